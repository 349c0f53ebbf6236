"""`jaxformer serve` (a subprocess on a free loopback port) under faults, over raw
sockets: clients that go before their answer or send less body than they announced
(one at a time, or as a slowloris crowd) are one log line each and counted as client
disconnects, not 500s; SIGTERM past the drain timeout ends the open answers with an
error (whole SSE events, an error event, [DONE]), not cut mid-chunk.

The model is a tiny byte-level LM whose output bias always picks "a" (never EOS), so
an answer lasts until max_tokens: long enough to disconnect from, or to outlast the
drain timeout.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import jax
import jax.numpy as jnp
import pytest

import jaxformer as jf
from jaxformer.text import ByteTokenizer
from tests.serve.server_fixture import free_port
from tests.serve.test_serve_cli import REPO, write_run

pytest.importorskip("uvicorn", reason="needs the `serve` extra")

MAX_LEN = 8192       # an answer of thousands of tokens: seconds, beyond the drain timeout
DRAIN_TIMEOUT = 1    # --drain-timeout, seconds
SLOWLORIS = 20       # half-open connections


@pytest.fixture(scope="module")
def endless_run(tmp_path_factory):
    """A run of a tiny byte-level LM that always picks "a"."""
    config = jf.tiny(src_vocab_size=259, tgt_vocab_size=259, max_len=MAX_LEN, norm="pre",
                     num_encoder_layers=0)
    params = jf.DecoderOnlyLM(config).init(jax.random.key(0), jnp.ones((1, 4), jnp.int32))
    params = params["params"]
    bias = params["decoder"]["out_proj"]["bias"]
    a = int(ByteTokenizer().encode("a")[0])
    params["decoder"]["out_proj"]["bias"] = bias.at[a].set(50.0)
    return write_run(str(tmp_path_factory.mktemp("runs") / "endless"), config, params)


@pytest.fixture(scope="module")
def server(endless_run, tmp_path_factory):
    """(process, base URL, its stderr's path) of `jaxformer serve --drain-timeout 1`."""
    port = free_port()
    log = str(tmp_path_factory.mktemp("log") / "stderr.txt")
    with open(log, "w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "jaxformer", "serve", "--model", endless_run, "--name",
             "endless", "--port", str(port), "--slots", "2", "--page-size", "16",
             "--drain-timeout", str(DRAIN_TIMEOUT)],
            stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=REPO,
            env={**os.environ, "PYTHONPATH": REPO})
    line = process.stdout.readline()
    if not line.startswith("serving endless on http://127.0.0.1:"):
        process.kill()
        raise RuntimeError(f"the server did not start: {line}{open(log).read()}")
    yield process, f"http://127.0.0.1:{port}", log
    if process.poll() is None:
        process.kill()
        process.wait()


def metrics(url) -> dict:
    """/metrics' samples, {name{labels}: value}."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        return {name: float(value) for name, value in (
            line.rsplit(" ", 1) for line in response.read().decode().splitlines()
            if not line.startswith("#"))}


def wait_for(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def connect(url) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def post_head(length: int) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json"
            b"\r\nContent-Length: %d\r\n\r\n" % length)


def completion(max_tokens: int, **fields) -> bytes:
    return json.dumps({"prompt": "hi", "max_tokens": max_tokens, **fields}).encode()


def ok_completion(url) -> int:
    """The status of a small normal request."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", completion(4),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert json.loads(response.read())["choices"][0]["text"] == "aaaa"
    conn.close()
    return response.status


DISCONNECTS = 'jaxformer_client_disconnects_total{route="/v1/completions"}'


def test_client_faults_are_one_log_line_each_and_counted_as_disconnects(server):
    """A client gone before its whole answer, a body shorter than its Content-Length,
    a slowloris crowd of half-sent bodies: each one line (no traceback), counted as a
    client disconnect and not as a 500; normal requests are answered meanwhile."""
    _, url, log = server
    assert ok_completion(url) == 200  # compiled, and a first line of metrics
    logged, before = len(open(log).read().splitlines()), metrics(url).get(DISCONNECTS, 0)

    early = connect(url)  # gone while its answer is generated
    body = completion(MAX_LEN - 8)
    early.sendall(post_head(len(body)) + body)
    wait_for(lambda: metrics(url)["jaxformer_running_requests"] == 1, "the request to run")
    early.close()

    short = connect(url)  # announces 50 bytes it never sends
    short.sendall(post_head(len(body) + 50) + body)
    crowd = [connect(url) for _ in range(SLOWLORIS)]
    for sock in crowd:
        sock.sendall(post_head(len(body)) + body[:10])
    time.sleep(0.2)  # all of them half-sent, waited for by the server
    assert ok_completion(url) == 200
    for sock in [short, *crowd]:
        sock.close()

    faults = 2 + SLOWLORIS
    wait_for(lambda: metrics(url).get(DISCONNECTS, 0) == before + faults, "the disconnects")
    after = metrics(url)
    assert not [name for name in after if 'code="5' in name], after
    lines = open(log).read().splitlines()[logged:]
    assert len(lines) == faults and all("disconnected before the whole answer" in line
                                        for line in lines), lines
    assert "Traceback" not in open(log).read()
    assert ok_completion(url) == 200
    wait_for(lambda: metrics(url)["jaxformer_running_requests"] == 0, "nothing running")


def test_sigterm_past_the_drain_timeout_ends_open_answers_with_an_error(server):
    """Last in this file: it stops the module's server. A stream and a whole answer
    outlast --drain-timeout: then the stream ends after whole events with an error
    event and [DONE] (not cut mid-chunk), the whole answer is a 503 error body; the
    process exits 0 without a traceback or uvicorn cancelling anything."""
    from jaxformer.serve.server import END_GRACE_S  # noqa: PLC0415

    process, url, log = server
    host, port = url.removeprefix("http://").split(":")
    streamed = http.client.HTTPConnection(host, int(port), timeout=60)
    streamed.request("POST", "/v1/completions", completion(MAX_LEN - 8, stream=True),
                     {"Content-Type": "application/json"})
    stream = streamed.getresponse()
    assert stream.status == 200
    first = b"".join(stream.readline() for _ in range(4))  # two events: data line, blank
    whole = {}

    def await_whole():
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", "/v1/completions", completion(MAX_LEN - 8),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        whole.update(status=response.status, body=json.loads(response.read()))

    waiter = threading.Thread(target=await_whole)
    waiter.start()
    wait_for(lambda: metrics(url)["jaxformer_running_requests"] == 2, "both to run")
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    rest = stream.read()  # http.client.IncompleteRead if a chunk is cut
    waiter.join(60)
    assert process.wait(60) == 0
    assert DRAIN_TIMEOUT <= time.monotonic() - signalled < DRAIN_TIMEOUT + END_GRACE_S + 30

    events = (first + rest).decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""], events[-3:]
    assert all(event.startswith("data: ") for event in events[:-1]), events
    bodies = [json.loads(event.removeprefix("data: ")) for event in events[:-2]]
    error = bodies[-1]["error"]
    assert (error["type"], error["code"]) == ("server_error", "shutting_down"), error
    assert "drain timeout" in error["message"]
    choices = [body["choices"][0] for body in bodies[:-1]]
    assert len(choices) >= 2 and {c["text"] for c in choices} == {"a"}
    assert all(c["finish_reason"] is None for c in choices)  # cut, not finished
    assert whole["status"] == 503 and whole["body"]["error"]["code"] == "shutting_down"
    stderr = open(log).read()
    assert "Traceback" not in stderr and "graceful shutdown exceeded" not in stderr, stderr

"""`jaxformer serve` as a user starts it: a subprocess on a free loopback port serving a
tiny byte-level run with a LoRA fine-tune of it beside (`--lora`), the official
`openai` client, SIGTERM draining the stream in flight; and its one-line refusals.

The runs are written directly (Run.create + one checkpoint): a base LM and the same
model with rank-4 LoRA adapters whose B is random (an untrained B is zero and would
change nothing), so the adapter's outputs must differ from the base's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request

import jax
import jax.numpy as jnp
import pytest

import jaxformer as jf
from jaxformer.cli.main import main
from tests.serve.server_fixture import free_port

openai = pytest.importorskip("openai", reason="needs the `test` extra (the openai client)")
pytest.importorskip("uvicorn", reason="needs the `serve` extra")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write_run(directory, config, params):
    from jaxformer.train import TrainConfig  # noqa: PLC0415
    from jaxformer.train.checkpoint import Checkpoints  # noqa: PLC0415
    from jaxformer.train.run import Run  # noqa: PLC0415

    Run.create(directory, config, TrainConfig(task="lm", data=("corpus.txt",)))
    with Checkpoints(os.path.join(directory, "checkpoints")) as checkpoints:
        checkpoints.save(1, {"params": params})
    return directory


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(base run, LoRA run) directories of a tiny byte-level LM."""
    from jaxformer.nn import lora  # noqa: PLC0415

    base_config = jf.tiny(src_vocab_size=259, tgt_vocab_size=259, max_len=128, norm="pre",
                          num_encoder_layers=0)
    config = base_config.replace(lora_rank=4)
    params = jf.DecoderOnlyLM(config).init(jax.random.key(0), jnp.ones((1, 4), jnp.int32))
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: jax.random.normal(jax.random.key(len(str(path))), x.shape) * 0.5
        if lora.is_adapter_path(path) and str(path[-1].key) == "b" else x, params["params"])
    folder = tmp_path_factory.mktemp("runs")
    return (write_run(str(folder / "base"), base_config, lora.split_adapters(params)[1]),
            write_run(str(folder / "tuned"), config, params))


@pytest.fixture(scope="module")
def server(runs):
    """(process, base URL) of `jaxformer serve --model BASE --lora tuned=TUNED --warm-up
    --scan-layers --cpu-tuning` (the layers scanned, the process tuned: the LoRA test
    below checks its tokens against an untuned `generate --run`)."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "jaxformer", "serve", "--model", runs[0], "--name", "base",
         "--lora", f"tuned={runs[1]}", "--port", str(port), "--max-len", "128", "--slots", "2",
         "--page-size", "8", "--drain-timeout", "60", "--warm-up", "--scan-layers",
         "--cpu-tuning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO})
    line = process.stdout.readline()
    if not (line.startswith("serving base on http://127.0.0.1:")
            and line.rstrip().endswith("(weights: float32; CPU tuning on)")):
        process.kill()
        raise RuntimeError(f"the server did not start: {line}{process.stderr.read()}")
    yield process, f"http://127.0.0.1:{port}"
    if process.poll() is None:
        process.kill()
        process.wait()


def generate_run(run_dir, prompt, n, capsys):
    capsys.readouterr()
    assert main(["generate", "--run", run_dir, "--json", "--temperature", "0",
                 "--max-new-tokens", str(n), prompt]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_lora_request_equals_generate_run(server, runs, capsys):
    client = openai.OpenAI(base_url=server[1] + "/v1", api_key="x", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["base", "tuned"]
    for model, run in (("tuned", runs[1]), ("base", runs[0])):
        want = generate_run(run, "hello", 12, capsys)
        got = client.completions.create(model=model, prompt="hello", max_tokens=12,
                                        temperature=0)
        assert got.choices[0].text == want["text"], model
    tuned = client.completions.create(model="tuned", prompt="hello", max_tokens=12,
                                      temperature=0).choices[0].text
    base = client.completions.create(model="base", prompt="hello", max_tokens=12,
                                     temperature=0).choices[0].text
    assert tuned != base  # the adapter is applied, not the base twice


def test_prompt_beyond_the_context_is_400(server):
    client = openai.OpenAI(base_url=server[1] + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model="base", prompt=[[3] * 129], max_tokens=1)
    assert raised.value.body["param"] == "prompt"
    assert "maximum context length is 128" in raised.value.body["message"]


@pytest.mark.parametrize("flags, message", [
    (["--lora", "x={base}", "--lora", "x={base}"], "--lora: a name given twice"),
    (["--lora", "x={missing}"], "is not a directory"),
    (["--lora", "x={tmp}"], "not a run directory"),
    (["--max-len", "500"], "longer than the model's context of 128"),
    (["--port", "0"], "--port: must be a positive integer"),
], ids=["twice", "missing", "not-a-run", "max-len", "port-0"])
def test_bad_flags_are_one_line_exit_2(runs, tmp_path, capsys, flags, message):
    values = {"base": runs[0], "missing": str(tmp_path / "nope"), "tmp": str(tmp_path)}
    code = main(["serve", "--model", runs[0], *[f.format(**values) for f in flags]])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_a_port_in_use_is_refused_before_the_model_loads(server, runs, capsys):
    port = server[1].rsplit(":", 1)[1]
    assert main(["serve", "--model", runs[0], "--port", port]) == 2
    assert "cannot listen there" in capsys.readouterr().err


def test_sigterm_drains_the_stream_in_flight_and_exits_0(server):
    """Last in this file: it stops the module's server."""
    process, url = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    stream = client.completions.create(model="base", prompt="hello", max_tokens=120,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks, first = [], threading.Event()

    def read():
        for chunk in stream:
            chunks.append(chunk)
            first.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert first.wait(60)
    process.send_signal(signal.SIGTERM)
    at_signal = len(chunks)
    reader.join(60)
    assert process.wait(60) == 0
    # The whole answer came after the signal, its usage chunk last: drained, not cut.
    assert at_signal < len(chunks) and chunks[-1].usage is not None, (at_signal, len(chunks))
    assert chunks[-2].choices[0].finish_reason in ("length", "stop")
    with pytest.raises(OSError):  # no longer listening
        urllib.request.urlopen(url + "/health", timeout=5)
    assert "Traceback" not in process.stderr.read()


TINY = jf.tiny(num_encoder_layers=0, num_decoder_layers=2)


@pytest.mark.parametrize("flags, config, scanned", [
    ([], TINY, False), ([], TINY.replace(weight_quant="int8"), True),
    (["--no-scan-layers"], TINY.replace(weight_quant="int8"), False),
    (["--scan-layers"], TINY, True),
    ([], TINY.replace(weight_quant="int8_block", quant_layouts=(("decoder/layers_1/ffn/wo",
                                                                  "int4"),)), False),
    ([], TINY.replace(weight_quant="int4", attention_pattern="LG",
                      sliding_window=4), False)],
    ids=["float", "quantized", "no-scan", "scan", "mixed-layouts", "mixed-layers"])
def test_layers_are_scanned_by_default_with_quantized_weights(flags, config, scanned):
    """--scan-layers: as given; unset, scanned exactly when the layer kernels are
    quantized and alike (the engine scans nothing else)."""
    from jaxformer.cli.main import build_parser  # noqa: PLC0415
    from jaxformer.cli.serve import scan_layers  # noqa: PLC0415

    args = build_parser().parse_args(["serve", "--model", "m.gguf"] + flags)
    assert scan_layers(args, config) is scanned

"""The HTTP layer over a scripted engine (tests/serve/fake_engine.py): OpenAI's bodies
as the official `openai` client reads them, errors, auth, SSE framing, disconnects.
The real engine behind the same app: tests/serve/test_serve_model.py."""

from __future__ import annotations

import http.client
import json
import time
import urllib.request

import pytest

from tests.serve.server_fixture import post, running
from tests.serve.fake_engine import BYTES, FAIL_TEXT, FakeEngine

openai = pytest.importorskip("openai", reason="needs the `test` extra (the openai client)")
pytest.importorskip("starlette", reason="needs the `serve` extra")

from jaxformer.serve import schemas  # noqa: E402
from jaxformer.serve.http import ServedModel, create_app  # noqa: E402

REPLY = "Hello, world! The end."
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
KEY = "sekret"


def served(engine, **kw):
    return ServedModel(engine, BYTES, name="fake", max_len=64, adapters=("tuned",),
                       chat_template=TEMPLATE, **kw)


def constraint_of(response_format):
    """`make_constraint` stand-in: the format itself (the fake engine ignores it)."""
    return {"compiled": response_format}


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine(REPLY, slots=2, max_queue=2)
    with running(create_app(served(engine, make_constraint=constraint_of))) as url:
        yield engine, url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0)


def test_models_lists_base_and_adapters(client):
    assert [m.id for m in client.models.list().data] == ["fake", "tuned"]


def test_completion_text_usage_and_finish(server, client):
    engine, _ = server
    out = client.completions.create(model="fake", prompt="Hi", max_tokens=5, temperature=0)
    assert out.choices[0].text == REPLY[:5] and out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (3, 5)  # BOS + "Hi"
    assert engine.requests[-1].prompt_ids == [1, ord("H") + 3, ord("i") + 3]
    full = client.completions.create(model="fake", prompt="Hi", max_tokens=40, temperature=0)
    assert full.choices[0].text == REPLY and full.choices[0].finish_reason == "stop"
    assert full.usage.completion_tokens == len(REPLY) + 1  # the EOS counts (llama-server's)


def test_prompt_shapes_one_choice_each(server, client):
    engine, _ = server
    out = client.completions.create(model="fake", prompt=[[1, 75], [1, 76, 77]], max_tokens=2,
                                    temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    assert [r.prompt_ids for r in engine.requests[-2:]] == [[1, 75], [1, 76, 77]]
    assert out.usage.prompt_tokens == 5


def test_stop_strings_reach_the_engine(server, client):
    engine, _ = server
    client.completions.create(model="fake", prompt="Hi", max_tokens=2, stop=["\n", "END"])
    assert engine.requests[-1].params.stop == ("\n", "END")


def test_echo_logprobs_as_lm_eval_reads_them(client):
    """lm-eval's local-completions loglikelihood request: max_tokens 1, echo, logprobs 1;
    it sums token_logprobs[ctxlen:-1] and checks each against max(top_logprobs)."""
    prompt = [1, 75, 76, 77]
    out = client.completions.create(model="fake", prompt=[prompt], max_tokens=1,
                                    temperature=0, logprobs=1, echo=True, seed=1234)
    lp = out.choices[0].logprobs
    assert lp.token_logprobs == [None, -1.0, -1.0, -1.0, -0.5]
    assert lp.top_logprobs[0] is None and lp.top_logprobs[1] == {"H": -1.0}
    assert lp.tokens == [""] + [BYTES.decode([i]) for i in prompt[1:]] + ["H"]
    assert out.choices[0].text == "".join(lp.tokens) == "HIJH"
    assert lp.text_offset == [0, 0, 1, 2, 3]
    # max_tokens 0: the prompt's logprobs only (vLLM's extension, also used by harnesses)
    only = client.completions.create(model="fake", prompt=[prompt], max_tokens=0,
                                     temperature=0, logprobs=1, echo=True)
    assert only.choices[0].logprobs.token_logprobs == [None, -1.0, -1.0, -1.0]
    assert only.choices[0].text == "HIJ" and only.usage.completion_tokens == 0


def test_generated_logprobs_and_top(client):
    out = client.completions.create(model="fake", prompt="x", max_tokens=3, temperature=0,
                                    logprobs=2)
    lp = out.choices[0].logprobs
    assert lp.tokens == ["H", "e", "l"] and lp.token_logprobs == [-0.5] * 3
    assert lp.top_logprobs[0] == {"H": -0.5, "I": -1.5}


def test_chat_uses_the_template(server, client):
    engine, _ = server
    out = client.chat.completions.create(model="fake", max_tokens=5, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert out.choices[0].message.content == REPLY[:5]
    assert out.choices[0].message.role == "assistant"
    assert BYTES.decode(engine.requests[-1].prompt_ids) == "<system>Be brief.\n<user>Hi\n<assistant>"
    assert engine.requests[-1].adapter is None


def test_chat_stream_and_logprobs(client):
    chunks = list(client.chat.completions.create(
        model="tuned", max_tokens=40, temperature=0, stream=True, logprobs=True, top_logprobs=1,
        messages=[{"role": "user", "content": "Hi"}], stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == REPLY
    finished = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finished[-1] == "stop" and set(finished[:-1]) == {None}
    # the EOS that ended it counts, as llama-server counts it (n_decoded)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(REPLY) + 1
    content = [t for c in chunks if c.choices and c.choices[0].logprobs
               for t in c.choices[0].logprobs.content]
    assert content[0].token == "H" and content[0].top_logprobs[0].logprob == -0.5


def test_adapter_is_chosen_by_model(server, client):
    engine, _ = server
    client.completions.create(model="tuned", prompt="Hi", max_tokens=1)
    assert engine.requests[-1].adapter == "tuned"


def test_sse_framing_raw(server):
    engine, url = server
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(
        {"prompt": "Hi", "max_tokens": 3, "stream": True, "temperature": 0}),
        {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    assert response.getheader("content-type").startswith("text/event-stream")
    events = response.read().decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    bodies = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-2])
    assert "".join(b["choices"][0]["text"] for b in bodies) == "Hel"
    assert bodies[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("body, param", [
    ({"prompt": "Hi", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "Hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "Hi", "top_p": 0}, "top_p"),
    ({"prompt": "Hi", "logprobs": 99}, "logprobs"),
    ({"prompt": "Hi", "n": 3}, "n"),
    ({"prompt": "Hi", "stop": [""]}, "stop"),
    ({"prompt": [[1, -5]]}, "prompt"),
    ({"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "x" * 64}, "prompt"),                 # beyond the 64-token context
    ({"prompt": [[1, 999]]}, "prompt"),               # an id beyond the vocabulary
], ids=["negative-max", "string-temperature", "top-p-0", "logprobs-99", "n-3", "empty-stop",
        "negative-id", "max-0-no-echo", "no-prompt", "too-long", "id-beyond-vocab"])
def test_malformed_completion_is_400_naming_the_field(server, body, param):
    engine, url = server
    submitted = len(engine.requests)
    status, _, error = post(url, "/v1/completions", body)
    assert status == 400, error
    assert error["error"]["param"] == param and error["error"]["type"] == "invalid_request_error"
    assert set(error["error"]) == {"message", "type", "param", "code"}
    assert len(engine.requests) == submitted  # refused before the engine saw anything


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}},
     "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
], ids=["no-messages", "bad-role", "image-part", "bad-format", "top-without-logprobs"])
def test_malformed_chat_is_400_naming_the_field(server, body, param):
    status, _, error = post(server[1], "/v1/chat/completions", body)
    assert status == 400 and error["error"]["param"] == param, error


def nested_any_of(depth: int) -> dict:
    schema = {"type": "integer"}
    for _ in range(depth):
        schema = {"anyOf": [schema]}
    return schema


@pytest.mark.parametrize("schema, message", [
    ({"type": "integer", "minimum": "ten"},
     "schema.minimum is invalid: 'ten' is not of type 'number'"),
    ({"type": "object", "required": 5}, "schema.required is invalid: 5 is not of type 'array'"),
    ({"type": "string", "maxLength": -3},
     "schema.maxLength is invalid: -3 is less than the minimum of 0"),
    ({"type": "object", "properties": {"age": {"type": "integer", "minimum": "ten"}}},
     "schema.properties.age.minimum is invalid"),
    (nested_any_of(200), "schema is nested too deeply to check"),
], ids=["minimum-string", "required-int", "negative-max-length", "nested", "too-deep"])
def test_an_invalid_json_schema_is_400_naming_the_keyword(server, client, schema, message):
    """A keyword its metaschema refuses is named, not ignored by the constraint (which
    would then constrain nothing), and refused before the engine sees the request."""
    engine, _ = server
    submitted = len(engine.requests)
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "bad", "schema": schema}})
    error = raised.value.body
    assert error["param"] == "response_format", error
    assert error["message"].startswith("response_format.json_schema.schema"), error
    assert message in error["message"] and "\n" not in error["message"], error
    assert len(engine.requests) == submitted


def test_a_valid_json_schema_reaches_the_constraint(server, client):
    engine, _ = server
    schema = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0},
                                               "name": {"type": "string", "maxLength": 8}},
              "required": ["age"]}
    client.chat.completions.create(
        model="fake", max_tokens=2, messages=[{"role": "user", "content": "x"}],
        response_format={"type": "json_schema", "json_schema": {"name": "ok", "schema": schema}})
    assert engine.requests[-1].constraint == {"compiled": {"type": "json_schema",
                                                           "schema": schema}}


def test_not_json_unknown_model(server):
    status, _, error = post(server[1], "/v1/completions", b"{not json")
    assert status == 400 and "not valid JSON" in error["error"]["message"]
    status, _, error = post(server[1], "/v1/completions", b"[" * 5000 + b"]" * 5000)
    assert status == 400 and "nested too deeply" in error["error"]["message"]
    status, _, error = post(server[1], "/v1/completions", {"prompt": "x", "model": "gpt-9"})
    assert status == 404 and error["error"]["code"] == "model_not_found"


def test_engine_error_is_500_and_the_server_goes_on(server, client):
    status, _, error = post(server[1], "/v1/completions", {"prompt": FAIL_TEXT})
    assert status == 500 and error["error"]["type"] == "server_error"
    stream = client.completions.create(model="fake", prompt=FAIL_TEXT, stream=True)
    with pytest.raises(openai.APIError):
        list(stream)
    assert client.completions.create(model="fake", prompt="Hi", max_tokens=2).choices[0].text


def test_metrics_prometheus_text(server, client):
    client.completions.create(model="fake", prompt="Hi", max_tokens=1)
    with urllib.request.urlopen(server[1] + "/metrics", timeout=30) as response:
        assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
        text = response.read().decode()
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert lines["jaxformer_kv_total_pages"] == "64"
    assert lines["jaxformer_prefix_cache_hit_rate"] == "0.25"
    assert lines["jaxformer_generation_tokens_per_second"] == "12.5"
    assert "jaxformer_spec_decode_acceptance_rate" not in lines  # not measured: left out
    assert int(lines['jaxformer_http_requests_total{route="/v1/completions",code="200"}']) >= 1
    with urllib.request.urlopen(server[1] + "/health", timeout=30) as response:
        assert json.loads(response.read()) == {"status": "ok"}


def scrape(url) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        return response.read().decode()


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole-answer"])
def test_disconnect_cancels_the_request(stream):
    """The engine stalls after two tokens (nothing more is sent): the disconnect itself
    must cancel the request, not a later failed write; /metrics counts it as a client
    disconnect, not as a 500."""
    engine = FakeEngine("x" * 200, stall_after=2)
    with running(create_app(served(engine))) as url:
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("POST", "/v1/completions", json.dumps(
            {"prompt": "Hi", "max_tokens": 50, "stream": stream}),
            {"Content-Type": "application/json"})
        if stream:
            conn.getresponse().fp.readline()  # the first event arrived
        else:
            while not engine.live:
                time.sleep(0.01)
        time.sleep(0.1)
        assert len(engine.live) == 1  # running, stalled
        conn.sock.close()
        conn.close()
        deadline = time.monotonic() + 5
        while engine.live and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.live == [], "the handle of a disconnected client was not cancelled"
        counted = 'jaxformer_client_disconnects_total{route="/v1/completions"} 1'
        while counted not in scrape(url) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert counted in scrape(url) and 'code="5' not in scrape(url)


def test_queue_full_is_429_with_retry_after():
    engine = FakeEngine("x" * 200, slots=1, max_queue=1, delay=0.05)
    with running(create_app(served(engine))) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        streams = [client.completions.create(model="fake", prompt="Hi", max_tokens=100,
                                             stream=True) for _ in range(2)]
        status, headers, error = post(url, "/v1/completions", {"prompt": "Hi"})
        assert status == 429 and headers["Retry-After"] == "1"
        assert error["error"]["type"] == "rate_limit_error"
        for stream in streams:
            stream.close()


def test_api_key_is_required_on_v1_routes():
    engine = FakeEngine()
    with running(create_app(served(engine), api_key=KEY)) as url:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            status, _, error = post(url, "/v1/completions", {"prompt": "Hi"}, headers)
            assert status == 401 and error["error"]["code"] == "invalid_api_key"
        assert engine.requests == []
        good = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        assert good.completions.create(model="fake", prompt="Hi", max_tokens=2).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
        with urllib.request.urlopen(url + "/health", timeout=30) as response:
            assert response.status == 200  # health checks need no key
    assert engine.started and engine.stopped  # the app's lifespan ran the engine


CHAT = {"messages": [{"role": "user", "content": "Hi"}]}

# Each applied field, a value and what the engine's Request must then hold.
COMPLETION_APPLIED = {
    "max_tokens": (3, lambda r: r.params.max_tokens == 3),
    "temperature": (0.5, lambda r: r.params.temperature == 0.5),
    "top_p": (0.25, lambda r: r.params.top_p == 0.25),
    "top_k": (7, lambda r: r.params.top_k == 7),
    "min_p": (0.125, lambda r: r.params.min_p == 0.125),
    "seed": (42, lambda r: r.params.seed == 42),
    "stop": ("END", lambda r: r.params.stop == ("END",)),
    "logprobs": (2, lambda r: r.params.logprobs == 2),
    "echo": (True, lambda r: r.params.echo),
    "model": ("tuned", lambda r: r.adapter == "tuned"),
    "prompt": ([1, 80, 81], lambda r: r.prompt_ids == [1, 80, 81]),
}
CHAT_APPLIED = {
    **{name: COMPLETION_APPLIED[name] for name in
       ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "model")},
    "max_completion_tokens": (4, lambda r: r.params.max_tokens == 4),
    "logprobs": (True, lambda r: r.params.logprobs == 0),
    "messages": ([{"role": "user", "content": "Yo"}],
                 lambda r: BYTES.decode(r.prompt_ids) == "<user>Yo\n<assistant>"),
    "response_format": ({"type": "regex", "regex": "a+"},
                        lambda r: r.constraint == {"compiled": {"type": "regex",
                                                                "regex": "a+"}}),
}
# Applied fields whose effect is on the response, tested above by name.
APPLIED_ELSEWHERE = {
    "stream": "test_sse_framing_raw, test_chat_stream_and_logprobs",
    "stream_options": "test_chat_stream_and_logprobs (include_usage)",
    "top_logprobs": "test_chat_stream_and_logprobs",
}


def test_every_applied_field_has_a_test():
    """A field added to the schema needs a row above (or a named test)."""
    assert set(COMPLETION_APPLIED) | {"stream", "stream_options"} == schemas.COMPLETION_FIELDS
    assert set(CHAT_APPLIED) | set(APPLIED_ELSEWHERE) == schemas.CHAT_FIELDS


@pytest.mark.parametrize("field", sorted(COMPLETION_APPLIED))
def test_each_completion_field_reaches_the_engine(server, field):
    engine, url = server
    value, holds = COMPLETION_APPLIED[field]
    status, _, out = post(url, "/v1/completions", {"prompt": "Hi", field: value})
    assert status == 200, out
    assert holds(engine.requests[-1]), engine.requests[-1]


@pytest.mark.parametrize("field", sorted(CHAT_APPLIED))
def test_each_chat_field_reaches_the_engine(server, field):
    engine, url = server
    value, holds = CHAT_APPLIED[field]
    status, _, out = post(url, "/v1/chat/completions", {**CHAT, field: value})
    assert status == 200, out
    assert holds(engine.requests[-1]), engine.requests[-1]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "Hi", "repetition_penalty": 1.1}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "Hi", "tools": []}, "tools"),          # a chat field
    ("/v1/completions", {"prompt": "Hi", "presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "Hi", "frequency_penalty": -1}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"5": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "Hi", "best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": "Hi", "suffix": "x"}, "suffix"),
    ("/v1/completions", {"prompt": "Hi", "n": True}, "n"),
    ("/v1/completions", {"prompt": "Hi", "stream": True,
                         "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    ("/v1/chat/completions", {**CHAT, "echo": True}, "echo"),          # a completions field
    ("/v1/chat/completions", {**CHAT, "n": 2}, "n"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, "tools"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "auto"}, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "function_call": "auto"}, "function_call"),
    ("/v1/chat/completions", {**CHAT, "presence_penalty": 1}, "presence_penalty"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "name": "bo"}]},
     "messages[0].name"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 3, "max_completion_tokens": 4},
     "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "user": 7}, "user"),
])
def test_unimplemented_fields_are_refused_by_name(server, path, body, param):
    engine, url = server
    submitted = len(engine.requests)
    status, _, error = post(url, path, body)
    assert status == 400 and error["error"]["param"] == param, error
    assert param.split(".")[-1] in error["error"]["message"]
    assert len(engine.requests) == submitted


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Hi", "n": 1, "best_of": 1, "presence_penalty": 0,
                         "frequency_penalty": 0.0, "logit_bias": {}, "suffix": "",
                         "user": "u1", "metadata": {"k": "v"}, "repetition_penalty": None}),
    ("/v1/chat/completions", {**CHAT, "n": 1, "tools": [], "tool_choice": "none",
                              "logit_bias": {}, "user": "u1", "store": None,
                              "max_tokens": 4, "max_completion_tokens": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "x",
                                            "refusal": None, "tool_calls": None}]}),
], ids=["completion", "chat", "echoed-assistant-message"])
def test_neutral_values_labels_and_nulls_are_accepted(server, path, body):
    status, _, out = post(server[1], path, body)
    assert status == 200, out


VOCAB = BYTES.vocab_size


@pytest.mark.parametrize("field, value, allowed", [
    ("top_k", 10 ** 12, f"[-1, {VOCAB}]"),       # overflowed the engine's int32 (issue 65)
    ("top_k", VOCAB + 1, f"[-1, {VOCAB}]"),
    ("top_k", -2, f"[-1, {VOCAB}]"),
    ("temperature", 2.5, "[1e-05, 2]"),
    ("temperature", 1e-30, "[1e-05, 2]"),          # logits / t overflow float32
    ("top_p", 1.5, "(0, 1]"),
    ("min_p", 1.5, "[0, 1]"),
    ("min_p", -0.1, "[0, 1]"),
    ("seed", 2 ** 64, "[-2**63, 2**64)"),
    ("seed", -2 ** 63 - 1, "[-2**63, 2**64)"),
    ("logprobs", 21, "[0, 20]"),
    ("max_tokens", -1, ">= 0"),
])
def test_out_of_range_numbers_are_400_with_the_range(server, field, value, allowed):
    engine, url = server
    submitted = len(engine.requests)
    status, _, error = post(url, "/v1/completions", {"prompt": "Hi", field: value})
    assert status == 400 and error["error"]["param"] == field, error
    assert allowed in error["error"]["message"], error
    assert len(engine.requests) == submitted


@pytest.mark.parametrize("field, value, allowed", [
    ("top_k", 10 ** 12, f"[-1, {VOCAB}]"),
    ("min_p", 2, "[0, 1]"),
    ("top_logprobs", 21, "[0, 20]"),
    ("max_tokens", 0, ">= 1"),
    ("max_completion_tokens", 0, ">= 1"),
])
def test_out_of_range_chat_numbers_are_400_with_the_range(server, field, value, allowed):
    status, _, error = post(server[1], "/v1/chat/completions",
                            {**CHAT, "logprobs": True, field: value})
    assert status == 400 and error["error"]["param"] == field, error
    assert allowed in error["error"]["message"], error


def test_edge_values_are_accepted(server):
    engine, url = server
    for field, value in (("top_k", VOCAB), ("top_k", -1), ("temperature", 1e-5),
                         ("min_p", 0), ("min_p", 1), ("seed", -2 ** 63)):
        status, _, out = post(url, "/v1/completions", {"prompt": "Hi", field: value})
        assert status == 200, (field, value, out)
    assert engine.requests[-1].params.seed == (-2 ** 63) % 2 ** 32


def test_an_unknown_route_and_a_wrong_method_answer_openai_error_bodies(server):
    """The router's 404 and 405 are JSON error bodies as OpenAI's (clients parse them),
    not plain text; the server stays up."""
    _, url = server
    status, _, body = post(url, "/v1/embeddingz", {"input": "x"})
    assert status == 404 and body["error"]["code"] == "not_found"
    assert "/v1/embeddingz" in body["error"]["message"]
    request = urllib.request.Request(url + "/v1/completions", method="GET")
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(request, timeout=30)
    error = json.loads(raised.value.read())
    assert raised.value.code == 405 and error["error"]["code"] == "method_not_allowed"
    assert "GET" in error["error"]["message"] and "POST" in raised.value.headers["allow"]
    status, _, _ = post(url, "/v1/completions", {"model": "fake", "prompt": "Hi",
                                                 "max_tokens": 2})
    assert status == 200

"""The OpenAI request bodies the server takes, checked field by field (no JAX here).

    body = parse_completion(json_dict, vocab_size=V)     # POST /v1/completions
    body = parse_chat(json_dict, vocab_size=V)           # POST /v1/chat/completions

Each parser returns a frozen dataclass or raises `ApiError` naming the first
field that is wrong (`param`), which the server sends as OpenAI's error body
with status 400, before any work. Every field is one of three kinds, never
silently ignored:

  applied (`COMPLETION_FIELDS`, `CHAT_FIELDS`): checked and passed to the engine;
  refused unless neutral (`COMPLETION_NEUTRAL`, `CHAT_NEUTRAL`): features the
    server does not implement (`n: 2`, `logit_bias: {...}`, `tools: [...]`);
  labels (`LABEL_FIELDS`: `user`, `metadata`): the caller's bookkeeping, which
    by definition changes no output.

Any other field (vLLM's `repetition_penalty`, a typo) is refused, as OpenAI
refuses an unrecognized argument; a null value counts as absent. The limits on
numbers are OpenAI's, narrowed to what the engine holds: top_k at most the
vocabulary, a temperature of 0 (greedy) or one whose scaled logits stay finite.
A `response_format` JSON schema must be valid against its metaschema (jsonschema,
the `structured` extra): a malformed keyword is refused by its path, not ignored.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional, Union

from jaxformer.serve.request import MIN_TEMPERATURE

# Largest top-n logprobs a request may ask for (OpenAI: 5 for completions, 20 for chat).
MAX_LOGPROBS = 20
# top_k's bound when the vocabulary is not known: the engine's int32 column.
MAX_TOP_K = 2 ** 31 - 1

# The fields each endpoint applies (module docstring).
SAMPLING_FIELDS = frozenset({"max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                             "stop", "stream", "stream_options"})
COMPLETION_FIELDS = SAMPLING_FIELDS | {"model", "prompt", "logprobs", "echo"}
CHAT_FIELDS = SAMPLING_FIELDS | {"model", "messages", "max_completion_tokens", "logprobs",
                                 "top_logprobs", "response_format"}
LABEL_FIELDS = frozenset({"user", "metadata"})
MESSAGE_FIELDS = frozenset({"role", "content"})


class ApiError(Exception):
    """An error the client caused (or a server state it must hear about), as an
    OpenAI error body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, message: str, param: Optional[str] = None, *, status: int = 400,
                 type: str = "invalid_request_error", code: Optional[str] = None,
                 headers: Optional[dict] = None):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status
        self.type, self.code, self.headers = type, code, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


@dataclasses.dataclass(frozen=True)
class Sampling:
    """The decoding fields both endpoints share, checked."""
    max_tokens: Optional[int]          # None: as many as the context leaves
    temperature: float
    top_p: Optional[float]
    top_k: Optional[int]
    min_p: float                       # 0: off
    seed: int
    stop: tuple[str, ...]
    logprobs: Optional[int]            # top-n per token; None = no logprobs
    stream: bool
    include_usage: bool                # stream_options.include_usage


@dataclasses.dataclass(frozen=True)
class CompletionBody:
    model: Optional[str]
    prompts: tuple[Union[str, tuple[int, ...]], ...]   # one choice each
    sampling: Sampling
    echo: bool


@dataclasses.dataclass(frozen=True)
class ChatBody:
    model: Optional[str]
    messages: tuple[dict, ...]         # {"role", "content": str}
    sampling: Sampling
    response_format: Optional[dict]    # {"type": "json_schema"|"json_object"|"regex", ...}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _get(body: dict, name: str, check, rule: str, default=None):
    """body[name] (absent or null: `default`), or ApiError naming `name`."""
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise ApiError(f"{name} must be {rule}, got {value!r}"[:300], name)
    return value


def _refuse_unless_neutral(body: dict, neutral: dict) -> None:
    for name, ok in neutral.items():
        if name in body and body[name] is not None and not ok(body[name]):
            raise ApiError(f"{name} is not supported by this server (got {body[name]!r})"[:300],
                           name)


def _refuse_unknown(fields: dict, known, where: str = "") -> None:
    """ApiError naming the first non-null field of `fields` not in `known`."""
    for name, value in fields.items():
        if value is not None and name not in known:
            raise ApiError(f"unrecognized request argument {where}{name}: this server does "
                           "not implement it"[:300], f"{where}{name}", code="unknown_field")


def _is_exactly(neutral) -> Callable:
    """A check that a value is `neutral` and of its type (`n: true` is not `n: 1`)."""
    return lambda v: type(v) is type(neutral) and v == neutral


COMPLETION_NEUTRAL = {
    "n": _is_exactly(1), "best_of": _is_exactly(1),
    "presence_penalty": lambda v: _is_number(v) and v == 0,
    "frequency_penalty": lambda v: _is_number(v) and v == 0,
    "logit_bias": _is_exactly({}), "suffix": _is_exactly(""),
}
CHAT_NEUTRAL = {
    "n": _is_exactly(1),
    "presence_penalty": COMPLETION_NEUTRAL["presence_penalty"],
    "frequency_penalty": COMPLETION_NEUTRAL["frequency_penalty"],
    "logit_bias": _is_exactly({}), "tools": _is_exactly([]), "functions": _is_exactly([]),
    "tool_choice": _is_exactly("none"), "function_call": _is_exactly("none"),
}


def _refuse_unapplied(body: dict, applied, neutral: dict) -> None:
    _refuse_unless_neutral(body, neutral)
    _refuse_unknown(body, applied | LABEL_FIELDS | set(neutral))
    _get(body, "user", lambda v: isinstance(v, str), "a string")
    _get(body, "metadata", lambda v: isinstance(v, dict), "an object")


def _require_object(body) -> dict:
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _model(body: dict) -> Optional[str]:
    return _get(body, "model", lambda v: isinstance(v, str), "a string")


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise ApiError(f"stop must be a non-empty string or a list of them, got {stop!r}"[:300],
                       "stop")
    return tuple(stop)


def _temperature(body: dict) -> float:
    return float(_get(body, "temperature",
                      lambda v: _is_number(v) and (v == 0 or MIN_TEMPERATURE <= v <= 2),
                      f"0 (greedy) or a number in [{MIN_TEMPERATURE}, 2]", 1.0))


def _include_usage(body: dict) -> bool:
    options = _get(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    _refuse_unknown(options, {"include_usage"}, "stream_options.")
    usage = options.get("include_usage", False)
    if not isinstance(usage, bool):
        raise ApiError(f"stream_options.include_usage must be true or false, got {usage!r}",
                       "stream_options")
    return usage


def _sampling(body: dict, *, max_tokens: Optional[int], logprobs: Optional[int],
              vocab_size: Optional[int]) -> Sampling:
    top_p = _get(body, "top_p", lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]")
    # top_k and min_p are vLLM's and llama.cpp's extensions; top_k 0 and -1 mean "off"
    # there too. top_k beyond the vocabulary keeps all (and would overflow the engine).
    most = MAX_TOP_K if vocab_size is None else vocab_size
    top_k = _get(body, "top_k", lambda v: _is_int(v) and -1 <= v <= most,
                 f"an integer in [-1, {most}] (0 and -1: off)")
    min_p = _get(body, "min_p", lambda v: _is_number(v) and 0 <= v <= 1, "a number in [0, 1]",
                 0.0)
    seed = _get(body, "seed", lambda v: _is_int(v) and -2 ** 63 <= v < 2 ** 64,
                "an integer in [-2**63, 2**64)", 0)
    stream = _get(body, "stream", lambda v: isinstance(v, bool), "true or false", False)
    usage = _include_usage(body)
    return Sampling(max_tokens=max_tokens, temperature=_temperature(body),
                    top_p=None if top_p is None or top_p == 1 else float(top_p),
                    top_k=None if top_k is None or top_k <= 0 else top_k,
                    min_p=float(min_p), seed=seed % 2 ** 32, stop=_stop(body),
                    logprobs=logprobs, stream=stream, include_usage=usage and stream)


def _prompts(prompt) -> tuple:
    """OpenAI's four prompt shapes: text, [text, ...], [id, ...], [[id, ...], ...]."""
    def ids(value) -> bool:
        return (isinstance(value, list) and bool(value)
                and all(_is_int(i) and i >= 0 for i in value))

    if isinstance(prompt, str):
        return (prompt,)
    if ids(prompt):
        return (tuple(prompt),)
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or ids(p) for p in prompt):
        return tuple(p if isinstance(p, str) else tuple(p) for p in prompt)
    raise ApiError("prompt must be a string, a list of strings, a list of token ids or a list "
                   "of lists of token ids (non-empty)", "prompt")


def parse_completion(body: Any, *, vocab_size: Optional[int] = None) -> CompletionBody:
    """A POST /v1/completions body (OpenAI's legacy completions, as lm-eval sends it);
    `vocab_size`: the model's, top_k's bound."""
    body = _require_object(body)
    _refuse_unapplied(body, COMPLETION_FIELDS, COMPLETION_NEUTRAL)
    if "prompt" not in body:
        raise ApiError("prompt is required", "prompt")
    prompts = _prompts(body["prompt"])
    max_tokens = _get(body, "max_tokens", lambda v: _is_int(v) and v >= 0,
                      "an integer >= 0", 16)
    logprobs = _get(body, "logprobs", lambda v: _is_int(v) and 0 <= v <= MAX_LOGPROBS,
                    f"an integer in [0, {MAX_LOGPROBS}]")
    echo = _get(body, "echo", lambda v: isinstance(v, bool), "true or false", False)
    if max_tokens == 0 and not echo:
        raise ApiError("max_tokens must be >= 1 unless echo is true (then 0 scores the "
                       "prompt only)", "max_tokens")
    sampling = _sampling(body, max_tokens=max_tokens, logprobs=logprobs, vocab_size=vocab_size)
    if echo and sampling.stream:
        raise ApiError("echo is not supported with stream", "echo")
    return CompletionBody(model=_model(body), prompts=prompts, sampling=sampling, echo=echo)


def _content(message: dict, index: int) -> str:
    """A message's content: a string, or a list of text parts joined."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise ApiError(f"messages[{index}].content: only text parts "
                               "({\"type\": \"text\", \"text\": ...}) are supported",
                               f"messages[{index}].content")
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(f"messages[{index}].content must be a string or a list of text parts",
                   f"messages[{index}].content")


ROLES = ("system", "developer", "user", "assistant", "tool")


def _messages(body: dict) -> tuple[dict, ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list of {\"role\", \"content\"} objects",
                       "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ApiError(f"messages[{i}] must be an object", f"messages[{i}]")
        _refuse_unknown(message, MESSAGE_FIELDS, f"messages[{i}].")  # a `name` would be lost
        role = message.get("role")
        if role not in ROLES:
            raise ApiError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got "
                           f"{role!r}"[:300], f"messages[{i}].role")
        out.append({"role": "system" if role == "developer" else role,
                    "content": _content(message, i)})
    return tuple(out)


def _check_json_schema(schema: dict, where: str) -> None:
    """ApiError naming the first keyword of `schema` its metaschema refuses (its `$schema`,
    else draft 2020-12): the constraint compiler would ignore a malformed keyword
    (`"minimum": "ten"`) and constrain nothing."""
    try:
        from jsonschema import Draft202012Validator, SchemaError  # noqa: PLC0415
        from jsonschema.validators import validator_for  # noqa: PLC0415
    except ImportError as error:
        raise ApiError(f"{where}: JSON schemas need jsonschema (pip install "
                       "'jaxformer[structured]')", "response_format") from error
    try:
        validator_for(schema, default=Draft202012Validator).check_schema(schema)
    except SchemaError as error:  # json_path: "$.properties.age.minimum"
        raise ApiError(f"{where}{error.json_path[1:]} is invalid: {error.message}"[:300],
                       "response_format") from error
    except RecursionError as error:
        raise ApiError(f"{where} is nested too deeply to check", "response_format") from error


def _response_format(body: dict) -> Optional[dict]:
    fmt = body.get("response_format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ApiError("response_format.json_schema.schema must be a JSON schema object",
                           "response_format")
        _check_json_schema(schema, "response_format.json_schema.schema")
        return {"type": "json_schema", "schema": schema}
    if kind == "regex":  # SGLang's and vLLM's extension
        if not isinstance(fmt.get("regex"), str):
            raise ApiError("response_format.regex must be a string", "response_format")
        return {"type": "regex", "regex": fmt["regex"]}
    raise ApiError("response_format.type must be text, json_object, json_schema or regex, got "
                   f"{kind!r}"[:300], "response_format")


def _chat_max_tokens(body: dict) -> Optional[int]:
    """max_completion_tokens (OpenAI's newer name) or max_tokens; both must agree."""
    given = [_get(body, name, lambda v: _is_int(v) and v >= 1, "an integer >= 1")
             for name in ("max_completion_tokens", "max_tokens")]
    if None not in given and given[0] != given[1]:
        raise ApiError(f"max_tokens ({given[1]}) and max_completion_tokens ({given[0]}) "
                       "disagree; send one", "max_tokens")
    return given[0] if given[0] is not None else given[1]


def parse_chat(body: Any, *, vocab_size: Optional[int] = None) -> ChatBody:
    """A POST /v1/chat/completions body; `vocab_size`: the model's, top_k's bound."""
    body = _require_object(body)
    _refuse_unapplied(body, CHAT_FIELDS, CHAT_NEUTRAL)
    messages = _messages(body)
    max_tokens = _chat_max_tokens(body)
    want = _get(body, "logprobs", lambda v: isinstance(v, bool), "true or false", False)
    top = _get(body, "top_logprobs", lambda v: _is_int(v) and 0 <= v <= MAX_LOGPROBS,
               f"an integer in [0, {MAX_LOGPROBS}]")
    if top is not None and not want:
        raise ApiError("top_logprobs needs logprobs: true", "top_logprobs")
    sampling = _sampling(body, max_tokens=max_tokens, logprobs=(top or 0) if want else None,
                         vocab_size=vocab_size)
    return ChatBody(model=_model(body), messages=messages, sampling=sampling,
                    response_format=_response_format(body))

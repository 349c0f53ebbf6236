"""OpenAI response bodies: completions, chat completions, their stream chunks and
logprobs, built from what a generation produced (no JAX here).

    completion_logprobs(tokenizer, entries, texts)      # {"tokens", "token_logprobs",
                                                        #  "top_logprobs", "text_offset"}
    chat_logprobs(tokenizer, entries)                   # {"content": [{"token", ...}]}
    sse(obj) / SSE_DONE                                 # server-sent event frames

An entry is (token id, logprob or None, ((id, logprob), ...) best first): a
`TokenEvent` without its finish reason. `completion_logprobs` is the shape
lm-evaluation-harness's `local-completions` reads: the i-th entries of the four
lists describe the i-th token; the first prompt token has no logprob (None, as
OpenAI sends it), and `top_logprobs[i]` maps token text to logprob.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Optional, Sequence

Entry = tuple  # (token id, logprob or None, top: ((id, logprob), ...))

SSE_DONE = b"data: [DONE]\n\n"


def sse(obj) -> bytes:
    """One server-sent event carrying `obj` as JSON."""
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def token_string(tokenizer, token: int) -> str:
    """The text of one id alone (a partial UTF-8 character shows as U+FFFD)."""
    return tokenizer.decode([int(token)])


def completion_logprobs(tokenizer, entries: Sequence[Entry], texts: Sequence[str]) -> dict:
    """OpenAI's legacy logprobs object; `texts[i]` is entry i's share of the choice's text
    (so "".join(tokens) is the text and text_offset indexes into it)."""
    offsets, at = [], 0
    for text in texts:
        offsets.append(at)
        at += len(text)
    return {
        "tokens": list(texts),
        "token_logprobs": [None if lp is None else float(lp) for _, lp, _ in entries],
        "top_logprobs": [None if lp is None else
                         {token_string(tokenizer, i): float(v) for i, v in top}
                         for _, lp, top in entries],
        "text_offset": offsets,
    }


def _chat_token(tokenizer, token: int, logprob: float) -> dict:
    text = token_string(tokenizer, token)
    return {"token": text, "logprob": float(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer, entries: Sequence[Entry]) -> dict:
    """The chat completions logprobs object: {"content": [per token]}."""
    return {"content": [{**_chat_token(tokenizer, token, lp),
                         "top_logprobs": [_chat_token(tokenizer, i, v) for i, v in top]}
                        for token, lp, top in entries]}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion(request_id: str, model: str, choices: list[dict], usage_: dict) -> dict:
    return {"id": request_id, "object": "text_completion", "created": now(), "model": model,
            "choices": choices, "usage": usage_}


def completion_choice(index: int, text: str, logprobs: Optional[dict],
                      finish_reason: Optional[str]) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_completion(request_id: str, model: str, content: str, logprobs: Optional[dict],
                    finish_reason: str, usage_: dict) -> dict:
    return {"id": request_id, "object": "chat.completion", "created": now(), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                         "logprobs": logprobs, "finish_reason": finish_reason}],
            "usage": usage_}


def chat_chunk(request_id: str, model: str, delta: dict, logprobs: Optional[dict] = None,
               finish_reason: Optional[str] = None) -> dict:
    return {"id": request_id, "object": "chat.completion.chunk", "created": now(),
            "model": model, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": finish_reason}]}


def usage_chunk(request_id: str, model: str, obj: str, usage_: dict) -> dict:
    """The last chunk of a stream with stream_options.include_usage: no choices."""
    return {"id": request_id, "object": obj, "created": now(), "model": model, "choices": [],
            "usage": usage_}

"""One request through the engine as the HTTP server sees it: submit, stream text
with stop strings cut out, cancel the moment the caller stops listening (no JAX here).

    handle = submit(engine, request)            # before any byte of the response
    async for step in stream(handle, tokenizer, request):
        step.text, step.entries, step.finish_reason

`submit` (called before the response starts) turns the engine's refusals into `ApiError`s (429 when its queue is
full, 400 for a prompt it cannot take); the engine handle is cancelled in a
`finally`, so a client that disconnects, a stop string matched here or an
exception frees the request's slot and pages at once.

Echo: with `params.echo` the engine streams one event per prompt token first
(the first without a logprob), then the new tokens; they arrive here as the
first step's `prompt_entries`.
"""

from __future__ import annotations

import dataclasses
from typing import AsyncIterator, Optional

from jaxformer.serve.detokenize import Detokenizer, StopMatcher, token_texts
from jaxformer.serve.request import FinishReason, Request
from jaxformer.serve.schemas import ApiError

# Seconds a client is told to wait after a 429 (the queue drains at decode speed).
RETRY_AFTER_S = 1


class EngineError(RuntimeError):
    """The engine ended this request with FinishReason.ERROR (the server goes on)."""


@dataclasses.dataclass
class Step:
    """What one engine event adds to a choice."""
    text: str = ""                                   # visible text, stop strings cut out
    entries: list = dataclasses.field(default_factory=list)   # (id, logprob, top) of new tokens
    texts: list = dataclasses.field(default_factory=list)     # each new token's raw text
    prompt_entries: list = dataclasses.field(default_factory=list)  # echo: prompt tokens
    finish_reason: Optional[str] = None


def is_queue_full(error: Exception) -> bool:
    """The engine's QueueFull (matched by name: the server does not import the engine)."""
    return any(t.__name__ == "QueueFull" for t in type(error).__mro__)


def submit(engine, request: Request):
    """engine.submit(request), its refusals as ApiErrors (call it before the response
    starts, so a 429 or 400 is still possible)."""
    try:
        return engine.submit(request)
    except Exception as error:  # noqa: BLE001 - sorted below
        if is_queue_full(error):
            raise ApiError(f"the server's queue is full ({error}); retry later", None,
                           status=429, type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from error
        if isinstance(error, ValueError):
            raise ApiError(str(error), "prompt", code="invalid_prompt") from error
        raise


async def stream(handle, tokenizer, request: Request, *, keep_new_tokens: bool = True
                 ) -> AsyncIterator[Step]:
    """The steps of `request`, submitted as `handle` (see the module docstring), the
    handle cancelled when this generator ends or is closed. `keep_new_tokens=False`:
    the prompt is only scored (echo with max_tokens 0): the new token is dropped."""
    prompt_ids = [int(i) for i in request.prompt_ids]
    echo_left = len(prompt_ids) if request.params.echo else 0
    prompt_entries: list = []
    text = Detokenizer(tokenizer, context=prompt_ids)
    stops = StopMatcher(request.params.stop)
    try:
        async for event in handle:
            step = Step()
            if event.token is not None and echo_left:
                echo_left -= 1
                prompt_entries.append((event.token, event.logprob, tuple(event.top_logprobs)))
                if echo_left:
                    continue
                step.prompt_entries, prompt_entries = prompt_entries, []
            elif event.token is not None and keep_new_tokens:
                piece = text.push(event.token)
                step.entries.append((event.token, event.logprob, tuple(event.top_logprobs)))
                step.texts.append(piece)
                step.text, stopped = stops.feed(piece)
                if stopped:
                    step.finish_reason = FinishReason.STOP.value
                    yield step
                    return
            reason = event.finish_reason
            if reason is not None:
                if reason == FinishReason.ERROR:
                    raise EngineError(f"the engine failed on request {request.request_id}")
                tail = text.flush()
                if step.texts:
                    step.texts[-1] += tail
                shown, stopped = stops.feed(tail)
                step.text += shown + ("" if stopped else stops.flush())
                step.finish_reason = (FinishReason.STOP.value if stopped else
                                      FinishReason(reason).value)
                yield step
                return
            if step.text or step.entries or step.prompt_entries:
                yield step
        raise EngineError(f"the engine's stream for request {request.request_id} ended "
                          "without a finish reason")
    finally:
        handle.cancel()


async def collect(handle, tokenizer, request: Request, *, keep_new_tokens: bool = True
                  ) -> Step:
    """The whole generation of `handle` as one Step."""
    out = Step()
    async for step in stream(handle, tokenizer, request, keep_new_tokens=keep_new_tokens):
        out.text += step.text
        out.entries += step.entries
        out.texts += step.texts
        out.prompt_entries += step.prompt_entries
        out.finish_reason = step.finish_reason
    return out


def prompt_texts(tokenizer, prompt_ids) -> list[str]:
    """Each prompt token's share of the decoded prompt (echo's `tokens`)."""
    return token_texts(tokenizer, [int(i) for i in prompt_ids])

"""One request through the engine as the HTTP server sees it: submit, stream its
text and logprobs, cancel the moment the caller stops listening (no JAX here).

    handle = submit(engine, request)            # before any byte of the response
    async for step in stream(handle, tokenizer, request):
        step.text, step.entries, step.finish_reason

`submit` (called before the response starts) turns the engine's refusals into
`ApiError`s: 429 with Retry-After when its queue is full, 400 for a request it
cannot take, 503 once it is stopping. The handle is cancelled in a `finally`,
so a client that disconnects or an exception frees the request's slot and
pages at the engine's next step.

The text is the engine's (`TokenEvent.text`: stop strings already cut, held
back while it could start one). Each new token's own share of the text, for
logprobs' `tokens` and `text_offset`, comes from `text.detokenize.Detokenizer`.
Echo: the prompt's events (`TokenEvent.prompt`) arrive first, here as the
steps' `prompt_entries`; a pick of EOS (or a stop id) that ends an echo request
is its last entry (text ""), as OpenAI lists it: harnesses scoring a prompt
(lm-eval's local-completions: max_tokens 1, token_logprobs[ctxlen:-1]) drop
the last entry as the generated one.

Usage (`Step.generated`): every token the engine picked counts, the EOS or stop
id that ended the request included, as llama-server counts them (`n_decoded`:
+1 per sampled token, before its end-of-generation check) and vLLM (the EOS is
in a finished output's `token_ids`); a stop string's tokens count too.
"""

from __future__ import annotations

import dataclasses
from typing import AsyncIterator, Optional

from jaxformer.text.detokenize import Detokenizer, token_texts
from jaxformer.serve.request import FinishReason, QueueFull, Request
from jaxformer.serve.schemas import ApiError

# Seconds a client is told to wait after a 429 (the queue drains at decode speed).
RETRY_AFTER_S = 1


class EngineError(RuntimeError):
    """The engine ended this request with FinishReason.ERROR (the server goes on)."""


@dataclasses.dataclass
class Step:
    """What one engine event adds to a choice."""
    text: str = ""                                   # new visible text
    entries: list = dataclasses.field(default_factory=list)   # (id, logprob, top) of new tokens
    texts: list = dataclasses.field(default_factory=list)     # each new token's own text
    prompt_entries: list = dataclasses.field(default_factory=list)  # echo: prompt tokens
    finish_reason: Optional[str] = None
    generated: int = 0   # tokens picked: usage's completion_tokens (an ending EOS counts)


def submit(engine, request: Request):
    """engine.submit(request), its refusals as ApiErrors."""
    try:
        return engine.submit(request)
    except QueueFull as error:
        raise ApiError(f"the server is busy: {error}; retry later", None, status=429,
                       type="rate_limit_error", code="queue_full",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from error
    except ValueError as error:
        raise ApiError(str(error), "prompt", code="invalid_prompt") from error
    except RuntimeError as error:  # the engine is stopping (SIGTERM): no new requests
        raise ApiError(str(error), None, status=503, type="server_error",
                       code="shutting_down") from error


async def stream(handle, tokenizer, request: Request, *, keep_new_tokens: bool = True
                 ) -> AsyncIterator[Step]:
    """The steps of `request`, submitted as `handle` (see the module docstring), the
    handle cancelled when this generator ends or is closed. `keep_new_tokens=False`:
    the prompt is only scored (echo with max_tokens 0): the new token is dropped."""
    pieces = Detokenizer(tokenizer, context=request.prompt_ids)
    try:
        async for event in handle:
            step = Step()
            if event.prompt:
                step.prompt_entries.append((event.token, event.logprob,
                                            tuple(event.top_logprobs)))
            elif event.token is not None and keep_new_tokens:
                step.entries.append((event.token, event.logprob, tuple(event.top_logprobs)))
                step.texts.append(pieces.push(event.token))
                step.generated = 1
            elif event.stopped_by is not None and keep_new_tokens:
                step.generated = 1  # the EOS (or stop id) picked: llama-server counts it too
                if request.params.echo:
                    step.entries.append(event.stopped_by)   # scored: the last entry is the pick
                    step.texts.append("")
            if keep_new_tokens and not event.prompt:
                step.text = event.text
            reason = event.finish_reason
            if reason is not None:
                if reason == FinishReason.ERROR:
                    why = getattr(handle, "error", None) or "see the server's log"
                    raise EngineError(f"the engine failed on this request ({why})")
                if step.texts:
                    step.texts[-1] += pieces.flush()
                step.finish_reason = FinishReason(reason).value
                yield step
                return
            if step.text or step.entries or step.prompt_entries:
                yield step
        raise EngineError("the engine's stream ended without a finish reason")
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
        out.generated += step.generated
    return out


def prompt_texts(tokenizer, prompt_ids) -> list[str]:
    """Each prompt token's share of the decoded prompt (echo's `tokens`)."""
    return token_texts(tokenizer, [int(i) for i in prompt_ids])

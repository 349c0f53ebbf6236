"""What a client asks the serving engine for and what it gets back (no JAX here).

The engine and the HTTP server
meet at these types: the server turns a JSON body into a `Request`, the engine
streams `TokenEvent`s for it and ends with one whose `finish_reason` is set.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional, Protocol, Sequence


class FinishReason(str, enum.Enum):
    """Why a request ended (OpenAI's `finish_reason` values, plus `cancelled`/`error`)."""
    STOP = "stop"            # EOS, a stop id or a stop string
    LENGTH = "length"        # max_tokens reached, or the context is full
    CANCELLED = "cancelled"  # the client went away or cancel() was called
    ERROR = "error"          # this request failed; the engine goes on


# The smallest temperature above 0 (greedy): logits / t must stay finite in float32
# (vLLM takes the same 1e-5 as its greedy threshold).
MIN_TEMPERATURE = 1e-5


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding choices; temperature 0 is greedy.

    A request's sampled tokens depend on its own `seed` only (its key is
    `fold_in(PRNGKey(seed), position)`), never on the requests beside it.
    """
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    min_p: float = 0.0                  # keep tokens >= min_p * the top token's probability
    seed: int = 0
    stop: tuple[str, ...] = ()          # stop strings (text never includes them)
    stop_ids: tuple[int, ...] = ()      # stop token ids (EOS always stops)
    logprobs: Optional[int] = None      # top-n logprobs per new token (0 = the token's own)
    echo: bool = False                  # also return the prompt's tokens with logprobs


class TokenConstraint(Protocol):
    """A structured-output constraint (JSON schema, regex) as a per-step token mask.

    One object per request, owned by the engine's thread: `allowed()` gives the
    (V,) bool mask of tokens that keep the output parseable, `advance(token)`
    moves past a chosen token, `done()` says the grammar is complete.
    """
    def allowed(self): ...
    def advance(self, token: int) -> None: ...
    def done(self) -> bool: ...


@dataclasses.dataclass
class Request:
    """One generation: prompt ids (already tokenized and templated) and its params."""
    prompt_ids: Sequence[int]
    params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    request_id: Optional[str] = None
    adapter: Optional[str] = None             # a LoRA adapter's name, None = the base
    constraint: Optional[TokenConstraint] = None


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """One streamed step of a request.

    token: the new id (None on a final event that carries only the reason);
    logprob: its log-probability under the (temperature-scaled) distribution;
    top_logprobs: ((id, logprob), ...) best first, when asked for;
    finish_reason: set on the request's last event only;
    text: the text this event adds to the output (with the engine's tokenizer;
      held back while it could start a stop string, never containing one);
    prompt: True for the prompt's own tokens, streamed first when `echo` is set
      (the first one has no logprob);
    stopped_by: on a final event ended by EOS or a stop id, that token's
      (id, logprob, top_logprobs): picked but not part of the output.
    """
    token: Optional[int]
    logprob: Optional[float] = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    finish_reason: Optional[FinishReason] = None
    text: str = ""
    prompt: bool = False
    stopped_by: Optional[tuple] = None


class QueueFull(RuntimeError):
    """The engine's queue holds `max_queue` requests already (HTTP: 429, retry later)."""

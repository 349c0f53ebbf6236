"""Streamed decoding: a prompt's new tokens handed to the host chunk by chunk, with no
host callback inside a compiled program.

    for tokens_Bk in generate_stream(lm, params, prompt_BP, max_new_tokens=64, chunk=8):
        ...  # (B, k) int32, k <= chunk, in step order; PAD after a row's EOS

`generate(on_token=...)` streams through `jax.debug.callback`, and JAX does not write a
program holding a host callback to its persistent compilation cache, so a streaming
`jaxformer generate` compiled its decode program again at every start. Here the
same decode runs as two host-free programs, both cacheable: `start_program` (the
prefill and the first pick, `api.start_lm_state`) and `steps_program` (`chunk` more
steps of `loop.decode_loop`, the state donated), called from the host until N tokens
are out or every row has finished. The chunks concatenated equal `generate`'s tokens
(the same picks with the same per-step keys, greedy or sampled), cut where every row
has finished.
"""

from __future__ import annotations

from typing import Iterator, Optional

import jax
import numpy as np

from jaxformer.decode.api import DecodeState, check_lm_request, start_lm_state
from jaxformer.decode.inputs import decodable
from jaxformer.decode.loop import TRACE_COUNTS, cached_logits_fn, decode_jit, decode_loop
from jaxformer.nn.model import DecoderOnlyLM

__all__ = ["generate_stream"]


@decode_jit(static_argnames=("model", "max_new_tokens", "select", "processors",
                             "prefill_chunk"))
def start_program(model, params, prompt_BP, lengths_B, rng, *, max_new_tokens, select,
                  processors, prefill_chunk) -> DecodeState:
    TRACE_COUNTS["stream_start"] += 1
    return start_lm_state(model, params, prompt_BP, lengths_B, rng,
                          max_new_tokens=max_new_tokens, select=select,
                          processors=processors, prefill_chunk=prefill_chunk)


@decode_jit(static_argnames=("model", "steps", "select", "processors"), donate_argnums=(2,))
def steps_program(model, params, state, *, steps, select, processors) -> DecodeState:
    TRACE_COUNTS["stream_steps"] += 1
    c = model.config
    return decode_loop(cached_logits_fn(model, params), state, steps, select=select,
                       eos_id=c.eos_id, pad_id=c.pad_id, processors=processors)


def generate_stream(model: DecoderOnlyLM, params, prompt_BP, *, max_new_tokens: int,
                    chunk: int = 8, prompt_lengths=None, rng: Optional[jax.Array] = None,
                    temperature: float = 0.0, top_k: Optional[int] = None,
                    top_p: Optional[float] = None, processors=None,
                    prefill_chunk: Optional[int] = None) -> Iterator[np.ndarray]:
    """`generate`'s tokens as an iterator of (B, k) numpy chunks: the first new token
    alone (right after the prefill), then up to `chunk` at a time.

    Arguments as `generate` (right-padded prompts, sampling, processors,
    prefill_chunk), checked before anything runs; `chunk` >= 1 steps per compiled
    call (at most two chunk lengths compile: `chunk` and the remainder). Stops early
    once every row has emitted EOS.
    """
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    select, procs, prompt, lengths = check_lm_request(
        model, prompt_BP, prompt_lengths, max_new_tokens, rng=rng, temperature=temperature,
        top_k=top_k, top_p=top_p, processors=processors, prefill_chunk=prefill_chunk)
    model, params = decodable(model, params)
    state = start_program(model, params, np.asarray(prompt, np.int32),
                          np.asarray(lengths, np.int32),
                          jax.random.PRNGKey(0) if rng is None else rng,
                          max_new_tokens=int(max_new_tokens), select=select, processors=procs,
                          prefill_chunk=None if prefill_chunk is None else int(prefill_chunk))
    return _chunks(model, params, state, int(max_new_tokens), chunk, select, procs)


def _chunks(model, params, state: DecodeState, max_new_tokens: int, chunk: int, select,
            processors) -> Iterator[np.ndarray]:
    step = 1
    tokens_BN, finished_B = jax.device_get((state.tokens_BN, state.finished_B))
    yield tokens_BN[:, :1]
    while step < max_new_tokens and not finished_B.all():
        steps = min(chunk, max_new_tokens - step)
        state = steps_program(model, params, state, steps=steps, select=select,
                              processors=processors)
        tokens_BN, finished_B = jax.device_get((state.tokens_BN, state.finished_B))
        yield tokens_BN[:, step:step + steps]
        step += steps

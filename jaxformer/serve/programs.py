"""The engine's two compiled programs: the decode step over every slot, a prefill chunk.

Both are jitted once per process and backend (shared by every `Engine`, so a
second engine on the same model compiles nothing), with the model, the page
size and the view length static and the KV pools donated (updated in place).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxformer.backends import cpu
from jaxformer.serve import paged, select

COMPILED: dict = {}


def decode_program(model, page_size, params, pools, table_SM, lengths_S, tokens_S, valid_S,
                   slot_params, want_top, allowed_SV, *, view_len: int, masked: bool):
    """One token per slot at positions L_s; the next picks (`select.pick`) and the pools."""
    logits_S1V, pools = paged.paged_forward(
        model, params, pools, table_SM, lengths_S, tokens_S[:, None], valid_S[:, None],
        page_size=page_size, view_len=view_len)
    logits_SV = logits_S1V[:, 0]
    if masked:  # structured-output constraints: (S, V) allowed tokens
        logits_SV = jnp.where(allowed_SV, logits_SV, select.NEG)
    return select.pick(logits_SV, slot_params, lengths_S + 1, want_top), pools


def prefill_program(model, page_size, params, pools, table_1M, length_1, tokens_1C, valid_1C,
                    slot_params, want_top, last, targets_C, allowed_1V, *, view_len: int,
                    echo: bool, masked: bool):
    """C prompt tokens of one request; the pick after token `last` (its final prompt
    token, when this chunk ends the prompt), the prompt logprobs if `echo`, the pools."""
    logits_1CV, pools = paged.paged_forward(
        model, params, pools, table_1M, length_1, tokens_1C, valid_1C,
        page_size=page_size, view_len=view_len)
    last_1V = jax.lax.dynamic_index_in_dim(logits_1CV[0], last, axis=0)
    if masked:
        last_1V = jnp.where(allowed_1V, last_1V, select.NEG)
    picks = select.pick(last_1V, slot_params, length_1 + last + 1, want_top)
    extra = select.prompt_logprobs(logits_1CV[0], targets_C) if echo else None
    return picks, extra, pools


def compiled():
    """(decode, prefill) jitted for the current backend (looked up at the first engine,
    not at import)."""
    backend = jax.default_backend()
    key = (backend, cpu.process_tuned())
    if key not in COMPILED:
        options = cpu.decode_compiler_options(backend)
        COMPILED[key] = (
            jax.jit(decode_program, static_argnames=("model", "page_size", "view_len", "masked"),
                    donate_argnums=(3,), compiler_options=options),
            jax.jit(prefill_program,
                    static_argnames=("model", "page_size", "view_len", "echo", "masked"),
                    donate_argnums=(3,), compiler_options=options))
    return COMPILED[key]

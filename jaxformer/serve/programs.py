"""The engine's two compiled programs: the decode step over every slot, a prefill chunk.

Both are jitted once per process and backend (shared by every `Engine`, so a
second engine on the same model compiles nothing), with the model, the page
size and the view length static and the KV pools donated (updated in place).
`warm_up` compiles every shape an engine's steady state calls, before it serves.
"""

from __future__ import annotations

import statistics
import threading
import time

import jax
import jax.numpy as jnp

import numpy as np

from jaxformer.backends import cpu, host_memory
from jaxformer.serve import batching, paged, select, spec_step

COMPILED: dict = {}
# Held while an engine call compiles a new program: one such compile at a time in the
# process, whichever engine or thread calls (a server's warm-up beside another engine's
# first steps). Two clean-clone CI runs lost a worker to a segfault inside XLA:CPU's
# compile of an engine step on its thread; the cause was not found (benchmarks/NOTES.md).
COMPILE_LOCK = threading.Lock()


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


def prefill_program(model, page_size, params, pools, table_RM, start_R, tokens_RC, valid_RC,
                    slot_params, want_top, last_R, targets_RC, allowed_RV, *, view_len: int,
                    echo: bool, masked: bool):
    """C prompt tokens of each of R requests at positions start_R..; the picks after
    each row's token `last_R` (its final prompt token, when this chunk ends its
    prompt), the prompt logprobs if `echo` (of each next token `targets_RC`), the pools."""
    # Without echo only the last prompt token's logits are needed: the output projection
    # (V = 49152 for SmolLM2) of the chunk's other tokens is skipped.
    logits_RCV, pools = paged.paged_forward(
        model, params, pools, table_RM, start_R, tokens_RC, valid_RC,
        page_size=page_size, view_len=view_len, logits_at=None if echo else last_R)
    last_RV = (jnp.take_along_axis(logits_RCV, last_R[:, None, None], axis=1) if echo
               else logits_RCV)[:, 0]
    if masked:
        last_RV = jnp.where(allowed_RV, last_RV, select.NEG)
    picks = select.pick(last_RV, slot_params, start_R + last_R + 1, want_top)
    extra = jax.vmap(select.prompt_logprobs)(logits_RCV, targets_RC) if echo else None
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


def warm_up(engine) -> None:
    """Run each of `engine`'s steady-state programs once with every row idle (writes go
    to the null page), through the engine's own call paths (`Engine.run_decode`,
    `run_prefill`, so the compiled shapes are the ones its steps look up): the decode
    step per row count and decode view (and the verify step per view, with
    `speculative`), the prefill chunk per (rows, width) and view length."""
    max_pages, params = engine.max_pages, engine.params[None]
    for view_len in engine.view_sizes:
        decodes = engine.decode_view(view_len) == view_len  # else no step reads this view
        if decodes and engine.speculative:
            spec_step.warm_up(engine, view_len)
        for rows in engine.decode_rows if decodes else ():  # (speculative: no drafts)
            picks = engine.run_decode(
                params, np.zeros((rows, max_pages), np.int32), np.zeros((rows,), np.int32),
                np.zeros((rows,), np.int32), np.zeros((rows,), bool),
                batching.slot_params([None] * rows), batching.want_top([]), None, view_len)
            jax.block_until_ready(picks)
        for rows in engine.row_sizes:
            for width in engine.chunk_sizes:
                if width > view_len or view_len < min(batching.PREFILL_VIEW, engine.max_len):
                    continue
                ids = np.zeros((rows, width), np.int32)
                picks, _ = engine.run_prefill(
                    params, np.zeros((rows, max_pages), np.int32), np.zeros((rows,), np.int32),
                    ids, np.zeros((rows, width), bool), batching.slot_params([None] * rows),
                    batching.want_top([]), np.zeros((rows,), np.int32), ids, None, view_len,
                    False)
                jax.block_until_ready(picks)
    engine.compiled_new = False
    host_memory.release_freed()  # the compiler's freed host memory


def time_programs(engine, length: int, reps: int = 20) -> dict:
    """The engine's compiled programs timed alone (no scheduling, no host work between
    calls; `benchmarks/serve_engine.py step`): the decode step with every slot's row
    holding `length` tokens (each row its own pages, the engine's view bucket for that
    length), and the prefill chunk of its widest shape (rows x `prefill_chunk` prompt
    tokens from position 0). Median milliseconds of `reps` calls (a quarter as many
    for the prefill), each after one untimed call (compiles). Takes pages from the
    engine's pool: call it on an engine that serves nothing else."""
    slots, size = engine.slots, engine.page_size
    table = np.zeros((slots, engine.max_pages), np.int32)
    for row in range(slots):
        table[row, :-(-(length + 1) // size)] = [
            engine.pool.take() for _ in range(-(-(length + 1) // size))]
    params, no_top = engine.params[None], batching.want_top([])
    view = engine.decode_view(length + 1)
    lengths, ids = np.full((slots,), length, np.int32), np.arange(slots, dtype=np.int32) + 3

    def decode():
        return engine.run_decode(params, table, lengths, ids, np.ones((slots,), bool),
                                 batching.slot_params([None] * slots), no_top, None, view)

    rows, width = engine.row_sizes[-1], engine.chunk_sizes[-1]
    chunk = np.full((rows, width), 3, np.int32)

    def prefill():
        return engine.run_prefill(params, table[:rows], np.zeros((rows,), np.int32), chunk,
                                  np.ones((rows, width), bool),
                                  batching.slot_params([None] * rows), no_top,
                                  np.full((rows,), width - 1, np.int32), chunk, None,
                                  engine.view_length(width), False)[0]

    def median_ms(fn, n):
        jax.block_until_ready(fn())
        times = []
        for _ in range(n):
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times)

    return {"view": view, "decode_ms": median_ms(decode, reps), "prefill_rows": rows,
            "prefill_width": width, "prefill_ms": median_ms(prefill, max(3, reps // 4))}

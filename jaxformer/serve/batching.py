"""What one engine call feeds the compiled step, built on the host from the slots.

Pure functions of the running `Slot`s (None for a free slot): the shape buckets
(`bucket`), which prefilling requests share a call and how many prompt tokens each
feeds (`prefill_batch`), how many rows a decode step runs (`decode_sizes`), and the
per-row arrays of a call: sampling settings (`slot_params`), constraint masks
(`allowed`), page tables (`page_rows`).

A call's cost grows with its padded shape (rows x width), not with the tokens that
are real: on a CPU a prefill call costs about the same per padded token at every
compiled shape, and a decode step's cost grows with its rows (benchmarks/NOTES.md,
issue 43). So a prefill call takes the compiled shape that feeds the most prompt
tokens per padded token, a long prompt giving a narrow call a full row of its next
tokens, and a decode step runs only the decoding slots, padded to the next of a few
row counts, instead of every slot.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from jaxformer.serve import select
from jaxformer.serve.slots import Slot

PREFILL_BUDGET = 4  # a prefill call feeds at most this many chunks (rows of `prefill_chunk`)
SHORT_CHUNK = 16    # the narrower prefill width, for prompts (or their ends) this short
CALL_COST = 16      # a call's fixed cost (dispatch, weights read), in padded tokens
# A prefill call reads at least this many positions: its attention is a small part of
# its cost (the matmuls over its tokens are most of it), and one view fewer is a
# compiled program fewer per (rows, width) (~9 MB each on SmolLM2, CPU).
PREFILL_VIEW = 256


def prefill_sizes(slots: int, chunk: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(widths, row counts) of the prefill calls: two of each, so an engine compiles
    four prefill shapes per view length (`Engine.warm_up` compiles them all)."""
    widths = tuple(sorted({min(SHORT_CHUNK, chunk), chunk}))
    return widths, tuple(sorted({1, min(slots, PREFILL_BUDGET)}))


def decode_sizes(slots: int) -> tuple[int, ...]:
    """Row counts of the decode step: every slot, a half and a quarter of them (a step
    runs only its decoding slots, padded to the next of these)."""
    return tuple(sorted({slots, -(-slots // 2), -(-slots // 4)}))


def bucket(value: int, sizes: tuple[int, ...]) -> int:
    """The smallest of `sizes` (ascending) >= value, else value rounded up to the last."""
    for size in sizes:
        if size >= value:
            return size
    return -(-value // sizes[-1]) * sizes[-1]


def slot_params(slots: list[Optional[Slot]]) -> select.SlotParams:
    """The rows' sampling settings (greedy for free rows), as host arrays: the compiled
    step takes them with its other arguments (no separate transfer per column)."""
    def column(get, dtype, idle):
        return np.asarray([idle if s is None else get(s.request.params) for s in slots], dtype)
    return select.SlotParams(
        temperature=column(lambda p: p.temperature, np.float32, 0.0),
        top_k=column(lambda p: p.top_k or 0, np.int32, 0),
        top_p=column(lambda p: 1.0 if p.top_p is None else p.top_p, np.float32, 1.0),
        min_p=column(lambda p: p.min_p, np.float32, 0.0),
        seed=column(lambda p: p.seed, np.uint32, 0))


def want_top(slots: list[Slot]) -> np.ndarray:
    """() bool: some row asks for top logprobs."""
    return np.asarray(any(s.request.params.logprobs for s in slots))


def allowed(slots: list[Optional[Slot]], vocab: int) -> Optional[np.ndarray]:
    """(S, V) bool masks of the rows' constraints, or None if no row has one."""
    if all(s is None or s.request.constraint is None for s in slots):
        return None
    mask = np.ones((len(slots), vocab), bool)
    for i, s in enumerate(slots):
        if s is not None and s.request.constraint is not None:
            mask[i] = np.asarray(s.request.constraint.allowed(), bool)
    return mask


def prefill_batch(prefilling: list[Slot], chunk: int, chunk_sizes: tuple[int, ...],
                  row_sizes: tuple[int, ...]) -> tuple[list[Slot], list[int]]:
    """(slots, tokens each feeds) of the next prefill call: the oldest prefilling requests
    of the oldest one's adapter, in the compiled shape (rows from `row_sizes`, a width
    from `chunk_sizes`, at most PREFILL_BUDGET chunks of `chunk` tokens) that feeds the
    most prompt tokens per padded token, counting a call's fixed cost as CALL_COST
    tokens; the oldest request is always in it. Each row feeds min(width, its prompt
    tokens left): a long prompt fills a narrow row with its next tokens."""
    first = prefilling[0]
    same = [s for s in prefilling if s.request.adapter == first.request.adapter]
    left = [s.prompt_len - s.cached for s in same]
    best = None
    for width in chunk_sizes:
        most = min(row_sizes[-1], len(same), max(1, PREFILL_BUDGET * chunk // width))
        for rows in range(1, most + 1):
            counts = [min(width, n) for n in left[:rows]]
            score = sum(counts) / (bucket(rows, row_sizes) * width + CALL_COST)
            if best is None or score > best[0]:
                best = (score, counts)
    counts = best[1]
    return same[:len(counts)], counts


def page_rows(running: list[Optional[Slot]], max_pages: int) -> np.ndarray:
    """(slots, max_pages) page tables of the running slots (zeros for free ones)."""
    return np.stack([np.zeros((max_pages,), np.int32) if s is None else s.table.row()
                     for s in running])

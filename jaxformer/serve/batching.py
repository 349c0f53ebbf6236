"""What one engine call feeds the compiled step, built on the host from the slots.

Pure functions of the running `Slot`s (None for a free slot): the shape buckets
(`bucket`), which prefilling requests share a call (`prefill_batch`), and the
per-row arrays of a call: sampling settings (`slot_params`), constraint masks
(`allowed`), page tables (`page_rows`).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from jaxformer.serve import select
from jaxformer.serve.slots import Slot

PREFILL_BUDGET = 4  # a prefill call feeds at most this many chunks (rows of `prefill_chunk`)
SHORT_CHUNK = 16    # the narrower prefill width, for prompts (or their ends) this short


def prefill_sizes(slots: int, chunk: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(widths, row counts) of the prefill calls: two of each, so an engine compiles
    four prefill shapes per view length (`Engine.warm_up` compiles them all)."""
    widths = tuple(sorted({min(SHORT_CHUNK, chunk), chunk}))
    return widths, tuple(sorted({1, min(slots, PREFILL_BUDGET)}))


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
                  row_sizes: tuple[int, ...]) -> list[Slot]:
    """The oldest prefilling requests of one adapter whose next chunks (at most `chunk`
    tokens each) share one call: at most `row_sizes[-1]` rows and PREFILL_BUDGET chunks'
    worth of (padded) tokens."""
    first = prefilling[0]
    chosen, width = [], 0
    for slot in prefilling:
        count = min(chunk, slot.prompt_len - slot.cached)
        wider = max(width, bucket(count, chunk_sizes))
        if chosen and (slot.request.adapter != first.request.adapter
                       or len(chosen) >= row_sizes[-1]
                       or bucket(len(chosen) + 1, row_sizes) * wider > PREFILL_BUDGET * chunk):
            break
        chosen.append(slot)
        width = wider
    return chosen


def page_rows(running: list[Optional[Slot]], max_pages: int) -> np.ndarray:
    """(slots, max_pages) page tables of the running slots (zeros for free ones)."""
    return np.stack([np.zeros((max_pages,), np.int32) if s is None else s.table.row()
                     for s in running])

"""The endings of one context in one row: the layout `Scorer.loglikelihoods` runs.

A request (context, continuation) of n continuation tokens needs the model's
next-token predictions at the last context position and at the continuation's
first n - 1 tokens. Requests with the same context (the endings of a
multiple-choice question) share the context's positions, so a row holds the
context once and then, per continuation, its tokens but the last, as a segment:

    tokens     c0 c1 c2 | a0 a1 | b0 b1 b2        (context c, endings a = a0 a1 a2, b = b0..b3)
    positions   0  1  2 |  3  4 |  3  4  5        each segment continues the context
    segments    0  0  0 |  1  1 |  2  2  2        0 = context, -1 = PAD
    gather      2 3 4 (a's three predictions), 2 5 6 7 (b's four)

A segment sees the context and its own earlier tokens (`segment_mask`), never
another segment, so each prediction is the one the pair would get alone, at the
positions it would have alone (RoPE sees the same offsets). Only the gathered
positions go through the output projection: K rows of the (D, V) matrix product
instead of T. A pair longer than the window is cut as lm-evaluation-harness cuts it:
`(context + continuation)[-(window + 1):]`, which gives it a context of its own.

Dimension key: B rows, T row length, K gathered predictions per row.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Row:
    """One row: a context and the requests (indices) whose continuations follow it."""

    context: tuple[int, ...]
    requests: tuple[int, ...]
    continuations: tuple[tuple[int, ...], ...]

    @property
    def length(self) -> int:
        """Tokens in the row: the context, then each continuation but its last token."""
        return len(self.context) + sum(len(c) - 1 for c in self.continuations)

    @property
    def predictions(self) -> int:
        """Gathered positions: one per continuation token."""
        return sum(len(c) for c in self.continuations)


def pack(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], window: int) -> list[Row]:
    """Rows of at most `window` tokens holding every (context, continuation) pair,
    pairs with the same (cut) context together, in order of first appearance.

    Each pair needs a non-empty context and at most `window` continuation tokens
    (checked by the caller)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    cut: list[tuple[int, ...]] = []
    for i, (context, continuation) in enumerate(pairs):
        whole = (list(context) + list(continuation))[-(window + 1):]
        cut.append(tuple(continuation))
        groups.setdefault(tuple(whole[:-len(continuation)]), []).append(i)
    rows = []
    for context, members in groups.items():
        taken: list[int] = []
        used = len(context)
        for i in members:
            if taken and used + len(cut[i]) - 1 > window:
                rows.append(Row(context, tuple(taken), tuple(cut[j] for j in taken)))
                taken, used = [], len(context)
            taken.append(i)
            used += len(cut[i]) - 1
        rows.append(Row(context, tuple(taken), tuple(cut[j] for j in taken)))
    return rows


@dataclasses.dataclass(frozen=True)
class Batch:
    """Host arrays of B rows: tokens, positions, segments (B, T); gather, targets (B, K)."""

    tokens: np.ndarray
    positions: np.ndarray
    segments: np.ndarray
    gather: np.ndarray
    targets: np.ndarray


def layout(rows: Sequence[Row], batch: int, length: int, predictions: int,
           pad_id: int) -> Batch:
    """`rows` (at most `batch`) laid out in (batch, length) and (batch, predictions)
    arrays; unused rows and slots are PAD (segment -1), gathering position 0."""
    tokens = np.full((batch, length), pad_id, np.int32)
    positions = np.zeros((batch, length), np.int32)
    segments = np.full((batch, length), -1, np.int32)
    gather = np.zeros((batch, predictions), np.int32)
    targets = np.zeros((batch, predictions), np.int32)
    for r, row in enumerate(rows):
        c = len(row.context)
        tokens[r, :c] = row.context
        positions[r, :c] = np.arange(c)
        segments[r, :c] = 0
        at, k = c, 0
        for s, continuation in enumerate(row.continuations, start=1):
            n = len(continuation)
            tokens[r, at:at + n - 1] = continuation[:-1]
            positions[r, at:at + n - 1] = np.arange(c, c + n - 1)
            segments[r, at:at + n - 1] = s
            gather[r, k] = c - 1
            gather[r, k + 1:k + n] = np.arange(at, at + n - 1)
            targets[r, k:k + n] = continuation
            at, k = at + n - 1, k + n
    return Batch(tokens, positions, segments, gather, targets)


def segment_mask(segments_BT: jnp.ndarray) -> jnp.ndarray:
    """(B, 1, T, T) True = may attend: earlier or the same slot, in the context or in
    the query's own segment, not PAD. A PAD query sees the context (finite rows)."""
    length = segments_BT.shape[1]
    causal_TT = jnp.tril(jnp.ones((length, length), jnp.bool_))
    query_BT1, key_B1T = segments_BT[:, :, None], segments_BT[:, None, :]
    same_BTT = (key_B1T == 0) | ((key_B1T == query_BT1) & (key_B1T > 0))
    return (causal_TT & same_BTT)[:, None]

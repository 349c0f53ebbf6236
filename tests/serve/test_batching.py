"""The host-side shapes of the engine's calls (`serve.batching`): which prefilling
requests share a call and how many tokens each feeds, the decode step's row counts."""

import types

import pytest

from jaxformer.serve import batching

WIDTHS, ROWS, CHUNK = (16, 128), (1, 4), 128


def prefilling(lefts, adapters=None):
    """Stand-ins for prefilling slots with `lefts` prompt tokens still to read."""
    adapters = adapters or [None] * len(lefts)
    return [types.SimpleNamespace(prompt_len=100 + n, cached=100,
                                  request=types.SimpleNamespace(adapter=a))
            for n, a in zip(lefts, adapters)]


def padded(counts, rows=ROWS, widths=WIDTHS):
    return batching.bucket(len(counts), rows) * batching.bucket(max(counts), widths)


@pytest.mark.parametrize("lefts, want", [
    ((28, 178), [16]),                    # a short prompt alone: a narrow row, not 4 x 128
    ((128, 128, 128, 128), [128] * 4),    # full rows: the widest call
    ((300, 300), [128])], ids=["short", "full", "two_long"])  # two: 4 rows padded
def test_prefill_batch_takes_the_least_wasteful_shape(lefts, want):
    slots = prefilling(lefts)
    chosen, counts = batching.prefill_batch(slots, CHUNK, WIDTHS, ROWS)
    assert counts == want and chosen == slots[:len(want)]


def test_prefill_pads_less_than_one_wide_call_per_four_prompts():
    """The c8 benchmark's prompts (811 tokens): every call's padded shape summed is
    below the 1,536 tokens of taking up to four prompts per call at the widest width."""
    slots = prefilling([91, 28, 178, 77, 114, 73, 159, 91])
    total = calls = 0
    while any(s.cached < s.prompt_len for s in slots):
        chosen, counts = batching.prefill_batch(
            [s for s in slots if s.cached < s.prompt_len], CHUNK, WIDTHS, ROWS)
        assert all(0 < n <= s.prompt_len - s.cached for s, n in zip(chosen, counts))
        for slot, n in zip(chosen, counts):
            slot.cached += n
        total, calls = total + padded(counts), calls + 1
    assert total < 1000 and calls < 30


def test_prefill_batch_keeps_to_the_oldest_requests_adapter():
    slots = prefilling([128, 128, 128, 128], adapters=["a", None, "a", "a"])
    chosen, counts = batching.prefill_batch(slots, CHUNK, WIDTHS, ROWS)
    assert chosen[0] is slots[0] and {s.request.adapter for s in chosen} == {"a"}


def test_prefill_batch_never_exceeds_the_token_budget():
    chosen, counts = batching.prefill_batch(prefilling([500] * 8), 64, (16, 64), (1, 4, 8))
    assert padded(counts, (1, 4, 8), (16, 64)) <= batching.PREFILL_BUDGET * 64


@pytest.mark.parametrize("slots, want", [(1, (1,)), (3, (1, 2, 3)), (8, (2, 4, 8)),
                                         (32, (8, 16, 32))])
def test_decode_sizes(slots, want):
    assert batching.decode_sizes(slots) == want

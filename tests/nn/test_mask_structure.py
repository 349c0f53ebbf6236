"""MaskSpec: the dense mask against a per-element numpy reference; blocks cut from it; the
block-skipping decisions never skip a block with a visible pair."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.nn.mask_structure import (MaskSpec, band, block_mask, block_visible,
                                         dense_mask, first_key_block)

B, T, S = 2, 11, 13


def _reference(spec: MaskSpec, num_queries: int, num_keys: int) -> np.ndarray:
    """(B, 1, T, S) by the rules of the module docstring, one element at a time."""
    out = np.zeros((B, 1, num_queries, num_keys), bool)
    arr = lambda x: None if x is None else np.broadcast_to(np.asarray(x), (B,) + np.shape(x)[1:])
    qseg, kseg = arr(spec.q_segment_ids), arr(spec.kv_segment_ids)
    qpos, kpos = arr(spec.q_positions), arr(spec.kv_positions)
    for b, t, s in itertools.product(range(B), range(num_queries), range(num_keys)):
        p, k = (t + int(spec.q_offset), s) if qpos is None else (qpos[b, t], kpos[b, s])
        ok = True
        if spec.causal:
            ok = k <= p
        if spec.window is not None:
            ok = ok and abs(p - k) < spec.window
        if spec.prefix_length is not None:
            ok = ok or k < np.broadcast_to(spec.prefix_length, (B,))[b]
        if qseg is not None:
            ok = ok and qseg[b, t] == kseg[b, s]
        if spec.kv_lengths is not None:
            ok = ok and s < spec.kv_lengths[b]
        if spec.q_lengths is not None:
            ok = ok and t < spec.q_lengths[b]
        out[b, 0, t, s] = ok
    return out


_r = np.random.default_rng(0)
_SEG_Q = np.sort(_r.integers(0, 3, (B, T)), axis=1)
_SEG_K = np.sort(_r.integers(0, 3, (B, S)), axis=1)
_POS_Q, _POS_K = _r.permutation(S)[None, :T].repeat(B, 0), _r.permutation(S)[None].repeat(B, 0)

SPECS = {
    "none": MaskSpec(),
    "causal": MaskSpec(causal=True),
    "causal_offset": MaskSpec(causal=True, q_offset=S - T),
    "window": MaskSpec(window=3),
    "causal_window": MaskSpec(causal=True, window=4, q_offset=2),
    "segments": MaskSpec(q_segment_ids=_SEG_Q, kv_segment_ids=_SEG_K),
    "lengths": MaskSpec(kv_lengths=np.array([5, 13]), q_lengths=np.array([11, 4])),
    "prefix": MaskSpec(causal=True, prefix_length=np.array([4, 0])),
    "positions": MaskSpec(causal=True, window=5, q_positions=_POS_Q, kv_positions=_POS_K),
    "all": MaskSpec(causal=True, window=6, q_segment_ids=_SEG_Q, kv_segment_ids=_SEG_K,
                    kv_lengths=np.array([9, 12]), q_offset=1),
}


@pytest.mark.parametrize("name", SPECS)
def test_dense_mask_matches_reference_and_blocks_are_its_slices(name):
    spec = SPECS[name]
    dense = np.broadcast_to(np.asarray(dense_mask(spec, T, S)), (B, 1, T, S))
    want = _reference(spec, T, S)
    np.testing.assert_array_equal(dense, want)
    assert 0 < want.sum() or name == "none"
    # Blocks at traced offsets are the dense mask's slices; visibility never misses one.
    cut = jax.jit(lambda qs, ks: (block_mask(spec, qs, 4, ks, 5),
                                  block_visible(spec, qs, 4, ks, 5)))
    for qs, ks in itertools.product(range(0, T - 4 + 1, 3), range(0, S - 5 + 1, 4)):
        block, visible = cut(qs, ks)
        want_block = want[:, :, qs:qs + 4, ks:ks + 5]
        np.testing.assert_array_equal(np.broadcast_to(block, want_block.shape), want_block)
        assert bool(visible) or not want_block.any()


@pytest.mark.parametrize("name", ["causal", "causal_window", "lengths", "segments"])
def test_block_visible_skips_blocks_that_are_all_masked(name):
    """Index structure and lengths: exact. Sorted segment ids: ranges that do not overlap
    are skipped (overlapping ranges may still hold no common id)."""
    spec, size = SPECS[name], 3
    want = _reference(spec, T, S)
    skipped = 0
    for qs, ks in itertools.product(range(0, T - size + 1), range(0, S - size + 1)):
        visible = bool(block_visible(spec, qs, size, ks, size))
        any_visible = want[:, :, qs:qs + size, ks:ks + size].any()
        assert visible == any_visible or (name == "segments" and visible)
        skipped += not visible
    assert skipped > 0


@pytest.mark.parametrize("causal,window,block_q,block_k", [
    (True, 4, 3, 2), (True, 1, 2, 3), (False, 3, 2, 2), (True, 9, 4, 4)])
def test_band_holds_every_visible_key(causal, window, block_q, block_k):
    n = 40
    spec = MaskSpec(causal=causal, window=window, q_offset=3)
    want = _reference(spec, n - 3, n)[0, 0]
    num_k_blocks = -(-n // block_k)
    width = band(spec, block_q, block_k, num_k_blocks)
    assert width < num_k_blocks  # the band bounds the work ...
    for qs in range(0, n - 3, block_q):
        first = int(first_key_block(spec, qs, block_k, num_k_blocks, width))
        lo, hi = first * block_k, (first + width) * block_k
        seen = np.nonzero(want[qs:qs + block_q].any(axis=0))[0]
        assert 0 <= first and first + width <= num_k_blocks
        assert seen.min() >= lo and seen.max() < hi  # ... and holds every visible key


def test_bad_specs_are_refused_by_field():
    with pytest.raises(ValueError, match="window"):
        MaskSpec(causal=True, window=0)
    with pytest.raises(ValueError, match="kv_segment_ids"):
        MaskSpec(q_segment_ids=jnp.zeros((1, 3), jnp.int32))
    with pytest.raises(ValueError, match="prefix_length"):
        MaskSpec(prefix_length=2)

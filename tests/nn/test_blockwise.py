"""Blockwise attention against the dense `dot_product_attention` on the materialised mask:
outputs and gradients for every mask kind, bfloat16 bounds, forward-mode AD, GQA,
soft-capping, skipped blocks never read, and temporaries linear in length."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.nn.attention import dot_product_attention
from jaxformer.nn.blockwise import blockwise_attention
from jaxformer.nn.mask_structure import MaskSpec, dense_mask

B, H, G, K = 2, 4, 2, 8
T = S = 37  # not a multiple of the blocks below
BLOCKS = dict(block_q=16, block_k=8)


def _qkv(seed, num_queries=T, num_keys=S, heads=H, kv_heads=G, dtype=jnp.float32):
    r = np.random.default_rng(seed)
    return tuple(jnp.asarray(r.normal(size=shape), dtype) for shape in (
        (B, heads, num_queries, K), (B, kv_heads, num_keys, K), (B, kv_heads, num_keys, K)))


def _dense(query, key, value, spec, softcap=None):
    """The reference: dense attention on the materialised mask, fully masked rows set to 0
    (blockwise's convention; the dense function gives them the mean of the values)."""
    mask = dense_mask(spec, query.shape[2], key.shape[2])
    if softcap is None:
        out = dot_product_attention(query, key, value, mask)[0]
    else:  # dot_product_attention with the cap applied, written out in jnp
        group = query.shape[1] // key.shape[1]
        key, value = (jnp.repeat(x, group, axis=1) for x in (key, value))
        logits = jnp.einsum("bhtk,bhsk->bhts", query, key) / math.sqrt(query.shape[-1])
        logits = softcap * jnp.tanh(logits / softcap)
        weights = jax.nn.softmax(jnp.where(mask, logits, jnp.finfo(jnp.float32).min), axis=-1)
        out = jnp.einsum("bhts,bhsk->bhtk", weights, value)
    return jnp.where(mask.any(axis=-1, keepdims=True), out, 0.0)


def _value_and_grads(attention, query, key, value):
    """(output, d <output, random cotangent> / d(q, k, v)), in float32."""
    cotangent = jnp.asarray(np.random.default_rng(9).normal(size=query.shape), jnp.float32)

    def loss(q, k, v):
        out = attention(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(query, key,
                                                                                  value)
    return out, grads


_r = np.random.default_rng(1)
_SEG = jnp.asarray(np.sort(_r.integers(1, 4, (B, T)), axis=1), jnp.int32)
# Query segment 7 exists in no key: those rows see nothing (fully masked).
_SEG_Q_ORPHANS = _SEG.at[0, 5:9].set(7)
_PERM = jnp.asarray(np.stack([_r.permutation(S), _r.permutation(S)]), jnp.int32)

CASES = {
    "none": MaskSpec(),
    "causal": MaskSpec(causal=True),
    "window": MaskSpec(window=5),
    "causal_window": MaskSpec(causal=True, window=6),
    "segments_causal": MaskSpec(causal=True, q_segment_ids=_SEG, kv_segment_ids=_SEG),
    "padding_ragged": MaskSpec(kv_lengths=jnp.array([20, 37]), q_lengths=jnp.array([37, 30])),
    "causal_window_segments_padding": MaskSpec(
        causal=True, window=9, q_segment_ids=_SEG, kv_segment_ids=_SEG,
        kv_lengths=jnp.array([37, 25])),
    "fully_masked_rows": MaskSpec(causal=True, q_segment_ids=_SEG_Q_ORPHANS,
                                  kv_segment_ids=_SEG),
    "prefix": MaskSpec(causal=True, prefix_length=jnp.array([10, 0])),
    "positions_permuted": MaskSpec(causal=True, window=12, q_positions=_PERM,
                                   kv_positions=_PERM),
}


# Variants of shape and options: (spec, inputs, blockwise keyword arguments, softcap).
VARIANTS = {
    # T < S: a chunk of queries at positions q_offset.. against all keys (a prefill chunk;
    # the offset an array, as a chunked prefill's loop carries it).
    "queries_continue_a_longer_sequence": (MaskSpec(causal=True, window=11,
                                                    q_offset=jnp.int32(24)),
                                           _qkv(2, num_queries=13), dict(block_q=4, block_k=16),
                                           None),
    "multi_query": (CASES["causal_window_segments_padding"], _qkv(3, kv_heads=1), BLOCKS, None),
    "no_grouping": (CASES["causal_window_segments_padding"], _qkv(3, kv_heads=4), BLOCKS, None),
    # Logits well beyond the cap.
    "softcap": (CASES["causal_window_segments_padding"], tuple(3 * x for x in _qkv(4)),
                BLOCKS, 0.7),
}
ALL = {**{name: (spec, _qkv(0), BLOCKS, None) for name, spec in CASES.items()}, **VARIANTS,
       "bfloat16": (CASES["causal_window_segments_padding"], _qkv(5, dtype=jnp.bfloat16),
                    BLOCKS, None)}


def _all_value_and_grads(attention):
    """{name: (out, grads)} of every case and variant, in one jit (one compile, not 14)."""
    cotangents = {name: jnp.asarray(np.random.default_rng(9).normal(size=qkv[0].shape),
                                    jnp.float32) for name, (_, qkv, _, _) in ALL.items()}

    def run(inputs):
        def loss(name, q, k, v):
            out = attention(name, q, k, v)
            return jnp.sum(out.astype(jnp.float32) * cotangents[name]), out
        results = {}
        for name, qkv in inputs.items():
            (_, out), grads = jax.value_and_grad(lambda *a: loss(name, *a), (0, 1, 2),
                                                 has_aux=True)(*qkv)
            results[name] = (out, grads)
        return results

    return jax.jit(run)({name: qkv for name, (_, qkv, _, _) in ALL.items()}), cotangents


@pytest.fixture(scope="module")
def blockwise_results():
    def attention(name, q, k, v):
        spec, _, blocks, cap = ALL[name]
        return blockwise_attention(q, k, v, spec, logit_softcap=cap, **blocks)
    return _all_value_and_grads(attention)


@pytest.fixture(scope="module")
def dense_results():
    return _all_value_and_grads(lambda name, q, k, v: _dense(q, k, v, ALL[name][0],
                                                             softcap=ALL[name][3]))


@pytest.mark.parametrize("name", [name for name in ALL if name != "bfloat16"])
def test_matches_dense_forward_and_gradients_float32(name, blockwise_results, dense_results):
    (out, grads), (want, want_grads) = blockwise_results[0][name], dense_results[0][name]
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(out, want, atol=2e-6, rtol=1e-5)
    for got, ref in zip(grads, want_grads):
        np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)
    if name == "fully_masked_rows":
        np.testing.assert_array_equal(out[0, :, 5:9], 0.0)
        query, key, value = ALL[name][1]
        assert np.abs(np.asarray(dot_product_attention(  # dense: the mean of the values
            query, key, value, dense_mask(ALL[name][0], T, S))[0][0, :, 5:9])).min() > 0
    if name == "softcap":
        spec, (query, key, value), _, _ = ALL[name]
        uncapped = _dense(query, key, value, spec)
        assert np.abs(np.asarray(uncapped - out)).max() > 1e-2  # the cap matters here


def test_forward_mode_agrees_with_reverse_mode(blockwise_results):
    """jax.jvp of <output, cotangent> along random tangents = <reverse-mode gradient, tangents>."""
    name = "causal_window_segments_padding"
    spec, primals, blocks, _ = ALL[name]
    grads, cotangent = blockwise_results[0][name][1], blockwise_results[1][name]
    tangents = _qkv(7)
    loss = lambda q, k, v: jnp.sum(blockwise_attention(q, k, v, spec, **blocks) * cotangent)
    _, forward = jax.jit(lambda p, t: jax.jvp(loss, p, t))(primals, tangents)
    reverse = sum(jnp.vdot(g, t) for g, t in zip(grads, tangents))
    np.testing.assert_allclose(forward, reverse, rtol=1e-5)


def test_bfloat16_error_is_that_of_dense_bfloat16(blockwise_results, dense_results):
    """Both in bfloat16 against float32 dense on the same (rounded) inputs: blockwise's
    float32 statistics make its error no worse than dense bfloat16's."""
    spec, inputs, _, _ = ALL["bfloat16"]
    (out, grads), (dense16, dense16_grads) = (blockwise_results[0]["bfloat16"],
                                              dense_results[0]["bfloat16"])
    want, want_grads = _value_and_grads(lambda q, k, v: _dense(q, k, v, spec),
                                        *(x.astype(jnp.float32) for x in inputs))
    assert out.dtype == jnp.bfloat16
    err = lambda a, b: float(np.abs(np.asarray(a, np.float32) - np.asarray(b)).max())
    assert err(out, want) < 2e-2
    assert err(out, want) <= 1.5 * err(dense16, want) + 1e-3
    for got, d16, ref in zip(grads, dense16_grads, want_grads):
        assert err(got, ref) < 0.1
        assert err(got, ref) <= 1.5 * err(d16, ref) + 1e-2


def test_masked_blocks_are_never_read():
    """NaN values in keys no query block may see stay out of the output: the blocks are
    skipped (a computed block would give NaN * 0 = NaN), statically above the causal
    diagonal and beyond the window, dynamically beyond kv_lengths."""
    query, key, value = _qkv(10, num_queries=64, num_keys=64)
    poisoned = value.at[:, :, 32:40].set(jnp.nan)  # key block 4 of 8
    specs = (MaskSpec(causal=True), MaskSpec(causal=True, window=8),
             MaskSpec(kv_lengths=jnp.array([32, 16])))
    causal, window, padded = jax.jit(lambda q, k, v: [
        blockwise_attention(q, k, v, spec, block_q=8, block_k=8) for spec in specs])(
            query, key, poisoned)
    assert np.isfinite(np.asarray(causal[:, :, :32])).all()  # query blocks 0-3
    assert np.isfinite(np.asarray(window[:, :, 48:])).all()  # >= 8 past the block
    assert np.isfinite(np.asarray(padded)).all()
    # Dense reads them all: the same inputs give NaN.
    assert np.isnan(np.asarray(dot_product_attention(
        query, key, poisoned, dense_mask(specs[0], 64, 64))[0][:, :, :32])).any()


def test_gradient_temporaries_grow_linearly_in_length():
    """Compiled (not run) reverse mode at T and 4T: temporaries grow ~4x (dense: 16x)."""
    def temp_bytes(length):
        x = jax.ShapeDtypeStruct((1, 2, length, 32), jnp.float32)
        loss = lambda q, k, v: blockwise_attention(q, k, v, MaskSpec(causal=True), block_q=64,
                                                   block_k=64).sum()
        compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(x, x, x).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temp_bytes(2048) / temp_bytes(512) < 6

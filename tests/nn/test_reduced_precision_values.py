"""Reduced precision by value, not by the dtypes of a jaxpr (tests/nn/test_invariants.py):

- a fully masked attention row in bfloat16 / float16 (the dense function, blockwise, and
  whole models under precision="mixed" or dtype="bfloat16" with an all-PAD source row, for
  each attention implementation that runs here) is finite and equals what float32 computes
  on the same inputs, every row, with finite gradients;
- the tied output projection under precision="mixed" computes its logits from float32
  operands to float32: they equal float32(h) @ float32(E)^T of the model's own last hidden
  state h to float32 rounding, 100x tighter than bfloat16 logits (2^-9 relative) could be.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.nn.blockwise import blockwise_attention
from jaxformer.nn.mask_structure import MaskSpec, dense_mask

from conftest import numpy_params

B, H, T, K = 2, 2, 6, 8


def _inputs(dtype):
    r = np.random.default_rng(0)
    # logits up to ~+-6: a fill value or a softmax of the wrong dtype shows, a bf16 rounding not
    q, k, v = (jnp.asarray(r.normal(size=(B, H, T, K)) * s, dtype) for s in (1.5, 1.5, 1.0))
    return q, k, v


# Batch row 0: causal, plus keys 0..2 hidden for query 1 (which then sees nothing). Row 1:
# keys beyond 3 are padding, so queries 4 and 5 see keys 0..3 only.
SPEC = MaskSpec(causal=True, q_segment_ids=jnp.array([[1, 2, 1, 1, 1, 1], [1] * 6]),
                kv_segment_ids=jnp.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]))


def _dense(q, k, v, softcap=None):
    return jf.dot_product_attention(q, k, v, dense_mask(SPEC, T, T), softcap=softcap)[0]


def _blockwise(q, k, v, softcap=None):
    return blockwise_attention(q, k, v, SPEC, block_q=4, block_k=4, logit_softcap=softcap)


@pytest.mark.parametrize("attend,dtype,softcap", [
    (_dense, jnp.bfloat16, None), (_dense, jnp.float16, None), (_dense, jnp.bfloat16, 2.5),
    (_blockwise, jnp.bfloat16, None)],
    ids=["dense-bfloat16", "dense-float16", "dense-bfloat16-softcap", "blockwise-bfloat16"])
def test_masked_rows_in_reduced_precision_equal_float32(attend, dtype, softcap):
    q, k, v = _inputs(dtype)
    assert not np.asarray(dense_mask(SPEC, T, T))[0, 0, 1].any()  # a fully masked row

    def loss(q, k, v):
        out = attend(q, k, v, softcap)
        return jnp.sum(out.astype(jnp.float32) ** 2), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    # The reference: dense float32 on the same (rounded) inputs; blockwise gives a row that
    # sees no key 0 instead of the dense function's mean of the values (both finite).
    want = np.array(jax.jit(_dense, static_argnums=3)(
        *(x.astype(jnp.float32) for x in (q, k, v)), softcap))
    if attend is _blockwise:
        want[0, :, 1] = 0.0
    assert out.dtype == dtype
    got = np.asarray(out, np.float32)
    assert np.isfinite(got).all() and all(np.isfinite(np.asarray(g, np.float32)).all()
                                          for g in grads)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


SRC = np.array([[5, 6, 7, 8, 9], [0, 0, 0, 0, 0]], np.int32)  # row 1: an all-PAD source
TGT = np.array([[1, 5, 6, 7], [1, 3, 4, 9]], np.int32)


@pytest.mark.parametrize("impl", ["einsum", "jax", "blockwise"])
def test_an_all_pad_source_row_under_reduced_precision_matches_float32(impl):
    """Row 1's encoder self-attention and every decoder cross-attention row are fully
    masked: under precision="mixed" and dtype="bfloat16" the logits are finite and those of
    the float32 model (the same implementation: blockwise gives such rows 0, the dense
    paths the mean of the values) to bfloat16 accuracy."""
    config = jf.tiny(norm="pre", num_encoder_layers=1, num_decoder_layers=1,
                     attention_impl=impl)
    params = numpy_params(jf.Transformer(config), jnp.asarray(SRC), jnp.asarray(TGT), seed=2)
    variants = (config, config.replace(precision="mixed"), config.replace(dtype="bfloat16"))
    want, mixed, bf16 = (np.asarray(x) for x in jax.jit(lambda p: [
        jf.Transformer(c).apply({"params": p}, SRC, TGT) for c in variants])(params))
    for name, got in (("mixed", mixed), ("bfloat16", bf16)):
        assert got.dtype == np.float32 and np.isfinite(got).all(), name
        np.testing.assert_allclose(got, want, atol=0.05 * np.abs(want).max(), err_msg=name)


def test_tied_logits_under_mixed_precision_are_a_float32_product():
    config = jf.tiny(precision="mixed", tie_output_embedding=True, tied_output_bias=True,
                     num_encoder_layers=1, num_decoder_layers=1, tgt_vocab_size=64,
                     src_vocab_size=64, d_model=64, d_ff=64)
    model = jf.Transformer(config)
    src, tgt = jnp.asarray(SRC[:1] + 3), jnp.asarray(TGT[:1])
    params = numpy_params(model, src, tgt, seed=4)
    logits, state = jax.jit(lambda p: model.apply({"params": p}, src, tgt,
                                                  capture_intermediates=True,
                                                  mutable=["intermediates"]))(params)
    # norm="post": the last layer's output (bfloat16) is what the projection reads.
    hidden, _ = state["intermediates"]["decoder"]["layers_0"]["__call__"][0]
    assert hidden.dtype == jnp.bfloat16
    embedding = np.asarray(params["tgt_embed"]["embedding"], np.float64)  # (V, D), float32 values
    want = np.asarray(hidden, np.float64) @ embedding.T + np.asarray(
        params["decoder"]["logits_bias"], np.float64)
    got = np.asarray(logits, np.float64)
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * scale)
    # ... where bfloat16 logits would be off by about 2^-9 of the largest
    bf16 = np.asarray(jnp.asarray(want, jnp.bfloat16), np.float64)
    assert np.abs(bf16 - want).max() > 10 * 2e-5 * scale

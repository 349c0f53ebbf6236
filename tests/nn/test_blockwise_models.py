"""attention_impl="blockwise" in the models: the decoder-only LM's logits and gradients
equal the dense "einsum" path (float32) on packed segments, on a windowed model with
local and global layers, scanned; forward mode works; "auto" resolves visibly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.nn import stacking
from jaxformer.nn.attention_select import BLOCKWISE_MIN_LENGTH, resolved_attention_impl
from jaxformer.nn.mask_structure import MaskSpec, dense_mask
from jaxformer.train.data import LMBatch, segment_mask, segment_mask_spec
from jaxformer.train import loss_and_metrics, model_logits

# 300 tokens: two query and two key blocks of the default 256, the second one padded.
SEQ = 300
SEGMENT_LENGTHS = (120, 140, 30)  # then 10 PAD
GQA_WINDOWED = jf.llama(num_heads=4, num_kv_heads=2, tgt_vocab_size=50, src_vocab_size=50,
                        max_len=SEQ, num_decoder_layers=2, sliding_window=70,
                        attention_pattern="LG", attn_logit_softcapping=5.0, query_scale=0.3,
                        qk_norm=True)


def packed_batch() -> LMBatch:
    rng = np.random.default_rng(0)
    segments = np.concatenate([np.full(n, i + 1) for i, n in enumerate(SEGMENT_LENGTHS)]
                              + [np.zeros(SEQ - sum(SEGMENT_LENGTHS))]).astype(np.int32)
    positions = np.concatenate([np.arange(n) for n in SEGMENT_LENGTHS]
                               + [np.zeros(SEQ - sum(SEGMENT_LENGTHS))]).astype(np.int32)
    tokens = np.where(segments > 0, rng.integers(3, 50, SEQ), 0).astype(np.int32)
    weights = (segments > 0).astype(np.float32)
    return LMBatch(inputs=tokens[None], labels=np.roll(tokens, -1)[None], weights=weights[None],
                   positions=positions[None], segments=segments[None])


def loss_and_logits(config, params, batch):
    model = jf.DecoderOnlyLM(config)
    logits_BTV, labels_BT, weights_BT = model_logits(model, params, batch)
    loss, _ = loss_and_metrics(logits_BTV, labels_BT, pad_id=None, weights_BT=weights_BT)
    return loss, logits_BTV * weights_BT[..., None]  # PAD rows differ (both finite)


@pytest.fixture(scope="module")
def einsum_reference():
    """(params, ((loss, logits), grads)) of the dense "einsum" path, unscanned."""
    batch = packed_batch()
    params = jax.jit(jf.DecoderOnlyLM(GQA_WINDOWED).init)(jax.random.PRNGKey(0),
                                                          batch.inputs[:, :8])["params"]
    return params, step(GQA_WINDOWED, params, batch)


def step(config, params, batch):
    lowered = jax.jit(jax.value_and_grad(lambda p: loss_and_logits(config, p, batch),
                                         has_aux=True)).lower(params)
    # No (T, T) array anywhere in the blockwise step (the dense one has them).
    assert (f"{SEQ}x{SEQ}x" in lowered.as_text()) == (config.attention_impl == "einsum")
    return lowered.compile()(params)


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unrolled", "scanned"])
def test_blockwise_lm_equals_einsum_on_packed_segments_forward_and_gradients(
        einsum_reference, scan_layers):
    """Packed documents, GQA, soft cap, query scale, qk-norm, a local and a global layer;
    scanned, one scan body serves both kinds."""
    params, ((loss_e, logits_e), grads_e) = einsum_reference
    config = GQA_WINDOWED.replace(attention_impl="blockwise", scan_layers=scan_layers)
    (loss_b, logits_b), grads_b = step(config, stacking.to_layout(params, scan_layers),
                                       packed_batch())
    grads_b = stacking.to_layout(grads_b, False)
    np.testing.assert_allclose(logits_b, logits_e, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(loss_b, loss_e, rtol=1e-6)
    for g_b, g_e in zip(jax.tree_util.tree_leaves(grads_b), jax.tree_util.tree_leaves(grads_e)):
        np.testing.assert_allclose(g_b, g_e, atol=2e-5, rtol=1e-4)


def test_the_packed_mask_spec_is_the_dense_segment_mask():
    segments = packed_batch().segments
    np.testing.assert_array_equal(dense_mask(segment_mask_spec(segments), SEQ, SEQ),
                                  segment_mask(segments))


def test_default_mask_and_forward_mode_through_the_blockwise_model():
    """The LM's default MaskSpec hides PAD keys (amid the tokens) like the dense mask,
    and jax.jvp goes through the blockwise model."""
    config = GQA_WINDOWED.replace(num_decoder_layers=1, max_len=40)
    tokens = jnp.asarray([[5, 0, 7, 8, 0, 9] * 5], jnp.int32)
    params = jax.jit(jf.DecoderOnlyLM(config).init)(jax.random.PRNGKey(1), tokens)["params"]
    tangent = jax.tree_util.tree_map(jnp.ones_like, params)
    out = {}
    for impl in ("einsum", "blockwise"):
        model = jf.DecoderOnlyLM(config.replace(attention_impl=impl))
        out[impl] = jax.jit(lambda t, m=model: jax.jvp(
            lambda p: m.apply({"params": p}, tokens), (params,), (t,)))(tangent)
    np.testing.assert_allclose(out["blockwise"][0], out["einsum"][0], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(out["blockwise"][1], out["einsum"][1], atol=1e-4, rtol=1e-4)


def test_auto_resolves_visibly_and_refuses_attention_dropout():
    auto = jf.llama(attention_impl="auto")
    assert resolved_attention_impl(auto, BLOCKWISE_MIN_LENGTH - 1, platform="cpu") == "einsum"
    assert resolved_attention_impl(auto, BLOCKWISE_MIN_LENGTH, platform="cpu") == "blockwise"
    assert resolved_attention_impl(auto.replace(dtype="bfloat16"), 4096, platform="cuda",
                                   mask=MaskSpec(causal=True)) == "cudnn"
    assert resolved_attention_impl(auto.replace(dtype="bfloat16", attn_logit_softcapping=30.0),
                                   4096, platform="cuda") == "blockwise"
    assert resolved_attention_impl(auto.replace(attention_impl="einsum"), 8192) == "einsum"
    for impl in ("blockwise", "auto"):
        with pytest.raises(ValueError, match="attention_impl"):
            jf.llama(attention_impl=impl, attention_dropout=0.1)

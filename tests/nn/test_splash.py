"""Pallas splash attention under attention_impl="auto" on TPU: its numbers equal the dense
path (the kernel in Pallas' interpreter, on this CPU), "auto" picks it only where its
constraints hold, and a model lowered for TPU from this host calls the kernel."""

import jax
import jax.numpy as jnp
import numpy as np

import jaxformer as jf
from jaxformer.nn.attention import dot_product_attention
from jaxformer.nn.attention_select import choose_attention_impl, target_platform
from jaxformer.nn.mask_structure import MaskSpec, dense_mask
from jaxformer.nn.splash import splash_attention

B, H, G, T, K = 2, 4, 2, 256, 128
SEGMENTS = jnp.asarray([[1] * 100 + [2] * 156, [1] * 256], jnp.int32)


def test_splash_equals_dense_attention_with_window_segments_gqa_and_softcap():
    r = np.random.default_rng(0)
    q, k, v = (jnp.asarray(r.normal(size=shape), jnp.float32)
               for shape in ((B, H, T, K), (B, G, T, K), (B, G, T, K)))
    spec = MaskSpec(causal=True, window=50, q_segment_ids=SEGMENTS, kv_segment_ids=SEGMENTS)
    got = jax.jit(lambda q, k, v: splash_attention(q, k, v, spec, scale=0.2, logit_softcap=5.0,
                                                   interpret=True))(q, k, v)
    want = dot_product_attention(q, k, v, dense_mask(spec, T, T), scale=0.2, softcap=5.0)[0]
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_auto_picks_splash_on_tpu_only_where_it_applies():
    causal = MaskSpec(causal=True)
    assert choose_attention_impl("tpu", 128, jnp.bfloat16, causal, 2048) == "splash"
    assert choose_attention_impl("tpu", 128, jnp.float32, causal, 512, shape=(256, 512)) == "splash"
    assert choose_attention_impl("cpu", 128, jnp.float32, causal, 2048) == "blockwise"
    for head_dim, mask, shape in [
            (64, causal, (2048, 2048)),                                   # head dim
            (128, causal, (2000, 2048)),                                  # not whole blocks
            (128, MaskSpec(causal=True, kv_lengths=jnp.array([5])), (2048, 2048)),
            (128, MaskSpec(causal=True, q_offset=256), (2048, 2048)),     # a prefill chunk
            (128, MaskSpec(causal=True, prefix_length=4), (2048, 2048))]:
        assert choose_attention_impl("tpu", head_dim, jnp.float32, mask, 2048,
                                     shape=shape) == "blockwise"


def test_a_model_lowered_for_tpu_calls_the_splash_kernel():
    """The LM's loss and gradients under "auto", lowered for TPU on this CPU host inside
    `target_platform("tpu")`: Mosaic custom calls; for CPU, none."""
    config = jf.llama(num_heads=2, num_kv_heads=1, head_dim=128, d_model=64, d_ff=128,
                      num_decoder_layers=1, tgt_vocab_size=32, src_vocab_size=32,
                      max_len=T, attention_impl="auto")
    model = jf.DecoderOnlyLM(config)
    tokens = jax.ShapeDtypeStruct((1, T), jnp.int32)
    params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0),
                                               jnp.zeros((1, 8), jnp.int32))["params"])
    def step():  # a fresh jit each time: the platform is not part of jit's cache key
        return jax.jit(jax.grad(lambda p, t: model.apply({"params": p}, t).sum()))

    with target_platform("tpu"):
        tpu = step().trace(params, tokens).lower(lowering_platforms=("tpu",)).as_text()
    cpu = step().trace(params, tokens).lower().as_text()
    assert tpu.count("tpu_custom_call") >= 2  # forward and backward kernels
    assert "tpu_custom_call" not in cpu

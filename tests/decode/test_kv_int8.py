"""The int8 decode cache (`config.kv_cache_quant="int8"`, `nn.kv_quant`): keys and values
stored as int8 with per-(head, token) scales decode the float cache's greedy tokens, through
every path that touches the cache (one-pass and chunked prefill, segments, sliding-window
rings, beam search), in well under half the bytes."""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.decode import api as decoding
from jaxformer.decode import cache as cache_lib
from jaxformer.nn.attention import KV
from jaxformer.nn.kv_quant import QuantKV, dequantize_kv, quantize_kv

# Layers L, G, L: window 3 < the prompts; GQA; head_dim 16.
CONFIG = jf.tiny(num_encoder_layers=0, num_decoder_layers=3, num_kv_heads=2, d_model=64,
                 sliding_window=3, attention_pattern="LG", rope="half", head_dim=16,
                 decoder_positions="none", norm="pre", norm_type="rmsnorm", max_len=32)
INT8 = CONFIG.replace(kv_cache_quant="int8")


@pytest.fixture(scope="module")
def lm(make_lm):
    model, params = make_lm(CONFIG, seed=3)
    prompt = np.random.default_rng(7).integers(3, 16, (3, 9)).astype(np.int32)
    lengths = np.array([9, 5, 7])
    for row, n in enumerate(lengths):
        prompt[row, n:] = CONFIG.pad_id
    return model, params, prompt, lengths


@pytest.fixture(scope="module")
def float_run(lm):
    model, params, prompt, lengths = lm
    return decoding.generate(model, params, prompt, max_new_tokens=10, prompt_lengths=lengths,
                             return_logits=True)


def test_int8_cache_decodes_the_float_caches_tokens(lm, float_run):
    _, params, prompt, lengths = lm
    got = decoding.generate(jf.DecoderOnlyLM(INT8), params, prompt, max_new_tokens=10,
                            prompt_lengths=lengths, return_logits=True)
    np.testing.assert_array_equal(got.tokens, float_run.tokens)
    diff = np.abs(np.asarray(got.logits) - np.asarray(float_run.logits)).max()
    assert 0 < diff < 0.02 * np.abs(np.asarray(float_run.logits)).max()  # it did round


@pytest.mark.parametrize("options", [dict(prefill_chunk=4), dict(segments=2)],
                         ids=["chunked_prefill", "segments"])
def test_int8_cache_through_chunks_and_segments(lm, float_run, options):
    _, params, prompt, lengths = lm
    got = decoding.generate(jf.DecoderOnlyLM(INT8), params, prompt, max_new_tokens=10,
                            prompt_lengths=lengths, **options)
    np.testing.assert_array_equal(got.tokens, float_run.tokens)


@pytest.mark.parametrize("head_axis", [1, 2], ids=["heads_major", "jax_layout"])
def test_int8_scales_are_per_head_and_token_and_round_within_half_a_step(head_axis):
    """Guards the int8 cache's scales taken over the wrong axis (shared across heads or
    tokens: the engine's 2 % logit tolerance lets it pass): each (head, token)'s scale is
    its own absmax over K / 127, and every value comes back within half a step of that
    scale, on heads and tokens whose magnitudes differ by orders of magnitude."""
    rng = np.random.default_rng(11)
    batch, heads, tokens, dim = 2, 3, 5, 16
    magnitude = 10.0 ** rng.uniform(-3, 2, (batch, heads, tokens, 1))
    keys_BGTK = (rng.normal(size=(batch, heads, tokens, dim)) * magnitude).astype(np.float32)
    values_BGTK = (rng.normal(size=(batch, heads, tokens, dim)) * magnitude[:, ::-1]
                   ).astype(np.float32)
    in_layout = (lambda x: x) if head_axis == 1 else (lambda x: np.swapaxes(x, 1, 2))
    quantized = quantize_kv(KV(jnp.asarray(in_layout(keys_BGTK)),
                               jnp.asarray(in_layout(values_BGTK))))
    back = dequantize_kv(quantized, jnp.float32)
    for x, q, scale, got in ((keys_BGTK, quantized.key, quantized.key_scale, back.key),
                             (values_BGTK, quantized.value, quantized.value_scale, back.value)):
        x = in_layout(x)
        own_scale = np.abs(x).max(-1) / 127.0
        assert q.dtype == jnp.int8 and scale.shape == x.shape[:-1]
        np.testing.assert_allclose(np.asarray(scale), own_scale, rtol=1e-6, atol=0)
        error = np.abs(np.asarray(got) - x)
        assert (error <= 0.5 * own_scale[..., None] * (1 + 1e-5)).all()
        assert error.max() > 0  # it did round


def test_int8_cache_holds_int8_in_under_a_third_of_the_bytes():
    """(K + 4) / (4 K) of a float32 cache: 0.27 at head_dim 64; here K = 16: 0.3125."""
    config = INT8.replace(sliding_window=None, attention_pattern=None)
    cache = cache_lib.init_cache(config, 2, 16)
    assert all(isinstance(kv, QuantKV) and kv.key.dtype == jnp.int8 for kv in cache.self_kv)
    ratio = cache_lib.cache_bytes(cache) / cache_lib.cache_bytes(
        cache_lib.init_cache(config.replace(kv_cache_quant=None), 2, 16))
    assert ratio == (16 + 4) / (4 * 16)
    wide = config.replace(d_model=256, num_heads=4, head_dim=64)
    assert cache_lib.cache_bytes(cache_lib.init_cache(wide, 1, 8)) / cache_lib.cache_bytes(
        cache_lib.init_cache(wide.replace(kv_cache_quant=None), 1, 8)) < 0.3
    with pytest.raises(ValueError, match="kv_cache_quant"):
        cache_lib.check_cache(cache, config.replace(kv_cache_quant=None))
    with pytest.raises(ValueError, match="kv_cache_quant must be None or 'int8'"):
        CONFIG.replace(kv_cache_quant="int4")


def test_beam_search_reorders_an_int8_cache(make_transformer, tokens):
    config = jf.tiny()
    model, params = make_transformer(config, seed=2)
    src = tokens(3, (2, 6))
    want = jf.beam_search(model, params, src, max_new_tokens=6, beam_size=3)
    got = jf.beam_search(jf.Transformer(config.replace(kv_cache_quant="int8")), params, src,
                         max_new_tokens=6, beam_size=3)
    np.testing.assert_array_equal(got.tokens, want.tokens)

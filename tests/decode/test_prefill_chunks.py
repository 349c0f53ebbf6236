"""Chunked prefill (`generate(..., prefill_chunk=C)`): the prompt fills the cache C tokens
at a time and decodes exactly like the one-pass prefill, on a model whose sliding-window
rings wrap inside the prompt, with grouped-query attention and ragged prompts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.decode import api as decoding
from jaxformer.decode import cache as cache_lib
from jaxformer.decode.inputs import left_align

# Layers L, G, L: window 3 < the prompts (11 and 6 tokens), 4 query heads on 2 kv heads.
CONFIG = jf.tiny(num_encoder_layers=0, num_decoder_layers=3, num_kv_heads=2,
                 sliding_window=3, attention_pattern="LG", rope="half",
                 decoder_positions="none", norm="pre", norm_type="rmsnorm", max_len=32)
LENGTHS = np.array([11, 6])


@pytest.fixture(scope="module")
def case(make_lm):
    model, params = make_lm(CONFIG, seed=3)
    out_bias = params["decoder"]["out_proj"]["bias"]  # EOS never: every row runs 8 steps
    params["decoder"]["out_proj"]["bias"] = np.where(np.arange(len(out_bias)) == 2, -1e3,
                                                     out_bias)
    prompt = np.random.default_rng(7).integers(3, 16, (2, 11)).astype(np.int32)
    prompt[1, LENGTHS[1]:] = CONFIG.pad_id
    one = decoding.generate(model, params, prompt, max_new_tokens=8, prompt_lengths=LENGTHS,
                            return_logits=True)
    return model, params, prompt, one


def test_chunked_prefill_equals_one_pass(case):
    """4 does not divide 11 (a 3-token lead, then two chunks) and exceeds the window."""
    model, params, prompt, one = case
    got = decoding.generate(model, params, prompt, max_new_tokens=8, prompt_lengths=LENGTHS,
                            return_logits=True, prefill_chunk=4)
    np.testing.assert_array_equal(got.tokens, one.tokens)
    np.testing.assert_allclose(got.logits, one.logits, atol=2e-5, rtol=1e-5)


def test_chunked_prefill_fills_the_cache_like_one_pass(case):
    """The cache itself (rings and the global layer's slots) and the last logits, under
    jit and vmap over two prompts (each a batch of one), with chunks of 2: below the
    window, a 1-token lead then five chunks."""
    model, params, prompt, _ = case
    aligned = left_align(jnp.asarray(prompt), jnp.asarray(LENGTHS), CONFIG.pad_id)

    def fill(row_P, start, chunk):
        cache = cache_lib.init_cache(CONFIG, 1, 16).replace(start_B=start[None])
        return cache_lib.prefill(model, params, cache, row_P[None], chunk)

    starts = jnp.asarray(11 - LENGTHS, jnp.int32)
    one, got = jax.jit(lambda a, s: (jax.vmap(lambda r, t: fill(r, t, None))(a, s),
                                     jax.vmap(lambda r, t: fill(r, t, 2))(a, s)))(aligned, starts)
    np.testing.assert_allclose(got[0], one[0], atol=2e-5, rtol=1e-5)
    assert int(got[1].index[0]) == 11
    for kv_got, kv_one in zip(got[1].self_kv, one[1].self_kv):
        for x, y in zip(kv_got, kv_one):  # slots before a row's start are never read
            np.testing.assert_allclose(x[1, ..., 5:, :] if x.shape[-2] == 16 else x[1],
                                       y[1, ..., 5:, :] if y.shape[-2] == 16 else y[1],
                                       atol=2e-5)
            np.testing.assert_allclose(x[0], y[0], atol=2e-5)


@pytest.mark.parametrize("chunk, error", [(0, ValueError), (-3, ValueError),
                                          (2.5, TypeError)])
def test_bad_prefill_chunk_is_refused_before_compiling(case, chunk, error):
    model, params, prompt, _ = case
    before = dict(decoding.TRACE_COUNTS)
    with pytest.raises(error, match="prefill_chunk"):
        decoding.generate(model, params, prompt, max_new_tokens=2, prefill_chunk=chunk)
    assert dict(decoding.TRACE_COUNTS) == before

"""The decode cache: a checked pytree, and the cached step == the parallel forward pass."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.decode import cache as cache_lib
from jaxformer.nn.attention import dot_product_attention


def test_init_cache_shapes_and_pytree():
    config = jf.tiny()
    cache = cache_lib.init_cache(config, batch=3, max_len=7)
    cache_lib.check_cache(cache, config)
    assert len(cache.self_kv) == config.num_decoder_layers
    chex.assert_shape(cache.self_kv[0].key, (3, config.num_heads, 7, config.head_dim))
    assert (cache.batch, cache.max_len, int(cache.index)) == (3, 7, 0)
    # A pytree: it goes through jit and tree_map with its named fields intact.
    doubled = jax.jit(lambda c: c.replace(index=c.index + 2))(cache)
    assert int(doubled.index) == 2 and isinstance(doubled, cache_lib.DecodeCache)
    assert len(jax.tree_util.tree_leaves(cache)) == 2 * config.num_decoder_layers + 2


@pytest.mark.parametrize("kwargs, match", [
    pytest.param(dict(batch=0, max_len=4), "batch", id="zero_batch"),
    pytest.param(dict(batch=2, max_len=0), "max_len", id="zero_slots"),
    pytest.param(dict(batch=2, max_len=33), "max_len", id="beyond_config_max_len"),
])
def test_init_cache_rejects_bad_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        cache_lib.init_cache(jf.tiny(), **kwargs)


def test_check_cache_rejects_a_cache_of_another_config():
    cache = cache_lib.init_cache(jf.tiny(), batch=2, max_len=4)
    with pytest.raises(ValueError, match="layers"):
        cache_lib.check_cache(cache, jf.tiny(num_decoder_layers=3))
    with pytest.raises(AssertionError):
        cache_lib.check_cache(cache, jf.tiny(num_heads=2))


def test_single_query_attention_equals_all_queries_at_once():
    """Attending one query at a time (a decode step) == all queries in one call."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=shape), jnp.float32)
               for shape in ((2, 4, 3, 8), (2, 4, 6, 8), (2, 4, 6, 8)))  # (B, H, T|S, K)
    mask = jnp.asarray(rng.random((2, 1, 3, 6)) < 0.7)
    out, weights = dot_product_attention(q, k, v, mask)
    for t in range(3):
        out_t, weights_t = dot_product_attention(q[:, :, t:t + 1], k, v, mask[:, :, t:t + 1])
        np.testing.assert_allclose(out_t[:, :, 0], out[:, :, t], atol=1e-6)
        np.testing.assert_allclose(weights_t[:, :, 0], weights[:, :, t], atol=1e-6)


def _lm(norm):
    config = jf.tiny(norm=norm, num_encoder_layers=0)
    model = jf.DecoderOnlyLM(config)
    tokens = jnp.asarray(np.random.default_rng(4).integers(3, 16, (2, 9)), jnp.int32)
    return config, model, model.init(jax.random.PRNGKey(0), tokens)["params"], tokens


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_step_by_step_and_prefill_equal_the_parallel_pass(norm):
    """Feeding tokens one at a time (query at slot t sees keys 0..t), or a prefill then
    steps, gives the logits of one causal forward pass over the whole sequence."""
    config, model, params, tokens = _lm(norm)
    full = model.apply({"params": params}, tokens, jf.causal_mask(tokens.shape[1]))
    step = jax.jit(lambda c, t: cache_lib.cached_forward(model, params, c, t))

    cache = cache_lib.init_cache(config, 2, 12)  # more slots than tokens: spare slots hidden
    for t in range(tokens.shape[1]):
        logits, cache = step(cache, tokens[:, t:t + 1])
        np.testing.assert_allclose(logits[:, 0], full[:, t], atol=1e-5, rtol=1e-5)
    assert int(cache.index) == tokens.shape[1]

    cache = cache_lib.init_cache(config, 2, 12)
    prefill, cache = step(cache, tokens[:, :5])
    np.testing.assert_allclose(prefill, full[:, :5], atol=1e-5, rtol=1e-5)
    for t in range(5, tokens.shape[1]):
        logits, cache = step(cache, tokens[:, t:t + 1])
        np.testing.assert_allclose(logits[:, 0], full[:, t], atol=1e-5, rtol=1e-5)


def test_fold_moves_the_chunk_into_the_past_and_steps_continue_exactly():
    """A prefill of 5 slots folded into the past, then steps in chunks of 2 folded in
    turn: the logits of the one causal forward pass, and the past holds the keys
    and values written so far, in slot order."""
    config, model, params, tokens = _lm("pre")
    full = model.apply({"params": params}, tokens, jf.causal_mask(tokens.shape[1]))
    step = jax.jit(lambda c, t: cache_lib.cached_forward(model, params, c, t))
    cache = cache_lib.init_cache(config, 2, 5)
    _, cache = step(cache, tokens[:, :5])
    written = cache.self_kv
    cache = cache_lib.fold(cache, 2)
    assert (cache.past_len, cache.max_len, int(cache.index)) == (5, 7, 5)
    cache_lib.check_cache(cache, config)
    for ours, ref in zip(jax.tree.leaves(cache.past_kv), jax.tree.leaves(written)):
        np.testing.assert_array_equal(ours, ref)
    assert not any(np.any(x) for x in jax.tree.leaves(cache.self_kv))  # a fresh chunk
    for t in range(5, tokens.shape[1]):
        if t in (7,):
            cache = cache_lib.fold(cache, 2)
        logits, cache = step(cache, tokens[:, t:t + 1])
        np.testing.assert_allclose(logits[:, 0], full[:, t], atol=1e-5, rtol=1e-5)
    assert (cache.past_len, cache.max_len) == (7, 9)


def test_cached_step_sees_earlier_keys_and_not_unwritten_slots():
    """The causal rule of a cached step, shown directly."""
    config, model, params, tokens = _lm("post")
    step = jax.jit(lambda c, t: cache_lib.cached_forward(model, params, c, t))
    cache = cache_lib.init_cache(config, 2, 9)
    _, cache_after_3 = step(cache, tokens[:, :3])
    changed_first = tokens.at[:, 0].set(3 + (tokens[:, 0] - 2) % 13)
    _, other_cache = step(cache, changed_first[:, :3])
    same, _ = step(cache_after_3, tokens[:, 3:4])
    different, _ = step(other_cache, tokens[:, 3:4])
    assert not np.allclose(same, different)  # key 0 is visible to the query at slot 3
    # Garbage in unwritten slots is invisible: write noise past the index.
    noisy = cache_after_3.replace(self_kv=tuple(
        type(kv)(kv.key.at[:, :, 4:].set(99.0), kv.value.at[:, :, 4:].set(-99.0))
        for kv in cache_after_3.self_kv))
    noisy_logits, _ = step(noisy, tokens[:, 3:4])
    np.testing.assert_allclose(noisy_logits, same, atol=1e-6)


def test_left_padded_rows_match_unpadded_rows():
    """A row starting at slot s (start_B) decodes as if it started at slot 0."""
    config, model, params, tokens = _lm("pre")
    step = jax.jit(lambda c, t: cache_lib.cached_forward(model, params, c, t))
    plain, _ = step(cache_lib.init_cache(config, 2, 9), tokens[:, :4])
    shifted = jnp.concatenate([jnp.full((2, 3), 7, jnp.int32), tokens[:, :4]], axis=1)
    cache = cache_lib.init_cache(config, 2, 9).replace(start_B=jnp.array([3, 3], jnp.int32))
    padded, _ = step(cache, shifted)
    np.testing.assert_allclose(padded[:, 3:], plain, atol=1e-5, rtol=1e-5)


def test_self_attention_mask_is_a_per_row_range():
    cache = cache_lib.init_cache(jf.tiny(), 2, 5).replace(
        index=jnp.array(2, jnp.int32), start_B=jnp.array([0, 1], jnp.int32))
    mask = cache_lib.self_attention_mask(cache, 2)
    np.testing.assert_array_equal(mask[:, 0], [
        [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]],
        [[0, 1, 1, 0, 0], [0, 1, 1, 1, 0]]])
    np.testing.assert_array_equal(cache_lib.positions(cache, 2), [[2, 3], [1, 2]])

"""jaxformer.prng: the fused threefry draws exactly what JAX's threefry draws, in one
kernel without loops, whatever `jax_threefry_partitionable` says."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import prng

KEY = jax.random.PRNGKey(1234)
SHAPES = [(), (1,), (7,), (4, 7, 3), (32, 33, 64)]


def _same(a, b):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [jnp.uint8, jnp.uint16, jnp.uint32])
def test_random_bits_equal_jax_threefry(shape, dtype):
    for key in (KEY, jax.random.fold_in(KEY, 99)):
        _same(jax.random.bits(prng.fused(key), shape, dtype),
              jax.random.bits(key, shape, dtype))


def test_keys_and_distributions_equal_jax_threefry():
    fused = prng.fused(KEY)
    _same(jax.random.key_data(jax.random.fold_in(fused, 7)), jax.random.fold_in(KEY, 7))
    _same(jax.random.key_data(jax.random.split(fused, (3, 2))), jax.random.split(KEY, (3, 2)))
    _same(jax.random.key_data(jax.random.key(5, impl=prng.FUSED_THREEFRY)),
          jax.random.PRNGKey(5))
    _same(jax.random.bernoulli(fused, 0.9, (64, 33)), jax.random.bernoulli(KEY, 0.9, (64, 33)))
    _same(jax.random.normal(fused, (5, 6)), jax.random.normal(KEY, (5, 6)))
    logits = jax.random.normal(KEY, (8, 50))
    _same(jax.random.categorical(fused, logits), jax.random.categorical(KEY, logits))
    # and the bits are not the key's own words, nor another key's
    assert not np.array_equal(jax.random.bits(fused, (64,)),
                              jax.random.bits(prng.fused(jax.random.PRNGKey(1)), (64,)))


def test_the_fallback_for_huge_arrays_draws_the_same(monkeypatch):
    expected = jax.random.bits(KEY, (6, 5))
    monkeypatch.setattr(prng, "_huge", lambda shape: True)  # > 2**32 elements: JAX's path
    _same(jax.random.bits(prng.fused(KEY), (6, 5)), expected)


def test_bits_do_not_depend_on_the_partitionable_flag():
    fused = jax.random.fold_in(prng.fused(KEY), 3)
    with_flag = jax.random.bits(fused, (9, 11))
    try:
        jax.config.update("jax_threefry_partitionable", False)
        assert not np.array_equal(jax.random.bits(jax.random.fold_in(KEY, 3), (9, 11)),
                                  with_flag)  # JAX's own bits change with the flag ...
        _same(jax.random.bits(fused, (9, 11)), with_flag)  # ... the fused ones do not
    finally:
        jax.config.update("jax_threefry_partitionable", True)


def test_a_dropout_mask_compiles_to_one_loop_free_kernel():
    def mask(key):
        return jax.random.bernoulli(jax.random.fold_in(key, 3), 0.9, (32, 33, 256))

    fused = jax.jit(mask).lower(prng.fused(KEY)).compile().as_text()
    plain = jax.jit(mask).lower(jax.random.wrap_key_data(KEY)).compile().as_text()
    assert " while(" not in fused
    if jax.default_backend() == "cpu":  # what the module works around: JAX's rolled loop
        assert " while(" in plain


def test_the_train_steps_dropout_key_is_jax_fold_in_without_a_loop():
    from jaxformer.training import dropout_key

    for step in (0, 7, 2 ** 31 - 1):
        _same(jax.random.key_data(dropout_key(KEY, jnp.int32(step))), jax.random.fold_in(KEY, step))
    compiled = jax.jit(dropout_key).lower(KEY, jnp.int32(3)).compile().as_text()
    assert " while(" not in compiled

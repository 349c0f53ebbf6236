"""jaxformer.dropout: the mask is flax's and JAX's, bit for bit, and XLA computes it
once however many users it has."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import prng
from jaxformer.dropout import Dropout, apply_dropout, keep_mask

KEY = jax.random.PRNGKey(7)


@pytest.mark.parametrize("key", [KEY, prng.fused(KEY)], ids=["raw", "fused"])
def test_keep_mask_is_jax_bernoulli(key):
    for shape in [(), (5,), (32, 33, 64)]:
        expected = jax.random.bernoulli(key, 0.9, shape)
        np.testing.assert_array_equal(keep_mask(key, 0.9, shape), expected)
        np.testing.assert_array_equal(
            jax.jit(keep_mask, static_argnums=(1, 2))(key, 0.9, shape), expected)
    assert not np.array_equal(keep_mask(key, 0.9, (64,)), keep_mask(key, 0.5, (64,)))


class _Sublayer(nn.Module):
    """Two dropout sites as the model's layers name them: one auto-named, one from setup."""

    dropout_cls: type

    def setup(self):
        self.dropout = self.dropout_cls(0.25)

    @nn.compact
    def __call__(self, x):
        h = self.dropout_cls(0.1)(nn.Dense(8)(x), deterministic=False)
        return self.dropout(h, deterministic=False)


def test_dropout_is_flax_dropout_values_and_gradients():
    x = jax.random.normal(KEY, (4, 6, 8))
    ours, flax_ = _Sublayer(Dropout), _Sublayer(nn.Dropout)
    params = flax_.init(KEY, x)["params"]
    assert jax.tree.structure(ours.init(KEY, x)["params"]) == jax.tree.structure(params)

    def loss(module, params, x):
        out = module.apply({"params": params}, x, rngs={"dropout": prng.fused(KEY)})
        return jnp.sum(out ** 2), out

    (l1, out1), g1 = jax.jit(jax.value_and_grad(lambda p: loss(ours, p, x), has_aux=True))(params)
    (l2, out2), g2 = jax.jit(jax.value_and_grad(lambda p: loss(flax_, p, x),
                                                has_aux=True))(params)
    np.testing.assert_array_equal(out1 == 0, out2 == 0)  # the same mask
    np.testing.assert_allclose(out1, out2, rtol=1e-6)
    assert 0 < np.mean(np.asarray(out1) == 0) < 0.5  # some, not all, dropped
    np.testing.assert_allclose(l1, l2, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g1, g2)
    # another key, another mask
    other = ours.apply({"params": params}, x, rngs={"dropout": prng.fused(KEY + 1)})
    assert not np.array_equal(other, out1)


def test_broadcast_dims_share_one_draw_as_flax():
    x = jnp.ones((4, 6, 8))
    for dims in [(), (0,), (1, 2)]:
        out = Dropout(0.5, broadcast_dims=dims).apply({}, x, deterministic=False,
                                                      rngs={"dropout": KEY})
        np.testing.assert_array_equal(out, nn.Dropout(0.5, broadcast_dims=dims).apply(
            {}, x, deterministic=False, rngs={"dropout": KEY}))
        for d in dims:  # constant along a broadcast dimension
            np.testing.assert_array_equal(out, jnp.broadcast_to(
                jnp.take(out, jnp.array([0]), axis=d), out.shape))


def test_rates_zero_one_and_eval_mode():
    x = jnp.ones((3, 5))
    rngs = {"dropout": KEY}
    assert Dropout(0.0).apply({}, x, deterministic=False, rngs=rngs) is x
    assert Dropout(0.5).apply({}, x, deterministic=True) is x
    np.testing.assert_array_equal(Dropout(1.0).apply({}, x, deterministic=False, rngs=rngs), 0)


def _hash_kernels(hlo_text: str, shape: tuple) -> int:
    """Compiled computations that run threefry's rotations on an array of `shape`."""
    dims = ",".join(map(str, shape))
    computations = re.split(r"\n(?=%|ENTRY)", hlo_text)
    return sum(bool(re.search(rf"u32\[{dims}\]\S* shift-left\(", c)) for c in computations)


def test_the_mask_is_computed_once_for_forward_and_backward():
    shape = (64, 128)
    w = jax.random.normal(KEY, (128, 128))

    def loss(w, x, key):  # the mask has users in the forward and in both gradients
        h = apply_dropout(jax.nn.relu(x @ w), 0.1, key)
        return jnp.sum((h @ w) ** 2)

    x = jax.random.normal(KEY, shape)
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(w, x, prng.fused(KEY)).compile().as_text()
    assert _hash_kernels(hlo, shape) == 1
    # the counter really finds the hash: a mask drawn twice (two keys) is two kernels
    def twice(w, x, key):
        return loss(w, x, key) + loss(w, x, jax.random.fold_in(key, 1))
    hlo = jax.jit(jax.grad(twice, argnums=(0, 1))).lower(w, x, prng.fused(KEY)).compile().as_text()
    assert _hash_kernels(hlo, shape) == 2

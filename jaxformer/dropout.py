"""Dropout whose mask is drawn once per step, in a computation of its own.

`keep_mask(rng, keep_prob, shape)` is `jax.random.bernoulli(rng, keep_prob,
shape)`, the same bits, drawn inside a `lax.cond` whose predicate is always
true. XLA cannot fuse across a conditional, so the mask is computed once and
stored (one byte an element) for its users. Without it XLA fuses the cheap-looking
threefry hash (20 rounds of integer adds, shifts and xors) into every consumer:
the forward select, the backward select and the transposes feeding the weight
gradients each recompute it, and each copy is code XLA compiles again. On the
bench train step (42 dropout sites) that was about 5,000 hash instructions in
124 kernels; with the conditional it is one kernel per site. The step compiles in
about 8.4 instead of 10.4 s (`python benchmarks/breakdown.py compile`), with the same
losses, bit for bit, and the same step time.

`Dropout` is `flax.linen.Dropout` (a subclass of the same name, so the same
auto-named scopes and `make_rng` keys, and the same output) drawing its mask
with `keep_mask`.
"""

from __future__ import annotations

from typing import Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def keep_mask(rng: jax.Array, keep_prob: float, shape: Sequence[int]) -> jnp.ndarray:
    """Boolean (shape): True with probability `keep_prob`; equal to
    `jax.random.bernoulli(rng, keep_prob, shape)`, drawn in a conditional XLA
    does not fuse into the mask's users."""
    shape = tuple(shape)
    words = jax.random.key_data(rng) if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key) else rng
    # Always true, but only at run time: (w | 1) != 0. A constant predicate would be
    # folded away, and the branch inlined and fused again. The word is read through a
    # sort, which XLA does not fuse: read directly, the predicate's kernel would
    # recompute the key's own derivation (a fold_in hash) once more.
    always = (jnp.sort(words.reshape(-1))[0].astype(jnp.uint32) | np.uint32(1)) != 0
    return lax.cond(always, lambda key: jax.random.bernoulli(key, keep_prob, shape),
                    lambda key: jnp.ones(shape, jnp.bool_), rng)


def apply_dropout(x: jnp.ndarray, rate: float, rng: jax.Array,
                  broadcast_dims: Sequence[int] = ()) -> jnp.ndarray:
    """Zero each element of `x` with probability `rate` (one draw shared along
    `broadcast_dims`) and scale the rest by 1 / (1 - rate)."""
    keep_prob = 1.0 - rate
    mask_shape = [1 if d in broadcast_dims else n for d, n in enumerate(x.shape)]
    mask = jnp.broadcast_to(keep_mask(rng, keep_prob, mask_shape), x.shape)
    return lax.select(mask, x / keep_prob, jnp.zeros_like(x))


class Dropout(nn.Dropout):
    """`flax.linen.Dropout` (a subclass: same fields, same auto-names, so the same
    `make_rng` keys and the same output) whose mask comes from `keep_mask`."""

    @nn.compact
    def __call__(self, inputs: jnp.ndarray, deterministic: Optional[bool] = None,
                 rng: Optional[jax.Array] = None) -> jnp.ndarray:
        deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
        if self.rate == 0.0 or deterministic:
            return inputs
        if self.rate == 1.0:  # as flax: no division by zero
            return jnp.zeros_like(inputs)
        if rng is None:
            rng = self.make_rng(self.rng_collection)
        return apply_dropout(inputs, self.rate, rng, self.broadcast_dims)

"""JAX's threefry2x32 random bits, bit for bit, as one fusible elementwise kernel on the CPU.

On the CPU, JAX lowers threefry's 20 rounds as a rolled loop, so XLA writes and
re-reads both state words at every iteration and each `fold_in` is a loop of
its own; the same hash unrolled in plain `jax.numpy` is one elementwise fusion
from an iota to the mask (figures in benchmarks/NOTES.md).

`FUSED_THREEFRY` is a JAX PRNG implementation with threefry2x32's key layout:
`fold_in`, `split` and `random_bits` equal JAX's partitionable threefry exactly
(each element's bits depend only on the key and its global index). The
unrolled hash is behind `lax.platform_dependent`: other backends run JAX's own
threefry. `UNROLLED_THREEFRY` (`unrolled(key)`) is the same without the branch: the
unrolled hash on every platform, as JAX itself lowers threefry off the CPU.

    key = fused(jax.random.PRNGKey(0))   # a typed key; same bits
    jax.random.bernoulli(key, 0.9, (32, 33, 1024))
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import random as jex

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_UINT = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}


def hash2x32(k1, k2, x1, x2):
    """Threefry-2x32 (20 rounds) of the counter pairs (x1, x2) under key (k1, k2).

    The order of operations is that of JAX's `threefry2x32` lowering, unrolled.
    """
    ks = (k1, k2, k1 ^ k2 ^ np.uint32(0x1BD11BDA))
    x1, x2 = x1 + ks[0], x2 + ks[1]
    for block in range(5):
        for r in _ROTATIONS[block % 2]:
            x1 = x1 + x2
            x2 = lax.shift_left(x2, np.uint32(r)) | lax.shift_right_logical(x2, np.uint32(32 - r))
            x2 = x1 ^ x2
        x1 = x1 + ks[(block + 1) % 3]
        x2 = x2 + ks[(block + 2) % 3] + np.uint32(block + 1)
    return x1, x2


def _flat_index(shape: tuple) -> jax.Array:
    """uint32 row-major index of every element of `shape` (fewer than 2**32 elements)."""
    index, stride = jnp.zeros(shape, jnp.uint32), 1
    for dim in reversed(range(len(shape))):
        index = index + lax.broadcasted_iota(jnp.uint32, shape, dim) * np.uint32(stride)
        stride *= shape[dim]
    return index


def _counter_hash(key, shape: tuple):
    """The two hash words of every element: counter (hi, lo) = its 64-bit flat index."""
    lo = _flat_index(shape)
    return hash2x32(key[0], key[1], jnp.zeros_like(lo), lo)


def _huge(shape: tuple) -> bool:
    return math.prod(shape) >= 2 ** 32  # the high counter word is not 0: JAX's own path


def _jax_key(key):
    return jax.random.wrap_key_data(key, impl="threefry2x32")


def _where(everywhere: bool, key, unrolled, jax_own):
    """`unrolled(key)` on every platform, or on the CPU only (JAX's own elsewhere)."""
    if everywhere:
        return unrolled(key)
    return lax.platform_dependent(key, cpu=unrolled, default=jax_own)


def _random_bits(key, bit_width: int, shape: tuple, everywhere: bool = False):
    shape = tuple(shape)

    def jax_bits(k):
        return jax.random.bits(_jax_key(k), shape, jnp.dtype(f"uint{bit_width}"))

    if _huge(shape) or bit_width not in _UINT:  # 64-bit words or > 2**32 elements
        return jax_bits(key)

    def fused_bits(k):
        bits1, bits2 = _counter_hash(k, shape)
        return (bits1 ^ bits2).astype(_UINT[bit_width])

    return _where(everywhere, key, fused_bits, jax_bits)


def _split(key, shape: tuple, everywhere: bool = False):
    shape = tuple(shape)

    def jax_split(k):
        return jax.random.key_data(jax.random.split(_jax_key(k), shape))

    if _huge(shape):
        return jax_split(key)

    def fused_split(k):
        bits1, bits2 = _counter_hash(k, shape)
        return jnp.stack([bits1, bits2], axis=-1)

    return _where(everywhere, key, fused_split, jax_split)


def _fold_in(key, data, everywhere: bool = False):
    def fused_fold_in(k):
        # Both words from one elementwise (2,) kernel: stacking two scalars instead
        # becomes a concatenate that XLA emits with the whole hash once per word.
        data2 = jnp.broadcast_to(jnp.asarray(data, jnp.uint32), (2,))
        bits1, bits2 = hash2x32(k[0], k[1], jnp.zeros((2,), jnp.uint32), data2)
        return jnp.where(lax.iota(jnp.int32, 2) == 0, bits1, bits2)

    def jax_fold_in(k):
        return jax.random.key_data(jax.random.fold_in(_jax_key(k), data))

    return _where(everywhere, key, fused_fold_in, jax_fold_in)


def _seed(seed):
    return jax.random.key_data(jax.random.key(seed, impl="threefry2x32"))


FUSED_THREEFRY = jex.define_prng_impl(key_shape=(2,), seed=_seed, split=_split,
                                      random_bits=_random_bits, fold_in=_fold_in,
                                      name="threefry2x32_fused", tag="fyf")


# The same hash unrolled on every platform: what JAX itself lowers on a GPU or TPU (its
# threefry is a rolled loop on the CPU only), so no platform branch is needed. The train
# step's default dropout key (`train.step.dropout_key`): on the CPU the rolled loops of
# ~40 masks kept ~130 MiB of hash words alive at once in the bench step's temporaries.
UNROLLED_THREEFRY = jex.define_prng_impl(
    key_shape=(2,), seed=_seed,
    split=lambda key, shape: _split(key, shape, everywhere=True),
    random_bits=lambda key, bit_width, shape: _random_bits(key, bit_width, shape,
                                                           everywhere=True),
    fold_in=lambda key, data: _fold_in(key, data, everywhere=True),
    name="threefry2x32_unrolled", tag="fyu")


def unrolled(raw_key: jax.Array) -> jax.Array:
    """A raw threefry key (uint32 (2,)) as a typed key of `UNROLLED_THREEFRY`: the same
    bits as the raw key draws, from the unrolled hash on every platform."""
    return jax.random.wrap_key_data(raw_key, impl=UNROLLED_THREEFRY)


def fused(raw_key: jax.Array) -> jax.Array:
    """A raw threefry key (uint32 (2,), e.g. `jax.random.PRNGKey(0)`) as a typed key of
    `FUSED_THREEFRY`: everything drawn from it equals what the raw key draws."""
    return jax.random.wrap_key_data(raw_key, impl=FUSED_THREEFRY)

"""An int8 decode cache (`config.kv_cache_quant="int8"`): keys and values held as int8
with one float32 scale per head and token (absmax over K / 127), quantized when a
step writes them and dequantized when attention reads them.

A layer's quantized cache is a `QuantKV` (key, value, key_scale, value_scale): key
and value int8 in the cache's layout ((B, G, T, K) or (B, T, G, K)), the scales the
same without K, so every slot operation (write at a slot, ring write, concatenate
along the slot axis, gather rows) applies to its four arrays alike. A float cache
stays a `KV`. Cache bytes: (K + 4) / (4 K) of a float32 cache, (K + 4) / (2 K) of a
bfloat16 one (0.27 and 0.53 at K = 64).
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from jaxformer.nn.attention import KV


class QuantKV(NamedTuple):
    """One layer's int8 keys and values and their per-(head, token) float32 scales."""

    key: jnp.ndarray
    value: jnp.ndarray
    key_scale: jnp.ndarray
    value_scale: jnp.ndarray


def _quantize(x: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / 127.0
    safe = jnp.where(scale == 0, 1.0, scale)[..., None]
    return jnp.clip(jnp.round(x / safe), -127, 127).astype(jnp.int8), scale


def quantize_kv(kv: KV) -> QuantKV:
    """Float keys and values (..., K) -> a `QuantKV` (absmax per head and token)."""
    (key, key_scale), (value, value_scale) = _quantize(kv.key), _quantize(kv.value)
    return QuantKV(key, value, key_scale, value_scale)


def dequantize_kv(kv: QuantKV, dtype) -> KV:
    """A `QuantKV` -> float keys and values in `dtype`."""
    return KV(*((q.astype(jnp.float32) * s[..., None]).astype(dtype)
                for q, s in ((kv.key, kv.key_scale), (kv.value, kv.value_scale))))


def empty(shape: tuple, quantized: bool, dtype) -> KV | QuantKV:
    """A zero cache of `shape` (keys and values each): float `KV` or int8 `QuantKV`."""
    if not quantized:
        return KV(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
    scales = jnp.zeros(shape[:-1], jnp.float32)
    return QuantKV(jnp.zeros(shape, jnp.int8), jnp.zeros(shape, jnp.int8), scales, scales)

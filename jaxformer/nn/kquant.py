"""GGUF's K-quant layouts: super-blocks of 256 values along the input axis, stored as
llama.cpp stores them and dequantized in its order of float32 operations.

The layouts (`config.WEIGHT_QUANT`'s "q4_k", "q5_k", "q6_k"), as arrays whose input
axis N becomes:

    "q4_k"  q          uint8 (N / 2)   4-bit values; in each 64 values, byte j holds
                                       value j (low nibble) and j + 32 (high)
            scale, min float16 (N / 256) the super-block's d and dmin
            sub_scale, sub_min  uint8 (N / 32)  6-bit integers sc, m of each 32 values
            w = (d sc) q - (dmin m)                                     (4.625 bits)
    "q5_k"  as "q4_k", plus
            q_high     uint8 (N / 8)   the fifth bits: in each 256 values, bit i of
                                       byte j is value 32 i + j's
            w = (d sc) (q + 16 q_high) - (dmin m)                       (5.625 bits)
    "q6_k"  q          uint8 (N / 2)   low four bits; in each 128 values, byte j holds
                                       value j (low nibble) and j + 64 (high)
            q_high     uint8 (N / 4)   the top two bits: in each 128 values, bits
                                       2t, 2t + 1 of byte j are value 32 t + j's
            scale      float16 (N / 256)  d
            sub_scale  int8 (N / 16)   sc of each 16 values
            w = (d sc) (q + 16 q_high - 32)                             (6.5625 bits)

These are the bytes of a GGUF block with its fields split apart (Q4_K's 12 bytes of
packed 6-bit scales unpacked into sub_scale and sub_min), so a file's tensor is kept
bit for bit and dequantizes to `gguf.quants.dequantize`'s float32 values exactly:
d sc is a float16 times a small integer, exact in float32, as in llama.cpp.

`quantize` is a plain round-to-nearest quantizer (per 32 or 16 values the range, per
256 the 6- or 8-bit scales): what a freshly initialised or requantized model holds;
files made by llama.cpp's search-based quantizer load as they are.

Pieces::

    FORMATS, SUPER
    parts_of(fmt), layout(fmt, shape, axis)
    quantize(w, fmt, axis) -> parts;  dequantize(parts, fmt, axis) -> float32 w
"""

from __future__ import annotations

import jax.numpy as jnp

FORMATS = ("q4_k", "q5_k", "q6_k")
SUPER = 256  # values of a super-block (llama.cpp's QK_K)
# Values per sub-block scale, and the largest integer of a value.
SUB = {"q4_k": 32, "q5_k": 32, "q6_k": 16}
LEVELS = {"q4_k": 15, "q5_k": 31, "q6_k": 63}
# Each part: (values of the input axis per element, dtype).
PARTS = {
    "q4_k": {"q": (2, jnp.uint8), "scale": (SUPER, jnp.float16), "min": (SUPER, jnp.float16),
             "sub_scale": (32, jnp.uint8), "sub_min": (32, jnp.uint8)},
    "q5_k": {"q": (2, jnp.uint8), "q_high": (8, jnp.uint8), "scale": (SUPER, jnp.float16),
             "min": (SUPER, jnp.float16), "sub_scale": (32, jnp.uint8),
             "sub_min": (32, jnp.uint8)},
    "q6_k": {"q": (2, jnp.uint8), "q_high": (4, jnp.uint8), "scale": (SUPER, jnp.float16),
             "sub_scale": (16, jnp.int8)},
}


def parts_of(fmt: str) -> tuple[str, ...]:
    return tuple(PARTS[fmt])


def layout(fmt: str, shape: tuple, axis: int) -> dict:
    """{part: (shape, dtype)} of the K-quant form of a float array of `shape`."""
    shape = tuple(shape)
    axis = axis % len(shape)
    n = shape[axis]
    if n % SUPER:
        raise ValueError(f"{fmt} needs the input axis {axis} (size {n}, shape {shape}) to be "
                         f"a whole number of {SUPER}-value super-blocks")
    return {part: (shape[:axis] + (n // per,) + shape[axis + 1:], dtype)
            for part, (per, dtype) in PARTS[fmt].items()}


def _split(x: jnp.ndarray, size: int) -> jnp.ndarray:
    """The last axis (M) as (M / size, size)."""
    return x.reshape(x.shape[:-1] + (x.shape[-1] // size, size))


def _flat(x: jnp.ndarray, axes: int) -> jnp.ndarray:
    """The last `axes` axes merged into one."""
    return x.reshape(x.shape[:x.ndim - axes] + (-1,))


def _nibbles(packed: jnp.ndarray, block: int) -> jnp.ndarray:
    """uint8 (..., N / 2) -> (..., N) 0..15: in each `block` values, byte j holds value
    j (low) and j + block / 2 (high)."""
    halves = _split(packed, block // 2)
    return _flat(jnp.stack([halves & 15, halves >> 4], axis=-2), 3)


def _pack_nibbles(q: jnp.ndarray, block: int) -> jnp.ndarray:
    """The inverse of `_nibbles`: 0..15 (..., N) -> uint8 (..., N / 2)."""
    halves = _split(q.astype(jnp.uint8), block).reshape(q.shape[:-1] + (-1, 2, block // 2))
    return _flat(halves[..., 0, :] | (halves[..., 1, :] << 4), 2)


def _bits(packed: jnp.ndarray, width: int, group: int) -> jnp.ndarray:
    """uint8 (..., N * width / 8) -> (..., N): in each 8 / width * group values, value
    `group` t + j is bits width t .. width t + width - 1 of byte j."""
    count = 8 // width
    shifts = (jnp.arange(count, dtype=jnp.uint8) * width)[:, None]
    fields = (_split(packed, group)[..., None, :] >> shifts) & ((1 << width) - 1)
    return _flat(fields, 3)


def _pack_bits(q: jnp.ndarray, width: int, group: int) -> jnp.ndarray:
    """The inverse of `_bits`: values below 2^width (..., N) -> uint8."""
    count = 8 // width
    fields = _split(q.astype(jnp.uint8), count * group).reshape(
        q.shape[:-1] + (-1, count, group))
    shifts = (jnp.arange(count, dtype=jnp.uint8) * width)[:, None]
    return _flat(jnp.sum(fields << shifts, axis=-2, dtype=jnp.uint8), 2)  # disjoint bits


def _values(parts: dict, fmt: str) -> jnp.ndarray:
    """The integers (..., N) as uint8 0..LEVELS (input axis last)."""
    if fmt == "q6_k":
        return _nibbles(parts["q"], 128) | (_bits(parts["q_high"], 2, 32) << 4)
    q = _nibbles(parts["q"], 64)
    return q | (_bits(parts["q_high"], 1, 32) << 4) if fmt == "q5_k" else q


def _last(parts: dict, axis: int) -> dict:
    return {k: jnp.moveaxis(v, axis, -1) for k, v in parts.items()}


def dequantize(parts: dict, fmt: str, axis: int) -> jnp.ndarray:
    """The float32 array of K-quant `parts` (input axis `axis`), llama.cpp's values."""
    axis = axis % parts["q"].ndim
    p = _last(parts, axis)
    sub = SUB[fmt]
    d = jnp.repeat(p["scale"].astype(jnp.float32), SUPER // sub, axis=-1)
    d_sub = d * p["sub_scale"].astype(jnp.float32)  # (..., N / sub): exact
    q = _split(_values(p, fmt), sub).astype(jnp.float32)
    if fmt == "q6_k":
        w = d_sub[..., None] * (q - 32.0)
    else:
        dmin = jnp.repeat(p["min"].astype(jnp.float32), SUPER // sub, axis=-1)
        w = d_sub[..., None] * q - (dmin * p["sub_min"].astype(jnp.float32))[..., None]
    return jnp.moveaxis(_flat(w, 2), -1, axis)


def _safe(x: jnp.ndarray) -> jnp.ndarray:
    return jnp.where(x == 0, 1.0, x)


def quantize(w: jnp.ndarray, fmt: str, axis: int) -> dict:
    """K-quant parts of float `w` along `axis` by rounding to nearest (module docstring)."""
    w = jnp.moveaxis(jnp.asarray(w, jnp.float32), axis % w.ndim, -1)
    layout(fmt, w.shape, -1)  # the super-block check
    sub, levels = SUB[fmt], LEVELS[fmt]
    wb = _split(w, sub)  # (..., N / sub, sub)
    per_super = SUPER // sub
    if fmt == "q6_k":  # symmetric: the value of largest magnitude maps to -32
        at = jnp.argmax(jnp.abs(wb), axis=-1)[..., None]
        step = jnp.take_along_axis(wb, at, axis=-1)[..., 0] / -32.0
        d = (jnp.max(_split(jnp.abs(step), per_super), axis=-1) / 127.0).astype(jnp.float16)
        sc = jnp.clip(jnp.round(step / _safe(jnp.repeat(d.astype(jnp.float32), per_super, -1))),
                      -128, 127).astype(jnp.int8)
        d_sub = jnp.repeat(d.astype(jnp.float32), per_super, -1) * sc.astype(jnp.float32)
        q = jnp.clip(jnp.round(wb / _safe(d_sub)[..., None]), -32, 31) + 32
        q = _flat(q, 2).astype(jnp.uint8)
        parts = {"q": _pack_nibbles(q & 15, 128), "q_high": _pack_bits(q >> 4, 2, 32),
                 "scale": d, "sub_scale": sc}
    else:  # w = (d sc) q - (dmin m) with m >= 0: the range from min(w, 0) to max(w)
        low = jnp.minimum(jnp.min(wb, axis=-1), 0.0)
        step = (jnp.max(wb, axis=-1) - low) / levels
        d = (jnp.max(_split(step, per_super), axis=-1) / 63.0).astype(jnp.float16)
        dmin = (jnp.max(_split(-low, per_super), axis=-1) / 63.0).astype(jnp.float16)
        d_rep = jnp.repeat(d.astype(jnp.float32), per_super, -1)
        dmin_rep = jnp.repeat(dmin.astype(jnp.float32), per_super, -1)
        sc = jnp.clip(jnp.round(step / _safe(d_rep)), 0, 63).astype(jnp.uint8)
        m = jnp.clip(jnp.round(-low / _safe(dmin_rep)), 0, 63).astype(jnp.uint8)
        d_sub, m_sub = d_rep * sc.astype(jnp.float32), dmin_rep * m.astype(jnp.float32)
        q = jnp.clip(jnp.round((wb + m_sub[..., None]) / _safe(d_sub)[..., None]), 0, levels)
        q = _flat(q, 2).astype(jnp.uint8)
        parts = {"q": _pack_nibbles(q & 15, 64), "scale": d, "min": dmin, "sub_scale": sc,
                 "sub_min": m}
        if fmt == "q5_k":
            parts["q_high"] = _pack_bits(q >> 4, 1, 32)
    return {k: jnp.moveaxis(v, -1, axis % w.ndim) for k, v in parts.items()}

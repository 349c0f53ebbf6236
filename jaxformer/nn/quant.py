"""Weight-only quantized layouts: float arrays to integers with scales, and back.

A quantized array has one *input axis* (`axis`; a Dense kernel's flattened input
features, an embedding table's D) along which its scales are taken. The layouts
(`config.WEIGHT_QUANT`), as arrays ``q``, ``scale`` (and ``offset``):

    "int8"        q int8, same shape; scale float32, the shape without `axis` (one per
                  output channel); w = scale * q, q in -127..127 (symmetric)
    "int8_block"  q int8, same shape; scale float16 with `axis` N -> N / block;
                  w = scale * q (GGUF Q8_0)
    "int4"        q uint8 with `axis` N -> N / 2 (two 4-bit values per byte); scale and
                  offset float16, `axis` N -> N / block; w = scale * q + offset, q in
                  0..15 (GGUF Q4_1: offset is its "min")
    "int4_sym"    as "int4" without offset; w = scale * (q - 8) (GGUF Q4_0)
    "q4_k", "q5_k", "q6_k"  GGUF's K-quants, super-blocks of 256 (`nn.kquant`)

Packing is GGUF's: in each block of B values along `axis`, byte j holds value j in
its low four bits and value j + B/2 in its high four bits, so a GGUF Q4 block's 16
bytes are a block of ``q`` as they are. Dequantization is float32 arithmetic in
the order llama.cpp's reference (`gguf.quants`) uses (scale * q + offset), so a
kept GGUF block dequantizes to the same float32 values bit for bit.

Pieces::

    FORMATS, BLOCK_FORMATS
    layout(fmt, shape, axis, block) -> {"q": (shape, dtype), "scale": ..., ["offset": ...]}
    quantize(w, fmt, block, axis) -> {"q", "scale"[, "offset"]}
    dequantize(parts, fmt, block, axis) -> float32 w
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxformer.config import WEIGHT_QUANT
from jaxformer.nn import kquant

FORMATS = WEIGHT_QUANT
BLOCK_FORMATS = ("int4", "int4_sym", "int8_block") + kquant.FORMATS
PACKED = ("int4", "int4_sym")


def check_format(fmt: str, what: str = "quantize") -> None:
    """ValueError naming `fmt` unless it is one of `FORMATS`."""
    if fmt not in FORMATS:
        raise ValueError(f"{what}={fmt!r} is not a quantized layout; valid: "
                         f"{', '.join(map(repr, FORMATS))}")


def parts_of(fmt: str) -> tuple[str, ...]:
    """The arrays of a layout: ("q", "scale"), ("q", "scale", "offset") or a K-quant's."""
    if fmt in kquant.FORMATS:
        return kquant.parts_of(fmt)
    return ("q", "scale", "offset") if fmt == "int4" else ("q", "scale")


def _with(shape: tuple, axis: int, size) -> tuple:
    shape = list(shape)
    if size is None:
        del shape[axis]
    else:
        shape[axis] = size
    return tuple(shape)


def layout(fmt: str, shape: tuple, axis: int, block: int) -> dict:
    """{part: (shape, dtype)} of the quantized form of a float array of `shape`."""
    check_format(fmt, "weight_quant")
    shape = tuple(shape)
    axis = axis % len(shape)
    n = shape[axis]
    if fmt in kquant.FORMATS:  # super-blocks of 256, whatever `block`
        return kquant.layout(fmt, shape, axis)
    if fmt == "int8":
        return {"q": (shape, jnp.int8), "scale": (_with(shape, axis, None), jnp.float32)}
    if n % block:
        raise ValueError(f"quant_block {block} does not divide the input axis {axis} of "
                         f"size {n} (shape {shape})")
    scales = (_with(shape, axis, n // block), jnp.float16)
    if fmt == "int8_block":
        return {"q": (shape, jnp.int8), "scale": scales}
    out = {"q": (_with(shape, axis, n // 2), jnp.uint8), "scale": scales}
    if fmt == "int4":
        out["offset"] = scales
    return out


def _blocks(x: jnp.ndarray, axis: int, block: int) -> jnp.ndarray:
    """`axis` of size N split into (N / block, block)."""
    return x.reshape(x.shape[:axis] + (x.shape[axis] // block, block) + x.shape[axis + 1:])


def _merge(x: jnp.ndarray, axis: int) -> jnp.ndarray:
    """The inverse of `_blocks`: axes axis, axis + 1 merged."""
    return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])


def pack(q: jnp.ndarray, axis: int, block: int) -> jnp.ndarray:
    """4-bit values 0..15 (any int dtype) -> uint8, `axis` halved, GGUF's order."""
    halves = _blocks(q.astype(jnp.uint8), axis, block)
    low, high = jnp.split(halves, 2, axis=axis + 1)
    return _merge(low | (high << 4), axis)


def unpack(packed: jnp.ndarray, axis: int, block: int) -> jnp.ndarray:
    """uint8 -> the 4-bit values 0..15 (uint8), `axis` doubled; the inverse of `pack`."""
    halves = _blocks(packed, axis, block // 2)
    return _merge(jnp.concatenate([halves & 15, halves >> 4], axis=axis + 1), axis)


@functools.partial(jax.jit, static_argnames=("fmt", "block", "axis"))
def quantize(w: jnp.ndarray, fmt: str, block: int, axis: int) -> dict:
    """{"q", "scale"[, "offset"]} of float `w`, as `layout` says, llama.cpp's rounding:
    the block scales are rounded to float16 first and the integers fit them."""
    w = jnp.asarray(w, jnp.float32)
    axis = axis % w.ndim
    if fmt in kquant.FORMATS:
        return kquant.quantize(w, fmt, axis)
    if fmt == "int8":
        scale = jnp.max(jnp.abs(w), axis=axis) / 127.0
        safe = jnp.expand_dims(jnp.where(scale == 0, 1.0, scale), axis)
        q = jnp.clip(jnp.round(w / safe), -127, 127).astype(jnp.int8)
        return {"q": q, "scale": scale}
    wb = _blocks(w, axis, block)  # (..., N/B, B, ...)
    if fmt == "int8_block":
        scale = (jnp.max(jnp.abs(wb), axis=axis + 1) / 127.0).astype(jnp.float16)
        d = jnp.expand_dims(scale.astype(jnp.float32), axis + 1)
        q = jnp.clip(jnp.round(wb / jnp.where(d == 0, 1.0, d)), -127, 127)
        return {"q": _merge(q, axis).astype(jnp.int8), "scale": scale}
    if fmt == "int4":
        low, high = jnp.min(wb, axis=axis + 1), jnp.max(wb, axis=axis + 1)
        scale = ((high - low) / 15.0).astype(jnp.float16)
        offset = low.astype(jnp.float16)
        d = jnp.expand_dims(scale.astype(jnp.float32), axis + 1)
        m = jnp.expand_dims(offset.astype(jnp.float32), axis + 1)
        q = jnp.clip(jnp.round((wb - m) / jnp.where(d == 0, 1.0, d)), 0, 15)
        return {"q": pack(_merge(q, axis), axis, block), "scale": scale, "offset": offset}
    # int4_sym (Q4_0): the value of largest magnitude maps to -8.
    at = jnp.expand_dims(jnp.argmax(jnp.abs(wb), axis=axis + 1), axis + 1)
    peak = jnp.squeeze(jnp.take_along_axis(wb, at, axis=axis + 1), axis + 1)
    scale = (peak / -8.0).astype(jnp.float16)
    d = jnp.expand_dims(scale.astype(jnp.float32), axis + 1)
    q = jnp.clip(jnp.round(wb / jnp.where(d == 0, 1.0, d)) + 8, 0, 15)
    return {"q": pack(_merge(q, axis), axis, block), "scale": scale}


def dequantize(parts: dict, fmt: str, block: int, axis: int) -> jnp.ndarray:
    """The float32 array of {"q", "scale"[, "offset"]} (traced: the caller's jit fuses it)."""
    q = parts["q"]
    axis = axis % q.ndim
    if fmt in kquant.FORMATS:
        return kquant.dequantize(parts, fmt, axis)
    if fmt == "int8":
        return q.astype(jnp.float32) * jnp.expand_dims(parts["scale"].astype(jnp.float32), axis)
    if fmt in PACKED:
        q = unpack(q, axis, block)
    qb = _blocks(q, axis, block).astype(jnp.float32)
    d = jnp.expand_dims(parts["scale"].astype(jnp.float32), axis + 1)
    if fmt == "int4":
        w = d * qb + jnp.expand_dims(parts["offset"].astype(jnp.float32), axis + 1)
    elif fmt == "int4_sym":
        w = d * (qb - 8.0)
    else:
        w = d * qb
    return _merge(w, axis)

"""GGUF block types as the quantized layouts of `jaxformer.nn.quant`.

Each quantized block type has a *target layout* (`target_layout`):

    Q8_0 -> "int8_block"  the blocks as they are
    Q4_0 -> "int4_sym"    the blocks as they are
    Q4_1 -> "int4"        the blocks as they are
    Q5_0 -> "int8_block"  exact: d * (q - 16) with q - 16 in -16..15 is an int8 with the
                          same float16 scale d (22 bytes a block of 32 become 34)
    Q4_K -> "int4"        the 4-bit values as they are (repacked into blocks of 32); each
                          sub-block's scale d * sc and min dmin * m (float16 times a 6-bit
                          integer) rounded to float16: a relative error of at most 2^-11
                          of a scale, stated at load
    other (Q5_1, Q2_K, Q3_K, Q5_K, Q6_K) -> "int8_block", requantized from the
                          dequantized values (`nn.quant.quantize`): 8 bits against the
                          file's 2-6, the error stated at load

`decode(raw, kind, n, fmt)` gives the arrays of a tensor (its raw bytes, one row per
output feature) in layout `fmt` (default: the target), with `exact` saying whether
they dequantize to llama.cpp's reference values bit for bit; any other layout than
the target is a requantization from the dequantized values. The error of a
conversion is `relative_error`: the largest |difference| over the largest |weight|.

Pieces::

    KEPT, target_layout(kind), decode(raw, kind, n, fmt=None) -> (parts, exact)
    relative_error(parts, fmt, reference)
"""

from __future__ import annotations

from typing import Optional

import gguf
import jax
import numpy as np

from jaxformer.nn import quant

Q = gguf.GGMLQuantizationType
BLOCK = 32
QK_K = 256
# Block types whose blocks are the layout's arrays as they are (no arithmetic).
KEPT = {Q.Q8_0: "int8_block", Q.Q4_0: "int4_sym", Q.Q4_1: "int4"}
# Block types decoded into a layout without requantizing (exactly, or scales rounded).
DECODED = {Q.Q5_0: "int8_block", Q.Q4_K: "int4"}


def target_layout(kind) -> str:
    """The layout a quantized GGUF block type loads into (module docstring)."""
    return KEPT.get(kind) or DECODED.get(kind) or "int8_block"


def _f16(raw: np.ndarray, start: int) -> np.ndarray:
    return np.ascontiguousarray(raw[..., start:start + 2]).view(np.float16)[..., 0]


def _pack(q: np.ndarray) -> np.ndarray:
    """4-bit values (..., blocks, 32) -> GGUF's packing (..., blocks * 16): byte j holds
    value j (low nibble) and value j + 16 (high)."""
    packed = q[..., :16] | (q[..., 16:] << 4)
    return packed.reshape(q.shape[:-2] + (-1,)).astype(np.uint8)


def _kept(raw: np.ndarray, kind, rows: tuple, n: int) -> dict:
    scale = _f16(raw, 0)
    if kind == Q.Q8_0:
        return {"q": np.ascontiguousarray(raw[..., 2:]).view(np.int8).reshape(rows + (n,)),
                "scale": scale}
    start = 2 if kind == Q.Q4_0 else 4
    parts = {"q": np.ascontiguousarray(raw[..., start:]).reshape(rows + (n // 2,)),
             "scale": scale}
    if kind == Q.Q4_1:
        parts["offset"] = _f16(raw, 2)
    return parts


def _q5_0(raw: np.ndarray, rows: tuple, n: int) -> dict:
    """Q5_0 (d f16, qh 4 bytes: bit i = value i's fifth bit, 16 bytes of nibbles: byte j =
    values j, j + 16) as int8_block: q - 16, scale d."""
    high = np.ascontiguousarray(raw[..., 2:6]).view(np.uint32)  # (..., blocks, 1)
    bits = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    nibbles = raw[..., 6:22]
    low = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1)
    q = (low | (bits << 4)).astype(np.int8) - np.int8(16)
    return {"q": q.reshape(rows + (n,)), "scale": _f16(raw, 0)}


def _q4_k(raw: np.ndarray, rows: tuple, n: int) -> dict:
    """Q4_K super-blocks of 256 (d, dmin f16; 12 bytes of 6-bit scales and mins; 128
    bytes: 64-value chunks, sub-block 2c in the low nibbles of chunk c's 32 bytes, 2c + 1
    in the high) as int4 blocks of 32: scale d * sc, offset -(dmin * m), float16."""
    d, dmin = _f16(raw, 0)[..., None], _f16(raw, 2)[..., None]
    flat_scales = np.ascontiguousarray(raw[..., 4:16]).reshape(-1, 12)
    sc, m = gguf.quants.Q4_K.get_scale_min(flat_scales)
    sc = sc.reshape(raw.shape[:-1] + (8,)).astype(np.float32)
    m = m.reshape(raw.shape[:-1] + (8,)).astype(np.float32)
    chunks = raw[..., 16:].reshape(raw.shape[:-1] + (4, 1, 32))
    q = (chunks >> np.array([0, 4], np.uint8).reshape(2, 1)) & 15  # (..., 4, 2, 32)
    q = q.reshape(raw.shape[:-1] + (8, 32))
    return {"q": _pack(q).reshape(rows + (n // 2,)),
            "scale": (d.astype(np.float32) * sc).astype(np.float16).reshape(rows + (-1,)),
            "offset": (-(dmin.astype(np.float32) * m)).astype(np.float16).reshape(rows + (-1,))}


def decode(raw: np.ndarray, kind, n: int, fmt: Optional[str] = None) -> tuple[dict, bool]:
    """({"q", "scale"[, "offset"]} in layout `fmt`, exact) of a tensor's raw bytes
    `raw` (*rows, bytes) uint8 of block type `kind`, `n` values a row, the block axis
    last (as `nn.quant` lays out a kernel's transposed rows).

    `fmt`: None (the target layout) or any block layout of `nn.quant`; a layout
    other than the target requantizes the dequantized values (`exact` False)."""
    fmt = fmt or target_layout(kind)
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    rows = tuple(raw.shape[:-1])
    blocks = raw.reshape(rows + (n // block_values, block_bytes))
    if fmt == target_layout(kind) and kind in KEPT:
        return _kept(blocks, kind, rows, n), True
    if fmt == target_layout(kind) and kind == Q.Q5_0:
        return _q5_0(blocks, rows, n), True
    if fmt == target_layout(kind) and kind == Q.Q4_K:
        return _q4_k(blocks, rows, n), False
    with np.errstate(all="ignore"):
        values = np.asarray(gguf.quants.dequantize(raw, kind), np.float32).reshape(rows + (n,))
    parts = quant.quantize(values, fmt, BLOCK, -1)
    return jax.tree_util.tree_map(np.asarray, parts), False


def relative_error(parts: dict, fmt: str, reference: np.ndarray) -> float:
    """max |dequantize(parts) - reference| / max |reference| (0.0 for a zero tensor)."""
    got = np.asarray(quant.dequantize(parts, fmt, BLOCK, -1))
    peak = float(np.max(np.abs(reference))) if reference.size else 0.0
    return float(np.max(np.abs(got - reference))) / peak if peak else 0.0

"""GGUF block types as the quantized layouts of `jaxformer.nn.quant`.

Each quantized block type has a *target layout* (`target_layout`):

    Q8_0 -> "int8_block"  the blocks as they are
    Q4_0 -> "int4_sym"    the blocks as they are
    Q4_1 -> "int4"        the blocks as they are
    Q4_K -> "q4_k"        the blocks as they are, fields split apart (`nn.kquant`)
    Q5_K -> "q5_k"        the same
    Q6_K -> "q6_k"        the same
    Q5_0 -> "int8_block"  exact: d * (q - 16) with q - 16 in -16..15 is an int8 with the
                          same float16 scale d (22 bytes a block of 32 become 34)
    other (Q5_1, Q2_K, Q3_K) -> "int8_block", requantized from the dequantized values
                          (`nn.quant.quantize`): 8 bits against the file's 2-5, the
                          error stated at load

`decode(raw, kind, n, fmt)` gives the arrays of a tensor (its raw bytes, one row per
output feature) in layout `fmt` (default: the target), with `exact` saying whether
they dequantize to llama.cpp's reference values bit for bit; any other layout than
the target is a requantization from the dequantized values. The error of a
conversion is `relative_error`: the largest |difference| over the largest |weight|.

Pieces::

    KEPT, target_layout(kind), decode(raw, kind, n, fmt=None) -> (parts, exact)
    encode(parts, kind) -> raw           the inverse, for kept types (writing a file)
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
# Block types whose blocks are the layout's arrays as they are (no arithmetic).
KEPT = {Q.Q8_0: "int8_block", Q.Q4_0: "int4_sym", Q.Q4_1: "int4", Q.Q4_K: "q4_k",
        Q.Q5_K: "q5_k", Q.Q6_K: "q6_k"}
# Block types decoded exactly into a layout of other block bytes.
DECODED = {Q.Q5_0: "int8_block"}
# The byte fields of a K-quant block: (part, start, end); Q4_K's and Q5_K's 12 bytes of
# packed 6-bit scales and mins ("scales") are unpacked into sub_scale and sub_min.
K_FIELDS = {
    Q.Q4_K: (("scale", 0, 2), ("min", 2, 4), ("scales", 4, 16), ("q", 16, 144)),
    Q.Q5_K: (("scale", 0, 2), ("min", 2, 4), ("scales", 4, 16), ("q_high", 16, 48),
             ("q", 48, 176)),
    Q.Q6_K: (("q", 0, 128), ("q_high", 128, 192), ("sub_scale", 192, 208),
             ("scale", 208, 210)),
}


def target_layout(kind) -> str:
    """The layout a quantized GGUF block type loads into (module docstring)."""
    return KEPT.get(kind) or DECODED.get(kind) or "int8_block"


def _f16(raw: np.ndarray, start: int) -> np.ndarray:
    return np.ascontiguousarray(raw[..., start:start + 2]).view(np.float16)[..., 0]


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


def _k_quant(raw: np.ndarray, kind, rows: tuple) -> dict:
    """A K-quant tensor's blocks (*rows, blocks, bytes) as `nn.kquant`'s parts (*rows, X)."""
    parts = {}
    for part, start, end in K_FIELDS[kind]:
        field = np.ascontiguousarray(raw[..., start:end])
        if part == "scales":
            sc, m = gguf.quants.Q4_K.get_scale_min(field.reshape(-1, 12))
            parts["sub_scale"] = sc.reshape(rows + (-1,)).astype(np.uint8)
            parts["sub_min"] = m.reshape(rows + (-1,)).astype(np.uint8)
            continue
        if part in ("scale", "min"):
            field = field.view(np.float16)
        elif part == "sub_scale":
            field = field.view(np.int8)
        parts[part] = field.reshape(rows + (-1,))
    return parts


def _pack_scale_min(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins (blocks, 8) -> llama.cpp's 12 bytes (blocks, 12): the
    inverse of `gguf.quants.Q4_K.get_scale_min`."""
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    out = np.zeros(sc.shape[:-1] + (12,), np.uint8)
    out[..., 0:4] = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    out[..., 4:8] = (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)
    return out


def encode(parts: dict, kind) -> np.ndarray:
    """The GGUF bytes (*rows, bytes) of kept `parts` in numpy order (block axis last) of
    block type `kind` (a key of `KEPT`): the inverse of `decode`."""
    parts = {k: np.asarray(v) for k, v in parts.items()}
    rows = parts["q"].shape[:-1]
    size = gguf.GGML_QUANT_SIZES[kind][1]
    blocks = parts["scale"].shape[-1]
    if kind not in K_FIELDS:  # d [m] q, 32 values a block
        fields = [parts["scale"].reshape(rows + (blocks, 1)).view(np.uint8)]
        if kind == Q.Q4_1:
            fields.append(parts["offset"].reshape(rows + (blocks, 1)).view(np.uint8))
        fields.append(parts["q"].reshape(rows + (blocks, -1)).view(np.uint8))
        return np.concatenate(fields, axis=-1).reshape(rows + (-1,))
    out = np.zeros(rows + (blocks, size), np.uint8)
    for part, start, end in K_FIELDS[kind]:
        if part == "scales":
            value = _pack_scale_min(parts["sub_scale"].reshape(-1, 8),
                                    parts["sub_min"].reshape(-1, 8))
        else:
            value = parts[part]
        out[..., start:end] = np.ascontiguousarray(value).view(np.uint8).reshape(
            rows + (blocks, end - start))
    return out.reshape(rows + (-1,))


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
    if fmt == target_layout(kind) and kind in K_FIELDS:
        return _k_quant(blocks, kind, rows), True
    if fmt == target_layout(kind) and kind in KEPT:
        return _kept(blocks, kind, rows, n), True
    if fmt == target_layout(kind) and kind == Q.Q5_0:
        return _q5_0(blocks, rows, n), True
    with np.errstate(all="ignore"):
        values = np.asarray(gguf.quants.dequantize(raw, kind), np.float32).reshape(rows + (n,))
    parts = quant.quantize(values, fmt, BLOCK, -1)
    return jax.tree_util.tree_map(np.asarray, parts), False


def relative_error(parts: dict, fmt: str, reference: np.ndarray) -> float:
    """max |dequantize(parts) - reference| / max |reference| (0.0 for a zero tensor)."""
    got = np.asarray(quant.dequantize(parts, fmt, BLOCK, -1))
    peak = float(np.max(np.abs(reference))) if reference.size else 0.0
    return float(np.max(np.abs(got - reference))) / peak if peak else 0.0

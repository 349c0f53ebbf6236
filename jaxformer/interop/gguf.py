"""GGUF files (llama.cpp's format): metadata, dequantized tensors, the tokenizer.

Needs the optional `gguf` package (`pip install 'jaxformer[llm]'`); the
`tokenizers` package for `jaxformer.text.gguf_vocab`.

    file = read_gguf(path)           # parses the header; tensors stay memory-mapped
    file.metadata["llama.block_count"]
    file.shape("blk.0.attn_q.weight")  # numpy order (rows = output features)
    file.array("blk.0.attn_q.weight")  # float32, dequantized on demand

Quantized tensors are dequantized to float32 with `gguf.quants.dequantize`,
the reference implementation of llama.cpp's block formats, or kept as they are
(`file.blocks(name)`: Q8_0, Q4_0, Q4_1 as the arrays of `jaxformer.nn.quant`'s
layouts, Q5_0 and Q4_K decoded into them, the other types requantized:
`jaxformer.interop.gguf_blocks`). Only the types in
`SUPPORTED_TYPES` are accepted; any other raises a `ValueError` naming the
tensor and its type before anything is dequantized (`check_types`).
Per-model mappings from GGUF names to jaxformer parameters live in
`jaxformer.models` (e.g. `models/llama.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np

from jaxformer.errors import FileFormatError, require_file

try:
    import gguf
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError("jaxformer.interop.gguf needs the `gguf` package: "
                      "pip install 'jaxformer[llm]'") from error

from jaxformer.interop import gguf_blocks  # noqa: E402 - needs gguf, imported above

Q = gguf.GGMLQuantizationType
SUPPORTED_TYPES = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
                             Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K})
FLOAT_TYPES = frozenset({Q.F32, Q.F16, Q.BF16})
# Block types kept quantized as they are (`GGUFFile.blocks`) -> jaxformer's layout
# (`jaxformer.nn.quant`); the others convert (`gguf_blocks.target_layout`).
KEPT_TYPES = gguf_blocks.KEPT
BLOCK = gguf_blocks.BLOCK


@dataclasses.dataclass
class GGUFFile:
    """A parsed GGUF file: `metadata` {key: value} and its tensors by name."""

    path: str
    metadata: dict[str, Any]
    tensors: dict[str, Any]  # name -> gguf.ReaderTensor (memory-mapped, not yet decoded)
    # (block type name, layout) -> the largest relative error of the tensors `blocks`
    # converted so far (`gguf_blocks.relative_error`); exact ones are not listed.
    conversions: dict = dataclasses.field(default_factory=dict)

    @property
    def architecture(self) -> str:
        return self.metadata.get("general.architecture", "<missing>")

    def shape(self, name: str) -> tuple[int, ...]:
        """Numpy shape of a tensor (GGUF lists dims fastest-first; this reverses them)."""
        return tuple(int(n) for n in reversed(self.tensors[name].shape))

    def check_types(self) -> None:
        """Refuse a file with any tensor of an unsupported quantization type."""
        for name, tensor in self.tensors.items():
            if tensor.tensor_type not in SUPPORTED_TYPES:
                raise ValueError(
                    f"{self.path}: tensor {name!r} has quantization type "
                    f"{tensor.tensor_type.name}, which jaxformer does not dequantize "
                    f"(supported: {sorted(t.name for t in SUPPORTED_TYPES)})")

    def array(self, name: str, *, check_finite: bool = True) -> np.ndarray:
        """The tensor dequantized to float32, in numpy order; a tensor holding NaN or
        infinity is refused (`check_finite=False` skips the check)."""
        tensor = self.tensors[name]
        if tensor.tensor_type not in SUPPORTED_TYPES:
            self.check_types()
        try:
            with np.errstate(all="ignore"):
                values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            values = owned(np.asarray(values, np.float32).reshape(self.shape(name)), tensor)
        except (ValueError, IndexError, TypeError) as error:
            raise FileFormatError(self.path, f"tensor {name!r} cannot be decoded ({error})",
                                  "the file is damaged: download it again") from error
        if check_finite and not np.isfinite(values).all():
            raise FileFormatError(self.path, f"tensor {name!r} holds NaN or infinite values",
                                  "the file is damaged: download it again")
        return values


    def blocks(self, name: str, fmt: Optional[str] = None) -> tuple[str, dict]:
        """(layout, {"q", "scale"[, "offset"]}) of a quantized tensor in numpy order with
        the block axis last: q (*rows, N) int8 or (*rows, N / 2) uint8, scale (and
        offset) (*rows, N / 32) float16. `fmt` None: the block type's target layout
        (`gguf_blocks.target_layout`: Q8_0, Q4_0, Q4_1 as they are, Q5_0 exactly, Q4_K
        with float16 scales, the other types requantized to int8_block); a layout of
        `nn.quant`: converted to it. A conversion that is not exact is recorded in
        `conversions` ({(type name, layout): largest relative error}). A float tensor
        or a type jaxformer does not decode is refused by name (ValueError)."""
        tensor = self.tensors[name]
        kind = tensor.tensor_type
        if kind in FLOAT_TYPES or kind not in SUPPORTED_TYPES:
            raise ValueError(
                f"{self.path}: tensor {name!r} is {kind.name}, which jaxformer does not keep "
                f"quantized (quantized types: "
                f"{', '.join(sorted(t.name for t in SUPPORTED_TYPES - FLOAT_TYPES))}); load it "
                "dequantized (no quantize=) or requantized (quantize='int8' / 'int4')")
        fmt = fmt or gguf_blocks.target_layout(kind)
        shape = self.shape(name)
        rows, n = shape[:-1], shape[-1]
        try:
            raw = np.asarray(tensor.data, np.uint8).reshape(rows + (-1,))
            parts, exact = gguf_blocks.decode(raw, kind, n, fmt)
            parts = {part: owned(value, tensor) for part, value in parts.items()}
        except ValueError as error:
            raise FileFormatError(self.path, f"tensor {name!r} cannot be decoded ({error})",
                                  "the file is damaged: download it again") from error
        if not all(np.isfinite(parts[p]).all() for p in parts if p != "q"):
            raise FileFormatError(self.path, f"tensor {name!r} holds NaN or infinite scales",
                                  "the file is damaged: download it again")
        if not exact:
            error = gguf_blocks.relative_error(parts, fmt, self.array(name))
            key = (kind.name, fmt)
            self.conversions[key] = max(self.conversions.get(key, 0.0), error)
        return fmt, parts


def owned(values: np.ndarray, tensor) -> np.ndarray:
    """`values`, copied if it is a view of the tensor's bytes in the file's memory map:
    on a CPU, `jax.device_put` can alias such a view, and one aliased norm weight kept
    the whole mapped file resident (96 MB of SmolLM2's 98 MB file, a served model's
    idle RSS)."""
    return np.array(values) if np.may_share_memory(values, tensor.data) else values


GGUF_MAGIC = b"GGUF"
# GGUF value types -> byte sizes of the fixed-size ones (8 = string, 9 = array).
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def read_architecture(path, *, max_entries: int = 64) -> Optional[str]:
    """`general.architecture` from the first metadata entries, without parsing the rest
    of the file (the full parse of a large vocabulary takes seconds); None if it is
    not among the first `max_entries` (converters write it first)."""
    return read_string_value(path, "general.architecture", max_entries=max_entries)


def read_string_value(path, key: str, *, max_entries: Optional[int] = None) -> Optional[str]:
    """The string metadata value `key` of a GGUF file (None if absent or not a string),
    read by skipping over the entries before it without decoding them."""
    import struct  # noqa: PLC0415 - only here

    path = require_file(path, "GGUF file")
    wanted = key.encode("utf-8")
    try:
        with open(path, "rb") as f:
            magic, _version, _tensors, count = struct.unpack("<4sIQQ", f.read(24))
            if magic != GGUF_MAGIC:
                raise FileFormatError(path, f"is not a GGUF file (it starts with {magic!r}, "
                                            f"not {GGUF_MAGIC!r})")

            def string() -> bytes:
                (n,) = struct.unpack("<Q", f.read(8))
                return f.read(n)

            def skip(kind: int) -> None:
                if kind == 8:
                    string()
                elif kind == 9:
                    item, n = struct.unpack("<IQ", f.read(12))
                    if item in _SCALAR_BYTES:
                        f.seek(n * _SCALAR_BYTES[item], 1)
                    else:
                        for _ in range(n):
                            skip(item)
                else:
                    f.seek(_SCALAR_BYTES[kind], 1)

            for _ in range(count if max_entries is None else min(count, max_entries)):
                name = string()
                (kind,) = struct.unpack("<I", f.read(4))
                if name == wanted and kind == 8:
                    return string().decode("utf-8", "replace")
                skip(kind)
    except (struct.error, KeyError, OSError, MemoryError) as error:
        raise FileFormatError(path, f"damaged GGUF header ({type(error).__name__}: {error})",
                              "it is truncated or corrupt: download it again") from error
    return None


class PlainArrayReader(gguf.GGUFReader):
    """`gguf.GGUFReader` over a plain ndarray view of its memory map: the same fields and
    tensors, without `numpy.memmap`'s Python-level hooks on each of the 250,000 small
    slices that parsing a 49,152-token vocabulary takes (most of SmolLM2's load time:
    benchmarks/NOTES.md)."""

    @property
    def data(self) -> np.ndarray:
        return self.file_bytes

    @data.setter
    def data(self, mapped: np.memmap) -> None:
        self.file_bytes = mapped.view(np.ndarray)


def read_gguf(path) -> GGUFFile:
    """Parse a GGUF file's header, metadata and tensor index (no tensor is decoded).

    Raises `FileFormatError` naming the file if it is missing, not a GGUF file,
    or damaged (truncated, impossible counts or offsets).
    """
    path = require_file(path, "GGUF file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise FileFormatError(path, f"is not a GGUF file (it starts with {magic!r}, not "
                                    f"{GGUF_MAGIC!r})")
    try:
        reader = PlainArrayReader(path)
        metadata = {key: field.contents() for key, field in reader.fields.items()
                    if not key.startswith("GGUF.")}
        tensors = {t.name: t for t in reader.tensors}
    except (ValueError, IndexError, KeyError, TypeError, OverflowError, MemoryError,
            OSError, UnicodeDecodeError) as error:
        raise FileFormatError(path, f"damaged GGUF file ({type(error).__name__}: "
                                    f"{str(error)[:200]})",
                              "it is truncated or corrupt: download it again") from error
    return GGUFFile(path, metadata, tensors)

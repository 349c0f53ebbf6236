"""safetensors checkpoints (Hugging Face's format): one file or a sharded index.

Needs the optional `safetensors` package (`pip install 'jaxformer[llm]'`).

    checkpoint = read_safetensors(directory)   # headers only: names, shapes, dtypes
    checkpoint.shape("model.embed_tokens.weight")
    checkpoint.array("model.embed_tokens.weight")   # numpy, read on demand

A directory holds `model.safetensors`, or shards listed by
`model.safetensors.index.json` ({"weight_map": {tensor name: shard file}}).
Every file is opened (`safe_open(..., framework="numpy")`, which validates the
header against the file's size) before any tensor is read, so a truncated file
or a missing shard raises `FileFormatError` naming that file up front.
bfloat16 tensors (which numpy cannot name) are read through `ml_dtypes`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct

import numpy as np

from jaxformer.errors import FileFormatError, require_file

try:
    import safetensors
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError("jaxformer.interop.safetensors needs the `safetensors` package: "
                      "pip install 'jaxformer[llm]'") from error

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DAMAGED = "it is truncated or corrupt: download it again"


@dataclasses.dataclass
class SafetensorsCheckpoint:
    """Tensors of one or more safetensors files: `files` {tensor name: file path},
    `shapes` {name: numpy shape}, `dtypes` {name: safetensors dtype name, e.g. "F32"}."""

    path: str  # the directory (or the single file)
    files: dict[str, str]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def array(self, name: str, *, check_finite: bool = True) -> np.ndarray:
        """The tensor as a numpy array (float32 for bfloat16); NaN/inf refused unless
        `check_finite=False`."""
        path = self.files[name]
        try:
            if self.dtypes[name] == "BF16":
                values = _read_bfloat16(path, name).astype(np.float32)
            else:
                with safetensors.safe_open(path, framework="numpy") as f:
                    values = f.get_tensor(name)
        except (safetensors.SafetensorError, OSError, ValueError, TypeError) as error:
            raise FileFormatError(path, f"tensor {name!r} cannot be read ({error})",
                                  DAMAGED) from error
        if check_finite and np.issubdtype(values.dtype, np.floating) \
                and not np.isfinite(values).all():
            raise FileFormatError(path, f"tensor {name!r} holds NaN or infinite values", DAMAGED)
        return values


def _header(path: str) -> tuple[int, dict]:
    """(byte offset of the data, the JSON header) of a safetensors file."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return 8 + length, json.loads(f.read(length))


def _read_bfloat16(path: str, name: str) -> np.ndarray:
    import ml_dtypes  # noqa: PLC0415 - a dependency of jax

    start, header = _header(path)
    entry = header[name]
    begin, end = entry["data_offsets"]
    values = np.memmap(path, dtype=np.uint8, mode="r", offset=start + begin, shape=(end - begin,))
    return np.asarray(values).view(ml_dtypes.bfloat16).reshape(entry["shape"])


def _open(path: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (shape, dtype)} of one file, validated by safe_open (no tensor is read)."""
    path = require_file(path, "safetensors file")
    try:
        with safetensors.safe_open(path, framework="numpy") as f:
            return {name: (tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype())
                    for name in f.keys()}
    except (safetensors.SafetensorError, OSError, ValueError) as error:
        raise FileFormatError(path, f"damaged safetensors file ({error})", DAMAGED) from error


def read_safetensors(path) -> SafetensorsCheckpoint:
    """Open a checkpoint: a directory (single file or sharded index) or one file.

    Raises `FileFormatError` naming the file for a missing directory, file or
    shard, a damaged index, or a truncated / corrupt file.
    """
    path = os.fspath(path)
    if os.path.isfile(path):
        files = {name: path for name in _open(path)}
        entries = {name: path for name in files}
        info = {name: spec for name, spec in _open(path).items()}
        return SafetensorsCheckpoint(path, entries, {n: s for n, (s, _) in info.items()},
                                     {n: d for n, (_, d) in info.items()})
    if not os.path.isdir(path):
        raise FileFormatError(path, "no such checkpoint directory or safetensors file")
    single, index = os.path.join(path, SINGLE), os.path.join(path, INDEX)
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            shard_of = {str(name): os.path.join(path, str(shard))
                        for name, shard in weight_map.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise FileFormatError(index, f"damaged index ({type(error).__name__}: {error})",
                                  "it needs a JSON object with a 'weight_map'") from error
        for shard in sorted(set(shard_of.values())):
            if not os.path.exists(shard):
                raise FileFormatError(shard, "a shard listed by the index is missing",
                                      f"{INDEX} names it: download it too")
    elif os.path.exists(single):
        shard_of = None
    else:
        raise FileFormatError(path, f"holds neither {SINGLE} nor {INDEX}",
                              "a Hugging Face checkpoint directory has one of them")
    shapes, dtypes, files = {}, {}, {}
    for shard in ([single] if shard_of is None else sorted(set(shard_of.values()))):
        for name, (shape, dtype) in _open(shard).items():
            shapes[name], dtypes[name], files[name] = shape, dtype, shard
    if shard_of is not None:
        absent = sorted(name for name in shard_of if name not in files)
        if absent:
            raise FileFormatError(shard_of[absent[0]], f"tensor(s) {absent[:5]} listed by the "
                                  "index are not in their shard", DAMAGED)
    return SafetensorsCheckpoint(path, files, shapes, dtypes)

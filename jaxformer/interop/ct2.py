"""Reader of CTranslate2 `model.bin` files: {name: numpy array} plus the spec name.

Read directly from the binary layout (little-endian), no converter and no
ctranslate2 import:

    uint32 version (>= 5 here), string spec name, uint32 spec revision,
    uint32 number of variables, then per variable:
        string name, uint8 rank, uint32 dims[rank], uint8 dtype id,
        uint32 byte count, the raw bytes
    uint32 number of aliases, then per alias: string alias, string target

where a string is a uint16 byte count (including a trailing NUL) and the bytes.
Scalars (rank 0) are options of the spec (e.g. `decoder/num_heads`); aliases
name a shared tensor twice (a tied output projection). A per-model mapping
(`jaxformer.models`) renames these names to jaxformer's and calls
`jaxformer.interop.flat.load_flat`.
"""

from __future__ import annotations

import dataclasses
import struct

import numpy as np

from jaxformer.errors import FileFormatError, require_file

# CTranslate2's DataType enum.
DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}
BFLOAT16 = 5  # no numpy dtype: refused with a clear error


@dataclasses.dataclass
class Ct2Model:
    """spec: e.g. "WhisperSpec"; version, revision: of the file and the spec;
    variables: {name: array}; aliases: {alias: target name}."""

    spec: str
    version: int
    revision: int
    variables: dict
    aliases: dict


class _Reader:
    def __init__(self, data: bytes, path: str):
        self.data, self.pos, self.path = memoryview(data), 0, path

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.data):
            raise FileFormatError(self.path, f"truncated CTranslate2 file (wanted {n} bytes "
                                  f"at offset {self.pos}, file has {len(self.data)})",
                                  "copy or install the model again")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def uint(self, fmt: str) -> int:
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        raw = bytes(self.take(self.uint("H"))).rstrip(b"\0")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise FileFormatError(self.path, f"not a CTranslate2 model.bin (bytes that are "
                                  f"not a name at offset {self.pos - len(raw)})") from None


def read_ct2(path: str) -> Ct2Model:
    """Read a CTranslate2 `model.bin` (format version 5 or 6) into numpy arrays.

    Raises:
      FileFormatError (a ValueError) naming the file if it is missing, of an
      unsupported version, has an unknown dtype, a byte count that does not
      match the shape, is truncated, or has bytes left over at the end.
    """
    with open(require_file(path, "CTranslate2 model file"), "rb") as f:
        r = _Reader(f.read(), path)
    version = r.uint("I")
    if version < 5:
        raise FileFormatError(path, f"CTranslate2 binary version {version} is not supported "
                              "(need >= 5)")
    spec, revision = r.string(), r.uint("I")
    variables = {}
    for _ in range(r.uint("I")):
        name = r.string()
        dims = tuple(r.uint("I") for _ in range(r.uint("B")))
        dtype_id, size = r.uint("B"), r.uint("I")
        if dtype_id not in DTYPES:
            raise FileFormatError(path, f"{name} has dtype id {dtype_id} "
                                  f"({'bfloat16' if dtype_id == BFLOAT16 else 'unknown'}), "
                                  "not supported")
        dtype = np.dtype(DTYPES[dtype_id])
        if size != dtype.itemsize * int(np.prod(dims, dtype=np.int64)):
            raise FileFormatError(path, f"{name} holds {size} bytes, its shape {dims} of "
                                  f"{dtype} needs {dtype.itemsize * int(np.prod(dims))}")
        variables[name] = np.frombuffer(r.take(size), dtype).reshape(dims).copy()
    aliases = {}
    for _ in range(r.uint("I")):
        alias = r.string()
        aliases[alias] = r.string()
    if r.pos != len(r.data):
        raise FileFormatError(path, f"{len(r.data) - r.pos} unread bytes after the aliases")
    return Ct2Model(spec, version, revision, variables, aliases)

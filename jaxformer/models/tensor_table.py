"""Tensor tables: one row per tensor of a model family, stating its jaxformer parameter
path, its Hugging Face name, its GGUF name, its shape in the files and how it moves
between the two layouts. Readers and writers loop over a table (`entries`); adding a
family is adding a table (`jaxformer.models.llama_tensors.LLAMA`; the encoder-decoder
families, two tables each: `jaxformer.models.encdec_tensors`).

A row's `kind` is the transform, both ways (file layout: torch `Linear` (out, in),
which GGUF's numpy order shares; `n` heads of `K` features, `order` a per-head
feature permutation for RoPE's layout, or None):

    kind        file          jaxformer          file -> jaxformer
    VECTOR      (X,)          (X,)               as is (biases of D features)
    NORM        (X,)          (X,)               as is (a norm's scale)
    HEAD_NORM   (K,)          (K,)               w[order] (per-head q/k norm)
    EMBEDDING   (V, D)        (V, D)             as is
    LINEAR      (out, in)     (in, out)          w.T
    HEADS_IN    (n*K, D)      (D, n, K)          w.reshape(n, K, D)[:, order] -> (D, n, K)
    HEADS_OUT   (D, n*K)      (n, K, D)          w.T.reshape(n, K, D)
    HEAD_BIAS   (n*K,)        (n, K)             b.reshape(n, K)[:, order]
    CONV        (out, in, W)  (W, in, out)       w.transpose(2, 1, 0) (torch Conv1d)
    ROW         (1, X)        (X,)               b.reshape(-1) (a bias stored as a row)

A shape part is a product of dimension letters or one literal count ("D,C,3", "1,V").

`to_params` and `to_file` are these transforms and their inverses; `check_shapes`
compares what a file holds with what the table says (one `CheckpointMismatch`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

import numpy as np

from jaxformer.interop.flat import CheckpointMismatch

VECTOR, NORM, HEAD_NORM, EMBEDDING = "vector", "norm", "head_norm", "embedding"
LINEAR, HEADS_IN, HEADS_OUT, HEAD_BIAS = "linear", "heads_in", "heads_out", "head_bias"
CONV, ROW = "conv", "row"
KERNELS = (EMBEDDING, LINEAR, HEADS_IN, HEADS_OUT)  # matrices: quantizable, LoRA-able
NORMS = (NORM, HEAD_NORM)
FORMATS = ("hf", "gguf")


def always(config) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One row of a table. `ours`, `hf`, `gguf`: the names (a layer row's relative to
    the table's layer prefixes; `gguf` None: the family has no GGUF form); `shape`: the
    file shape in dimension letters, e.g. "HK,D" = (H*K, D); `kind`: the transform;
    `heads`: the letter counting the heads of a HEADS_*/HEAD_BIAS row; `rope_rows`: its
    features follow the RoPE layout (query and key); `when`: config -> present."""

    ours: str
    hf: str
    gguf: Optional[str]
    shape: str
    kind: str
    heads: str = ""
    rope_rows: bool = False
    when: Callable[[Any], bool] = always


@dataclasses.dataclass(frozen=True)
class Table:
    """A family's tensors: `top` (once), `layer` (once per layer, the names behind
    `prefixes[fmt].format(i=layer)`), `dims(config)` -> {letter: size} and
    `layers(config)` -> the layer count."""

    top: tuple[Tensor, ...]
    layer: tuple[Tensor, ...]
    prefixes: dict
    dims: Callable[[Any], dict]
    layers: Callable[[Any], int]

    def row(self, ours: str) -> Tensor:
        """The top row of jaxformer path `ours` (e.g. "decoder/out_proj/kernel")."""
        for t in self.top:
            if t.ours == ours:
                return t
        raise KeyError(f"no top row {ours!r} in the table")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor of one model: its three names, its file shape, its row; `layer`: the
    layer index of a layer row, else None."""

    ours: str
    hf: str
    gguf: Optional[str]
    shape: tuple[int, ...]
    row: Tensor
    layer: Optional[int]

    def name(self, fmt: str) -> str:
        return getattr(self, fmt)


def _shape(spec: str, dims: dict) -> tuple[int, ...]:
    return tuple(int(part) if part.isdigit() else math.prod(dims[letter] for letter in part)
                 for part in spec.split(","))


def entries(table: Table, config) -> list[Entry]:
    """Every tensor a model of `config` has, in table order (top rows, then each layer's)."""
    dims = table.dims(config)
    out = [Entry(t.ours, t.hf, t.gguf, _shape(t.shape, dims), t, None)
           for t in table.top if t.when(config)]
    for i in range(table.layers(config)):
        ours, hf, gguf = (table.prefixes[k].format(i=i) for k in ("ours", "hf", "gguf"))
        out += [Entry(ours + t.ours, hf + t.hf, None if t.gguf is None else gguf + t.gguf,
                      _shape(t.shape, dims), t, i) for t in table.layer if t.when(config)]
    return out


def file_shapes(table: Table, config, fmt: str) -> dict[str, tuple[int, ...]]:
    """{file name: file shape} of every tensor of `config` in format `fmt` ("hf", "gguf")."""
    if fmt not in FORMATS:
        raise ValueError(f"tensor name format {fmt!r}: one of {FORMATS}")
    return {e.name(fmt): e.shape for e in entries(table, config)}


def check_shapes(want: dict, have: dict) -> None:
    """CheckpointMismatch listing every name of `want` missing from `have`, every name
    `have` has beyond it, and every shape that differs ({name: shape} both)."""
    missing = sorted(set(want) - set(have))
    unexpected = sorted(set(have) - set(want))
    wrong = {n: (tuple(have[n]), want[n]) for n in sorted(set(want) & set(have))
             if tuple(have[n]) != want[n]}
    if missing or unexpected or wrong:
        raise CheckpointMismatch(missing, unexpected, wrong)


def to_params(row: Tensor, value: np.ndarray, dims: dict, order=None, *,
              blocks: bool = False) -> np.ndarray:
    """A file tensor (file layout) in jaxformer's layout (see the module docstring).

    `order`: the per-head feature order of a `rope_rows` row (None: as stored).
    `blocks`: `value` is a quantized kernel whose columns are blocks of the input
    features (GGUF kept blocks): rows are moved, columns kept, nothing reshaped
    across them."""
    kind, K = row.kind, dims.get("K")
    n = dims[row.heads] if row.heads else None
    order = order if row.rope_rows else None
    if kind in (VECTOR, NORM, EMBEDDING):
        return value
    if kind == HEAD_NORM:
        return value if order is None else value[order]
    if kind == LINEAR:
        return value.T
    if kind == CONV:
        return value.transpose(2, 1, 0)
    if kind == ROW:
        return value.reshape(-1)
    if kind == HEADS_IN:  # (n*K, X) -> (X, n, K)
        heads = value.reshape(n, K, -1)
        return (heads if order is None else heads[:, order]).transpose(2, 0, 1)
    if kind == HEADS_OUT:  # (D, n*K) -> (n, K, D); blocks: (X, D)
        return value.T if blocks else value.T.reshape(n, K, -1)
    if kind == HEAD_BIAS:
        heads = value.reshape(n, K)
        return heads if order is None else heads[:, order]
    raise ValueError(f"tensor kind {kind!r} is not one of the table's")


def to_file(row: Tensor, value: np.ndarray, dims: dict, order=None) -> np.ndarray:
    """The inverse of `to_params`: a float parameter in the file's layout. `order`: the
    per-head feature order that takes jaxformer's RoPE layout to the file's."""
    kind = row.kind
    order = order if row.rope_rows else None
    if kind in (VECTOR, NORM, EMBEDDING):
        return value
    if kind == HEAD_NORM:
        return value if order is None else value[order]
    if kind == LINEAR:
        return value.T
    if kind == CONV:
        return value.transpose(2, 1, 0)
    if kind == ROW:
        return value.reshape(1, -1)
    if kind == HEADS_IN:  # (D, n, K) -> (n*K, D)
        heads = value if order is None else value[:, :, order]
        return heads.reshape(value.shape[0], -1).T
    if kind == HEADS_OUT:  # (n, K, D) -> (D, n*K)
        return value.reshape(-1, value.shape[-1]).T
    if kind == HEAD_BIAS:
        return (value if order is None else value[:, order]).reshape(-1)
    raise ValueError(f"tensor kind {kind!r} is not one of the table's")

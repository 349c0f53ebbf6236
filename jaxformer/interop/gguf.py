"""GGUF files (llama.cpp's format): metadata, dequantized tensors, the tokenizer.

Needs the optional `gguf` package (`pip install 'jaxformer[llm]'`); the
`tokenizers` package for `tokenizer_from_gguf`.

    file = read_gguf(path)           # parses the header; tensors stay memory-mapped
    file.metadata["llama.block_count"]
    file.shape("blk.0.attn_q.weight")  # numpy order (rows = output features)
    file.array("blk.0.attn_q.weight")  # float32, dequantized on demand

Quantized tensors are dequantized to float32 with `gguf.quants.dequantize`,
the reference implementation of llama.cpp's block formats. Only the types in
`SUPPORTED_TYPES` are accepted; any other raises a `ValueError` naming the
tensor and its type before anything is dequantized (`check_types`).
Per-model mappings from GGUF names to jaxformer parameters live in
`jaxformer.models` (e.g. `models/llama.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

try:
    import gguf
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError("jaxformer.interop.gguf needs the `gguf` package: "
                      "pip install 'jaxformer[llm]'") from error

Q = gguf.GGMLQuantizationType
SUPPORTED_TYPES = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
                             Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K})


@dataclasses.dataclass
class GGUFFile:
    """A parsed GGUF file: `metadata` {key: value} and its tensors by name."""

    path: str
    metadata: dict[str, Any]
    tensors: dict[str, Any]  # name -> gguf.ReaderTensor (memory-mapped, not yet decoded)

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

    def array(self, name: str) -> np.ndarray:
        """The tensor dequantized to float32, in numpy order."""
        tensor = self.tensors[name]
        if tensor.tensor_type not in SUPPORTED_TYPES:
            self.check_types()
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        return np.asarray(values, np.float32).reshape(self.shape(name))


def read_gguf(path) -> GGUFFile:
    """Parse a GGUF file's header, metadata and tensor index (no tensor is decoded)."""
    reader = gguf.GGUFReader(str(path))
    metadata = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        metadata[key] = field.contents()
    return GGUFFile(str(path), metadata, {t.name: t for t in reader.tensors})


def tokenizer_from_gguf(file: GGUFFile):
    """A `tokenizers.Tokenizer` from the vocabulary stored in a GGUF file.

    Supports `tokenizer.ggml.model == "gpt2"` (byte-level BPE: tokens + merges).
    Control tokens (`<|im_start|>`, ...) are special tokens, matched whole.
    The pre-tokenizer follows llama.cpp: the GPT-2 regex, with digits split
    one by one for the pre-tokenizer types that do so (smollm, starcoder, ...).
    """
    import tokenizers  # noqa: PLC0415 - optional
    from tokenizers import decoders, models, pre_tokenizers  # noqa: PLC0415

    kind = file.metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{file.path}: tokenizer model {kind!r} is not supported "
                         "(only 'gpt2' byte-level BPE)")
    tokens = file.metadata["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in file.metadata["tokenizer.ggml.merges"]]
    bpe = models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False)
    tokenizer = tokenizers.Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if file.metadata.get("tokenizer.ggml.pre") in ("smollm", "starcoder", "refact",
                                                  "command-r", "codeshell", "exaone"):
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    types = file.metadata.get("tokenizer.ggml.token_type", [])
    control = int(gguf.TokenType.CONTROL)
    tokenizer.add_special_tokens([tokenizers.AddedToken(t, special=True)
                                  for t, kind in zip(tokens, types) if kind == control])
    return tokenizer

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
from typing import Any, Optional

import numpy as np

from jaxformer.errors import FileFormatError, require_file

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

    def array(self, name: str, *, check_finite: bool = True) -> np.ndarray:
        """The tensor dequantized to float32, in numpy order; a tensor holding NaN or
        infinity is refused (`check_finite=False` skips the check)."""
        tensor = self.tensors[name]
        if tensor.tensor_type not in SUPPORTED_TYPES:
            self.check_types()
        try:
            with np.errstate(all="ignore"):
                values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            values = np.asarray(values, np.float32).reshape(self.shape(name))
        except (ValueError, IndexError, TypeError) as error:
            raise FileFormatError(self.path, f"tensor {name!r} cannot be decoded ({error})",
                                  "the file is damaged: download it again") from error
        if check_finite and not np.isfinite(values).all():
            raise FileFormatError(self.path, f"tensor {name!r} holds NaN or infinite values",
                                  "the file is damaged: download it again")
        return values


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
        reader = gguf.GGUFReader(path)
        metadata = {key: field.contents() for key, field in reader.fields.items()
                    if not key.startswith("GGUF.")}
        tensors = {t.name: t for t in reader.tensors}
    except (ValueError, IndexError, KeyError, TypeError, OverflowError, MemoryError,
            OSError, UnicodeDecodeError) as error:
        raise FileFormatError(path, f"damaged GGUF file ({type(error).__name__}: "
                                    f"{str(error)[:200]})",
                              "it is truncated or corrupt: download it again") from error
    return GGUFFile(path, metadata, tensors)


def tokenizer_from_gguf(file: GGUFFile):
    """A `tokenizers.Tokenizer` from the vocabulary stored in a GGUF file.

    `tokenizer.ggml.model` "gpt2": byte-level BPE (tokens + merges); the
    pre-tokenizer follows llama.cpp: the GPT-2 regex, with digits split one by
    one for the pre-tokenizer types that do so (smollm, starcoder, ...).
    "llama": SentencePiece (`spm_tokenizer`). Control tokens (`<|im_start|>`,
    `<s>`, ...) are special tokens, matched whole; BOS/EOS are added as
    `tokenizer.ggml.add_bos_token` / `add_eos_token` say (llama.cpp's defaults:
    BOS for "llama", nothing for "gpt2").
    """
    import tokenizers  # noqa: PLC0415 - optional
    from tokenizers import decoders, models, pre_tokenizers  # noqa: PLC0415

    kind = file.metadata.get("tokenizer.ggml.model")
    if kind == "llama":
        return spm_tokenizer(file)
    if kind != "gpt2":
        raise ValueError(f"{file.path}: tokenizer model {kind!r} is not supported "
                         "(only 'gpt2' byte-level BPE and 'llama' SentencePiece)")
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
    _add_bos_eos(tokenizer, file, tokens, default_bos=False)
    return tokenizer


SPACE = "\u2581"  # SentencePiece's space marker "▁"


def spm_merges(tokens, scores, mergeable) -> list[tuple[str, str]]:
    """BPE merges that reproduce SentencePiece's (and llama.cpp's) encoding.

    SentencePiece merges, among adjacent symbols, the pair whose concatenation is
    the vocabulary piece of highest score (leftmost first). As BPE merges: every
    split (left, right) of a mergeable piece into two mergeable pieces, ranked by
    the merged piece's score, highest first (ties: lower id first).
    """
    ids = {t: i for i, t in enumerate(tokens) if mergeable[i]}
    merges = []
    for piece, i in ids.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                merges.append((-float(scores[i]), i, ids[left], left, right))
    merges.sort()
    return [(left, right) for *_, left, right in merges]


def spm_tokenizer(file: GGUFFile):
    """The SentencePiece vocabulary of a GGUF file (`tokenizer.ggml.model == "llama"`)
    as llama.cpp tokenizes with it: spaces become "▁", a "▁" is prepended to the
    text (and after each special token) if `tokenizer.ggml.add_space_prefix`
    (default true), pieces merge by score (`spm_merges`), and characters outside
    the vocabulary fall back to their UTF-8 bytes as `<0xXX>` tokens."""
    import tokenizers  # noqa: PLC0415 - optional
    from tokenizers import decoders, models, normalizers  # noqa: PLC0415

    meta = file.metadata
    tokens = list(meta["tokenizer.ggml.tokens"])
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    T = gguf.TokenType
    types = meta.get("tokenizer.ggml.token_type") or [int(T.NORMAL)] * len(tokens)
    if not len(scores) == len(types) == len(tokens):
        raise FileFormatError(file.path, f"tokenizer.ggml.scores ({len(scores)}) / token_type "
                              f"({len(types)}) and tokens ({len(tokens)}) differ in length",
                              "the file is damaged: download it again")
    unknown = meta.get("tokenizer.ggml.unknown_token_id")
    if unknown is None:
        unknown = next((i for i, k in enumerate(types) if k == int(T.UNKNOWN)), None)
    bpe = models.BPE({t: i for i, t in enumerate(tokens)},
                     spm_merges(tokens, scores, [k == int(T.NORMAL) for k in types]),
                     unk_token=None if unknown is None else tokens[int(unknown)],
                     fuse_unk=True, byte_fallback=True)
    tokenizer = tokenizers.Tokenizer(bpe)
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    # A normalizer, not the Metaspace pre-tokenizer: that one prepends no "▁" to text that
    # starts with a space, SentencePiece and llama.cpp do (" a" -> "▁▁a").
    replace = normalizers.Replace(" ", SPACE)
    tokenizer.normalizer = (normalizers.Sequence([normalizers.Prepend(SPACE), replace])
                            if prefix else replace)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(
        steps + [decoders.Strip(" ", 1, 0)] if prefix else steps)
    special = (int(T.CONTROL), int(T.UNKNOWN))
    tokenizer.add_tokens([tokenizers.AddedToken(t, normalized=False, special=False)
                          for t, k in zip(tokens, types) if k == int(T.USER_DEFINED)])
    tokenizer.add_special_tokens([tokenizers.AddedToken(t, normalized=False, special=True)
                                  for t, k in zip(tokens, types) if k in special])
    _add_bos_eos(tokenizer, file, tokens, default_bos=True)
    return tokenizer


def _add_bos_eos(tokenizer, file: GGUFFile, tokens, *, default_bos: bool) -> None:
    """A post-processor adding BOS / EOS as the file's add_bos_token / add_eos_token say."""
    from tokenizers import processors  # noqa: PLC0415 - optional

    meta = file.metadata
    ends = {}
    for end, default in (("bos", default_bos), ("eos", False)):
        token_id = meta.get(f"tokenizer.ggml.{end}_token_id")
        if meta.get(f"tokenizer.ggml.add_{end}_token", default) and token_id is not None:
            ends[end] = (tokens[int(token_id)], int(token_id))
    if not ends:
        return
    bos = [ends["bos"][0]] if "bos" in ends else []
    eos = [ends["eos"][0]] if "eos" in ends else []
    tokenizer.post_processor = processors.TemplateProcessing(
        single=bos + ["$A"] + eos, pair=bos + ["$A"] + eos + bos + ["$B:1"] + eos,
        special_tokens=sorted(set(ends.values())))

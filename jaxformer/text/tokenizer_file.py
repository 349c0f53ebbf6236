"""A Hugging Face `tokenizers` JSON file as a training tokenizer: `JSONTokenizer`, and
`load_tokenizer(path or None)` (None: bytes)."""

from __future__ import annotations

import os

import numpy as np

from jaxformer.errors import FileFormatError, require_file
from jaxformer.text.byte import ByteTokenizer


# Names tried, in order, for each special token of a Hugging Face tokenizer.
SPECIAL_CANDIDATES = {
    "pad": ("<pad>", "[PAD]", "<|pad|>", "<|padding|>"),
    "bos": ("<s>", "<bos>", "[BOS]", "<|startoftext|>", "<|begin_of_text|>", "[CLS]",
            "<|endoftext|>"),
    "eos": ("</s>", "<eos>", "[EOS]", "<|end_of_text|>", "[SEP]", "<|endoftext|>"),
}


class JSONTokenizer:
    """A Hugging Face `tokenizers` JSON file (e.g. a model's tokenizer.json).

    pad/bos/eos are looked up by name (`SPECIAL_CANDIDATES`) and must be three
    different ids. Text that spells a special token ("<pad>") is encoded as
    ordinary text, so a document never contains a stray PAD or EOS id.
    """

    accepts_bytes = False  # documents must be UTF-8 text

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ValueError(f"tokenizer {path!r}: the `tokenizers` package is needed "
                             "(pip install tokenizers)") from e
        require_file(path, "tokenizer file")
        try:
            self._tok = Tokenizer.from_file(os.fspath(path))
        except Exception as e:  # tokenizers raises plain Exception on bad JSON
            raise FileFormatError(path, "does not load as a Hugging Face tokenizers JSON "
                                  f"file ({str(e).splitlines()[0][:120] if str(e) else e!r})",
                                  "pass a tokenizer.json, or no --tokenizer for bytes") from e
        self._tok.no_padding()
        self._tok.no_truncation()
        self._tok.encode_special_tokens = True
        found, missing = {}, []
        for role, names in SPECIAL_CANDIDATES.items():
            ids = [self._tok.token_to_id(n) for n in names]
            ids = [i for i in ids if i is not None and i not in found.values()]
            if ids:
                found[role] = ids[0]
            else:
                missing.append(f"{role} (tried {', '.join(names)})")
        if missing:
            raise FileFormatError(path, f"lacks special tokens: {'; '.join(missing)}",
                                  "add them (three different tokens) to the tokenizer")
        self.path = os.fspath(path)
        self.pretrained = False
        self.pad_id, self.bos_id, self.eos_id = found["pad"], found["bos"], found["eos"]
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    @classmethod
    def wrap(cls, tokenizer, *, pad_id: int, bos_id: int, eos_id: int, vocab_size: int,
             name: str = "the model's tokenizer") -> "JSONTokenizer":
        """A loaded `tokenizers.Tokenizer` (a pretrained model's: `jaxformer.models.load`)
        with the model's special ids and vocabulary size (its logits' width)."""
        self = cls.__new__(cls)
        # A copy: the caller's tokenizer keeps its settings. Text spelling a special
        # token stays that token here, as the model's own tokenizer treats it.
        self._tok = type(tokenizer).from_str(tokenizer.to_str())
        self._tok.no_padding()
        self._tok.no_truncation()
        self.path = name
        self.pad_id, self.bos_id, self.eos_id = pad_id, bos_id, eos_id
        self.vocab_size = vocab_size
        self.pretrained = True
        return self

    @property
    def hf_tokenizer(self):
        """The `tokenizers.Tokenizer` inside (its vocabulary, e.g. for structured output)."""
        return self._tok

    def encode(self, data: str) -> np.ndarray:
        """(N,) int32 ids, no specials added (a post-processor's BOS/EOS are not applied)."""
        return np.asarray(self._tok.encode(data, add_special_tokens=False).ids, np.int32)

    def encode_prompt(self, text: str) -> np.ndarray:
        """A generation prompt: BOS then the text's ids for a model trained here (every
        document starts with BOS), or as the tokenizer's post-processor makes it for a
        pretrained model (`wrap`: BOS only where that model expects it)."""
        if self.pretrained:
            return np.asarray(self._tok.encode(text, add_special_tokens=True).ids, np.int32)
        return np.concatenate([[self.bos_id], self.encode(text)]).astype(np.int32)

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry of one id ("<|im_end|>"), or "" if there is none."""
        return self._tok.id_to_token(int(token_id)) or ""

    def decode(self, ids) -> str:
        """Text of the ids, special tokens dropped."""
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        return self._tok.decode(ids, skip_special_tokens=True)

    def byte_count(self, ids) -> int:
        """UTF-8 length of `decode(ids)` (specials count 0)."""
        return len(self.decode(ids).encode("utf-8"))


def training_tokenizer(path: str | None) -> ByteTokenizer | JSONTokenizer:
    """None -> ByteTokenizer(); else the JSON tokenizer at `path`."""
    return ByteTokenizer() if path is None else JSONTokenizer(path)

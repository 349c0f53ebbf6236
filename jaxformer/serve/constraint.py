"""Structured output: a JSON schema or a regular expression as a per-step token mask.

The grammar library is `outlines-core` (the Rust core of Outlines, also behind vLLM's
and TGI's guided decoding; no torch, no triton): a regex (a JSON schema is first turned
into one by `outlines_core.json_schema.build_regex_from_schema`) is compiled once per
vocabulary into an `Index`, a token-level automaton; each request walks it with its
own `Guide`. `Grammars` holds one tokenizer's vocabulary and caches compiled indexes,
so the same schema sent twice compiles once.

    grammars = Grammars(tokenizer, vocab_size=config.tgt_vocab_size, eos_id=config.eos_id)
    request = Request(prompt_ids, params, constraint=grammars.json_schema(schema))

`GrammarConstraint` implements `request.TokenConstraint`: `allowed()` is the (V,) bool
mask of tokens that keep the output a prefix of a match (EOS only where the match may
end), `advance(token)` moves past a token, `done()` is True once nothing but EOS may
follow. The library is imported when a `Grammars` is built (the `serve` extra).
"""

from __future__ import annotations

import functools
import json
from typing import Any

import numpy as np

from jaxformer.text.byte import ByteTokenizer, bytes_to_unicode

__all__ = ["GrammarConstraint", "Grammars", "token_bytes"]


def token_bytes(tokenizer) -> dict[int, bytes]:
    """{id: the bytes the token stands for} of every non-special token.

    Takes a Hugging Face `tokenizers.Tokenizer` with byte-level BPE (GPT-2, Llama 3,
    SmolLM2, Qwen: the decoder is ByteLevel) or SentencePiece pieces ("▁" for a space,
    "<0xNN>" byte fallback), or jaxformer's `ByteTokenizer`.
    """
    if isinstance(tokenizer, ByteTokenizer):
        return {b + 3: bytes([b]) for b in range(256)}
    if not hasattr(tokenizer, "to_str") or not hasattr(tokenizer, "get_vocab"):
        raise TypeError(f"tokenizer: a tokenizers.Tokenizer or ByteTokenizer is needed for "
                        f"structured output, got {type(tokenizer).__name__}")
    spec = json.loads(tokenizer.to_str())
    special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    byte_level = "ByteLevel" in json.dumps(spec.get("decoder"))
    inverse = {ch: b for b, ch in bytes_to_unicode().items()}
    out = {}
    for text, index in tokenizer.get_vocab(with_added_tokens=True).items():
        if index in special:
            continue
        if byte_level and all(ch in inverse for ch in text):
            out[index] = bytes(inverse[ch] for ch in text)
        elif len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            out[index] = bytes([int(text[3:5], 16)])
        else:
            out[index] = text.replace("\u2581", " ").encode("utf-8")
    return out


class GrammarConstraint:
    """One request's walk through a compiled grammar (a `request.TokenConstraint`)."""

    def __init__(self, index, vocab_size: int, eos_id: int):
        import outlines_core  # noqa: PLC0415 - optional

        self.guide = outlines_core.Guide(index)
        self.vocab_size, self.eos_id = vocab_size, eos_id
        self.words = np.zeros(((vocab_size + 31) // 32,), np.int32)

    def allowed(self) -> np.ndarray:
        """(V,) bool: True where the token keeps the output a prefix of a match."""
        self.words[:] = 0
        self.guide.write_mask_into(self.words.ctypes.data, self.words.size, 4)
        bits = np.unpackbits(self.words.view(np.uint8), bitorder="little")
        return bits[:self.vocab_size].astype(bool)

    def advance(self, token: int) -> None:
        """Move past `token`; a token the mask did not allow is a ValueError."""
        try:
            self.guide.advance(int(token), return_tokens=False)
        except Exception as e:  # outlines_core raises a plain ValueError/RuntimeError
            raise ValueError(f"token {int(token)} is not allowed by the constraint here") from e

    def done(self) -> bool:
        """True once the output is a full match that nothing but EOS may extend."""
        if not self.guide.is_finished():
            return False
        allowed = self.guide.get_tokens()
        return all(t == self.eos_id for t in allowed)


class Grammars:
    """A tokenizer's vocabulary for the grammar library, and the indexes compiled over it.

    Args:
      tokenizer: see `token_bytes`.
      vocab_size: V, the model's logits width (>= the tokenizer's ids; ids beyond the
        tokenizer are never allowed).
      eos_id: the model's end-of-sequence id, allowed where a match may end.
    """

    def __init__(self, tokenizer, *, vocab_size: int, eos_id: int):
        try:
            import outlines_core  # noqa: PLC0415 - optional
        except ImportError as e:
            raise ImportError("structured output needs outlines-core: pip install "
                              "'jaxformer[structured]'") from e
        pieces: dict[bytes, list[int]] = {}
        for index, data in token_bytes(tokenizer).items():
            if index != eos_id and index < vocab_size and data:
                pieces.setdefault(data, []).append(index)
        self.vocabulary = outlines_core.Vocabulary(eos_id, pieces)
        self.vocab_size, self.eos_id = vocab_size, eos_id
        self.index = functools.lru_cache(maxsize=64)(self.compile)

    def compile(self, regex: str):
        import outlines_core  # noqa: PLC0415 - optional

        try:
            return outlines_core.Index(regex, self.vocabulary)
        except Exception as e:  # a regex the library cannot compile, or no token path
            raise ValueError(f"regex {regex[:80]!r}: {str(e).splitlines()[0][:160]}") from e

    def regex(self, pattern: str) -> GrammarConstraint:
        """A constraint whose output matches `pattern` in full (Rust `regex` syntax)."""
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"regex must be a non-empty string, got {pattern!r}")
        return GrammarConstraint(self.index(pattern), self.vocab_size, self.eos_id)

    def json_schema(self, schema: Any, whitespace: str = r"[ ]?") -> GrammarConstraint:
        """A constraint whose output is JSON valid under `schema` (a dict or its JSON text).

        `whitespace`: the regex allowed between JSON tokens (default: at most one space,
        so a model cannot run on in whitespace).
        """
        from outlines_core.json_schema import build_regex_from_schema  # noqa: PLC0415

        if isinstance(schema, dict):
            text = json.dumps(schema)
        elif isinstance(schema, str):
            try:
                json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"json schema is not JSON: {e}") from e
            text = schema
        else:
            raise ValueError(f"json schema must be a dict or JSON text, got "
                             f"{type(schema).__name__}")
        try:
            regex = build_regex_from_schema(text, whitespace)
        except Exception as e:
            raise ValueError(f"json schema not supported: {str(e).splitlines()[0][:160]}"
                             ) from e
        return GrammarConstraint(self.index(regex), self.vocab_size, self.eos_id)

"""Bytes as tokens: `ByteTokenizer` (what `--task lm` trains on without a tokenizer file),
and the same vocabulary as a Hugging Face `tokenizers.Tokenizer` (for export)."""

from __future__ import annotations

import numpy as np

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2  # jaxformer's TransformerConfig defaults


class ByteTokenizer:
    """Bytes as tokens: byte b -> id b + 3 after PAD 0, BOS 1, EOS 2. Takes any bytes."""

    vocab_size = 259
    pad_id, bos_id, eos_id = PAD_ID, BOS_ID, EOS_ID
    accepts_bytes = True  # TextData passes raw bytes (no UTF-8 decoding needed)

    def encode(self, data: bytes | str) -> np.ndarray:
        """(N,) int32 ids of the bytes (a str is UTF-8 encoded), no specials added."""
        if isinstance(data, str):
            data = data.encode("utf-8")
        return np.frombuffer(data, np.uint8).astype(np.int32) + 3

    def encode_prompt(self, text: str) -> np.ndarray:
        """A generation prompt: BOS then the text's ids."""
        return np.concatenate([[self.bos_id], self.encode(text)]).astype(np.int32)

    def _bytes(self, ids) -> bytes:
        ids = np.asarray(ids).reshape(-1)
        return (ids[ids >= 3] - 3).astype(np.uint8).tobytes()

    def decode(self, ids) -> str:
        """Specials dropped; bytes that are not UTF-8 become U+FFFD."""
        return self._bytes(ids).decode("utf-8", errors="replace")

    def byte_count(self, ids) -> int:
        """Number of bytes the ids stand for (specials count 0)."""
        return int(np.count_nonzero(np.asarray(ids) >= 3))


def byte_tokenizer():
    """`ByteTokenizer` as a `tokenizers.Tokenizer`: byte b -> id b + 3
    after <pad>, <s>, </s> (GPT-2's byte-to-character table, no merges)."""
    import tokenizers  # noqa: PLC0415 - optional
    from tokenizers import decoders, models, pre_tokenizers  # noqa: PLC0415

    table = bytes_to_unicode()
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {table[b]: b + 3 for b in range(256)}
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab, [], fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<pad>", "<s>", "</s>"])
    return tokenizer


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable character of each byte (the ByteLevel pre-tokenizer's table)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def with_bos(tokenizer, bos_id: int):
    """A copy of `tokenizer` that starts every encoding with the token `bos_id` (how
    `jaxformer train --task lm` saw every document), for `transformers`' encode."""
    from tokenizers import processors  # noqa: PLC0415 - optional

    copy = type(tokenizer).from_str(tokenizer.to_str())
    bos = copy.id_to_token(bos_id)
    copy.post_processor = processors.TemplateProcessing(single=f"{bos} $A",
                                                        pair=f"{bos} $A $B",
                                                        special_tokens=[(bos, bos_id)])
    return copy

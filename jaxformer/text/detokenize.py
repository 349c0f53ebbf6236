"""Each token's own share of a sequence's text, as the tokens stream (no JAX here).

    text = Detokenizer(tokenizer, context=prompt_ids)
    piece = text.push(token)         # the text this token completes ("" while a
                                     # multi-byte character is still partial)
    token_texts(tokenizer, ids)      # every id's share at once

The server's logprobs name each token by its share (OpenAI's `tokens` and
`text_offset`: "".join(shares) is the text); `jaxformer generate` prints each
share of one prompt's continuation as its token is picked (`cli.streaming`).

A token's text is the difference between decoding a short window of ids with
and without it (vLLM's prefix/read offsets), so a SentencePiece word keeps its
leading space and a byte-level BPE character split over two tokens appears
once, whole, with the second. Decoding drops special tokens, as the tokenizer's
`decode` does.
"""

from __future__ import annotations

from typing import Sequence

# Prompt ids kept as the window's left context: enough for any merge to settle.
CONTEXT = 6


class Detokenizer:
    """Incremental decoding of one sequence (see the module docstring)."""

    def __init__(self, tokenizer, context: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.ids = [int(i) for i in list(context)[-CONTEXT:]]
        self.prefix = 0
        self.read = len(self.ids)

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        after = self.tokenizer.decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """Text of ids still pending (a partial character at the end: U+FFFD)."""
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        after = self.tokenizer.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return after[len(before):] if after.startswith(before) else ""


def token_texts(tokenizer, ids: Sequence[int], context: Sequence[int] = ()) -> list[str]:
    """Each id's share of the decoded text ("" for a special token or a partial character,
    whose text arrives with the id that completes it)."""
    text = Detokenizer(tokenizer, context)
    pieces = [text.push(i) for i in ids]
    if pieces:
        pieces[-1] += text.flush()
    return pieces

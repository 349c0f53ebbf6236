"""Text printed as a decode loop picks its tokens (`jaxformer generate` of one prompt)."""

from __future__ import annotations

import sys

from jaxformer.text.detokenize import Detokenizer


class TextStream:
    """Prints `prompt`, then the continuation's text as it grows, one row's picks at a time.

    Each pick's share of the text comes from `text.detokenize.Detokenizer` (the
    server's): a byte-level or SentencePiece token may end inside a character,
    whose text comes whole with the token that completes it; `finish` writes the
    rest of the final text, so the printed text ends equal to `tokenizer.decode(ids)`.
    """

    def __init__(self, tokenizer, prompt: str, *, stop: set, row: int = 0, out=None):
        self.tokenizer, self.stop, self.row = tokenizer, set(stop), row
        self.out = sys.stdout if out is None else out
        self.text = Detokenizer(tokenizer)
        self.printed = ""
        self.ended = False
        self.out.write(prompt)
        self.out.flush()

    def on_token(self, step, token_B) -> None:
        """`jaxformer.decode.api.generate`'s `on_token`: (step, (B,) picks)."""
        del step  # the callbacks come in step order
        token = int(token_B[self.row])
        if self.ended or token in self.stop:
            self.ended = True
            return
        self._write(self.text.push(token))

    def finish(self, text: str) -> None:
        """Print what is left of the final `text` and end the line."""
        if text.startswith(self.printed):
            self._write(text[len(self.printed):])
        self.out.write("\n")
        self.out.flush()

    def _write(self, piece: str) -> None:
        if piece:
            self.out.write(piece)
            self.out.flush()
            self.printed += piece

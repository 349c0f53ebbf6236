"""Token ids to text as they stream, and stop strings cut out of it (no JAX here).

    text = Detokenizer(tokenizer, context=prompt_ids)
    piece = text.push(token)         # the text this token completes ("" while a
                                     # multi-byte character is still partial)
    stops = StopMatcher(("\\n\\n",))
    shown, stopped = stops.feed(piece)   # text safe to send; True once a stop matched

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


class StopMatcher:
    """Finds the first stop string in streamed text; holds back what may start one."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.pending = ""
        self.stopped = False

    def feed(self, piece: str) -> tuple[str, bool]:
        """(text that can be shown now, whether a stop string matched): after a match the
        text ends before the stop string and every later piece is dropped."""
        if self.stopped:
            return "", True
        if not self.stops:
            return piece, False
        text = self.pending + piece
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self.pending = True, ""
            return text[:min(hits)], True
        hold = 0  # the longest tail of text that is a proper prefix of some stop string
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), hold, -1):
                if text.endswith(stop[:n]):
                    hold = n
                    break
        self.pending = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold], False

    def flush(self) -> str:
        """The text held back, once the sequence ended without a stop string."""
        text, self.pending = self.pending, ""
        return text

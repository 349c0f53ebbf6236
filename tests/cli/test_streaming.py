"""`jaxformer generate`'s printed stream of one prompt (`cli.streaming.TextStream`): each
pick's share of the text from the one incremental detokenizer (`text.detokenize`)."""

import io

import numpy as np

from jaxformer.cli.streaming import TextStream
from jaxformer.text import ByteTokenizer


class Recorder(io.StringIO):
    def __init__(self):
        super().__init__()
        self.writes = []

    def write(self, text):
        self.writes.append(text)
        return super().write(text)


def stream(tokenizer, ids, stop=()):
    out = Recorder()
    text = TextStream(tokenizer, "> ", stop=set(stop), out=out)
    for step, token in enumerate(ids):
        text.on_token(step, np.asarray([token]))
    kept = ids[:ids.index(stop[0])] if stop else ids
    text.finish(tokenizer.decode(kept))
    return out


def test_multibyte_characters_print_whole_and_the_line_is_the_decoded_text():
    tok = ByteTokenizer()
    ids = tok.encode("héllo ✓ wörld").tolist()
    out = stream(tok, ids)
    assert out.getvalue() == "> " + tok.decode(ids) + "\n"
    pieces = [w for w in out.writes[1:-1] if w]
    assert pieces == list("héllo ✓ wörld")  # one write per character, never a U+FFFD


def test_a_stop_id_ends_the_stream():
    tok = ByteTokenizer()
    ids = tok.encode("ab").tolist() + [tok.eos_id] + tok.encode("cd").tolist()
    out = stream(tok, ids, stop=(tok.eos_id,))
    assert out.getvalue() == "> ab\n"


class Pieces:
    """A SentencePiece-like tokenizer: "▁" is a space, dropped at the start of a text."""
    vocab = ["▁Hello", "▁world", "!", ","]

    def decode(self, ids):
        return "".join(self.vocab[i] for i in ids).replace("▁", " ").removeprefix(" ")


def test_a_word_keeps_its_leading_space_after_the_first():
    out = stream(Pieces(), [0, 3, 1, 2])
    assert out.getvalue() == "> Hello, world!\n"
    assert [w for w in out.writes[1:-1] if w] == ["Hello", ",", " world", "!"]

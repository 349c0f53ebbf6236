"""The decoder's previous-text prompt: `--initial-prompt` and conditioning on the
previous window's text, as openai-whisper and faster-whisper build it.

    ids = encode_text(w, "Glossary: JAX, Flax.")      # " " + text, the model's BPE
    ctx = Context(w.vocab, [ids], condition=True)      # one list per file
    prompt = ctx.prompt(0, prompt_ids(...))            # <|startofprev|> ... <|sot|> ...
    ctx.add(0, [segment ids], temperature)             # after each decoded window

A window's prompt is `<|startofprev|>`, the last 223 (`max_length // 2 - 1`)
tokens of the file's text so far (timestamps included), then the usual
`<|startoftranscript|> <|lang|> <|task|>`; with no text so far (and no initial
prompt) the prompt has no `<|startofprev|>` part. The initial prompt's tokens
come first. The text so far is forgotten (`prompt_reset_since`) after a window
when conditioning is off, or when the window was decoded at a temperature
above `reset_temperature` (0.5: sampled text is unreliable context).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

MAX_LENGTH = 448  # Whisper's decoder positions
RESET_TEMPERATURE = 0.5  # faster-whisper's prompt_reset_on_temperature

PromptInput = Union[None, str, Sequence[int]]


def encode_text(w, text: PromptInput) -> list[int]:
    """The ids of an initial prompt: a string is encoded as faster-whisper encodes it
    (" " + text.strip(), the checkpoint's tokenizer.json through the `tokenizers`
    package); a sequence of ids is taken as it is (checked against the vocabulary).

    Raises:
      ValueError naming what is missing (no tokenizer.json, `tokenizers` not
      installed) or an id outside the text tokens.
    """
    if text is None:
        return []
    eot = list(w.vocab).index("<|endoftext|>")
    if not isinstance(text, str):
        ids = list(text)
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < eot
                   for i in ids):
            raise ValueError(f"initial_prompt ids must be text token ids in [0, {eot}), got "
                             f"{ids[:8]}{'...' if len(ids) > 8 else ''}")
        return ids
    if w.tokenizer_file is None:
        raise ValueError("initial_prompt as text needs the model folder's tokenizer.json "
                         "(or pass token ids)")
    try:
        from tokenizers import Tokenizer  # noqa: PLC0415 - optional: the text/llm extras
    except ImportError:
        raise ValueError("initial_prompt as text needs the `tokenizers` package: "
                         "pip install 'jaxformer[text]'") from None
    tokenizer = Tokenizer.from_file(w.tokenizer_file)
    return [i for i in tokenizer.encode(" " + text.strip(), add_special_tokens=False).ids]


def conditioned(previous: Sequence[int], base: Sequence[int], sot_prev: int) -> list[int]:
    """`base` (<|startoftranscript|> ...) after <|startofprev|> and the last
    `MAX_LENGTH // 2 - 1` ids of `previous`, or `base` alone without previous ids."""
    if not previous:
        return list(base)
    return [sot_prev, *list(previous)[-(MAX_LENGTH // 2 - 1):], *base]


@dataclasses.dataclass
class Context:
    """Each file's text so far, as the prompt of its next window (`prompt`)."""

    vocab: Sequence[str]
    initial: list  # per file: the initial prompt's ids (may be empty)
    condition: bool = True
    reset_temperature: float = RESET_TEMPERATURE

    def __post_init__(self):
        self.sot_prev = list(self.vocab).index("<|startofprev|>")
        self.tokens = [list(ids) for ids in self.initial]
        self.since = [0] * len(self.tokens)

    def prompt(self, f: int, base: Sequence[int]) -> list[int]:
        return conditioned(self.tokens[f][self.since[f]:], base, self.sot_prev)

    def add(self, f: int, pieces: Sequence[Sequence[int]], temperature: Optional[float]
            ) -> None:
        """After a decoded window of file f: its segments' ids (those with text) join
        the text so far, which is then forgotten if conditioning is off or the window
        was decoded above `reset_temperature`."""
        for piece in pieces:
            self.tokens[f].extend(piece)
        if not self.condition or (temperature is not None
                                  and temperature > self.reset_temperature):
            self.since[f] = len(self.tokens[f])

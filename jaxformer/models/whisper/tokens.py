"""Whisper's vocabulary conventions: special tokens, language codes, the decoder
prompt, and the text of token ids.

    t = tokens_of(vocab)                                  # `Tokens`: the special ids
    prompt = prompt_ids(vocab, "en", "transcribe", timestamps=True)
    text = decode_text(vocab, ids)                        # byte-level BPE -> str
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Optional, Sequence

TASKS = ("transcribe", "translate")
# Every language code a Whisper vocabulary can hold (openai-whisper's LANGUAGES, in
# vocabulary order; large-v3 added "yue"): a code outside it is refused before any
# model is read. Which of them a given model knows is its vocabulary's business.
LANGUAGE_CODES = (
    "en", "zh", "de", "es", "ru", "ko", "fr", "ja", "pt", "tr", "pl", "ca", "nl", "ar", "sv",
    "it", "id", "hi", "fi", "vi", "he", "uk", "el", "ms", "cs", "ro", "da", "hu", "ta", "no",
    "th", "ur", "hr", "bg", "lt", "la", "mi", "ml", "cy", "sk", "te", "fa", "lv", "bn", "sr",
    "az", "sl", "kn", "et", "mk", "br", "eu", "is", "hy", "ne", "mn", "bs", "kk", "sq", "sw",
    "gl", "mr", "pa", "si", "km", "sn", "yo", "so", "af", "oc", "ka", "be", "tg", "sd", "gu",
    "am", "yi", "lo", "uz", "fo", "ht", "ps", "tk", "nn", "mt", "sa", "lb", "my", "bo", "tl",
    "mg", "as", "tt", "haw", "ln", "ha", "ba", "jw", "su", "yue")


def check_language_code(code: str) -> None:
    """ValueError unless `code` is "auto" or a Whisper language code (`LANGUAGE_CODES`)."""
    if code != "auto" and code not in LANGUAGE_CODES:
        raise ValueError(f"unknown language {code!r}: Whisper's codes are ISO 639-1 style, "
                         f"e.g. {', '.join(LANGUAGE_CODES[:8])} (or 'auto')")
TIME_PRECISION = 0.02  # seconds per timestamp token: <|0.00|>, <|0.02|>, ...
MULTILINGUAL_VOCAB = 51865  # openai-whisper's test: English-only (".en") vocabularies are smaller


@dataclasses.dataclass(frozen=True)
class Tokens:
    """The special token ids of a Whisper vocabulary (text tokens come first, then
    <|endoftext|>, <|startoftranscript|>, the language tokens, the task tokens,
    ..., <|notimestamps|>, and the timestamps <|0.00|> .. <|30.00|> last)."""

    eot: int
    sot: int
    translate: int
    transcribe: int
    no_timestamps: int
    timestamp_begin: int
    languages: tuple[str, ...]  # codes, in vocabulary order
    language_ids: tuple[int, ...]
    multilingual: bool
    no_speech: Optional[int] = None  # <|nospeech|> (<|nocaptions|> in older vocabularies)

    def language_id(self, code: str) -> int:
        """The id of <|code|>, or ValueError naming the code and listing known ones."""
        if code not in self.languages:
            raise ValueError(f"unknown language {code!r}: the model knows {len(self.languages)} "
                             f"codes, e.g. {', '.join(self.languages[:8])} (or 'auto')")
        return self.language_ids[self.languages.index(code)]


def tokens_of(vocab: Sequence[str]) -> Tokens:
    """The `Tokens` of a vocabulary (as `load_ct2` returns it), found once per
    vocabulary: every window's decoding asks for them several times, and reading
    51,864 tokens took 16 ms a time."""
    return _tokens_of(tuple(vocab))


@functools.lru_cache(maxsize=4)
def _tokens_of(vocab: tuple[str, ...]) -> Tokens:
    ids = {token: i for i, token in enumerate(vocab)}
    sot, translate = ids["<|startoftranscript|>"], ids["<|translate|>"]
    languages = [(vocab[i][2:-2], i) for i in range(sot + 1, translate)
                 if re.fullmatch(r"<\|[a-z]{2,3}(-[a-z]+)?\|>", vocab[i])]
    no_timestamps = ids["<|notimestamps|>"]
    return Tokens(eot=ids["<|endoftext|>"], sot=sot, translate=translate,
                  transcribe=ids["<|transcribe|>"], no_timestamps=no_timestamps,
                  timestamp_begin=no_timestamps + 1,
                  languages=tuple(c for c, _ in languages),
                  language_ids=tuple(i for _, i in languages),
                  multilingual=len(vocab) >= MULTILINGUAL_VOCAB,
                  no_speech=ids.get("<|nospeech|>", ids.get("<|nocaptions|>")))


def prompt_ids(vocab: list[str], language: Optional[str] = "en", task: str = "transcribe",
               timestamps: bool = False) -> list[int]:
    """The decoder prompt: <|startoftranscript|> <|language|> <|task|>, then
    <|notimestamps|> unless `timestamps`. `language=None` leaves out the language and
    task tokens, the form English-only models were trained with.

    Raises:
      ValueError naming an unknown language code or task.
    """
    t = tokens_of(vocab)
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    ids = [t.sot]
    if language is not None:
        ids += [t.language_id(language), t.translate if task == "translate" else t.transcribe]
    return ids if timestamps else ids + [t.no_timestamps]


@functools.lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: {printable character: the byte it stands for}."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    others = [b for b in range(256) if b not in printable]
    chars = printable + [256 + i for i in range(len(others))]
    return {chr(c): b for b, c in zip(printable + others, chars)}


def decode_text(vocab: Sequence[str], ids: Sequence[int]) -> str:
    """The text of token ids; special tokens and timestamps (ids >= <|endoftext|>) are
    skipped. Bytes that are not valid UTF-8 (a character cut by the window edge)
    become U+FFFD."""
    eot = tokens_of(list(vocab)).eot
    table = byte_decoder()
    data = bytes(table[ch] for i in ids if i < eot for ch in vocab[i])
    return data.decode("utf-8", errors="replace")

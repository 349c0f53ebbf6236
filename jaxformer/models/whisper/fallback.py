"""Long-form safeguards as openai-whisper and faster-whisper define them: the
temperature fallback on a window whose text is too repetitive (gzip compression
ratio) or too improbable (average log-probability), and the no-speech rule.

    s = Safeguards()                                   # openai-whisper's defaults
    needs_fallback(text, avg_logprob, no_speech_prob, s)   # decode again, hotter?
    is_no_speech(avg_logprob, no_speech_prob, s)           # drop the window?

A window is decoded at `temperatures[0]` (0.0: greedy); if its text compresses
better than `compression_ratio_threshold` (a loop: "the the the ...") or its
average log-probability is below `logprob_threshold`, it is decoded again at the
next temperature (sampling, `best_of` candidates, the most probable kept) unless
it is likely silence (no-speech probability above `no_speech_threshold` and the
log-probability low: then it is dropped, not retried). If every temperature fails,
the most probable result is kept among those under the compression threshold (or
among all). The rules are faster-whisper's `generate_with_fallback`.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Optional, Sequence

TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)


def compression_ratio(text: str) -> float:
    """len(UTF-8 bytes) / len(zlib-compressed bytes) (openai-whisper's
    `compression_ratio`): about 1 to 2 for speech, above 2.4 for a loop."""
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data))


def finite_or_none(name: str, value) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
            value):
        raise ValueError(f"{name} must be a finite number or None, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Safeguards:
    """The fallback and no-speech settings (None turns a test off); defaults are
    openai-whisper's and faster-whisper's."""

    temperatures: Sequence[float] = TEMPERATURES
    compression_ratio_threshold: Optional[float] = 2.4
    logprob_threshold: Optional[float] = -1.0
    no_speech_threshold: Optional[float] = 0.6
    best_of: int = 5

    def __post_init__(self):
        object.__setattr__(self, "temperatures", tuple(float(t) for t in (
            self.temperatures if isinstance(self.temperatures, (list, tuple))
            else [self.temperatures])))
        self.check()

    def check(self) -> None:
        """ValueError naming the first setting out of range."""
        if not self.temperatures or any(not math.isfinite(t) or t < 0
                                        for t in self.temperatures):
            raise ValueError(f"temperatures must be finite numbers >= 0 (at least one), got "
                             f"{list(self.temperatures)}")
        if list(self.temperatures) != sorted(self.temperatures):
            raise ValueError(f"temperatures must not decrease, got {list(self.temperatures)}")
        for name in ("compression_ratio_threshold", "logprob_threshold", "no_speech_threshold"):
            finite_or_none(name, getattr(self, name))
        if self.no_speech_threshold is not None and not 0 <= self.no_speech_threshold <= 1:
            raise ValueError(f"no_speech_threshold is a probability in [0, 1], got "
                             f"{self.no_speech_threshold!r}")
        if self.compression_ratio_threshold is not None and self.compression_ratio_threshold <= 0:
            raise ValueError(f"compression_ratio_threshold must be > 0, got "
                             f"{self.compression_ratio_threshold!r}")
        if self.logprob_threshold is not None and self.logprob_threshold > 0:
            raise ValueError(f"logprob_threshold is a log-probability (<= 0), got "
                             f"{self.logprob_threshold!r}")
        if isinstance(self.best_of, bool) or not isinstance(self.best_of, int) or self.best_of < 1:
            raise ValueError(f"best_of must be an int >= 1, got {self.best_of!r}")


def is_no_speech(avg_logprob: float, no_speech_prob: Optional[float], s: Safeguards) -> bool:
    """openai-whisper's skip rule: <|nospeech|> likely, and the text not confident."""
    if s.no_speech_threshold is None or no_speech_prob is None:
        return False
    return no_speech_prob > s.no_speech_threshold and not (
        s.logprob_threshold is not None and avg_logprob > s.logprob_threshold)


def needs_fallback(text: str, avg_logprob: float, no_speech_prob: Optional[float],
                   s: Safeguards) -> bool:
    """Decode the window again at the next temperature? (faster-whisper's rules: too
    repetitive or too improbable, unless it is likely silence.)"""
    fallback = (s.compression_ratio_threshold is not None
                and compression_ratio(text) > s.compression_ratio_threshold)
    low = s.logprob_threshold is not None and avg_logprob < s.logprob_threshold
    if low:
        fallback = True
    if (s.no_speech_threshold is not None and no_speech_prob is not None
            and no_speech_prob > s.no_speech_threshold and low):
        fallback = False  # silence: dropped by the no-speech rule, not retried
    return fallback


def final_choice(tried: Sequence[tuple[str, float]], s: Safeguards) -> int:
    """The index kept when every temperature failed: the highest average
    log-probability among the results under the compression threshold, or among all.
    `tried`: [(text, avg_logprob)] in the order decoded."""
    under = [i for i, (text, _) in enumerate(tried)
             if s.compression_ratio_threshold is None
             or compression_ratio(text) <= s.compression_ratio_threshold]
    return max(under or range(len(tried)), key=lambda i: tried[i][1])

"""What transcription returns (`Transcript`, `Segment`) and its output formats
(text, JSON; the subtitle formats are in `subtitles`)."""

from __future__ import annotations

import dataclasses
import json
from typing import Optional

from jaxformer.models.whisper.words import Word


@dataclasses.dataclass(frozen=True)
class Segment:
    """A stretch of the audio (seconds from its start) and its text; `words` with
    word timestamps (else None, and left out of `to_dict`)."""

    start: float
    end: float
    text: str
    words: Optional[tuple[Word, ...]] = None

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        if self.words is None:
            del out["words"]
        return out


@dataclasses.dataclass(frozen=True)
class Transcript:
    """`language_probability` is None when the language was not detected (given, or
    an English-only model)."""

    text: str
    language: str
    language_probability: Optional[float]
    segments: tuple[Segment, ...]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"segments": [s.to_dict() for s in self.segments]}

def srt_time(seconds: float) -> str:
    """SubRip time: HH:MM:SS,mmm."""
    ms = int(round(max(seconds, 0.0) * 1000))
    return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d},{ms % 1000:03d}"


def to_text(result: Transcript, timestamps: bool = False) -> str:
    """The text, or one `[start --> end] text` line per segment."""
    if not timestamps:
        return result.text
    return "\n".join(f"[{srt_time(s.start).replace(',', '.')} --> "
                     f"{srt_time(s.end).replace(',', '.')}] {s.text}" for s in result.segments)


def to_json(result: Transcript) -> str:
    """One JSON line: text, language, language_probability, segments."""
    return json.dumps(result.to_dict(), ensure_ascii=False)

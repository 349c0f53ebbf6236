"""Subtitle and table formats of a transcript, as openai-whisper's writers (`utils.py`)
write them: SubRip (`srt`), WebVTT (`vtt`) and tab-separated values (`tsv`).

    print(whisper.srt(result.segments))                      # a cue per segment
    print(whisper.vtt(result.segments, max_line_width=42, max_line_count=2))
    print(whisper.tsv(result.segments))                      # start\\tend\\ttext, in ms

With word timestamps (segments with `words`), the cues are built from the words
as openai-whisper's `SubtitlesWriter.iterate_result` builds them: a cue per
segment from its first word's start to its last word's end; `max_line_width`
(characters) and `max_line_count` (lines per cue) re-cut the text into lines and
cues by word timing, ignoring segment bounds (a pause over 3 s starts a new
cue); `max_words_per_line` cuts each segment into cues of that many words;
`highlight_words` gives a cue per word with that word underlined (`<u>word</u>`).
"""

from __future__ import annotations

import re
from typing import Iterator, Optional, Sequence

from jaxformer.models.whisper.output import Segment

LONG_PAUSE_S = 3.0  # a longer gap between words starts a new cue (line-width mode)


def format_timestamp(seconds: float, always_include_hours: bool = False,
                     decimal_marker: str = ".") -> str:
    """`[HH:]MM:SS.mmm`, as openai-whisper's `format_timestamp` (negative times: 0)."""
    ms = round(max(seconds, 0.0) * 1000.0)
    hours, minutes, secs, ms = ms // 3_600_000, ms // 60_000 % 60, ms // 1000 % 60, ms % 1000
    marker = f"{hours:02d}:" if always_include_hours or hours > 0 else ""
    return f"{marker}{minutes:02d}:{secs:02d}{decimal_marker}{ms:03d}"


def check_layout(max_line_width: Optional[int] = None, max_line_count: Optional[int] = None,
                 max_words_per_line: Optional[int] = None) -> None:
    """ValueError naming an option that is not None or a positive integer, or
    `max_line_count` without `max_line_width` (it would do nothing)."""
    for name, value in (("max_line_width", max_line_width), ("max_line_count", max_line_count),
                        ("max_words_per_line", max_words_per_line)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
    if max_line_count is not None and max_line_width is None:
        raise ValueError("max_line_count needs max_line_width (lines are cut by width)")


def _word_cues(segments: Sequence[Segment], max_line_width, max_line_count,
               max_words_per_line) -> Iterator[list[dict]]:
    """openai-whisper's `iterate_subtitles`: the words of each cue (dicts with word,
    start, end; a line break is a "\\n" before a word)."""
    preserve_segments = max_line_count is None or max_line_width is None
    max_line_width = max_line_width or 1000
    max_words_per_line = max_words_per_line or 1000
    line_len, line_count, subtitle = 0, 1, []
    starts = [w.start for s in segments for w in s.words]
    last = (starts[0] if starts else segments[0].start if segments else None) or 0.0
    for segment in segments:
        words = segment.words
        for chunk in range(0, len(words), max_words_per_line):
            for i, original in enumerate(words[chunk:chunk + max_words_per_line]):
                timing = dict(word=original.word, start=original.start, end=original.end)
                long_pause = not preserve_segments and timing["start"] - last > LONG_PAUSE_S
                has_room = line_len + len(timing["word"]) <= max_line_width
                seg_break = i == 0 and len(subtitle) > 0 and preserve_segments
                if line_len > 0 and has_room and not long_pause and not seg_break:
                    line_len += len(timing["word"])  # the line goes on
                else:
                    timing["word"] = timing["word"].strip()
                    if (subtitle and max_line_count is not None
                            and (long_pause or line_count >= max_line_count) or seg_break):
                        yield subtitle  # a new cue
                        subtitle, line_count = [], 1
                    elif line_len > 0:  # a new line in the cue
                        line_count += 1
                        timing["word"] = "\n" + timing["word"]
                    line_len = len(timing["word"].strip())
                subtitle.append(timing)
                last = timing["start"]
    if subtitle:
        yield subtitle


def cues(segments: Sequence[Segment], *, max_line_width: Optional[int] = None,
         max_line_count: Optional[int] = None, highlight_words: bool = False,
         max_words_per_line: Optional[int] = None, always_include_hours: bool = False,
         decimal_marker: str = ".") -> list[tuple[str, str, str]]:
    """(start, end, text) of each subtitle cue (openai-whisper's `iterate_result`):
    by words when the segments have them (see the module docstring), else one
    cue per segment."""
    check_layout(max_line_width, max_line_count, max_words_per_line)

    def stamp(seconds):
        return format_timestamp(seconds, always_include_hours, decimal_marker)

    if not segments or segments[0].words is None:
        return [(stamp(s.start), stamp(s.end), s.text.strip().replace("-->", "->"))
                for s in segments]
    out = []
    for subtitle in _word_cues(segments, max_line_width, max_line_count, max_words_per_line):
        start, end = stamp(subtitle[0]["start"]), stamp(subtitle[-1]["end"])
        words = [timing["word"] for timing in subtitle]
        if not highlight_words:
            out.append((start, end, "".join(words)))
            continue
        last = start
        for i, timing in enumerate(subtitle):
            word_start, word_end = stamp(timing["start"]), stamp(timing["end"])
            if last != word_start:  # the gap before the word: no underline
                out.append((last, word_start, "".join(words)))
            out.append((word_start, word_end, "".join(
                re.sub(r"^(\s*)(.*)$", r"\1<u>\2</u>", word) if j == i else word
                for j, word in enumerate(words))))
            last = word_end
    return out


def srt(segments: Sequence[Segment], **layout) -> str:
    """SubRip subtitles: numbered cues `HH:MM:SS,mmm --> HH:MM:SS,mmm` and their text;
    `layout`: the word options of `cues`."""
    return "".join(f"{i}\n{start} --> {end}\n{text}\n\n" for i, (start, end, text) in
                   enumerate(cues(segments, always_include_hours=True, decimal_marker=",",
                                  **layout), 1))


def vtt(segments: Sequence[Segment], **layout) -> str:
    """WebVTT subtitles: `WEBVTT`, then cues `[HH:]MM:SS.mmm --> ...` and their text;
    `layout`: the word options of `cues`."""
    return "WEBVTT\n\n" + "".join(f"{start} --> {end}\n{text}\n\n"
                                  for start, end, text in cues(segments, **layout))


def tsv(segments: Sequence[Segment]) -> str:
    """A header `start<TAB>end<TAB>text`, then a row per segment: start and end in
    integer milliseconds, the text with tabs as spaces."""
    rows = [f"{round(1000 * s.start)}\t{round(1000 * s.end)}\t"
            f"{s.text.strip().replace(chr(9), ' ')}\n" for s in segments]
    return "start\tend\ttext\n" + "".join(rows)

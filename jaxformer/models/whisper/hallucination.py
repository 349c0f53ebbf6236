"""Skipping the silence around likely hallucinations (`hallucination_silence_threshold`),
as openai-whisper's and faster-whisper's `transcribe` do it with word timestamps.

A segment is "anomalous" when its first eight words (punctuation left out) are
improbable (probability < 0.15), very short (< 0.133 s) or very long (> 2 s): the
words Whisper invents in silence or noise. With a threshold T (seconds):

- if a window's first segment with words is anomalous and starts more than T
  after the window, the window is dropped and decoded again from that start;
- otherwise the first anomalous segment with silence (or another anomaly) on both
  sides (a gap over T, or within 2 s of the window's start or end) is dropped with
  everything after it, and the next window starts at its start (at least 1 s into
  this window; at the end of the file when less than T remains after it).

openai-whisper also moves the next window to the end of this one when less than T
seconds follow the last word; faster-whisper does not, and neither does this module
(its word timestamps and seeking are faster-whisper's).
"""

from __future__ import annotations

from typing import Optional, Sequence

PUNCTUATION = "\"'“¿([{-\"'.。,，!！?？:：”)]}、"
FRAMES_PER_SECOND = 100


def word_anomaly_score(word) -> float:
    """How unlike a spoken word `word` (a `words.Word`) is: 1 if improbable, plus the
    shortfall below 0.133 s (x 15), plus the excess over 2 s."""
    duration = word.end - word.start
    score = 1.0 if word.probability < 0.15 else 0.0
    if duration < 0.133:
        score += (0.133 - duration) * 15
    if duration > 2.0:
        score += duration - 2.0
    return score


def is_segment_anomaly(words: Optional[Sequence]) -> bool:
    """Whether a segment's words look invented: the scores of its first 8 words
    (punctuation left out) sum to 3 or more, or to about their count."""
    if not words:
        return False
    spoken = [w for w in words if w.word not in PUNCTUATION][:8]
    score = sum(word_anomaly_score(w) for w in spoken)
    return score >= 3 or score + 0.01 >= len(spoken)


def check_threshold(threshold: Optional[float]) -> None:
    """ValueError unless None or a finite number of seconds >= 0."""
    if threshold is None:
        return
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not (
            0 <= threshold < float("inf")):
        raise ValueError(f"hallucination_silence_threshold must be None or a finite number "
                         f"of seconds >= 0, got {threshold!r}")


def skip_hallucinations(segments: list, threshold: float, seek: int, size: int,
                        last_speech: float, total_frames: int
                        ) -> tuple[list, Optional[int], bool]:
    """One window's segments after the rule (see the module docstring).

    Args:
      segments: (start s, end s, ids, words) of the window, words timed.
      threshold: seconds of silence that make a gap.
      seek, size: the window's first mel frame and its frames of audio.
      last_speech: the end of the last word before this window (seconds).
      total_frames: the file's mel frames.
    Returns:
      (the segments kept, the next window's first frame or None to keep the
      caller's, whether the whole window is dropped and decoded again).
    """
    offset = seek / FRAMES_PER_SECOND
    window_end = (seek + 3000) / FRAMES_PER_SECOND
    with_words = [s for s in segments if s[3]]
    if with_words and is_segment_anomaly(with_words[0][3]):
        gap = with_words[0][0] - offset
        if gap > threshold:  # leading silence before a likely hallucination
            return [], seek + round(gap * FRAMES_PER_SECOND), True
    last_end = last_speech
    for i, (start, end, _, words) in enumerate(segments):
        if not words:
            continue
        if is_segment_anomaly(words):
            following = next((s for s in segments[i + 1:] if s[3]), None)
            next_start = following[3][0].start if following else offset + size / 100
            silence_before = (start - last_end > threshold or start < threshold
                              or start - offset < 2.0)
            silence_after = (next_start - end > threshold
                             or is_segment_anomaly(following[3] if following else None)
                             or window_end - end < 2.0)
            if silence_before and silence_after:
                new_seek = round(max(offset + 1, start) * FRAMES_PER_SECOND)
                if total_frames / FRAMES_PER_SECOND - end < threshold:
                    new_seek = total_frames
                return segments[:i], new_seek, False
        last_end = end
    return segments, None, False

"""Speech packing: find the speech in a file, join it into chunks of at most 30 s,
and map times in a chunk back to the file (faster-whisper's batched pipeline:
`vad.get_speech_timestamps`, `collect_chunks`, `SpeechTimestampsMap`).

    regions = speech_regions(source)          # [(first sample, end sample)] of speech
    chunks = pack(regions)                    # [[region, ...]] each <= 30 s of audio
    samples = chunk_samples(source, chunks[0])
    seconds = original_time(chunks[0], 12.3)  # 12.3 s into the chunk -> file seconds

The detector is an energy detector, not silero's network: a 32 ms frame (512
samples, silero's window) is speech when its level is `margin_db` above the
file's noise floor (the 5th percentile of its frame levels, at least
`FLOOR_DB`), and keeps a started region going down to `margin_db - hold_db`.
Those frame decisions go through silero's own rules as faster-whisper runs them
(`regions_of_frames`: speech split after 160 ms of silence, regions of at most
30 s cut at their last pause, 400 ms of padding each side so no word is cut,
shared in half where two regions are closer than that).

Why not silero, measured on the benchmark files (`benchmarks/whisper.py`): the
regions are silero's to 64 ms (starts 0 to 2 frames earlier, ends 0 to 1), at a
twentieth of its cost (10 min of audio: 0.05 s, against 1.3 to 1.5 s for silero
through onnxruntime on one thread, as faster-whisper runs it), with no
dependency. The price: Whisper tiny's text of a chunk moves with where the chunk
starts. Fed silero's regions, the packed transcription's text is faster-whisper
batched's on all five chunks of the 10 min file (greedy); with these regions the
60 s file's text is the same, the 10 min file's differs in two chunks of five
at beam 5 (punctuation in one, words in the other). What it is not: a speech
classifier. Music and loud noise count as speech (they cost decode time;
Whisper's no-speech rule still applies), and speech quieter than the floor plus
the margin is left out.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from jaxformer.models.whisper.audio import SAMPLE_RATE
from jaxformer.models.whisper.features import CHUNK_SAMPLES

FRAME = 512  # samples per decision (32 ms), silero's window
FLOOR_DB = -90.0  # the noise floor's lowest value: one 16-bit step
READ_SAMPLES = FRAME * 1000  # samples read at a time while measuring levels (whole frames)

Region = tuple[int, int]  # [first sample, end sample) of the file


@dataclasses.dataclass(frozen=True)
class SpeechOptions:
    """The detector's settings (faster-whisper's batched `VadOptions` for the rules).

    margin_db: a frame this far above the noise floor starts speech;
    hold_db: a started region goes on while frames stay above margin - hold;
    min_silence_ms: silence that ends a region; speech_pad_ms: padding each side;
    max_speech_s: the longest region (cut at its last pause of 98 ms or more);
    min_speech_ms: shorter regions are dropped.
    """

    margin_db: float = 10.0
    hold_db: float = 6.0
    min_silence_ms: int = 160
    speech_pad_ms: int = 400
    max_speech_s: float = 30.0
    min_speech_ms: int = 0

    def __post_init__(self):
        for name in ("margin_db", "hold_db", "min_silence_ms", "speech_pad_ms",
                     "max_speech_s", "min_speech_ms"):
            value = getattr(self, name)
            if not np.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.max_speech_s * SAMPLE_RATE <= FRAME + 2 * self.speech_pad_ms * SAMPLE_RATE / 1000:
            raise ValueError(f"max_speech_s ({self.max_speech_s:g}) must be longer than "
                             f"the padding on both sides and one frame")


def frame_levels(source) -> np.ndarray:
    """(F,) level in dB (full scale) of each 512-sample frame of `source` (an
    `audio.WavFile`, `audio.Samples`, `media.MediaFile` or (N,) samples), read 30 s
    at a time; the last frame is padded with zeros."""
    total = len(source) if isinstance(source, np.ndarray) else source.num_samples
    out = []
    for start in range(0, total, READ_SAMPLES):
        x = (source[start:start + READ_SAMPLES] if isinstance(source, np.ndarray)
             else source.read(start, start + READ_SAMPLES)).astype(np.float32)
        x = np.pad(x, (0, -len(x) % FRAME)).reshape(-1, FRAME)
        power = np.einsum("fn,fn->f", x, x) / FRAME
        out.append(10.0 * np.log10(np.maximum(power, 1e-12)))
    return np.concatenate(out) if out else np.zeros(0, np.float32)


def frame_scores(levels_F: np.ndarray, options: SpeechOptions = SpeechOptions()) -> np.ndarray:
    """(F,) silero-like speech probabilities of frame levels: 1.0 at `margin_db` or
    more above the floor, 0.4 (above silero's end threshold 0.35, under its start
    threshold 0.5) within `hold_db` under that, else 0.0."""
    if not len(levels_F):
        return np.zeros(0, np.float32)
    floor = max(float(np.percentile(levels_F, 5)), FLOOR_DB)
    start = floor + options.margin_db
    return np.where(levels_F >= start, 1.0,
                    np.where(levels_F >= start - options.hold_db, 0.4, 0.0)).astype(np.float32)


def regions_of_frames(scores_F: Sequence[float], num_samples: int,
                      options: SpeechOptions = SpeechOptions()) -> list[Region]:
    """Speech regions from per-frame probabilities, by silero's rules as
    faster-whisper's `get_speech_timestamps` applies them (threshold 0.5, end
    threshold 0.35): [(first sample, end sample)], padded, in order."""
    threshold, neg_threshold = 0.5, 0.35
    pad = SAMPLE_RATE * options.speech_pad_ms / 1000
    min_speech = SAMPLE_RATE * options.min_speech_ms / 1000
    max_speech = SAMPLE_RATE * options.max_speech_s - FRAME - 2 * pad
    min_silence = SAMPLE_RATE * options.min_silence_ms / 1000
    min_silence_at_max = SAMPLE_RATE * 98 / 1000
    triggered, speeches, current = False, [], {}
    temp_end = prev_end = next_start = 0
    for i, p in enumerate(scores_F):
        at = FRAME * i
        if p >= threshold and temp_end:
            temp_end = 0
            if next_start < prev_end:
                next_start = at
        if p >= threshold and not triggered:
            triggered, current["start"] = True, at
            continue
        if triggered and at - current["start"] > max_speech:
            if prev_end:
                current["end"] = prev_end
                speeches.append(current)
                current = {}
                if next_start < prev_end:
                    triggered = False
                else:
                    current["start"] = next_start
                prev_end = next_start = temp_end = 0
            else:
                current["end"] = at
                speeches.append(current)
                current, triggered = {}, False
                prev_end = next_start = temp_end = 0
                continue
        if p < neg_threshold and triggered:
            if not temp_end:
                temp_end = at
            if at - temp_end > min_silence_at_max:
                prev_end = temp_end
            if at - temp_end < min_silence:
                continue
            current["end"] = temp_end
            if current["end"] - current["start"] > min_speech:
                speeches.append(current)
            current, triggered = {}, False
            prev_end = next_start = temp_end = 0
    if current and num_samples - current["start"] > min_speech:
        current["end"] = num_samples
        speeches.append(current)
    for i, speech in enumerate(speeches):  # padding, shared where regions are close
        if i == 0:
            speech["start"] = int(max(0, speech["start"] - pad))
        if i != len(speeches) - 1:
            gap = speeches[i + 1]["start"] - speech["end"]
            if gap < 2 * pad:
                speech["end"] += int(gap // 2)
                speeches[i + 1]["start"] = int(max(0, speeches[i + 1]["start"] - gap // 2))
            else:
                speech["end"] = int(min(num_samples, speech["end"] + pad))
                speeches[i + 1]["start"] = int(max(0, speeches[i + 1]["start"] - pad))
        else:
            speech["end"] = int(min(num_samples, speech["end"] + pad))
    return [(s["start"], s["end"]) for s in speeches]


def speech_regions(source, options: SpeechOptions = SpeechOptions()) -> list[Region]:
    """The speech regions of `source` ([(first sample, end sample)], in order; none
    for a file without speech): `frame_levels`, `frame_scores`, `regions_of_frames`."""
    total = len(source) if isinstance(source, np.ndarray) else source.num_samples
    return regions_of_frames(frame_scores(frame_levels(source), options), total, options)


def pack(regions: Sequence[Region], max_samples: int = CHUNK_SAMPLES) -> list[list[Region]]:
    """Consecutive regions joined into chunks of at most `max_samples` of audio
    (faster-whisper's `collect_chunks`: a region that would overflow the chunk
    starts the next one; a region is never split, and is at most 30 s already)."""
    chunks: list[list[Region]] = []
    size = 0
    for region in regions:
        n = region[1] - region[0]
        if chunks and size + n <= max_samples:
            chunks[-1].append(tuple(region))
            size += n
        else:
            chunks.append([tuple(region)])
            size = n
    return chunks


def chunk_samples(source, chunk: Sequence[Region]) -> np.ndarray:
    """The chunk's audio: its regions' samples one after another."""
    read = (lambda a, b: source[a:b]) if isinstance(source, np.ndarray) else source.read
    parts = [np.asarray(read(a, b), np.float32) for a, b in chunk]
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


def region_index(chunk: Sequence[Region], t: float, is_end: bool = False) -> int:
    """The region of the chunk that chunk time `t` (seconds) falls in
    (faster-whisper's `SpeechTimestampsMap.get_chunk_index`: an end exactly at a
    region's end belongs to that region)."""
    sample, ends, total = int(t * SAMPLE_RATE), [], 0
    for a, b in chunk:
        total += b - a
        ends.append(total)
    if is_end and sample in ends:
        return ends.index(sample)
    return min(int(np.searchsorted(ends, sample, side="right")), len(chunk) - 1)


def original_time(chunk: Sequence[Region], t: float, index: int | None = None,
                  is_end: bool = False) -> float:
    """Chunk time `t` (seconds from the chunk's start) as seconds in the file: `t`
    plus the audio left out before region `index` (`region_index` of `t` when None)."""
    index = region_index(chunk, t, is_end) if index is None else index
    before = sum(b - a for a, b in chunk[:index])
    return chunk[index][0] / SAMPLE_RATE + t - before / SAMPLE_RATE

"""Any audio or video container through PyAV (FFmpeg): decoded and resampled to 16 kHz
mono as a stream, read window by window like a WAV file.

    source = open_media("talk.mp3")                # checked now: one pass counts the samples
    samples_N = source.read(start, stop)           # a piece, decoded forward from the file

PyAV (`pip install 'jaxformer[media]'`) is imported on first use. The samples are
what faster-whisper's `decode_audio` gives (FFmpeg's resampler to signed 16-bit mono
16 kHz, then x / 32768), but never the whole signal at once: the file is decoded
forward and only the samples from the last read on are kept (at most one window and
one decoded frame), so an hour-long file costs the memory of 30 s.
"""

from __future__ import annotations

import os

import numpy as np

from jaxformer.errors import FileFormatError, require_file
from jaxformer.models.whisper.audio import SAMPLE_RATE


def import_av():
    """The `av` module, or ImportError naming the extra to install."""
    try:
        import av  # noqa: PLC0415  (optional: the `media` extra)
    except ImportError as error:
        raise ImportError("reading audio or video files other than WAV needs PyAV: "
                          "pip install 'jaxformer[media]'") from error
    return av


def is_wav(path: str) -> bool:
    """True if the file starts with a RIFF/WAVE header (read by `audio.open_wav`)."""
    with open(path, "rb") as f:
        head = f.read(12)
    return head[:4] == b"RIFF" and head[8:12] == b"WAVE"


class MediaFile:
    """An audio or video file opened with PyAV: `open_media(path)`.

    `num_samples` is counted when it is opened (the whole file is decoded once, in
    pieces, which also finds a corrupt file before any model runs); `read(start,
    stop)` then returns samples [start, stop) of the 16 kHz mono signal. Reads are
    expected in increasing order of `start` (as transcription's windows are): the
    file is decoded forward, and a read before the kept samples decodes again from
    the start.
    """

    def __init__(self, path: str, sample_rate: int = SAMPLE_RATE):
        self.path = require_file(path, "audio file")
        self.sample_rate = sample_rate
        self.av = import_av()
        self.num_samples = sum(len(x) for x in self.pieces())
        self.reset()

    def reset(self) -> None:
        self.stream = self.pieces()
        self.kept_N = np.zeros(0, np.float32)
        self.kept_start = 0  # index of kept_N[0] in the signal

    def error(self, problem: str) -> FileFormatError:
        return FileFormatError(self.path, problem,
                               "convert it to WAV, or check that it plays")

    def pieces(self):
        """The signal as consecutive float32 arrays (16 kHz mono), decoded lazily."""
        av = self.av
        try:
            container = av.open(self.path, metadata_errors="ignore")
        except (av.FFmpegError, UnicodeDecodeError) as error:
            raise self.error(f"is not an audio or video file FFmpeg can read ({error})") from None
        with container:
            streams = [s for s in container.streams if s.type == "audio"]
            if not streams:
                kinds = sorted({s.type for s in container.streams}) or ["none"]
                raise self.error(f"has no audio stream (streams: {', '.join(kinds)})")
            resampler = av.AudioResampler(format="s16", layout="mono", rate=self.sample_rate)
            try:
                for frame in container.decode(streams[0]):
                    frame.pts = None  # the resampler does not need them (faster-whisper)
                    for out in resampler.resample(frame):
                        yield self.floats(out)
                for out in resampler.resample(None):
                    yield self.floats(out)
            except av.FFmpegError as error:
                raise self.error(f"could not be decoded ({error})") from None

    @staticmethod
    def floats(frame) -> np.ndarray:
        return frame.to_ndarray().reshape(-1).astype(np.float32) / 32768.0

    def read(self, start: int, stop: int) -> np.ndarray:
        """(stop - start,) float32 samples at 16 kHz (fewer past the end)."""
        start, stop = max(start, 0), min(stop, self.num_samples)
        if stop <= start:
            return np.zeros(0, np.float32)
        if start < self.kept_start:
            self.reset()
        pieces, have = [self.kept_N], self.kept_start + len(self.kept_N)
        while have < stop:
            piece = next(self.stream, None)
            if piece is None:
                break
            pieces.append(piece)
            have += len(piece)
        self.kept_N = np.concatenate(pieces) if len(pieces) > 1 else self.kept_N
        drop = start - self.kept_start  # never needed again (reads go forward)
        self.kept_N, self.kept_start = self.kept_N[drop:], start
        return self.kept_N[:stop - start].copy()


def open_media(path: str, *, sample_rate: int = SAMPLE_RATE) -> MediaFile:
    """An audio or video file (MP3, FLAC, M4A, OGG, MP4, MKV, ...), checked and counted,
    to be read in pieces (`MediaFile`).

    Raises:
      ImportError without PyAV; `FileFormatError` naming the file for a missing file,
      one FFmpeg cannot open, one without an audio stream, or one that fails to
      decode part way.
    """
    return MediaFile(os.fspath(path), sample_rate)


def read_media(path: str, *, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """The whole file as (N,) float32 16 kHz mono samples (`open_media` reads it in pieces)."""
    source = open_media(path, sample_rate=sample_rate)
    return source.read(0, source.num_samples)

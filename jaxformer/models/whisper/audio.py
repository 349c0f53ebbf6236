"""Audio files to 16 kHz mono samples: WAV reading with checks, read in pieces.

    audio_N = read_wav(path)                          # any WAV -> 16 kHz mono float32
    audio_N = open_wav(path).read(start, stop)        # a piece of it, file read in pieces
"""

from __future__ import annotations

import math
import os
import struct

import numpy as np

from jaxformer.errors import FileFormatError, require_file

SAMPLE_RATE = 16000


# WAVE format codes (the fmt chunk's first field; WAVE_FORMAT_EXTENSIBLE carries
# the real one in the first two bytes of its sub-format GUID).
_PCM, _FLOAT, _EXTENSIBLE = 1, 3, 0xFFFE


def _unreadable(path: str, problem: str) -> FileFormatError:
    return FileFormatError(path, f"is not a readable WAV file ({problem})",
                           "convert it to 16-bit PCM WAV")


def _wav_layout(path: str, f) -> tuple[bytes, int, int]:
    """(fmt chunk, data offset, data bytes) of an open RIFF/WAVE file, or FileFormatError.

    Only the chunk headers are read (seeking over other chunks). A data chunk
    whose size runs past the end of the file (written by a stream that never
    came back to fix the header) is cut at the end of the file.
    """
    f.seek(0, os.SEEK_END)
    file_size = f.tell()
    f.seek(0)
    head = f.read(12)
    if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        raise _unreadable(path, "no RIFF/WAVE header")
    fmt, pos = None, 12
    while pos + 8 <= file_size:
        f.seek(pos)
        header = f.read(8)
        chunk_id, size = header[:4], struct.unpack_from("<I", header, 4)[0]
        if chunk_id == b"fmt ":
            fmt = f.read(min(size, 64))
        elif chunk_id == b"data":
            if fmt is None or len(fmt) < 16:
                raise _unreadable(path, "no fmt chunk before the data")
            return fmt, pos + 8, min(size, file_size - pos - 8)
        pos += 8 + size + (size & 1)  # chunks are padded to an even size
    raise _unreadable(path, "no fmt and data chunks")


def _sample_format(path: str, fmt: bytes) -> tuple[str, int, int, int]:
    """(numpy kind, channels, sample rate, bits) of a fmt chunk, or FileFormatError."""
    code, channels, rate, _, _, bits = struct.unpack_from("<HHIIHH", fmt)
    if code == _EXTENSIBLE and len(fmt) >= 26:
        code = struct.unpack_from("<H", fmt, 24)[0]
    kind = {(_PCM, 8): "u1", (_PCM, 16): "<i2", (_PCM, 24): "i3", (_PCM, 32): "<i4",
            (_FLOAT, 32): "<f4", (_FLOAT, 64): "<f8"}.get((code, bits))
    for ok, problem in ((kind is not None, f"{bits}-bit samples of format code {code:#x} "
                                           f"(8/16/24/32-bit PCM and 32/64-bit float are read)"),
                        (channels > 0, "0 channels"), (rate > 0, "sample rate 0 Hz")):
        if not ok:
            raise FileFormatError(path, problem, "convert it to 16-bit PCM WAV")
    return kind, channels, rate, bits


def _frames(raw: bytes, kind: str, channels: int, bits: int) -> np.ndarray:
    """Whole frames of raw sample bytes -> (N, channels) float32 in [-1, 1]."""
    raw = np.frombuffer(raw, np.uint8)
    if kind == "u1":
        x = (raw.astype(np.float32) - 128.0) / 128.0
    elif kind == "i3":  # little-endian 24-bit: put the 3 bytes in the top of an int32
        b = raw.reshape(-1, 3).astype(np.int32)
        x = ((b[:, 0] << 8 | b[:, 1] << 16 | b[:, 2] << 24) >> 8).astype(np.float32) / 2.0 ** 23
    elif kind[1] == "i":
        x = raw.view(kind).astype(np.float32) / 2.0 ** (bits - 1)
    else:
        x = raw.view(kind).astype(np.float32)
    return x.reshape(-1, channels)


def resample(audio_N: np.ndarray, rate: int, target: int = SAMPLE_RATE) -> np.ndarray:
    """(N,) samples at `rate` Hz -> float32 at `target` Hz by polyphase filtering
    (`scipy.signal.resample_poly`: an anti-aliasing FIR, Kaiser window)."""
    if rate == target:
        return np.asarray(audio_N, np.float32)
    try:
        from scipy import signal  # noqa: PLC0415  (only needed for other sample rates)
    except ImportError as error:
        raise ImportError(f"resampling {rate} Hz audio to {target} Hz needs scipy: "
                          f"pip install 'jaxformer[audio]'") from error
    g = math.gcd(rate, target)
    return signal.resample_poly(audio_N, target // g, rate // g).astype(np.float32)


class WavFile:
    """A WAV file opened for reading in pieces: `open_wav(path)`.

    The header is read and checked when it is opened; `read(start, stop)` then
    reads samples [start, stop) of the 16 kHz mono signal (`num_samples` long)
    from the file, so a long recording is never held whole. Another sample rate
    is resampled piece by piece with a margin of source samples on both sides,
    aligned to the polyphase filter's period, so the pieces equal the whole
    file's `resample` (tested); the channels are averaged.
    """

    def __init__(self, path: str, sample_rate: int = SAMPLE_RATE):
        self.path = require_file(path, "WAV file")
        with open(self.path, "rb") as f:
            fmt, self.data_offset, data_bytes = _wav_layout(self.path, f)
        self.kind, self.channels, self.rate, self.bits = _sample_format(self.path, fmt)
        self.frame_bytes = self.bits // 8 * self.channels
        self.source_frames = data_bytes // self.frame_bytes  # whole frames only
        self.sample_rate = sample_rate
        g = math.gcd(self.rate, sample_rate)
        self.up, self.down = sample_rate // g, self.rate // g
        self.num_samples = -(-self.source_frames * self.up // self.down)  # resample_poly's
        if self.rate != sample_rate:
            resample(np.zeros(1, np.float32), self.rate, sample_rate)  # scipy, checked now

    def source(self, start: int, stop: int) -> np.ndarray:
        """Mono float32 frames [start, stop) of the file at its own rate."""
        start, stop = max(start, 0), min(stop, self.source_frames)
        if stop <= start:
            return np.zeros(0, np.float32)
        with open(self.path, "rb") as f:
            f.seek(self.data_offset + start * self.frame_bytes)
            raw = f.read((stop - start) * self.frame_bytes)
        frames_NC = _frames(raw[:len(raw) // self.frame_bytes * self.frame_bytes],
                            self.kind, self.channels, self.bits)
        return frames_NC[:, 0] if self.channels == 1 else frames_NC.mean(axis=1)

    def read(self, start: int, stop: int) -> np.ndarray:
        """(stop - start,) float32 samples at `sample_rate` (fewer past the end)."""
        start, stop = max(start, 0), min(stop, self.num_samples)
        if stop <= start:
            return np.zeros(0, np.float32)
        if self.up == self.down:
            return self.source(start, stop)
        # Output n sits at source position n * down / up. A piece that starts at a
        # multiple of `down` source frames is aligned with the whole file's
        # filter phases; the margin covers the filter's half-length
        # (10 * max(up, down) upsampled samples in scipy's design).
        half = -(-10 * max(self.up, self.down) // self.up) + 1  # source frames
        margin = -(-half // self.down) * self.down
        first = max(start // self.up * self.down - margin, 0)
        last = min(-(-stop * self.down // self.up) + margin, self.source_frames)
        y = resample(self.source(first, last), self.rate, self.sample_rate)
        offset = first // self.down * self.up
        return y[start - offset:stop - offset]

    def read_all(self) -> np.ndarray:
        """The whole file, resampled in one go (`read_wav`)."""
        return resample(self.source(0, self.source_frames), self.rate, self.sample_rate)


class Samples:
    """16 kHz mono samples already in memory, read like a `WavFile`."""

    def __init__(self, samples_N: np.ndarray):
        self.samples_N = np.asarray(samples_N, np.float32)
        if self.samples_N.ndim != 1:
            raise ValueError(f"audio samples must be (N,) 16 kHz mono, got shape "
                             f"{self.samples_N.shape}")
        self.num_samples = len(self.samples_N)

    def read(self, start: int, stop: int) -> np.ndarray:
        return self.samples_N[max(start, 0):max(stop, 0)]


def open_wav(path: str, *, sample_rate: int = SAMPLE_RATE) -> WavFile:
    """A WAV file, its header checked, to be read in pieces (`WavFile`).

    Raises:
      `FileFormatError` as `read_wav` does, without reading the samples.
    """
    return WavFile(path, sample_rate)


def read_wav(path: str, *, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """A WAV file -> (N,) float32 mono samples at `sample_rate` (16 kHz), in [-1, 1].

    Reads 8/16/24/32-bit PCM and 32/64-bit float files (also in the
    WAVE_FORMAT_EXTENSIBLE layout) at any sample rate and channel count: the
    channels are averaged, and another rate is resampled (`resample`, which
    needs scipy: `pip install 'jaxformer[audio]'`). A 16 kHz mono file is
    returned exactly as stored (x / 2**15 for 16-bit). `open_wav` reads a long
    file in pieces instead.

    Raises:
      `FileFormatError` (a ValueError) naming the file and the problem (missing,
      not a RIFF/WAVE file, an unsupported sample format) before anything is
      resampled.
    """
    return open_wav(path, sample_rate=sample_rate).read_all()


# A window with no sample above one 16-bit step (-90 dBFS) is digitally silent.
SILENCE_PEAK = 2.0 ** -15


def is_silent(samples_N: np.ndarray) -> bool:
    """True if no sample's magnitude exceeds `SILENCE_PEAK` (one step of 16-bit PCM,
    -90 dBFS): digital silence, such as zeros or 1-bit dither (an empty array too).
    Not a voice detector: quiet noise is not silent here."""
    return not samples_N.size or float(np.max(np.abs(samples_N))) <= SILENCE_PEAK

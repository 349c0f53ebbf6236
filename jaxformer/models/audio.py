"""Audio front end in JAX: WAV reading with checks, and Whisper's log-mel spectrogram.

    audio_N = read_wav(path)                          # any WAV -> 16 kHz mono float32
    mel_BFM = log_mel_spectrogram(audio_BN)           # (B, 3000 frames, 80 mels)

The spectrogram follows Whisper's `log_mel_spectrogram`: audio padded or cut to
30 s (480,000 samples at 16 kHz), a periodic Hann window of 400 samples (25 ms),
hop 160 (10 ms), reflect padding of 200 on both sides, power spectrum, the last
frame dropped, 80 Slaney mel filters (0 to 8 kHz, Slaney area norm), log10
floored at 1e-10, then clamped to (max - 8) and scaled by (x + 4) / 4. Frames
come out channels-last (B, T, 80), the layout of the encoder's stem.
"""

from __future__ import annotations

import functools
import math
import struct

import jax.numpy as jnp
import numpy as np

from jaxformer.errors import FileFormatError, require_file

SAMPLE_RATE = 16000
N_FFT = 400
HOP = 160
N_MELS = 80
CHUNK_SAMPLES = 30 * SAMPLE_RATE


# WAVE format codes (the fmt chunk's first field; WAVE_FORMAT_EXTENSIBLE carries
# the real one in the first two bytes of its sub-format GUID).
_PCM, _FLOAT, _EXTENSIBLE = 1, 3, 0xFFFE


def _wav_chunks(path: str, data: bytes) -> tuple[bytes, memoryview]:
    """(fmt chunk, data chunk) of a RIFF/WAVE file's bytes, or FileFormatError.

    A data chunk whose size runs past the end of the file (written by a stream
    that never came back to fix the header) is cut at the end of the file.
    """
    def unreadable(problem):
        return FileFormatError(path, f"is not a readable WAV file ({problem})",
                               "convert it to 16-bit PCM WAV")

    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise unreadable("no RIFF/WAVE header")
    fmt, pos = None, 12
    while pos + 8 <= len(data):
        chunk_id, size = data[pos:pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        body = memoryview(data)[pos + 8:pos + 8 + size]
        if chunk_id == b"fmt ":
            fmt = bytes(body)
        elif chunk_id == b"data":
            if fmt is None or len(fmt) < 16:
                raise unreadable("no fmt chunk before the data")
            return fmt, body
        pos += 8 + size + (size & 1)  # chunks are padded to an even size
    raise unreadable("no fmt and data chunks")


def _samples(path: str, fmt: bytes, body: memoryview) -> tuple[np.ndarray, int]:
    """(frames (N, channels) float32 in [-1, 1], sample rate) of a fmt and data chunk."""
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
    width = bits // 8
    raw = np.frombuffer(body, np.uint8)
    raw = raw[:len(raw) // (width * channels) * width * channels]  # whole frames only
    if kind == "u1":
        x = (raw.astype(np.float32) - 128.0) / 128.0
    elif kind == "i3":  # little-endian 24-bit: put the 3 bytes in the top of an int32
        b = raw.reshape(-1, 3).astype(np.int32)
        x = ((b[:, 0] << 8 | b[:, 1] << 16 | b[:, 2] << 24) >> 8).astype(np.float32) / 2.0 ** 23
    elif kind[1] == "i":
        x = np.frombuffer(raw.tobytes(), kind).astype(np.float32) / 2.0 ** (bits - 1)
    else:
        x = np.frombuffer(raw.tobytes(), kind).astype(np.float32)
    return x.reshape(-1, channels), rate


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


def read_wav(path: str, *, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """A WAV file -> (N,) float32 mono samples at `sample_rate` (16 kHz), in [-1, 1].

    Reads 8/16/24/32-bit PCM and 32/64-bit float files (also in the
    WAVE_FORMAT_EXTENSIBLE layout) at any sample rate and channel count: the
    channels are averaged, and another rate is resampled (`resample`, which
    needs scipy: `pip install 'jaxformer[audio]'`). A 16 kHz mono file is
    returned exactly as stored (x / 2**15 for 16-bit).

    Raises:
      `FileFormatError` (a ValueError) naming the file and the problem (missing,
      not a RIFF/WAVE file, an unsupported sample format) before anything is
      resampled.
    """
    path = require_file(path, "WAV file")
    with open(path, "rb") as f:
        data = f.read()
    frames_NC, rate = _samples(path, *_wav_chunks(path, data))
    mono_N = frames_NC[:, 0] if frames_NC.shape[1] == 1 else frames_NC.mean(axis=1)
    return resample(mono_N, rate, sample_rate)


def _hz_to_mel(f):
    """Slaney mel scale: linear below 1 kHz, logarithmic above."""
    f = np.asarray(f, np.float64)
    mels = f / (200.0 / 3)
    log_region = f >= 1000.0
    return np.where(log_region, 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / (np.log(6.4) / 27),
                    mels)


def _mel_to_hz(m):
    m = np.asarray(m, np.float64)
    return np.where(m >= 15.0, 1000.0 * np.exp((np.log(6.4) / 27) * (m - 15.0)),
                    m * (200.0 / 3))


@functools.lru_cache(maxsize=None)
def mel_filters(n_mels: int = N_MELS, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE
                ) -> np.ndarray:
    """(n_fft // 2 + 1, n_mels) Slaney-normalised triangular filters, 0 .. sample_rate / 2."""
    fft_hz = np.linspace(0, sample_rate / 2, n_fft // 2 + 1)
    mel_hz = _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(sample_rate / 2), n_mels + 2))
    lower = (fft_hz[None, :] - mel_hz[:-2, None]) / np.diff(mel_hz)[:-1, None]
    upper = (mel_hz[2:, None] - fft_hz[None, :]) / np.diff(mel_hz)[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    weights *= (2.0 / (mel_hz[2:] - mel_hz[:-2]))[:, None]  # equal area per filter
    return weights.T.astype(np.float32)


def pad_or_trim(audio_BN: jnp.ndarray, length: int = CHUNK_SAMPLES) -> jnp.ndarray:
    """Zero-pad or cut the last axis to `length` samples."""
    n = audio_BN.shape[-1]
    if n >= length:
        return audio_BN[..., :length]
    return jnp.pad(audio_BN, [(0, 0)] * (audio_BN.ndim - 1) + [(0, length - n)])


def log_mel_spectrogram(audio_BN: jnp.ndarray) -> jnp.ndarray:
    """(B, N) 16 kHz samples -> (B, 3000, 80) Whisper log-mel features (float32)."""
    audio_BN = pad_or_trim(jnp.asarray(audio_BN, jnp.float32))
    padded_BN = jnp.pad(audio_BN, ((0, 0), (N_FFT // 2, N_FFT // 2)), mode="reflect")
    num_frames = 1 + (padded_BN.shape[1] - N_FFT) // HOP
    index_TW = np.arange(num_frames)[:, None] * HOP + np.arange(N_FFT)[None, :]
    window_W = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)  # periodic Hann
    frames_BTW = padded_BN[:, index_TW] * window_W.astype(np.float32)
    power_BTF = jnp.abs(jnp.fft.rfft(frames_BTW, axis=-1)) ** 2
    mel_BTM = power_BTF[:, :-1] @ mel_filters()  # Whisper drops the last frame
    log_BTM = jnp.log10(jnp.maximum(mel_BTM, 1e-10))
    log_BTM = jnp.maximum(log_BTM, log_BTM.max(axis=(1, 2), keepdims=True) - 8.0)
    return (log_BTM + 4.0) / 4.0

"""Whisper's log-mel spectrogram in JAX.

    mel_BFM = log_mel_spectrogram(audio_BN)           # (B, 3000 frames, 80 mels)

The spectrogram follows Whisper's `log_mel_spectrogram`: audio padded or cut to
30 s (480,000 samples at 16 kHz), a periodic Hann window of 400 samples (25 ms),
hop 160 (10 ms), reflect padding of 200 on both sides, power spectrum, the last
frame dropped, 80 Slaney mel filters (0 to 8 kHz, Slaney area norm), log10
floored at 1e-10 (128 filters for large-v3, the same formula), then clamped to (max - 8) and scaled by (x + 4) / 4. Frames
come out channels-last (B, T, 80), the layout of the encoder's stem.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.models.whisper.audio import SAMPLE_RATE

N_FFT = 400
HOP = 160
N_MELS = 80
CHUNK_SAMPLES = 30 * SAMPLE_RATE


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
    """Zero-pad or cut the last axis to `length` samples (a numpy array stays one, on
    the host: no program compiled per length)."""
    n = audio_BN.shape[-1]
    if n >= length:
        return audio_BN[..., :length]
    pad = np.pad if isinstance(audio_BN, np.ndarray) else jnp.pad
    return pad(audio_BN, [(0, 0)] * (audio_BN.ndim - 1) + [(0, length - n)])


def log_mel_spectrogram(audio_BN: jnp.ndarray, n_mels: int = N_MELS) -> jnp.ndarray:
    """(B, N) 16 kHz samples -> (B, 3000, n_mels) Whisper log-mel features (float32):
    80 bins, or 128 for large-v3 and its family (`Whisper.n_mels`). One compiled
    program per batch size (the samples are padded or cut to 30 s first), not one
    per operation (issue 45: a transcription compiled some twenty small ones)."""
    return _log_mel_jit(pad_or_trim(np.asarray(audio_BN, np.float32)), int(n_mels))


def _log_mel(audio_BN, n_mels):
    padded_BN = jnp.pad(audio_BN, ((0, 0), (N_FFT // 2, N_FFT // 2)), mode="reflect")
    num_frames = 1 + (padded_BN.shape[1] - N_FFT) // HOP
    index_TW = np.arange(num_frames)[:, None] * HOP + np.arange(N_FFT)[None, :]
    window_W = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)  # periodic Hann
    frames_BTW = padded_BN[:, index_TW] * window_W.astype(np.float32)
    power_BTF = jnp.abs(jnp.fft.rfft(frames_BTW, axis=-1)) ** 2
    mel_BTM = power_BTF[:, :-1] @ mel_filters(n_mels)  # Whisper drops the last frame
    log_BTM = jnp.log10(jnp.maximum(mel_BTM, 1e-10))
    log_BTM = jnp.maximum(log_BTM, log_BTM.max(axis=(1, 2), keepdims=True) - 8.0)
    return (log_BTM + 4.0) / 4.0


_log_mel_jit = jax.jit(_log_mel, static_argnums=1)

"""Rotary position embeddings (RoPE, Su et al. 2021) in both checkpoint layouts.

Each pair of a head's K features is a 2-d vector rotated by the angle
position * theta^(-2i/K) for pair i = 0..K/2-1, so the dot product of a
query at position m and a key at position n depends on m - n only.
Checkpoints disagree on which features form pair i:

  "half":        (i, i + K/2)   GPT-NeoX, Hugging Face Llama (`rotate_half`)
  "interleaved": (2i, 2i + 1)   RoFormer, Meta's Llama, llama.cpp / GGUF files

The two are the same function up to a permutation of the query/key
projection rows (`half_to_interleaved_rows`), which is how llama.cpp's
converter turns a Hugging Face checkpoint into a GGUF file.

Frequency scaling (`config.rope_scaling`, as checkpoints state it): "linear"
divides every frequency by the factor; "llama3" (Llama 3.1) divides the low
frequencies (wavelength above original_max_len / low_freq_factor) by the factor,
keeps the high ones (wavelength below original_max_len / high_freq_factor) and
interpolates in between. `layer_frequencies` gives a layer's (K/2,) frequencies;
local (sliding-window) layers may have their own base (`rope_local_theta`).
"""

from __future__ import annotations

import math
from typing import Optional

import jax.numpy as jnp
import numpy as np

from jaxformer.config import TransformerConfig
from jaxformer.nn import checks


def rope_frequencies(head_dim: int, theta: float) -> np.ndarray:
    """(K/2,) float32 inverse frequencies theta^(-2i/K), as transformers computes them.

    transformers (the reference every imported checkpoint is compared with) takes
    `1.0 / (theta ** (arange(0, K, 2) / K))` in float32: the exponent 2i/K rounded to
    float32, theta rounded to float32, the power rounded to float32 (torch's scalar
    path is glibc's `powf`, which rounds correctly in all but rare cases), then the
    float32 reciprocal. The power is taken here in float64 and rounded once, so the
    result does not depend on numpy's float32 `power` (a SIMD approximation a few
    ulps off: 5 of SmolLM2's 32 frequencies differed). torch's vectorized `pow`
    (Sleef, 1 ulp) can still differ by an ulp at some (K, theta), from 32 pairs up.
    """
    exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    power = np.float64(np.float32(theta)) ** exponent.astype(np.float64)
    return np.float32(1.0) / power.astype(np.float32)


def scaled_frequencies(inv_freq: np.ndarray, kind: Optional[str], factor: float,
                       low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                       original_max_len: int = 8192) -> np.ndarray:
    """`inv_freq` under the scaling `kind` (None, "linear", "llama3"), float32."""
    if kind is None:
        return inv_freq
    if kind == "linear":
        return (inv_freq / np.float32(factor)).astype(np.float32)
    if kind != "llama3":
        raise ValueError(f"RoPE scaling {kind!r} is not implemented (linear, llama3)")
    low_wavelen = original_max_len / low_freq_factor
    high_wavelen = original_max_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def layer_frequencies(config: TransformerConfig, local: bool = False) -> np.ndarray:
    """(K/2,) frequencies of a global layer, or of a local one (`local`): a local layer
    with its own base (`rope_local_theta`) is not scaled."""
    if local and config.rope_local_theta is not None:
        return rope_frequencies(config.head_dim, config.rope_local_theta)
    return scaled_frequencies(rope_frequencies(config.head_dim, config.rope_theta),
                              config.rope_scaling, config.rope_scaling_factor,
                              config.rope_low_freq_factor, config.rope_high_freq_factor,
                              config.rope_original_max_len)


def rope_angles(positions_BT: jnp.ndarray, head_dim: int, theta: float,
                inv_freq=None) -> jnp.ndarray:
    """(B, T) positions -> (B, T, K/2) float32 angles position * theta^(-2i/K)
    (or position * inv_freq when given)."""
    if inv_freq is None:
        inv_freq = rope_frequencies(head_dim, theta)
    return positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)


def apply_rope(x_BTHK: jnp.ndarray, positions_BT: jnp.ndarray, theta: Optional[float],
               layout: str, *, inv_freq=None) -> jnp.ndarray:
    """Rotate queries or keys (B, T, H, K) by their positions (B|1, T); float32 inside.

    `inv_freq` (K/2,) replaces the frequencies of `theta` (scaled RoPE, a local base).
    """
    checks.check_shape("x_BTHK", x_BTHK, (None,) * 4, "(batch, length, heads, head_dim)")
    batch, length, _, depth = x_BTHK.shape
    if depth % 2:
        raise ValueError(f"x_BTHK has an odd head_dim {depth}: RoPE rotates pairs")
    checks.check_shape("positions_BT", positions_BT, ((1, batch), length),
                       "(batch or 1, length)")
    if inv_freq is not None:
        checks.check_shape("inv_freq", inv_freq, (depth // 2,), "(head_dim / 2,)")
    angles_BT1P = rope_angles(positions_BT, x_BTHK.shape[-1], theta,
                              inv_freq)[:, :, None]  # P = K/2
    cos, sin = jnp.cos(angles_BT1P), jnp.sin(angles_BT1P)
    x = x_BTHK.astype(jnp.float32)
    if layout == "half":
        first, second = jnp.split(x, 2, axis=-1)
    elif layout == "interleaved":
        first, second = x[..., 0::2], x[..., 1::2]
    else:
        raise ValueError(f"rope layout must be 'half' or 'interleaved', got {layout!r}")
    rotated = (first * cos - second * sin, second * cos + first * sin)
    if layout == "half":
        out = jnp.concatenate(rotated, axis=-1)
    else:  # re-interleave: (..., P, 2) -> (..., K)
        out = jnp.stack(rotated, axis=-1).reshape(x.shape)
    return out.astype(x_BTHK.dtype)


def half_to_interleaved_rows(head_dim: int) -> np.ndarray:
    """Permutation p of a head's K features with interleaved[j] = half[p[j]].

    Applied to the per-head output features of the query and key projections,
    it turns weights for the "half" layout into weights for "interleaved"
    (llama.cpp's `permute`); `np.argsort(p)` undoes it.
    """
    half = head_dim // 2
    return np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1)

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
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def rope_angles(positions_BT: jnp.ndarray, head_dim: int, theta: float) -> jnp.ndarray:
    """(B, T) positions -> (B, T, K/2) float32 angles position * theta^(-2i/K)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    return positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)


def apply_rope(x_BTHK: jnp.ndarray, positions_BT: jnp.ndarray, theta: float,
               layout: str) -> jnp.ndarray:
    """Rotate queries or keys (B, T, H, K) by their positions (B|1, T); float32 inside."""
    angles_BT1P = rope_angles(positions_BT, x_BTHK.shape[-1], theta)[:, :, None]  # P = K/2
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

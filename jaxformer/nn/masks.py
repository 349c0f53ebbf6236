"""Attention masks: pure functions returning booleans, **True = may attend**.

This is the convention of `jax.nn.dot_product_attention` and Flax. (The seeds
disagree: 000/002 use 1 = blocked, 001 uses 1 = visible.) Masks broadcast
against attention logits of shape (B, H, T, S): B batch, H heads, T queries,
S keys. Combine them with `&` (or `combine_masks`).

Worked example: a source of length 4 whose last token is PAD (pad_id 0), and a
target of length 3::

    src = [[5, 6, 7, 0]]
    padding_mask(src)            # (1,1,1,4): [[[[T, T, T, F]]]]
    causal_mask(3)               # (1,1,3,3): [[[[T, F, F],
                                 #              [T, T, F],
                                 #              [T, T, T]]]]
    cross_mask(tgt, src)         # (1,1,3,4): every target row sees keys [T, T, T, F]

A query row whose keys are all masked (an all-PAD source) is allowed: attention
gives it finite outputs and gradients (see `attention.dot_product_attention`).
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from jaxformer.nn import checks


def padding_mask(tokens_BS: jnp.ndarray, pad_id: int = 0) -> jnp.ndarray:
    """(B, S) token ids -> (B, 1, 1, S): True where the key is not PAD."""
    checks.check_shape("tokens_BS", tokens_BS, (None, None), "(batch, length) token ids")
    return (tokens_BS != pad_id)[:, None, None, :]


def causal_mask(length: int) -> jnp.ndarray:
    """(1, 1, T, T): query t may attend to keys 0..t."""
    return jnp.tril(jnp.ones((length, length), dtype=bool))[None, None]


def cross_mask(tgt_BT: jnp.ndarray, src_BS: jnp.ndarray, pad_id: int = 0) -> jnp.ndarray:
    """(B, 1, T, S): every target query may attend to every non-PAD source key."""
    checks.check_shape("tgt_BT", tgt_BT, (None, None), "(batch, length) token ids")
    checks.check_shape("src_BS", src_BS, (tgt_BT.shape[0], None),
                       "(the target's batch, length) token ids")
    return jnp.broadcast_to(padding_mask(src_BS, pad_id),
                            (src_BS.shape[0], 1, tgt_BT.shape[1], src_BS.shape[1]))


def decoder_self_mask(tgt_BT: jnp.ndarray, pad_id: int = 0) -> jnp.ndarray:
    """(B, 1, T, T): causal and not PAD, the decoder self-attention mask."""
    checks.check_shape("tgt_BT", tgt_BT, (None, None), "(batch, length) token ids")
    return causal_mask(tgt_BT.shape[1]) & padding_mask(tgt_BT, pad_id)


def sliding_window_mask(query_slots_T: jnp.ndarray, key_slots_S: jnp.ndarray,
                        window: int) -> jnp.ndarray:
    """(1, 1, T, S): True where |query slot - key slot| < window.

    With a causal mask this is a local layer's band: the query at slot t sees keys
    t - window < s <= t (Hugging Face's `kv_idx > q_idx - sliding_window`). Slots,
    not positions: within one sequence (or one packed segment) they differ alike.
    """
    checks.check_shape("query_slots_T", query_slots_T, (None,), "(queries,) slots")
    checks.check_shape("key_slots_S", key_slots_S, (None,), "(keys,) slots")
    distance_TS = query_slots_T[:, None] - key_slots_S[None, :]
    return (jnp.abs(distance_TS) < window)[None, None]


def combine_masks(*masks: Optional[jnp.ndarray]) -> Optional[jnp.ndarray]:
    """Logical AND of the masks that are not None (None if all are None)."""
    present = [m for m in masks if m is not None]
    if not present:
        return None
    for i, mask in enumerate(present):
        checks.check_shape(f"masks[{i}]", mask, (None,) * 4, "(B|1, H|1, T|1, S|1)")
    try:
        jnp.broadcast_shapes(*(m.shape for m in present))
    except ValueError as error:
        raise ValueError(f"masks do not broadcast together: shapes "
                         f"{[tuple(m.shape) for m in present]}") from error
    combined = present[0]
    for mask in present[1:]:
        combined = combined & mask
    return combined

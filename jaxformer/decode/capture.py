"""Activations and attention weights of one cached decode step (`cache.cached_forward`).

    logits_BTV, cache, acts = capture_step(model, params, cache, token_B1)
    acts["decoder/layers_0/self_attn/attention_weights"]   # (B, H, 1, T_max)

The same call as `cached_forward` (same masks, positions and cache writes; the
logits and the new cache are equal), with Flax's `capture_intermediates` on: keys
and shapes as `nn.inspection.capture` documents, with S = the cache's T_max slots
(slots not yet written and other rows' padding get weight 0).
"""

from __future__ import annotations

from typing import Any

import jax

from jaxformer.decode.cache import DecodeCache, apply_decoder
from jaxformer.nn.inspection import Filter, flatten_intermediates


def capture_step(model, params, cache: DecodeCache, tokens_BT: jax.Array, *,
                 modules: Filter = True) -> tuple[jax.Array, DecodeCache, dict[str, Any]]:
    """(logits (B, T, V), the cache after the T tokens, {path: captured value}).
    `modules` as `nn.inspection.capture` (False: only the attention weights)."""
    (logits_BTV, self_kv), state = apply_decoder(
        model, params, cache, tokens_BT, capture_intermediates=modules,
        mutable="intermediates")
    cache = cache.replace(self_kv=self_kv, index=cache.index + tokens_BT.shape[1])
    return logits_BTV, cache, flatten_intermediates(state.get("intermediates", {}))

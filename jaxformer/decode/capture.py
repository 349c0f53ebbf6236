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

from jaxformer.decode.cache import (DecodeCache, check_tokens_for, positions, ring_mask,
                                    self_attention_mask)
from jaxformer.nn.inspection import Filter, flatten_intermediates


def _run_decoder(module, *args, **kwargs):
    return module.decoder(*args, **kwargs)


def capture_step(model, params, cache: DecodeCache, tokens_BT: jax.Array, *,
                 modules: Filter = True) -> tuple[jax.Array, DecodeCache, dict[str, Any]]:
    """(logits (B, T, V), the cache after the T tokens, {path: captured value}).
    `modules` as `nn.inspection.capture` (False: only the attention weights)."""
    check_tokens_for(cache, model.config, tokens_BT)
    num_queries = tokens_BT.shape[1]
    rings = [kv for kv, ring in zip(cache.self_kv, cache.local_flags) if ring]
    local_mask = None
    if rings:
        local_mask = ring_mask(cache, num_queries, rings[0].key.shape[cache.length_axis],
                               model.config.sliding_window)
    (logits_BTV, self_kv), state = model.apply(
        {"params": params}, tokens_BT, self_attention_mask(cache, num_queries),
        cache.cross_kv, cache.cross_mask,
        positions_BT=positions(cache, num_queries), caches=cache.self_kv,
        cache_index=cache.index - cache.past_len, past_kvs=cache.past_kv,
        ring_mask=local_mask, ring_index=cache.index if rings else None,
        deterministic=True, method=_run_decoder, capture_intermediates=modules,
        mutable="intermediates")
    cache = cache.replace(self_kv=self_kv, index=cache.index + num_queries)
    return logits_BTV, cache, flatten_intermediates(state.get("intermediates", {}))

"""Paged keys and values in plain JAX: the pool, and the model's cached step read through it.

Dimension key: S slots (rows of a step), M pages per table, C tokens fed per
row in a call, Tv the step's view length, N pool pages, Z page size.

The pool holds, per decoder layer, keys and values of (N + 1) * Z token
positions (page 0 is the null page, `pages.NULL_PAGE`), laid out as one cache
row of that many slots (`decode.cache.kv_shape(config, 1, (N + 1) * Z)`), so
an int8 cache (`config.kv_cache_quant`, `nn.kv_quant.QuantKV`) pages its
scales alongside. Position p of a row lives at pool slot
`table[p // Z] * Z + p % Z`.

A call feeding C tokens to S rows of lengths L_s does not need a second model:
it gathers a `DecodeCache` view of Tv slots in which row s's L_s cached tokens
sit right-aligned at slots Tv - C - L_s .. Tv - C - 1 (its `start_B`), so every
row's new tokens go to the same slots Tv - C .. Tv - 1 (the cache's one scalar
`index`) while keeping their own positions (slot - start = L_s ..), exactly as
`decode.generate` left-aligns ragged prompts. `decode.cache.cached_forward`
runs on the view; the C new keys/values are then scattered to their pages.
Reads cost one gather of Tv slots per row and layer (the attention reads them
all anyway); rows or tokens marked invalid write to the null page.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxformer.config import TransformerConfig
from jaxformer.decode.cache import DecodeCache, cached_forward, kv_shape
from jaxformer.nn import kv_quant
from jaxformer.nn.attention import kv_length_axis

Pools = tuple  # per decoder layer, a KV or QuantKV of one row of (N + 1) * Z slots


def init_pools(config: TransformerConfig, num_pages: int, page_size: int,
               dtype: Any = None) -> Pools:
    """Zero keys/values for `num_pages` pages of `page_size` tokens, plus the null page."""
    dtype = config.compute_dtype if dtype is None else jnp.dtype(dtype)
    shape = kv_shape(config, 1, (num_pages + 1) * page_size)
    # Every array its own buffer (`kv_quant.empty` shares one zero array between the
    # two scales): the engine donates the pools to each step.
    return tuple(type(kv)(*(jnp.zeros(x.shape, x.dtype) for x in kv))
                 for kv in (kv_quant.empty(shape, config.kv_cache_quant == "int8", dtype)
                            for _ in range(config.num_decoder_layers)))


def pool_bytes(pools: Pools) -> int:
    return sum(x.size * x.dtype.itemsize for kv in pools for x in kv)


def pool_slots(table_SM: jnp.ndarray, positions_ST: jnp.ndarray, valid_ST: jnp.ndarray,
               page_size: int) -> jnp.ndarray:
    """(S, T) pool slots of the given positions (the null page's slot 0 where invalid)."""
    page = jnp.clip(positions_ST // page_size, 0, table_SM.shape[1] - 1)
    page_ST = jnp.take_along_axis(table_SM, page, axis=1)
    return jnp.where(valid_ST, page_ST * page_size + positions_ST % page_size, 0)


def gather_view(config: TransformerConfig, pools: Pools, table_SM: jnp.ndarray,
                lengths_S: jnp.ndarray, *, page_size: int, view_len: int,
                new: int) -> DecodeCache:
    """A `DecodeCache` of `view_len` slots, row s's cached tokens right-aligned before
    the `new` slots its next tokens will fill (module docstring)."""
    axis = kv_length_axis(config)
    start_S = (view_len - new - lengths_S).astype(jnp.int32)
    pos_ST = jnp.arange(view_len)[None, :] - start_S[:, None]
    slots_ST = pool_slots(table_SM, pos_ST, (pos_ST >= 0) & (pos_ST < lengths_S[:, None]),
                          page_size)

    def gather(x):  # (1, .., N*Z @ axis, ..) -> (S, .., Tv @ axis, ..)
        return jnp.moveaxis(jnp.take(x[0], slots_ST, axis=axis - 1), axis - 1, 0)

    view = tuple(type(kv)(*(gather(x) for x in kv)) for kv in pools)
    return DecodeCache(self_kv=view, index=jnp.asarray(view_len - new, jnp.int32),
                       start_B=start_S, length_axis=axis,
                       local=(False,) * config.num_decoder_layers)


def scatter_new(config: TransformerConfig, pools: Pools, view: DecodeCache,
                table_SM: jnp.ndarray, lengths_S: jnp.ndarray, valid_SC: jnp.ndarray, *,
                page_size: int) -> Pools:
    """`pools` with the view's last C slots (the keys/values just written) stored at
    positions L_s .. L_s + C - 1 of each row's pages; invalid ones to the null page."""
    axis = kv_length_axis(config)
    new = valid_SC.shape[1]
    pos_SC = lengths_S[:, None] + jnp.arange(new)[None, :]
    slots_SC = pool_slots(table_SM, pos_SC, valid_SC, page_size)
    index = (slice(None),) * (axis - 1) + (slots_SC,)

    def scatter(pool, x):  # x (S, .., Tv @ axis, ..) -> its last C slots into the pool
        fresh = jax.lax.slice_in_dim(x, x.shape[axis] - new, x.shape[axis], axis=axis)
        return pool[0].at[index].set(jnp.moveaxis(fresh, 0, axis - 1))[None]

    return tuple(type(kv)(*(scatter(p, x) for p, x in zip(kv, written)))
                 for kv, written in zip(pools, view.self_kv))


def paged_forward(model, params, pools: Pools, table_SM: jnp.ndarray, lengths_S: jnp.ndarray,
                  tokens_SC: jnp.ndarray, valid_SC: jnp.ndarray, *, page_size: int,
                  view_len: int) -> tuple[jnp.ndarray, Pools]:
    """Feed C tokens per row at positions L_s.. through the pages: the decode step
    (C = 1) or a prefill chunk. Traceable; the caller jits it (pools donated).

    Args:
      model, params: the decoder-only LM (per-layer layout, `stacking.for_decoding`).
      pools: `init_pools`' keys/values.
      table_SM: (S, M) int32 page ids per row (`pages.PageTable.row`).
      lengths_S: (S,) int32 tokens already cached per row.
      tokens_SC: (S, C) int32 ids to feed; valid_SC: (S, C) bool, False = padding or
        an idle row (its keys/values go to the null page).
      view_len: Tv >= max(L_s) + C, slots of the gathered view (static).
    Returns:
      (logits (S, C, V) float32, the updated pools).
    """
    new = tokens_SC.shape[1]
    view = gather_view(model.config, pools, table_SM, lengths_S, page_size=page_size,
                       view_len=view_len, new=new)
    logits_SCV, view = cached_forward(model, params, view, tokens_SC)
    return logits_SCV, scatter_new(model.config, pools, view, table_SM, lengths_S, valid_SC,
                                   page_size=page_size)

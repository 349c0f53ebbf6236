"""Paged keys and values in plain JAX: the pool, and the model's cached step read through it.

Dimension key: S slots (rows of a step), M pages per table, C tokens fed per
row in a call, Tv the step's view length, N pool pages, Z page size.

The pool holds, per decoder layer, keys and values of (N + 1) * Z token
positions (page 0 is the null page, `pages.NULL_PAGE`), laid out as one cache
row of that many slots (`decode.cache.kv_shape(config, 1, (N + 1) * Z)`), so
an int8 cache (`config.kv_cache_quant`, `nn.kv_quant.QuantKV`) pages its
scales alongside. Position p of a row lives at pool slot
`table[p // Z] * Z + p % Z`.

A call feeding C tokens to S rows of lengths L_s hands each decoder layer its
pool as an `nn.paged_kv.PagedKV`: the layer reads the rows' first ceil(Tv / Z)
pages through the page table (one gather of whole pages, consumed by that
layer's attention), attends over [those pages, the C new keys] with the mask
"page slot i < L_s, new key j <= query i", and writes only the C new
keys/values into their pages. Rows or tokens marked invalid write to the null
page. No per-step copy of every layer's context is assembled or scattered back.

`scanned_forward` (`Engine(scan_layers=True)`) runs the same step as one scan
over stacked layer parameters and one pool of every layer stacked (L, ...):
each layer reads and writes its own slice inside the one gather / scatter.
`paged_forward` takes that path when the parameters are stacked.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxformer.config import TransformerConfig
from jaxformer.decode.cache import kv_shape
from jaxformer.nn import kv_quant, stacking
from jaxformer.nn.layers import DecoderLayer
from jaxformer.nn.attention import kv_length_axis
from jaxformer.nn.paged_kv import PagedKV

Pools = tuple  # per decoder layer, a KV or QuantKV of one row of (N + 1) * Z slots


def init_pools(config: TransformerConfig, num_pages: int, page_size: int,
               dtype: Any = None, stacked: bool = False) -> Pools:
    """Zero keys/values for `num_pages` pages of `page_size` tokens, plus the null page;
    `stacked`: one pool of every layer on a leading axis L (for `scanned_forward`)."""
    dtype = config.compute_dtype if dtype is None else jnp.dtype(dtype)
    shape = kv_shape(config, 1, (num_pages + 1) * page_size)
    if stacked:
        kv = kv_quant.empty(shape, config.kv_cache_quant == "int8", dtype)
        return (type(kv)(*(jnp.zeros((config.num_decoder_layers,) + x.shape, x.dtype)
                           for x in kv)),)
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


def call_decoder(module, *args, **kwargs):
    return module.decoder(*args, **kwargs)


def paged_mask(lengths_S: jnp.ndarray, read_slots: int, new: int,
               window: Optional[int] = None) -> jnp.ndarray:
    """(S, 1, C, read_slots + C): query i of row s sees page slots < L_s and new keys <= i;
    with `window` (a local layer's), only keys less than `window` positions back (page
    slot p is position p, new key j position L_s + j)."""
    slots_K, new_C = jnp.arange(read_slots), jnp.arange(new)
    past_SK = slots_K[None, :] < lengths_S[:, None]
    causal_CC = new_C[None, :] <= new_C[:, None]
    past_SCK = jnp.broadcast_to(past_SK[:, None, :], (lengths_S.shape[0], new, read_slots))
    causal_SCC = jnp.broadcast_to(causal_CC[None], (lengths_S.shape[0], new, new))
    if window is not None:
        queries_SC = lengths_S[:, None] + new_C[None, :]
        past_SCK = past_SCK & (queries_SC[:, :, None] - slots_K[None, None, :] < window)
        causal_SCC = causal_SCC & (new_C[:, None] - new_C[None, :] < window)[None]
    return jnp.concatenate([past_SCK, causal_SCC], axis=-1)[:, None]


def layer_masks(config: TransformerConfig, lengths_S: jnp.ndarray, read_slots: int,
                new: int) -> tuple[jnp.ndarray, Optional[jnp.ndarray]]:
    """(the global layers' `paged_mask`, the local layers' or None without local layers)."""
    local = any(config.local_layers(config.num_decoder_layers))
    return (paged_mask(lengths_S, read_slots, new),
            paged_mask(lengths_S, read_slots, new, config.sliding_window) if local else None)


def paged_forward(model, params, pools: Pools, table_SM: jnp.ndarray, lengths_S: jnp.ndarray,
                  tokens_SC: jnp.ndarray, valid_SC: jnp.ndarray, *, page_size: int,
                  view_len: int, logits_at: Optional[jnp.ndarray] = None
                  ) -> tuple[jnp.ndarray, Pools]:
    """Feed C tokens per row at positions L_s.. through the pages: the decode step
    (C = 1) or a prefill chunk. Traceable; the caller jits it (pools donated).

    Args:
      model, params: the decoder-only LM (per-layer layout, `stacking.for_decoding`).
      pools: `init_pools`' keys/values.
      table_SM: (S, M) int32 page ids per row (`pages.PageTable.row`).
      lengths_S: (S,) int32 tokens already cached per row.
      tokens_SC: (S, C) int32 ids to feed; valid_SC: (S, C) bool, False = padding or
        an idle row (its keys/values go to the null page).
      view_len: Tv >= max(L_s) + C (static): each row reads its first ceil(Tv / Z)
        pages (at most M).
      logits_at: None, or (S,) int32: the logits of that one position of each row's
        chunk only (a prefill chunk needs its last prompt token's; the output
        projection of every other position is skipped).
    Returns:
      (logits (S, C, V), or (S, 1, V) with `logits_at`, float32; the updated pools).
    """
    if stacking.layout(params) == "stacked":
        return scanned_forward(model, params, pools, table_SM, lengths_S, tokens_SC, valid_SC,
                               page_size=page_size, view_len=view_len, logits_at=logits_at)
    new = tokens_SC.shape[1]
    axis = kv_length_axis(model.config)
    pages = min(table_SM.shape[1], -(-view_len // page_size))
    table_SP = jnp.asarray(table_SM)[:, :pages]
    positions_SC = lengths_S[:, None] + jnp.arange(new)[None, :]
    slots_SC = pool_slots(table_SM, positions_SC, valid_SC, page_size)
    caches = tuple(PagedKV(kv, table_SP, slots_SC, page_size, axis, start_B=lengths_S)
                   for kv in pools)
    # Local layers attend through the same pages with their window's band (`ring_mask`:
    # the decoder's mask of local layers; no ring index: the pages are not a ring).
    mask, local_mask = layer_masks(model.config, lengths_S, pages * page_size, new)
    out, caches = model.apply(
        {"params": params}, tokens_SC, mask, None, None, positions_BT=positions_SC,
        caches=caches, ring_mask=local_mask, deterministic=True,
        hidden=logits_at is not None, method=call_decoder)
    if logits_at is not None:  # out: the final normed states (S, C, D)
        out = model.apply({"params": params}, at_positions(out, logits_at),
                          method=type(model).output_logits)
    return out, tuple(c.pool for c in caches)


def at_positions(y_SCD: jnp.ndarray, at_S: jnp.ndarray) -> jnp.ndarray:
    """(S, 1, D): position at_s of each row."""
    return jnp.take_along_axis(y_SCD, at_S[:, None, None], axis=1)


def embed_inputs(module, tokens_SC, positions_SC):
    decoder = module.decoder
    return decoder.positions(decoder.embed(tokens_SC), positions_SC, deterministic=True)


def final_logits(module, y_SCD):
    decoder = module.decoder
    if module.config.use_final_norm:
        y_SCD = decoder.final_norm(y_SCD)
    return decoder.output_logits(y_SCD)


def scanned_forward(model, params, pools: Pools, table_SM: jnp.ndarray,
                    lengths_S: jnp.ndarray, tokens_SC: jnp.ndarray, valid_SC: jnp.ndarray, *,
                    page_size: int, view_len: int, logits_at: Optional[jnp.ndarray] = None
                    ) -> tuple[jnp.ndarray, Pools]:
    """`paged_forward` with the decoder layers run as one `lax.scan` (the program holds
    one layer's kernels whatever the depth): `params` stacked (``decoder/layers/...``
    with a leading axis L, `stacking.stack_layers`) and `pools` one stacked pool
    (`init_pools(stacked=True)`); `model` the unrolled model (`stacking.for_decoding`),
    all of whose layers are of one kind."""
    config = model.config
    new = tokens_SC.shape[1]
    axis = kv_length_axis(config)
    pages = min(table_SM.shape[1], -(-view_len // page_size))
    table_SP = jnp.asarray(table_SM)[:, :pages]
    positions_SC = lengths_S[:, None] + jnp.arange(new)[None, :]
    slots_SC = pool_slots(table_SM, positions_SC, valid_SC, page_size)
    mask, local_mask = layer_masks(config, lengths_S, pages * page_size, new)
    mask = mask if local_mask is None else local_mask  # one kind: all local, or none
    decoder = dict(params["decoder"])
    layers = decoder.pop(stacking.STACKED)
    rest = {"params": {**params, "decoder": decoder}}
    layer = DecoderLayer(config, cross_attention=False, local=config.layer_is_local(0))

    def body(carry, xs):
        y_SCD, pool = carry
        layer_params, index = xs
        cache = PagedKV(pool, table_SP, slots_SC, page_size, axis, index, lengths_S)
        y_SCD, cache = layer.apply({"params": layer_params}, y_SCD, mask, None, None,
                                   cache=cache, positions_BT=positions_SC, deterministic=True)
        return (y_SCD, cache.pool), None

    y_SCD = model.apply(rest, tokens_SC, positions_SC, method=embed_inputs)
    (y_SCD, pool), _ = jax.lax.scan(body, (y_SCD, pools[0]),
                                    (layers, jnp.arange(config.num_decoder_layers)))
    if logits_at is not None:
        y_SCD = at_positions(y_SCD, logits_at)
    return model.apply(rest, y_SCD, method=final_logits), (pool,)

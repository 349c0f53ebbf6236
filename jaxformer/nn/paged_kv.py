"""A paged KV cache as a decoder layer reads it: one pool of pages, a page table per row.

Dimension key: B rows, N + 1 pool pages of Z slots (page 0 is the null page),
M pages read per row, C new tokens per row.

A layer's pool is a `KV` (or an int8 `kv_quant.QuantKV`) of one cache row of
(N + 1) * Z slots in the cache layout (`attention.kv_length_axis`): (1, G, P, K)
or (1, P, G, K), P = (N + 1) * Z; the scales (1, G, P) or (1, P, G). Position p
of row b lives at pool slot `table_BM[b, p // Z] * Z + p % Z`.

A call feeding C tokens per row reads the rows' first M pages straight from
the pool (`read`: one gather of whole pages per layer, left-aligned: position p
of row b at index p, entries past the row's length masked by the caller) and
attends over [those pages, its C new keys] as two parts
(`attention.dot_product_attention` reads parts in place); then only the new
keys/values are written into their pages (`write`, a scatter of C slots per row;
the pool is updated in place when the caller donates it). No contiguous copy of
the whole context is built before the call and none is scattered back after it.

A scanned layer stack (the serving engine's default for deep models) hands
every layer the pools of all L layers stacked, (L, 1, ...) in the same layout,
and the layer's index `layer` (traced): reads and writes index the layer inside
the one gather / scatter, so no layer's pool is sliced out (copied) first.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional, Union

import jax.numpy as jnp
from jax import lax

from jaxformer.backends import paged_attention
from jaxformer.config import TransformerConfig
from jaxformer.nn.attention import KV, dot_product_attention
from jaxformer.nn.kv_quant import QuantKV


class PagedKV(NamedTuple):
    """One decoder layer's cache in a serving step (a layer's `cache` argument).

    Attributes:
      pool: the layer's pool, a `KV` or `QuantKV` of (N + 1) * Z slots (module docstring).
      table_BM: (B, M) int32 pages each row reads, in position order (0 = null page).
      slots_BC: (B, C) int32 pool slots the C new keys/values go to (0 = the null page's
        first slot, for padding or idle rows).
      page_size: Z (static in shape: the pool's slots are a multiple of it).
      axis: the slot axis of one layer's pool (`attention.kv_length_axis`).
      layer: None, or the index (int32 scalar, may be traced) of this layer in a
        pool of all layers stacked on a leading axis L (module docstring).
      start_B: None, or (B,) int32 positions cached before the call (the C new tokens
        sit at start_b ..): what `heads` needs to read each row's own positions.
    """

    pool: Union[KV, QuantKV]
    table_BM: jnp.ndarray
    slots_BC: jnp.ndarray
    page_size: int
    axis: int
    layer: Optional[jnp.ndarray] = None
    start_B: Optional[jnp.ndarray] = None

    def with_pool(self, pool: Union[KV, QuantKV]) -> "PagedKV":
        return self._replace(pool=pool)


def read(cache: PagedKV) -> Union[KV, QuantKV]:
    """The rows' pages as a cache of M * Z slots each, (B, G, M*Z, K) or (B, M*Z, G, K)
    (scales without K): slot i of row b holds position i."""
    table_BM, size, axis = cache.table_BM, cache.page_size, cache.axis
    batch, pages = table_BM.shape

    def gather_stacked(x):  # (L, 1, .., P @ axis, ..): one gather at (layer, pages)
        inner = x[:, 0]
        paged = inner.reshape(inner.shape[:axis] + (-1, size) + inner.shape[axis + 1:])
        index = (cache.layer,) + (slice(None),) * (axis - 1) + (table_BM,)
        taken = jnp.moveaxis(paged[index], 1, axis)         # (B, .., M, Z, ..)
        return taken.reshape(taken.shape[:axis] + (pages * size,) + taken.shape[axis + 2:])

    if cache.layer is not None:
        return type(cache.pool)(*(gather_stacked(x) for x in cache.pool))

    def gather(x):  # (1, .., P @ axis, ..) -> (B, .., M*Z @ axis, ..)
        inner = x[0]
        paged = inner.reshape(inner.shape[:axis - 1] + (-1, size) + inner.shape[axis:])
        taken = jnp.take(paged, table_BM, axis=axis - 1)   # (.., B, M, Z, ..)
        taken = jnp.moveaxis(taken, axis - 1, 0)            # (B, .., M, Z, ..)
        return taken.reshape(taken.shape[:axis] + (pages * size,) + taken.shape[axis + 2:])

    return type(cache.pool)(*(gather(x) for x in cache.pool))


def write(cache: PagedKV, new: Union[KV, QuantKV]) -> Union[KV, QuantKV]:
    """The pool with `new` (B, G, C, K) or (B, C, G, K) (scales without K; the
    pool's type and dtypes) stored at `cache.slots_BC`.

    One new slot (B = C = 1: a 1-slot decode step) is a `dynamic_update_slice`, not a
    scatter: XLA:CPU rewrites a one-index scatter into a bounds-checked update that
    reads the old slot from the pool, and then copies the whole pool (three times) to
    update it; the update slice stays in place."""
    axis = cache.axis
    if cache.layer is not None:  # (L, 1, .., P @ axis, ..): one scatter at (layer, 0, slots)
        index = (cache.layer, 0) + (slice(None),) * (axis - 1) + (cache.slots_BC,)
        return type(cache.pool)(*(
            jnp.asarray(pool).at[index].set(jnp.moveaxis(x.astype(pool.dtype), axis, 1))
            for pool, x in zip(cache.pool, new)))
    index = (slice(None),) * (axis - 1) + (cache.slots_BC,)

    def scatter(pool, x):
        if cache.slots_BC.size == 1:  # one new key: in place (docstring)
            start = [0] * pool.ndim
            start[axis] = cache.slots_BC.reshape(())
            return lax.dynamic_update_slice(jnp.asarray(pool), x.astype(pool.dtype), start)
        fresh = jnp.moveaxis(x.astype(pool.dtype), 0, axis - 1)
        return jnp.asarray(pool)[0].at[index].set(fresh)[None]

    return type(cache.pool)(*(scatter(p, x) for p, x in zip(cache.pool, new)))


def kernel_attends(pool, axis: int, config: TransformerConfig) -> bool:
    """Whether `heads` gives the C++ kernel's attention for steps over `pool` (a decode
    or speculative step's few queries a row; a prefill chunk's many take the plain
    path): a tuned CPU process, a float32 (G, S, K)-layout pool, no logit soft-capping."""
    return (isinstance(pool, KV) and axis == 2 and config.attn_logit_softcapping is None
            and paged_attention.usable(pool))


def heads(cache: PagedKV, seen: Callable[[], KV], mask: jnp.ndarray,
          config: TransformerConfig) -> Optional[Callable[[jnp.ndarray], jnp.ndarray]]:
    """The attention of a paged step's queries as a function (B, C, H, K) -> (B, C, H, K),
    for `MultiHeadAttention(..., heads=...)`: on a tuned CPU the C++ kernel
    (`backends.paged_attention`: each row's own positions read in place from the pool,
    which must hold the new keys already, `write` first); elsewhere the plain dense
    attention over `seen()` ([the pages `read` gives, the new keys]) with `mask`.
    None where the kernel cannot serve (an untuned process, an int8 or non-float32 pool,
    the (B, S, G, K) layout, logit soft-capping, no `start_B`): the caller attends as
    before."""
    pool = cache.pool
    if cache.start_B is None or not kernel_attends(pool, cache.axis, config):
        return None
    scale = config.query_scale

    def plain(query_BCHK):
        kv = seen()
        out_BHCK, _ = dot_product_attention(jnp.swapaxes(query_BCHK, 1, 2), kv.key, kv.value,
                                            mask, scale=scale)
        return jnp.swapaxes(out_BHCK, 1, 2)

    def attend(query_BCHK):
        if not paged_attention.usable(pool, query_BCHK):
            return plain(query_BCHK)
        factor = scale if scale is not None else 1.0 / math.sqrt(query_BCHK.shape[-1])
        return paged_attention.attend(query_BCHK, pool.key, pool.value, cache.layer,
                                      cache.table_BM, cache.start_B, cache.page_size, factor,
                                      plain)

    return attend

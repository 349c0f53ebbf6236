"""The paged attention of a serving step on the CPU: a C++ kernel (`kernels/paged_attention.cc`)
called through `jax.ffi`, reading keys and values straight from the page pool.

Opt-in, part of the CPU tuning, as `qmatmul` is (built into the same library): `attend`
calls it only in a process that called `cpu.tune_process()`, only on the CPU
(`lax.platform_dependent`: any other lowering holds the caller's plain path), and only for
a float32 pool. The plain path (`nn.paged_kv.read`, then the dense attention) gathers
every row's pages, padded to the step's view length (the longest row's bucket), into a
copy per layer that the attention's products read again; at 32 slots those copies and
the small batched products over them were most of the step (benchmarks/NOTES.md). The
kernel reads each row's own positions once, in place, and each kv head once for all its
query heads (grouped-query attention) and all the step's queries of the row.

Dimension key: B rows, C queries per row, H query heads, G kv heads, D head depth,
L layers of a stacked pool, P pool slots ((N + 1) * Z), M pages per row, Z page size.

Pieces::

    usable(pool[, query]) -> bool  a tuned CPU process, the kernel built, float32 operands
    kernel(query, key_pool, value_pool, layer, table, start, page_size, scale)
                                  the kernel: (B, C, H, D) float32 (CPU only)
    attend(query, ..., plain)     kernel on a tuned CPU, `plain(query)` elsewhere
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxformer.backends import qmatmul

TARGET = qmatmul.PAGED_TARGET[0]
# Most queries per row the kernel takes (a decode step, a speculative step's drafts): its
# scores are dot products one at a time, which a prefill chunk's many queries per key
# make slower than the plain path's matrix products (8 rows of 32 queries over 150
# cached positions: 3.0 vs 2.1 ms a layer; of 8 queries: 0.44 vs 0.75).
MAX_QUERIES = 16


def usable(pool_arrays, query: Optional[jnp.ndarray] = None) -> bool:
    """Whether `attend` takes the kernel for a pool of these arrays (keys, values) and
    these queries (None: not known yet): a tuned process whose kernels are built,
    everything float32, at most MAX_QUERIES queries per row."""
    return ((query is None or (query.dtype == jnp.float32 and query.shape[1] <= MAX_QUERIES))
            and all(x.dtype == jnp.float32 for x in pool_arrays) and qmatmul.enabled())


def kernel(query_BCHD: jnp.ndarray, key_pool: jnp.ndarray, value_pool: jnp.ndarray,
           layer, table_BM: jnp.ndarray, start_B: jnp.ndarray, page_size: int,
           scale: float) -> jnp.ndarray:
    """softmax(scale q k^T) v of each query over its row's positions 0 .. start_b + i,
    read through the page table (`kernels/paged_attention.cc` states the layout).

    Args:
      query_BCHD: (B, C, H, D) float32, query i of row b at position start_b + i.
      key_pool, value_pool: (L, 1, G, P, D) (a stacked pool) or (1, G, P, D), float32,
        holding every position the queries see (the new keys written first).
      layer: which of the L layers (an int or int32 scalar, may be traced); 0 unstacked.
      table_BM: (B, M) int32 page ids; start_B: (B,) int32.
    Returns:
      (B, C, H, D) float32.
    """
    if qmatmul.library() is None:
        raise RuntimeError("the CPU kernels' library could not be built (see the warning)")
    # The pools go in as they are (a reshape here made XLA keep a second copy of a
    # pool updated by a one-slot write, for this operand alone).
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(query_BCHD.shape, jnp.float32),
                            vmap_method="sequential")
    return call(query_BCHD, key_pool, value_pool, jnp.asarray(0 if layer is None else layer, jnp.int32),
                table_BM.astype(jnp.int32), start_B.astype(jnp.int32),
                page_size=np.int64(page_size), scale=np.float32(scale))


def attend(query_BCHD: jnp.ndarray, key_pool: jnp.ndarray, value_pool: jnp.ndarray,
           layer, table_BM: jnp.ndarray, start_B: jnp.ndarray, page_size: int, scale: float,
           plain: Callable[[jnp.ndarray], jnp.ndarray]) -> jnp.ndarray:
    """`kernel` where `usable`, lowered for the CPU; `plain(query_BCHD)` (the same
    (B, C, H, D) result by the plain path) elsewhere and in any other platform's
    lowering."""
    if not usable((key_pool, value_pool), query_BCHD):
        return plain(query_BCHD)

    def on_cpu(q):
        return kernel(q, key_pool, value_pool, layer, table_BM, start_B, page_size, scale)

    return lax.platform_dependent(query_BCHD, cpu=on_cpu, default=plain)

"""Blockwise (flash) attention: the softmax online over key blocks, memory linear in length.

`blockwise_attention` computes what `attention.dot_product_attention` computes
(same layouts: queries (B, H, T, K), keys and values (B, G, S, K), G dividing
H) without ever holding a (T, S) matrix: a scan over query blocks, and for
each a scan over the key blocks it can see, carrying the running row maximum
m, the running sum l of exp(logit - m) and the running weighted sum of values
(Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022). The mask is a
`mask_structure.MaskSpec`; each block builds its own (block_q, block_k) mask.

Skipping: a query block scans only the `band` of key blocks its causal /
sliding-window structure lets it see (static bounds, so a window's compute
grows linearly in T), and inside the band a block pair that `block_visible`
says is all masked (above the causal diagonal, other segments, padding)
is skipped at run time by `lax.cond`.

Backward: no custom VJP. Each query block's computation runs under
`jax.checkpoint`, so reverse mode keeps only the query blocks and the outputs
and recomputes one query block's forward at a time when it differentiates
it; each key step is rematerialised again, so that recompute keeps only the
scan's (block_q, K) carries: temporaries are O(T x K + S / block_k x block_q x K)
per head, never O(T x S) (benchmarks/long.py: x9.6 from 1k to 16k). Forward mode
(`jax.jvp`, `jax.jacfwd`) works as for any JAX function. The running maximum is
a `stop_gradient`: the result does not depend on it mathematically.

Not here: attention dropout (use the dense path) and the attention weights
(never formed).

Fully masked query rows (no visible key) give output 0 and zero gradients.
The dense function gives them uniform weights over all S keys instead (the
mean of the values); both are finite. The rows are padding in practice.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from jaxformer.nn import checks
from jaxformer.nn.mask_structure import (MaskSpec, band, block_mask, block_visible,
                                         check_spec, first_key_block)

# Tuned for CPU at T = 1k (benchmarks/long.py); multiples of 128, sensible for GPU/TPU tiles.
DEFAULT_BLOCK_Q = 256
DEFAULT_BLOCK_K = 256


def _pad_axis(x: Optional[jnp.ndarray], axis: int, size: int) -> Optional[jnp.ndarray]:
    """x padded at the end of `axis` to `size` (edge values; the caller masks them)."""
    if x is None or x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, mode="edge")


def _padded_spec(mask: MaskSpec, num_queries: int, num_keys: int, padded_queries: int,
                 padded_keys: int) -> MaskSpec:
    """`mask` for queries and keys padded at the end: per-token arrays padded along
    with them, the padded keys cut off by `kv_lengths`."""
    mask = mask.replace(**{name: _pad_axis(getattr(mask, name), 1, padded_queries)
                           for name in ("q_segment_ids", "q_positions")},
                        **{name: _pad_axis(getattr(mask, name), 1, padded_keys)
                           for name in ("kv_segment_ids", "kv_positions")})
    if padded_keys != num_keys:
        lengths = num_keys if mask.kv_lengths is None else jnp.minimum(mask.kv_lengths, num_keys)
        mask = mask.replace(kv_lengths=jnp.reshape(jnp.asarray(lengths, jnp.int32), (-1,)))
    return mask


def blockwise_attention(
    query_BHTK: jnp.ndarray,
    key_BGSK: jnp.ndarray,
    value_BGSK: jnp.ndarray,
    mask: Optional[MaskSpec] = None,
    *,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    logit_softcap: Optional[float] = None,
    scale: Optional[float] = None,
) -> jnp.ndarray:
    """softmax(mask(softcap(Q K^T * scale))) V per head, blockwise: (B, H, T, K).

    Args:
      query_BHTK: queries; key_BGSK, value_BGSK: G kv heads, G dividing H (query
        head h reads kv head h // (H / G); never repeated in memory).
      mask: which keys each query may see (None: all).
      block_q, block_k: block sizes (clipped to T and S); T and S need not be
        multiples (the tails are padded and masked).
      logit_softcap: if set, logits become cap * tanh(logits / cap) before masking
        (Gemma 2).
      scale: logit scale, default 1 / sqrt(K).

    The softmax statistics and the value sums are float32 whatever the input
    dtype; the output has the query's dtype.
    """
    checks.check_qkv(query_BHTK, key_BGSK, value_BGSK)
    batch, heads, num_queries, depth = query_BHTK.shape
    kv_heads, num_keys = key_BGSK.shape[1], key_BGSK.shape[2]
    group = heads // kv_heads
    scale = 1.0 / math.sqrt(depth) if scale is None else scale
    mask = MaskSpec() if mask is None else mask
    check_spec(mask, batch, num_queries, num_keys)
    block_q, block_k = min(block_q, num_queries), min(block_k, num_keys)
    num_q_blocks, num_k_blocks = -(-num_queries // block_q), -(-num_keys // block_k)
    padded_t, padded_s = num_q_blocks * block_q, num_k_blocks * block_k
    mask = _padded_spec(mask, num_queries, num_keys, padded_t, padded_s)
    query_BHTK = _pad_axis(query_BHTK, 2, padded_t)
    key_BGSK, value_BGSK = _pad_axis(key_BGSK, 2, padded_s), _pad_axis(value_BGSK, 2, padded_s)
    width = band(mask, block_q, block_k, num_k_blocks)
    neg = jnp.finfo(jnp.float32).min

    def key_step(q_start, query_BGRQK, carry, k_start, key_BGCK, value_BGCK):
        """Fold the key block at `k_start` into (values sum, max, sum of exp)."""
        acc_BGRQK, max_BGRQ, sum_BGRQ = carry
        logits_BGRQC = jnp.einsum("bgrqk,bgck->bgrqc", query_BGRQK, key_BGCK,
                                  preferred_element_type=jnp.float32) * scale
        if logit_softcap is not None:
            logits_BGRQC = logit_softcap * jnp.tanh(logits_BGRQC / logit_softcap)
        visible_B11QC = block_mask(mask, q_start, block_q, k_start, block_k)[:, :, None]
        logits_BGRQC = jnp.where(visible_B11QC, logits_BGRQC, neg)
        new_max_BGRQ = lax.stop_gradient(jnp.maximum(max_BGRQ, logits_BGRQC.max(axis=-1)))
        # where, not just exp: a row with nothing visible yet has max = neg and must add 0.
        weights_BGRQC = jnp.where(visible_B11QC,
                                  jnp.exp(logits_BGRQC - new_max_BGRQ[..., None]), 0.0)
        rescale_BGRQ = jnp.exp(max_BGRQ - new_max_BGRQ)
        sum_BGRQ = sum_BGRQ * rescale_BGRQ + weights_BGRQC.sum(axis=-1)
        acc_BGRQK = acc_BGRQK * rescale_BGRQ[..., None] + jnp.einsum(
            "bgrqc,bgck->bgrqk", weights_BGRQC.astype(value_BGCK.dtype), value_BGCK,
            preferred_element_type=jnp.float32)
        return acc_BGRQK, new_max_BGRQ, sum_BGRQ

    # Key and value blocks as scan inputs, (nk, B, G, block_k, K): their gradients
    # then come back as stacked blocks, not as a full (B, G, S, K) array per step.
    key_NBGCK, value_NBGCK = (x.reshape(batch, kv_heads, num_k_blocks, block_k, depth)
                              .transpose(2, 0, 1, 3, 4) for x in (key_BGSK, value_BGSK))

    def query_block(q_index, query_BGRQK):
        """(B, G, R, block_q, K) output of one query block, scanning its band of key blocks."""
        q_start = q_index * block_q
        first = first_key_block(mask, q_start, block_k, num_k_blocks, width)
        band_keys, band_values = (x if width == num_k_blocks else
                                  lax.dynamic_slice_in_dim(x, first, width, axis=0)
                                  for x in (key_NBGCK, value_NBGCK))

        def step(carry, xs):
            j, key_BGCK, value_BGCK = xs
            k_start = (first + j) * block_k
            # Remat per key block too: reverse mode then keeps the carries of the scan,
            # not each block's (block_q, block_k) weights and masks.
            attend = jax.checkpoint(lambda c: key_step(q_start, query_BGRQK, c, k_start,
                                                       key_BGCK, value_BGCK), prevent_cse=False)
            carry = lax.cond(block_visible(mask, q_start, block_q, k_start, block_k),
                             attend, lambda c: c, carry)
            return carry, None

        stats_shape = query_BGRQK.shape[:-1]
        init = (jnp.zeros(query_BGRQK.shape, jnp.float32), jnp.full(stats_shape, neg),
                jnp.zeros(stats_shape, jnp.float32))
        (acc_BGRQK, _, sum_BGRQ), _ = lax.scan(step, init,
                                               (jnp.arange(width), band_keys, band_values))
        # Rows that saw no key: sum 0, acc 0 -> output 0 (and finite gradients).
        return (acc_BGRQK / jnp.where(sum_BGRQ == 0.0, 1.0, sum_BGRQ)[..., None]).astype(
            query_BGRQK.dtype)

    # (B, H, T, K) -> (nq, B, G, R, block_q, K): the query blocks as scan inputs.
    query_NBGRQK = query_BHTK.reshape(batch, kv_heads, group, num_q_blocks, block_q,
                                      depth).transpose(3, 0, 1, 2, 4, 5)
    remat_block = jax.checkpoint(query_block, prevent_cse=False)
    _, out_NBGRQK = lax.scan(lambda _, x: (None, remat_block(*x)), None,
                             (jnp.arange(num_q_blocks), query_NBGRQK))
    out_BHTK = out_NBGRQK.transpose(1, 2, 3, 0, 4, 5).reshape(batch, heads, padded_t, depth)
    return out_BHTK[:, :, :num_queries]

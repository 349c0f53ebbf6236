"""Pallas splash attention (TPU): the fused blockwise kernel of MaxText, for a MaskSpec.

`splash_attention` runs `jax.experimental.pallas.ops.tpu.splash_attention` on
the layouts of `attention.dot_product_attention` (queries (B, H, T, K), keys and
values (B, G, S, K), G dividing H: the kernel's grouped-query mode), one kernel
call per batch row (`jax.vmap`). The mask's static structure becomes the
kernel's block-sparse mask (`FullMask`, `CausalMask`, `LocalMask` of the
window), its segment ids the kernel's `SegmentIds`; what else a MaskSpec can
say (lengths, prefix, explicit positions, a query offset) has no splash form,
so `attention_select.splash_supports` sends such masks elsewhere.

Forward-mode AD: the kernel has a custom VJP only, so `jax.jvp` needs
"blockwise" or "einsum" (name it in `config.attention_impl`).

`interpret=True` runs the kernel in Pallas' interpreter (any backend, slow):
how the tests check its numbers on CPU.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp

from jaxformer.nn import checks
from jaxformer.nn.mask_structure import MaskSpec, check_spec


def _kernel_mask(mask_lib, mask: Optional[MaskSpec], num_queries: int, num_keys: int):
    """The static (T, S) splash mask of `mask`'s causal / window structure."""
    shape = (num_queries, num_keys)
    if mask is None or (not mask.causal and mask.window is None):
        return mask_lib.FullMask(shape)
    if mask.window is None:
        return mask_lib.CausalMask(shape)
    left = mask.window - 1  # keys q - (w - 1) .. q (causal), or .. q + w - 1
    return mask_lib.LocalMask(shape, window_size=(left, 0 if mask.causal else left), offset=0)


def splash_attention(query_BHTK: jnp.ndarray, key_BGSK: jnp.ndarray, value_BGSK: jnp.ndarray,
                     mask: Optional[MaskSpec] = None, *, scale: Optional[float] = None,
                     logit_softcap: Optional[float] = None,
                     interpret: bool = False) -> jnp.ndarray:
    """softmax(mask(softcap(Q K^T * scale))) V per head with the splash kernel: (B, H, T, K).

    `mask` must pass `attention_select.splash_supports` (causal, window, segment ids);
    T and S multiples of the kernel's 128-token blocks.
    """
    checks.check_qkv(query_BHTK, key_BGSK, value_BGSK)  # before the kernels load
    if mask is not None:
        check_spec(mask, query_BHTK.shape[0], query_BHTK.shape[2], key_BGSK.shape[2])
    # Pallas' TPU kernels load on first use, not with `import jaxformer`.
    from jax.experimental.pallas.ops.tpu.splash_attention import (  # noqa: PLC0415
        splash_attention_kernel as kernel_lib, splash_attention_mask as mask_lib)

    batch, heads, num_queries, depth = query_BHTK.shape
    num_keys = key_BGSK.shape[2]
    scale = 1.0 / math.sqrt(depth) if scale is None else scale
    head_mask = _kernel_mask(mask_lib, mask, num_queries, num_keys)
    kernel = kernel_lib.make_splash_mha(
        mask_lib.MultiHeadMask([head_mask] * heads), head_shards=1, q_seq_shards=1,
        attn_logits_soft_cap=logit_softcap, interpret=interpret)
    query_BHTK = (query_BHTK * scale).astype(query_BHTK.dtype)
    if mask is None or mask.q_segment_ids is None:
        return jax.vmap(kernel)(query_BHTK, key_BGSK, value_BGSK)
    q_segments_BT = jnp.broadcast_to(mask.q_segment_ids, (batch, num_queries))
    kv_segments_BS = jnp.broadcast_to(mask.kv_segment_ids, (batch, num_keys))
    return jax.vmap(lambda q, k, v, qs, ks: kernel(
        q, k, v, segment_ids=kernel_lib.SegmentIds(qs, ks)))(
            query_BHTK, key_BGSK, value_BGSK, q_segments_BT.astype(jnp.int32),
            kv_segments_BS.astype(jnp.int32))

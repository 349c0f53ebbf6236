"""Scaled dot-product attention (a pure function) and multi-head attention.

Layout: `attention_impl="einsum"` is heads-major, queries (B, H, T, K), keys
and values (B, G, S, K), weights (B, H, T, S): both products are batched
matmuls over (B, H), so a cached step's query reads a (B, G, T_max, K) cache in
place. `attention_impl="jax"` (`jax.nn.dot_product_attention`, cuDNN's fused
kernel on GPU) takes (B, T, H, K) and keys and values (B, S, G, K), so its
keys, values and cache keep that layout (`kv_length_axis`). Either way only
the new token's key and value change layout on their way into a cache.

One module serves self- and cross-attention: `MultiHeadAttention.kv(x)` projects
keys/values, `MultiHeadAttention(x_q, kv, mask)` attends. Self-attention passes
`kv(x)` of its own input; cross-attention passes `kv(memory)`, which a decode
loop computes once and reuses; a KV cache is just a bigger `KV`.

Grouped-query attention: keys and values have G = `config.kv_heads` heads,
(B, G, S, K); query head h reads kv head h // (H / G). The einsum path views
the queries as (B, G, H/G, T, K) (a free reshape) so each kv head is read
once for its whole group, never repeated in memory.

Masks are dense booleans (B|1, 1, T, S) or a `MaskSpec` (structure: causal,
window, segment ids, ...). `attention_impl="blockwise"` runs
`blockwise.blockwise_attention` on a MaskSpec, so no (T, S) array is built;
"auto" picks per call (`attention_select.resolved_attention_impl`): cuDNN on GPU,
Pallas splash on TPU (`splash.py`) where their constraints hold. A dense
mask, or keys in parts (a cached decode step), take the dense path whatever
the implementation: single-token decode steps stay dense.

Rotary embeddings (`rope.py`) rotate queries and keys by their positions
before the product; `kv(x, positions_BS)` stores rotated keys, so a cache
holds them ready and a step rotates only its new query and key.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jaxformer.config import TransformerConfig
from jaxformer.nn import checks, lora, tuning
from jaxformer.nn.attention_select import jax_nn_mask_arguments, resolved_attention_impl
from jaxformer.nn.blockwise import blockwise_attention
from jaxformer.nn.mask_structure import LayerKindMask, MaskSpec, densified
from jaxformer.nn.splash import splash_attention
from jaxformer.nn.tuning import apply_dropout
from jaxformer.nn.norms import layer_norm
from jaxformer.nn.quant_dense import dense
from jaxformer.nn.rope import apply_rope, layer_frequencies


class KV(NamedTuple):
    """Projected keys and values, each (B, G, S, K) (G = H without grouped-query attention),
    or each a tuple of such parts along S (a decode cache's past and current chunk)."""

    key: jnp.ndarray
    value: jnp.ndarray


def structured_attention(query_BHTK: jnp.ndarray, key_BGSK: jnp.ndarray,
                         value_BGSK: jnp.ndarray, mask, config: TransformerConfig
                         ) -> jnp.ndarray:
    """Blockwise attention (B, H, T, K) under `mask` (None, a MaskSpec or a
    `LayerKindMask`) with the config's query scale and logit soft cap."""
    def run(spec):
        return blockwise_attention(query_BHTK, key_BGSK, value_BGSK, spec,
                                   logit_softcap=config.attn_logit_softcapping,
                                   scale=config.query_scale)

    if isinstance(mask, LayerKindMask):
        return jax.lax.cond(mask.is_local, lambda: run(mask.local),
                            lambda: run(mask.global_))
    return run(mask)


def shared_rows(batch: int, kv_batch: int, mask) -> int:
    """r = batch / kv_batch, the query rows that share each row of keys and values
    (`MultiHeadAttention.__call__`); ValueError unless kv_batch divides batch and
    `mask` is None or (1|kv_batch, 1, 1, S) (one mask row per source, the same for
    every query)."""
    if kv_batch < 1 or batch % kv_batch:
        raise ValueError(f"keys and values have {kv_batch} rows: the queries' {batch} rows "
                         "must be a multiple of them (rows that share a source's keys)")
    if mask is not None and (isinstance(mask, (MaskSpec, LayerKindMask)) or mask.ndim != 4
                             or mask.shape[0] not in (1, kv_batch) or mask.shape[2] != 1):
        raise ValueError(f"queries that share keys take a mask of shape (1|{kv_batch}, 1, 1, "
                         f"S) or None, got {getattr(mask, 'shape', type(mask).__name__)}")
    return batch // kv_batch


@jax.custom_jvp
def softmax_last(logits: jnp.ndarray) -> jnp.ndarray:
    """`jax.nn.softmax(logits, axis=-1)`, the same values, with a derivative that needs
    only the output: d softmax = y * (dx - sum(y * dx)). (`jax.nn.softmax` differentiates
    its exp / sum formula unless `jax_softmax_custom_jvp` is set, a process-wide flag; the
    compiled train step then keeps the exponentials and a broadcast reciprocal of the
    sums beside the weights: two more (B, H, T, S) arrays a layer, 270 MiB of SmolLM2's
    fine-tuning step at 2 x 256 tokens, issue 44.) Forward mode works as for any function."""
    unnormalized = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    return unnormalized / jnp.sum(unnormalized, axis=-1, keepdims=True)


@softmax_last.defjvp
def _softmax_last_jvp(primals, tangents):
    (logits,), (logits_dot,) = primals, tangents
    y = softmax_last(logits)
    return y, y * (logits_dot - (y * logits_dot).sum(axis=-1, keepdims=True))


def dot_product_attention(
    query_BHTK: jnp.ndarray,
    key_BHSK: jnp.ndarray,
    value_BHSK: jnp.ndarray,
    mask: Optional[jnp.ndarray] = None,
    *,
    dropout_rate: float = 0.0,
    dropout_rng: Optional[jax.Array] = None,
    dropout_mask: Callable = jax.random.bernoulli,
    scale: Optional[float] = None,
    softcap: Optional[float] = None,
    query_block: Optional[int] = None,
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """softmax(Q K^T / sqrt(K) masked) V, per head.

    Args:
      query_BHTK, key_BHSK, value_BHSK: queries, keys, values. Keys and values
        may have G heads with G dividing H (grouped-query attention): query
        head h then reads kv head h // (H / G). They may also be tuples of
        parts along S (a decode cache's past and current chunk), attended as
        their concatenation without building it.
      mask: boolean, broadcastable to (B, H, T, S); True = may attend.
      dropout_rate, dropout_rng: dropout on the weights (off if rng is None).
      dropout_mask: `(rng, keep_prob, shape) -> bool mask` (`jax.random.bernoulli`).
      scale: the logits' factor instead of 1 / sqrt(K) (`config.query_scale`).
      softcap: logits -> softcap * tanh(logits / softcap) before the mask (Gemma 2).
      query_block: if set and below T, the weights are formed for one batch row and
        this many queries at a time (`lax.map` over the blocks; each query row's
        values are those of the whole computation), on a CPU only (elsewhere the
        whole product): `MultiHeadAttention` of a `cpu_tuning` config passes
        `query_block_length` at inference, so a block's weights stay under
        `ATTENTION_BLOCK_BYTES`. Not with dropout or keys in parts.

    Returns:
      (out (B, H, T, K), weights (B, H, T, S) after dropout). Unused weights
      cost nothing under jit: XLA drops them.

    Masked logits are replaced (`jnp.where`), not offset by -inf, with the most
    negative finite value of the dtype: a fully masked row then gets uniform
    weights, so its output and gradients stay finite instead of NaN. The softmax
    runs in float32 whatever the compute dtype.
    """
    checks.check_shape("query_BHTK", query_BHTK, (None,) * 4, "(batch, heads, queries, depth)")
    batch, heads, num_queries, depth = query_BHTK.shape
    # Keys and values may come in parts along S (a decode cache's read-only past
    # and its current chunk): each part is read in place, never concatenated.
    keys = key_BHSK if isinstance(key_BHSK, tuple) else (key_BHSK,)
    values = value_BHSK if isinstance(value_BHSK, tuple) else (value_BHSK,)
    if len(keys) != len(values) or not keys:
        raise ValueError(f"key_BHSK and value_BHSK must come in the same number of parts, "
                         f"got {len(keys)} and {len(values)}")
    kv_heads = getattr(keys[0], "shape", (None, None))[1]
    for i, (k, v) in enumerate(zip(keys, values)):
        part = f"[{i}]" if len(keys) > 1 else ""
        checks.check_shape(f"key_BHSK{part}", k, (batch, kv_heads, None, depth),
                           "(batch, kv heads, keys, depth)")
        checks.check_shape(f"value_BHSK{part}", v, k.shape, "(the keys' shape)")
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of kv heads ({kv_heads})")
    if mask is not None:
        num_keys = sum(k.shape[2] for k in keys)
        checks.check_shape("mask", mask, ((1, batch), (1, heads), (1, num_queries),
                                          (1, num_keys)), "broadcastable to (B, H, T, S)")
    group = heads // kv_heads  # R = H / G query heads per kv head
    if query_block is not None and query_block < num_queries:
        if len(keys) > 1 or (dropout_rng is not None and dropout_rate > 0.0):
            raise ValueError("query_block: not with keys in parts or dropout")
        def blocked():
            return _in_query_blocks(query_BHTK, key_BHSK, value_BHSK, mask, query_block,
                                    scale=scale, softcap=softcap)

        def whole():
            return dot_product_attention(query_BHTK, key_BHSK, value_BHSK, mask,
                                         scale=scale, softcap=softcap)

        # On XLA:CPU only: a GPU or TPU runs one batched product faster than a loop.
        return lax.platform_dependent(cpu=blocked, default=whole)

    def scores(key_BGSK):  # (B, H, T, S) of one part
        if group == 1:
            return jnp.einsum("bhtk,bhsk->bhts", query_BHTK, key_BGSK)
        query_BGRTK = query_BHTK.reshape(batch, kv_heads, group, num_queries, depth)
        return jnp.einsum("bgrtk,bgsk->bgrts", query_BGRTK, key_BGSK).reshape(
            batch, heads, num_queries, key_BGSK.shape[2])

    def mix(weights_BHTS, value_BGSK):  # (B, H, T, K) of one part
        if group == 1:
            return jnp.einsum("bhts,bhsk->bhtk", weights_BHTS, value_BGSK)
        weights_BGRTS = weights_BHTS.reshape(batch, kv_heads, group, num_queries,
                                             value_BGSK.shape[2])
        return jnp.einsum("bgrts,bgsk->bgrtk", weights_BGRTS, value_BGSK).reshape(
            batch, heads, num_queries, depth)

    logits_BHTS = jnp.concatenate([scores(k) for k in keys], axis=-1)
    if scale is None:
        logits_BHTS = (logits_BHTS / math.sqrt(depth)).astype(jnp.float32)
    else:
        logits_BHTS = (logits_BHTS * scale).astype(jnp.float32)
    if softcap is not None:
        logits_BHTS = softcap * jnp.tanh(logits_BHTS / softcap)
    if mask is not None:
        logits_BHTS = jnp.where(mask, logits_BHTS, jnp.finfo(jnp.float32).min)
    weights_BHTS = softmax_last(logits_BHTS)
    if dropout_rng is not None and dropout_rate > 0.0:
        weights_BHTS = apply_dropout(weights_BHTS, dropout_rate, dropout_rng, dropout_mask)
    weights_BHTS = weights_BHTS.astype(values[0].dtype)
    out_BHTK, offset = None, 0
    for value_BGSK in values:
        part = mix(weights_BHTS[..., offset:offset + value_BGSK.shape[2]], value_BGSK)
        out_BHTK = part if out_BHTK is None else out_BHTK + part
        offset += value_BGSK.shape[2]
    return out_BHTK, weights_BHTS


# Inference forms a (T, S) weights block of at most this many bytes at a time (one batch
# row, all heads): a whole layer's weights (Whisper's encoder: 6 x 1500 x 1500 float32,
# 54 MB a row) are a fresh allocation at each call, faulted in page by page on a host
# (70,000 faults, a third of the encoder's CPU time), and larger than the caches.
ATTENTION_BLOCK_BYTES = 4 * 2**20


def query_block_length(heads: int, num_queries: int, num_keys: int) -> Optional[int]:
    """Queries per block so that a block's float32 weights (heads, queries, keys) stay
    within `ATTENTION_BLOCK_BYTES`: a divisor of T from half that count up if there
    is one (else T is padded); None when one row's weights fit whole."""
    per_query = heads * num_keys * 4
    if per_query * num_queries <= ATTENTION_BLOCK_BYTES:
        return None
    most = max(1, ATTENTION_BLOCK_BYTES // per_query)
    fits = [d for d in range(most, max(most // 2, 1) - 1, -1) if num_queries % d == 0]
    return fits[0] if fits else most


def _in_query_blocks(query_BHTK, key_BGSK, value_BGSK, mask, block: int, **kwargs):
    """`dot_product_attention` over blocks of one batch row and `block` queries."""
    batch, heads, num_queries, depth = query_BHTK.shape
    n = -(-num_queries // block)
    pad = n * block - num_queries
    query_XHCK = jnp.pad(query_BHTK, ((0, 0), (0, 0), (0, pad), (0, 0))).reshape(
        batch, heads, n, block, depth).transpose(0, 2, 1, 3, 4).reshape(
        batch * n, heads, block, depth)
    if mask is not None:
        mask = jnp.asarray(mask).reshape((1,) * (4 - jnp.ndim(mask)) + jnp.shape(mask))
        if mask.shape[2] > 1:  # padded queries see every key (their rows are dropped)
            mask = jnp.pad(mask, ((0, 0), (0, 0), (0, pad), (0, 0)), constant_values=True)

    def one(x):
        i, query_1HCK = x
        b, j = i // n, i % n
        row = lambda a: jax.lax.dynamic_slice_in_dim(a, b, 1, axis=0)  # noqa: E731
        block_mask = None
        if mask is not None:
            block_mask = mask if mask.shape[0] == 1 else row(mask)
            if mask.shape[2] > 1:
                block_mask = jax.lax.dynamic_slice_in_dim(block_mask, j * block, block, axis=2)
        return dot_product_attention(query_1HCK[None], row(key_BGSK), row(value_BGSK),
                                     block_mask, **kwargs)

    out_X1HCK, weights_X1HCS = jax.lax.map(one, (jnp.arange(batch * n), query_XHCK))

    def unblock(x_XHCZ):
        return x_XHCZ.reshape((batch, n, heads, block, -1)).transpose(0, 2, 1, 3, 4).reshape(
            batch, heads, n * block, -1)[:, :, :num_queries]

    return unblock(out_X1HCK[:, 0]), unblock(weights_X1HCS[:, 0])


def dense_init() -> nn.initializers.Initializer:
    """Xavier-uniform, as torch.nn.MultiheadAttention and Flax's wmt example."""
    return nn.initializers.xavier_uniform()


def _heads_major(x_BTHK: jnp.ndarray) -> jnp.ndarray:
    """(B, T, H, K) -> (B, H, T, K); also the inverse."""
    return jnp.swapaxes(x_BTHK, 1, 2)


def kv_length_axis(config: TransformerConfig) -> int:
    """The S axis of keys and values (and of a KV cache) under `config.attention_impl`:
    2 for "einsum" (B, G, S, K), read in place by its batched matmuls; 1 for "jax"
    (B, S, G, K), the layout `jax.nn.dot_product_attention` and cuDNN take."""
    return 1 if config.attention_impl == "jax" else 2


class MultiHeadAttention(nn.Module):
    """Multi-head attention with separate query/key/value/output projections.

    Parameters: `query` kernel (D, H, K), `key` and `value` kernels (D, G, K),
    `out` kernel (H, K, D), plus each projection's bias if
    `config.has_attention_bias("q" | "k" | "v" | "o")`.
    `rotary=True` (self-attention of a `config.rope` model) rotates queries
    and keys by their positions, with the frequencies of a local layer if
    `local` (`rope.layer_frequencies`). `config.qk_norm` adds `query_norm` and
    `key_norm` (K,), applied per head before the rotation.
    """

    config: TransformerConfig
    rotary: bool = False
    local: bool = False

    def setup(self):
        c = self.config
        bias = c.has_attention_bias

        def project(features, kernel_names, bias_names, letter, n_in=1):  # float or quantized
            return dense(c, "layers", features, kernel_names, bias_names, n_in=n_in,
                         use_bias=bias(letter), dtype=c.compute_dtype,
                         kernel_init=dense_init())

        self.query = project((c.num_heads, c.head_dim), ("embed", "heads", "kv"),
                             ("heads", "kv"), "q")
        self.key = project((c.kv_heads, c.head_dim), ("embed", "kv_heads", "kv"),
                           ("kv_heads", "kv"), "k")
        self.value = project((c.kv_heads, c.head_dim), ("embed", "kv_heads", "kv"),
                             ("kv_heads", "kv"), "v")
        self.out = project(c.d_model, ("heads", "kv", "embed"), ("embed",), "o", n_in=2)
        if c.qk_norm:
            self.query_norm = layer_norm(c)
            self.key_norm = layer_norm(c)
        heads = ((c.num_heads, c.head_dim), ("heads", "kv"))
        kv_heads = ((c.kv_heads, c.head_dim), ("kv_heads", "kv"))
        embed = ((c.d_model,), ("embed",))
        for name, (ins, in_names), (outs, out_names) in (
                ("query", embed, heads), ("key", embed, kv_heads), ("value", embed, kv_heads),
                ("out", heads, embed)):
            if lora.targets(c, name):  # `config.lora_targets`: an adapter beside the kernel
                setattr(self, name + lora.SUFFIX, lora.LoRA(c, ins, outs, in_names, out_names))

    def _rotate(self, x_BTHK: jnp.ndarray, positions_BT: Optional[jnp.ndarray],
                inv_freq=None) -> jnp.ndarray:
        """RoPE (if `rotary`) with `inv_freq` (K/2,), default this layer kind's."""
        if not self.rotary:
            return x_BTHK
        if positions_BT is None:
            positions_BT = jnp.arange(x_BTHK.shape[1])[None, :]
        if inv_freq is None:
            inv_freq = layer_frequencies(self.config, self.local)
        return apply_rope(x_BTHK, positions_BT, None, self.config.rope, inv_freq=inv_freq)

    def _head_norm(self, norm, x_BTHK: jnp.ndarray) -> jnp.ndarray:
        """Per-head norm over K (`config.qk_norm`), in the projection's dtype."""
        return norm(x_BTHK).astype(x_BTHK.dtype) if self.config.qk_norm else x_BTHK

    def _layout(self, x_BTHK: jnp.ndarray) -> jnp.ndarray:
        """(B, T, H, K) as the attention implementation reads it (`kv_length_axis`)."""
        return x_BTHK if self.config.attention_impl == "jax" else _heads_major(x_BTHK)

    def kv(self, inputs_BSD: jnp.ndarray, positions_BS: Optional[jnp.ndarray] = None,
           inv_freq=None) -> KV:
        """Project keys and values: (B, S, D) -> KV of (B, G, S, K) ("einsum") or
        (B, S, G, K) ("jax"; see `kv_length_axis`).

        Keys are rotated (if `rotary`) by `positions_BS`, default 0..S-1, with
        `inv_freq` (default: this layer kind's frequencies).
        """
        # checkpoint_name: what config.remat="save_proj" keeps (identity otherwise).
        key_BSGK = checkpoint_name(lora.apply(self, "key", inputs_BSD), "key_proj")
        value_BSGK = checkpoint_name(lora.apply(self, "value", inputs_BSD), "value_proj")
        if self.config.qk_norm:
            key_BSGK = self._head_norm(self.key_norm, key_BSGK)
        return KV(self._layout(self._rotate(key_BSGK, positions_BS, inv_freq)),
                  self._layout(value_BSGK))

    def __call__(
        self,
        inputs_q_BTD: jnp.ndarray,
        kv: KV,
        mask=None,
        *,
        positions_BT: Optional[jnp.ndarray] = None,
        deterministic: bool = True,
        inv_freq=None,
        heads: Optional[Callable[[jnp.ndarray], jnp.ndarray]] = None,
    ) -> jnp.ndarray:
        """Attend from `inputs_q_BTD` to `kv`: (B, T, D) -> (B, T, D).

        `heads`: instead of `kv` and `mask`, the product itself, rotated queries
        (B, T, H, K) -> outputs (B, T, H, K) before the output projection (a serving
        step's paged read, `paged_kv.heads`; no weights are sown).

        `mask`: None, a dense boolean (B|1, 1, T, S), a `MaskSpec` or a
        `LayerKindMask`; structured masks run blockwise when the implementation
        (`config.attention_impl`, "auto" resolved at trace time) is "blockwise",
        and are densified for the dense path.

        Queries are rotated (if `rotary`) by `positions_BT`, default 0..T-1
        (with `inv_freq`, default this layer kind's frequencies).

        The (B, H, T, S) attention weights are sown into the `intermediates`
        collection as `attention_weights`: pass `mutable="intermediates"` to
        `apply` to get them (see `model.attention_weights`).

        Shared keys: `kv` may have fewer rows than the queries, B / r (the beams
        or samples of one source share its memory: query rows b * r .. b * r + r - 1
        read kv row b). The r rows' queries are then attended as r * T queries
        of one row, so each key and value is read once for all of them (a
        matrix product, not r vector products over r copies); `mask` must then
        be None or (1|B/r, 1, 1, S).
        """
        query_BTHK = checkpoint_name(lora.apply(self, "query", inputs_q_BTD), "query_proj")
        if self.config.qk_norm:
            query_BTHK = self._head_norm(self.query_norm, query_BTHK)
        query_BTHK = self._rotate(query_BTHK, positions_BT, inv_freq)
        if heads is not None:
            return checkpoint_name(lora.apply(self, "out", heads(query_BTHK)), "out_proj")
        batch, num_queries = query_BTHK.shape[:2]
        kv_batch = (kv.key[0] if isinstance(kv.key, tuple) else kv.key).shape[0]
        if kv_batch == batch:
            return self._attend(query_BTHK, kv, mask, deterministic, 1)
        rows = shared_rows(batch, kv_batch, mask)
        out_BTD = self._attend(query_BTHK.reshape((kv_batch, rows * num_queries)
                                                  + query_BTHK.shape[2:]),
                               kv, mask, deterministic, rows)
        return out_BTD.reshape((batch, num_queries) + out_BTD.shape[2:])

    def _attend(self, query_BTHK, kv: KV, mask, deterministic: bool, rows: int) -> jnp.ndarray:
        """`__call__` after the query projection (`rows` > 1: queries of shared keys
        folded into the T axis; the sown weights are unfolded)."""
        c = self.config
        axis = kv_length_axis(c)
        num_keys = sum(k.shape[axis] for k in (kv.key if isinstance(kv.key, tuple) else (kv.key,)))
        num_queries = query_BTHK.shape[1]
        if c.attention_impl == "jax":  # (B, T, H, K); takes G < H kv heads
            key, value = (jnp.concatenate(x, axis=1) if isinstance(x, tuple) else x
                          for x in kv)  # a cache in segments (past, chunk): one array
            args = jax_nn_mask_arguments(mask) if isinstance(mask, MaskSpec) else None
            if args is None:
                args = {"mask": densified(mask, num_queries, num_keys)}
            out_BTHK = jax.nn.dot_product_attention(query_BTHK, key, value,
                                                    scale=c.query_scale, **args)
            return checkpoint_name(lora.apply(self, "out", out_BTHK), "out_proj")
        structured = isinstance(mask, (MaskSpec, LayerKindMask)) or mask is None
        in_parts = isinstance(kv.key, tuple)  # a cached step: the dense path
        if structured and not in_parts:
            spec = mask.global_ if isinstance(mask, LayerKindMask) else mask
            impl = resolved_attention_impl(c, max(num_queries, num_keys), spec,
                                           shape=(num_queries, num_keys))
            if impl == "splash" and not isinstance(mask, LayerKindMask):
                out_BHTK = splash_attention(_heads_major(query_BTHK), kv.key, kv.value, mask,
                                            scale=c.query_scale,
                                            logit_softcap=c.attn_logit_softcapping)
                return checkpoint_name(lora.apply(self, "out", _heads_major(out_BHTK)),
                                       "out_proj")
            if impl == "cudnn" and not isinstance(mask, LayerKindMask):
                out_BTHK = jax.nn.dot_product_attention(
                    query_BTHK, _heads_major(kv.key), _heads_major(kv.value),
                    scale=c.query_scale, implementation="cudnn", **jax_nn_mask_arguments(mask))
                return checkpoint_name(lora.apply(self, "out", out_BTHK), "out_proj")
            if impl in ("blockwise", "cudnn", "splash"):
                out_BHTK = structured_attention(_heads_major(query_BTHK), kv.key, kv.value,
                                                mask, c)
                return checkpoint_name(lora.apply(self, "out", _heads_major(out_BHTK)), "out_proj")
        rate = c.attention_dropout
        dropout_rng = None if deterministic or rate == 0.0 else self.make_rng("dropout")
        out_BHTK, weights_BHTS = dot_product_attention(
            _heads_major(query_BTHK), kv.key, kv.value,
            densified(mask, num_queries, num_keys), dropout_rate=rate,
            dropout_rng=dropout_rng, dropout_mask=tuning.dropout_mask(c),
            scale=c.query_scale, softcap=c.attn_logit_softcapping,
            query_block=query_block_length(c.num_heads, num_queries, num_keys)
            if tuning.query_blocks(c) and deterministic and not in_parts else None)
        if rows > 1:  # (B/r, H, r*T, S) -> (B, H, T, S)
            b, h, rt, keys = weights_BHTS.shape
            weights_BHTS = weights_BHTS.reshape(b, h, rows, rt // rows, keys).transpose(
                0, 2, 1, 3, 4).reshape(b * rows, h, rt // rows, keys)
        self.sow("intermediates", "attention_weights", weights_BHTS)
        return checkpoint_name(lora.apply(self, "out", _heads_major(out_BHTK)), "out_proj")

"""Building blocks: embeddings and positions, feed-forward, encoder/decoder layers.

Each layer applies its sublayers through `_residual`, the one place that knows
where the norms sit (`config.norm`): Post-LN, x = LN(x + f(x)); Pre-LN,
x = x + f(LN(x)); "sandwich", x = x + LN'(f(LN(x))) (Gemma 2/3); and
"post_sublayer", x = x + LN(f(x)) (OLMo 2).
`layer_norm` (`norms.py`) builds the configured norm (LayerNorm, RMSNorm or
Gemma's (1 + w) RMSNorm) under the same parameter names.

A layer is local (`local=True`: a sliding-window layer of
`config.attention_pattern`) or global; the caller hands each layer the mask of
its kind, and a local layer rotates with the local RoPE frequencies.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jaxformer.backends import qmatmul
from jaxformer.nn.attention import KV, MultiHeadAttention, dense_init, kv_length_axis
from jaxformer.config import TransformerConfig
from jaxformer.nn import checks, lora, tuning
from jaxformer.nn.axes import ACTIVATION_BTD, constrain, logical
from jaxformer.nn.norms import layer_norm
from jaxformer.nn import kv_quant, quant, quant_dense
from jaxformer.nn.kv_quant import QuantKV
from jaxformer.nn import paged_kv
from jaxformer.nn.paged_kv import PagedKV
from jaxformer.nn.quant_dense import dense

__all__ = ["DecoderLayer", "EncoderLayer", "FeedForward", "PositionEmbedding", "TokenEmbedding",
           "activation_fn", "layer_norm", "ring_write", "sinusoidal_table"]


def sinusoidal_table(max_len: int, d_model: int) -> np.ndarray:
    """(max_len, D): PE[p, 2i] = sin(p / 10000^(2i/D)), PE[p, 2i+1] = cos(same).

    The seeds' formula; an odd D simply has one more sine than cosine column.
    """
    position = np.arange(max_len, dtype=np.float32)[:, None]
    div_term = np.exp(np.arange(0, d_model, 2, dtype=np.float32) * (-math.log(10000.0) / d_model))
    table = np.zeros((max_len, d_model), dtype=np.float32)
    table[:, 0::2] = np.sin(position * div_term)
    table[:, 1::2] = np.cos(position * div_term[: d_model // 2])
    return table


def activation_fn(name: str) -> Callable[[jnp.ndarray], jnp.ndarray]:
    return {"relu": jax.nn.relu,
            "gelu": functools.partial(jax.nn.gelu, approximate=False),
            "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
            "silu": jax.nn.silu}[name]


class TokenEmbedding(nn.Module):
    """Token ids -> vectors, and (tied output) vectors -> logits.

    Parameter: `embedding` (V, D), or with `config.quant_format("embed")` its
    quantized leaves `embedding_q`, `scale` (+ `offset`) along D (`nn.quant_dense`).
    Out-of-range ids look up NaN rows (JAX gathers would otherwise clamp them
    silently to a valid id); eagerly they are refused before this point by
    `checks.check_tokens`.
    """

    vocab_size: int
    config: TransformerConfig

    def setup(self):
        c = self.config
        stddev = c.d_model ** -0.5 if c.scale_embeddings else 1.0
        init, shape = nn.initializers.normal(stddev), (self.vocab_size, c.d_model)
        self.fmt = c.quant_format("embed")  # None: a float table
        if self.fmt is not None:
            self.fmt = quant_dense.module_layout(self, self.fmt, c.quant_layouts, "embedding")
        if self.fmt is None:
            self.embedding = self.param("embedding", logical(init, ("vocab", "embed")),
                                        shape, c.params_dtype)
        else:  # embedding_q (V, D or D/2), scale (V) or (V, D/block) (+ offset)
            self.table = quant_dense.quantized_param(self, "embedding", self.fmt, shape, 1,
                                                     c.quant_block, ("vocab", "embed"), init)

    def __call__(self, tokens_BT: jnp.ndarray) -> jnp.ndarray:
        """(B, T) ids -> (B, T, D), times sqrt(D) if `config.scale_embeddings`."""
        ids = jnp.where(tokens_BT < 0, self.vocab_size, tokens_BT)  # negative ids would wrap
        c = self.config
        if self.fmt is None:
            x_BTD = jnp.take(self.embedding, ids, axis=0, mode="fill", fill_value=jnp.nan)
        else:  # only the rows looked up are dequantized; a NaN scale marks a bad id
            rows = {part: jnp.take(value, ids, axis=0, mode="fill", fill_value=jnp.nan
                                   if jnp.issubdtype(value.dtype, jnp.floating) else 0)
                    for part, value in self.table.items()}
            x_BTD = quant.dequantize(rows, self.fmt, c.quant_block, -1).astype(
                c.params_dtype)
        if c.scale_embeddings and c.embedding_scale_dtype == "compute":
            # Gemma (Hugging Face): the normaliser rounded to the compute dtype.
            return x_BTD.astype(c.compute_dtype) * jnp.asarray(math.sqrt(c.d_model),
                                                               c.compute_dtype)
        if c.scale_embeddings:
            x_BTD = x_BTD * math.sqrt(c.d_model)
        return x_BTD.astype(c.compute_dtype)

    def attend(self, x_BTD: jnp.ndarray) -> jnp.ndarray:
        """(B, T, D) -> (B, T, V) logits against the embedding matrix (tied output)."""
        if self.fmt is None:
            return jnp.einsum("btd,vd->btv", x_BTD, self.embedding.astype(x_BTD.dtype))
        c = self.config

        def plain(x, parts):  # (..., D) -> (..., V)
            if self.fmt == "int8":  # x (q s)^T = (x q^T) s: scale the output channels
                return jnp.einsum("...d,vd->...v", x, parts["q"].astype(x.dtype)
                                  ) * parts["scale"].astype(x.dtype)
            table = quant.dequantize(parts, self.fmt, c.quant_block, -1)
            return jnp.einsum("...d,vd->...v", x, table.astype(c.params_dtype).astype(x.dtype))

        if x_BTD.dtype == jnp.float32 and jnp.dtype(c.params_dtype) == jnp.float32 and \
                qmatmul.enabled():  # a tuned process: the CPU kernel (`plain` elsewhere)
            rows = x_BTD.reshape(-1, x_BTD.shape[-1])
            logits = qmatmul.dot(rows, self.table, self.fmt, c.quant_block, plain,
                                 transposed=True)
            return logits.reshape(x_BTD.shape[:-1] + (self.vocab_size,))
        return plain(x_BTD, self.table)


class PositionEmbedding(nn.Module):
    """Adds positions to (B, T, D) inputs, then embedding dropout.

    "sinusoidal" is a constant table; "learned" has a parameter `embedding`
    (length, D); "fixed" too, but it is not trained (a checkpoint's table);
    "none" adds nothing (RoPE models rotate inside attention). `length` is the
    stack's `config.encoder_len` / `config.decoder_len`.
    `positions_BT` (default 0..T-1) lets a decode step or a left-padded prompt
    put each token at its own position.
    """

    kind: str
    config: TransformerConfig
    length: Optional[int] = None  # None: config.max_len

    @nn.compact
    def __call__(self, x_BTD: jnp.ndarray, positions_BT: Optional[jnp.ndarray] = None,
                 *, deterministic: bool = True) -> jnp.ndarray:
        c = self.config
        if positions_BT is None:
            positions_BT = jnp.arange(x_BTD.shape[1])[None, :]
        if self.kind == "none":
            x_BTD = tuning.dropout(c, c.embedding_dropout)(x_BTD, deterministic=deterministic)
            return constrain(x_BTD, ACTIVATION_BTD)
        length = c.max_len if self.length is None else self.length
        if self.kind == "learned":
            table = self.param("embedding", logical(nn.initializers.normal(0.02),
                                                    ("length", "embed")),
                               (length, c.d_model), c.params_dtype)
        elif self.kind == "fixed":
            table = jax.lax.stop_gradient(self.param(
                "embedding", logical(lambda _, shape, dtype: jnp.asarray(
                    sinusoidal_table(*shape), dtype), ("length", "embed")),
                (length, c.d_model), c.params_dtype))
        else:
            table = jnp.asarray(sinusoidal_table(length, c.d_model))
        x_BTD = x_BTD + jnp.take(table, positions_BT, axis=0).astype(x_BTD.dtype)
        x_BTD = tuning.dropout(c, c.embedding_dropout)(x_BTD, deterministic=deterministic)
        return constrain(x_BTD, ACTIVATION_BTD)


class FeedForward(nn.Module):
    """Position-wise FFN, (B, T, D) -> (B, T, F) -> (B, T, D).

    Plain: wo(act(wi(x))). Gated (`config.gated_ffn`, SwiGLU / GeGLU):
    wo(act(gate(x)) * wi(x)), i.e. down(act(gate(x)) * up(x)).
    Biases on every projection iff `config.ffn_bias`.
    """

    config: TransformerConfig

    @nn.compact
    def __call__(self, x_BTD: jnp.ndarray, *, deterministic: bool = True) -> jnp.ndarray:
        c = self.config
        def up(name):  # (D, F): up and gate projections, float or quantized
            return dense(c, "layers", c.d_ff, ("embed", "mlp"), ("mlp",), use_bias=c.ffn_bias,
                         dtype=c.compute_dtype, kernel_init=dense_init(), name=name)

        down = dense(c, "layers", c.d_model, ("mlp", "embed"), ("embed",), use_bias=c.ffn_bias,
                     dtype=c.compute_dtype, kernel_init=dense_init(), name="wo")

        def project(dense_, x, ins, outs):  # + its LoRA adapter if `config.lora_targets` it
            y = dense_(x)
            if lora.targets(c, dense_.name):
                y = y + lora.LoRA(c, (x.shape[-1],), (y.shape[-1],), ins, outs,
                                  name=dense_.name + lora.SUFFIX)(x).astype(y.dtype)
            return y

        mlp_in = (("embed",), ("mlp",))
        # checkpoint_name: what config.remat="save_proj" keeps (identity otherwise).
        if c.gated_ffn:
            gate_BTF = checkpoint_name(project(up("gate"), x_BTD, *mlp_in), "ffn_gate")
            up_BTF = checkpoint_name(project(up("wi"), x_BTD, *mlp_in), "ffn_wi")
            h_BTF = activation_fn(c.activation)(gate_BTF) * up_BTF
        else:
            h_BTF = activation_fn(c.activation)(
                checkpoint_name(project(up("wi"), x_BTD, *mlp_in), "ffn_wi"))
        h_BTF = tuning.dropout(c, c.ffn_dropout)(h_BTF, deterministic=deterministic)
        return checkpoint_name(project(down, h_BTF, ("mlp",), ("embed",)), "ffn_wo")


def _residual(config: TransformerConfig, norm: nn.Module, dropout: nn.Module,
              sublayer: Callable, x_BTD: jnp.ndarray, deterministic: bool,
              post_norm: Optional[nn.Module] = None):
    """Apply `sublayer` with residual and LayerNorm in the configured placement.

    `sublayer` maps (B, T, D) to ((B, T, D), aux); aux (a new cache) is passed
    through. `post_norm`: the second norm of "sandwich".
    """
    if config.norm in ("pre", "sandwich"):
        out_BTD, aux = sublayer(norm(x_BTD))
        if config.norm == "sandwich":
            out_BTD = post_norm(out_BTD)
        out_BTD = dropout(out_BTD, deterministic=deterministic)
        return (x_BTD + out_BTD).astype(x_BTD.dtype), aux
    out_BTD, aux = sublayer(x_BTD)
    if config.norm == "post_sublayer":
        out_BTD = dropout(norm(out_BTD), deterministic=deterministic)
        return (x_BTD + out_BTD).astype(x_BTD.dtype), aux
    # The residual stream keeps its dtype (a no-op unless precision="mixed", whose
    # norms compute and return float32): a scanned layer's carry must not change type.
    return norm(x_BTD + dropout(out_BTD, deterministic=deterministic)).astype(x_BTD.dtype), aux


def ring_write(ring: jnp.ndarray, new: jnp.ndarray, first_slot: jnp.ndarray,
               axis: int) -> jnp.ndarray:
    """A ring of R slots along `axis` after writing the T entries of `new` at slots
    first_slot.. (slot s at ring position s mod R; only the newest R survive)."""
    expected = list(ring.shape)
    expected[axis] = None
    checks.check_shape("new", new, tuple(expected), f"(the ring's shape, any size on axis {axis})")
    ring_len, count = ring.shape[axis], new.shape[axis]
    if count == 1:  # one decode step: a single slice write
        start = [0] * ring.ndim
        start[axis] = jnp.remainder(first_slot, ring_len)
        return jax.lax.dynamic_update_slice(ring, new, start)
    last = first_slot + count - 1
    newest_R = last - jnp.remainder(last - jnp.arange(ring_len), ring_len)  # slot per position
    taken = jnp.take(new, jnp.clip(newest_R - first_slot, 0, count - 1), axis=axis)
    shape = [1] * ring.ndim
    shape[axis] = ring_len
    return jnp.where((newest_R >= first_slot).reshape(shape), taken, ring)


class EncoderLayer(nn.Module):
    """Self-attention + FFN, two Add & Norm. Parameters: self_attn, self_attn_norm, ffn, ffn_norm
    (+ self_attn_post_norm, ffn_post_norm for norm="sandwich")."""

    config: TransformerConfig
    local: bool = False  # a sliding-window layer (its mask comes from the caller)

    def setup(self):
        c = self.config
        self.self_attn = MultiHeadAttention(c, rotary=c.rope != "none", local=self.local)
        self.ffn = FeedForward(c)
        self.self_attn_norm = layer_norm(c)
        self.ffn_norm = layer_norm(c)
        if c.norm == "sandwich":
            self.self_attn_post_norm = layer_norm(c)
            self.ffn_post_norm = layer_norm(c)
        self.dropout = tuning.dropout(c, c.residual_dropout)

    def __call__(self, x_BSD: jnp.ndarray, mask: Optional[jnp.ndarray], *,
                 deterministic: bool = True, inv_freq=None) -> jnp.ndarray:
        """(B, S, D), mask (B|1, 1, S|1, S) -> (B, S, D). `inv_freq`: RoPE frequencies
        (default: this layer kind's)."""
        sandwich = self.config.norm == "sandwich"

        def attend(h):
            return self.self_attn(h, self.self_attn.kv(h, inv_freq=inv_freq), mask,
                                  deterministic=deterministic, inv_freq=inv_freq), None

        x_BSD, _ = _residual(self.config, self.self_attn_norm, self.dropout, attend, x_BSD,
                             deterministic, self.self_attn_post_norm if sandwich else None)
        x_BSD, _ = _residual(self.config, self.ffn_norm, self.dropout,
                             lambda h: (self.ffn(h, deterministic=deterministic), None),
                             x_BSD, deterministic, self.ffn_post_norm if sandwich else None)
        return constrain(x_BSD, ACTIVATION_BTD)


class DecoderLayer(nn.Module):
    """Masked self-attention (+ cross-attention) + FFN, each with Add & Norm.

    Parameters: self_attn, self_attn_norm, cross_attn and cross_attn_norm (if
    `cross_attention`), ffn, ffn_norm; norm="sandwich" adds `*_post_norm` of each.
    With `cross_attention=False` this is the decoder-only LM layer of seed 004.
    """

    config: TransformerConfig
    cross_attention: bool = True
    local: bool = False  # a sliding-window layer (its mask comes from the caller)

    def setup(self):
        c = self.config
        sandwich = c.norm == "sandwich"
        self.self_attn = MultiHeadAttention(c, rotary=c.rope != "none", local=self.local)
        self.self_attn_norm = layer_norm(c)
        if sandwich:
            self.self_attn_post_norm = layer_norm(c)
        if self.cross_attention:
            self.cross_attn = MultiHeadAttention(c)
            self.cross_attn_norm = layer_norm(c)
            if sandwich:
                self.cross_attn_post_norm = layer_norm(c)
        self.ffn = FeedForward(c)
        self.ffn_norm = layer_norm(c)
        if sandwich:
            self.ffn_post_norm = layer_norm(c)
        self.dropout = tuning.dropout(c, c.residual_dropout)

    def cross_kv(self, memory_BSD: jnp.ndarray) -> KV:
        """Project the encoder memory once; reuse it for every decoder call."""
        return self.cross_attn.kv(memory_BSD)

    def __call__(
        self,
        y_BTD: jnp.ndarray,
        self_mask: Optional[jnp.ndarray],
        cross_kv: Optional[KV] = None,
        cross_mask: Optional[jnp.ndarray] = None,
        *,
        cache: Optional[KV] = None,
        cache_index: Optional[jnp.ndarray] = None,
        past: Optional[KV] = None,
        positions_BT: Optional[jnp.ndarray] = None,
        deterministic: bool = True,
        inv_freq=None,
        ring_index: Optional[jnp.ndarray] = None,
    ) -> tuple[jnp.ndarray, Optional[KV]]:
        """One decoder layer.

        Args:
          y_BTD: decoder inputs.
          self_mask: (B|1, 1, T, T) without a cache, (B|1, 1, T, T_max) with one.
          cross_kv: `cross_kv(memory)` (S keys); required iff `cross_attention`.
          cross_mask: (B|1, 1, T|1, S).
          cache: keys/values of earlier positions, each (B, G, T_max, K) (or
            (B, T_max, G, K), as `attention.kv_length_axis` says). The
            new keys/values are written at `cache_index` (a scalar) and the
            queries attend over the whole cache, so `self_mask` must hide the
            slots not yet written.
          past: keys/values (B, G, P, K) of the P slots before the cache's first
            (read, never written: a decode cache kept in chunks); the queries
            attend over past then cache, and `self_mask` spans P + T_max slots.
          positions_BT: (B|1, T) positions of the inputs for RoPE (default
            0..T-1); cached keys were rotated by theirs when written.
          inv_freq: RoPE frequencies (K/2,) (default: this layer kind's; a scanned
            stack of mixed kinds passes each layer's).
            A `paged_kv.PagedKV` cache is a page pool instead: the queries attend
            over [the rows' pages, the new keys] (`self_mask` spans M * Z + T) and
            only the new keys/values are written to their pages.
          ring_index: with `cache`, the cache is a sliding-window ring (a local
            layer; `decode.cache`) and this is the absolute slot of the first new
            token: the queries attend over [ring, new keys] (`self_mask` spans
            R + T), then the new keys are written at their slots mod R.
        Returns:
          (y_BTD, the updated cache or None).
        """

        post = (lambda name: getattr(self, name)) if self.config.norm == "sandwich" else (
            lambda name: None)

        def self_attend(h_BTD):
            kv = self.self_attn.kv(h_BTD, positions_BT, inv_freq)
            axis = kv_length_axis(self.config)
            # An int8 cache (`kv_quant.QuantKV`) stores the new keys quantized and its
            # earlier slots are read dequantized; a float cache is a `KV` of the compute dtype.
            quantized = isinstance(cache.pool if isinstance(cache, PagedKV) else cache, QuantKV)
            stored = kv_quant.quantize_kv(kv) if quantized else kv

            def readable(c):
                return kv_quant.dequantize_kv(c, kv.key.dtype) if quantized else c

            if isinstance(cache, PagedKV):  # a serving step: write new slots, read pages
                # Written first, read after (the new slots are masked in the pages: they
                # are read exact from `kv`): the read depends on the write, so XLA updates
                # the donated pool in place instead of copying it to keep the read's input.
                updated = cache.with_pool(paged_kv.write(cache, stored))

                def seen():
                    pages = readable(paged_kv.read(updated))
                    return KV((pages.key, kv.key), (pages.value, kv.value))

                # On a tuned CPU the pool is read in place by a kernel (`paged_kv.heads`),
                # which reads every position of a row: a local layer's band needs the mask.
                heads = None if self.local else paged_kv.heads(updated, seen, self_mask,
                                                               self.config)
                out = self.self_attn(h_BTD, None if heads else seen(), self_mask,
                                     positions_BT=positions_BT, deterministic=deterministic,
                                     inv_freq=inv_freq, heads=heads)
                return out, updated
            if cache is not None and ring_index is not None:
                ring = readable(cache)
                seen = KV((ring.key, kv.key), (ring.value, kv.value))
                out = self.self_attn(h_BTD, seen, self_mask, positions_BT=positions_BT,
                                     deterministic=deterministic, inv_freq=inv_freq)
                return out, type(cache)(*(ring_write(old, new.astype(old.dtype), ring_index, axis)
                                          for old, new in zip(cache, stored)))
            written = None
            if cache is not None:
                def write(old, new):
                    start = [0] * old.ndim
                    start[axis] = cache_index
                    return jax.lax.dynamic_update_slice(old, new.astype(old.dtype), start)

                written = type(cache)(*(write(old, new) for old, new in zip(cache, stored)))
                # The new slots are read as computed (not rounded: a prefill attends over
                # its exact keys), the earlier ones as the cache holds them.
                kv = KV(*(write(old, new) for old, new in zip(readable(written), kv))
                        ) if quantized else written
            if past is not None:
                past_kv = readable(past)
                kv = KV((past_kv.key, kv.key), (past_kv.value, kv.value))
            out = self.self_attn(h_BTD, kv, self_mask, positions_BT=positions_BT,
                                 deterministic=deterministic, inv_freq=inv_freq)
            return out, written

        y_BTD, new_cache = _residual(self.config, self.self_attn_norm, self.dropout,
                                     self_attend, y_BTD, deterministic,
                                     post("self_attn_post_norm"))
        if self.cross_attention:
            y_BTD, _ = _residual(
                self.config, self.cross_attn_norm, self.dropout,
                lambda h: (self.cross_attn(h, cross_kv, cross_mask,
                                           deterministic=deterministic), None),
                y_BTD, deterministic, post("cross_attn_post_norm"))
        y_BTD, _ = _residual(self.config, self.ffn_norm, self.dropout,
                             lambda h: (self.ffn(h, deterministic=deterministic), None),
                             y_BTD, deterministic, post("ffn_post_norm"))
        return constrain(y_BTD, ACTIVATION_BTD), new_cache

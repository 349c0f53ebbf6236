"""Stacks and models: Encoder, Decoder, Transformer (encoder-decoder), DecoderOnlyLM.

Parameter pytree of a `Transformer` (list-of-layers layout, names mirror modules)::

    src_embed/embedding                  (V_src, D)    shared with tgt if share_embeddings
    tgt_embed/embedding                  (V_tgt, D)
    encoder/positions/embedding          (encoder_len, D)  only for learned/fixed positions
    encoder/layers_{i}/self_attn/query/{kernel (D,H,K), bias (H,K)}
    encoder/layers_{i}/self_attn/{key,value}/{kernel (D,G,K), bias (G,K)}   G = kv heads
    encoder/layers_{i}/self_attn/out/{kernel (H,K,D), bias (D,)}
    encoder/layers_{i}/ffn/{wi (D,F), wo (F,D)}/{kernel, bias}   + gate (D,F) if gated_ffn
    encoder/layers_{i}/{self_attn_norm, ffn_norm}/{scale, bias}  (RMSNorm: scale only)
    encoder/final_norm/{scale, bias}     if config.use_final_norm
    decoder/layers_{i}/{self_attn, cross_attn, ffn, *_norm}/...
    decoder/final_norm/...
    decoder/out_proj/{kernel (D,V), bias (V,)}   unless tie_output_embedding
    decoder/logits_bias (V,)             if tie_output_embedding and tied_output_bias

Biases exist iff attention_bias (per projection: attention_biases) / ffn_bias / output_bias.

Layers are a list (`layers_0`, `layers_1`, ...) by default: it mirrors torch
state dicts one-to-one (weight import is a rename). With `config.scan_layers`
each stack is one scanned layer, `encoder/layers/...` with a leading (L, ...)
axis on every leaf, so compile time stays flat in depth (`layer_stack`);
`stacking` converts between the two layouts exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer.nn import checks, stack as layer_stack, stacking
from jaxformer.nn.attention import KV, dense_init
from jaxformer.nn.attention_select import uses_mask_spec
from jaxformer.nn.mask_structure import MaskSpec, check_spec
from jaxformer.config import TransformerConfig
from jaxformer.nn.layers import (DecoderLayer, EncoderLayer, PositionEmbedding, TokenEmbedding,
                              layer_norm)
from jaxformer.nn.masks import causal_mask, decoder_self_mask, padding_mask, sliding_window_mask
from jaxformer.nn.axes import logical
from jaxformer.nn.quant_dense import dense


class Encoder(nn.Module):
    """Token ids (B, S) -- or already-embedded inputs (B, S, D) -- to memory (B, S, D)."""

    config: TransformerConfig
    embed: Optional[TokenEmbedding] = None

    def setup(self):
        c = self.config
        self.positions = PositionEmbedding(c.encoder_positions, c, c.encoder_len)
        if layer_stack.uses_blocks(c):
            self.layers = layer_stack.encoder_stack(c, c.num_encoder_layers)
        else:
            self.layers = [EncoderLayer(c, local=c.layer_is_local(i))
                           for i in range(c.num_encoder_layers)]
        if c.use_final_norm:
            self.final_norm = layer_norm(c)

    def __call__(self, src: jnp.ndarray, mask: Optional[jnp.ndarray], *,
                 deterministic: bool = True) -> jnp.ndarray:
        if jnp.issubdtype(src.dtype, jnp.integer):
            x_BSD = self.embed(src)
        else:  # continuous sources (audio features, patches): positions only
            x_BSD = src.astype(self.config.compute_dtype)
        x_BSD = self.positions(x_BSD, deterministic=deterministic)
        c = self.config
        length = jnp.arange(x_BSD.shape[1])
        local_mask = local_attention_mask(c, mask, length, length)
        if layer_stack.uses_blocks(c):
            x_BSD = layer_stack.run_encoder_stack(
                self.layers, x_BSD, mask, deterministic, local_mask,
                layer_stack.scanned_flags(c, c.num_encoder_layers))
        else:
            for i, layer in enumerate(self.layers):
                x_BSD = layer(x_BSD, local_mask if c.layer_is_local(i) else mask,
                              deterministic=deterministic)
        if self.config.use_final_norm:
            x_BSD = self.final_norm(x_BSD)
        return x_BSD


class Decoder(nn.Module):
    """Target ids (B, T) to logits (B, T, V); cross-attends to memory if `cross_attention`."""

    config: TransformerConfig
    embed: TokenEmbedding
    cross_attention: bool = True

    def setup(self):
        c = self.config
        self.positions = PositionEmbedding(c.decoder_positions, c, c.decoder_len)
        if layer_stack.uses_blocks(c):
            self.layers = layer_stack.decoder_stack(c, c.num_decoder_layers,
                                                    self.cross_attention)
        else:
            self.layers = [DecoderLayer(c, cross_attention=self.cross_attention,
                                        local=c.layer_is_local(i))
                           for i in range(c.num_decoder_layers)]
        if c.use_final_norm:
            self.final_norm = layer_norm(c)
        if c.tie_output_embedding and c.tied_output_bias:
            self.logits_bias = self.param("logits_bias", logical(nn.initializers.zeros,
                                                                 ("vocab",)),
                                          (c.tgt_vocab_size,), c.params_dtype)
        if not c.tie_output_embedding:
            # norm_dtype: logits are computed in float32 under precision="mixed".
            self.out_proj = dense(c, "embed", c.tgt_vocab_size, ("embed", "vocab"), ("vocab",),
                                  use_bias=c.output_bias, dtype=c.norm_dtype,
                                  kernel_init=dense_init())

    def cross_kv(self, memory_BSD: jnp.ndarray) -> tuple[KV, ...]:
        """Each layer's cross-attention keys/values of the memory, computed once."""
        _no_scanned_decoding(self.config)
        return tuple(layer.cross_kv(memory_BSD) for layer in self.layers)

    def __call__(
        self,
        tgt_BT: jnp.ndarray,
        self_mask: Optional[jnp.ndarray],
        cross_kvs: Optional[Sequence[KV]] = None,
        cross_mask: Optional[jnp.ndarray] = None,
        *,
        positions_BT: Optional[jnp.ndarray] = None,
        caches: Optional[Sequence[KV]] = None,
        cache_index: Optional[jnp.ndarray] = None,
        past_kvs: Optional[Sequence[KV]] = None,
        ring_mask: Optional[jnp.ndarray] = None,
        ring_index: Optional[jnp.ndarray] = None,
        deterministic: bool = True,
        hidden: bool = False,
    ) -> tuple[jnp.ndarray, Optional[tuple[KV, ...]]]:
        """Returns (logits (B, T, V) in float32, updated per-layer caches or None).

        Without `caches` this is the parallel (training) pass. With them, the
        T new tokens are written at `cache_index` of every layer's cache and
        attend over it, after `past_kvs` if given: see `DecoderLayer`. With `config.scan_layers`,
        `cross_kvs` is the memory (B, S, D) itself (each scanned layer projects
        it) and there are no caches (decoding runs `stacking.unscanned`).
        `hidden=True`: the final normed states (B, T, D) instead of the logits, for a
        caller that projects them itself (`output_logits`: a loss in chunks, a serving
        step that needs the logits of a few positions).
        A local layer's cache is a sliding-window ring (`decode.cache`): it attends
        with `ring_mask` and writes at the absolute slot `ring_index`.
        """
        c = self.config
        y_BTD = self.positions(self.embed(tgt_BT), positions_BT, deterministic=deterministic)
        local_mask = None
        if caches is None:
            slots = jnp.arange(tgt_BT.shape[1])
            local_mask = local_attention_mask(c, self_mask, slots, slots)
        new_caches = []
        if layer_stack.uses_blocks(self.config) and caches is None:
            y_BTD = layer_stack.run_decoder_stack(
                self.layers, y_BTD, self_mask, cross_kvs if self.cross_attention else None,
                cross_mask, positions_BT, deterministic, local_mask,
                layer_stack.scanned_flags(c, c.num_decoder_layers))
        else:
            if caches is not None and layer_stack.uses_blocks(self.config):
                raise ValueError("a scanned or rematted stack takes no KV cache: decode "
                                 "through jaxformer.nn.stacking.for_decoding(model, params) "
                                 "(the decoding entry points do)")
            for i, layer in enumerate(self.layers):
                ring = caches is not None and c.layer_is_local(i)
                if ring and ring_mask is None:
                    raise ValueError("a local layer's cache is a sliding-window ring: pass "
                                     "ring_mask and ring_index (decode.cache.cached_forward "
                                     "does)")
                mask = ring_mask if ring else (
                    local_mask if c.layer_is_local(i) else self_mask)
                y_BTD, cache = layer(
                    y_BTD, mask, cross_kvs[i] if self.cross_attention else None, cross_mask,
                    cache=None if caches is None else caches[i], cache_index=cache_index,
                    past=None if past_kvs is None or ring else past_kvs[i],
                    positions_BT=positions_BT, deterministic=deterministic,
                    ring_index=ring_index if ring else None)
                new_caches.append(cache)
        if self.config.use_final_norm:
            y_BTD = self.final_norm(y_BTD)
        new_caches = None if caches is None else tuple(new_caches)
        return (y_BTD if hidden else self.output_logits(y_BTD)), new_caches

    def output_logits(self, y_BTD: jnp.ndarray) -> jnp.ndarray:
        """The output projection of final (normed) hidden states (..., D) -> float32
        logits (..., V): tied or own kernel, bias, soft-capping."""
        if self.config.tie_output_embedding:
            logits_BTV = self.embed.attend(y_BTD.astype(self.config.norm_dtype))
            if self.config.tied_output_bias:
                logits_BTV = logits_BTV + self.logits_bias.astype(logits_BTV.dtype)
        else:
            logits_BTV = self.out_proj(y_BTD)
        logits_BTV = logits_BTV.astype(jnp.float32)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits_BTV = cap * jnp.tanh(logits_BTV / cap)
        return logits_BTV


def local_attention_mask(config: TransformerConfig, mask: Optional[jnp.ndarray],
                         query_slots_T: jnp.ndarray, key_slots_S: jnp.ndarray
                         ) -> Optional[jnp.ndarray]:
    """The sliding-window layers' mask: `mask` (the global layers') and the band
    |query slot - key slot| < config.sliding_window; None without local layers.
    A MaskSpec stays one (its `window`: slots are its index positions)."""
    if config.sliding_window is None:
        return None
    if isinstance(mask, MaskSpec):
        return mask.replace(window=config.sliding_window)
    band = sliding_window_mask(query_slots_T, key_slots_S, config.sliding_window)
    return band if mask is None else mask & band


def lm_mask_spec(tokens_BT: jnp.ndarray, pad_id: int) -> MaskSpec:
    """`decoder_self_mask` as structure: causal, and every query (segment 1) sees
    only the keys that are not PAD (segment 1; PAD keys are segment 0)."""
    spec = key_padding_spec(tokens_BT != pad_id, tokens_BT.shape[1])
    return MaskSpec(causal=True, q_segment_ids=spec.q_segment_ids,
                    kv_segment_ids=spec.kv_segment_ids)


def key_padding_spec(visible_BS: jnp.ndarray, num_queries: int) -> MaskSpec:
    """A (B, 1, 1, S) padding mask as structure, for `num_queries` queries: every query
    (segment 1) sees the keys marked visible (segment 1; hidden keys are segment 0)."""
    visible_BS = visible_BS.astype(jnp.int32)
    return MaskSpec(q_segment_ids=jnp.ones((visible_BS.shape[0], num_queries), jnp.int32),
                    kv_segment_ids=visible_BS)


def _no_scanned_decoding(config: TransformerConfig) -> None:
    if config.scan_layers:
        raise ValueError("a scanned stack has no per-layer cross-attention KVs: decode "
                         "through jaxformer.nn.stacking.for_decoding(model, params) (the "
                         "decoding entry points do)")


def _default_src_mask(src, pad_id: int) -> Optional[jnp.ndarray]:
    """PAD keys are hidden for token sources; embedded sources need an explicit mask."""
    return padding_mask(src, pad_id) if jnp.issubdtype(src.dtype, jnp.integer) else None


def _check_mask(name: str, mask, batch: int, queries: int, keys: int, heads: int) -> None:
    """`checks.check_mask` for dense masks, `mask_structure.check_spec` for a MaskSpec."""
    if isinstance(mask, MaskSpec):
        check_spec(mask, batch, queries, keys, name)
    else:
        checks.check_mask(name, mask, batch, queries, keys, heads=heads)


def check_variables_layout(config: TransformerConfig, variables) -> None:
    """ValueError naming the converter when `variables["params"]` hold the other layer
    layout than `config.scan_layers` (Flax's own error is a page of scope traces)."""
    params = variables.get("params") if isinstance(variables, Mapping) else None
    if isinstance(params, Mapping):
        stacking.check_layout(params, config.scan_layers, "variables['params']")


class Transformer(nn.Module):
    """The encoder-decoder Transformer of "Attention Is All You Need" (seed 001).

    Masks are boolean, True = may attend (see `jaxformer.nn.masks`), or MaskSpecs.
    When omitted they are derived from `config.pad_id`: the source mask hides PAD
    keys (B, 1, 1, S), the target mask is causal and hides PAD keys (B, 1, T, T)
    (causal only with `config.mask_decoder_pad=False`). Under attention_impl
    "blockwise" or "auto" these defaults are MaskSpecs (`key_padding_spec`,
    `lm_mask_spec`) for the encoder's self-attention, the decoder's self-attention
    and (in `__call__`) the cross-attention, so no (T, S) array is built and the
    blockwise path applies.

    An input stem (`stem`, any Flax module, e.g. `stems.ConvStem` over audio
    features) maps the raw source (B, S_in, C) to (B, S, D) before the encoder;
    its parameters live in the same tree, under "stem", and train with the rest.
    Masks and lengths then refer to the stem's output positions.
    """

    config: TransformerConfig
    stem: Optional[nn.Module] = None

    def apply(self, variables, *args, **kwargs):
        check_variables_layout(self.config, variables)
        return super().apply(variables, *args, **kwargs)

    def setup(self):
        c = self.config
        # An encoder of embedded inputs (config.encoder_input) owns no source table.
        self.src_embed = (TokenEmbedding(c.src_vocab_size, c)
                          if c.encoder_input == "tokens" else None)
        self.tgt_embed = self.src_embed if c.share_embeddings else TokenEmbedding(
            c.tgt_vocab_size, c)
        self.encoder = Encoder(c, embed=self.src_embed)
        self.decoder = Decoder(c, embed=self.tgt_embed)

    def encode(self, src: jnp.ndarray, src_mask: Optional[jnp.ndarray] = None, *,
               deterministic: bool = True) -> jnp.ndarray:
        """src: ids (B, S) or embedded (B, S, D) (or the stem's input (B, S_in, C));
        src_mask (B, 1, 1|S, S) -> memory (B, S, D)."""
        c = self.config
        if self.stem is not None:
            checks.check_rank("src", src, 3, "(batch, length, channels): the stem's input")
            src = self.stem(src)
        if src.ndim == 2 and c.encoder_input != "tokens":
            raise ValueError('src: this encoder reads embedded inputs (config.encoder_input='
                             '"embedded"), got token ids of shape ' f"{src.shape}")
        if src.ndim == 3:
            checks.check_embedded("src", src, c.d_model, c.encoder_len)
        else:
            checks.check_tokens("src", src, c.src_vocab_size, c.encoder_len)
        if src_mask is None:
            src_mask = _default_src_mask(src, c.pad_id)
            if src_mask is not None and uses_mask_spec(c):
                src_mask = key_padding_spec(src != c.pad_id, src.shape[1])
        _check_mask("src_mask", src_mask, src.shape[0], src.shape[1], src.shape[1],
                    heads=c.num_heads)
        return self.encoder(src, src_mask, deterministic=deterministic)

    def cross_kv(self, memory_BSD: jnp.ndarray) -> tuple[KV, ...]:
        """Per-layer cross-attention keys/values (each (B, H, S, K)), for decoding."""
        return self.decoder.cross_kv(memory_BSD)

    def decode(self, tgt: jnp.ndarray, memory_BSD: jnp.ndarray,
               src_mask: Optional[jnp.ndarray] = None, tgt_mask: Optional[jnp.ndarray] = None,
               *, deterministic: bool = True) -> jnp.ndarray:
        """tgt (B, T) ids attending to memory (B, S, D) -> logits (B, T, V_tgt).

        `src_mask` (B, 1, 1|T, S) or a MaskSpec hides memory positions (PAD);
        without it all memory is visible. `tgt_mask` defaults to causal & non-PAD
        (a MaskSpec under attention_impl "blockwise" / "auto").
        """
        c = self.config
        checks.check_tokens("tgt", tgt, c.tgt_vocab_size, c.decoder_len)
        checks.check_embedded("memory", memory_BSD, c.d_model, max_len=None)
        checks.check_same_batch(tgt=tgt, memory=memory_BSD)
        if tgt_mask is None:
            if uses_mask_spec(c):
                tgt_mask = (lm_mask_spec(tgt, c.pad_id) if c.mask_decoder_pad
                            else MaskSpec(causal=True))
            else:
                tgt_mask = (decoder_self_mask(tgt, c.pad_id) if c.mask_decoder_pad
                            else causal_mask(tgt.shape[1]))
        _check_mask("tgt_mask", tgt_mask, tgt.shape[0], tgt.shape[1], tgt.shape[1],
                    heads=c.num_heads)
        _check_mask("src_mask", src_mask, tgt.shape[0], tgt.shape[1], memory_BSD.shape[1],
                    heads=c.num_heads)
        cross = memory_BSD if c.scan_layers else self.decoder.cross_kv(memory_BSD)
        logits_BTV, _ = self.decoder(tgt, tgt_mask, cross, src_mask, deterministic=deterministic)
        return logits_BTV

    def __call__(self, src: jnp.ndarray, tgt: jnp.ndarray,
                 src_mask: Optional[jnp.ndarray] = None, tgt_mask: Optional[jnp.ndarray] = None,
                 *, deterministic: bool = True) -> jnp.ndarray:
        """Teacher-forced logits (B, T, V_tgt) of `tgt` (B, T) given `src` (B, S[, D])."""
        # Ranks first: otherwise a wrong-rank src fails as a misleading batch
        # mismatch, or as an IndexError inside the default mask.
        checks.check_rank("src", src, {2, 3},
                          "ids (batch, length) or embedded (batch, length, d_model)")
        checks.check_rank("tgt", tgt, 2, "(batch, length)")
        checks.check_same_batch(src=src, tgt=tgt)
        c = self.config
        cross_mask = None
        if src_mask is None and jnp.issubdtype(src.dtype, jnp.integer) and uses_mask_spec(c):
            # One visibility, two shapes: S encoder queries, T decoder queries.
            visible_BS = src != c.pad_id
            src_mask = key_padding_spec(visible_BS, src.shape[1])
            cross_mask = key_padding_spec(visible_BS, tgt.shape[1])
        elif src_mask is None:
            src_mask = _default_src_mask(src, c.pad_id)
        memory_BSD = self.encode(src, src_mask, deterministic=deterministic)
        return self.decode(tgt, memory_BSD, src_mask if cross_mask is None else cross_mask,
                           tgt_mask, deterministic=deterministic)


class DecoderOnlyLM(nn.Module):
    """A causal language model (seed 004): decoder layers without cross-attention.

    Reads `tgt_vocab_size` and the decoder fields; `num_encoder_layers` must be 0.
    """

    config: TransformerConfig

    def apply(self, variables, *args, **kwargs):
        check_variables_layout(self.config, variables)
        return super().apply(variables, *args, **kwargs)

    def setup(self):
        if self.config.num_encoder_layers:
            raise ValueError("DecoderOnlyLM has no encoder: set "
                             "TransformerConfig.num_encoder_layers=0")
        self.embed = TokenEmbedding(self.config.tgt_vocab_size, self.config)
        self.decoder = Decoder(self.config, embed=self.embed, cross_attention=False)

    def __call__(self, tokens_BT: jnp.ndarray, mask: Optional[jnp.ndarray] = None, *,
                 positions_BT: Optional[jnp.ndarray] = None,
                 deterministic: bool = True, hidden: bool = False) -> jnp.ndarray:
        """Next-token logits (B, T, V). `mask` (dense (B|1, 1, T, T) or a MaskSpec)
        defaults to causal & non-PAD: a MaskSpec under attention_impl "blockwise" or
        "auto" (`lm_mask_spec`), so no (T, T) array is built. `hidden=True`: the final
        normed hidden states (B, T, D) instead; `output_logits` projects them."""
        c = self.config
        checks.check_tokens("tokens", tokens_BT, c.tgt_vocab_size, c.decoder_len)
        if mask is None:
            mask = (lm_mask_spec(tokens_BT, c.pad_id) if uses_mask_spec(c)
                    else decoder_self_mask(tokens_BT, c.pad_id))
        if not isinstance(mask, MaskSpec):
            checks.check_mask("mask", mask, tokens_BT.shape[0], tokens_BT.shape[1],
                              tokens_BT.shape[1], heads=c.num_heads)
        logits_BTV, _ = self.decoder(tokens_BT, mask, positions_BT=positions_BT,
                                     deterministic=deterministic, hidden=hidden)
        return logits_BTV

    def output_logits(self, y_BTD: jnp.ndarray) -> jnp.ndarray:
        """Float32 logits (..., V) of final hidden states (..., D) (`hidden=True`)."""
        return self.decoder.output_logits(y_BTD)


def count_params(params) -> int:
    """Total number of scalars in a parameter pytree."""
    return sum(x.size for x in jax.tree_util.tree_leaves(params))


def attention_weights(intermediates) -> dict[str, jnp.ndarray]:
    """Flatten sown attention weights to {"decoder/layers_0/cross_attn": (B, H, T, S)}.

    Usage: `logits, state = model.apply({"params": p}, src, tgt, mutable="intermediates")`,
    then `attention_weights(state["intermediates"])`. A scanned model's weights
    are stacked, `layers/...` (L, B, H, T, S); they come out per layer as well,
    so both layouts give the same keys.
    """
    flat = {}
    for path, value in jax.tree_util.tree_flatten_with_path(
            intermediates, is_leaf=lambda x: isinstance(x, tuple))[0]:
        keys = [p.key for p in path if hasattr(p, "key")]
        if keys and keys[-1] == "attention_weights":
            if "layers" in keys:  # scanned: split the leading layer axis
                at = keys.index("layers")
                for i, weights in enumerate(value[-1]):
                    flat["/".join(keys[:at] + [f"layers_{i}"] + keys[at + 1:-1])] = weights
            else:
                flat["/".join(keys[:-1])] = value[-1]
    return flat

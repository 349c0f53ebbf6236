"""A stack of L layers, unrolled or scanned, with optional rematerialisation.

`config.scan_layers=True` runs the stack as one `nn.scan` over a layer whose
parameters carry a leading layer axis L (``layers/...``), so the compiled
program holds one layer whatever the depth: compile time stays flat. The
default unrolls ``layers_0 .. layers_{L-1}`` (see `stacking` for converters).

`config.remat` wraps each layer in `nn.remat` (`jax.checkpoint`): the backward
pass recomputes the layer's activations instead of keeping them, except what
the policy saves:

  "none"       keep every activation (no remat; the default)
  "full"       keep only each layer's input; recompute everything else
  "save_proj"  keep the projection matmuls' outputs (attention query/key/value/
               out, FFN gate/wi/wo; names tagged with `checkpoint_name`), recompute
               the cheap elementwise work, softmax and norms (MaxText's
               "qkv_proj"/"out_proj"/"mlpwi"/"mlpwo" policies)
  "save_dots"  keep every matmul without batch dimensions
               (`jax.checkpoint_policies.dots_with_no_batch_dims_saveable`)

Remat is exactly as configured, scanned or not (what each choice costs on
XLA:CPU is in benchmarks/NOTES.md).

The blocks below give the layers the positional (carry, *broadcast) -> (carry,
None) signature that `nn.scan` and `nn.remat` (static `deterministic`) want;
their parameters are the layers' own, so layouts do not change.

Local and global layers (`config.attention_pattern`): every block gets both
masks, the global `mask` and the sliding-window `local_mask`. Unrolled, each
block is built with its kind (`local`, static); scanned over layers of mixed
kinds, one block body serves all, and a scanned per-layer input `local_flag`
(L,) picks the mask and the RoPE frequencies of each layer.
"""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer.nn.attention import KV
from jaxformer.nn.mask_structure import LayerKindMask, MaskSpec
from jaxformer.config import TransformerConfig
from jaxformer.nn.layers import DecoderLayer, EncoderLayer
from jaxformer.nn.rope import layer_frequencies

# Names tagged with `jax.ad_checkpoint.checkpoint_name` in attention.py / layers.py.
PROJECTIONS = ("query_proj", "key_proj", "value_proj", "out_proj",
               "ffn_gate", "ffn_wi", "ffn_wo")

REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_proj": jax.checkpoint_policies.save_only_these_names(*PROJECTIONS),
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def select_kind(config: TransformerConfig, local: bool, local_flag, mask, local_mask):
    """(mask, RoPE frequencies or None) of a layer: by its static kind `local`, or,
    in a scan over mixed kinds, by the traced per-layer `local_flag`."""
    if local_flag is None:
        return (local_mask if local else mask), None
    inv_freq = jnp.where(local_flag, layer_frequencies(config, True),
                         layer_frequencies(config, False))
    if isinstance(local_mask, MaskSpec):  # static windows: the attention picks by cond
        return LayerKindMask(local_flag, local_mask,
                             MaskSpec() if mask is None else mask), inv_freq
    global_mask = True if mask is None else mask
    return jnp.where(local_flag, local_mask, global_mask), inv_freq


class EncoderBlock(EncoderLayer):
    """`EncoderLayer` as a scan body: (x_BSD, mask, local_mask, local_flag, deterministic)
    -> (x_BSD, None)."""

    def __call__(self, x_BSD, mask, local_mask, local_flag, deterministic):
        mask, inv_freq = select_kind(self.config, self.local, local_flag, mask, local_mask)
        return super().__call__(x_BSD, mask, deterministic=deterministic,
                                inv_freq=inv_freq), None


class DecoderBlock(DecoderLayer):
    """`DecoderLayer` as a scan body (no KV cache: the training / full pass).

    `cross` is either this layer's cross-attention `KV`, or the encoder memory
    (B, S, D), projected here by the layer's own weights (a scanned stack has no
    per-layer KV tuple to hand in).
    """

    def __call__(self, y_BTD, self_mask, local_mask, local_flag, cross, cross_mask,
                 positions_BT, deterministic):
        cross_kv = None
        if self.cross_attention:
            cross_kv = cross if isinstance(cross, KV) else self.cross_kv(cross)
        self_mask, inv_freq = select_kind(self.config, self.local, local_flag, self_mask,
                                          local_mask)
        y_BTD, _ = super().__call__(y_BTD, self_mask, cross_kv, cross_mask,
                                    positions_BT=positions_BT, deterministic=deterministic,
                                    inv_freq=inv_freq)
        return y_BTD, None


def _maybe_remat(block_cls, config: TransformerConfig, num_args: int):
    if config.remat == "none":
        return block_cls
    policy = REMAT_POLICIES[config.remat]
    # static: `deterministic`, the last positional argument (self counts as 0).
    # prevent_cse is unneeded inside scan (the loop keeps recomputation apart).
    return nn.remat(block_cls, policy=policy, prevent_cse=not config.scan_layers,
                    static_argnums=(num_args,))


def uses_blocks(config: TransformerConfig) -> bool:
    """True when the stack runs through the blocks (scan or remat), not the plain layers."""
    return config.scan_layers or config.remat != "none"


def mixed_kinds(config: TransformerConfig, num_layers: int) -> bool:
    """Whether a stack has both local and global layers (a scan then needs per-layer flags)."""
    return len(set(config.local_layers(num_layers))) > 1


def scanned_flags(config: TransformerConfig, num_layers: int):
    """The scanned per-layer input: (L,) bools for a stack of mixed kinds, else None."""
    if config.scan_layers and mixed_kinds(config, num_layers):
        return jnp.asarray(config.local_layers(num_layers))
    return None


def _scan(block, config: TransformerConfig, num_layers: int, num_broadcast_after: int):
    """nn.scan of `block` over the layers: (mask, local_mask) broadcast, the flags
    scanned (or broadcast when there are none), then `num_broadcast_after` broadcast."""
    flags_axis = 0 if mixed_kinds(config, num_layers) else nn.broadcast
    return nn.scan(block, variable_axes={"params": 0, "intermediates": 0},
                   split_rngs={"params": True, "dropout": True},
                   in_axes=(nn.broadcast, nn.broadcast, flags_axis)
                   + (nn.broadcast,) * num_broadcast_after, length=num_layers,
                   metadata_params={nn.PARTITION_NAME: "layers"})


def _scanned_kind(config: TransformerConfig, num_layers: int) -> bool:
    """The static kind of a scanned block: its layers' one kind (False if mixed)."""
    return not mixed_kinds(config, num_layers) and config.layer_is_local(0)


def encoder_stack(config: TransformerConfig, num_layers: int):
    """A scanned block named "layers", or a list of (maybe rematted) blocks."""
    block = _maybe_remat(EncoderBlock, config, num_args=5)
    if not config.scan_layers:
        return [block(config, local=config.layer_is_local(i)) for i in range(num_layers)]
    return _scan(block, config, num_layers, 1)(
        config, local=_scanned_kind(config, num_layers))


def decoder_stack(config: TransformerConfig, num_layers: int, cross_attention: bool):
    block = _maybe_remat(DecoderBlock, config, num_args=8)
    if not config.scan_layers:
        return [block(config, cross_attention=cross_attention, local=config.layer_is_local(i))
                for i in range(num_layers)]
    return _scan(block, config, num_layers, 4)(
        config, cross_attention=cross_attention, local=_scanned_kind(config, num_layers))


def run_encoder_stack(layers, x_BSD: jnp.ndarray, mask: Optional[jnp.ndarray],
                      deterministic: bool, local_mask: Optional[jnp.ndarray] = None,
                      flags=None) -> jnp.ndarray:
    """`local_mask`: the sliding-window layers' mask (None without local layers);
    `flags`: `scanned_flags` of a scanned stack."""
    if isinstance(layers, (list, tuple)):
        for layer in layers:
            x_BSD, _ = layer(x_BSD, mask, local_mask, None, deterministic)
        return x_BSD
    return layers(x_BSD, mask, local_mask, flags, deterministic)[0]


def run_decoder_stack(layers, y_BTD, self_mask, cross, cross_mask, positions_BT,
                      deterministic: bool, local_mask: Optional[jnp.ndarray] = None,
                      flags=None) -> jnp.ndarray:
    """`cross`: per-layer KVs (a sequence) for a list of layers, memory for a scan;
    `local_mask`: the sliding-window layers' self-attention mask."""
    if isinstance(layers, (list, tuple)):
        for i, layer in enumerate(layers):
            y_BTD, _ = layer(y_BTD, self_mask, local_mask, None,
                             None if cross is None else cross[i], cross_mask, positions_BT,
                             deterministic)
        return y_BTD
    return layers(y_BTD, self_mask, local_mask, flags, cross, cross_mask, positions_BT,
                  deterministic)[0]

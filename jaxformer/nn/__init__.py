"""The model: attention, positions, masks, layers, layer stacks, the two model classes.

Modules: `axes` (logical axis names), `checks` (input checks), `masks` and
`mask_structure` (`MaskSpec`, masks never materialised), `rope`, `norms`,
`attention`, `attention_select` (which kernel runs), `quant` (int8/int4 layouts), `quant_dense`
(`QuantDense`), `quant_params` (`quantize_params`), `kv_quant` (the int8 KV cache), `paged_kv` (paged KV reads and writes), `blockwise` (flash-style
attention), `splash` (the TPU kernel), `layers`, `lora`, `stems`, `stack`
(unrolled or scanned stacks, remat), `stacking` (parameter layout converters),
`model` (`Transformer`, `DecoderOnlyLM`), `inspection` (renderings, captured
activations), `precision`, `tuning`. The names below
are the public surface; the modules are free to move.
"""

from jaxformer.nn.attention import KV, MultiHeadAttention, dot_product_attention
from jaxformer.nn.attention_select import resolved_attention_impl
from jaxformer.nn.blockwise import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, blockwise_attention
from jaxformer.nn.inspection import capture, modules_named, render
from jaxformer.nn.layers import DecoderLayer, EncoderLayer, FeedForward, sinusoidal_table
from jaxformer.nn.lora import merge_lora, split_adapters
from jaxformer.nn.mask_structure import MaskSpec, dense_mask
from jaxformer.nn.masks import (causal_mask, combine_masks, cross_mask, decoder_self_mask,
                                padding_mask)
from jaxformer.nn.quant_params import dequantize_params, param_bytes, quantize_params
from jaxformer.nn.model import (Decoder, DecoderOnlyLM, Encoder, Transformer,
                                attention_weights, count_params)
from jaxformer.nn.stacking import stack_layers, unstack_layers

__all__ = ["KV", "MultiHeadAttention", "dot_product_attention", "resolved_attention_impl",
           "DEFAULT_BLOCK_K", "DEFAULT_BLOCK_Q", "blockwise_attention", "DecoderLayer",
           "EncoderLayer", "FeedForward", "sinusoidal_table", "merge_lora", "split_adapters",
           "MaskSpec", "dense_mask", "causal_mask", "combine_masks", "cross_mask",
           "decoder_self_mask", "padding_mask", "Decoder", "DecoderOnlyLM", "Encoder",
           "Transformer", "attention_weights", "count_params", "stack_layers",
           "unstack_layers", "dequantize_params", "param_bytes", "quantize_params",
           "capture", "modules_named", "render"]

"""The model: attention, positions, masks, layers, layer stacks, the two model classes.

Modules (imports only go up this list): `axes` (logical axis names), `checks`
(input checks), `masks`, `rope`, `dropout`, `attention`, `layers`, `stems`,
`stack` (unrolled or scanned stacks, remat), `stacking` (parameter layout
converters), `model` (`Transformer`, `DecoderOnlyLM`), `precision`.
"""

from jaxformer.nn.attention import KV, MultiHeadAttention, dot_product_attention
from jaxformer.nn.layers import DecoderLayer, EncoderLayer, FeedForward, sinusoidal_table
from jaxformer.nn.masks import (causal_mask, combine_masks, cross_mask, decoder_self_mask,
                                padding_mask)
from jaxformer.nn.model import (Decoder, DecoderOnlyLM, Encoder, Transformer,
                                attention_weights, count_params)
from jaxformer.nn.stacking import stack_layers, unstack_layers

__all__ = ["KV", "MultiHeadAttention", "dot_product_attention", "DecoderLayer", "EncoderLayer",
           "FeedForward", "sinusoidal_table", "causal_mask", "combine_masks", "cross_mask",
           "decoder_self_mask", "padding_mask", "Decoder", "DecoderOnlyLM", "Encoder",
           "Transformer", "attention_weights", "count_params", "stack_layers",
           "unstack_layers"]

"""jaxformer: the Transformer as pure functional Flax modules.

Dimension key, used in names (`x_BTD`, `mask_BHTS`) and einsum strings:
  B batch   S source length   T target length   D d_model   H heads
  K head dim   F d_ff   V vocabulary   L layers

Masks are boolean, True = may attend.
"""

from jaxformer.attention import KV, MultiHeadAttention, dot_product_attention
from jaxformer.config import PRESETS, TransformerConfig, bench, copy_task, tiny
from jaxformer.layers import DecoderLayer, EncoderLayer, FeedForward, sinusoidal_table
from jaxformer.masks import (causal_mask, combine_masks, cross_mask, decoder_self_mask,
                             padding_mask)
from jaxformer.model import (Decoder, DecoderOnlyLM, Encoder, Transformer, attention_weights,
                             count_params)

__version__ = "0.1.0"

"""jaxformer: the Transformer as pure functional Flax modules.

Dimension key, used in names (`x_BTD`, `mask_BHTS`) and einsum strings:
  B batch   S source length   T target length   D d_model   H heads
  G key/value heads   K head dim   F d_ff   V vocabulary   L layers

Masks are boolean, True = may attend.

The model, decoding and configs import with the package. Training, loading, serving and
the other subpackages import on first use of one of their names (`jf.fit`, `jf.load`,
`jf.Engine`, `jf.serve`, ...: `LAZY`), so `import jaxformer` needs none of their
optional packages (Starlette, gguf, orbax, ...) and costs none of their import time.
"""

import importlib

from jaxformer.nn.attention import KV, MultiHeadAttention, dot_product_attention
from jaxformer.config import PRESETS, TransformerConfig, bench, copy_task, llama, tiny
from jaxformer.nn.layers import DecoderLayer, EncoderLayer, FeedForward, sinusoidal_table
from jaxformer.nn.masks import (causal_mask, combine_masks, cross_mask, decoder_self_mask,
                             padding_mask)
from jaxformer.nn.model import (Decoder, DecoderOnlyLM, Encoder, Transformer, attention_weights,
                             count_params)
# Decoding (after the models it drives).
from jaxformer.decode.beam import beam_search
from jaxformer.decode.cache import DecodeCache, init_cache
from jaxformer.decode.api import (DecodeResult, DecodeState, generate, greedy_decode,
                                greedy_decode_one, sample)
from jaxformer.decode.processors import force_token, min_length, suppress_at_step, suppress_tokens
from jaxformer.decode.sampling import make_sampler
from jaxformer.nn.stacking import stack_layers, unstack_layers

# Names imported on first use: name -> the subpackage whose public name it is.
LAZY = {
    "fit": "jaxformer.train",
    "FitResult": "jaxformer.train",
    "Run": "jaxformer.train",
    "TrainConfig": "jaxformer.train",
    "load": "jaxformer.models",
    "save_hf": "jaxformer.models",
    "Engine": "jaxformer.serve",
    "SamplingParams": "jaxformer.serve",
}
# Subpackages not imported with the package, as attributes on first use (`jf.serve`).
SUBPACKAGES = ("cli", "harness", "interop", "models", "nnx", "parallel", "serve", "text",
               "train")


def __getattr__(name: str):
    """A `LAZY` name or a subpackage, imported now (PEP 562) and kept for the next use."""
    if name in LAZY:
        value = getattr(importlib.import_module(LAZY[name]), name)
    elif name in SUBPACKAGES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted({*globals(), *LAZY, *SUBPACKAGES})


__all__ = [
    "attention_weights",
    "beam_search",
    "bench",
    "causal_mask",
    "combine_masks",
    "copy_task",
    "count_params",
    "cross_mask",
    "DecodeCache",
    "Decoder",
    "decoder_self_mask",
    "DecodeResult",
    "DecoderLayer",
    "DecoderOnlyLM",
    "DecodeState",
    "dot_product_attention",
    "Encoder",
    "EncoderLayer",
    "FeedForward",
    "force_token",
    "generate",
    "greedy_decode",
    "greedy_decode_one",
    "init_cache",
    "KV",
    "llama",
    "make_sampler",
    "min_length",
    "MultiHeadAttention",
    "padding_mask",
    "PRESETS",
    "sample",
    "sinusoidal_table",
    "suppress_at_step",
    "suppress_tokens",
    "stack_layers",
    "tiny",
    "Transformer",
    "TransformerConfig",
    "unstack_layers",
    *LAZY,
]

__version__ = "0.1.0"

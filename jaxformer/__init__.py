"""jaxformer: the Transformer as pure functional Flax modules.

Dimension key, used in names (`x_BTD`, `mask_BHTS`) and einsum strings:
  B batch   S source length   T target length   D d_model   H heads
  G key/value heads   K head dim   F d_ff   V vocabulary   L layers

Masks are boolean, True = may attend.

Every name and subpackage imports on first use (`jf.Transformer`, `jf.fit`, `jf.load`,
`jf.Engine`, `jf.serve`, ...: `LAZY`), so `import jaxformer` needs none of the optional
packages (Starlette, gguf, orbax, ...) and costs none of their import time, nor JAX's:
the `jaxformer` command handles a Ctrl-C from its first moment (`jaxformer.cli.interrupts`).
"""

import importlib

# Every name is imported on first use: name -> the subpackage whose public name it is.
_MODEL = ("KV", "MultiHeadAttention", "dot_product_attention", "DecoderLayer", "EncoderLayer",
          "FeedForward", "sinusoidal_table", "causal_mask", "combine_masks", "cross_mask",
          "decoder_self_mask", "padding_mask", "Decoder", "DecoderOnlyLM", "Encoder",
          "Transformer", "attention_weights", "count_params", "stack_layers",
          "unstack_layers")
_CONFIG = ("PRESETS", "TransformerConfig", "bench", "copy_task", "llama", "tiny")
_DECODING = ("beam_search", "DecodeCache", "init_cache", "DecodeResult", "DecodeState",
             "generate", "greedy_decode", "greedy_decode_one", "sample", "force_token",
             "min_length", "suppress_at_step", "suppress_tokens", "make_sampler")
LAZY = {
    **dict.fromkeys(_MODEL, "jaxformer.nn"),
    **dict.fromkeys(_CONFIG, "jaxformer.config"),
    **dict.fromkeys(_DECODING, "jaxformer.decode"),
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
SUBPACKAGES = ("backends", "cli", "config", "decode", "errors", "harness", "interop", "models",
               "nn", "nnx", "parallel", "serve", "text", "train")


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


__all__ = list(LAZY)

__version__ = "0.1.0"

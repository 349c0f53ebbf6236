"""Weight-only post-training quantization of a parameter tree, and back.

    qconfig, qparams = quantize_params(config, params, "int4")    # float -> quantized
    model = DecoderOnlyLM(qconfig)                                 # same tree names
    fconfig, fparams = dequantize_params(qconfig, qparams)         # quantized -> float

`quantize_params` replaces each projection kernel (attention query/key/value/out,
FFN gate/wi/wo, decoder/out_proj) and each token table by the leaves of its
layout (`nn.quant_dense`: ``kernel_q``, ``scale`` (+ ``offset``); ``embedding_q``,
...), in either stack layout (a scanned stack's leading layer axis is kept).
Norms, biases, position tables, stems and LoRA adapters stay float.
`dequantize_params` computes the float kernels the quantized model multiplies
by (`nn.quant.dequantize`, then `config.param_dtype`): the float model with
them computes the quantized model's function.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import traverse_util

from jaxformer.config import TransformerConfig
from jaxformer.nn import quant
from jaxformer.nn.quant_dense import leaf_names

# Module names of the quantized Dense layers; "out_proj" (and the token tables) is
# the "embed" role, the others "layers".
DENSE = ("query", "key", "value", "out", "gate", "wi", "wo", "out_proj")
TABLES = ("embed", "src_embed", "tgt_embed")


def _role(key: tuple) -> Optional[tuple[str, str]]:
    """(role, parameter name) of a quantizable float leaf path, else None."""
    if "stem" in key or len(key) < 2:
        return None
    if key[-1] == "kernel" and key[-2] in DENSE:
        return ("embed" if key[-2] == "out_proj" else "layers"), "kernel"
    if key[-1] == "embedding" and key[-2] in TABLES:
        return "embed", "embedding"
    return None


def module_path(key: tuple) -> str:
    """The module path of a parameter leaf's key ("decoder/layers_3/ffn/wo"), as
    `config.quant_layouts` names kernels."""
    return "/".join(map(str, key[:-1]))


def _lead(key: tuple) -> int:
    """1 for a leaf of a scanned stack (its leading layer axis), else 0."""
    return int("layers" in key)


def is_quantized(config: TransformerConfig, params: Any = None) -> bool:
    """Whether `config` quantizes any kernel, or `params` holds quantized leaves."""
    if config.weight_quant is not None or config.quant_format("embed") is not None:
        return True
    flat = traverse_util.flatten_dict(dict(params)) if params is not None else {}
    return any(str(k[-1]).endswith("_q") for k in flat)


def quantize_params(config: TransformerConfig, params: Any, fmt: str, *,
                    embed_quant: Optional[str] = None, quant_layouts: tuple = ()
                    ) -> tuple[TransformerConfig, dict]:
    """(config with `weight_quant=fmt`, the parameters quantized): weight-only
    post-training quantization (`nn.quant.quantize`: per-channel absmax for "int8",
    per-block scale (and min) for the block layouts, as llama.cpp rounds).

    `embed_quant`: the token tables' and output projection's layout (None: `fmt`;
    "float": keep them float). `quant_layouts`: per-kernel layouts over the roles'
    (`config.quant_layouts`: ((module path, layout), ...)). Raises ValueError naming the problem for an unknown
    layout or a tree that is already quantized (dequantize it first)."""
    quant.check_format(fmt)
    if embed_quant not in (None, "float"):
        quant.check_format(embed_quant, "embed_quant")
    if is_quantized(config, params):
        raise ValueError(
            f"the parameters are already quantized (weight_quant={config.weight_quant!r}, "
            f"embed_quant={config.embed_quant!r}): quantize a float tree "
            "(jaxformer.nn.quant_params.dequantize_params gives one back)")
    new = config.replace(weight_quant=fmt, embed_quant=embed_quant,
                         quant_layouts=tuple(quant_layouts))
    out = {}
    for key, value in traverse_util.flatten_dict(dict(params)).items():
        found = _role(key)
        layout = found and new.quant_format(found[0], module_path(key))
        if not layout:
            out[key] = value
            continue
        role, name = found
        lead = _lead(key)
        if name == "kernel":  # (lead, *in, *out) -> (lead, N, *out): input axes flattened
            n_in = 2 if key[-2] == "out" else 1
            shape = value.shape
            value = value.reshape(shape[:lead] + (math.prod(shape[lead:lead + n_in]),)
                                  + shape[lead + n_in:])
            axis = lead
        else:
            axis = value.ndim - 1
        parts = quant.quantize(value, layout, new.quant_block, axis)
        for part, leaf in leaf_names(name, layout).items():
            out[key[:-1] + (leaf,)] = parts[part]
    return new, traverse_util.unflatten_dict(out)


def dequantize_params(config: TransformerConfig, params: Any
                      ) -> tuple[TransformerConfig, dict]:
    """(config without quantization, float parameters in `config.param_dtype`): each
    quantized kernel as the float array its layout stands for (the kernels the
    quantized model multiplies by)."""
    plain = config.replace(weight_quant=None, embed_quant=None, quant_layouts=())
    flat = traverse_util.flatten_dict(dict(params))
    out = {}
    taken = set()
    for key, value in flat.items():
        if key in taken:
            continue
        name = str(key[-1])[:-2] if str(key[-1]).endswith("_q") else None
        found = _role(key[:-1] + (name,)) if name else None
        if not found:
            out[key] = value
            continue
        role, _ = found
        layout = config.quant_format(role, module_path(key))
        if layout is None:
            raise ValueError(f"{'/'.join(map(str, key))}: a quantized leaf, but the config "
                             f"quantizes no {role} kernels (weight_quant="
                             f"{config.weight_quant!r}, embed_quant={config.embed_quant!r})")
        keys = {part: key[:-1] + (leaf,) for part, leaf in leaf_names(name, layout).items()}
        taken.update(keys.values())
        parts = {part: flat[k] for part, k in keys.items()}
        lead = _lead(key)
        axis = lead if name == "kernel" else value.ndim - 1
        w = quant.dequantize(parts, layout, config.quant_block, axis)
        if name == "kernel" and key[-2] == "out":  # (lead, H*K, D) -> (lead, H, K, D)
            w = w.reshape(w.shape[:lead] + (config.num_heads, config.head_dim)
                          + w.shape[lead + 1:])
        out[key[:-1] + (name,)] = w.astype(config.params_dtype)
    for key in taken:
        out.pop(key, None)
    return plain, traverse_util.unflatten_dict(out)


def param_bytes(params: Any) -> int:
    """Bytes of every array in a parameter tree."""
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(params))

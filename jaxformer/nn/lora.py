"""LoRA: low-rank adapters on the projections of a model (`config.lora_rank > 0`).

A targeted projection y = x W (W: `kernel` of shape (*in, *out)) becomes
y = x W + (x A) B * alpha / r, with A (*in, r) drawn as PEFT draws it
(uniform in +-1/sqrt(fan_in)) and B (r, *out) zero: an untrained adapter adds
exactly 0, so the model's outputs are those of its base parameters.

Parameters: each adapter is a sibling of its projection, named
``<projection>_lora`` with leaves ``a`` and ``b`` (``self_attn/query_lora/a``
beside ``self_attn/query/kernel``; scanned stacks add their leading layer axis
to both). `config.lora_targets` names the projections (`config.LORA_TARGETS`):
q/k/v/o -> attention ``query``/``key``/``value``/``out``, gate/up/down -> FFN
``gate``/``wi``/``wo``.

Pieces::

    LoRA(config, in_shape, out_shape, in_names, out_names)   the adapter module
    is_adapter_path(path), split_adapters(params) -> (adapters, base), join(a, b)
    merge_lora(config, params) -> (config without LoRA, params with B A folded in)

QLoRA: the base may be quantized (`config.weight_quant`, `jaxformer.nn.quant_params`);
training updates the float adapters only, and `merge_lora` dequantizes the base
first (the adapted model's function has no exact integer form): its result is a
float model (quantize it again with `quantize_params` if wanted).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util

from jaxformer.config import TransformerConfig
from jaxformer.nn.axes import logical
from jaxformer.nn.quant_params import dequantize_params, is_quantized

SUFFIX = "_lora"
# config.lora_targets -> the projection's module name.
PROJECTIONS = {"q": "query", "k": "key", "v": "value", "o": "out",
               "gate": "gate", "up": "wi", "down": "wo"}


def targets(config: TransformerConfig, *names: str) -> bool:
    """Whether the projection called `names[0]` (a module name such as "query") has an
    adapter in `config`."""
    if not config.lora_rank:
        return False
    return any(PROJECTIONS[t] in names for t in config.lora_targets)


class LoRA(nn.Module):
    """(..., *in_shape) -> (..., *out_shape): (x A) B * scale in the compute dtype.

    `in_names` / `out_names`: the logical axes of the projection's input and
    output dimensions (so adapters shard like their kernels); the rank axis is
    "lora" (never split).
    """

    config: TransformerConfig
    in_shape: tuple
    out_shape: tuple
    in_names: tuple
    out_names: tuple

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        c = self.config
        rank, n_in = c.lora_rank, len(self.in_shape)
        a_init = nn.initializers.variance_scaling(  # PEFT: kaiming_uniform(a=sqrt(5))
            1.0 / 3.0, "fan_in", "uniform", in_axis=tuple(range(n_in)), out_axis=-1)
        a = self.param("a", logical(a_init, self.in_names + ("lora",)),
                       tuple(self.in_shape) + (rank,), c.params_dtype)
        b = self.param("b", logical(nn.initializers.zeros, ("lora",) + self.out_names),
                       (rank,) + tuple(self.out_shape), c.params_dtype)
        dtype = c.compute_dtype
        h = jnp.tensordot(x.astype(dtype), a.astype(dtype), axes=n_in)
        h = h * jnp.asarray(c.lora_scale, dtype)
        return jnp.tensordot(h, b.astype(dtype), axes=1)


def apply(module: nn.Module, name: str, x: jnp.ndarray) -> jnp.ndarray:
    """`module.<name>(x)`, plus its adapter `module.<name>_lora(x)` when the config targets it."""
    y = getattr(module, name)(x)
    if targets(module.config, name):
        y = y + getattr(module, name + SUFFIX)(x).astype(y.dtype)
    return y


def is_adapter_path(path) -> bool:
    """Whether a pytree path (of keys or strings) lies inside an adapter."""
    return any(str(getattr(k, "key", k)).endswith(SUFFIX) for k in path)


def split_adapters(params: Any) -> tuple[dict, dict]:
    """(adapters, base): two nested dicts holding the adapter leaves and the rest.

    Works on any params-shaped dict tree (shardings, abstract shapes)."""
    flat = traverse_util.flatten_dict(dict(params))
    adapters = {k: v for k, v in flat.items() if is_adapter_path(k)}
    base = {k: v for k, v in flat.items() if not is_adapter_path(k)}
    return traverse_util.unflatten_dict(adapters), traverse_util.unflatten_dict(base)


def join(adapters: Any, base: Any) -> dict:
    """The inverse of `split_adapters`: one tree with both sets of leaves."""
    flat = traverse_util.flatten_dict(dict(base))
    flat.update(traverse_util.flatten_dict(dict(adapters)))
    return traverse_util.unflatten_dict(flat)


def merge_lora(config: TransformerConfig, params: Any) -> tuple[TransformerConfig, dict]:
    """(config with lora_rank=0, params without adapters): each targeted kernel W
    becomes W + (A B) * scale (computed in float32, stored in W's dtype), so the
    plain model gives the adapted model's outputs. Either layout (per-layer or
    scanned: the leading layer axis is kept).

    A quantized base (QLoRA) is dequantized first (`dequantize_params`): the result
    is the float model (config without `weight_quant`/`embed_quant`) whose kernels
    are the dequantized base plus the adapters' product."""
    if is_quantized(config, params):
        config, params = dequantize_params(config, params)
    plain = config.replace(lora_rank=0)
    if not config.lora_rank:
        return plain, params
    flat = traverse_util.flatten_dict(dict(params))
    merged = {k: v for k, v in flat.items() if not is_adapter_path(k)}
    for key in [k for k in flat if k[-1] == "a" and is_adapter_path(k)]:
        owner, name = key[:-2], key[-2][:-len(SUFFIX)]
        a, b = flat[key], flat[key[:-1] + ("b",)]
        kernel_key = owner + (name, "kernel")
        kernel = merged[kernel_key]
        lead = a.ndim + b.ndim - 2 - kernel.ndim  # 1 for a scanned stack's layer axis
        lead_shape = kernel.shape[:lead]
        a2 = a.reshape(lead_shape + (-1, a.shape[-1])).astype(jnp.float32)
        b2 = b.reshape(lead_shape + (b.shape[lead], -1)).astype(jnp.float32)
        delta = jnp.matmul(a2, b2).reshape(kernel.shape) * config.lora_scale
        merged[kernel_key] = (kernel.astype(jnp.float32) + delta).astype(kernel.dtype)
    return plain, traverse_util.unflatten_dict(merged)


def count_adapter_params(params: Any) -> int:
    """Number of adapter parameters in `params`."""
    return sum(x.size for x in jax.tree_util.tree_leaves(split_adapters(params)[0]))

"""Dense layers whose kernels are quantized (`config.weight_quant`, `config.embed_quant`).

A quantized Dense holds, instead of ``kernel`` (*in, *out), the leaves of its
layout (`jaxformer.nn.quant`) over the kernel with its input axes flattened,
(N, *out) with N = prod(in):

    kernel_q   (N, *out) int8, or (N / 2, *out) uint8 (4-bit, packed)
    scale      (*out) float32 ("int8"), or (N / block, *out) float16 (block layouts)
    offset     as scale ("int4" only)
    bias       (*out), float, as before

The float kernel exists only inside the compiled function: "int8" multiplies the
integers in the compute dtype and scales the product's output channels
(x (q s) = (x q) s); the block layouts dequantize the kernel (float32
arithmetic, then the compute dtype) and multiply. On GPU and TPU XLA fuses the
conversion into the matmul's operand; the parameters passed in stay integers.
On the CPU of a process that called `backends.cpu.tune_process()`, float32 layers
call `backends.qmatmul`'s kernel instead, which reads the integers as stored
(XLA:CPU would write and read a float copy of the kernel each call).

Logical axes: every leaf carries its kernel's names (the flattened input axes
take the name of the outer one: the out projection's (heads, kv) -> heads), and
"int8"'s per-channel scale the output names, so scales shard like their kernels.

Pieces::

    quantized_param(module, name, fmt, shape, axis, block, names, init) -> parts
    QuantDense(features, n_in, fmt, block, ...)       nn.DenseGeneral's interface
    dense(config, role, features, kernel_names, bias_names, ...)   float or quantized
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import flax.linen as nn
import jax.numpy as jnp
from jax import lax

from jaxformer.backends import qmatmul
from jaxformer.config import TransformerConfig
from jaxformer.nn import quant, tuning
from jaxformer.nn.axes import logical

# The leaf names of a quantized parameter `name` ("kernel" -> kernel_q, scale, offset;
# the K-quants' kernel_q_high, min, sub_scale, sub_min).
LEAF = {"q": "{}_q", "q_high": "{}_q_high"}


def leaf_names(name: str, fmt: str) -> dict:
    """{part: leaf name} of quantized parameter `name` in layout `fmt`."""
    return {part: LEAF.get(part, part).format(name) for part in quant.parts_of(fmt)}


def module_layout(module: nn.Module, fmt: str, layouts: tuple, name: str = "kernel") -> str:
    """The layout of a bound `module`'s parameter `name`: its path's entry of `layouts`
    (`config.quant_layouts`), else its role's `fmt`. A module applied on its own (a
    layer bound alone: its path is not the model's) takes the layout whose leaves its
    parameters hold (the one of most leaves: a K-quant's include a block layout's)."""
    if not layouts:
        return fmt
    found = dict(layouts).get("/".join(module.path))
    if found is not None or module.is_initializing():
        return found or fmt
    held = set(module.variables.get("params", {}))
    candidates = dict.fromkeys((fmt,) + tuple(layout for _, layout in layouts))
    for layout in sorted(candidates, key=lambda layout: -len(quant.parts_of(layout))):
        if set(leaf_names(name, layout).values()) <= held:
            return layout
    return fmt


def part_axis_names(fmt: str, names: tuple, axis: int) -> dict:
    """{part: logical axis names}: the array's `names`; "int8"'s scale without `axis`."""
    out = {part: tuple(names) for part in quant.parts_of(fmt)}
    if fmt == "int8":
        out["scale"] = tuple(n for i, n in enumerate(names) if i != axis % len(names))
    return out


def quantized_param(module: nn.Module, name: str, fmt: str, shape: tuple, axis: int,
                    block: int, names: tuple, init: Callable) -> dict:
    """Declare the leaves of float parameter `name` of `shape` quantized in `fmt`
    along `axis` on `module`; {part: array}. Initialising, the float value is drawn
    with `init` (one key for all parts) and quantized; the leaves are consistent."""
    spec = quant.layout(fmt, shape, axis, block)
    if module.is_initializing():
        parts = quant.quantize(init(module.make_rng("params"), shape, jnp.float32),
                               fmt, block, axis)
        make = lambda part: (lambda *_: parts[part])  # noqa: E731
    else:  # only shapes are checked (Flax evaluates the initializer abstractly)
        make = lambda part: (lambda *_: jnp.zeros(*spec[part]))  # noqa: E731
    axis_names = part_axis_names(fmt, names, axis)
    return {part: module.param(leaf, logical(make(part), axis_names[part]))
            for part, leaf in leaf_names(name, fmt).items()}


class QuantDense(nn.Module):
    """`nn.DenseGeneral` over the last `n_in` axes of x with a quantized kernel:
    (..., *in) -> (..., *features). `kernel_names`: the float kernel's logical axes."""

    features: tuple
    n_in: int
    fmt: str
    block: int
    kernel_names: tuple
    bias_names: tuple
    use_bias: bool = True
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    kernel_init: Callable = nn.initializers.lecun_normal()
    layouts: tuple = ()  # config.quant_layouts: this kernel's entry overrides `fmt`

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        fmt = module_layout(self, self.fmt, self.layouts)
        features = tuple(self.features)
        in_shape = x.shape[x.ndim - self.n_in:]
        n = math.prod(in_shape)
        names = (self.kernel_names[0],) + tuple(self.kernel_names[self.n_in:])

        def init(key, shape, dtype):  # the float kernel's init, flattened
            return self.kernel_init(key, in_shape + features, dtype).reshape(shape)

        parts = quantized_param(self, "kernel", fmt, (n,) + features, 0, self.block,
                                names, init)
        x = x.reshape(x.shape[:x.ndim - self.n_in] + (n,)).astype(self.dtype)

        def plain(x, parts):
            contract = (((x.ndim - 1,), (0,)), ((), ()))
            if fmt == "int8":  # x (q s) = (x q) s: scale the output channels
                y = lax.dot_general(x, parts["q"].astype(self.dtype), contract)
                return y * parts["scale"].astype(self.dtype)
            w = quant.dequantize(parts, fmt, self.block, 0)
            return lax.dot_general(x, w.astype(self.param_dtype).astype(self.dtype), contract)

        if jnp.dtype(self.dtype) == jnp.dtype(self.param_dtype) == jnp.float32 and \
                qmatmul.enabled():  # a tuned process: the CPU kernel (`plain` elsewhere)
            rows = x.reshape(-1, n)
            flat = lambda x, parts: plain(x, parts).reshape(x.shape[0], -1)  # noqa: E731
            y = qmatmul.dot(rows, parts, fmt, self.block, flat)
            y = y.reshape(x.shape[:-1] + features)
        else:
            y = plain(x, parts)
        if self.use_bias:
            bias = self.param("bias", logical(nn.initializers.zeros, self.bias_names),
                              features, self.param_dtype)
            y = y + bias.astype(self.dtype)
        return y


def dense(config: TransformerConfig, role: str, features, kernel_names: tuple,
          bias_names: tuple, *, n_in: int = 1, use_bias: bool, dtype, kernel_init: Callable,
          name: Optional[str] = None) -> nn.Module:
    """The Dense of `config`: `nn.Dense` (one input and output axis) or
    `nn.DenseGeneral` with float kernels, or a `QuantDense` in the layout
    `config.quant_format(role)` ("layers" or "embed")."""
    fmt = config.quant_format(role)
    common = dict(use_bias=use_bias, dtype=dtype, param_dtype=config.params_dtype, name=name)
    bias_init = logical(nn.initializers.zeros, bias_names)
    if fmt is None:
        kernel = logical(kernel_init, kernel_names)
        if isinstance(features, int) and n_in == 1:
            return nn.Dense(features, kernel_init=kernel, bias_init=bias_init,
                            dot_general=tuning.dot_general(config), **common)
        axis = -1 if n_in == 1 else tuple(range(-n_in, 0))
        return nn.DenseGeneral(features=features, axis=axis, kernel_init=kernel,
                               bias_init=bias_init, dot_general=tuning.dot_general(config),
                               **common)
    features = (features,) if isinstance(features, int) else tuple(features)
    return QuantDense(features, n_in, fmt, config.quant_block, tuple(kernel_names),
                      tuple(bias_names), kernel_init=kernel_init,
                      layouts=config.quant_layouts, **common)

"""Opt-in XLA:CPU tuning. Nothing here runs unless asked for.

Two switches, both off by default:

- `tune_process()`: process-wide settings, a call the application makes before
  JAX's backend starts (`jaxformer train` makes it on CPU and says so;
  `--no-cpu-tuning` turns it off). Freed host memory is kept for reuse (glibc
  `mallopt`: no mmap, no trim), one-device CPU calls run on the calling thread,
  and decode loops on a CPU compile with `decode_compiler_options` and run in
  `decode_segments`; quantized float32 Dense layers call the C++ kernel of
  `backends.qmatmul` (built on first use) instead of dequantize-then-dot.
- `TransformerConfig(cpu_tuning=True)`: in-graph tricks, each behind
  `lax.platform_dependent`, so a GPU or TPU lowering never contains them:
  `dot_general` (Dense kernel gradients in the kernel's own layout, a custom
  VJP) and `Dropout` (masks drawn once, in a conditional XLA does not fuse).
  `dropout_key` (the fused threefry of `backends.threefry`) is no longer the
  train step's: that one draws the unrolled threefry on every platform.

Each trick computes the same values as the default path up to float rounding
(the tests check it); why each one pays on XLA:CPU, with figures, is in
`benchmarks/NOTES.md`. The
custom VJP admits no forward-mode autodiff: `jax.jvp` through a model with
`cpu_tuning=True` raises `ForwardModeError` naming the field to change.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import math
import os
import platform
from typing import Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxformer.backends import threefry


class CPUTuningError(RuntimeError):
    """CPU tuning asked for where it cannot apply (JAX's backend already started)."""


class ForwardModeError(TypeError):
    """Forward-mode autodiff through the CPU-tuned layout VJP."""


# --------------------------------------------------------------------------- the process

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # mallopt's parameters (glibc's malloc.h)
_NEVER = -1  # M_TRIM_THRESHOLD is a size_t inside glibc: -1 is its largest value
_PROCESS = {"tuned": False}


def backends_started() -> bool:
    """Whether JAX's backends are up (its device settings are fixed from then on)."""
    try:
        from jax._src import xla_bridge  # noqa: PLC0415 (JAX's own, not public API)
        return xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):  # another JAX: assume started
        return True


_ACCELERATOR_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin",
                        "jax_rocm7_plugin", "libtpu")


def cpu_is_the_backend() -> bool:
    """Whether JAX will run on the CPU, judged without starting it: `JAX_PLATFORMS`
    names the CPU first, or is unset and no GPU or TPU plugin is installed."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    return not any(importlib.util.find_spec(name) for name in _ACCELERATOR_PLUGINS)


def tune_process() -> bool:
    """Keep freed host memory for reuse and run one-device CPU calls inline.

    Call it before JAX's backend starts (before the first array or device
    query). Returns True if the allocator setting took effect, False on a C
    library other than glibc (the decode settings apply either way). Raises
    `CPUTuningError` once JAX's backend has started. An explicit
    `JAX_CPU_ENABLE_ASYNC_DISPATCH` in the environment is left as set.
    """
    if backends_started():
        raise CPUTuningError("CPU tuning must be asked for before JAX's backend starts "
                             "(call jaxformer.backends.cpu.tune_process() before the first "
                             "array or device query)")
    _PROCESS["tuned"] = True
    if "JAX_CPU_ENABLE_ASYNC_DISPATCH" not in os.environ:
        jax.config.update("jax_cpu_enable_async_dispatch", False)
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(param, value) == 1
               for param, value in ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _NEVER)))


def process_tuned() -> bool:
    """Whether `tune_process()` was called in this process."""
    return _PROCESS["tuned"]


# XLA's own dots instead of YNNPACK's for a decode loop on a CPU split into a
# device per core (benchmarks/NOTES.md, "decode").
XLA_DOTS = {"xla_cpu_experimental_ynn_fusion_type": ""}
SEGMENT_STEPS, MAX_SEGMENTS = 32, 4


def decode_compiler_options(backend: str, *, devices: Optional[int] = None,
                            cores: Optional[int] = None) -> Optional[dict]:
    """Compiler options of a decode loop on `backend`: XLA's own dots on a tuned CPU
    process split into a device per core (`devices` >= `cores`); None (XLA's
    defaults) otherwise."""
    if backend != "cpu" or not process_tuned():
        return None
    devices = jax.local_device_count("cpu") if devices is None else devices
    cores = (os.cpu_count() or 1) if cores is None else cores
    return XLA_DOTS if devices >= cores else None


def decode_segments(num_steps: int, backend: str) -> int:
    """Segments of a decode loop whose caller left them open: 1 (one loop over the
    whole cache) unless this is a tuned CPU process, where a step reads only the
    slots written so far: one segment per 32 steps, at most 4."""
    if backend != "cpu" or not process_tuned():
        return 1
    return max(1, min(MAX_SEGMENTS, num_steps // SEGMENT_STEPS))


# --------------------------------------------------------------------------- Dense kernel gradients


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _layout_dot(x, kernel, dimension_numbers, precision, preferred_element_type):
    return lax.dot_general(x, kernel, dimension_numbers, precision, preferred_element_type)


def _layout_dot_fwd(x, kernel, dimension_numbers, precision, preferred_element_type):
    out = _layout_dot(x, kernel, dimension_numbers, precision, preferred_element_type)
    return out, (x, kernel)


def _layout_dot_bwd(dimension_numbers, precision, preferred_element_type, residuals, g):
    """JAX's input gradient; the kernel gradient formed in the kernel's layout, the
    smaller operand transposed (XLA:CPU's matmul takes row-major operands only)."""
    x, kernel = residuals
    (x_in, kernel_in), _ = dimension_numbers
    _, x_vjp = jax.vjp(lambda a: lax.dot_general(a, kernel, dimension_numbers, precision,
                                                 preferred_element_type), x)
    dx, = x_vjp(g)
    # g: (x's token dims..., kernel's out dims...); kernel: (in dims..., out dims...).
    x_tokens = tuple(d for d in range(x.ndim) if d not in x_in)
    g_tokens = tuple(range(len(x_tokens)))
    in_size = math.prod(x.shape[d] for d in x_in)
    if in_size <= kernel.size // in_size:  # in <= out: transpose x; product (in..., out...)
        dk = lax.dot_general(x, g, ((x_tokens, g_tokens), ((), ())), precision,
                             preferred_element_type)
    else:  # transpose g, the smaller; product (out..., in...), transposed once after
        dk_t = lax.dot_general(g, x, ((g_tokens, x_tokens), ((), ())), precision,
                               preferred_element_type)
        out_ndim = kernel.ndim - len(kernel_in)
        dk = _transpose_unfused(dk_t, tuple(range(out_ndim, kernel.ndim))
                                + tuple(range(out_ndim)))
    return dx, dk.astype(kernel.dtype)


_layout_dot.defvjp(_layout_dot_fwd, _layout_dot_bwd)


def _transpose_unfused(product, axes):
    """`product.transpose(axes)` inside a conditional (both branches the transpose,
    a predicate unknown before run time): XLA cannot fold the transpose into the
    dot that made `product`, which would then read an operand column-major. The
    result leaves flattened, so its layout is row-major for every reader."""
    transposed_shape = tuple(product.shape[a] for a in axes)

    def transpose_flat(a):
        return a.transpose(axes).reshape(-1)

    first = product.reshape(-1)[0]
    return lax.cond(first != first, transpose_flat, transpose_flat,
                    product).reshape(transposed_shape)


def dot_general(x, kernel, dimension_numbers, precision=None, preferred_element_type=None):
    """`lax.dot_general` for a Flax Dense/DenseGeneral; on the CPU its kernel gradient
    comes out in the kernel's layout (`_layout_dot_bwd`). Other backends, and other
    dimension numbers (batch dims, unsorted axes), get `lax.dot_general` itself."""
    (x_in, kernel_in), (x_batch, _) = dimension_numbers
    plain = functools.partial(lax.dot_general, dimension_numbers=dimension_numbers,
                              precision=precision,
                              preferred_element_type=preferred_element_type)
    if x_batch or tuple(kernel_in) != tuple(range(len(kernel_in))) or \
            list(x_in) != sorted(x_in):
        return plain(x, kernel)
    numbers = (tuple(map(tuple, dimension_numbers[0])), ((), ()))
    try:
        return lax.platform_dependent(
            x, kernel, default=plain,
            cpu=lambda a, k: _layout_dot(a, k, numbers, precision, preferred_element_type))
    except TypeError as e:
        if "forward-mode" not in str(e):
            raise
        raise ForwardModeError(
            "forward-mode autodiff (jax.jvp, jax.jacfwd) cannot go through the CPU-tuned "
            "layout VJP: build the model with TransformerConfig(cpu_tuning=False)") from e


# --------------------------------------------------------------------------- dropout


def keep_mask(rng: jax.Array, keep_prob: float, shape: Sequence[int]) -> jnp.ndarray:
    """Boolean (shape), True with probability `keep_prob`: the bits of
    `jax.random.bernoulli(rng, keep_prob, shape)`. On the CPU they are drawn inside a
    conditional, so the mask is computed once and stored instead of its threefry
    hash being fused into (and recompiled for) every user."""
    shape = tuple(shape)

    def draw(key):
        return jax.random.bernoulli(key, keep_prob, shape)

    def unfused(key):
        words = jax.random.key_data(key) if jnp.issubdtype(key.dtype,
                                                           jax.dtypes.prng_key) else key
        # Always true, but only at run time ((w | 1) != 0): a constant predicate would be
        # folded away. The word is read through a sort, which XLA does not fuse, so the
        # predicate does not recompute the key's own derivation.
        always = (jnp.sort(words.reshape(-1))[0].astype(jnp.uint32) | np.uint32(1)) != 0
        return lax.cond(always, draw, lambda _: jnp.ones(shape, jnp.bool_), key)

    return lax.platform_dependent(rng, cpu=unfused, default=draw)


class Dropout(nn.Dropout):
    """`flax.linen.Dropout` (a subclass of the same name: the same auto-names, `make_rng`
    keys and output) whose mask comes from `keep_mask`."""

    @nn.compact
    def __call__(self, inputs: jnp.ndarray, deterministic: Optional[bool] = None,
                 rng: Optional[jax.Array] = None) -> jnp.ndarray:
        deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
        if self.rate == 0.0 or deterministic:
            return inputs
        if self.rate == 1.0:  # as flax: no division by zero
            return jnp.zeros_like(inputs)
        if rng is None:
            rng = self.make_rng(self.rng_collection)
        keep_prob = 1.0 - self.rate
        mask_shape = [1 if d in self.broadcast_dims else n for d, n in enumerate(inputs.shape)]
        mask = jnp.broadcast_to(keep_mask(rng, keep_prob, mask_shape), inputs.shape)
        return lax.select(mask, inputs / keep_prob, jnp.zeros_like(inputs))


def dropout_key(rng: jax.Array, step) -> jax.Array:
    """`jax.random.fold_in(rng, step)`; a raw threefry key (uint32 (2,)) becomes a key of
    `threefry.FUSED_THREEFRY`, which draws the same bits as one fused kernel per mask on
    the CPU and as JAX's threefry elsewhere. Other key kinds are left as they are."""
    if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key) or rng.shape != (2,) or \
            jax.config.jax_default_prng_impl != "threefry2x32":
        return jax.random.fold_in(rng, step)
    return jax.random.fold_in(threefry.fused(rng), step)

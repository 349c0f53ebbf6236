"""Dense layers whose kernel gradient comes out in the kernel's own layout.

A Dense kernel's gradient dK = x^T g contracts the tokens, the leading
dimension of both x (tokens, in) and g (tokens, out). XLA:CPU's matmul kernel
(YNNPACK) takes row-major operands only, so XLA copies one operand transposed
first. JAX's transpose rule emits dot(g, x): XLA transposes g and the product
is dK^T (out, in), which every reader (the gradient norm, AdamW's two moments)
then reads through a transpose fused into its own loop, with a strided read
that XLA's CPU loop emitter runs about 5x slower than the same transpose alone
(285 against 61 us for a (32, 33, 256) array, select and scale fused vs a plain
copy). The operand transposed is also the larger one in half the FFN.

`dot_general` is `lax.dot_general` with its own VJP. The kernel's gradient is
dot(x, g) when the kernel has no more inputs than outputs, so XLA transposes x,
the smaller operand or an equal one, and the product is already (in, out);
otherwise dot(g, x), transposed once (a kernel-sized copy). The input's gradient
is JAX's own. The math is the same; float32 sums run in another order (the
gradients agree to about 1e-6 relative).

Bench train step (`benchmarks/train.py` sizes, interleaved in one process,
against `kernel_grad="autodiff"`): 155 against 173 ms a step; the step's copy
kernels 19 against 31 ms.

A custom VJP admits no forward-mode autodiff, so `jax.jvp` / `jax.jacfwd`
through the model need `TransformerConfig(kernel_grad="autodiff")`: JAX's own
rule, `lax.dot_general` as it is. Scanned stacks and remat keep JAX's rule too
(`for_config`).
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
from jax import lax


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _dense_dot(x, kernel, dimension_numbers, precision, preferred_element_type):
    return lax.dot_general(x, kernel, dimension_numbers, precision, preferred_element_type)


def _dense_dot_fwd(x, kernel, dimension_numbers, precision, preferred_element_type):
    out = _dense_dot(x, kernel, dimension_numbers, precision, preferred_element_type)
    return out, (x, kernel)


def _dense_dot_bwd(dimension_numbers, precision, preferred_element_type, residuals, g):
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
        dk = _transpose_unfolded(dk_t, tuple(range(out_ndim, kernel.ndim))
                                 + tuple(range(out_ndim)))
    return dx, dk.astype(kernel.dtype)


_dense_dot.defvjp(_dense_dot_fwd, _dense_dot_bwd)


def _transpose_unfolded(product, axes):
    """`product.transpose(axes)`, on the CPU behind a conditional whose two branches
    are this same transpose. Left bare, XLA folds the transpose into the dot that
    made `product`; the dot then reads an operand column-major, which YNNPACK does
    not take, and runs as XLA's own dot: the FFN's (1056, 1024) x (1056, 256)
    weight gradients took about 2.4 ms each so, 7 ms a bench train step in all
    (155 against 162 ms interleaved). A conditional is a fusion boundary; its
    predicate (a NaN test) only has to be unknown before run time.

    The branches return the transpose flattened, reshaped to 2-D after: a 1-D
    result has one layout, so the transpose is done inside, once. Returned as
    2-D, XLA gave the conditional's result the column-major layout that makes the
    transpose a bitcast, and each consumer (the clip's divide, AdamW) read it
    through a strided, fused transpose, 0.65 ms each for the FFN's (1024, 256):
    10 ms less kernel time a bench train step, 164.8 vs 166.2 ms interleaved."""
    transposed_shape = tuple(product.shape[a] for a in axes)

    def transpose_flat(a):
        return a.transpose(axes).reshape(-1)

    def unfolded(p):
        first = p.reshape(-1)[0]
        return lax.cond(first != first, transpose_flat, transpose_flat,
                        p).reshape(transposed_shape)

    return lax.platform_dependent(product, cpu=unfolded,
                                  default=lambda p: p.transpose(axes))


def dot_general(x, kernel, dimension_numbers, precision=None, preferred_element_type=None):
    """`lax.dot_general(x, kernel, ...)` for a Flax Dense/DenseGeneral: contracting x's
    `axis` dims (ascending) with the kernel's leading dims, no batch dims; its kernel
    gradient in the kernel's layout (module docstring). Other dimension numbers go
    to `lax.dot_general` as they are."""
    (x_in, kernel_in), (x_batch, _) = dimension_numbers
    if x_batch or tuple(kernel_in) != tuple(range(len(kernel_in))) or \
            list(x_in) != sorted(x_in):
        return lax.dot_general(x, kernel, dimension_numbers, precision,
                               preferred_element_type)
    return _dense_dot(x, kernel, (tuple(map(tuple, dimension_numbers[0])), ((), ())),
                      precision, preferred_element_type)


def for_config(config) -> Callable:
    """The `dot_general` a Dense of `config` uses: this module's for
    `kernel_grad="layout"` in an unrolled stack without remat; `lax.dot_general`
    for "autodiff", and wherever a checkpoint policy must see the matmuls (a
    policy sees a custom VJP as one opaque call: remat="save_dots" would keep
    no projection, and a scanned stack, whose policy keeps its dots, would
    recompute them all in the backward pass)."""
    if config.kernel_grad == "layout" and config.remat == "none" and not config.scan_layers:
        return dot_general
    return lax.dot_general

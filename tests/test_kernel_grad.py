"""jaxformer.kernel_grad: Dense layers whose kernel gradient is formulated for the
kernel's layout give JAX's own outputs and gradients, produce the kernel gradient
as the module says (no transpose after the dot when in <= out), and leave
forward-mode autodiff to kernel_grad="autodiff"."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxformer as jf
from jaxformer import kernel_grad

from conftest import numpy_params, random_tokens

# (module, input shape): in < out, in > out, in == out, and DenseGeneral both ways
DENSES = {
    "dense_up": (lambda dg: nn.Dense(24, dot_general=dg), (2, 5, 8)),
    "dense_down": (lambda dg: nn.Dense(8, dot_general=dg), (2, 5, 24)),
    "dense_square": (lambda dg: nn.Dense(8, dot_general=dg), (10, 8)),
    "heads_split": (lambda dg: nn.DenseGeneral((4, 3), dot_general=dg), (2, 5, 8)),
    "heads_merge": (lambda dg: nn.DenseGeneral(8, axis=(-2, -1), dot_general=dg),
                    (2, 5, 4, 3)),
}


def _value_and_grads(make, shape, dot_general):
    module = make(dot_general)
    x = jnp.asarray(np.random.default_rng(0).standard_normal(shape), jnp.float32)
    params = module.init(jax.random.PRNGKey(0), x)

    def loss(params, x):
        y = module.apply(params, x)
        return jnp.sum(jnp.sin(y) * jnp.arange(y.size).reshape(y.shape)), y

    (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
    return y, grads


@pytest.mark.parametrize("name", DENSES)
def test_outputs_and_gradients_equal_jax_own_rule(name):
    make, shape = DENSES[name]
    y_want, grads_want = _value_and_grads(make, shape, lax.dot_general)
    y_got, grads_got = _value_and_grads(make, shape, kernel_grad.dot_general)
    np.testing.assert_array_equal(y_got, y_want)  # the forward is lax.dot_general itself
    for got, want in zip(jax.tree_util.tree_leaves(grads_got),
                         jax.tree_util.tree_leaves(grads_want)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _kernel_grad_eqns(dot_general, in_size, out_size):
    """(the kernel gradient's dots: those contracting the (2, 5) token dims, the
    transposes) of d/dkernel sum(x @ kernel) for x (2, 5, in)."""
    x, kernel = jnp.ones((2, 5, in_size)), jnp.ones((in_size, out_size))
    dims = (((2,), (0,)), ((), ()))
    grad = jax.grad(lambda k: jnp.sum(dot_general(x, k, dims)))
    eqns = jax.make_jaxpr(grad)(kernel).jaxpr.eqns
    tokens = ((0, 1), (0, 1))
    return ([e.outvars[0].aval.shape for e in eqns if e.primitive is lax.dot_general_p
             and tuple(map(tuple, e.params["dimension_numbers"][0])) == tokens],
            [e for e in eqns if e.primitive is lax.transpose_p])


@pytest.mark.parametrize("in_size, out_size", [(8, 24), (8, 8), (24, 8)])
def test_kernel_gradient_is_one_dot_in_the_kernels_layout_when_in_le_out(in_size, out_size):
    dots, transposes = _kernel_grad_eqns(kernel_grad.dot_general, in_size, out_size)
    if in_size <= out_size:  # x transposed by XLA; the product is (in, out) already
        assert dots == [(in_size, out_size)] and not transposes
    else:  # g, the smaller, transposed by XLA; the (out, in) product transposed after,
        assert dots == [(out_size, in_size)] and not transposes  # inside a conditional
    # JAX's own rule always forms (out, in) and transposes it
    dots, transposes = _kernel_grad_eqns(lax.dot_general, in_size, out_size)
    assert dots == [(out_size, in_size)] and len(transposes) == 1


def test_compiled_kernel_gradient_keeps_its_out_in_product():
    """in > out: the kernel gradient is the (out, in) product dot(g, x), transposed
    after. Left bare, XLA folds that transpose into the dot, which then forms (in, out)
    reading x column-major (a dot YNNPACK does not take): the compiled program must
    still compute the (out, in) product."""
    x = jnp.ones((64, 48))
    grad = jax.jit(jax.grad(lambda k: jnp.sum(jnp.sin(kernel_grad.dot_general(
        x, k, (((1,), (0,)), ((), ())))))))
    hlo = grad.lower(jnp.ones((48, 16))).compile().as_text()
    products = re.findall(r"= (f32\[\d+,\d+\])\{[\d,]+\} (?:dot|fusion)\(.*(?:dot_general|__ynn)", hlo)
    assert "f32[16,48]" in products and "f32[48,16]" not in products, products


def test_compiled_kernel_gradient_is_row_major_for_its_users():
    """in > out: the transposed kernel gradient reaches its users (here an update
    like the optimizer's) row-major. Were the transpose a layout change (a bitcast),
    each user would read it through a strided transpose of its own."""
    x = jnp.ones((64, 48))

    def update(kernel):
        grad = jax.grad(lambda k: jnp.sum(jnp.sin(kernel_grad.dot_general(
            x, k, (((1,), (0,)), ((), ()))))))(kernel)
        return kernel - grad / jnp.sqrt(jnp.sum(grad * grad))
    hlo = jax.jit(update).lower(jnp.ones((48, 16))).compile().as_text()
    results = re.findall(r"= \((f32\[[\d,]+\]\{[\d,]+\})\) conditional\(", hlo)
    assert results and "f32[48,16]{0,1}" not in results, results


def test_other_dimension_numbers_go_to_lax_dot_general():
    x, kernel = jnp.ones((3, 4, 5)), jnp.ones((3, 5, 6))
    batched = (((2,), (1,)), ((0,), (0,)))  # a batch dimension: not a Dense
    eqns = jax.make_jaxpr(lambda a, b: kernel_grad.dot_general(a, b, batched))(x, kernel).eqns
    assert [e.primitive for e in eqns] == [lax.dot_general_p]


def _model_loss(model, params, src, tgt):
    return jnp.sum(jnp.sin(model.apply({"params": params}, src, tgt)))


@pytest.mark.parametrize("overrides", [{}, {"precision": "mixed"}], ids=["float32", "mixed"])
def test_model_gradients_equal_autodiff(overrides):
    config = jf.config.tiny(norm="pre", gated_ffn=True, activation="silu", **overrides)
    src = random_tokens(0, (2, 6), config.src_vocab_size)
    tgt = random_tokens(1, (2, 5), config.tgt_vocab_size)
    params = numpy_params(jf.Transformer(config), src, tgt)
    grad = jax.jit(jax.grad(_model_loss, argnums=1), static_argnums=0)
    got = grad(jf.Transformer(config), params, src, tgt)
    want = grad(jf.Transformer(config.replace(kernel_grad="autodiff")), params, src, tgt)
    tolerance = 1e-5 if config.precision == "default" else 1e-2  # bfloat16 compute
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(a, b, rtol=tolerance * 10, atol=tolerance)


def test_checkpoint_policies_keep_jax_own_rule():
    """Only an unrolled stack without remat uses the custom VJP (a policy must see
    the dots it keeps: tests/test_remat.py)."""
    config = jf.config.tiny()
    assert kernel_grad.for_config(config) is kernel_grad.dot_general
    assert kernel_grad.for_config(config.replace(kernel_grad="autodiff")) is lax.dot_general
    for overrides in ({"scan_layers": True}, {"remat": "save_dots"}, {"remat": "full"}):
        assert kernel_grad.for_config(config.replace(**overrides)) is lax.dot_general


def test_forward_mode_needs_autodiff():
    config = jf.config.tiny()
    src = random_tokens(0, (2, 6), config.src_vocab_size)
    tgt = random_tokens(1, (2, 5), config.tgt_vocab_size)
    params = numpy_params(jf.Transformer(config), src, tgt)
    tangent = jax.tree_util.tree_map(jnp.ones_like, params)

    def jvp(config):
        model = jf.Transformer(config)
        return jax.jvp(lambda p: _model_loss(model, p, src, tgt), (params,), (tangent,))

    value, derivative = jvp(config.replace(kernel_grad="autodiff"))
    # the directional derivative is the gradient's inner product with the tangent
    grads = jax.grad(_model_loss, argnums=1)(jf.Transformer(config), params, src, tgt)
    np.testing.assert_allclose(derivative, sum(jnp.sum(g) for g in
                                               jax.tree_util.tree_leaves(grads)), rtol=1e-4)
    with pytest.raises(TypeError, match="custom_vjp"):
        jvp(config)


def test_kernel_grad_is_validated():
    with pytest.raises(ValueError, match="kernel_grad"):
        jf.config.tiny(kernel_grad="fast")

"""jaxformer.backends.cpu: every trick computes what the default path computes, a GPU
or TPU program never contains one, and nothing happens unless asked for."""

import json
import os
import re
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxformer as jf
from jaxformer.backends import cpu, threefry
from jaxformer.nn import tuning
from jaxformer.train.step import dropout_key

from conftest import REPO, numpy_params, random_tokens

KEY = jax.random.PRNGKey(7)

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


# -- the layout VJP -----------------------------------------------------------------------


@pytest.mark.parametrize("name", DENSES)
def test_layout_dot_outputs_and_gradients_equal_jax_own_rule(name):
    make, shape = DENSES[name]
    y_want, grads_want = _value_and_grads(make, shape, lax.dot_general)
    y_got, grads_got = _value_and_grads(make, shape, cpu.dot_general)
    np.testing.assert_array_equal(y_got, y_want)  # the forward is lax.dot_general itself
    for got, want in zip(jax.tree_util.tree_leaves(grads_got),
                         jax.tree_util.tree_leaves(grads_want)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _kernel_grad_dots(dot_general, in_size, out_size):
    """The shapes of the kernel gradient's dots (those contracting the (2, 5) token
    dims) in the CPU program of d/dkernel sum(x @ kernel), x (2, 5, in)."""
    x, kernel = jnp.ones((2, 5, in_size)), jnp.ones((in_size, out_size))
    dims = (((2,), (0,)), ((), ()))
    grad = jax.grad(lambda k: jnp.sum(dot_general(x, k, dims)))
    text = jax.jit(grad).trace(kernel).lower(lowering_platforms=("cpu",)).as_text()
    return re.findall(r"stablehlo.dot_general %\S+, %\S+, contracting_dims = \[0, 1\] x "
                      r"\[0, 1\].*-> tensor<(\d+)x(\d+)xf32>", text)


@pytest.mark.parametrize("in_size, out_size", [(8, 24), (8, 8), (24, 8)])
def test_layout_dot_forms_the_kernel_gradient_with_the_smaller_operand_transposed(
        in_size, out_size):
    dots = _kernel_grad_dots(cpu.dot_general, in_size, out_size)
    if in_size <= out_size:  # the product is (in, out) already
        assert dots == [(str(in_size), str(out_size))]
    else:  # g, the smaller, transposed; the (out, in) product transposed after
        assert dots == [(str(out_size), str(in_size))]
    # JAX's own rule always forms (out, in)
    assert _kernel_grad_dots(lax.dot_general, in_size, out_size) == [
        (str(out_size), str(in_size))]


def test_compiled_kernel_gradient_is_row_major_for_its_users():
    """in > out: the transposed kernel gradient reaches its users (here an update
    like the optimizer's) row-major, not through a strided transpose of their own."""
    x = jnp.ones((64, 48))

    def update(kernel):
        grad = jax.grad(lambda k: jnp.sum(jnp.sin(cpu.dot_general(
            x, k, (((1,), (0,)), ((), ()))))))(kernel)
        return kernel - grad / jnp.sqrt(jnp.sum(grad * grad))
    hlo = jax.jit(update).lower(jnp.ones((48, 16))).compile().as_text()
    results = re.findall(r"= \((f32\[[\d,]+\]\{[\d,]+\})\) conditional\(", hlo)
    assert results and "f32[48,16]{0,1}" not in results, results


def test_other_dimension_numbers_go_to_lax_dot_general():
    x, kernel = jnp.ones((3, 4, 5)), jnp.ones((3, 5, 6))
    batched = (((2,), (1,)), ((0,), (0,)))  # a batch dimension: not a Dense
    eqns = jax.make_jaxpr(lambda a, b: cpu.dot_general(a, b, batched))(x, kernel).eqns
    assert [e.primitive for e in eqns] == [lax.dot_general_p]


def test_only_unrolled_stacks_without_remat_use_the_layout_vjp():
    """A checkpoint policy must see the dots it keeps; a custom VJP is one opaque call."""
    config = jf.tiny(cpu_tuning=True)
    assert tuning.dot_general(config) is cpu.dot_general
    assert tuning.dot_general(config.replace(cpu_tuning=False)) is lax.dot_general
    for overrides in ({"scan_layers": True}, {"remat": "save_dots"}, {"remat": "full"}):
        assert tuning.dot_general(config.replace(**overrides)) is lax.dot_general


def test_forward_mode_through_the_layout_vjp_names_the_field_to_change():
    config = jf.tiny(cpu_tuning=True)
    src = random_tokens(0, (2, 6), config.src_vocab_size)
    tgt = random_tokens(1, (2, 5), config.tgt_vocab_size)
    model = jf.Transformer(config)
    params = numpy_params(model, src, tgt)
    tangent = jax.tree_util.tree_map(jnp.ones_like, params)
    with pytest.raises(cpu.ForwardModeError, match=r"cpu_tuning=False"):
        jax.jvp(lambda p: model.apply({"params": p}, src, tgt).sum(), (params,), (tangent,))


# -- dropout ------------------------------------------------------------------------------


@pytest.mark.parametrize("key", [KEY, threefry.fused(KEY)], ids=["raw", "fused"])
def test_keep_mask_is_jax_bernoulli(key):
    for shape in [(), (5,), (32, 33, 64)]:
        expected = jax.random.bernoulli(key, 0.9, shape)
        np.testing.assert_array_equal(cpu.keep_mask(key, 0.9, shape), expected)
        np.testing.assert_array_equal(
            jax.jit(cpu.keep_mask, static_argnums=(1, 2))(key, 0.9, shape), expected)
    assert not np.array_equal(cpu.keep_mask(key, 0.9, (64,)), cpu.keep_mask(key, 0.5, (64,)))


class _Sublayer(nn.Module):
    """Two dropout sites as the model's layers name them: one auto-named, one from setup."""

    dropout_cls: type

    def setup(self):
        self.dropout = self.dropout_cls(0.25)

    @nn.compact
    def __call__(self, x):
        h = self.dropout_cls(0.1)(nn.Dense(8)(x), deterministic=False)
        return self.dropout(h, deterministic=False)


def test_tuned_dropout_is_flax_dropout_values_and_gradients():
    x = jax.random.normal(KEY, (4, 6, 8))
    ours, flax_ = _Sublayer(cpu.Dropout), _Sublayer(nn.Dropout)
    params = flax_.init(KEY, x)["params"]
    assert jax.tree.structure(ours.init(KEY, x)["params"]) == jax.tree.structure(params)

    def loss(module, params, x):
        out = module.apply({"params": params}, x, rngs={"dropout": threefry.fused(KEY)})
        return jnp.sum(out ** 2), out

    (l1, out1), g1 = jax.jit(jax.value_and_grad(lambda p: loss(ours, p, x), has_aux=True))(params)
    (l2, out2), g2 = jax.jit(jax.value_and_grad(lambda p: loss(flax_, p, x),
                                                has_aux=True))(params)
    np.testing.assert_array_equal(out1 == 0, out2 == 0)  # the same mask
    np.testing.assert_allclose(out1, out2, rtol=1e-6)
    assert 0 < np.mean(np.asarray(out1) == 0) < 0.5  # some, not all, dropped
    np.testing.assert_allclose(l1, l2, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g1, g2)
    other = ours.apply({"params": params}, x, rngs={"dropout": threefry.fused(KEY + 1)})
    assert not np.array_equal(other, out1)


def _hash_kernels(hlo_text: str, shape: tuple) -> int:
    """Compiled computations that run threefry's rotations on an array of `shape`."""
    dims = ",".join(map(str, shape))
    computations = re.split(r"\n(?=%|ENTRY)", hlo_text)
    return sum(bool(re.search(rf"u32\[{dims}\]\S* shift-left\(", c)) for c in computations)


def test_the_tuned_mask_is_computed_once_for_forward_and_backward():
    shape = (64, 128)
    w = jax.random.normal(KEY, (128, 128))

    def loss(w, x, key):  # the mask has users in the forward and in both gradients
        h = tuning.apply_dropout(jax.nn.relu(x @ w), 0.1, key, cpu.keep_mask)
        return jnp.sum((h @ w) ** 2)

    x = jax.random.normal(KEY, shape)
    key = threefry.fused(KEY)
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(w, x, key).compile().as_text()
    assert _hash_kernels(hlo, shape) == 1

    def twice(w, x, key):  # the counter finds the hash: two masks are two kernels
        return loss(w, x, key) + loss(w, x, jax.random.fold_in(key, 1))
    hlo = jax.jit(jax.grad(twice, argnums=(0, 1))).lower(w, x, key).compile().as_text()
    assert _hash_kernels(hlo, shape) == 2


# -- fused threefry -----------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(), (7,), (4, 7, 3), (32, 33, 64)])
@pytest.mark.parametrize("dtype", [jnp.uint8, jnp.uint32])
@pytest.mark.parametrize("wrap", [threefry.fused, threefry.unrolled], ids=["fused", "unrolled"])
def test_fused_random_bits_equal_jax_threefry(shape, dtype, wrap):
    for key in (KEY, jax.random.fold_in(KEY, 99)):
        np.testing.assert_array_equal(jax.random.bits(wrap(key), shape, dtype),
                                      jax.random.bits(key, shape, dtype))


@pytest.mark.parametrize("wrap", [threefry.fused, threefry.unrolled], ids=["fused", "unrolled"])
def test_fused_keys_and_distributions_equal_jax_threefry(wrap):
    fused = wrap(KEY)
    same = np.testing.assert_array_equal
    same(jax.random.key_data(jax.random.fold_in(fused, 7)), jax.random.fold_in(KEY, 7))
    same(jax.random.key_data(jax.random.split(fused, (3, 2))), jax.random.split(KEY, (3, 2)))
    same(jax.random.bernoulli(fused, 0.9, (64, 33)), jax.random.bernoulli(KEY, 0.9, (64, 33)))
    same(jax.random.normal(fused, (5, 6)), jax.random.normal(KEY, (5, 6)))
    assert not np.array_equal(jax.random.bits(fused, (64,)),
                              jax.random.bits(wrap(jax.random.PRNGKey(1)), (64,)))


def test_the_fallback_for_huge_arrays_draws_the_same(monkeypatch):
    expected = jax.random.bits(KEY, (6, 5))
    monkeypatch.setattr(threefry, "_huge", lambda shape: True)  # > 2**32 elements
    np.testing.assert_array_equal(jax.random.bits(threefry.fused(KEY), (6, 5)), expected)


def test_a_fused_mask_compiles_to_one_loop_free_kernel_on_the_cpu():
    def mask(key):
        return jax.random.bernoulli(jax.random.fold_in(key, 3), 0.9, (32, 33, 256))

    fused = jax.jit(mask).lower(threefry.fused(KEY)).compile().as_text()
    unrolled = jax.jit(mask).lower(threefry.unrolled(KEY)).compile().as_text()
    plain = jax.jit(mask).lower(jax.random.wrap_key_data(KEY)).compile().as_text()
    assert " while(" not in fused and " while(" not in unrolled and " while(" in plain


def test_the_dropout_key_is_jax_fold_in_tuned_or_not():
    tuned = jf.tiny(cpu_tuning=True)
    for step in (0, 7, 2 ** 31 - 1):
        want = jax.random.fold_in(KEY, step)
        for config in (None, jf.tiny(), tuned):
            got = dropout_key(KEY, jnp.int32(step), config)
            assert jax.random.key_impl(got) == threefry.UNROLLED_THREEFRY
            np.testing.assert_array_equal(jax.random.key_data(got), want)
            np.testing.assert_array_equal(jax.random.bernoulli(got, 0.9, (33, 7)),
                                          jax.random.bernoulli(want, 0.9, (33, 7)))


def test_the_dropout_key_keeps_the_users_prng_implementation():
    """A typed key of another implementation (TPU users pick rbg) stays that kind."""
    key = jax.random.key(3, impl="rbg")
    for config in (None, jf.tiny(cpu_tuning=True)):
        got = dropout_key(key, jnp.int32(5), config)
        assert jax.random.key_impl(got) == jax.random.key_impl(key)
        np.testing.assert_array_equal(jax.random.key_data(got),
                                      jax.random.key_data(jax.random.fold_in(key, 5)))


# -- whole models: same results, and what an accelerator would compile ---------------------

DROPOUT = dict(attention_dropout=0.1, residual_dropout=0.1, embedding_dropout=0.1,
               ffn_dropout=0.1)


def _train_step_fn(config, key_fn=dropout_key):
    model = jf.Transformer(config)

    def step(params, src, tgt, rng):
        def loss(p):
            out = model.apply({"params": p}, src, tgt, deterministic=False,
                              rngs={"dropout": key_fn(rng, jnp.int32(3), config)})
            return jnp.mean(jnp.sin(out))
        return jax.value_and_grad(loss)(params)
    return model, step


@pytest.fixture(scope="module")
def train_inputs():
    config = jf.tiny(norm="pre", gated_ffn=True, activation="silu", **DROPOUT)
    src = random_tokens(0, (2, 6), config.src_vocab_size)
    tgt = random_tokens(1, (2, 5), config.tgt_vocab_size)
    params = numpy_params(jf.Transformer(config), src, tgt)
    return config, (params, src, tgt, KEY)


def test_tuned_train_step_equals_the_default_one(train_inputs):
    config, args = train_inputs
    (loss_d, grads_d) = jax.jit(_train_step_fn(config)[1])(*args)
    (loss_t, grads_t) = jax.jit(_train_step_fn(config.replace(cpu_tuning=True))[1])(*args)
    np.testing.assert_allclose(loss_t, loss_d, rtol=1e-6)  # same masks; fused otherwise
    for a, b in zip(jax.tree_util.tree_leaves(grads_t), jax.tree_util.tree_leaves(grads_d)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)  # sums in another order


def test_the_unrolled_dropout_key_trains_as_jax_own_threefry(train_inputs):
    """The default step's key (the unrolled threefry) against `jax.random.fold_in` of the
    raw key (JAX's own threefry, as before): the same masks, so the same loss and
    gradients up to float rounding (XLA fuses the two programs differently)."""
    config, args = train_inputs

    def jax_own(rng, step, _config):
        return jax.random.fold_in(rng, step)

    loss_u, grads_u = jax.jit(_train_step_fn(config)[1])(*args)
    loss_j, grads_j = jax.jit(_train_step_fn(config, jax_own)[1])(*args)
    np.testing.assert_allclose(loss_u, loss_j, rtol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(grads_u), jax.tree_util.tree_leaves(grads_j)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _ops(text: str) -> dict:
    """Histogram of the StableHLO ops of a lowering, without the (single-branch)
    conditionals `lax.platform_dependent` leaves when lowered for one platform."""
    ops = re.findall(r"stablehlo\.([a-z_]+)", text)
    skip = {"case", "return", "constant"}
    counts = {}
    for op in ops:
        if op not in skip:
            counts[op] = counts.get(op, 0) + 1
    return counts


def test_the_default_train_step_draws_its_masks_without_a_loop(train_inputs):
    """The default step's dropout masks come from the unrolled threefry (the dropout
    key, `train.step.dropout_key`): no rolled loop whose state words for every mask
    would be alive at once (134 of the bench step's 373 MiB of temporaries)."""
    config, args = train_inputs
    hlo = jax.jit(_train_step_fn(config)[1]).lower(*args).compile().as_text()
    assert " while(" not in hlo


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_accelerator_programs_hold_no_cpu_trick(train_inputs, platform):
    """The default step lowered for a GPU or TPU holds no conditional at all; the tuned
    one holds the default program's ops exactly (the CPU branches are not lowered)."""
    config, args = train_inputs

    def lowered(c):
        return jax.jit(_train_step_fn(c)[1]).trace(*args).lower(
            lowering_platforms=(platform,)).as_text()

    default, tuned = lowered(config), lowered(config.replace(cpu_tuning=True))
    assert "stablehlo.case" not in default and "stablehlo.if" not in default
    assert _ops(tuned) == _ops(default)
    on_cpu = jax.jit(_train_step_fn(config.replace(cpu_tuning=True))[1]).trace(*args).lower(
        lowering_platforms=("cpu",)).as_text()
    assert _ops(on_cpu) != _ops(default)  # ... which the CPU program does hold


# -- the process ---------------------------------------------------------------------------


def _run(code: str, env=None) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, **(env or {})}, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


IMPORT_CHANGES_NOTHING = """
import json, resource
import numpy as np
def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20
import jax
async_before = jax.config.read("jax_cpu_enable_async_dispatch")
import jaxformer
from jaxformer.backends import cpu
started = cpu.backends_started()
a = np.ones(512 * 2**20 // 8)  # 512 MiB, touched
peak = rss_mib()
del a
print(json.dumps({"async": [async_before, jax.config.read("jax_cpu_enable_async_dispatch")],
                  "started": started, "kept_mib": rss_mib() - (peak - 512),
                  "tuned": cpu.process_tuned()}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_import_changes_no_process_state():
    got = _run(IMPORT_CHANGES_NOTHING)
    assert got["async"][0] == got["async"][1]
    assert not got["started"] and not got["tuned"]
    assert got["kept_mib"] < 64, got  # the freed 512 MiB went back to the system


TUNE_PROCESS = """
import json, jax
from jaxformer.backends import cpu
took = cpu.tune_process()
x = jax.numpy.ones(3).sum()  # the backend starts
try:
    cpu.tune_process()
    late = "accepted"
except cpu.CPUTuningError as e:
    late = str(e)
print(json.dumps({"took": took, "async": jax.config.read("jax_cpu_enable_async_dispatch"),
                  "tuned": cpu.process_tuned(), "late": late,
                  "options": cpu.decode_compiler_options("cpu", devices=2, cores=2),
                  "segments": cpu.decode_segments(128, "cpu"),
                  "gpu_segments": cpu.decode_segments(128, "gpu")}))
"""


def test_tune_process_is_an_explicit_call_refused_once_jax_started():
    env = {k: v for k, v in os.environ.items() if k != "JAX_CPU_ENABLE_ASYNC_DISPATCH"}
    got = _run(TUNE_PROCESS, env=env)
    assert got["tuned"] and got["async"] is False
    assert "before JAX's backend starts" in got["late"]
    assert got["options"] == cpu.XLA_DOTS and got["segments"] == 4
    assert got["gpu_segments"] == 1
    # untuned (this process): XLA's defaults, one segment
    assert cpu.decode_compiler_options("cpu", devices=2, cores=2) is None
    assert cpu.decode_segments(128, "cpu") == 1

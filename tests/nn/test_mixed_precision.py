"""precision="mixed": float32 parameters, gradients and optimizer state; bfloat16
operands in the projections' dots; float32 logits; refused where bf16 is not."""

import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest

import jaxformer as jf
from jaxformer.nn.precision import check_backend
from jaxformer.train.tasks import Batch
from jaxformer.train import make_optimizer, make_train_step, TrainConfig, TrainState

from conftest import random_tokens

DOT = re.compile(r"stablehlo\.dot_general .*: \(tensor<([0-9x]+)x(\w+)>, tensor<([0-9x]+)x(\w+)>\)")


def _setup(**overrides):
    config = jf.config.tiny(num_encoder_layers=1, num_decoder_layers=1, **overrides)
    src = random_tokens(0, (2, 5), config.src_vocab_size)
    tgt = random_tokens(1, (2, 5), config.tgt_vocab_size).at[:, 0].set(1)
    model = jf.Transformer(config)
    return model, model.init(jax.random.PRNGKey(0), src, tgt)["params"], src, tgt


def _dots(model, params, src, tgt) -> list[tuple[str, str, str]]:
    """(lhs dtype, rhs shape, rhs dtype) of every dot in the lowered forward pass."""
    text = jax.jit(lambda p: model.apply({"params": p}, src, tgt)).lower(params).as_text()
    return [(m[1], m[2], m[3]) for m in DOT.findall(text)]


@pytest.mark.parametrize("precision", ["mixed", "default"])
def test_projection_dots_take_bfloat16_operands_and_logits_float32(precision):
    model, params, src, tgt = _setup(precision=precision)
    dots = _dots(model, params, src, tgt)
    kernels = {"32x4x8", "4x8x32", "32x64", "64x32"}  # q/k/v, out, ffn wi, ffn wo
    projections = [d for d in dots if d[1] in kernels]
    assert len(projections) == 16  # encoder 4 + 2, decoder 4 + 4 (cross) + 2
    want = "bf16" if precision == "mixed" else "f32"
    assert {(lhs, rhs) for lhs, _, rhs in projections} == {(want, want)}
    logits = [d for d in dots if d[1] == "32x16"]  # out_proj (D, V)
    assert [(lhs, rhs) for lhs, _, rhs in logits] == [("f32", "f32")]


def test_params_grads_and_optimizer_state_stay_float32():
    model, params, src, tgt = _setup(precision="mixed", norm="pre")
    tx = make_optimizer(TrainConfig())
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params,
                       opt_state=tx.init(params), rng=jax.random.PRNGKey(0))
    batch = Batch(src=src, tgt_in=tgt, labels=jnp.roll(tgt, -1, axis=1))
    grads = jax.jit(jax.grad(lambda p: model.apply({"params": p}, src, tgt).sum()))(params)
    state, metrics = make_train_step(model, tx)(state, batch)
    assert jnp.isfinite(metrics["loss"]) and metrics["loss"].dtype == jnp.float32
    for tree in (state.params, grads, state.opt_state):
        floats = [x for x in jax.tree_util.tree_leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
        assert floats and {x.dtype for x in floats} == {jnp.dtype("float32")}


def test_mixed_sets_the_dtypes_itself():
    with pytest.raises(ValueError, match="leave dtype and param_dtype at float32"):
        jf.config.tiny(precision="mixed", dtype="bfloat16")
    config = jf.config.tiny(precision="mixed")
    assert (config.compute_dtype, config.params_dtype, config.norm_dtype) == (
        jnp.bfloat16, jnp.float32, jnp.float32)


def test_backend_without_bfloat16_is_refused_with_the_fix():
    old_gpu = SimpleNamespace(platform="gpu", device_kind="Tesla V100", compute_capability="7.0")
    new_gpu = SimpleNamespace(platform="gpu", device_kind="A100", compute_capability="8.0")
    config = jf.config.tiny(precision="mixed")
    with pytest.raises(ValueError, match=r'Tesla V100.*use precision="default"'):
        check_backend(config, [old_gpu])
    check_backend(config, [new_gpu])
    check_backend(jf.config.tiny(), [old_gpu])  # float32 runs anywhere

"""Invariants a refactoring could break silently: what remat="save_proj" keeps, and
which arithmetic stays float32 under reduced precision."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.nn import stack

from conftest import numpy_params, random_tokens


def _eqns(jaxpr):
    """Every equation of `jaxpr`, sub-jaxprs (scan, remat, custom rules) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


def _model_jaxpr(config):
    model = jf.Transformer(config)
    src = random_tokens(0, (2, 6), config.src_vocab_size)
    tgt = random_tokens(1, (2, 5), config.tgt_vocab_size)
    params = numpy_params(model, src, tgt)
    return jax.make_jaxpr(lambda p: model.apply({"params": p}, src, tgt))(params).jaxpr


@pytest.mark.parametrize("gated", [True, False], ids=["gated_ffn", "plain_ffn"])
def test_save_proj_names_every_projection_the_layers_tag(gated):
    """The names `remat="save_proj"` keeps are exactly those the layers tag: a misspelled
    name on either side would silently recompute that projection."""
    config = jf.tiny(gated_ffn=gated, activation="silu" if gated else "relu")
    tagged = {e.params["name"] for e in _eqns(_model_jaxpr(config)) if e.primitive.name == "name"}
    expected = set(stack.PROJECTIONS) - ({"ffn_gate"} if not gated else set())
    assert tagged == expected


@pytest.mark.parametrize("overrides", [dict(precision="mixed"), dict(dtype="bfloat16"),
                                       dict(precision="mixed", tie_output_embedding=True)],
                         ids=["mixed", "bfloat16", "mixed_tied"])
def test_softmax_runs_in_float32(overrides):
    exps = [e for e in _eqns(_model_jaxpr(jf.tiny(**overrides))) if e.primitive.name == "exp"]
    assert exps and all(e.invars[0].aval.dtype == jnp.float32 for e in exps)


@pytest.mark.parametrize("tied", [False, True], ids=["out_proj", "tied_embedding"])
def test_mixed_precision_logits_come_from_a_float32_product(tied):
    config = jf.tiny(precision="mixed", tie_output_embedding=tied)
    dots = [e for e in _eqns(_model_jaxpr(config)) if e.primitive.name == "dot_general"
            and e.outvars[0].aval.shape[-1] == config.tgt_vocab_size]
    assert dots and all(v.aval.dtype == jnp.float32 for e in dots for v in e.invars)
    # ... while the layers' matmuls are bfloat16
    assert any(v.aval.dtype == jnp.bfloat16 for e in _eqns(_model_jaxpr(config))
               if e.primitive.name == "dot_general" for v in e.invars)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_a_fully_masked_row_stays_finite(dtype):
    """float32's most negative value overflows to -inf in bfloat16 and float16: the
    masked logits must be filled after the cast to float32, not before."""
    q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (1, 2, 3, 4)).astype(dtype)
               for i in range(3))
    mask = jnp.array([[True, True, False], [False, False, False], [True, False, False]])

    def loss(q, k, v):
        out, _ = jf.dot_product_attention(q, k, v, mask[None, None])
        return jnp.sum(out.astype(jnp.float32) ** 2), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    assert out.dtype == dtype and np.isfinite(np.asarray(out, np.float32)).all()
    assert all(np.isfinite(np.asarray(g, np.float32)).all() for g in grads)
    # a fully masked row attends uniformly: the mean of the values
    np.testing.assert_allclose(np.asarray(out[0, :, 1], np.float32),
                               np.asarray(v.astype(jnp.float32).mean(axis=2)[0], np.float32),
                               rtol=2e-2, atol=2e-2)

"""config.remat: every policy gives the gradients of no remat (with and without
scan), and each really keeps less for the backward pass than no remat."""

import jax
import jax.numpy as jnp
import pytest
from jax._src.ad_checkpoint import saved_residuals  # public printer: print_saved_residuals

import jaxformer as jf
from jaxformer.nn import stacking

from conftest import numpy_params, random_tokens

POLICIES = ("full", "save_proj", "save_dots")


def _inputs(config):
    src = random_tokens(0, (2, 6), config.src_vocab_size).at[1, 4:].set(0)
    return src, random_tokens(1, (2, 5), config.tgt_vocab_size).at[:, 0].set(1)


def _loss(model, params, src, tgt):
    return jnp.sum(jnp.sin(model.apply({"params": params}, src, tgt)))


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_every_policy_gives_the_gradients_of_no_remat(scan):
    config = jf.config.tiny(norm="pre", gated_ffn=True, activation="silu", scan_layers=scan,
                            num_encoder_layers=1)
    src, tgt = _inputs(config)
    params = numpy_params(jf.Transformer(config), src, tgt)
    grad = jax.jit(jax.grad(_loss, argnums=1), static_argnums=0)
    want = grad(jf.Transformer(config), params, src, tgt)
    for policy in POLICIES:
        got = grad(jf.Transformer(config.replace(remat=policy)), params, src, tgt)
        # normwise over the tree: recomputation may fuse (round) differently, and
        # some leaves (key biases: softmax ignores them) have pure-noise gradients
        diff = sum(jnp.sum((a - b) ** 2) for a, b in zip(jax.tree_util.tree_leaves(got),
                                                         jax.tree_util.tree_leaves(want)))
        norm = sum(jnp.sum(b ** 2) for b in jax.tree_util.tree_leaves(want))
        assert (diff / norm) ** 0.5 <= 1e-6, policy


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_policies_keep_less_for_the_backward_pass(scan):
    """Scalars saved for the backward pass: full < save_proj (+ the projections)
    < save_dots (+ attention's QK^T and weights.V too) < none."""
    config = jf.config.tiny(scan_layers=scan)
    src, tgt = _inputs(config)
    params = numpy_params(jf.Transformer(config), src, tgt)

    def saved(policy):
        model = jf.Transformer(config.replace(remat=policy))
        return sum(aval.size for aval, _ in saved_residuals(
            lambda p: _loss(model, p, src, tgt), params))

    sizes = {policy: saved(policy) for policy in ("none",) + POLICIES}
    assert sizes["full"] < sizes["save_proj"] < sizes["save_dots"] < sizes["none"], sizes


def test_remat_keeps_the_parameter_tree():
    config = jf.config.tiny()
    src, tgt = _inputs(config)
    for scan in (False, True):
        plain = jax.eval_shape(jf.Transformer(config.replace(scan_layers=scan)).init,
                               jax.random.PRNGKey(0), src, tgt)
        remat = jax.eval_shape(jf.Transformer(config.replace(scan_layers=scan, remat="full")).init,
                               jax.random.PRNGKey(0), src, tgt)
        assert jax.tree_util.tree_structure(plain) == jax.tree_util.tree_structure(remat)
    assert stacking.layout(remat) == "stacked"


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match=r"TransformerConfig.remat must be one of \('none', 'full'"):
        jf.config.tiny(remat="everything")

"""Forward-mode autodiff through every model family and config option: `jax.jvp`,
`jax.jacfwd` and forward-over-reverse Hessian-vector products, each checked against
reverse mode (an independent path through JAX's rules)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.nn.stems import ConvStem

from conftest import numpy_params, random_tokens

ENCDEC = {
    "post_layernorm": {},
    "pre_gated_silu": dict(norm="pre", gated_ffn=True, activation="silu"),
    "rope_gqa_rmsnorm": dict(norm="pre", norm_type="rmsnorm", rope="half", num_kv_heads=2,
                             encoder_positions="none", decoder_positions="none"),
    "rope_interleaved_learned": dict(rope="interleaved", decoder_positions="learned"),
    "attention_impl_jax": dict(attention_impl="jax"),
    "scan_remat_save_proj": dict(scan_layers=True, remat="save_proj"),
    "remat_full": dict(remat="full"),
    "remat_save_dots": dict(remat="save_dots"),
    "mixed_precision": dict(precision="mixed"),
    "tied_shared": dict(tie_output_embedding=True, share_embeddings=True),
}


def _encdec(overrides):
    config = jf.tiny(**overrides)
    model = jf.Transformer(config)
    src = random_tokens(0, (2, 6), config.src_vocab_size)
    tgt = random_tokens(1, (2, 5), config.tgt_vocab_size)
    params = numpy_params(model, src, tgt)
    return (lambda p: jnp.mean(jnp.sin(model.apply({"params": p}, src, tgt)
                                       .astype(jnp.float32))), params)


def _lm():
    config = jf.llama(num_kv_heads=2)
    model = jf.DecoderOnlyLM(config)
    tokens = random_tokens(2, (2, 7), config.tgt_vocab_size)
    params = numpy_params(model, tokens)
    return lambda p: jnp.mean(jnp.sin(model.apply({"params": p}, tokens))), params


def _stemmed():
    config = jf.tiny(encoder_input="embedded", encoder_positions="fixed", activation="gelu")
    model = jf.Transformer(config, stem=ConvStem(config))
    features = jax.random.normal(jax.random.PRNGKey(3), (2, 8, 5))
    tgt = random_tokens(4, (2, 5), config.tgt_vocab_size)
    params = numpy_params(model, features, tgt)
    return lambda p: jnp.mean(jnp.sin(model.apply({"params": p}, features, tgt))), params


CASES = {**{f"encdec_{k}": (lambda v=v: _encdec(v)) for k, v in ENCDEC.items()},
         "decoder_only_llama": _lm, "conv_stem_whisper_like": _stemmed}


def _tangent(params, seed):
    leaves, tree = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    return tree.unflatten([jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])


def _dot(a, b):
    return sum(jnp.vdot(x, y) for x, y in zip(jax.tree_util.tree_leaves(a),
                                              jax.tree_util.tree_leaves(b)))


@pytest.mark.parametrize("case", CASES)
def test_jvp_equals_the_gradients_inner_product(case):
    loss, params = CASES[case]()
    tangent = _tangent(params, 1)
    _, derivative = jax.jit(lambda p, t: jax.jvp(loss, (p,), (t,)))(params, tangent)
    want = _dot(jax.jit(jax.grad(loss))(params), tangent)
    rtol = 2e-2 if "mixed" in case else 1e-4
    np.testing.assert_allclose(derivative, want, rtol=rtol, atol=1e-6)
    assert abs(float(want)) > 1e-6  # a derivative that could be wrong


@pytest.mark.parametrize("case", ["encdec_post_layernorm", "decoder_only_llama",
                                  "encdec_scan_remat_save_proj"])
def test_jacfwd_equals_jacrev(case):
    loss, params = CASES[case]()
    # Jacobian of the loss w.r.t. one small leaf, as a function of that leaf
    path, leaf = next((p, x) for p, x in jax.tree_util.tree_leaves_with_path(params)
                      if x.ndim == 1 and x.size <= 64)

    def of_leaf(value):
        return jax.tree_util.tree_map_with_path(
            lambda p, x: value if p == path else x, params)

    def outputs(value):  # a vector-valued function: the loss at three scalings
        return jnp.stack([loss(of_leaf(value * s)) for s in (0.5, 1.0, 2.0)])

    forward = jax.jit(jax.jacfwd(outputs))(leaf)
    reverse = jax.jit(jax.jacrev(outputs))(leaf)
    assert forward.shape == (3,) + leaf.shape
    np.testing.assert_allclose(forward, reverse, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("case", ["encdec_pre_gated_silu", "decoder_only_llama"])
def test_forward_over_reverse_hvp_equals_reverse_over_reverse(case):
    loss, params = CASES[case]()
    v = _tangent(params, 2)
    fwd_rev = jax.jit(lambda p, t: jax.jvp(jax.grad(loss), (p,), (t,))[1])(params, v)
    rev_rev = jax.jit(lambda p, t: jax.grad(lambda q: _dot(jax.grad(loss)(q), t))(p))(params, v)
    for a, b in zip(jax.tree_util.tree_leaves(fwd_rev), jax.tree_util.tree_leaves(rev_rev)):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)
    assert float(_dot(fwd_rev, v)) != 0.0

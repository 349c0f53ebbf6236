"""The modern blocks as config choices: RoPE, RMSNorm, gated FFN, grouped-query attention.

Each against an independent reference: hand-written numpy formulas, a
property the math implies (RoPE scores depend only on position differences;
grouped kv heads are repeated kv heads), or today's model (defaults).
Cached decoding == recomputation for these options is in test_decoding.py.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.nn.attention import dot_product_attention
from jaxformer.nn.rope import apply_rope, half_to_interleaved_rows

from conftest import numpy_params


def normal(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


# -- RoPE ---------------------------------------------------------------------------------


def np_rope(x, positions, theta, layout):
    """Rotate each pair (a, b) by angle pos * theta^(-2i/K) with an explicit 2x2 matrix."""
    x = np.asarray(x, np.float64)
    out = np.empty_like(x)
    K = x.shape[-1]
    for i in range(K // 2):
        a, b = (i, i + K // 2) if layout == "half" else (2 * i, 2 * i + 1)
        angle = np.asarray(positions, np.float64)[:, :, None] * theta ** (-2.0 * i / K)
        cos, sin = np.cos(angle), np.sin(angle)
        out[..., a] = cos * x[..., a] - sin * x[..., b]
        out[..., b] = sin * x[..., a] + cos * x[..., b]
    return out


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rope_equals_the_rotation_formula(layout):
    x = normal(0, (2, 5, 3, 8))  # (B, T, H, K)
    positions = jnp.array([[0, 1, 2, 3, 4], [7, 3, 0, 11, 100]])
    np.testing.assert_allclose(apply_rope(x, positions, 10000.0, layout),
                               np_rope(x, positions, 10000.0, layout), atol=1e-5)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rope_scores_depend_only_on_position_differences(layout):
    q, k = normal(1, (1, 1, 1, 16)), normal(2, (1, 1, 1, 16))

    def score(m, n):
        pos = lambda p: jnp.array([[p]])  # noqa: E731
        return float(jnp.sum(apply_rope(q, pos(m), 500.0, layout)
                             * apply_rope(k, pos(n), 500.0, layout)))

    for m, n in [(3, 1), (10, 2), (0, 5)]:
        for shift in (1, 7, 40):
            assert score(m + shift, n + shift) == pytest.approx(score(m, n), abs=1e-4)
    assert abs(score(3, 1) - score(4, 1)) > 1e-3  # ...and the difference does matter


def llama_lm(rope="half", **overrides):
    config = jf.llama(**(dict(d_model=32, num_heads=4, num_kv_heads=2, d_ff=40, rope=rope,
                              num_decoder_layers=2) | overrides))
    model = jf.DecoderOnlyLM(config)
    tokens = jnp.asarray(np.random.default_rng(9).integers(3, 16, (2, 7)), jnp.int32)
    return model, numpy_params(model, jax.ShapeDtypeStruct((1, 1), jnp.int32), seed=4), tokens


def permute_qk_rows(params, head_dim):
    """Half-layout weights -> interleaved-layout weights (llama.cpp's conversion)."""
    perm = half_to_interleaved_rows(head_dim)
    params = jax.tree_util.tree_map(lambda x: x, params)
    for layer in params["decoder"].values():
        if "self_attn" in layer:
            for name in ("query", "key"):
                layer["self_attn"][name]["kernel"] = layer["self_attn"][name]["kernel"][..., perm]
    return params


def test_rope_layouts_are_the_same_model_up_to_permuted_rows_and_the_choice_matters():
    model, params, tokens = llama_lm("half")
    want = model.apply({"params": params}, tokens)
    interleaved = jf.DecoderOnlyLM(model.config.replace(rope="interleaved"))
    permuted = permute_qk_rows(params, model.config.head_dim)
    np.testing.assert_allclose(interleaved.apply({"params": permuted}, tokens), want,
                               atol=1e-5)
    # The wrong layout for the weights is a different model.
    assert np.abs(interleaved.apply({"params": params}, tokens) - want).max() > 1e-2
    # And RoPE is on: without it the logits differ too.
    no_rope = jf.DecoderOnlyLM(model.config.replace(rope="none"))
    assert np.abs(no_rope.apply({"params": params}, tokens) - want).max() > 1e-2


# -- RMSNorm and gated FFN ----------------------------------------------------------------


def test_rmsnorm_equals_the_formula():
    config = jf.tiny(norm_type="rmsnorm", layer_norm_epsilon=1e-3)
    norm = jf.nn.layers.layer_norm(config)
    x = 3.0 * normal(3, (2, 4, 32)) + 1.0
    scale = 1.0 + 0.1 * normal(4, (32,))
    got = norm.apply({"params": {"scale": scale}}, x)
    x64 = np.asarray(x, np.float64)
    want = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-3) * np.asarray(scale)
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert set(norm.init(jax.random.PRNGKey(0), x)["params"]) == {"scale"}  # no bias


def silu(v):
    return v / (1.0 + np.exp(-v))


def gelu(v):
    return np.vectorize(lambda a: a * 0.5 * (1 + math.erf(a / math.sqrt(2))))(v)


@pytest.mark.parametrize("activation, act, bias", [("silu", silu, False), ("gelu", gelu, True)],
                         ids=["swiglu_no_bias", "geglu_bias"])
def test_gated_ffn_equals_the_formula(activation, act, bias):
    config = jf.tiny(gated_ffn=True, activation=activation, d_ff=37, ffn_bias=bias)
    module = jf.FeedForward(config)
    x = normal(5, (2, 3, 32))
    params = module.init(jax.random.PRNGKey(0), x)["params"]
    params = jax.tree_util.tree_map(lambda a: a + 0.1 * normal(6, a.shape), params)
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    assert set(p) == {"gate", "wi", "wo"} and p["gate"]["kernel"].shape == (32, 37)
    b = (lambda n: p[n]["bias"]) if bias else (lambda n: 0.0)
    assert bias == ("bias" in p["wo"])
    x64 = np.asarray(x, np.float64)
    hidden = act(x64 @ p["gate"]["kernel"] + b("gate")) * (x64 @ p["wi"]["kernel"] + b("wi"))
    want = hidden @ p["wo"]["kernel"] + b("wo")
    np.testing.assert_allclose(module.apply({"params": params}, x), want, atol=1e-5)


# -- grouped-query attention --------------------------------------------------------------


@pytest.mark.parametrize("kv_heads", [1, 2, 3])
def test_grouped_attention_equals_attention_with_repeated_kv_heads(kv_heads):
    """Query head h reads kv head h // (H / G): the same as repeating each kv head."""
    H = 6
    q, k, v = normal(7, (2, H, 4, 8)), normal(8, (2, kv_heads, 5, 8)), normal(9, (2, kv_heads, 5, 8))
    mask = jnp.asarray(np.random.default_rng(0).random((2, 1, 4, 5)) < 0.7).at[..., 0].set(True)
    out, weights = dot_product_attention(q, k, v, mask)
    repeat = lambda a: jnp.repeat(a, H // kv_heads, axis=1)  # noqa: E731
    want_out, want_weights = dot_product_attention(q, repeat(k), repeat(v), mask)
    assert weights.shape == (2, H, 4, 5)
    np.testing.assert_allclose(out, want_out, atol=1e-6)
    np.testing.assert_allclose(weights, want_weights, atol=1e-6)


def test_num_kv_heads_equal_to_num_heads_is_todays_attention(make_transformer):
    model, params = make_transformer(jf.tiny(norm="pre"))
    src, tgt = jnp.array([[5, 6, 7, 0]]), jnp.array([[1, 5, 6, 9]])
    today = model.apply({"params": params}, src, tgt)
    same = jf.Transformer(model.config.replace(num_kv_heads=4)).apply({"params": params}, src, tgt)
    np.testing.assert_array_equal(same, today)


@pytest.mark.parametrize("impl", ["einsum", "jax"])
def test_grouped_model_equals_full_heads_model_with_repeated_kv_weights(impl, make_transformer):
    """A GQA Transformer (self and cross attention) = the H-head model whose key/value
    kernels repeat each kv head's for its group; both attention paths."""
    config = jf.tiny(norm="pre", num_heads=4, num_kv_heads=2, attention_impl=impl,
                     rope="interleaved", norm_type="rmsnorm")
    model, params = make_transformer(config)
    full_params = jax.tree_util.tree_map_with_path(
        lambda path, a: (jnp.repeat(a, 2, axis=-2)
                         if path[-2].key in ("key", "value") else a), params)
    src, tgt = jnp.array([[5, 6, 7, 0], [3, 4, 4, 4]]), jnp.array([[1, 5, 6, 9], [1, 3, 3, 3]])
    full = jf.Transformer(config.replace(num_kv_heads=None, attention_impl="einsum"))
    np.testing.assert_allclose(model.apply({"params": params}, src, tgt),
                               full.apply({"params": full_params}, src, tgt), atol=1e-5)


@pytest.mark.parametrize("rope", ["half", "interleaved"])
def test_jax_attention_path_equals_einsum_for_llama_blocks(rope):
    model, params, tokens = llama_lm(rope, num_kv_heads=1)
    fused = jf.DecoderOnlyLM(model.config.replace(attention_impl="jax"))
    np.testing.assert_allclose(fused.apply({"params": params}, tokens),
                               model.apply({"params": params}, tokens), atol=1e-5)


def test_kv_cache_holds_only_the_kv_heads():
    full = jf.init_cache(jf.llama(num_heads=4), batch=2, max_len=8)
    grouped = jf.init_cache(jf.llama(num_heads=4, num_kv_heads=1), batch=2, max_len=8)
    assert grouped.self_kv[0].key.shape == (2, 1, 8, 8)
    nbytes = lambda c: sum(x.nbytes for kv in c.self_kv for x in kv)  # noqa: E731
    assert nbytes(full) == 4 * nbytes(grouped)


def test_llama_preset_states_the_blocks():
    model, params, tokens = llama_lm()
    layer = params["decoder"]["layers_0"]
    assert set(params) == {"embed", "decoder"}                           # tied output
    assert set(params["decoder"]) == {"layers_0", "layers_1", "final_norm"}  # no positions
    assert set(layer["self_attn_norm"]) == {"scale"}                     # RMSNorm
    assert set(layer["ffn"]) == {"gate", "wi", "wo"}                     # SwiGLU
    assert all(set(layer["self_attn"][n]) == {"kernel"} for n in ("query", "key", "value", "out"))
    assert layer["self_attn"]["key"]["kernel"].shape == (32, 2, 8)       # G = 2 kv heads

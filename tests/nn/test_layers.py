"""Layers against references written here in numpy (float64), from the formulas."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.nn.layers import PositionEmbedding, TokenEmbedding, activation_fn

# ----------------------------------------------------------------------------
# Positions, activations, embeddings
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("d_model", [8, 7, 33], ids=["d8", "odd_d7", "odd_d33"])
def test_sinusoidal_table_is_seed_001_formula(d_model):
    """PE[p, 2i] = sin(p / 10000^(2i/D)), PE[p, 2i+1] = cos(p / 10000^(2i/D)), by loop."""
    max_len = 12
    want = np.zeros((max_len, d_model))
    for p in range(max_len):
        for j in range(d_model):
            angle = p / 10000 ** ((j - j % 2) / d_model)
            want[p, j] = math.sin(angle) if j % 2 == 0 else math.cos(angle)
    got = jf.sinusoidal_table(max_len, d_model)
    assert got.shape == (max_len, d_model) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=2e-6)


def test_activations():
    x = np.linspace(-4, 4, 41)
    gelu_erf = np.array([v * 0.5 * (1 + math.erf(v / math.sqrt(2))) for v in x])
    np.testing.assert_allclose(activation_fn("gelu")(jnp.asarray(x, jnp.float32)), gelu_erf,
                               atol=1e-6)
    np.testing.assert_allclose(activation_fn("relu")(jnp.asarray(x)), np.maximum(x, 0))
    gelu_tanh = activation_fn("gelu_tanh")(jnp.asarray(x, jnp.float32))
    gelu_tanh_ref = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    np.testing.assert_allclose(gelu_tanh, gelu_tanh_ref, atol=1e-6)
    assert np.abs(gelu_tanh_ref - gelu_erf).max() > 1e-4  # the two forms really differ


@pytest.mark.parametrize("scale", [True, False], ids=["scaled", "unscaled"])
def test_token_embedding_lookup_scale_and_tied_output(scale):
    config = jf.tiny(scale_embeddings=scale)
    embed = TokenEmbedding(16, config)
    ids = jnp.array([[3, 0, 15], [7, 7, 1]])
    params = embed.init(jax.random.PRNGKey(0), ids)["params"]
    table = np.asarray(params["embedding"])
    got = embed.apply({"params": params}, ids)
    np.testing.assert_allclose(got, table[np.asarray(ids)] * (math.sqrt(32) if scale else 1.0),
                               rtol=1e-6)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 32)), jnp.float32)
    np.testing.assert_allclose(embed.apply({"params": params}, x, method=embed.attend),
                               np.asarray(x) @ table.T, atol=1e-5)


def test_token_embedding_out_of_range_ids_are_nan_rows_even_under_jit():
    config = jf.tiny()
    embed = TokenEmbedding(16, config)
    params = embed.init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))["params"]
    ids = jnp.array([[3, 16, -1, 4]])
    got = np.asarray(jax.jit(embed.apply)({"params": params}, ids))
    assert np.isnan(got[0, 1]).all() and np.isnan(got[0, 2]).all()  # not clamped to 15 / 0
    assert np.isfinite(got[0, [0, 3]]).all()


def test_position_embeddings():
    config = jf.tiny(max_len=10)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 4, 32)), jnp.float32)
    table = jf.sinusoidal_table(10, 32)
    sin = PositionEmbedding("sinusoidal", config)
    assert sin.init(jax.random.PRNGKey(0), x) == {}  # a constant, no parameters
    np.testing.assert_allclose(sin.apply({}, x), np.asarray(x) + table[:4], atol=1e-6)
    positions = jnp.array([[5, 6, 7, 8], [0, 0, 1, 2]])
    np.testing.assert_allclose(sin.apply({}, x, positions), np.asarray(x) + table[positions],
                               atol=1e-6)
    learned = PositionEmbedding("learned", config)
    params = learned.init(jax.random.PRNGKey(0), x)["params"]
    assert params["embedding"].shape == (10, 32)
    np.testing.assert_allclose(learned.apply({"params": params}, x, positions),
                               np.asarray(x) + np.asarray(params["embedding"])[positions],
                               atol=1e-6)


def test_embedding_dropout_only_when_not_deterministic():
    module = PositionEmbedding("sinusoidal", jf.tiny(embedding_dropout=0.5))
    x = jnp.ones((2, 4, 32))
    clean = module.apply({}, x)  # deterministic by default: no dropout
    want = np.broadcast_to(1.0 + jf.sinusoidal_table(32, 32)[:4], x.shape)
    np.testing.assert_allclose(clean, want, atol=1e-6)
    noisy = module.apply({}, x, deterministic=False, rngs={"dropout": jax.random.PRNGKey(0)})
    assert 0.2 < float(jnp.mean(noisy == 0)) < 0.8
    kept = np.asarray(noisy != 0)
    np.testing.assert_allclose(np.asarray(noisy)[kept], 2 * np.asarray(clean)[kept], rtol=1e-6)


# ----------------------------------------------------------------------------
# numpy references of the sublayers
# ----------------------------------------------------------------------------


def f64(tree):
    return jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), tree)


def np_layer_norm(p, x, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * p["scale"] + p["bias"]


def np_attention(p, xq, xkv, mask):
    def proj(name, x):
        return np.einsum("bld,dhk->blhk", x, p[name]["kernel"]) + p[name]["bias"]

    q, k, v = proj("query", xq), proj("key", xkv), proj("value", xkv)
    logits = np.einsum("bthk,bshk->bhts", q, k) / math.sqrt(q.shape[-1])
    if mask is not None:
        logits = np.where(np.asarray(mask), logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w = w / w.sum(-1, keepdims=True)
    heads = np.einsum("bhts,bshk->bthk", w, v)
    return np.einsum("bthk,hkd->btd", heads, p["out"]["kernel"]) + p["out"]["bias"]


def np_ffn(p, x, activation):
    h = x @ p["wi"]["kernel"] + p["wi"]["bias"]
    h = np.maximum(h, 0) if activation == "relu" else np.vectorize(
        lambda v: v * 0.5 * (1 + math.erf(v / math.sqrt(2))))(h)
    return h @ p["wo"]["kernel"] + p["wo"]["bias"]


def np_sublayer(norm, ln_params, f, x):
    if norm == "pre":
        return x + f(np_layer_norm(ln_params, x))
    return np_layer_norm(ln_params, x + f(x))


def np_encoder_layer(p, x, mask, norm, activation):
    x = np_sublayer(norm, p["self_attn_norm"], lambda h: np_attention(p["self_attn"], h, h, mask),
                    x)
    return np_sublayer(norm, p["ffn_norm"], lambda h: np_ffn(p["ffn"], h, activation), x)


def np_decoder_layer(p, y, memory, self_mask, cross_mask, norm, activation):
    y = np_sublayer(norm, p["self_attn_norm"],
                    lambda h: np_attention(p["self_attn"], h, h, self_mask), y)
    y = np_sublayer(norm, p["cross_attn_norm"],
                    lambda h: np_attention(p["cross_attn"], h, memory, cross_mask), y)
    return np_sublayer(norm, p["ffn_norm"], lambda h: np_ffn(p["ffn"], h, activation), y)


def perturbed(params, seed=0):
    """Non-trivial LayerNorm scales/biases and biases, so a misplaced norm would show."""
    leaves, tree = jax.tree_util.tree_flatten(params)
    r = np.random.default_rng(seed)
    return jax.tree_util.tree_unflatten(
        tree, [leaf + 0.2 * r.normal(size=leaf.shape).astype(np.float32) for leaf in leaves])


CASES = [("post", "relu"), ("pre", "gelu")]


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_feed_forward_equals_numpy(activation):
    module = jf.FeedForward(jf.tiny(activation=activation))
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 3, 32)), jnp.float32)
    params = perturbed(module.init(jax.random.PRNGKey(0), x)["params"])
    np.testing.assert_allclose(module.apply({"params": params}, x),
                               np_ffn(f64(params), np.asarray(x, np.float64), activation),
                               atol=1e-5)


@pytest.mark.parametrize("norm,activation", CASES, ids=["post_relu", "pre_gelu"])
def test_encoder_layer_equals_numpy(norm, activation):
    layer = jf.EncoderLayer(jf.tiny(norm=norm, activation=activation))
    x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 5, 32)), jnp.float32)
    mask = jf.padding_mask(jnp.array([[4, 4, 4, 0, 0], [4, 4, 4, 4, 4]]))
    params = perturbed(layer.init(jax.random.PRNGKey(0), x, mask)["params"])
    assert set(params) == {"self_attn", "self_attn_norm", "ffn", "ffn_norm"}
    want = np_encoder_layer(f64(params), np.asarray(x, np.float64), mask, norm, activation)
    np.testing.assert_allclose(layer.apply({"params": params}, x, mask), want, atol=1e-4)


@pytest.mark.parametrize("norm,activation", CASES, ids=["post_relu", "pre_gelu"])
def test_decoder_layer_equals_numpy(norm, activation):
    layer = jf.DecoderLayer(jf.tiny(norm=norm, activation=activation))
    r = np.random.default_rng(4)
    y = jnp.asarray(r.normal(size=(2, 4, 32)), jnp.float32)
    memory = jnp.asarray(r.normal(size=(2, 5, 32)), jnp.float32)
    self_mask = jf.decoder_self_mask(jnp.array([[1, 4, 4, 0], [1, 4, 4, 4]]))
    cross_mask = jf.padding_mask(jnp.array([[4, 4, 0, 0, 0], [4, 4, 4, 4, 4]]))

    def run(module, y, memory, self_mask, cross_mask):
        return module(y, self_mask, module.cross_kv(memory), cross_mask)[0]

    params = layer.init(jax.random.PRNGKey(0), y, memory, self_mask, cross_mask,
                        method=run)["params"]
    params = perturbed(params)
    got = layer.apply({"params": params}, y, memory, self_mask, cross_mask, method=run)
    want = np_decoder_layer(f64(params), np.asarray(y, np.float64),
                            np.asarray(memory, np.float64), self_mask, cross_mask, norm,
                            activation)
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_decoder_layer_cache_step_by_step_equals_parallel():
    """Writing keys/values one position at a time into a cache gives the parallel output."""
    config = jf.tiny(norm="pre")
    layer = jf.DecoderLayer(config, cross_attention=False)
    T_max = 5
    y = jnp.asarray(np.random.default_rng(5).normal(size=(2, T_max, 32)), jnp.float32)
    params = layer.init(jax.random.PRNGKey(0), y, jf.causal_mask(T_max))["params"]
    full, none_cache = layer.apply({"params": params}, y, jf.causal_mask(T_max))
    assert none_cache is None
    empty = jnp.zeros((2, config.num_heads, T_max, config.head_dim))
    cache = jf.KV(empty, empty)
    for t in range(T_max):
        step_mask = (jnp.arange(T_max) <= t)[None, None, None, :]  # (1,1,1,T_max)
        out, cache = layer.apply({"params": params}, y[:, t:t + 1], step_mask, cache=cache,
                                 cache_index=jnp.int32(t))
        np.testing.assert_allclose(out[:, 0], full[:, t], atol=1e-5)

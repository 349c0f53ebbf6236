"""Attention: equal to a numpy reference and to jax.nn.dot_product_attention;
dropout only when asked, reproducibly; fully masked rows stay finite."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf

B, T, S, H, K = 2, 3, 5, 2, 4


def qkv(seed=0, dtype=jnp.float32, t=T, s=S):
    """Heads-major queries (B, H, t, K), keys and values (B, H, s, K)."""
    r = np.random.default_rng(seed)
    q = r.normal(size=(B, H, t, K))
    k = r.normal(size=(B, H, s, K))
    v = r.normal(size=(B, H, s, K))
    return tuple(jnp.asarray(a, dtype) for a in (q, k, v))


def numpy_attention(q, k, v, mask):
    """The textbook formula in float64 numpy: softmax(q k^T / sqrt(K), masked) v."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    logits = np.einsum("bhtk,bhsk->bhts", q, k) / math.sqrt(q.shape[-1])
    if mask is not None:
        logits = np.where(np.asarray(mask), logits, -np.inf)
    logits = logits - logits.max(axis=-1, keepdims=True)
    weights = np.exp(logits) / np.exp(logits).sum(axis=-1, keepdims=True)
    return np.einsum("bhts,bhsk->bhtk", weights, v), weights


def random_mask(shape, seed=3):
    mask = np.random.default_rng(seed).random(shape) < 0.6
    mask[..., 0] = True  # every query row sees at least one key (no fully masked row here)
    return jnp.asarray(mask)


MASKS = {
    "none": lambda: None,
    "padding_B11S": lambda: jf.padding_mask(jnp.array([[4, 4, 4, 0, 0], [4, 0, 4, 4, 4]])),
    "causal_11TT": lambda: jf.causal_mask(S),
    "full_BHTS": lambda: random_mask((B, H, T, S)),
    "per_query_B1TS": lambda: random_mask((B, 1, T, S), seed=4),
    # One query (T=1): the shape of a cached decode step.
    "one_query_none": lambda: None,
    "one_query_padding_B11S": lambda: jf.padding_mask(jnp.array([[4, 4, 0, 0, 0],
                                                                 [4, 4, 4, 4, 0]])),
    "one_query_full_BH1S": lambda: random_mask((B, H, 1, S), seed=5),
}


def shapes_for(case):
    if case.startswith("one_query"):
        return 1, S
    return (S, S) if case == "causal_11TT" else (T, S)


@pytest.mark.parametrize("case", list(MASKS))
def test_equals_numpy_reference(case):
    t, s = shapes_for(case)
    q, k, v = qkv(t=t, s=s)
    mask = MASKS[case]()
    out, weights = jf.dot_product_attention(q, k, v, mask)
    want_out, want_weights = numpy_attention(q, k, v, mask)
    assert out.shape == (B, H, t, K) and weights.shape == (B, H, t, s)
    np.testing.assert_allclose(np.asarray(out), want_out, atol=1e-6)
    np.testing.assert_allclose(np.asarray(weights), want_weights, atol=1e-6)


@pytest.mark.parametrize("case", list(MASKS))
def test_equals_jax_nn_dot_product_attention(case):
    t, s = shapes_for(case)
    q, k, v = qkv(seed=1, t=t, s=s)
    mask = MASKS[case]()
    if mask is not None:
        mask = jnp.broadcast_to(mask, (B, H, t, s))
    out, _ = jf.dot_product_attention(q, k, v, mask)
    # jax.nn takes (B, T, H, K): the same attention in the other layout.
    q, k, v = (jnp.swapaxes(a, 1, 2) for a in (q, k, v))
    want = jnp.swapaxes(jax.nn.dot_product_attention(q, k, v, mask=mask), 1, 2)
    np.testing.assert_allclose(out, want, atol=1e-6)


def test_weights_are_distributions_that_ignore_masked_keys():
    q, k, v = qkv(seed=2)
    mask = random_mask((B, H, T, S))
    _, weights = jf.dot_product_attention(q, k, v, mask)
    weights = np.asarray(weights)
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-6)
    assert (weights >= 0).all()
    assert (weights[~np.asarray(mask)] == 0).all()


def test_masked_key_values_do_not_matter():
    q, k, v = qkv(seed=5)
    mask = jf.padding_mask(jnp.array([[4, 4, 4, 0, 0], [4, 4, 4, 4, 0]]))
    out, _ = jf.dot_product_attention(q, k, v, mask)
    v2 = v.at[:, :, 4].set(1e4)  # a masked key position in both rows
    k2 = k.at[:, :, 4].set(-1e4)
    out2, _ = jf.dot_product_attention(q, k2, v2, mask)
    np.testing.assert_array_equal(out, out2)


def test_fully_masked_row_is_finite_with_finite_gradients():
    q, k, v = qkv(seed=6)
    mask = np.ones((B, 1, T, S), bool)
    mask[0, :, 1, :] = False  # query 1 of batch 0 sees nothing
    mask = jnp.asarray(mask)
    _check_fully_masked(q, k, v, mask)
    ok, _ = jf.dot_product_attention(q, k, v, None)
    out, _ = jf.dot_product_attention(q, k, v, mask)
    # The other rows are exactly what they are without the dead row.
    np.testing.assert_allclose(out[1], ok[1], atol=1e-6)
    np.testing.assert_allclose(out[0][:, [0, 2]], ok[0][:, [0, 2]], atol=1e-6)


def test_fully_masked_single_query_is_finite_with_finite_gradients():
    q, k, v = qkv(seed=9, t=1)
    mask = jnp.ones((B, 1, 1, S), bool).at[1].set(False)  # batch 1: an all-PAD source
    _check_fully_masked(q, k, v, mask, row=(1, 0))


def _check_fully_masked(q, k, v, mask, row=(0, 1)):
    out, weights = jf.dot_product_attention(q, k, v, mask)
    assert np.isfinite(np.asarray(out)).all()
    b, t = row
    np.testing.assert_allclose(weights[b, :, t], 1.0 / S, atol=1e-6)  # uniform, not NaN

    def loss(q, k, v):
        return jnp.sum(jf.dot_product_attention(q, k, v, mask)[0] ** 2)

    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)


def test_dropout_on_weights_is_scaled_reproducible_and_off_without_rng():
    q, k, v = qkv(seed=7)
    plain_out, plain_w = jf.dot_product_attention(q, k, v)
    no_rng, _ = jf.dot_product_attention(q, k, v, dropout_rate=0.5, dropout_rng=None)
    np.testing.assert_array_equal(no_rng, plain_out)

    key = jax.random.PRNGKey(0)
    out_a, w_a = jf.dot_product_attention(q, k, v, dropout_rate=0.5, dropout_rng=key)
    out_b, w_b = jf.dot_product_attention(q, k, v, dropout_rate=0.5, dropout_rng=key)
    out_c, _ = jf.dot_product_attention(q, k, v, dropout_rate=0.5,
                                        dropout_rng=jax.random.PRNGKey(1))
    np.testing.assert_array_equal(out_a, out_b)
    assert not np.allclose(out_a, plain_out) and not np.allclose(out_a, out_c)
    w_a, plain_w = np.asarray(w_a), np.asarray(plain_w)
    kept = w_a != 0
    assert 0.2 < kept.mean() < 0.8
    np.testing.assert_allclose(w_a[kept], plain_w[kept] / 0.5, rtol=1e-6)  # inverted dropout
    # The output is the dropped weights applied to the values.
    np.testing.assert_allclose(out_a, np.einsum("bhts,bhsk->bhtk", w_a, v), atol=1e-5)


def test_single_query_dropout_is_the_same_function():
    """One query (a decode step): the output is the dropped weights applied to the values."""
    q, k, v = qkv(seed=10, t=1)
    key = jax.random.PRNGKey(3)
    out, w = jf.dot_product_attention(q, k, v, dropout_rate=0.5, dropout_rng=key)
    w = np.asarray(w)
    assert 0 < (w == 0).mean() < 1
    np.testing.assert_allclose(out, np.einsum("bhts,bhsk->bhtk", w, v), atol=1e-5)


# ----------------------------------------------------------------------------
# MultiHeadAttention module
# ----------------------------------------------------------------------------


def mha_setup(config, t=T, s=S, seed=0):
    r = np.random.default_rng(seed)
    x_BTD = jnp.asarray(r.normal(size=(B, t, config.d_model)), jnp.float32)
    m_BSD = jnp.asarray(r.normal(size=(B, s, config.d_model)), jnp.float32)
    mha = jf.MultiHeadAttention(config)

    def call(module, x, m, mask, deterministic=True):
        return module(x, module.kv(m), mask, deterministic=deterministic)

    params = mha.init(jax.random.PRNGKey(seed), x_BTD, m_BSD, None, method=call)["params"]
    return mha, call, params, x_BTD, m_BSD


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_multi_head_attention_equals_projections_by_hand(bias):
    config = jf.tiny(attention_bias=bias)
    mha, call, params, x, m = mha_setup(config)
    mask = jf.padding_mask(jnp.array([[4, 4, 0, 0, 0], [4, 4, 4, 4, 4]]))
    got = mha.apply({"params": params}, x, m, mask, method=call)

    def proj(name, inputs):  # (B, L, D) @ (D, H, K) + (H, K) -> (B, H, L, K)
        p = {k_: np.asarray(v_, np.float64) for k_, v_ in params[name].items()}
        bias = p.get("bias", np.zeros(p["kernel"].shape[1:]))
        return np.einsum("bld,dhk->bhlk", inputs, p["kernel"]) + bias[:, None, :]

    assert ("bias" in params["query"]) == bias and params["out"]["kernel"].shape == (4, 8, 32)
    heads, _ = numpy_attention(proj("query", x), proj("key", m), proj("value", m), mask)
    out = params["out"]
    want = np.einsum("bhtk,hkd->btd", heads, np.asarray(out["kernel"], np.float64))
    want = want + (np.asarray(out["bias"]) if bias else 0.0)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)


def test_multi_head_attention_sows_weights_of_cross_attention_shape():
    mha, call, params, x, m = mha_setup(jf.tiny())
    mask = jf.padding_mask(jnp.array([[4, 4, 4, 0, 0], [4, 4, 4, 4, 0]]))
    out, state = mha.apply({"params": params}, x, m, mask, method=call,
                           mutable="intermediates")
    (weights,) = state["intermediates"]["attention_weights"]
    assert out.shape == (B, T, 32) and weights.shape == (B, 4, T, S)
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-6)
    assert float(jnp.abs(weights[0, :, :, 3:]).max()) == 0.0


@pytest.mark.parametrize("impl", ["einsum", "jax"])
def test_queries_sharing_keys_equal_the_keys_repeated(impl):
    """Keys and values of B sources read by B * 3 query rows (the beams of each
    source, issue 45): the outputs and sown weights of the keys repeated 3 times in
    memory (the layout beam search used before), with a padding mask per source."""
    mha, call, params, x, m = mha_setup(jf.tiny(attention_impl=impl), t=1)
    x_RTD = jnp.asarray(np.random.default_rng(1).normal(size=(B * 3, 1, 32)), jnp.float32)
    mask_B11S = jf.padding_mask(jnp.array([[4, 4, 4, 0, 0], [4, 4, 4, 4, 0]]))
    kv = mha.apply({"params": params}, m, method=lambda module, m: module.kv(m))
    repeated = type(kv)(*(jnp.repeat(a, 3, axis=0) for a in kv))

    def attend(module, x, kv, mask):
        return module(x, kv, mask)

    shared, state = mha.apply({"params": params}, x_RTD, kv, mask_B11S, method=attend,
                              mutable="intermediates")
    want, want_state = mha.apply({"params": params}, x_RTD, repeated,
                                 jnp.repeat(mask_B11S, 3, axis=0), method=attend,
                                 mutable="intermediates")
    np.testing.assert_allclose(shared, want, rtol=1e-6, atol=1e-6)
    if impl == "einsum":  # the jax path sows no weights
        (weights,), (want_weights,) = (st["intermediates"]["attention_weights"]
                                       for st in (state, want_state))
        assert weights.shape == (B * 3, 4, 1, S)
        np.testing.assert_allclose(weights, want_weights, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="must be a multiple of them"):
        mha.apply({"params": params}, x_RTD[:5], kv, None, method=attend)
    with pytest.raises(ValueError, match=r"a mask of shape \(1\|2, 1, 1, S\)"):
        mha.apply({"params": params}, x_RTD, kv, jnp.repeat(mask_B11S, 3, axis=0),
                  method=attend)


def test_multi_head_attention_dropout_only_when_not_deterministic():
    config = jf.tiny(attention_dropout=0.5)
    mha, call, params, x, m = mha_setup(config)
    plain = jf.MultiHeadAttention(config.replace(attention_dropout=0.0))
    reference = plain.apply({"params": params}, x, m, None, method=call)
    det = mha.apply({"params": params}, x, m, None, method=call)
    np.testing.assert_array_equal(det, reference)

    def noisy(seed):
        return mha.apply({"params": params}, x, m, None, False, method=call,
                         rngs={"dropout": jax.random.PRNGKey(seed)})

    np.testing.assert_array_equal(noisy(0), noisy(0))
    assert not np.allclose(noisy(0), reference)
    assert not np.allclose(noisy(0), noisy(1))


def test_softmax_with_the_output_only_derivative_equals_the_plain_formula():
    """`attention.softmax_last` (its derivative keeps only the output, issue 44): the values
    of jax.nn.softmax, and reverse and forward mode equal the plain formula's (exp / sum
    differentiated by JAX), masked logits included."""
    from jaxformer.nn.attention import softmax_last

    r = np.random.default_rng(0)
    x = jnp.asarray(r.normal(size=(2, 3, 4, 6)) * 3, jnp.float32)
    x = x.at[0, 0, 0, :3].set(jnp.finfo(jnp.float32).min)  # masked logits, as attention has
    w = jnp.asarray(r.normal(size=x.shape), jnp.float32)

    def plain(z):
        e = jnp.exp(z - jax.lax.stop_gradient(z.max(-1, keepdims=True)))
        return e / e.sum(-1, keepdims=True)

    np.testing.assert_array_equal(softmax_last(x), jax.nn.softmax(x, axis=-1))
    want = jax.grad(lambda z: (plain(z) * w).sum())(x)
    np.testing.assert_allclose(jax.grad(lambda z: (softmax_last(z) * w).sum())(x), want,
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jax.jvp(softmax_last, (x,), (w,))[1],
                               jax.jvp(plain, (x,), (w,))[1], rtol=1e-5, atol=1e-6)


QUERY_BLOCK_MASKS = {  # broadcastable to (B, H, T, S), each axis 1 or full
    "none": None, "keys": (1, 1, 1, 9), "rows_keys": (B, 1, 1, 9),
    "queries_keys": (1, 1, 7, 9), "full": (B, H, 7, 9),
}


@pytest.mark.parametrize("block", [1, 3, 7], ids=["block1", "block3_padded", "block7_whole"])
@pytest.mark.parametrize("mask_shape", list(QUERY_BLOCK_MASKS.values()),
                         ids=list(QUERY_BLOCK_MASKS))
@pytest.mark.parametrize("kv_heads", [H, 1], ids=["mha", "mqa"])
def test_query_blocks_equal_the_whole_product(block, mask_shape, kv_heads):
    """Weights formed a batch row and `block` queries at a time (T = 7: a block of 3
    pads T to 9) give the whole product's outputs and weights, and the numpy
    reference's (each query row its own mask row, each batch row its own keys)."""
    q, k, v = qkv(seed=5, t=7, s=9)
    k, v = k[:, :kv_heads], v[:, :kv_heads]
    mask = None if mask_shape is None else random_mask(mask_shape, seed=7)
    whole = jf.dot_product_attention(q, k, v, mask)
    blocked = jf.dot_product_attention(q, k, v, mask, query_block=block)
    for a, b in zip(blocked, whole):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    ref_k, ref_v = (np.repeat(np.asarray(x), H // kv_heads, axis=1) for x in (k, v))
    out, weights = numpy_attention(q, ref_k, ref_v, mask)
    np.testing.assert_allclose(blocked[0], out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(blocked[1], weights, rtol=1e-5, atol=1e-5)


def test_query_block_length_keeps_a_block_under_the_limit():
    """Whisper's encoder (6 heads, 1500 x 1500): blocks of 100 queries (a divisor of
    1500, 3.4 MiB); a prime length is padded; weights that fit whole are not blocked."""
    from jaxformer.nn.attention import ATTENTION_BLOCK_BYTES, query_block_length

    assert query_block_length(6, 1500, 1500) == 100
    assert query_block_length(6, 1499, 1500) == ATTENTION_BLOCK_BYTES // (6 * 1500 * 4)
    assert query_block_length(6, 100, 1500) is None
    assert query_block_length(4, 8, 10 ** 6) == 1  # one query is already over the limit
    for heads, t, s in ((6, 1500, 1500), (20, 1500, 1500), (9, 2048, 2048)):
        block = query_block_length(heads, t, s)
        assert block * heads * s * 4 <= ATTENTION_BLOCK_BYTES


def test_tuned_inference_forms_no_whole_row_of_weights_on_a_cpu():
    """At inference (`deterministic`) with `cpu_tuning`, self-attention over 1500
    positions (Whisper's encoder) never holds one row's (H, 1500, 1500) weights on a
    CPU: the compiled program has no array with a (1500, 1500) tail, and its
    temporaries are a fraction of one row's 13.7 MiB. Training, an untuned config and
    a lowering for a GPU or TPU keep the whole product."""
    x = jnp.zeros((1, 1500, 8), jnp.float32)

    def call(module, x, deterministic):
        return module(x, module.kv(x), None, deterministic=deterministic)

    def lowered(deterministic, cpu_tuning=True, platform="cpu"):
        mha = jf.MultiHeadAttention(jf.tiny(num_heads=4, d_model=8, cpu_tuning=cpu_tuning))
        params = jax.eval_shape(lambda: mha.init(jax.random.PRNGKey(0), x, True,
                                                 method=call))["params"]
        fn = jax.jit(lambda p, x: mha.apply({"params": p}, x, deterministic, method=call))
        return fn.trace(params, x).lower(lowering_platforms=(platform,))

    inference = lowered(True).compile()
    assert "1500,1500]" not in inference.as_text()
    assert inference.memory_analysis().temp_size_in_bytes < 8 * 2**20
    assert "1500,1500]" in lowered(False).compile().as_text()
    assert "1500,1500]" in lowered(True, cpu_tuning=False).compile().as_text()
    for platform in ("cuda", "tpu"):
        assert "1500x1500" in lowered(True, platform=platform).as_text()

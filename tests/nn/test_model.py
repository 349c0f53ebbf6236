"""Transformer and DecoderOnlyLM: invariances that hold only if the model is right.

Many tests put their variants in the batch dimension (rows are independent),
so that one forward pass checks them all.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf

PAD = 0


# ----------------------------------------------------------------------------
# Parameter count: seed 001's closed form, written out
# ----------------------------------------------------------------------------


def closed_form_count(c: jf.TransformerConfig, decoder_only: bool = False) -> int:
    d, f = c.d_model, c.d_ff
    kv = c.kv_heads * c.head_dim                                 # D * G K per key/value kernel
    # W_q, W_o (D x D), W_k, W_v (D x GK) (+ biases)
    attention = 2 * d * d + 2 * d * kv + ((2 * d + 2 * kv) if c.attention_bias else 0)
    projections_in = 2 if c.gated_ffn else 1                     # W_1 (and W_gate), W_2
    ffn = (projections_in + 1) * d * f + ((projections_in * f + d) if c.ffn_bias else 0)
    norm = 2 * d if c.norm_type == "layernorm" else d            # gamma (, beta)
    final = norm if c.use_final_norm else 0
    out_proj = 0 if c.tie_output_embedding else d * c.tgt_vocab_size + (
        c.tgt_vocab_size if c.output_bias else 0)
    if decoder_only:
        layers = c.num_decoder_layers * (attention + ffn + 2 * norm)
        positions = c.max_len * d if c.decoder_positions == "learned" else 0
        return c.tgt_vocab_size * d + layers + final + positions + out_proj
    encoder = c.num_encoder_layers * (attention + ffn + 2 * norm) + final
    decoder = c.num_decoder_layers * (2 * attention + ffn + 3 * norm) + final
    embeddings = c.src_vocab_size * d + (0 if c.share_embeddings else c.tgt_vocab_size * d)
    positions = c.max_len * d * ((c.encoder_positions == "learned")
                                 + (c.decoder_positions == "learned"))
    return embeddings + positions + encoder + decoder + out_proj


COUNT_CASES = {
    "tiny_post": jf.tiny(),
    "pre_norm": jf.tiny(norm="pre"),
    "post_with_final_norm": jf.tiny(final_norm=True),
    "tied_output": jf.tiny(tie_output_embedding=True, tgt_vocab_size=20),
    "shared_embeddings": jf.tiny(share_embeddings=True),
    "shared_and_tied": jf.tiny(share_embeddings=True, tie_output_embedding=True),
    "no_attention_bias": jf.tiny(attention_bias=False),
    "learned_positions": jf.tiny(encoder_positions="learned", decoder_positions="learned"),
    "learned_decoder_positions_only": jf.tiny(decoder_positions="learned"),
    "d48_h6_3enc_1dec_gelu": jf.tiny(d_model=48, num_heads=6, num_encoder_layers=3,
                                     num_decoder_layers=1, activation="gelu",
                                     src_vocab_size=30, tgt_vocab_size=23),
    "no_encoder_layers": jf.tiny(num_encoder_layers=0),
    "bench": jf.bench(),
    "grouped_query_rmsnorm_swiglu": jf.tiny(num_kv_heads=2, norm_type="rmsnorm", norm="pre",
                                            gated_ffn=True, activation="silu", d_ff=37,
                                            rope="half", encoder_positions="none"),
    "multi_query_no_biases": jf.tiny(num_kv_heads=1, attention_bias=False, ffn_bias=False,
                                     output_bias=False, gated_ffn=True, activation="gelu"),
    "llama": jf.llama(num_heads=4, num_kv_heads=2, tgt_vocab_size=20, src_vocab_size=20),
}


@pytest.mark.parametrize("case", list(COUNT_CASES))
def test_parameter_count_is_the_closed_form(case):
    config = COUNT_CASES[case]
    tokens = jax.ShapeDtypeStruct((1, 4), jnp.int32)
    params = jax.eval_shape(jf.Transformer(config).init, jax.random.PRNGKey(0), tokens, tokens)
    assert jf.count_params(params["params"]) == closed_form_count(config)


@pytest.mark.parametrize("case", ["tiny_post", "pre_norm", "shared_and_tied",
                                  "no_attention_bias", "learned_positions",
                                  "grouped_query_rmsnorm_swiglu", "multi_query_no_biases",
                                  "llama"])
def test_decoder_only_parameter_count_is_the_closed_form(case):
    config = COUNT_CASES[case].replace(num_encoder_layers=0, share_embeddings=False)
    tokens = jax.ShapeDtypeStruct((1, 4), jnp.int32)
    params = jax.eval_shape(jf.DecoderOnlyLM(config).init, jax.random.PRNGKey(0), tokens)
    assert jf.count_params(params["params"]) == closed_form_count(config, decoder_only=True)


def test_count_params_of_real_arrays(seq2seq, lm):
    model, params, _ = seq2seq
    assert jf.count_params(params) == closed_form_count(model.config)
    lm_model, lm_params, _ = lm
    assert jf.count_params(lm_params) == closed_form_count(lm_model.config, decoder_only=True)


def test_parameter_tree_layout():
    def tree(config):
        tokens = jax.ShapeDtypeStruct((1, 4), jnp.int32)
        return jax.eval_shape(jf.Transformer(config).init, jax.random.PRNGKey(0), tokens,
                              tokens)["params"]

    p = tree(jf.tiny())
    assert set(p) == {"src_embed", "tgt_embed", "encoder", "decoder"}
    assert set(p["encoder"]) == {"layers_0", "layers_1"}
    assert set(p["decoder"]) == {"layers_0", "layers_1", "out_proj"}
    assert set(p["decoder"]["layers_1"]) == {"self_attn", "self_attn_norm", "cross_attn",
                                             "cross_attn_norm", "ffn", "ffn_norm"}
    attn = p["encoder"]["layers_0"]["self_attn"]
    assert attn["query"]["kernel"].shape == (32, 4, 8) and attn["query"]["bias"].shape == (4, 8)
    assert attn["out"]["kernel"].shape == (4, 8, 32) and attn["out"]["bias"].shape == (32,)
    assert p["decoder"]["out_proj"]["kernel"].shape == (32, 16)
    p = tree(jf.tiny(norm="pre", share_embeddings=True, tie_output_embedding=True,
                     encoder_positions="learned"))
    assert set(p) == {"src_embed", "encoder", "decoder"}
    assert set(p["encoder"]) == {"layers_0", "layers_1", "final_norm", "positions"}
    assert set(p["decoder"]) == {"layers_0", "layers_1", "final_norm"}


# ----------------------------------------------------------------------------
# Fixtures for the invariance tests
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def seq2seq(make_transformer):
    """(model, params, apply) of a pre-norm tiny Transformer; apply is jitted once."""
    model, params = make_transformer(jf.tiny(norm="pre", src_vocab_size=16, tgt_vocab_size=20))
    apply = jax.jit(lambda p, s, t: model.apply({"params": p}, s, t))
    return model, params, apply


@pytest.fixture(scope="module")
def lm(make_lm):
    """(model, params, apply) of a post-norm tiny DecoderOnlyLM."""
    model, params = make_lm(jf.tiny(num_encoder_layers=0, tgt_vocab_size=20), seed=1)
    apply = jax.jit(lambda p, t: model.apply({"params": p}, t))
    return model, params, apply


def ids(seed, shape, vocab):
    return np.random.default_rng(seed).integers(3, vocab, shape).astype(np.int32)


# ----------------------------------------------------------------------------
# Causality
# ----------------------------------------------------------------------------


def causal_variants(tokens_T, vocab, seed=0):
    """Row 0: the tokens. Row 1+t: tokens after position t replaced (t = 0..T-2).
    Row T+s: the token at position s replaced (s = 0..T-2)."""
    T = tokens_T.shape[0]
    r = np.random.default_rng(seed)
    rows = [tokens_T.copy()]
    for t in range(T - 1):
        row = tokens_T.copy()
        row[t + 1:] = (row[t + 1:] - 3 + r.integers(1, vocab - 3, T - t - 1)) % (vocab - 3) + 3
        rows.append(row)
    for s in range(T - 1):
        row = tokens_T.copy()
        row[s] = (row[s] - 3 + 1) % (vocab - 3) + 3  # a different real token
        rows.append(row)
    return np.stack(rows)


def check_causality(logits, T):
    logits = np.asarray(logits)
    base = logits[0]
    for t in range(T - 1):  # future tokens changed: positions <= t unchanged, t+1 changed
        np.testing.assert_allclose(logits[1 + t, : t + 1], base[: t + 1], atol=1e-5)
        assert np.abs(logits[1 + t, t + 1] - base[t + 1]).max() > 1e-4
    for s in range(T - 1):  # a past token changed: every later position changes
        later = np.abs(logits[T + s, s + 1:] - base[s + 1:]).max(axis=-1)
        assert (later > 1e-4).all(), (s, later)
        np.testing.assert_allclose(logits[T + s, :s], base[:s], atol=1e-5)


def test_causality_encoder_decoder(seq2seq):
    _, params, apply = seq2seq
    T = 6
    tgt = causal_variants(ids(1, (T,), 20), 20)
    src = np.tile(ids(2, (1, 5), 16), (tgt.shape[0], 1))
    check_causality(apply(params, jnp.asarray(src), jnp.asarray(tgt)), T)


def test_causality_decoder_only(lm):
    _, params, apply = lm
    T = 6
    check_causality(apply(params, jnp.asarray(causal_variants(ids(3, (T,), 20), 20))), T)


def test_source_tokens_all_matter(seq2seq):
    """The decoder does look at the source: changing any source token changes logits."""
    _, params, apply = seq2seq
    S = 5
    src = np.tile(ids(4, (1, S), 16), (S + 1, 1))
    for s in range(S):
        src[1 + s, s] = (src[1 + s, s] - 3 + 1) % 13 + 3
    tgt = np.tile(ids(5, (1, 4), 20), (S + 1, 1))
    logits = np.asarray(apply(params, jnp.asarray(src), jnp.asarray(tgt)))
    assert (np.abs(logits[1:] - logits[:1]).max(axis=(1, 2)) > 1e-4).all()


# ----------------------------------------------------------------------------
# Padding
# ----------------------------------------------------------------------------


def test_appending_pad_to_the_source_leaves_logits_unchanged(seq2seq):
    _, params, apply = seq2seq
    src = ids(6, (2, 5), 16)
    tgt = jnp.asarray(ids(7, (2, 4), 20))
    want = apply(params, jnp.asarray(src), tgt)
    for extra in (2,):
        padded = np.concatenate([src, np.full((2, extra), PAD, np.int32)], axis=1)
        np.testing.assert_allclose(apply(params, jnp.asarray(padded), tgt), want, atol=1e-5)


def test_appending_pad_to_targets_leaves_real_positions_unchanged(seq2seq, lm):
    _, params, apply = seq2seq
    src = jnp.asarray(ids(8, (2, 5), 16))
    tgt = ids(9, (2, 4), 20)
    padded = np.concatenate([tgt, np.full((2, 3), PAD, np.int32)], axis=1)
    np.testing.assert_allclose(apply(params, src, jnp.asarray(padded))[:, :4],
                               apply(params, src, jnp.asarray(tgt)), atol=1e-5)
    _, lm_params, lm_apply = lm
    np.testing.assert_allclose(lm_apply(lm_params, jnp.asarray(padded))[:, :4],
                               lm_apply(lm_params, jnp.asarray(tgt)), atol=1e-5)


def test_padded_row_in_a_batch_equals_the_row_alone(seq2seq):
    """Row 0 is short (right-padded); its logits equal those of the unpadded row alone."""
    _, params, apply = seq2seq
    src = ids(10, (2, 6), 16)
    tgt = ids(11, (2, 5), 20)
    src[0, 3:] = PAD
    tgt[0, 2:] = PAD
    batch = apply(params, jnp.asarray(src), jnp.asarray(tgt))
    alone = apply(params, jnp.asarray(src[:1, :3]), jnp.asarray(tgt[:1, :2]))
    np.testing.assert_allclose(batch[0, :2], alone[0], atol=1e-5)


# ----------------------------------------------------------------------------
# Fully masked rows: finite forward and gradients
# ----------------------------------------------------------------------------


def logits_and_grads(model, params, *args):
    """(logits, d loss / d params) in one jitted forward+backward pass."""

    def loss(p):
        logits = model.apply({"params": p}, *args)
        return -jnp.mean(jax.nn.log_softmax(logits)[..., 3]), logits

    grads, logits = jax.jit(jax.grad(loss, has_aux=True))(params)
    return logits, grads


def all_finite(tree):
    return all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(tree))


def test_fully_masked_rows_are_finite_with_finite_gradients(make_transformer, make_lm):
    """All-PAD source and target rows (default masks) and explicit all-False mask rows."""
    config = jf.tiny(norm="pre", num_encoder_layers=1, num_decoder_layers=1)
    model, params = make_transformer(config)
    src = ids(12, (4, 5), 16)
    tgt = ids(13, (4, 4), 16)
    src[1] = PAD  # an all-PAD source: every cross-attention row is fully masked
    tgt[2] = PAD  # an all-PAD target: the first self-attention row is fully masked
    src, tgt = jnp.asarray(src), jnp.asarray(tgt)
    src_mask = jf.padding_mask(src).at[3].set(False)  # row 3: an explicit all-False mask
    tgt_mask = jf.decoder_self_mask(tgt).at[0, :, 2].set(False)  # row 0, query 2 sees nothing
    logits, grads = logits_and_grads(model, params, src, tgt, src_mask, tgt_mask)
    assert all_finite(logits) and all_finite(grads)
    assert jf.count_params(grads) == jf.count_params(params)

    lm_model, lm_params = make_lm(config.replace(num_encoder_layers=0))
    logits, grads = logits_and_grads(lm_model, lm_params, tgt, tgt_mask)
    assert all_finite(logits) and all_finite(grads)


# ----------------------------------------------------------------------------
# jit == eager; encode/decode == __call__; embedded sources
# ----------------------------------------------------------------------------


def test_jit_equals_eager(seq2seq, lm):
    model, params, apply = seq2seq
    src = jnp.asarray(ids(16, (2, 5), 16))
    tgt = jnp.asarray(ids(17, (2, 4), 20))
    eager = model.apply({"params": params}, src, tgt)
    # XLA may fuse and reorder float32 sums under jit: equal to float32 rounding.
    np.testing.assert_allclose(apply(params, src, tgt), eager, atol=1e-6, rtol=1e-6)
    lm_model, lm_params, lm_apply = lm
    np.testing.assert_allclose(lm_apply(lm_params, tgt),
                               lm_model.apply({"params": lm_params}, tgt), atol=1e-6, rtol=1e-6)


def test_encode_then_decode_equals_call(seq2seq):
    model, params, apply = seq2seq
    src = ids(18, (2, 5), 16)
    src[0, 4] = PAD
    src, tgt = jnp.asarray(src), jnp.asarray(ids(19, (2, 4), 20))
    memory = model.apply({"params": params}, src, method=model.encode)
    assert memory.shape == (2, 5, 32)
    logits = model.apply({"params": params}, tgt, memory, jf.padding_mask(src),
                         method=model.decode)
    np.testing.assert_allclose(logits, model.apply({"params": params}, src, tgt), atol=1e-6)


def test_encoder_accepts_embedded_inputs(seq2seq):
    """Float inputs that are exactly the scaled token embeddings encode like the ids."""
    model, params, apply = seq2seq
    src = ids(20, (2, 5), 16)
    src[1, 3:] = PAD
    src = jnp.asarray(src)
    x_BSD = model.apply({"params": params}, src, method=lambda m, s: m.src_embed(s))
    assert x_BSD.shape == (2, 5, 32) and x_BSD.dtype == jnp.float32
    mask = jf.padding_mask(src)
    from_ids = model.apply({"params": params}, src, method=model.encode)
    from_floats = model.apply({"params": params}, x_BSD, mask, method=model.encode)
    np.testing.assert_allclose(from_floats, from_ids, atol=1e-6)
    tgt = jnp.asarray(ids(21, (2, 4), 20))
    np.testing.assert_allclose(model.apply({"params": params}, x_BSD, tgt, mask),
                               model.apply({"params": params}, src, tgt), atol=1e-6)


# ----------------------------------------------------------------------------
# dtypes, dropout, attention weights
# ----------------------------------------------------------------------------


def test_bfloat16_compute_keeps_float32_params_and_logits(seq2seq):
    model, params, apply = seq2seq
    src = jnp.asarray(ids(22, (2, 5), 16))
    tgt = jnp.asarray(ids(23, (2, 4), 20))
    bf16 = jf.Transformer(model.config.replace(dtype="bfloat16"))
    params_bf16 = jax.eval_shape(bf16.init, jax.random.PRNGKey(0), src, tgt)["params"]
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(params_bf16))
    want = apply(params, src, tgt)
    got, state = jax.jit(lambda p: bf16.apply({"params": p}, src, tgt,
                                              mutable="intermediates"))(params)
    assert got.dtype == jnp.float32  # logits are returned in float32
    weights = jf.attention_weights(state["intermediates"])
    assert all(w.dtype == jnp.bfloat16 for w in weights.values())  # really computed in bf16
    # How close to float32: tests/test_precision.py, under bounds derived from bf16.
    assert not np.array_equal(np.asarray(got), np.asarray(want))


def test_dropout_only_when_not_deterministic_and_reproducible(seq2seq):
    plain, params, _ = seq2seq
    # Attention dropout is tested in test_attention (its jitted compile is slow on CPU).
    model = jf.Transformer(plain.config.replace(residual_dropout=0.3, embedding_dropout=0.3))
    src = jnp.asarray(ids(24, (2, 5), 16))
    tgt = jnp.asarray(ids(25, (2, 4), 20))
    clean = plain.apply({"params": params}, src, tgt)
    np.testing.assert_allclose(model.apply({"params": params}, src, tgt), clean, atol=1e-6)

    noisy_apply = jax.jit(lambda p, key: model.apply({"params": p}, src, tgt, deterministic=False,
                                                     rngs={"dropout": key}))

    def noisy(seed):
        return noisy_apply(params, jax.random.PRNGKey(seed))

    np.testing.assert_array_equal(noisy(0), noisy(0))
    assert not np.allclose(noisy(0), clean, atol=1e-3)
    assert not np.allclose(noisy(0), noisy(1), atol=1e-3)


def test_attention_weights_are_returned_per_layer(seq2seq):
    model, params, _ = seq2seq
    src = ids(26, (2, 5), 16)
    src[0, 3:] = PAD
    tgt = jnp.asarray(ids(27, (2, 4), 20))
    _, state = model.apply({"params": params}, jnp.asarray(src), tgt, mutable="intermediates")
    weights = jf.attention_weights(state["intermediates"])
    assert set(weights) == {f"{stack}/layers_{i}/{kind}"
                            for i in range(2)
                            for stack, kind in [("encoder", "self_attn"),
                                                ("decoder", "self_attn"),
                                                ("decoder", "cross_attn")]}
    cross = np.asarray(weights["decoder/layers_0/cross_attn"])
    self_ = np.asarray(weights["decoder/layers_1/self_attn"])
    assert cross.shape == (2, 4, 4, 5) and self_.shape == (2, 4, 4, 4)
    assert (cross[0, :, :, 3:] == 0).all()  # PAD source keys get no weight
    assert (np.triu(np.ones((4, 4)), 1).astype(bool) & (self_ != 0)).sum() == 0  # causal
    np.testing.assert_allclose(cross.sum(-1), 1.0, atol=1e-6)

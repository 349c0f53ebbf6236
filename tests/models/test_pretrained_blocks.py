"""Choices that real checkpoints need: per-projection attention biases, PAD == EOS."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.decode import api as decoding

from conftest import reference_greedy


def _leaves(tree):
    return {"/".join(getattr(k, "key", str(k)) for k in path): leaf.shape
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def test_attention_biases_all_letters_is_todays_tree(make_transformer):
    _, default = make_transformer(jf.tiny())
    _, explicit = make_transformer(jf.tiny(attention_biases="qkvo"))
    assert _leaves(default) == _leaves(explicit)


def test_attention_biases_select_the_projections(make_transformer):
    _, params = make_transformer(jf.tiny(attention_biases="qvo"))
    names = _leaves(params)
    for stack, attn in (("encoder", "self_attn"), ("decoder", "self_attn"),
                        ("decoder", "cross_attn")):
        prefix = f"{stack}/layers_0/{attn}"
        assert f"{prefix}/query/bias" in names and f"{prefix}/value/bias" in names
        assert f"{prefix}/out/bias" in names and f"{prefix}/key/bias" not in names
    _, none = make_transformer(jf.tiny(attention_biases=""))
    assert not any(n.endswith("bias") and "_attn/" in n for n in _leaves(none))


def test_without_key_bias_equals_full_biases_whatever_the_key_bias(make_transformer, tokens):
    # A key bias adds q.b_k to every logit of a query: softmax ignores it. So the
    # "qvo" model must equal the full-bias model for ANY key bias, while the query,
    # value and out biases (non-zero here) must all be wired in.
    full_model, full = make_transformer(jf.tiny(), seed=3)
    qvo_model = jf.Transformer(jf.tiny(attention_biases="qvo"))
    qvo = jax.tree_util.tree_map(lambda x: x, full)

    def drop_key_bias(tree):
        for name, sub in tree.items():
            if name == "key":
                sub.pop("bias")
            elif isinstance(sub, dict):
                drop_key_bias(sub)
    drop_key_bias(qvo)
    src, tgt = tokens(0, (2, 5)), tokens(1, (2, 4))
    want = full_model.apply({"params": full}, src, tgt, None, jf.causal_mask(4))
    got = qvo_model.apply({"params": qvo}, src, tgt, None, jf.causal_mask(4))
    np.testing.assert_allclose(got, want, atol=1e-5)
    # ...and dropping the query bias instead does change the output.
    no_q = jf.Transformer(jf.tiny(attention_biases="kvo"))
    noq = jax.tree_util.tree_map(lambda x: x, full)
    for stack in ("encoder", "decoder"):
        for i in range(2):
            for attn in ("self_attn", "cross_attn"):
                node = noq[stack][f"layers_{i}"].get(attn)
                if node is not None:
                    node["query"].pop("bias")
    other = no_q.apply({"params": noq}, src, tgt, None, jf.causal_mask(4))
    assert np.abs(np.asarray(other) - np.asarray(want)).max() > 1e-3


def test_pad_may_equal_eos_and_decoding_still_matches_recomputation():
    config = jf.tiny(pad_id=2, bos_id=1, eos_id=2, norm="pre")
    model = jf.Transformer(config)
    src = jnp.asarray(np.random.default_rng(2).integers(3, 16, (4, 6)), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), src, src[:, :3])["params"]
    params["decoder"]["out_proj"]["bias"] = params["decoder"]["out_proj"]["bias"].at[2].add(2.5)
    got = decoding.greedy_decode(model, params, src, max_new_tokens=8)
    tokens, lengths, _ = reference_greedy(model, params, src, 8)
    np.testing.assert_array_equal(got.tokens, tokens)
    np.testing.assert_array_equal(got.lengths, lengths)
    lengths = np.asarray(got.lengths)
    assert (lengths < 8).any()  # EOS (= PAD) was emitted and the row stopped there
    for row, n in zip(np.asarray(got.tokens), lengths):
        if n < 8:
            assert (row[n - 1:] == 2).all()


@pytest.mark.parametrize("ids", [dict(pad_id=1, bos_id=1, eos_id=2),
                                 dict(pad_id=0, bos_id=2, eos_id=2)])
def test_bos_must_still_differ(ids):
    with pytest.raises(ValueError, match="BOS must differ"):
        jf.tiny(**ids)


# -- per-stack positions ---------------------------------------------------------------


def test_per_stack_lengths_shape_the_tables_and_the_checks(make_transformer):
    config = jf.tiny(encoder_positions="learned", decoder_positions="learned",
                     encoder_max_len=40, decoder_max_len=8, norm="pre")
    model, params = make_transformer(config)
    assert params["encoder"]["positions"]["embedding"].shape == (40, 32)
    assert params["decoder"]["positions"]["embedding"].shape == (8, 32)
    src = jnp.asarray(np.random.default_rng(0).integers(3, 16, (2, 40)), jnp.int32)  # > max_len
    got = decoding.greedy_decode(model, params, src, max_new_tokens=8)
    tokens, lengths, _ = reference_greedy(model, params, src, 8)
    np.testing.assert_array_equal(got.tokens, tokens)
    with pytest.raises(ValueError, match="max_len=8"):
        decoding.greedy_decode(model, params, src, max_new_tokens=9)
    with pytest.raises(ValueError, match="max_len"):
        decoding.greedy_decode(model, params, jnp.concatenate([src, src[:, :1]], 1),
                               max_new_tokens=4)


def test_default_lengths_keep_todays_tree(make_transformer):
    learned = dict(encoder_positions="learned", decoder_positions="learned")
    _, today = make_transformer(jf.tiny(**learned))
    _, explicit = make_transformer(jf.tiny(encoder_max_len=32, decoder_max_len=32, **learned))
    assert _leaves(today) == _leaves(explicit)


def test_fixed_table_is_the_checkpoints_and_is_not_trained(make_transformer, tokens):
    fixed_model, fixed = make_transformer(jf.tiny(encoder_positions="fixed", norm="pre"))
    learned_model = jf.Transformer(jf.tiny(encoder_positions="learned", norm="pre"))
    table = fixed["encoder"]["positions"]["embedding"]
    # Initialised to the sinusoidal table, so a fresh "fixed" model is today's default.
    init = jax.eval_shape(fixed_model.init, jax.random.PRNGKey(0), tokens(0, (1, 2)),
                          tokens(0, (1, 2)))
    assert init["params"]["encoder"]["positions"]["embedding"].shape == (32, 32)
    real = fixed_model.init(jax.random.PRNGKey(0), tokens(0, (1, 2)), tokens(0, (1, 2)))
    np.testing.assert_allclose(real["params"]["encoder"]["positions"]["embedding"],
                               jf.sinusoidal_table(32, 32))
    src, tgt = tokens(2, (2, 6)), tokens(3, (2, 5))

    def loss(model, params):
        return jnp.sum(model.apply({"params": params}, src, tgt, None, jf.causal_mask(5)) ** 2)

    # Same table in the same place: same outputs as "learned" ...
    np.testing.assert_allclose(loss(fixed_model, fixed), loss(learned_model, fixed), rtol=1e-6)
    # ... but no gradient flows into it.
    g_fixed = jax.grad(lambda p: loss(fixed_model, p))(fixed)
    g_learned = jax.grad(lambda p: loss(learned_model, p))(fixed)
    assert not np.asarray(g_fixed["encoder"]["positions"]["embedding"]).any()
    assert np.asarray(g_learned["encoder"]["positions"]["embedding"]).any()
    assert table.shape == (32, 32)

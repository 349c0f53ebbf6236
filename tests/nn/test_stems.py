"""Encoders without a token table, and the input-stem slot (params in the same tree)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import erf

import jaxformer as jf
from jaxformer.decode import beam, api as decoding
from jaxformer.nn.stems import ConvStem

from conftest import numpy_params
from conftest import reference_greedy

CONFIG = jf.tiny(encoder_input="embedded", activation="gelu", norm="pre")


def _features(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


@pytest.fixture(scope="module")
def stemmed():
    model = jf.Transformer(CONFIG, stem=ConvStem(CONFIG))
    ids = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    params = numpy_params(model, jax.ShapeDtypeStruct((1, 20, 5), jnp.float32), ids, seed=1)
    return model, params


def test_embedded_encoder_has_no_source_table_and_refuses_ids(make_transformer, tokens):
    tok_model, tok_params = make_transformer(jf.tiny(activation="gelu", norm="pre"))
    emb_model = jf.Transformer(CONFIG)
    emb_params = {k: v for k, v in tok_params.items() if k != "src_embed"}
    abstract = jax.eval_shape(emb_model.init, jax.random.PRNGKey(0),
                              jax.ShapeDtypeStruct((1, 2, 32), jnp.float32),
                              jax.ShapeDtypeStruct((1, 1), jnp.int32))["params"]
    assert set(abstract) == set(emb_params) == {"encoder", "decoder", "tgt_embed"}
    x, tgt = _features(0, (2, 6, 32)), tokens(1, (2, 4))
    np.testing.assert_array_equal(emb_model.apply({"params": emb_params}, x, tgt),
                                  tok_model.apply({"params": tok_params}, x, tgt))
    with pytest.raises(ValueError, match="embedded inputs"):
        emb_model.apply({"params": emb_params}, tokens(0, (2, 6)), tgt)
    with pytest.raises(ValueError, match="embedded inputs"):
        decoding.greedy_decode(emb_model, emb_params, tokens(0, (2, 6)), max_new_tokens=3)


def test_share_embeddings_needs_a_source_table():
    with pytest.raises(ValueError, match="share_embeddings"):
        jf.tiny(encoder_input="embedded", share_embeddings=True)


def _numpy_conv_stem(x, params, strides=(1, 2)):
    """Reference: zero-padded 1-D convolutions (width 3), exact GELU, in numpy."""
    x = np.asarray(x, np.float64)
    for i, stride in enumerate(strides):
        w = np.asarray(params[f"conv_{i}"]["kernel"], np.float64)  # (3, C_in, D)
        b = np.asarray(params[f"conv_{i}"]["bias"], np.float64)
        xp = np.pad(x, ((0, 0), (1, 1), (0, 0)))
        out_len = (x.shape[1] + stride - 1) // stride
        y = np.stack([np.einsum("bkc,kcd->bd", xp[:, t * stride:t * stride + 3], w)
                      for t in range(out_len)], axis=1) + b
        x = 0.5 * y * (1 + erf(y / np.sqrt(2)))
    return x


def test_stem_params_live_in_the_tree_and_compose(stemmed, tokens):
    model, params = stemmed
    assert set(params["stem"]) == {"conv_0", "conv_1"}
    assert params["stem"]["conv_0"]["kernel"].shape == (3, 5, 32)
    x, tgt = _features(2, (2, 20, 5)), tokens(3, (2, 4))
    stem_out = ConvStem(CONFIG).apply({"params": params["stem"]}, x)
    np.testing.assert_allclose(stem_out, _numpy_conv_stem(x, params["stem"]), atol=1e-5)
    assert stem_out.shape == (2, 10, 32)
    plain = jf.Transformer(CONFIG)
    rest = {k: v for k, v in params.items() if k != "stem"}
    np.testing.assert_allclose(model.apply({"params": params}, x, tgt),
                               plain.apply({"params": rest}, stem_out, tgt), atol=1e-6)
    # The stem trains with the model: gradients reach its parameters.
    grads = jax.grad(lambda p: jnp.sum(model.apply({"params": p}, x, tgt) ** 2))(params)
    assert np.asarray(grads["stem"]["conv_0"]["kernel"]).any()


def test_decoding_through_a_stem_equals_recomputation(stemmed):
    model, params = stemmed
    x = _features(4, (3, 20, 5))
    got = decoding.greedy_decode(model, params, x, max_new_tokens=6)
    tokens, lengths, _ = reference_greedy(model, params, x, 6)
    np.testing.assert_array_equal(got.tokens, tokens)
    np.testing.assert_array_equal(got.lengths, lengths)
    best = beam.beam_search(model, params, x, max_new_tokens=6, beam_size=1)
    np.testing.assert_array_equal(best.tokens, tokens)

"""Inspection: captured activations and attention weights (both models, the cached
decode step) checked against an independent softmax and against the full forward;
treescope renderings."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from conftest import numpy_params, random_tokens
from jaxformer.decode.capture import capture_step
from jaxformer.nn.inspection import capture, modules_named, render


def reference_weights(query_BTHK, key_BSHK, visible_BTS):
    """softmax(q k^T / sqrt(K)) over the visible keys, in numpy (float64)."""
    q, k = np.asarray(query_BTHK, np.float64), np.asarray(key_BSHK, np.float64)
    scores = np.einsum("bthk,bshk->bhts", q, k) / np.sqrt(q.shape[-1])
    scores = np.where(visible_BTS[:, None], scores, -np.inf)
    scores -= scores.max(-1, keepdims=True)
    weights = np.exp(scores)
    return weights / weights.sum(-1, keepdims=True)


@pytest.fixture(scope="module")
def lm():
    model = jf.DecoderOnlyLM(jf.tiny(num_encoder_layers=0))
    tokens = random_tokens(0, (2, 6), 16).at[1, -2:].set(0)  # row 1 ends in PAD
    return model, numpy_params(model, jax.ShapeDtypeStruct((1, 1), jnp.int32)), tokens


def test_captured_attention_weights_are_the_softmax_of_the_captured_queries_and_keys(lm):
    model, params, tokens = lm
    logits, acts = capture(model, params, tokens)
    np.testing.assert_array_equal(np.asarray(logits),
                                  np.asarray(model.apply({"params": params}, tokens)))
    visible = np.tril(np.ones((6, 6), bool))[None] & (np.asarray(tokens) != 0)[:, None, :]
    for i in range(2):
        layer = f"decoder/layers_{i}/self_attn"
        got = acts[f"{layer}/attention_weights"]
        assert got.shape == (2, 4, 6, 6)  # (B, H, T, S)
        want = reference_weights(acts[f"{layer}/query/__call__"],
                                 acts[f"{layer}/key/__call__"], visible)
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-6)
        # ... and are what jf.attention_weights reads from the sown collection
        _, state = model.apply({"params": params}, tokens, mutable="intermediates")
        np.testing.assert_array_equal(np.asarray(got),
                                      np.asarray(jf.attention_weights(
                                          state["intermediates"])[layer]))
    assert acts["decoder/layers_1/ffn/__call__"].shape == (2, 6, 32)  # (B, T, D)


def test_an_encoder_decoders_cross_attention_and_a_filter(make_transformer):
    model, params = make_transformer(jf.tiny())
    src, tgt = random_tokens(1, (2, 5), 16), random_tokens(2, (2, 3), 16)
    _, acts = capture(model, params, src, tgt, modules=modules_named("layers_1", "cross_attn"))
    weights = acts["decoder/layers_1/cross_attn/attention_weights"]
    assert weights.shape == (2, 4, 3, 5)  # (B, H, T, S): S = the memory
    want = reference_weights(acts["decoder/layers_1/cross_attn/query/__call__"],
                             acts["decoder/layers_1/cross_attn/key/__call__"],
                             np.ones((2, 3, 5), bool))
    np.testing.assert_allclose(np.asarray(weights), want, atol=1e-6)
    # the filter: only that module's outputs, and every sown weight
    called = sorted(k for k in acts if k.endswith("__call__"))
    assert called and all("layers_1/cross_attn" in k for k in called)
    assert "encoder/layers_0/self_attn/attention_weights" in acts
    memory, acts = capture(model, params, src, modules=False, method="encode")
    assert memory.shape == (2, 5, 32) and set(acts) == {
        f"encoder/layers_{i}/self_attn/attention_weights" for i in range(2)}


def test_a_cached_steps_attention_weights_are_the_full_forwards_row(lm):
    """Step t's query (slot t) attends over the cache's T_max slots: its weights are
    row t of the full forward's (B, H, T, T) weights, then zeros for unwritten slots."""
    model, params, tokens = lm
    tokens = tokens[:1]  # no PAD
    _, full = capture(model, params, tokens, modules=False)
    cache = jf.init_cache(model.config, batch=1, max_len=8)
    step = jax.jit(lambda c, t: capture_step(model, params, c, t, modules=False))
    for t in range(tokens.shape[1]):
        logits, cache, acts = step(cache, tokens[:, t:t + 1])
        for i in range(2):
            got = np.asarray(acts[f"decoder/layers_{i}/self_attn/attention_weights"])
            assert got.shape == (1, 4, 1, 8)  # (B, H, 1, T_max)
            want = np.asarray(full[f"decoder/layers_{i}/self_attn/attention_weights"])
            np.testing.assert_allclose(got[:, :, 0, :t + 1], want[:, :, t, :t + 1], atol=1e-6)
            assert not got[:, :, 0, t + 1:].any()
    reference, _ = jf.decode.cached_forward(model, params, jf.init_cache(
        model.config, batch=1, max_len=8), tokens[:, :1])
    first, _, _ = capture_step(model, params, jf.init_cache(model.config, batch=1, max_len=8),
                               tokens[:, :1])
    np.testing.assert_array_equal(np.asarray(first), np.asarray(reference))


def test_render_shows_parameter_shapes_and_config_fields(lm):
    pytest.importorskip("treescope", reason="needs the inspect extra")
    model, params, _ = lm
    text = render(params)
    assert "layers_0" in text and "float32(32, 4, 8)" in text
    assert "d_model=32" in render(model.config)
    assert render(model.config, html=True).lstrip().startswith("<")


def test_render_without_treescope_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "treescope", None)
    with pytest.raises(ImportError, match=r"jaxformer\[inspect\]"):
        render({"a": 1})

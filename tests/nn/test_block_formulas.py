"""The newer families' block formulas against a numpy forward pass, no optional package:
Gemma's offset RMSNorm x / rms(x) * (1 + w), the per-head q/k norm (before RoPE), soft
caps cap * tanh(x / cap) on the attention logits and on the output logits, and the local
layers' own RoPE base (`rope_local_theta`), on a tiny two-layer (local, global) Gemma-like
LM. Every formula matters here: norm weights near 0 (so 1 + w and w differ), per-feature
q/k norm weights (so norm-then-rotate and rotate-then-norm differ), caps the logits
exceed, a local base of 20 against 10000 and a window (3) shorter than the input (8).
(The same blocks against `transformers`: tests/models/test_hf_dirs.py.)"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf

from conftest import numpy_params

CONFIG = jf.llama(num_decoder_layers=2, norm="sandwich", norm_scale_plus_one=True, qk_norm=True,
                  d_model=16, num_heads=2, head_dim=8, d_ff=24, query_scale=0.3,
                  attn_logit_softcapping=2.0, final_logit_softcapping=3.0, sliding_window=3,
                  attention_pattern="LG", rope_theta=1e4, rope_local_theta=20.0,
                  activation="gelu_tanh", scale_embeddings=True, max_len=16,
                  layer_norm_epsilon=1e-6)
TOKENS = np.array([[5, 9, 3, 14, 7, 7, 11, 4]], np.int32)


def params_of(model):
    params = jax.tree_util.tree_map(np.asarray, numpy_params(
        model, jax.ShapeDtypeStruct((1, 1), jnp.int32), seed=11))
    r = np.random.default_rng(12)

    def near_zero_scales(path, leaf):  # Gemma's norm weights: small, around 0
        last = getattr(path[-1], "key", "")
        return (0.3 * r.normal(size=leaf.shape)).astype(np.float32) if last == "scale" else leaf

    return jax.tree_util.tree_map_with_path(near_zero_scales, params)


def reference_logits(p, tokens, c=CONFIG):
    """The LM's logits (T, V) in float64 numpy, one row, written from the formulas."""
    f = lambda x: np.asarray(x, np.float64)  # noqa: E731

    def norm(x, scale):  # Gemma: x / rms(x) * (1 + w)
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + c.layer_norm_epsilon) * (
            1.0 + f(scale))

    def rope(x_THK, theta):  # "half" layout: pairs (i, i + K/2)
        K = x_THK.shape[-1]
        angles = np.arange(len(x_THK))[:, None] * theta ** (-np.arange(0, K, 2) / K)
        cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]
        a, b = x_THK[..., :K // 2], x_THK[..., K // 2:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    def cap(x, value):
        return value * np.tanh(x / value)

    def gelu_tanh(x):
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))

    embedding = f(p["embed"]["embedding"])
    x = embedding[tokens] * np.float32(math.sqrt(c.d_model))
    T = len(tokens)
    t, s = np.arange(T)[:, None], np.arange(T)[None, :]
    for i in range(c.num_decoder_layers):
        layer = p["decoder"][f"layers_{i}"]
        a = layer["self_attn"]
        local = c.attention_pattern[i % 2] == "L"
        h = norm(x, layer["self_attn_norm"]["scale"])
        q, k, v = (np.einsum("td,dhk->thk", h, f(a[n]["kernel"])) for n in ("query", "key", "value"))
        theta = c.rope_local_theta if local and c.rope_local_theta else c.rope_theta
        q = rope(norm(q, a["query_norm"]["scale"]), theta)  # q/k norm first, then RoPE
        k = rope(norm(k, a["key_norm"]["scale"]), theta)
        logits = cap(np.einsum("thk,shk->hts", q, k) * c.query_scale, c.attn_logit_softcapping)
        visible = (s <= t) & ((t - s < c.sliding_window) if local else True)
        logits = np.where(visible, logits, -np.inf)
        w = np.exp(logits - logits.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        out = np.einsum("thk,hkd->td", np.einsum("hts,shk->thk", w, v), f(a["out"]["kernel"]))
        x = x + norm(out, layer["self_attn_post_norm"]["scale"])
        h = norm(x, layer["ffn_norm"]["scale"])
        ffn = layer["ffn"]
        up = gelu_tanh(h @ f(ffn["gate"]["kernel"])) * (h @ f(ffn["wi"]["kernel"]))
        x = x + norm(up @ f(ffn["wo"]["kernel"]), layer["ffn_post_norm"]["scale"])
    x = norm(x, p["decoder"]["final_norm"]["scale"])
    return cap(x @ embedding.T, c.final_logit_softcapping)


@pytest.fixture(scope="module")
def case():
    model = jf.DecoderOnlyLM(CONFIG)
    params = params_of(model)
    return params, reference_logits(params, TOKENS[0])


@pytest.mark.parametrize("impl", ["einsum", "blockwise"])
def test_gemma_like_blocks_equal_the_numpy_formulas(case, impl):
    params, want = case
    model = jf.DecoderOnlyLM(CONFIG.replace(attention_impl=impl))
    got = np.asarray(jax.jit(model.apply)({"params": params}, jnp.asarray(TOKENS)))[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # The caps bind: the uncapped logits exceed them.
    assert np.abs(np.arctanh(want / CONFIG.final_logit_softcapping)).max() > 1.0


def test_each_formula_changes_the_result(case):
    """Must-differ: the reference with each block replaced by its plain version is another
    model (so the comparison above sees each one)."""
    params, want = case
    plain = {
        "plain_rope_base": CONFIG.replace(rope_local_theta=None),
        "no_attention_cap": CONFIG.replace(attn_logit_softcapping=1e9),
        "no_final_cap": CONFIG.replace(final_logit_softcapping=1e9),
    }
    for name, config in plain.items():
        assert np.abs(reference_logits(params, TOKENS[0], config) - want).max() > 1e-2, name

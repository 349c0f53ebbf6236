"""The blocks of today's open models as config choices (issue 33), beyond the checkpoint
tests of tests/models/test_hf_dirs.py: the norm placements against a numpy formula,
the scanned stack with mixed local/global layers against the unrolled one, the
sliding window in packed segments, the ring-buffer KV cache against full
recomputation (and its size), and the validation of the new fields.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.decode import api as decoding
from jaxformer.decode import cache as cache_lib
from jaxformer.nn import stacking

from conftest import reference_greedy

# A Gemma-like LM: every new block on at once.
GEMMA_LIKE = dict(num_encoder_layers=0, num_decoder_layers=3, norm="sandwich",
                  norm_type="rmsnorm", norm_scale_plus_one=True, qk_norm=True, head_dim=12,
                  query_scale=0.3, attn_logit_softcapping=3.0, final_logit_softcapping=5.0,
                  sliding_window=3, attention_pattern="LG", rope="half", rope_theta=1e4,
                  rope_local_theta=50.0, decoder_positions="none", gated_ffn=True,
                  activation="gelu_tanh", embedding_scale_dtype="compute", max_len=40)


def lm(make_lm, seed=0, **overrides):
    return make_lm(jf.tiny(**(GEMMA_LIKE | overrides)), seed=seed)


def ids(seed, shape, low=3, high=16):
    return jnp.asarray(np.random.default_rng(seed).integers(low, high, shape), jnp.int32)


WIDTH = 11  # every single-row pass of `gemma` has this width: one compile serves all


@pytest.fixture(scope="module")
def gemma(make_lm):
    """(model, params, forward): the Gemma-like LM (layers L, G, L) and its jitted
    `forward(params, tokens_1W, mask, positions_1W)`."""
    model, params = lm(make_lm)
    forward = jax.jit(lambda p, t, mask, pos: model.apply({"params": p}, t, mask,
                                                          positions_BT=pos))
    return model, params, forward


def causal_row(tokens_1T):
    """(tokens right-padded to WIDTH, causal mask, positions 0..WIDTH-1): the first T
    logits are the row's alone (the mask hides the padding that follows)."""
    padded = jnp.pad(tokens_1T, ((0, 0), (0, WIDTH - tokens_1T.shape[1])), constant_values=3)
    return padded, jf.causal_mask(WIDTH), jnp.arange(WIDTH)[None]


def test_defaults_keep_head_dim_derived():
    assert jf.tiny().head_dim == 8 and jf.tiny().replace(d_model=64).head_dim == 16
    assert jf.tiny(head_dim=5, d_model=30, num_heads=4).head_dim == 5  # 30 % 4 != 0 is fine
    assert jf.tiny(head_dim=8).replace(d_model=64).head_dim == 8  # explicit stays
    assert jf.TransformerConfig.from_dict(jf.tiny().to_dict()).replace(d_model=64).head_dim == 16


def test_post_sublayer_norm_equals_the_formula(make_lm):
    """x + RMSNorm(f(x)) per sublayer (OLMo 2), one layer, against numpy."""
    config = jf.llama(num_decoder_layers=1, norm="post_sublayer", d_model=16, num_heads=2,
                      d_ff=24, rope="none", tie_output_embedding=False)
    model, p = make_lm(config, seed=1)
    tokens = ids(0, (1, 5))
    got = np.asarray(jax.jit(model.apply)({"params": p}, tokens, jf.causal_mask(5)))
    q = lambda name: np.asarray(name, np.float64)  # noqa: E731
    layer = p["decoder"]["layers_0"]

    def rms(x, scale):
        return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + config.layer_norm_epsilon) * q(scale)

    x = q(p["embed"]["embedding"])[np.asarray(tokens[0])]
    a = layer["self_attn"]
    qh = np.einsum("td,dhk->htk", x, q(a["query"]["kernel"]))
    kh = np.einsum("td,dhk->htk", x, q(a["key"]["kernel"]))
    vh = np.einsum("td,dhk->htk", x, q(a["value"]["kernel"]))
    logits = qh @ kh.transpose(0, 2, 1) / np.sqrt(8) + np.triu(np.full((5, 5), -1e30), 1)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    attn = np.einsum("htk,hkd->td", (w / w.sum(-1, keepdims=True)) @ vh, q(a["out"]["kernel"]))
    x = x + rms(attn, layer["self_attn_norm"]["scale"])
    f = layer["ffn"]
    silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
    h = silu(x @ q(f["gate"]["kernel"])) * (x @ q(f["wi"]["kernel"])) @ q(f["wo"]["kernel"])
    x = rms(x + rms(h, layer["ffn_norm"]["scale"]), p["decoder"]["final_norm"]["scale"])
    want = x @ q(p["decoder"]["out_proj"]["kernel"])
    np.testing.assert_allclose(got[0], want, rtol=1e-4, atol=1e-4)


def test_scanned_mixed_pattern_equals_unrolled(gemma):
    """(Remat under scan is covered by tests/nn/test_remat.py.)"""
    model, params, forward = gemma
    tokens, mask, positions = causal_row(ids(1, (1, WIDTH)))
    want = forward(params, tokens, mask, positions)
    scanned = jf.DecoderOnlyLM(model.config.replace(scan_layers=True))
    # The local layers' frequencies and window are really per layer: all-global differs.
    all_global = jf.DecoderOnlyLM(model.config.replace(attention_pattern="G"))
    got, other = jax.jit(lambda p, stacked, t: (  # one compile for both
        scanned.apply({"params": stacked}, t), all_global.apply({"params": p}, t)))(
        params, stacking.stack_layers(params), tokens)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(other) - np.asarray(want)).max() > 1e-3


def test_window_applies_inside_packed_segments(gemma):
    """Two sequences packed in one row (segment mask, positions restarting) give each
    sequence's logits alone."""
    model, params, forward = gemma
    first, second = ids(2, (1, 6)), ids(3, (1, 5))
    packed = jnp.concatenate([first, second], axis=1)
    segment = jnp.asarray([0] * 6 + [1] * 5)
    mask = (segment[:, None] == segment[None, :])[None, None] & jf.causal_mask(WIDTH)
    positions = jnp.asarray([list(range(6)) + list(range(5))])
    got = forward(params, packed, mask, positions)
    np.testing.assert_allclose(got[:, :6], forward(params, *causal_row(first))[:, :6],
                               atol=1e-5)
    np.testing.assert_allclose(got[:, 6:], forward(params, *causal_row(second))[:, :5],
                               atol=1e-5)


def full_recompute_greedy(model, params, rows, n_new):
    """Each row alone, a full forward pass per new token (one fixed-width buffer, so one
    compile; the causal mask hides what follows the read position): the reference."""
    width = max(len(r) for r in rows) + n_new
    forward = jax.jit(lambda p, t: model.apply({"params": p}, t, jf.causal_mask(width)))
    out = []
    for row in rows:
        seq = np.full(width, 3, np.int32)
        seq[:len(row)] = row
        for step in range(n_new):
            logits = np.asarray(forward(params, jnp.asarray(seq[None])))[0, len(row) + step - 1]
            seq[len(row) + step] = int(np.argmax(logits))
        out.append(seq[len(row):len(row) + n_new])
    return np.asarray(out)


LENGTHS, N_NEW = (7, 4), 12


@pytest.fixture(scope="module")
def ring_case(make_lm):
    """(model, params, right-padded prompts, greedy tokens by full recomputation): computed
    once for every `segments` below."""
    model, params = lm(make_lm, seed=2, final_logit_softcapping=None)
    out_bias = params["decoder"]["out_proj"]["bias"]
    params["decoder"]["out_proj"]["bias"] = np.where(np.arange(len(out_bias)) == 2, -1e3,
                                                     out_bias)  # EOS never: 12 tokens each
    rows = [np.asarray(ids(10 + i, (n,))) for i, n in enumerate(LENGTHS)]
    batch = np.zeros((2, max(LENGTHS)), np.int32)
    for i, row in enumerate(rows):
        batch[i, :len(row)] = row
    return model, params, batch, full_recompute_greedy(model, params, rows, N_NEW)


@pytest.mark.parametrize("segments", [1, 3])
def test_ring_cache_greedy_equals_full_recomputation(ring_case, segments):
    """Ragged prompts longer than the window, 12 new tokens: the rings wrap many times
    (and, in segments, grow and stay put through `fold`)."""
    model, params, batch, want = ring_case
    out = decoding.generate(model, params, jnp.asarray(batch), max_new_tokens=N_NEW,
                            prompt_lengths=np.asarray(LENGTHS), segments=segments)
    np.testing.assert_array_equal(np.asarray(out.tokens), want)


def test_all_local_cache_at_four_windows_is_a_quarter(make_lm):
    config = jf.tiny(**(GEMMA_LIKE | dict(attention_pattern=None, sliding_window=8,
                                          max_len=64)))
    ring = cache_lib.init_cache(config, batch=2, max_len=32)
    full = cache_lib.init_cache(config.replace(sliding_window=None), batch=2, max_len=32)
    assert cache_lib.cache_bytes(ring) / cache_lib.cache_bytes(full) == 8 / 32
    cache_lib.check_cache(ring, config)


def test_encoder_decoder_with_local_layers_decodes_like_recomputation(make_transformer):
    config = jf.tiny(norm="sandwich", qk_norm=True, sliding_window=2, attention_pattern="LG",
                     rope="half", decoder_positions="none", head_dim=6, max_len=24)
    model, params = make_transformer(config, seed=4)
    src = ids(5, (3, 7))
    got = decoding.greedy_decode(model, params, src, max_new_tokens=10)
    tokens, lengths, _ = reference_greedy(model, params, src, 10)
    np.testing.assert_array_equal(got.tokens, tokens)
    np.testing.assert_array_equal(got.lengths, lengths)


def test_forward_mode_through_every_block(gemma):
    """jvp equals the derivative of the (already compiled) forward pass: central
    differences, Richardson-extrapolated to cancel their eps**2 error."""
    model, params, forward = gemma
    tokens, mask, positions = causal_row(ids(6, (1, 6)))
    tangent = jax.tree_util.tree_map(
        lambda p: np.random.default_rng(p.size).normal(size=p.shape).astype(np.float32), params)
    f = lambda p: forward(p, tokens, mask, positions)[0, :6].sum()  # noqa: E731
    jvp = jax.jit(lambda p, t: jax.jvp(f, (p,), (t,))[1])(params, tangent)

    def difference(eps):
        step = lambda h: jax.tree_util.tree_map(lambda p, t: p + h * t,  # noqa: E731
                                                params, tangent)
        return (float(f(step(eps))) - float(f(step(-eps)))) / (2 * eps)

    derivative = (4 * difference(1e-3) - difference(2e-3)) / 3
    np.testing.assert_allclose(jvp, derivative, rtol=1e-3)


@pytest.mark.parametrize("overrides,field", [
    (dict(head_dim=0), "head_dim"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(attention_pattern="LX", sliding_window=2), "attention_pattern"),
    (dict(attention_pattern="LG"), "attention_pattern"),  # local layers without a window
    (dict(rope_scaling="yarn"), "rope_scaling"),
    (dict(norm_scale_plus_one=True), "norm_scale_plus_one"),  # needs rmsnorm
    (dict(attn_logit_softcapping=30.0, attention_impl="jax"), "attn_logit_softcapping"),
    (dict(query_scale=-1.0), "query_scale"),
    (dict(norm="peri"), "norm"),
])
def test_invalid_block_fields_are_refused_by_name(overrides, field):
    with pytest.raises(ValueError, match=rf"TransformerConfig\.{field}\b"):
        jf.tiny(**overrides)

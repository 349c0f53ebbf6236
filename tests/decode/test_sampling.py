"""Selectors (greedy, temperature / top-k / top-p sampling) and the loop, with a fake model."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.decode import api as decoding, sampling
from jaxformer.decode.loop import decode_loop, init_state

V = 8
EOS, PAD = 2, 0


def test_first_argmax_equals_numpy_argmax_ties_and_nans_included():
    """Random rows, rows of ties (the lowest id wins), -inf, NaNs (the first NaN, as
    argmax), bfloat16: numpy's argmax exactly."""
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(6, 300)).astype(np.float32)
    rows[1, [7, 40, 299]] = 9.0                     # a three-way tie
    rows[2] = 1.0                                   # all equal
    rows[3, :50] = -np.inf
    rows[4, [10, 20]] = np.nan                      # argmax: the first NaN
    rows[5, 299] = np.inf
    np.testing.assert_array_equal(sampling.first_argmax(jnp.asarray(rows)),
                                  np.argmax(rows, axis=-1))
    low = jnp.asarray(rows).astype(jnp.bfloat16)
    np.testing.assert_array_equal(sampling.first_argmax(low), jnp.argmax(low, axis=-1))
    assert sampling.first_argmax(jnp.asarray(rows)).dtype == jnp.int32


def test_top_k_filter_keeps_the_k_largest():
    logits = jnp.array([[0.0, 5.0, 1.0, 3.0, -2.0]])
    kept = sampling.top_k_filter(logits, 2) > sampling.NEG
    np.testing.assert_array_equal(kept, [[False, True, False, True, False]])


def test_top_p_filter_keeps_the_smallest_nucleus():
    probs = jnp.array([[0.5, 0.05, 0.3, 0.15]])
    kept = lambda p: np.asarray(sampling.top_p_filter(jnp.log(probs), p) > sampling.NEG)[0]
    np.testing.assert_array_equal(kept(0.5), [True, False, False, False])   # 0.5 reaches 0.5
    np.testing.assert_array_equal(kept(0.6), [True, False, True, False])    # 0.5 + 0.3
    np.testing.assert_array_equal(kept(0.81), [True, False, True, True])
    np.testing.assert_array_equal(kept(0.01), [True, False, False, False])  # top-1 always kept


def test_one_filter_chain_per_row_equals_the_static_settings_ties_included():
    """`filter_logits` with (B,) settings (the engine's rows) equals it with each row's
    numbers (generate's), which equals top-k then top-p applied one after the other, to
    the bit: rows with ties at the k-th value (bfloat16-like logits) included, where
    the tied tokens all stay and count in the nucleus' mass."""
    rng = np.random.default_rng(0)
    logits = np.round(rng.normal(size=(7, 40)) * 3, 0).astype(np.float32)  # many ties
    logits[5] = np.round(rng.normal(size=40) * 3, 1)
    logits[6] = -3.0
    logits[6, :4] = [2.0, 1.0, 1.0, 1.0]  # top-2 keeps 4; its mass: 0.475, 0.175 x 3
    temperature = np.asarray([0.5, 1.0, 0.7, 2.0, 1.3, 0.9, 1.0], np.float32)
    top_k = np.asarray([0, 1, 5, 7, 40, 12, 2], np.int32)
    top_p = np.asarray([1.0, 0.3, 0.8, 0.5, 0.95, 1.0, 0.5], np.float32)
    min_p = np.asarray([0.0, 0.0, 0.05, 0.0, 0.2, 0.1, 0.0], np.float32)
    per_row = np.asarray(sampling.filter_logits(jnp.asarray(logits), temperature, top_k,
                                                top_p, min_p))
    for b in range(7):
        row = jnp.asarray(logits[b:b + 1])
        static = sampling.filter_logits(row, float(temperature[b]), int(top_k[b]) or None,
                                        float(top_p[b]), float(min_p[b]))
        np.testing.assert_array_equal(per_row[b:b + 1], static, err_msg=f"row {b}")
        if not min_p[b]:
            chained = row / float(temperature[b])
            if top_k[b]:
                chained = sampling.top_k_filter(chained, int(top_k[b]))
            chained = sampling.top_p_filter(chained, float(top_p[b]))
            np.testing.assert_array_equal(per_row[b:b + 1], chained, err_msg=f"row {b}")
    kept = per_row > sampling.NEG
    assert kept[0].all() and kept[1].sum() == (logits[1] == logits[1].max()).sum()
    assert (logits[2] == np.sort(logits[2])[-5]).sum() > 1  # ties at the 5th value
    # 0.475 < 0.5: the nucleus reaches the tied tokens (the engine's own chain, which
    # counted only k of them in the mass, kept token 0 alone).
    np.testing.assert_array_equal(kept[6], np.arange(40) < 4)
    assert np.isfinite(per_row).all()


def test_make_sampler_min_p():
    """min_p 1 keeps the most likely token alone; min_p 0 filters nothing."""
    logits = jnp.log(jnp.array([[0.1, 0.6, 0.3, 1e-9]]))
    keys = jax.random.split(jax.random.PRNGKey(4), 300)
    one = jax.vmap(lambda k: sampling.make_sampler(2.0, min_p=1.0)(logits, k))(keys)
    assert set(np.asarray(one).ravel()) == {1}
    half = jax.vmap(lambda k: sampling.make_sampler(1.0, min_p=0.4)(logits, k))(keys)
    assert set(np.asarray(half).ravel()) == {1, 2}  # 0.3 >= 0.4 * 0.6 > 0.1
    np.testing.assert_array_equal(
        jax.vmap(lambda k: sampling.make_sampler(1.0, min_p=0.0)(logits, k))(keys),
        jax.vmap(lambda k: sampling.make_sampler(1.0)(logits, k))(keys))


def test_sampler_is_reproducible_and_follows_the_distribution():
    logits = jnp.log(jnp.array([[0.1, 0.6, 0.3, 1e-9]]))
    select = sampling.make_sampler(1.0)
    draws = jax.vmap(lambda k: select(logits, k))(jax.random.split(jax.random.PRNGKey(0), 4000))
    np.testing.assert_array_equal(
        draws, jax.vmap(lambda k: select(logits, k))(jax.random.split(jax.random.PRNGKey(0), 4000)))
    freq = np.bincount(np.asarray(draws).ravel(), minlength=4) / draws.size
    np.testing.assert_allclose(freq, [0.1, 0.6, 0.3, 0.0], atol=0.03)
    # top-k 2 removes token 0; top-p 0.6 keeps token 1 alone.
    topk = jax.vmap(lambda k: sampling.make_sampler(1.0, top_k=2)(logits, k))(
        jax.random.split(jax.random.PRNGKey(1), 500))
    assert set(np.asarray(topk).ravel()) == {1, 2}
    topp = jax.vmap(lambda k: sampling.make_sampler(1.0, top_p=0.6)(logits, k))(
        jax.random.split(jax.random.PRNGKey(2), 200))
    assert set(np.asarray(topp).ravel()) == {1}
    # Low temperature sharpens: almost always the argmax.
    cold = jax.vmap(lambda k: sampling.make_sampler(0.05)(logits, k))(
        jax.random.split(jax.random.PRNGKey(3), 200))
    assert (np.asarray(cold) == 1).mean() > 0.99


@pytest.mark.parametrize("kwargs, match", [
    pytest.param(dict(temperature=-1.0), "temperature", id="negative_temperature"),
    pytest.param(dict(top_k=0), "top_k", id="zero_top_k"),
    pytest.param(dict(top_p=0.0), "top_p", id="zero_top_p"),
    pytest.param(dict(top_p=1.5), "top_p", id="top_p_above_one"),
    pytest.param(dict(temperature=float("nan")), "temperature", id="nan_temperature"),
    pytest.param(dict(temperature=float("inf")), "temperature", id="infinite_temperature"),
    pytest.param(dict(top_p=float("nan")), "top_p", id="nan_top_p"),
    pytest.param(dict(top_k=True), "top_k", id="bool_top_k"),
    pytest.param(dict(min_p=-0.1), "min_p", id="negative_min_p"),
    pytest.param(dict(min_p=1.5), "min_p", id="min_p_above_one"),
])
def test_make_sampler_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sampling.make_sampler(**kwargs)


def test_equal_settings_give_the_same_selector():
    assert sampling.make_sampler(0.7, 3, 0.9) is sampling.make_sampler(0.7, 3, 0.9)
    assert sampling.make_sampler(0.0) is sampling.greedy


# -- the loop alone, driven by a fake logits_fn (no model) -----------------------------


def fake_logits_fn(script_BN):
    """Row b emits script[b, step] whatever it is fed; the 'cache' counts calls."""

    def logits_fn(token_B, calls, step):
        return jax.nn.one_hot(script_BN[:, step], V) * 10.0, calls + 1

    return logits_fn


SCRIPT = jnp.array([[3, 4, EOS, 5, 6],    # stops at step 3
                    [3, 3, 3, 3, 3],      # never stops
                    [EOS, 7, 7, 7, 7]])   # stops at once


@pytest.mark.parametrize("loop", ["scan", "while"])
def test_loop_eos_pad_and_lengths_with_a_fake_model(loop):
    state = init_state(jnp.ones(3, jnp.int32), jnp.zeros((), jnp.int32), 5,
                                pad_id=PAD)
    run = jax.jit(functools.partial(decode_loop, fake_logits_fn(SCRIPT),
                                    num_steps=5, eos_id=EOS, pad_id=PAD, loop=loop))
    out = run(state)
    np.testing.assert_array_equal(out.tokens_BN, [[3, 4, EOS, PAD, PAD],
                                                  [3, 3, 3, 3, 3],
                                                  [EOS, PAD, PAD, PAD, PAD]])
    np.testing.assert_array_equal(out.lengths_B, [3, 5, 1])
    np.testing.assert_array_equal(out.finished_B, [True, False, True])
    assert int(out.cache) == 5  # one row never finishes: both loops run all 5 steps


def test_while_loop_stops_when_every_row_is_done():
    script = SCRIPT.at[1, 3].set(EOS)
    state = init_state(jnp.ones(3, jnp.int32), jnp.zeros((), jnp.int32), 5,
                                pad_id=PAD)
    run = lambda loop: jax.jit(functools.partial(
        decode_loop, fake_logits_fn(script), num_steps=5, eos_id=EOS, pad_id=PAD,
        loop=loop))(state)
    early, full = run("while"), run("scan")
    assert (int(early.cache), int(full.cache)) == (4, 5)  # model calls
    np.testing.assert_array_equal(early.tokens_BN, full.tokens_BN)


def test_loop_feeds_back_its_own_picks():
    """A fake model that echoes the fed token + 1: the loop must feed each pick back."""

    def logits_fn(token_B, cache, step):
        return jax.nn.one_hot((token_B + 1) % V, V), cache

    state = init_state(jnp.array([3, 5], jnp.int32), None, 4, pad_id=PAD)
    out = decode_loop(logits_fn, state, 4, eos_id=EOS, pad_id=PAD)
    np.testing.assert_array_equal(out.tokens_BN, [[4, 5, 6, 7], [6, 7, 0, 1]])


# -- sampling through the model ---------------------------------------------------------


@pytest.fixture(scope="module")
def model_and_src():
    config = jf.tiny()
    model = jf.Transformer(config)
    src = jnp.asarray(np.random.default_rng(5).integers(3, 16, (4, 6)), jnp.int32)
    return model, model.init(jax.random.PRNGKey(0), src, src[:, :3])["params"], src


def test_top_k_1_and_temperature_0_sampling_equal_greedy(model_and_src):
    model, params, src = model_and_src
    greedy = decoding.greedy_decode(model, params, src, max_new_tokens=8)
    top1 = decoding.sample(model, params, src, max_new_tokens=8, rng=jax.random.PRNGKey(9),
                           temperature=1.3, top_k=1)
    cold = decoding.sample(model, params, src, max_new_tokens=8, rng=jax.random.PRNGKey(9),
                           temperature=0.0)
    np.testing.assert_array_equal(top1.tokens, greedy.tokens)
    np.testing.assert_array_equal(cold.tokens, greedy.tokens)


def test_sampling_is_reproducible_per_key(model_and_src):
    model, params, src = model_and_src
    draw = lambda seed: np.asarray(decoding.sample(
        model, params, src, max_new_tokens=8, rng=jax.random.PRNGKey(seed), top_p=0.95).tokens)
    np.testing.assert_array_equal(draw(1), draw(1))
    assert not np.array_equal(draw(1), draw(2))


def test_lm_sampling_with_top_k_1_equals_lm_greedy():
    config = jf.tiny(num_encoder_layers=0)
    model = jf.DecoderOnlyLM(config)
    prompt = jnp.array([[5, 6, 7], [8, 0, 0]], jnp.int32)
    params = model.init(jax.random.PRNGKey(1), prompt)["params"]
    greedy = decoding.generate(model, params, prompt, max_new_tokens=5)
    top1 = decoding.generate(model, params, prompt, max_new_tokens=5,
                             rng=jax.random.PRNGKey(0), temperature=0.8, top_k=1)
    np.testing.assert_array_equal(top1.tokens, greedy.tokens)


@pytest.mark.parametrize("loop", ["scan", "while"])
def test_on_token_streams_every_pick_in_step_order(loop):
    """The host callback sees each step's picks as the jitted loop makes them: in step
    order, equal to the returned tokens (PAD after EOS included)."""
    seen = []
    state = init_state(jnp.ones(3, jnp.int32), jnp.zeros((), jnp.int32), 5, pad_id=PAD)
    out = jax.jit(functools.partial(
        decode_loop, fake_logits_fn(SCRIPT), num_steps=5, eos_id=EOS, pad_id=PAD, loop=loop,
        on_token=lambda step, token_B: seen.append((int(step), token_B.tolist()))))(state)
    jax.effects_barrier()
    assert [step for step, _ in seen] == list(range(5))
    np.testing.assert_array_equal(np.array([t for _, t in seen]).T, out.tokens_BN)

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

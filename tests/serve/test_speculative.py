"""Speculative decoding (issue 43 item 4): prompt-lookup and draft-model drafts, greedy
and rejection-sampling verification, against plain `generate` and exact probabilities."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.serve import speculative
from jaxformer.serve.spec_decode import speculative_generate
from tests.families import family_config

V = 8  # the sampling tests' vocabulary: 64 cells for two tokens


@pytest.fixture(scope="module")
def lm(make_lm):
    return make_lm(jf.tiny(num_encoder_layers=0, tgt_vocab_size=20, max_len=64), seed=1)


@pytest.fixture(scope="module")
def small_vocab(make_lm):
    """A target and a different draft model over the same 8 ids."""
    config = jf.tiny(num_encoder_layers=0, tgt_vocab_size=V, max_len=16)
    model, params = make_lm(config, seed=3)
    _, draft_params = make_lm(config, seed=4)
    return model, params, draft_params


# -- the pure functions, golden values -------------------------------------------------


def test_ngram_draft_takes_what_followed_the_latest_longest_match():
    seq = jnp.array([7, 8, 9, 4, 7, 8, 5, 6, 7, 8, 0, 0], jnp.int32)
    draft, count = speculative.ngram_draft(seq, jnp.int32(10), k=3, n_max=2, n_min=1)
    # "7 8" last occurred at 4 (not at 0): what followed is 5 6 7.
    assert np.asarray(draft).tolist() == [5, 6, 7] and int(count) == 3
    draft, count = speculative.ngram_draft(seq, jnp.int32(7), k=3, n_max=2,
                                           n_min=1)  # tail "8 5": none
    draft1, count1 = speculative.ngram_draft(seq, jnp.int32(7), k=3, n_max=2, n_min=2)
    assert int(count1) == 0
    # n = 1: "5" never occurred before, so nothing either.
    assert int(count) == 0
    # A match near the end proposes only the known tokens.
    draft, count = speculative.ngram_draft(jnp.array([5, 6, 5, 0], jnp.int32), jnp.int32(3),
                                           k=3, n_max=2, n_min=1)
    assert int(count) == 2 and np.asarray(draft)[:2].tolist() == [6, 5]


def test_greedy_verify_accepts_the_agreeing_prefix_and_adds_the_targets_token():
    logits = jax.nn.one_hot(jnp.array([4, 5, 9, 3]), 10)  # target argmax 4 5 9 3
    tokens, emitted = speculative.greedy_verify(logits, jnp.array([4, 5, 6]), jnp.int32(3))
    assert np.asarray(tokens)[:int(emitted)].tolist() == [4, 5, 9]
    tokens, emitted = speculative.greedy_verify(logits, jnp.array([4, 5, 9]), jnp.int32(3))
    assert int(emitted) == 4  # every draft and the bonus token
    tokens, emitted = speculative.greedy_verify(logits, jnp.array([4, 5, 9]), jnp.int32(1))
    assert int(emitted) == 2  # drafts beyond count are not drafts


# -- greedy: identical to generate ------------------------------------------------------


REPETITIVE = [[3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4, 0, 0], [5, 9, 8, 5, 9, 8, 5, 9, 8, 5, 9, 8, 5, 9]]


@pytest.mark.parametrize("draft", ["ngram", "same_model", "other_model"])
def test_greedy_speculation_equals_generate(lm, make_lm, draft):
    """Accepted drafts (repetitive prompts, the model itself as draft) and rejected ones
    (another model as draft) give `generate`'s tokens, EOS and lengths."""
    model, params = lm
    prompt = jnp.array(REPETITIVE, jnp.int32)
    plain = jf.generate(model, params, prompt, max_new_tokens=24)
    draft_arg = {"ngram": None, "same_model": (model, params),
                 "other_model": (model, make_lm(model.config, seed=7)[1])}[draft]
    out = speculative_generate(model, params, prompt, max_new_tokens=24, k=3, draft=draft_arg)
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    np.testing.assert_array_equal(out.lengths, plain.lengths)
    rate = out.acceptance_rate
    assert rate == float(np.sum(out.accepted)) / float(np.sum(out.drafted))
    if draft == "other_model":
        assert rate < 0.3  # mostly rejected, still exact
    else:
        assert rate >= 0.5  # the random model repeats what it saw at least half the time
        assert int(np.sum(out.rounds)) < int(np.sum(out.lengths))  # fewer passes than tokens


@pytest.mark.parametrize("draft", ["ngram", "other_model"])
def test_sliding_window_layers_roll_back_within_their_rings(make_lm, draft):
    """Gemma 3's local layers (a 5-token window, two of three layers) under 7- to
    14-token prompts and 24 new tokens: the rings wrap many times and rejected drafts (k = 3) are written
    and given back each round. Equal to `generate`'s tokens; with rings of the window
    alone (no rollback room) a rejected key overwrites one the window still reads."""
    config = family_config("gemma3", max_position_embeddings=64)
    model, params = make_lm(config, seed=1)
    # and a short prompt: more padding than the rings hold beyond the window
    prompt = jnp.array(REPETITIVE + [[6, 7, 8, 6, 7, 8, 6] + [0] * 7], jnp.int32)
    plain = jf.generate(model, params, prompt, max_new_tokens=24)
    draft_arg = None if draft == "ngram" else (model, make_lm(config, seed=7)[1])
    out = speculative_generate(model, params, prompt, max_new_tokens=24, k=3, draft=draft_arg)
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    np.testing.assert_array_equal(out.lengths, plain.lengths)
    assert out.acceptance_rate < 1  # drafts rolled back
    if draft == "ngram":
        assert out.acceptance_rate > 0  # and kept


def test_greedy_one_row_and_a_row_that_stops_early(lm):
    """One row at a time (no vmap: a round without drafts feeds one position), the
    third prompt's tokens all distinct, so its first round finds no draft."""
    model, params = lm
    for row in REPETITIVE + [list(range(3, 17))]:
        prompt = jnp.array([row], jnp.int32)
        plain = jf.generate(model, params, prompt, max_new_tokens=20)
        out = speculative_generate(model, params, prompt, max_new_tokens=20, k=5)
        np.testing.assert_array_equal(out.tokens, plain.tokens)
        np.testing.assert_array_equal(out.lengths, plain.lengths)


# -- sampling: distributed as plain sampling --------------------------------------------


def exact_two_token_probs(model, params, prompt):
    """{(t1, t2): probability} of the first two sampled tokens (temperature 1), by full
    forward passes (no cache): t2 is PAD after an EOS t1."""
    c = model.config
    forward = jax.jit(lambda t: model.apply({"params": params}, t))
    first = np.asarray(jax.nn.softmax(forward(prompt[None])[0, -1]), np.float64)
    nexts = jnp.concatenate([jnp.tile(prompt[None], (V, 1)), jnp.arange(V)[:, None]], axis=1)
    second = np.asarray(jax.nn.softmax(forward(nexts)[:, -1]), np.float64)
    probs = {}
    for t1, t2 in itertools.product(range(V), range(V)):
        if t1 == c.eos_id:
            probs[(t1, c.pad_id)] = first[t1]
        else:
            probs[(t1, t2)] = first[t1] * second[t1, t2]
    return probs


def chi_square_p(tokens_N2, probs):
    """p-value of the observed pairs against `probs` (cells with < 5 expected merged)."""
    from scipy.stats import chisquare  # noqa: PLC0415

    n = tokens_N2.shape[0]
    counts = {}
    for pair in map(tuple, tokens_N2.tolist()):
        counts[pair] = counts.get(pair, 0) + 1
    assert set(counts) <= set(probs), f"impossible pairs {set(counts) - set(probs)}"
    cells = sorted(probs, key=lambda c: -probs[c])
    big = [c for c in cells if probs[c] * n >= 5]
    small = [c for c in cells if probs[c] * n < 5]
    observed = [counts.get(c, 0) for c in big]
    expected = [probs[c] * n for c in big]
    if small:
        observed.append(sum(counts.get(c, 0) for c in small))
        expected.append(sum(probs[c] for c in small) * n)
    return chisquare(observed, np.asarray(expected) * sum(observed) / sum(expected)).pvalue


N_DRAWS = 6000
P_MIN = 1e-3  # a correct sampler fails this 1 run in 1000


def draws(model, params, fn, **kwargs):
    prompt = jnp.array([4, 7, 7, 4, 7], jnp.int32)  # lookup drafts 7, p(7) ~ 0.5
    batch = jnp.tile(prompt[None], (N_DRAWS, 1))
    out = fn(model, params, batch, max_new_tokens=2, temperature=1.0,
             rng=jax.random.PRNGKey(11), **kwargs)
    return np.asarray(out.tokens), exact_two_token_probs(model, params, prompt), out


def test_plain_sampling_passes_the_reference_test(small_vocab):
    """The reference probabilities and the test itself, on `generate`'s sampling (each
    row of the batch is an independent draw)."""
    model, params, _ = small_vocab
    tokens, probs, _ = draws(model, params, jf.generate)
    assert chi_square_p(tokens, probs) > P_MIN


@pytest.mark.parametrize("draft", ["ngram", "draft_model"])
def test_sampled_speculation_is_distributed_as_plain_sampling(small_vocab, draft):
    """Rejection sampling with a one-hot (prompt lookup) or a sampled (draft model)
    proposal: the first two tokens follow the model's exact probabilities."""
    model, params, draft_params = small_vocab
    draft_arg = None if draft == "ngram" else (model, draft_params)
    tokens, probs, out = draws(model, params, speculative_generate, k=2, draft=draft_arg)
    assert 0.05 < out.acceptance_rate < 0.95  # both branches (accept, resample) taken
    assert chi_square_p(tokens, probs) > P_MIN


def test_the_chi_square_test_catches_accepting_every_draft(small_vocab, monkeypatch):
    """Mutant: accept every draft (no min(1, p/q) test). The draft model's distribution
    then leaks into the output, and the test must reject it."""

    def accept_all(p_TV, q_kV, draft_k, count, rng):
        k = draft_k.shape[0]
        last = jax.random.categorical(rng, jnp.log(p_TV[count])).astype(jnp.int32)
        tokens = jnp.where(jnp.arange(k + 1) < count,
                           jnp.concatenate([draft_k, jnp.zeros((1,), jnp.int32)]), last)
        return tokens, (count + 1).astype(jnp.int32)

    monkeypatch.setattr(speculative, "rejection_verify", accept_all)
    model, params, draft_params = small_vocab
    # top_k=V filters nothing but is a new compilation key: the mutant gets traced.
    tokens, probs, _ = draws(model, params, speculative_generate, k=2,
                             draft=(model, draft_params), top_k=V)
    assert chi_square_p(tokens, probs) < 1e-6


# -- bad input ---------------------------------------------------------------------------


def test_bad_arguments_are_refused_before_compiling(lm, make_lm):
    model, params = lm
    prompt = jnp.array([[3, 4, 5]], jnp.int32)
    with pytest.raises(ValueError, match="k must be"):
        speculative_generate(model, params, prompt, max_new_tokens=4, k=0)
    with pytest.raises(ValueError, match="ngram"):
        speculative_generate(model, params, prompt, max_new_tokens=4, ngram=(3, 1))
    with pytest.raises(ValueError, match="max_len"):
        speculative_generate(model, params, prompt, max_new_tokens=60, k=4)
    other = make_lm(jf.tiny(num_encoder_layers=0, tgt_vocab_size=30, max_len=64))
    with pytest.raises(ValueError, match="vocabulary"):
        speculative_generate(model, params, prompt, max_new_tokens=4, draft=other)

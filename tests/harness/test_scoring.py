"""Scorer and its packed layout on a tiny Llama-style model (RoPE, grouped-query
attention): every request scores as it does alone, in a full forward pass of its own."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.harness import Scorer, bucket
from jaxformer.harness.packing import Row, layout, pack
from jaxformer.nn.masks import causal_mask
from tests.tolerances import decoder_additions, logprob_sum_atol

WINDOW = 24


@pytest.fixture(scope="module")
def lm():
    config = jf.llama(d_model=32, num_heads=4, num_kv_heads=2, d_ff=40, num_decoder_layers=2,
                      tgt_vocab_size=64, src_vocab_size=64, max_len=WINDOW)
    model = jf.DecoderOnlyLM(config)
    params = jax.jit(model.init)(jax.random.key(3), jnp.ones((1, 1), jnp.int32))["params"]
    return model, params, Scorer(model, params, batch_size=4, max_length=WINDOW)


def alone(model, params, context, continuation):
    """The reference: one pair in a forward pass of its own (cut to the window as the
    hf model cuts it; PAD after it, unseen under the causal mask), the log-softmax
    over every position's logits."""
    whole = (list(context) + list(continuation))[-(WINDOW + 1):]
    tokens = np.zeros((1, WINDOW), np.int32)
    tokens[0, :len(whole) - 1] = whole[:-1]
    logits = np.asarray(forward(model)(params, tokens)[0])
    logp = np.asarray(jax.nn.log_softmax(logits, -1), np.float64)
    start = len(whole) - 1 - len(continuation)
    rows = np.arange(start, len(whole) - 1)
    return (float(logp[rows, continuation].sum()),
            bool((np.asarray(logits)[rows].argmax(-1) == np.asarray(continuation)).all()))


def atol(model, params, pairs):
    """float32's bound on a packed row's sum against the one alone (tests/tolerances.py),
    for the longest continuation, at the size of the model's largest logit here."""
    c = model.config
    tokens = np.zeros((1, WINDOW), np.int32)
    tokens[0, :WINDOW] = (list(pairs[-1][0]) + list(pairs[-1][1]))[:WINDOW]
    scale = float(np.abs(np.asarray(forward(model)(params, tokens))).max())
    additions = decoder_additions(c.d_model, c.d_ff, c.head_dim,
                                  c.num_decoder_layers, WINDOW, c.tgt_vocab_size)
    return logprob_sum_atol(max(scale, 1.0), additions, max(len(p[1]) for p in pairs))


@functools.cache
def forward(model):
    return jax.jit(lambda params, tokens: model.apply({"params": params}, tokens,
                                                      causal_mask(tokens.shape[1])))


def requests(model, params):
    """Questions with 4 endings (one of them the model's greedy continuation), pairs
    with contexts of their own, one-token endings, and pairs longer than the window."""
    rng = np.random.default_rng(0)
    pairs = []
    for q in range(5):
        context = [1] + rng.integers(3, 64, 3 + 2 * q).tolist()
        tokens = np.zeros((1, WINDOW), np.int32)
        tokens[0, :len(context)] = context
        greedy = int(forward(model)(params, tokens)[0, len(context) - 1].argmax())
        endings = [[greedy]] + [rng.integers(3, 64, n).tolist() for n in (1, 3, 5)]
        pairs += [(context, ending) for ending in endings]
    pairs += [([1] + rng.integers(3, 64, n).tolist(), rng.integers(3, 64, m).tolist())
              for n, m in ((2, 7), (9, 2), (20, 10), (30, 4), (1, 24))]
    return pairs


def test_every_request_scores_as_it_does_alone(lm):
    model, params, scorer = lm
    pairs = requests(model, params)
    got = scorer.loglikelihoods(pairs)
    want = [alone(model, params, *pair) for pair in pairs]
    np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want],
                               atol=atol(model, params, pairs), rtol=0)
    assert [g[1] for g in got] == [w[1] for w in want]
    assert sum(w[1] for w in want) >= 5  # greedy endings are among them
    assert len(pack(pairs, WINDOW)) < len(pairs)  # the endings shared rows


def test_requests_in_any_order_and_batch_give_the_same_scores(lm):
    model, params, scorer = lm
    pairs = requests(model, params)
    first = scorer.loglikelihoods(pairs)
    order = np.random.default_rng(1).permutation(len(pairs))
    second = scorer.loglikelihoods([pairs[i] for i in order] + pairs[:2])[:len(pairs)]
    np.testing.assert_allclose([second[j][0] for j in np.argsort(order)],
                               [f[0] for f in first], atol=atol(model, params, pairs), rtol=0)


def test_compiles_once_per_bucket_not_per_request(lm):
    """19 requests of 19 lengths compile one program per (length, predictions) bucket;
    the same requests again, in another order, compile nothing."""
    model, params, scorer = lm
    rng = np.random.default_rng(2)
    pairs = [([1] + rng.integers(3, 64, n).tolist(), rng.integers(3, 64, 2).tolist())
             for n in range(1, 20)]
    before = set(scorer.shapes)
    scorer.loglikelihoods(pairs)
    assert scorer.traces == len(scorer.shapes) and len(scorer.shapes - before) <= 3
    traces = scorer.traces
    scorer.loglikelihoods(pairs[::-1])
    assert scorer.traces == traces


def greedy_next(model, params, ids):
    """The model's argmax token after `ids` (a full forward pass, PAD after them)."""
    tokens = np.zeros((1, WINDOW), np.int32)
    tokens[0, :len(ids)] = ids
    return int(forward(model)(params, tokens)[0, len(ids) - 1].argmax())


def test_is_greedy_checks_every_token_of_a_continuation_not_only_the_last(lm):
    """Guards `is_greedy` looking only at the last token: three-token continuations
    whose last token (and the ones after the miss) are the argmax given what precedes
    them, but whose first or middle token is not, are not greedy; the all-argmax one
    is."""
    model, params, scorer = lm
    context = [1, 7, 19, 33, 4]

    def continue_greedily(prefix, count):
        ids = list(prefix)
        for _ in range(count):
            ids.append(greedy_next(model, params, ids))
        return ids[len(prefix):]

    def not_the_argmax_after(ids):
        return 3 if greedy_next(model, params, ids) != 3 else 4

    all_greedy = continue_greedily(context, 3)
    first_missed = [not_the_argmax_after(context)]
    first_missed += continue_greedily(context + first_missed, 2)
    middle_missed = all_greedy[:1] + [not_the_argmax_after(context + all_greedy[:1])]
    middle_missed += continue_greedily(context + middle_missed, 1)
    pairs = [(context, all_greedy), (context, first_missed), (context, middle_missed)]
    got = [greedy for _, greedy in scorer.loglikelihoods(pairs)]
    assert got == [True, False, False]
    assert got == [alone(model, params, *pair)[1] for pair in pairs]


def test_layout_of_a_context_and_two_endings():
    """The packing module's docstring example, array by array."""
    rows = pack([([10, 11, 12], [20, 21, 22]), ([10, 11, 12], [30, 31, 32, 33])], window=8)
    assert rows == [Row((10, 11, 12), (0, 1), ((20, 21, 22), (30, 31, 32, 33)))]
    out = layout(rows, batch=2, length=10, predictions=8, pad_id=0)
    np.testing.assert_array_equal(out.tokens[0], [10, 11, 12, 20, 21, 30, 31, 32, 0, 0])
    np.testing.assert_array_equal(out.positions[0], [0, 1, 2, 3, 4, 3, 4, 5, 0, 0])
    np.testing.assert_array_equal(out.segments[0], [0, 0, 0, 1, 1, 2, 2, 2, -1, -1])
    np.testing.assert_array_equal(out.gather[0], [2, 3, 4, 2, 5, 6, 7, 0])
    np.testing.assert_array_equal(out.targets[0], [20, 21, 22, 30, 31, 32, 33, 0])
    assert (out.segments[1] == -1).all() and (out.tokens[1] == 0).all()
    # a context whose endings overflow the window starts a second row
    assert [r.requests for r in pack([([1] * 5, [2, 3, 4])] * 3, window=9)] == [(0, 1), (2,)]


def test_buckets():
    assert [bucket(n, 256) for n in (1, 16, 17, 24, 25, 33, 49, 65, 97, 200, 256)] == [
        16, 16, 24, 24, 32, 48, 64, 96, 128, 256, 256]
    assert bucket(300, 256) == 256 and bucket(5, 256, min_length=8) == 8

"""Every random path, tested statistically against an exact distribution or numpy.

- sampling: draws at different decode steps (and in different rows) are
  independent, and each is uniform when the model's logits are flat
  (`sample`, `generate`);
- the selector pipeline (temperature, then top-k, then top-p, then a draw)
  against a numpy implementation of that documented order;
- dropout: the drop rate and the 1/(1-rate) scaling of every dropout site,
  independent masks across calls, layers, batch rows and training steps (the
  masks are read out of the real jitted train step), identity at eval.

Each test draws from fixed seeds and refuses at significance ALPHA = 1e-6, so
a correct implementation fails a given test with probability below 1e-6 over
the choice of seed: with the 20-odd tests here, a false failure of the suite is
rarer than one run in ten thousand. The bugs these tests exist for (a key
reused at every step, temperature applied after filtering, a dropout mask
fixed across steps or layers) give p-values below 1e-30.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.decode import api as decoding, sampling
from jaxformer.train import make_train_step, train_functions, TrainConfig

ALPHA = 1e-6


# --------------------------------------------------------------------------- statistics


def chi2_pvalue(statistic: float, dof: int) -> float:
    """P(X >= statistic) for X ~ chi-square(dof): the regularised upper incomplete gamma."""
    return float(jax.scipy.special.gammaincc(dof / 2.0, statistic / 2.0))


def goodness_of_fit_pvalue(counts, probs) -> float:
    """Chi-square test of observed `counts` against `probs` (cells with p = 0 must be empty)."""
    counts, probs = np.asarray(counts, np.float64), np.asarray(probs, np.float64)
    assert counts[probs == 0].sum() == 0, f"draws where the probability is 0: {counts}"
    expected = counts.sum() * probs[probs > 0]
    assert expected.min() >= 5, "too few draws for the chi-square approximation"
    statistic = ((counts[probs > 0] - expected) ** 2 / expected).sum()
    return chi2_pvalue(statistic, int((probs > 0).sum()) - 1)


def independence_pvalue(a, b) -> float:
    """Chi-square test of independence of two paired samples of categories."""
    a, b = np.asarray(a).ravel(), np.asarray(b).ravel()
    _, ia = np.unique(a, return_inverse=True)
    _, ib = np.unique(b, return_inverse=True)
    table = np.zeros((ia.max() + 1, ib.max() + 1))
    np.add.at(table, (ia, ib), 1)
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    assert expected.min() >= 5, "too few draws for the chi-square approximation"
    statistic = ((table - expected) ** 2 / expected).sum()
    return chi2_pvalue(statistic, (table.shape[0] - 1) * (table.shape[1] - 1))


def binomial_pvalue(successes: int, trials: int, p: float) -> float:
    """Two-sided normal-approximation p-value of a binomial count (trials large)."""
    z = (successes - trials * p) / math.sqrt(trials * p * (1 - p))
    return math.erfc(abs(z) / math.sqrt(2))


def test_the_tests_reject_what_they_must():
    """The helpers themselves: dependent, biased or wrong-rate samples are refused."""
    r = np.random.default_rng(0)
    x = r.integers(0, 6, 3000)
    assert independence_pvalue(x, r.integers(0, 6, 3000)) > ALPHA
    assert independence_pvalue(x, x) < 1e-30                      # a reused key
    assert independence_pvalue(x, (x + r.integers(0, 2, 3000)) % 6) < 1e-30
    assert goodness_of_fit_pvalue(np.bincount(x, minlength=6), np.full(6, 1 / 6)) > ALPHA
    assert goodness_of_fit_pvalue(np.bincount(x, minlength=6), [.3, .14, .14, .14, .14, .14]) < 1e-30
    assert binomial_pvalue(1000, 10000, 0.1) == 1.0
    assert binomial_pvalue(1200, 10000, 0.1) < 1e-9


# --------------------------------------------------------------------------- sampling


def flat_output(params, eos_id):
    """The same params with a zero output projection: every step's logits are flat,
    except EOS, which can never be drawn (so no row stops)."""
    out = dict(params["decoder"]["out_proj"])
    out["kernel"] = jnp.zeros_like(out["kernel"])
    out["bias"] = jnp.zeros_like(out["bias"]).at[eos_id].set(-1e9)
    return {**params, "decoder": {**params["decoder"], "out_proj": out}}


ROWS, STEPS = 3000, 4


def check_independent_uniform_draws(tokens_BN, vocab, eos_id):
    """Every step uniform over the non-EOS ids; consecutive steps and neighbouring rows
    independent."""
    tokens_BN = np.asarray(tokens_BN)
    probs = np.full(vocab, 1 / (vocab - 1))
    probs[eos_id] = 0.0
    for step in range(tokens_BN.shape[1]):
        counts = np.bincount(tokens_BN[:, step], minlength=vocab)
        assert goodness_of_fit_pvalue(counts, probs) > ALPHA, f"step {step} is not uniform"
    for step in range(tokens_BN.shape[1] - 1):
        p = independence_pvalue(tokens_BN[:, step], tokens_BN[:, step + 1])
        assert p > ALPHA, f"draws at steps {step} and {step + 1} are dependent (p={p:.2e})"
    p = independence_pvalue(tokens_BN[0::2], tokens_BN[1::2])
    assert p > ALPHA, f"draws in neighbouring rows are dependent (p={p:.2e})"


@pytest.mark.parametrize("loop", ["scan", "while"])
def test_sample_draws_fresh_independent_tokens_at_every_step(loop):
    config = jf.tiny(num_encoder_layers=1, num_decoder_layers=1)
    model = jf.Transformer(config)
    src = jnp.asarray(np.random.default_rng(0).integers(3, 16, (ROWS, 4)), jnp.int32)
    params = flat_output(model.init(jax.random.PRNGKey(0), src[:1], src[:1])["params"],
                         config.eos_id)
    out = decoding.sample(model, params, src, max_new_tokens=STEPS, rng=jax.random.PRNGKey(7),
                          loop=loop)
    check_independent_uniform_draws(out.tokens, config.tgt_vocab_size, config.eos_id)


def test_lm_generate_draws_fresh_independent_tokens_at_every_step():
    config = jf.tiny(num_encoder_layers=0, num_decoder_layers=1)
    model = jf.DecoderOnlyLM(config)
    prompt = np.random.default_rng(1).integers(3, 16, (ROWS, 3)).astype(np.int32)
    prompt[::3, 2] = config.pad_id  # ragged prompts
    params = flat_output(model.init(jax.random.PRNGKey(0), prompt[:1])["params"], config.eos_id)
    out = decoding.generate(model, params, prompt, max_new_tokens=STEPS,
                            rng=jax.random.PRNGKey(8), temperature=1.0)
    check_independent_uniform_draws(out.tokens, config.tgt_vocab_size, config.eos_id)


def numpy_sampling_probs(logits, temperature, top_k, top_p):
    """The documented pipeline in numpy: temperature, then top-k, then top-p on the
    renormalised top-k distribution, then softmax. Logits here have no ties."""
    z = np.asarray(logits, np.float64) / temperature
    keep = np.ones_like(z, bool)
    if top_k is not None:
        keep &= z >= np.sort(z)[::-1][top_k - 1]
    if top_p is not None:
        order = np.argsort(-z)
        probs = np.where(keep, np.exp(z - z.max()), 0.0)
        probs /= probs.sum()
        mass_before = np.cumsum(probs[order]) - probs[order]
        nucleus = np.zeros_like(keep)
        nucleus[order] = mass_before < top_p
        keep &= nucleus
    probs = np.where(keep, np.exp(z - z.max()), 0.0)
    return probs / probs.sum()


# The probabilities are chosen so that each setting keeps a different set of
# tokens than the same filters applied before the temperature (or top-p before
# top-k) would: a wrong order leaves a likely token undrawn or draws an
# impossible one.
PROBS = np.array([0.36, 0.24, 0.16, 0.1, 0.07, 0.04, 0.02, 0.01])


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (1.0, None, None), (0.6, None, None), (2.0, None, 0.8), (0.5, None, 0.8),
    (2.0, 4, None), (2.5, 6, 0.7), (0.7, 3, 0.8),
])
def test_sampler_matches_a_numpy_reference_of_the_documented_order(temperature, top_k, top_p):
    logits = np.log(PROBS)
    want = numpy_sampling_probs(logits, temperature, top_k, top_p)
    draws = 40000
    select = sampling.make_sampler(temperature, top_k, top_p)
    tokens = jax.jit(select)(jnp.broadcast_to(jnp.asarray(logits, jnp.float32),
                                              (draws, len(PROBS))), jax.random.PRNGKey(3))
    counts = np.bincount(np.asarray(tokens), minlength=len(PROBS))
    p = goodness_of_fit_pvalue(counts, want)
    assert p > ALPHA, f"frequencies {counts / draws} differ from {want} (p={p:.2e})"


def test_the_reference_tells_the_orders_apart():
    """Guard on the test above: its settings really distinguish the orders."""
    logits = np.log(PROBS)
    for temperature, top_k, top_p in [(2.0, None, 0.8), (0.5, None, 0.8), (2.5, 6, 0.7),
                                      (0.7, 3, 0.8)]:
        right = numpy_sampling_probs(logits, temperature, top_k, top_p)
        filtered_first = numpy_sampling_probs(
            np.log(numpy_sampling_probs(logits, 1.0, top_k, top_p) + 1e-300), temperature,
            None, None)
        assert not np.array_equal(right > 0, filtered_first > 0)


# --------------------------------------------------------------------------- dropout


# GELU, not ReLU: a dropout input of exactly 0 would hide its mask entry.
DROPOUT = jf.tiny(embedding_dropout=0.3, residual_dropout=0.2, ffn_dropout=0.4,
                  attention_dropout=0.25, max_len=16, activation="gelu")
RATES = {"embedding": 0.3, "residual": 0.2, "ffn": 0.4}


def site(path: tuple) -> str:
    """Which config rate a Dropout module applies, from its path."""
    if "positions" in path:
        return "embedding"
    return "ffn" if "ffn" in path else "residual"


class DropoutRecorder:
    """Intercepts every `nn.Dropout` call: (module path, call number, input, output).

    `in_jit=True` reads the arrays out of a jitted function with
    `jax.debug.callback`; the call number is fixed at trace time.
    """

    def __init__(self, in_jit: bool = False):
        self.records, self.in_jit, self.calls = [], in_jit, 0

    def __call__(self, next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if isinstance(context.module, nn.Dropout) and context.method_name == "__call__":
            key = (tuple(context.module.path), self.calls)
            self.calls += 1
            if self.in_jit:
                jax.debug.callback(lambda x, y, key=key: self.records.append(
                    (key, np.asarray(x), np.asarray(y))), args[0], out)
            else:
                self.records.append((key, np.asarray(args[0]), np.asarray(out)))
        return out


def dropped(x, y, rate):
    """The drop mask of one call, after checking kept values are scaled by 1/(1-rate)."""
    assert np.all(x != 0), "inputs must be non-zero to read the mask"
    kept = y != 0
    # 1e-5: inside jit XLA may recompute the input inside the dropout's fusion, a few
    # ulps off the copy read out; a wrong scale is off by percents.
    np.testing.assert_allclose(y[kept], x[kept] / (1 - rate), rtol=1e-5, atol=1e-6)
    return ~kept


@pytest.fixture(scope="module")
def dropout_model():
    model = jf.Transformer(DROPOUT)
    r = np.random.default_rng(2)
    src = jnp.asarray(r.integers(3, 16, (64, 16)), jnp.int32)
    tgt = jnp.asarray(r.integers(3, 16, (64, 16)), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), src[:1], tgt[:1])["params"]
    return model, params, src, tgt


def test_dropout_rate_scaling_and_independence_across_layers_and_rows(dropout_model):
    model, params, src, tgt = dropout_model
    recorder = DropoutRecorder()
    with nn.intercept_methods(recorder):
        model.apply({"params": params}, src, tgt, deterministic=False,
                    rngs={"dropout": jax.random.PRNGKey(5)})
    masks = {}
    for (path, call), x, y in recorder.records:
        rate = RATES[site(path)]
        mask = dropped(x, y, rate)
        p = binomial_pvalue(int(mask.sum()), mask.size, rate)
        assert p > ALPHA, f"{'/'.join(path)}: drop fraction {mask.mean():.4f}, rate {rate}"
        p = independence_pvalue(mask[0::2], mask[1::2])
        assert p > ALPHA, f"{'/'.join(path)}: rows share their mask (p={p:.2e})"
        masks[(path, call)] = mask
    # 2 stacks x 2 layers: 2 residual sites per encoder layer, 3 per decoder layer,
    # one FFN site per layer, and the embedding dropout of each stack.
    assert len(masks) == 2 * 2 + 2 * 3 + 4 + 2
    same_shape = [(a, b) for a in masks for b in masks
                  if a < b and masks[a].shape == masks[b].shape]
    assert len(same_shape) > 50
    for a, b in same_shape:  # every pair of calls, within and across layers
        p = independence_pvalue(masks[a], masks[b])
        assert p > ALPHA, f"{a} and {b} share their dropout mask (p={p:.2e})"


def test_attention_dropout_rate_scaling_and_independence_across_rows_and_heads():
    from jaxformer.nn.attention import dot_product_attention

    q, k, v = jax.random.normal(jax.random.PRNGKey(0), (3, 64, 4, 16, 8))
    full = np.asarray(dot_product_attention(q, k, v)[1])
    weights = np.asarray(dot_product_attention(q, k, v, dropout_rate=0.25,
                                               dropout_rng=jax.random.PRNGKey(1))[1])
    mask = dropped(full, weights, 0.25)
    assert binomial_pvalue(int(mask.sum()), mask.size, 0.25) > ALPHA
    assert independence_pvalue(mask[0::2], mask[1::2]) > ALPHA, "rows share a mask"
    assert independence_pvalue(mask[:, 0::2], mask[:, 1::2]) > ALPHA, "heads share a mask"
    assert independence_pvalue(mask[..., 0::2, :], mask[..., 1::2, :]) > ALPHA, "queries"


def test_attention_dropout_masks_differ_between_layers_and_sublayers(dropout_model):
    """The sown weights of every attention site: dropped entries are exactly 0."""
    _, params, src, tgt = dropout_model
    model = jf.Transformer(DROPOUT.replace(embedding_dropout=0.0, residual_dropout=0.0,
                                           ffn_dropout=0.0))
    _, state = model.apply({"params": params}, src, tgt, deterministic=False,
                           rngs={"dropout": jax.random.PRNGKey(6)}, mutable="intermediates")
    masks = {}
    for name, w in jf.attention_weights(state["intermediates"]).items():
        w = np.asarray(w)
        # Causal self-attention: only the weights on and below the diagonal are drawn.
        visible = np.broadcast_to(np.tril(np.ones((16, 16), bool)) if "self" in name
                                  and "decoder" in name else True, w.shape)
        mask = w[visible] == 0  # a softmax weight is never exactly 0 unless dropped
        assert binomial_pvalue(int(mask.sum()), mask.size, 0.25) > ALPHA, name
        masks[name] = mask
    assert len(masks) == 6  # 2 encoder self, 2 decoder self, 2 cross
    names = sorted(masks)
    pairs = [(a, b) for a in names for b in names if a < b and masks[a].shape == masks[b].shape]
    assert len(pairs) == 6 + 1  # the 4 full sites pairwise, the 2 causal ones
    for a, b in pairs:
        assert independence_pvalue(masks[a], masks[b]) > ALPHA, (a, b)


def test_dropout_is_the_identity_at_eval(dropout_model):
    model, params, src, tgt = dropout_model
    recorder = DropoutRecorder()
    with nn.intercept_methods(recorder):
        eval_logits = model.apply({"params": params}, src, tgt,
                                  rngs={"dropout": jax.random.PRNGKey(5)})
    assert len(recorder.records) == 16
    for _, x, y in recorder.records:
        np.testing.assert_array_equal(x, y)
    no_dropout = jf.Transformer(DROPOUT.replace(embedding_dropout=0.0, residual_dropout=0.0,
                                                ffn_dropout=0.0, attention_dropout=0.0))
    np.testing.assert_array_equal(eval_logits,
                                  no_dropout.apply({"params": params}, src, tgt))


def test_train_step_draws_new_dropout_masks_at_every_step():
    """Masks read out of the real jitted train step: independent from step to step."""
    config = DROPOUT.replace(num_encoder_layers=1, num_decoder_layers=1, attention_dropout=0.0)
    train = TrainConfig(max_len=8, steps=10, batch_size=64, warmup_steps=1)
    fns = train_functions(config, train)
    state = fns.init(0)
    recorder = DropoutRecorder(in_jit=True)
    with nn.intercept_methods(recorder):  # traced inside: the callbacks are compiled in
        step = make_train_step(fns.model, fns.tx)
        for s in range(3):
            state, metrics = step(state, fns.batch(0, s))
        jax.block_until_ready(metrics)
    by_call = {}
    for (path, call), x, y in recorder.records:
        by_call.setdefault((path, call), []).append(dropped(x, y, RATES[site(path)]))
    assert len(by_call) == 2 + 3 + 2 + 2 and all(len(m) == 3 for m in by_call.values())
    for key, (first, second, third) in by_call.items():
        for a, b in ((first, second), (second, third)):
            p = independence_pvalue(a, b)
            assert p > ALPHA, f"{key}: the dropout mask repeats across steps (p={p:.2e})"

"""Speculation in the engine (issue 43 item 4): prompt-lookup drafts verified in the
step's one pass give plain greedy tokens (= `generate` alone, = the engine without
speculation), sampled tokens distributed as the model's probabilities, and the
acceptance rate in `metrics()`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.serve import Engine, Request, SamplingParams, speculative
from jaxformer.serve.spec_step import draft_tokens
from tests.serve.test_engine import CONFIG, alone, engine, prompts, tokens_of
from tests.serve.test_speculative import P_MIN, V, chi_square_p, exact_two_token_probs


@pytest.fixture(scope="module")
def lm(make_lm):
    return make_lm(CONFIG, seed=3)


def test_host_drafts_equal_the_jax_lookup():
    rng = np.random.default_rng(0)
    lookup = jax.jit(speculative.ngram_draft, static_argnames=("k", "n_min", "n_max"))
    for trial in range(120):
        seq = rng.integers(3, 7, rng.integers(1, 30)).tolist()
        k, n_max = (1, 3, 5)[trial % 3], (1, 3)[trial % 2]
        padded = jnp.asarray(seq + [0] * (32 - len(seq)), jnp.int32)
        draft, count = lookup(padded, jnp.int32(len(seq)), k=k, n_min=1, n_max=n_max)
        want = np.asarray(draft)[:int(count)].tolist()
        assert draft_tokens(seq, k, 1, n_max) == want, (seq, k, n_max)


def repetitive(seed, length):
    """A prompt that repeats a short phrase: drafts from it get accepted."""
    phrase = prompts(seed, (5,))[0]
    return (phrase * 8)[:length]


def test_greedy_with_speculation_equals_without_and_generate_alone(lm):
    ps = [repetitive(1, 20), prompts(4, (9,))[0], repetitive(2, 30), prompts(5, (3,))[0],
          repetitive(3, 12)]
    news = (20, 12, 24, 7, 16)
    outs, rates = {}, {}
    for k in (0, 4):
        eng = engine(lm, speculative=k)
        handles = [eng.submit(Request(p, SamplingParams(max_tokens=n)))
                   for p, n in zip(ps, news)]
        eng.run_until_idle()
        outs[k] = [tokens_of(h) for h in handles]
        rates[k] = eng.metrics()["acceptance_rate"]
        assert eng.metrics()["free_pages"] == eng.metrics()["total_pages"]
    assert outs[4] == outs[0] == [alone(*lm, p, n) for p, n in zip(ps, news)]
    assert rates[0] == 0.0 and 0.2 < rates[4] <= 1.0


def test_speculative_logprobs_and_stops_equal_plain(lm):
    prompt = repetitive(6, 18)
    runs = {}
    for k in (0, 3):
        eng = engine(lm, speculative=k)
        handles = [eng.submit(Request(prompt, SamplingParams(max_tokens=14, logprobs=2))),
                   eng.submit(Request(prompt, SamplingParams(max_tokens=14, stop_ids=(
                       alone(*lm, prompt, 14)[6],))))]
        eng.run_until_idle()
        runs[k] = [[(e.token, e.logprob, e.top_logprobs, e.finish_reason) for e in h.result(0)]
                   for h in handles]
    for plain, spec in zip(runs[0], runs[3]):
        assert [e[0] for e in spec] == [e[0] for e in plain]
        assert [e[3] for e in spec] == [e[3] for e in plain]
        for a, b in zip(plain, spec):
            if a[1] is not None:
                assert b[1] == pytest.approx(a[1], abs=1e-4)
                assert [t for t, _ in b[2]] == [t for t, _ in a[2]]


def test_greedy_and_sampled_rows_in_one_speculative_step(lm):
    """A verify step holding a greedy row beside sampled ones (one with top-k) takes the
    sampled acceptance for all: the greedy row still gets plain greedy tokens, and each
    sampled row the tokens it gets alone (its seed and own drafts only)."""
    prompt = prompts(1, (12,))[0]  # its greedy row rejects drafts in mixed steps
    requests = [SamplingParams(max_tokens=16),
                SamplingParams(max_tokens=16, temperature=0.8, seed=5),
                SamplingParams(max_tokens=16, temperature=1.0, top_k=3, seed=9)]

    def run(batch):
        eng = engine(lm, speculative=3)
        handles = [eng.submit(Request(prompt, r)) for r in batch]
        eng.run_until_idle()
        return [tokens_of(h) for h in handles], eng.metrics()["acceptance_rate"]

    together, rate = run(requests)
    assert together[0] == alone(*lm, prompt, 16)
    assert rate > 0  # drafts were verified, some accepted
    for i in (1, 2):
        assert together[i] == run([requests[i]])[0][0]
    assert together[1] != together[2]


def test_a_step_without_drafts_runs_the_plain_decode_step(lm, monkeypatch):
    """Where no slot has a draft, the engine runs the decode program (one position per
    row) instead of the verify step (k + 1): same tokens, and after `warm_up` neither
    compiles anything."""
    from jaxformer.serve import spec_step  # noqa: PLC0415

    eng = engine(lm, speculative=3).warm_up()
    verify, decode = spec_step.compiled_verify(), eng.decode_fn
    sizes = (verify._cache_size(), decode._cache_size())
    calls = {"verify": 0, "decode": 0}
    run_verify, run_decode = spec_step.run_verify, eng.run_decode
    monkeypatch.setattr(spec_step, "run_verify", lambda *a: calls.__setitem__(
        "verify", calls["verify"] + 1) or run_verify(*a))
    monkeypatch.setattr(eng, "run_decode", lambda *a: calls.__setitem__(
        "decode", calls["decode"] + 1) or run_decode(*a))
    ps = [repetitive(1, 20), prompts(4, (9,))[0]]
    handles = [eng.submit(Request(p, SamplingParams(max_tokens=12))) for p in ps]
    eng.run_until_idle()
    assert [tokens_of(h) for h in handles] == [alone(*lm, p, 12) for p in ps]
    assert calls["verify"] > 0

    monkeypatch.setattr(spec_step, "draft_tokens", lambda *a: [])  # prompt lookup finds none
    calls.update(verify=0, decode=0)
    handle = eng.submit(Request(ps[0], SamplingParams(max_tokens=12)))
    eng.run_until_idle()
    assert tokens_of(handle) == alone(*lm, ps[0], 12)
    assert calls == {"verify": 0, "decode": 11}  # the first token comes from the prefill
    assert (verify._cache_size(), decode._cache_size()) == sizes


@pytest.fixture(scope="module")
def small_vocab(make_lm):
    config = jf.tiny(num_encoder_layers=0, tgt_vocab_size=V, max_len=16)
    return make_lm(config, seed=3)


DRAWS = 3000


def engine_draws(lm, speculative_k):
    """The first two sampled tokens of DRAWS requests with seeds 0.. (temperature 1)."""
    model, params = lm
    eng = Engine(model, params, slots=64, max_len=16, page_size=4, prefill_chunk=8,
                 max_queue=DRAWS, speculative=speculative_k)
    prompt = [4, 7, 7, 4, 7]  # lookup drafts 7 after "4 7"; the model gives it p ~ 0.5
    # max_tokens 3: the first token comes from the prefill, the second from a step that
    # verifies one draft (room for one more token after it).
    handles = [eng.submit(Request(prompt, SamplingParams(max_tokens=3, temperature=1.0,
                                                         seed=s)))
               for s in range(DRAWS)]
    eng.run_until_idle()
    c = model.config
    rows = []
    for h in handles:
        got = [e.token for e in h.result(0) if e.token is not None]
        if len(got) < 2:  # EOS ends a request with an event without a token
            got = got + [c.eos_id, c.pad_id] if len(got) == 1 else [c.eos_id, c.pad_id]
        rows.append(got[:2])
    return (np.asarray(rows), exact_two_token_probs(model, params, jnp.asarray(prompt)),
            eng.metrics()["acceptance_rate"])


def test_sampled_speculation_in_the_engine_follows_the_model(small_vocab):
    """Chi-square of the first two tokens against the exact probabilities (p > 1e-3)."""
    tokens, probs, rate = engine_draws(small_vocab, 3)
    assert 0.03 < rate < 0.9  # both accepted and rejected drafts (about 9 % accepted)
    assert chi_square_p(tokens, probs) > P_MIN


def test_bad_speculation_settings_are_refused(lm):
    with pytest.raises(ValueError, match="speculative"):
        engine(lm, speculative=-1)
    with pytest.raises(ValueError, match="ngram"):
        engine(lm, speculative=2, ngram=(2, 1))

"""The engine against `decode.generate` alone: concurrency, chunked prefill, prefix cache,
cancel, per-seed sampling, stops, logprobs, echo, bad input (a tiny llama-style model)."""

import asyncio
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.decode import sampling
from jaxformer.nn.quant_params import quantize_params
from jaxformer.serve import (Engine, FinishReason, QueueFull, Request, SamplingParams)
from jaxformer.serve.select import SlotParams, filtered_logits

VOCAB = 64
CONFIG = jf.llama(tgt_vocab_size=VOCAB, src_vocab_size=VOCAB, max_len=64, num_kv_heads=2)
EOS = CONFIG.eos_id


class Letters:
    """A tokenizer stand-in: id i is one letter (specials 0-2 are empty)."""

    def decode(self, ids):
        return "".join("" if i < 3 else chr(ord("a") + (i - 3) % 26) for i in ids)


@pytest.fixture(scope="module")
def lm(make_lm):
    return make_lm(CONFIG, seed=3)


def prompts(seed, lengths):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, VOCAB, n)] for n in lengths]


WIDTH, NEW = 32, 24  # one compiled `generate` for every reference


def generate_alone(model, params, prompt, **kwargs):
    """`generate` of one prompt alone (a batch of one, right-padded to WIDTH)."""
    row = np.zeros((1, WIDTH), np.int32)
    row[0, :len(prompt)] = prompt
    return jf.generate(model, params, jnp.asarray(row), prompt_lengths=jnp.asarray([len(prompt)]),
                       max_new_tokens=NEW, **kwargs)


def alone(model, params, prompt, max_tokens):
    """The first `max_tokens` new tokens of `generate_alone`, before EOS."""
    out = generate_alone(model, params, prompt)
    tokens = [int(t) for t in out.tokens[0][:min(int(out.lengths[0]), max_tokens)]]
    return tokens[:tokens.index(EOS)] if EOS in tokens else tokens


def engine(lm, **kwargs):
    kwargs = {"slots": 3, "max_len": 64, "page_size": 4, "prefill_chunk": 8, **kwargs}
    return Engine(*lm, **kwargs)


def tokens_of(handle):
    return [e.token for e in handle.result(0) if e.token is not None and not e.prompt]


def test_concurrent_greedy_equals_generate_alone(lm):
    """Six prompts of 1..30 tokens through 3 slots (queueing, chunked prefill over
    several steps, joins while others decode) give generate's tokens."""
    eng = engine(lm)
    ps = prompts(0, (5, 30, 1, 17, 9, 12))
    news = (12, 6, 20, 9, 15, 3)
    handles = [eng.submit(Request(p, SamplingParams(max_tokens=n))) for p, n in zip(ps, news)]
    eng.run_until_idle()
    got = [tokens_of(h) for h in handles]
    want = [alone(*lm, p, n) for p, n in zip(ps, news)]
    assert got == want
    assert len({tuple(w) for w in want}) == len(want)      # the model is not degenerate
    assert eng.metrics()["free_pages"] == eng.metrics()["total_pages"]
    assert eng.metrics()["generated_tokens"] >= sum(len(w) for w in want)


def test_decode_runs_only_the_decoding_slots(lm, monkeypatch):
    """Eight slots, requests ending at different steps: each decode call has the
    decoding slots' row count rounded up to 2, 4 or 8 (not always 8), and the
    tokens are still generate's."""
    eng = engine(lm, slots=8)
    rows = []
    run_decode = eng.run_decode
    monkeypatch.setattr(eng, "run_decode", lambda *a: rows.append(len(a[1])) or run_decode(*a))
    ps, news = prompts(40, (3, 2, 1, 3, 2)), (5, 6, 7, 11, 16)
    handles = [eng.submit(Request(p, SamplingParams(max_tokens=n))) for p, n in zip(ps, news)]
    eng.run_until_idle()
    assert [tokens_of(h) for h in handles] == [alone(*lm, p, n) for p, n in zip(ps, news)]
    assert set(rows) == {2, 4, 8} and rows[-1] == 2


def test_a_prefill_call_reads_at_least_256_positions(make_lm, monkeypatch):
    """A short prompt's prefill reads the 256-position view, not 128 (one compiled
    program fewer per prefill shape: `batching.PREFILL_VIEW`); decode keeps 128."""
    config = jf.llama(tgt_vocab_size=VOCAB, src_vocab_size=VOCAB, max_len=512, num_kv_heads=2)
    eng = Engine(*make_lm(config, seed=3), slots=2, max_len=512, page_size=16,
                 prefill_chunk=16)
    views = []
    for name in ("run_prefill", "run_decode"):
        call = getattr(eng, name)
        monkeypatch.setattr(eng, name, lambda *a, call=call, name=name:
                            views.append((name, a[-2 if name == "run_prefill" else -1]))
                            or call(*a))
    eng.submit(Request(prompts(41, (5,))[0], SamplingParams(max_tokens=2)))
    eng.run_until_idle()
    assert views == [("run_prefill", 256), ("run_decode", 128)]


def test_prefix_cache_on_off_identical_and_reused(lm):
    shared = prompts(1, (21,))[0]
    ps = [shared + tail for tail in prompts(2, (3, 7, 1))] + [shared]
    outs = {}
    for on in (True, False):
        eng = engine(lm, prefix_cache=on, slots=2)
        handles = [eng.submit(Request(p, SamplingParams(max_tokens=8))) for p in ps]
        eng.run_until_idle()
        outs[on] = [tokens_of(h) for h in handles]
        rate = eng.metrics()["prefix_hit_rate"]
        assert (rate > 0.3) if on else rate == 0   # the last two find 20 tokens each
    assert outs[True] == outs[False] == [alone(*lm, p, 8) for p in ps]


def test_echo_logprobs_with_the_prefix_cached(lm):
    """lm-eval's pattern: one context, four endings, echo (issue 43). The context's full
    pages are cached by an earlier request and by each other (concurrent, then one after
    another); every prompt logprob is still the model's own log-softmax."""
    model, params = lm
    shared = prompts(11, (13,))[0]
    ps = [shared + tail for tail in prompts(12, (1, 3, 6, 9))]
    for together in (True, False):
        eng = engine(lm, slots=4)
        eng.submit(Request(shared, SamplingParams(max_tokens=1)))
        eng.run_until_idle()
        handles = []
        for p in ps:
            handles.append(eng.submit(Request(p, SamplingParams(max_tokens=1, echo=True,
                                                                logprobs=1))))
            if not together:
                eng.run_until_idle()
        eng.run_until_idle()
        for p, h in zip(ps, handles):
            got = [e.logprob for e in h.result(0) if e.prompt][1:]
            ref = jax.nn.log_softmax(model.apply({"params": params}, jnp.asarray([p]))[0], -1)
            np.testing.assert_allclose(got, [ref[i - 1, p[i]] for i in range(1, len(p))],
                                       atol=1e-4)


def test_cancel_frees_pages_at_once(lm):
    eng = engine(lm, slots=2)
    long = eng.submit(Request(prompts(3, (20,))[0], SamplingParams(max_tokens=40)))
    queued = eng.submit(Request([5, 6], SamplingParams(max_tokens=40)))
    other = eng.submit(Request([7, 8, 9], SamplingParams(max_tokens=40)))
    for _ in range(6):
        eng.step()
    assert eng.metrics()["free_pages"] < eng.metrics()["total_pages"]
    long.cancel()
    eng.cancel(queued.request_id)
    other.cancel()
    eng.step()
    m = eng.metrics()
    assert m["free_pages"] == m["total_pages"] and m["running"] == 0 and m["queued"] == 0
    for h in (long, queued, other):
        assert h.result(0)[-1].finish_reason == FinishReason.CANCELLED


def test_sampling_depends_on_the_seed_only(lm):
    p = SamplingParams(max_tokens=10, temperature=1.0, top_k=20, top_p=0.9, seed=7)
    prompt = prompts(4, (6,))[0]
    eng = engine(lm)
    solo = eng.submit(Request(prompt, p))
    eng.run_until_idle()
    eng = engine(lm)
    crowd = [eng.submit(Request(q, SamplingParams(max_tokens=12, temperature=0.7, seed=s)))
             for s, q in enumerate(prompts(5, (3, 11)))]
    beside = eng.submit(Request(prompt, p))
    other_seed = eng.submit(Request(prompt, SamplingParams(**{**p.__dict__, "seed": 8})))
    eng.run_until_idle()
    assert tokens_of(solo) == tokens_of(beside)
    assert tokens_of(other_seed) != tokens_of(solo)
    assert all(tokens_of(h) for h in crowd)


@pytest.mark.parametrize("top_k,top_p", [(1, None), (5, None), (None, 0.3), (7, 0.8)])
def test_per_row_filters_equal_decode_sampling(top_k, top_p):
    logits = jax.random.normal(jax.random.PRNGKey(0), (3, 50)) * 3
    ref = logits / 0.5
    if top_k:
        ref = sampling.top_k_filter(ref, top_k)
    if top_p:
        ref = sampling.top_p_filter(ref, top_p)
    params = SlotParams(temperature=jnp.full((3,), 0.5), top_k=jnp.full((3,), top_k or 0),
                        top_p=jnp.full((3,), top_p or 1.0), min_p=jnp.zeros((3,)),
                        seed=jnp.zeros((3,), jnp.uint32))
    np.testing.assert_array_equal(np.asarray(filtered_logits(logits, params)), np.asarray(ref))


def test_min_p_keeps_tokens_at_least_min_p_times_the_top():
    """Per row: a token stays iff its probability (after temperature) is >= min_p times
    the top token's, intersected with the row's top-k; kept logits are unchanged."""
    logits = np.asarray(jax.random.normal(jax.random.PRNGKey(1), (5, 50)) * 3)
    min_p = np.asarray([0.0, 0.05, 0.3, 1.0, 0.05], np.float32)
    top_k = np.asarray([0, 0, 0, 0, 3], np.int32)
    params = SlotParams(temperature=jnp.full((5,), 0.7), top_k=jnp.asarray(top_k),
                        top_p=jnp.ones((5,)), min_p=jnp.asarray(min_p),
                        seed=jnp.zeros((5,), jnp.uint32))
    out = np.asarray(filtered_logits(jnp.asarray(logits), params))
    scaled = logits.astype(np.float32) / np.float32(0.7)
    probs = np.exp(scaled - scaled.max(-1, keepdims=True))
    want = probs >= min_p[:, None] * probs.max(-1, keepdims=True)
    want[4] &= scaled[4] >= np.sort(scaled[4])[-3]
    kept = out > sampling.NEG
    np.testing.assert_array_equal(kept, want)
    assert kept[0].all() and kept[3].sum() == 1 and 1 < kept[2].sum() < kept[1].sum()
    np.testing.assert_allclose(out[kept], scaled[kept], rtol=1e-6)


@pytest.mark.parametrize("speculative", [0, 3], ids=["plain", "speculative"])
def test_min_p_one_is_greedy_per_row(lm, speculative):
    """Temperature 2 with min_p 1.0 keeps only the top token: greedy's tokens for every
    seed, beside rows of the same prompt with min_p 0 (which then sample other tokens),
    in the plain and in the speculative (verify) step."""
    prompt = prompts(11, (5,))[0]
    greedy = alone(*lm, prompt, 8)
    eng = engine(lm, slots=4, speculative=speculative)
    hot = [SamplingParams(max_tokens=8, temperature=2.0, seed=s, min_p=m)
           for s in range(4) for m in (1.0, 0.0)]
    handles = [(p.min_p, eng.submit(Request(prompt, p))) for p in hot]
    eng.run_until_idle()
    assert [tokens_of(h) for m, h in handles if m == 1.0] == [greedy] * 4
    assert all(tokens_of(h) != greedy for m, h in handles if m == 0.0)


def test_stop_ids_strings_and_logprobs(lm):
    prompt = prompts(9, (7,))[0]     # a varied continuation
    want = alone(*lm, prompt, 16)
    text = Letters().decode(want)
    stop = text[5:8]
    cut = text.index(stop)
    eng = engine(lm, tokenizer=Letters())
    by_string = eng.submit(Request(prompt, SamplingParams(max_tokens=16, stop=(stop, "zzzz"))))
    by_id = eng.submit(Request(prompt, SamplingParams(max_tokens=16, stop_ids=(want[4],))))
    with_lp = eng.submit(Request(prompt, SamplingParams(max_tokens=16, logprobs=3)))
    eng.run_until_idle()
    events = by_string.result(0)
    assert "".join(e.text for e in events) == text[:cut]
    assert events[-1].finish_reason == FinishReason.STOP
    events = by_id.result(0)
    assert [e.token for e in events if e.token is not None] == want[:want.index(want[4])]
    assert events[-1].finish_reason == FinishReason.STOP
    events = with_lp.result(0)
    assert "".join(e.text for e in events) == text
    events = [e for e in events if e.token is not None]
    out = generate_alone(*lm, prompt, return_logits=True)
    ref = jax.nn.log_softmax(out.logits[0], axis=-1)
    for i, e in enumerate(events):
        assert e.logprob == pytest.approx(float(ref[i, e.token]), abs=1e-4)
        ids = [t for t, _ in e.top_logprobs]
        assert ids == [int(t) for t in jnp.argsort(-ref[i])[:3]]


def test_echo_gives_prompt_logprobs(lm):
    model, params = lm
    prompt = prompts(7, (19,))[0]
    eng = engine(lm, tokenizer=Letters())
    h = eng.submit(Request(prompt, SamplingParams(max_tokens=3, echo=True, logprobs=2)))
    eng.run_until_idle()
    events = h.result(0)
    echoed = [e for e in events if e.prompt]
    assert [e.token for e in echoed] == prompt and echoed[0].logprob is None
    logits = model.apply({"params": params}, jnp.asarray([prompt]))
    ref = jax.nn.log_softmax(logits[0], axis=-1)
    for i, e in enumerate(echoed[1:], 1):
        assert e.logprob == pytest.approx(float(ref[i - 1, prompt[i]]), abs=1e-4)
        assert e.top_logprobs[0][0] == int(jnp.argmax(ref[i - 1]))
    assert [e.token for e in events if not e.prompt and e.token is not None] == \
        alone(*lm, prompt, 3)


def test_a_stop_pick_is_reported_with_its_logprob(lm):
    """An EOS / stop-id pick ends the request without output, but its final event carries
    (id, logprob, top) of that pick: echo scoring (lm-eval's max_tokens 1) needs the
    generated entry even when it is EOS (issue 43: the last prompt token's logprob was
    dropped instead)."""
    model, params = lm
    prompt = prompts(7, (19,))[0]
    first = alone(model, params, prompt, 1)[0]
    eng = engine(lm)
    h = eng.submit(Request(prompt, SamplingParams(max_tokens=1, echo=True, logprobs=2,
                                                  stop_ids=(first,))))
    eng.run_until_idle()
    last = h.result(0)[-1]
    assert last.token is None and last.finish_reason == FinishReason.STOP
    logits = model.apply({"params": params}, jnp.asarray([prompt]))
    ref = jax.nn.log_softmax(logits[0, -1], axis=-1)
    token, logprob, top = last.stopped_by
    assert token == first == int(jnp.argmax(ref))
    assert logprob == pytest.approx(float(ref[first]), abs=1e-4)
    assert [t for t, _ in top] == [int(t) for t in jnp.argsort(-ref)[:2]]


def test_full_context_ends_with_length(lm):
    eng = engine(lm, max_len=24)
    h = eng.submit(Request(prompts(8, (20,))[0], SamplingParams(max_tokens=50)))
    eng.run_until_idle()
    events = h.result(0)
    assert len([e for e in events if e.token is not None]) == 5      # positions 20..24
    assert events[-1].finish_reason == FinishReason.LENGTH


def test_threads_and_asyncio(lm):
    eng = engine(lm).start()
    try:
        ps = prompts(9, (4, 13, 8, 2))
        results = {}

        def client(i):
            results[i] = [e.token for e in eng.submit(Request(ps[i], SamplingParams(max_tokens=6)))
                          if e.token is not None]

        threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()

        async def stream():
            h = eng.submit(Request(ps[3], SamplingParams(max_tokens=6)))
            return [e.token async for e in h if e.token is not None]

        last = asyncio.run(stream())
        for t in threads:
            t.join()
        assert [results[i] for i in range(3)] + [last] == [alone(*lm, p, 6) for p in ps]
    finally:
        eng.stop(drain_timeout=5)
    with pytest.raises(RuntimeError, match="stopping"):
        eng.submit(Request([3], SamplingParams()))


def test_bad_input_is_refused_before_work(lm):
    eng = engine(lm, max_len=32, max_queue=2, tokenizer=None)
    cases = [
        (Request(list(range(3, 36))), "more than the context max_len=32"),
        (Request([]), "prompt_ids is empty"),
        (Request([3, VOCAB]), "prompt_ids must be ints"),
        (Request([3], SamplingParams(temperature=-1)), "temperature"),
        (Request([3], SamplingParams(top_p=0)), "top_p"),
        (Request([3], SamplingParams(top_k=VOCAB + 1)), "top_k"),
        (Request([3], SamplingParams(top_k=10 ** 12)), "top_k"),
        (Request([3], SamplingParams(min_p=1.5)), "min_p"),
        (Request([3], SamplingParams(temperature=1e-30)), "temperature"),
        (Request([3], SamplingParams(max_tokens=0)), "max_tokens"),
        (Request([3], SamplingParams(logprobs=21)), "logprobs"),
        (Request([3], SamplingParams(stop=("x",))), "tokenizer"),
        (Request([3], adapter="nope"), "unknown adapter"),
    ]
    for request, message in cases:
        with pytest.raises(ValueError, match=message):
            eng.submit(request)
    eng.submit(Request([3]))
    eng.submit(Request([4]))
    with pytest.raises(QueueFull):
        eng.submit(Request([5]))
    with pytest.raises(ValueError, match="exceeds the model's context"):
        engine(lm, max_len=65)
    with pytest.raises(ValueError, match="page_size"):
        engine(lm, page_size=0)


def test_a_pool_larger_than_the_memory_is_refused_in_one_line(lm):
    """page_size 10**9: the pools' bytes against the machine's memory, refused before
    anything is allocated (XLA's RESOURCE_EXHAUSTED is a 52-line page); a pool that fits
    is what `init_pools` allocates, byte for byte."""
    from jaxformer.serve import checks, paged  # noqa: PLC0415

    with pytest.raises(ValueError, match=r"the KV page pools need [\d,.]+ GiB \(3 pages of "
                                         r"1000000000 tokens, 2 layers\), more than the"):
        engine(lm, page_size=10 ** 9)
    for change in ({}, {"kv_cache_quant": "int8"}):
        config = CONFIG.replace(**change)
        assert checks.pool_bytes_needed(config, 5, 4) == paged.pool_bytes(
            paged.init_pools(config, 5, 4))


def test_adapters_choose_their_parameters(lm, make_lm):
    model, base = lm
    _, other = make_lm(CONFIG, seed=11)
    eng = engine(lm, adapters={"tuned": other})
    prompt = prompts(10, (9,))[0]
    a = eng.submit(Request(prompt, SamplingParams(max_tokens=8)))
    b = eng.submit(Request(prompt, SamplingParams(max_tokens=8), adapter="tuned"))
    eng.run_until_idle()
    assert tokens_of(a) == alone(model, base, prompt, 8)
    assert tokens_of(b) == alone(model, other, prompt, 8) != tokens_of(a)


def test_an_adapter_never_reuses_the_base_models_cached_pages(lm, make_lm):
    """The prefix cache is per parameter set: the same prompt, cached by a base request
    first, is computed again under the adapter (its keys and values differ)."""
    model, base = lm
    _, other = make_lm(CONFIG, seed=11)
    eng = engine(lm, adapters={"tuned": other})
    prompt = prompts(15, (13,))[0]
    for adapter in (None, "tuned", "tuned", None):
        handle = eng.submit(Request(prompt, SamplingParams(max_tokens=8), adapter=adapter))
        eng.run_until_idle()
        assert tokens_of(handle) == alone(model, base if adapter is None else other, prompt, 8)
    assert eng.metrics()["prefix_hit_rate"] > 0.3  # the repeats found their own pages


@pytest.mark.parametrize("change", [{}, {"kv_cache_quant": "int8", "weight_quant": "int8"},
                                    {"attention_impl": "jax"}],
                         ids=["default", "int8", "jax_layout"])
def test_one_slot_quantized_and_layouts_equal_generate(make_lm, change):
    """One slot (its decode step writes its one new key with a dynamic update slice, not
    the scatter of several rows: `nn.paged_kv.write`), the prompts queued behind each
    other; int8 weights quantized from float ones (random int8 leaves give a model that
    only says PAD, which would pass anything). Several slots with these layouts:
    `test_scanned_layers_equal_unrolled_and_generate`."""
    config = CONFIG.replace(**change)
    model, params = make_lm(config.replace(weight_quant=None), seed=3)
    if config.weight_quant:
        model = jf.DecoderOnlyLM(config)
        params = quantize_params(config.replace(weight_quant=None), params, "int8")[1]
    eng = engine((model, params), slots=1)
    ps = prompts(11, (6, 14, 3))
    handles = [eng.submit(Request(p, SamplingParams(max_tokens=7))) for p in ps]
    eng.run_until_idle()
    want = [alone(model, params, p, 7) for p in ps]
    assert [tokens_of(h) for h in handles] == want
    assert len({tuple(w) for w in want}) == len(want)  # not degenerate


@pytest.mark.parametrize("change,kwargs", [
    ({}, {}), ({"attention_impl": "jax"}, {"speculative": 2}),
    ({"kv_cache_quant": "int8", "weight_quant": "int8"}, {"prefix_cache": False})],
    ids=["default", "jax_layout_speculative", "int8"])
def test_scanned_layers_equal_unrolled_and_generate(make_lm, change, kwargs):
    """`scan_layers=True` (one scan over stacked layers and one stacked pool, each layer
    reading and writing its own slice): the unrolled engine's tokens and generate's,
    with queueing, chunked prefill, the prefix cache, an adapter, int8 weights and cache
    (quantized from float weights: random int8 leaves give a model that only says PAD)."""
    config = CONFIG.replace(num_decoder_layers=3, **change)
    float_config = config.replace(weight_quant=None)
    (model, params), (_, other) = (make_lm(float_config, seed=s) for s in (3, 11))
    if config.weight_quant:
        model = jf.DecoderOnlyLM(config)
        params, other = (quantize_params(float_config, p, "int8")[1] for p in (params, other))
    ps = prompts(13, (5, 30, 1, 17, 9)) + prompts(14, (9,))
    news = (12, 6, 20, 9, 15, 8)
    got = {}
    for scan in (False, True):
        eng = engine((model, params), scan_layers=scan, adapters={"tuned": other}, **kwargs)
        handles = [eng.submit(Request(p, SamplingParams(max_tokens=n),
                                      adapter="tuned" if i == 5 else None))
                   for i, (p, n) in enumerate(zip(ps, news))]
        eng.run_until_idle()
        got[scan] = [tokens_of(h) for h in handles]
        assert len(eng.pools) == (1 if scan else 3)
    want = [alone(model, params, p, n) for p, n in zip(ps[:5], news)]
    want.append(alone(model, other, ps[5], 8))
    assert got[True] == got[False] == want
    assert len({tuple(w) for w in want}) == len(want)  # not degenerate
    assert want[5] != alone(model, params, ps[5], 8)  # the adapter's tokens are its own


class OnlyTokens:
    """A TokenConstraint stand-in: allows `allowed` ids, done after `length` tokens."""

    def __init__(self, allowed, length):
        self.mask = np.zeros((VOCAB,), bool)
        self.mask[list(allowed)] = True
        self.length, self.seen = length, []

    def allowed(self):
        return self.mask

    def advance(self, token):
        self.seen.append(token)

    def done(self):
        return len(self.seen) >= self.length


def test_constraint_masks_every_pick_and_ends_the_request(lm):
    eng = engine(lm)
    prompt = prompts(9, (7,))[0]
    free = eng.submit(Request(prompt, SamplingParams(max_tokens=6)))
    constraint = OnlyTokens({10, 11, 40}, length=4)
    constrained = eng.submit(Request(prompt, SamplingParams(max_tokens=10, temperature=1.0),
                                     constraint=constraint))
    eng.run_until_idle()
    got = tokens_of(constrained)
    assert len(got) == 4 and set(got) <= {10, 11, 40} and constraint.seen == got
    assert constrained.finish_reason == FinishReason.STOP
    assert not set(tokens_of(free)) <= {10, 11, 40}        # the mask changed the output
    assert eng.metrics()["tokens_per_s"] > 0


def test_idle_after_compiling_releases_host_memory_once(lm, monkeypatch):
    """The step thread hands the compiler's freed host memory back when it goes idle
    after a call of a new shape (`backends.host_memory`), not after every request."""
    from jaxformer.serve import engine as engine_module

    calls = []
    monkeypatch.setattr(engine_module.host_memory, "release_freed", lambda: calls.append(1))
    eng = engine(lm).start()
    try:
        prompt = prompts(12, (5,))[0]
        for expected in (1, 1):  # the second request compiles nothing new
            eng.submit(Request(prompt, SamplingParams(max_tokens=3))).result()
            deadline = time.monotonic() + 10
            while len(calls) < expected and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.05)
            assert len(calls) == expected
    finally:
        eng.stop()


def test_warm_up_leaves_nothing_to_compile(lm):
    """After `warm_up`, a mixed load compiles nothing (issue 43: compiles in the timed
    window were a third of a served run): six short prompts at once (more rows than a
    prefill call takes), long ones over several chunks, and a prefix-cached start whose
    last chunk would run past max_len (its view is capped at max_len)."""
    eng = engine(lm, slots=6, prefill_chunk=32).warm_up()
    sizes = (eng.decode_fn._cache_size(), eng.prefill_fn._cache_size())
    shared = prompts(30, (53,))[0]
    ps = prompts(31, (5, 14, 1, 16, 9, 12)) + [prompts(32, (40,))[0]]
    handles = [eng.submit(Request(p, SamplingParams(max_tokens=8))) for p in ps]
    eng.run_until_idle()
    for tail in prompts(33, (2, 3)):
        eng.submit(Request(shared + tail, SamplingParams(max_tokens=4)))
        eng.run_until_idle()
    assert eng.pool.hit_rate > 0  # the second long prompt started at a cached page
    assert [tokens_of(h) for h in handles[:6]] == [alone(*lm, p, 8) for p in ps[:6]]
    assert (eng.decode_fn._cache_size(), eng.prefill_fn._cache_size()) == sizes

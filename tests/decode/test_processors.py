"""Logits processors and forced prefixes: hand-written expectations, a recomputed
reference loop, and the contracts of every entry point."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.decode import beam, api as decoding
from jaxformer.decode import processors as P
from jaxformer.nn.masks import causal_mask

N_NEW = 8
NEG = np.finfo(np.float32).min


# -- each processor against a hand-written expectation ------------------------------


def _logits():
    return jnp.asarray(np.arange(12, dtype=np.float32).reshape(2, 6))


def _tokens():
    return jnp.zeros((2, 4), jnp.int32)


def test_suppress_tokens():
    out = np.asarray(P.suppress_tokens([1, 4])(_logits(), jnp.int32(3), _tokens()))
    want = np.arange(12, dtype=np.float32).reshape(2, 6)
    want[:, [1, 4]] = NEG
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("step", [0, 1])
def test_suppress_at_step_acts_only_at_its_step(step):
    out = np.asarray(P.suppress_at_step([0, 5], at=0)(_logits(), jnp.int32(step), _tokens()))
    want = np.arange(12, dtype=np.float32).reshape(2, 6)
    if step == 0:
        want[:, [0, 5]] = NEG
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("step", [1, 2])
def test_force_token_at_its_step(step):
    out = np.asarray(P.force_token(3, at=2)(_logits(), jnp.int32(step), _tokens()))
    want = np.arange(12, dtype=np.float32).reshape(2, 6)
    if step == 2:
        want[:] = NEG
        want[:, 3] = 0.0
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("step, blocked", [(0, True), (1, True), (2, False), (5, False)])
def test_min_length_blocks_eos_before_the_nth_token(step, blocked):
    # min 3 tokens: EOS may not be token 1 or 2 (steps 0, 1), may be token 3 (step 2).
    out = np.asarray(P.min_length(3, eos_id=2)(_logits(), jnp.int32(step), _tokens()))
    want = np.arange(12, dtype=np.float32).reshape(2, 6)
    if blocked:
        want[:, 2] = NEG
    np.testing.assert_array_equal(out, want)


def test_processors_compose_in_order_and_jit():
    procs = (P.suppress_tokens([5]), P.force_token(5, at=1))  # the force wins: it comes last
    fn = jax.jit(lambda lg, s, t: P.apply(procs, lg, s, t))
    assert int(jnp.argmax(fn(_logits(), jnp.int32(1), _tokens())[0])) == 5
    assert int(jnp.argmax(fn(_logits(), jnp.int32(0), _tokens())[0])) == 4


@pytest.mark.parametrize("proc, match", [
    pytest.param(P.suppress_tokens([16]), "SuppressTokens.*16", id="suppress"),
    pytest.param(P.suppress_at_step([-1]), "SuppressAtStep", id="suppress_at_step"),
    pytest.param(P.force_token(99, at=0), "ForceToken.*99", id="force"),
    pytest.param(P.min_length(2, eos_id=20), "MinLength.*20", id="min_length"),
])
def test_processor_ids_outside_the_vocabulary_raise(proc, match):
    with pytest.raises(ValueError, match=match):
        P.normalize(proc, 16)


# -- the decode loops against a recomputed reference ---------------------------------


@pytest.fixture(scope="module")
def encdec():
    config = jf.tiny(norm="pre")
    model = jf.Transformer(config)
    src = jnp.asarray(np.random.default_rng(3).integers(3, 16, (4, 7)), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), src, src[:, :3])["params"]
    # Make EOS likely, so min_length and EOS handling both matter.
    params["decoder"]["out_proj"]["bias"] = params["decoder"]["out_proj"]["bias"].at[
        config.eos_id].add(2.0)
    return config, model, params, src


def reference(model, params, src, n_new, edit, prefix, prefix_len):
    """Python loop, full forward pass per step; `edit(logits_BV (np), step)` and the
    forced prefix applied by hand. Returns (tokens, lengths)."""
    c = model.config
    batch = src.shape[0]
    forward = jax.jit(lambda p, s, t: model.apply({"params": p}, s, t, None,
                                                  causal_mask(t.shape[1])))
    fed = np.full((batch, n_new), c.pad_id, np.int32)
    fed[:, 0] = c.bos_id
    tokens = np.full((batch, n_new), c.pad_id, np.int32)
    lengths = np.zeros(batch, np.int32)
    finished = np.zeros(batch, bool)
    for step in range(n_new):
        logits = edit(np.array(forward(params, src, jnp.asarray(fed))[:, step]), step)
        pick = logits.argmax(-1)
        pick = np.where(step < prefix_len, prefix[:, min(step, prefix.shape[1] - 1)], pick)
        pick = np.where(finished, c.pad_id, pick).astype(np.int32)
        tokens[:, step] = pick
        lengths = np.where(finished, lengths, step + 1)
        finished |= pick == c.eos_id
        if step + 1 < n_new:
            fed[:, step + 1] = pick
    return tokens, lengths


PREFIX = np.array([[7, 8, 9], [7, 0, 0], [5, 6, 0], [4, 4, 4]], np.int32)
PREFIX_LEN = np.array([3, 1, 2, 0], np.int32)


def _edit(logits, step):
    logits[:, [3, 11]] = NEG  # suppress 3 and 11
    if step == 0:
        logits[:, 12] = NEG  # suppressed at the first step only
    if step == 4:
        logits[:] = NEG
        logits[:, 13] = 0.0  # forced at step 4
    if step + 1 < 3:
        logits[:, 2] = NEG  # min length 3
    return logits


PROCS = [P.suppress_tokens([3, 11]), P.suppress_at_step([12], at=0), P.force_token(13, at=4),
         P.min_length(3, eos_id=2)]


def test_greedy_with_processors_and_ragged_prefix_equals_reference(encdec):
    config, model, params, src = encdec
    got = decoding.greedy_decode(model, params, src, max_new_tokens=N_NEW, processors=PROCS,
                                 prefix=PREFIX, prefix_lengths=PREFIX_LEN)
    want_tokens, want_lengths = reference(model, params, src, N_NEW, _edit, PREFIX, PREFIX_LEN)
    np.testing.assert_array_equal(got.tokens, want_tokens)
    np.testing.assert_array_equal(got.lengths, want_lengths)
    # The case is not vacuous: the prefixes are in, something stopped early, and
    # without processors the output differs.
    assert (np.asarray(got.lengths) < N_NEW).any()
    plain = decoding.greedy_decode(model, params, src, max_new_tokens=N_NEW)
    assert not np.array_equal(plain.tokens, got.tokens)


def test_while_loop_and_beam_1_agree_with_greedy(encdec):
    config, model, params, src = encdec
    kw = dict(max_new_tokens=N_NEW, processors=PROCS, prefix=PREFIX, prefix_lengths=PREFIX_LEN)
    scan = decoding.greedy_decode(model, params, src, **kw)
    loop = decoding.greedy_decode(model, params, src, loop="while", **kw)
    best = beam.beam_search(model, params, src, beam_size=1, **kw)
    for other in (loop, best):
        np.testing.assert_array_equal(other.tokens, scan.tokens)
        np.testing.assert_array_equal(other.lengths, scan.lengths)


def test_wide_beam_keeps_prefix_and_suppression(encdec):
    config, model, params, src = encdec
    best = beam.beam_search(model, params, src, max_new_tokens=N_NEW, beam_size=4,
                            processors=PROCS[:1], prefix=PREFIX, prefix_lengths=PREFIX_LEN)
    tokens = np.asarray(best.tokens)
    for row, n in zip(range(4), PREFIX_LEN):
        np.testing.assert_array_equal(tokens[row, :n], PREFIX[row, :n])
    assert not np.isin(tokens, [3, 11]).any()
    assert np.isfinite(np.asarray(best.scores)).all()


def test_sampling_respects_prefix_and_processors(encdec):
    config, model, params, src = encdec
    got = decoding.sample(model, params, src, max_new_tokens=N_NEW, rng=jax.random.PRNGKey(4),
                          temperature=2.0, processors=PROCS[:2] + [P.min_length(N_NEW + 1, 2)],
                          prefix=PREFIX, prefix_lengths=PREFIX_LEN)
    tokens = np.asarray(got.tokens)
    for row, n in zip(range(4), PREFIX_LEN):
        np.testing.assert_array_equal(tokens[row, :n], PREFIX[row, :n])
    free = np.arange(N_NEW)[None] >= PREFIX_LEN[:, None]
    assert not np.isin(tokens[free], [3, 11, config.eos_id]).any()
    assert not (tokens[:, 0][PREFIX_LEN == 0] == 12).any()


def test_lm_forced_first_token_equals_a_longer_prompt():
    config = jf.tiny(num_encoder_layers=0, norm="pre")
    model = jf.DecoderOnlyLM(config)
    prompt = jnp.asarray(np.random.default_rng(5).integers(3, 16, (3, 4)), jnp.int32)
    params = model.init(jax.random.PRNGKey(1), prompt)["params"]
    forced = decoding.generate(model, params, prompt, max_new_tokens=6,
                               processors=[P.force_token(9, at=0)])
    longer = decoding.generate(model, params, jnp.concatenate(
        [prompt, jnp.full((3, 1), 9, jnp.int32)], axis=1), max_new_tokens=5)
    assert (np.asarray(forced.tokens)[:, 0] == 9).all()
    np.testing.assert_array_equal(np.asarray(forced.tokens)[:, 1:], longer.tokens)


@pytest.mark.parametrize("kwargs, match", [
    pytest.param(dict(prefix=np.full((2, 32), 5)), "decoder positions", id="prefix_too_long"),
    pytest.param(dict(prefix=np.full((2, 4), 5), max_new_tokens=3), "max_new_tokens",
                 id="prefix_longer_than_output"),
    pytest.param(dict(prefix=np.array([5, 16])), "outside the target vocabulary",
                 id="prefix_id_out_of_range"),
    pytest.param(dict(prefix=np.array([5, 6]), prefix_lengths=np.array([1, 3])),
                 "prefix_lengths", id="bad_lengths"),
    pytest.param(dict(prefix=np.full((3, 2), 5)), "prefix must be", id="wrong_batch"),
    pytest.param(dict(processors=[P.suppress_tokens([40])]), "outside the vocabulary",
                 id="processor_id"),
])
def test_bad_prefix_or_processor_raises_before_compiling(kwargs, match):
    model = jf.Transformer(jf.tiny())
    src = jnp.full((2, 3), 5, jnp.int32)
    args = dict(max_new_tokens=8) | kwargs
    before = dict(decoding.TRACE_COUNTS)
    for fn in (decoding.greedy_decode, lambda *a, **k: beam.beam_search(*a, beam_size=2, **k)):
        with pytest.raises(ValueError, match=match):
            fn(model, {}, src, **args)
    assert dict(decoding.TRACE_COUNTS) == before

"""Beam search: beam 1 is greedy; wider beams find sequences at least as likely."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.decode import beam, api as decoding

N_NEW = 8


@pytest.fixture(scope="module", params=["post", "pre"])
def setup(request):
    config = jf.tiny(norm=request.param)
    model = jf.Transformer(config)
    src = np.random.default_rng(6).integers(3, 16, (4, 7)).astype(np.int32)
    src[2, 4:] = config.pad_id
    src = jnp.asarray(src)
    params = model.init(jax.random.PRNGKey(0), src, src[:, :3])["params"]
    # An EOS bias at which short (EOS early) and long outputs compete, so finished
    # beams and the length penalty both matter (checked in the tests).
    params["decoder"]["out_proj"]["bias"] = params["decoder"]["out_proj"]["bias"].at[
        config.eos_id].add(0.5 if request.param == "post" else -0.5)
    return config, model, params, src


def sequence_log_prob(model, params, src, tokens, lengths):
    """Teacher-forced log-probability of each row's tokens up to its length (a reference)."""
    c = model.config
    tgt = jnp.concatenate([jnp.full((src.shape[0], 1), c.bos_id, jnp.int32), tokens[:, :-1]], 1)
    logits = model.apply({"params": params}, src, tgt, None, jf.causal_mask(tgt.shape[1]))
    log_probs = jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[..., None], -1)[..., 0]
    keep = jnp.arange(tokens.shape[1])[None] < lengths[:, None]
    return np.asarray(jnp.sum(jnp.where(keep, log_probs, 0.0), axis=1))


def test_beam_1_equals_greedy(setup):
    config, model, params, src = setup
    mixed = False
    for delta in np.arange(0.0, 4.0, 0.25):  # more EOS bias: rows stop at different steps
        edited = jax.tree_util.tree_map(lambda x: x, params)
        bias = edited["decoder"]["out_proj"]["bias"]
        edited["decoder"]["out_proj"]["bias"] = bias.at[config.eos_id].add(float(delta))
        greedy = decoding.greedy_decode(model, edited, src, max_new_tokens=N_NEW)
        best = beam.beam_search(model, edited, src, max_new_tokens=N_NEW, beam_size=1)
        np.testing.assert_array_equal(best.tokens, greedy.tokens)
        np.testing.assert_array_equal(best.lengths, greedy.lengths)
        lengths = np.asarray(greedy.lengths)
        mixed |= bool((lengths < N_NEW).any() and (lengths == N_NEW).any())
        if mixed:
            break
    assert mixed  # the comparison covered rows that stop and rows that do not


def test_wider_beam_is_at_least_as_likely_as_greedy_and_scores_are_right(setup):
    config, model, params, src = setup
    greedy = decoding.greedy_decode(model, params, src, max_new_tokens=N_NEW)
    best = beam.beam_search(model, params, src, max_new_tokens=N_NEW, beam_size=4,
                                   length_penalty=0.0)
    best_lp = sequence_log_prob(model, params, src, best.tokens, best.lengths)
    greedy_lp = sequence_log_prob(model, params, src, greedy.tokens, greedy.lengths)
    np.testing.assert_allclose(best.scores, best_lp, atol=1e-4)  # alpha 0: raw log-prob
    assert (best_lp >= greedy_lp - 1e-5).all()
    # Output convention as greedy: PAD after EOS, lengths count through EOS.
    for row, length in zip(np.asarray(best.tokens), np.asarray(best.lengths)):
        if length < N_NEW:
            assert row[length - 1] == config.eos_id and (row[length:] == config.pad_id).all()


def test_segmented_beam_search_equals_one_segment(setup):
    """Beams reorder the past of a chunked cache with the chunk: the same best beam,
    lengths and scores in 8 segments of 2 steps as in one loop (16 steps, 4 beams:
    enough parent changes across folds that a past left unordered gives other
    beams)."""
    config, model, params, src = setup
    one, eight = (beam.beam_search(model, params, src, max_new_tokens=16, beam_size=4,
                                   segments=s) for s in (1, 8))
    np.testing.assert_array_equal(eight.tokens, one.tokens)
    np.testing.assert_array_equal(eight.lengths, one.lengths)
    np.testing.assert_allclose(eight.scores, one.scores, rtol=1e-5, atol=1e-5)


def test_length_penalty_favours_longer_outputs(setup):
    config, model, params, src = setup
    short = beam.beam_search(model, params, src, max_new_tokens=N_NEW, beam_size=4,
                                    length_penalty=0.0)
    long = beam.beam_search(model, params, src, max_new_tokens=N_NEW, beam_size=4,
                                   length_penalty=3.0)
    short_lengths, long_lengths = np.asarray(short.lengths), np.asarray(long.lengths)
    assert (short_lengths < N_NEW).any()  # some best beams finished early
    assert (long_lengths >= short_lengths).all() and (long_lengths > short_lengths).any()
    lp = sequence_log_prob(model, params, src, long.tokens, long.lengths)
    np.testing.assert_allclose(long.scores, lp / ((5.0 + long_lengths) / 6.0) ** 3,
                               atol=1e-4)


@pytest.mark.parametrize("kwargs, match", [
    pytest.param(dict(beam_size=0), "beam_size", id="zero_beams"),
    pytest.param(dict(beam_size=17), "beam_size", id="more_beams_than_vocab"),
    pytest.param(dict(length_penalty=-0.5), "length_penalty", id="negative_penalty"),
    pytest.param(dict(max_new_tokens=0), "max_new_tokens", id="zero_new_tokens"),
])
def test_bad_inputs_raise(kwargs, match):
    config = jf.tiny()
    model = jf.Transformer(config)
    src = jnp.full((2, 3), 5, jnp.int32)
    args = dict(max_new_tokens=3, beam_size=2) | kwargs
    with pytest.raises(ValueError, match=match):
        beam.beam_search(model, {}, src, **args)


@pytest.mark.parametrize("penalty", [float("nan"), float("inf"), -0.5, True])
def test_a_length_penalty_that_is_not_a_finite_number_is_refused(penalty):
    model = jf.Transformer(jf.tiny())
    src = jnp.full((1, 4), 5, jnp.int32)
    params = model.init(jax.random.PRNGKey(0), src, src)["params"]
    with pytest.raises(ValueError, match="length_penalty"):
        jf.beam_search(model, params, src, max_new_tokens=3, beam_size=2,
                       length_penalty=penalty)


@pytest.mark.parametrize("kwargs, match", [
    pytest.param(dict(prefix=jnp.ones((1, 2), jnp.int32)), "prefix", id="a_forced_prefix"),
    pytest.param(dict(src_mask=jnp.ones((1, 1, 1, 4), bool)), "src_mask", id="a_source_mask"),
    pytest.param(dict(max_new_tokens=30), "max_len", id="past_the_positions"),
    pytest.param(dict(prompt_lengths=[5]), "prompt_lengths", id="longer_than_the_prompt"),
])
def test_a_decoder_only_beam_search_refuses_what_it_cannot_take(kwargs, match):
    """Encoder-decoder arguments, and `generate`'s prompt checks, by name."""
    model = jf.DecoderOnlyLM(jf.tiny(num_encoder_layers=0, max_len=32))
    prompt = jnp.full((1, 4), 5, jnp.int32)
    with pytest.raises(ValueError, match=match):
        jf.beam_search(model, {}, prompt, **(dict(max_new_tokens=3, beam_size=2) | kwargs))


def test_prompt_lengths_are_for_a_decoder_only_model():
    with pytest.raises(ValueError, match="prompt_lengths"):
        jf.beam_search(jf.Transformer(jf.tiny()), {}, jnp.full((1, 3), 5, jnp.int32),
                       max_new_tokens=3, beam_size=2, prompt_lengths=[3])

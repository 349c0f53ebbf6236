"""Beam search for Whisper (issue 45) against CTranslate2 and faster-whisper on the
installed tiny model: token ids and average log-probabilities equal to
`ctranslate2.models.Whisper.generate(beam_size=W)` with the timestamp rules, the text
and segment timestamps of `faster_whisper.WhisperModel.transcribe(beam_size=5)`, and
beam 5 choosing other tokens than greedy decoding. Two windows a batch throughout:
the pipeline test reuses the generate test's compiled program."""

import jax
import numpy as np
import pytest

from jaxformer.decode.loop import TRACE_COUNTS
from jaxformer.models import whisper

from conftest import REPO, whisper_ct2_runtime
from model_files import whisper_model_dir

FOX = f"{REPO}/tests/data/fox_espeak.wav"
SR = whisper.SAMPLE_RATE


@pytest.fixture(scope="module")
def tiny():
    model_dir = whisper_model_dir()
    return whisper.load(model_dir), model_dir, whisper_ct2_runtime(model_dir)


def _two_sentences():
    x = whisper.read_wav(FOX)
    return np.concatenate([x, np.zeros(SR, np.float32), 0.8 * x])


def _clips():
    """The two sentences, and the clip reversed then forward (where beams differ)."""
    x = whisper.read_wav(FOX)
    return [_two_sentences(), np.concatenate([x[::-1], x])]


def _generate(w, features, prompt, beam_size, length_penalty=1.0):
    return whisper.generate(w.model, w.params, list(w.vocab), features, [prompt] * 2,
                            suppress_ids=w.suppress_ids, suppress_ids_begin=w.suppress_ids_begin,
                            beam_size=beam_size, length_penalty=length_penalty)


@pytest.mark.parametrize("beam_size", [5, 2])
def test_beam_ids_and_logprobs_are_ctranslate2s(tiny, beam_size):
    import ctranslate2  # noqa: PLC0415 (whisper_ct2_runtime skips without it)

    w, _, runtime = tiny
    vocab, t = list(w.vocab), whisper.tokens_of(list(w.vocab))
    prompt = whisper.prompt_ids(vocab, None, timestamps=True)
    features = np.stack([whisper.features_of(x) for x in _clips()])
    traced = TRACE_COUNTS["whisper_beam"]
    ours = _generate(w, features, prompt, beam_size)
    theirs = runtime.generate(
        ctranslate2.StorageView.from_array(np.ascontiguousarray(features.transpose(0, 2, 1))),
        [prompt] * 2, beam_size=beam_size, max_length=224, return_scores=True,
        return_no_speech_prob=True)
    for g, ref in zip(ours, theirs):
        n = len(ref.sequences_ids[0])
        assert g.ids == ref.sequences_ids[0]
        # ctranslate2's score: the summed log-probability / n ** length_penalty (1).
        np.testing.assert_allclose(g.avg_logprob, ref.scores[0] * n / (n + 1), atol=1e-4)
        np.testing.assert_allclose(g.no_speech_prob, ref.no_speech_prob, atol=1e-5)
        assert any(i >= t.timestamp_begin for i in g.ids)
    # Another call of the same shape reuses the compiled program.
    assert _generate(w, features, prompt, beam_size) == ours
    assert TRACE_COUNTS["whisper_beam"] - traced <= 1
    if beam_size == 5:  # beam search is not greedy decoding here
        greedy = _generate(w, features, prompt, 1)
        assert [g.ids for g in greedy] != [g.ids for g in ours]
        assert all(b.avg_logprob >= g.avg_logprob - 1e-6 for b, g in zip(ours, greedy))


def test_beams_past_the_first_cache_segment_are_ctranslate2s(tiny, monkeypatch):
    """A self-attention cache of 4 slots first (`beam_program(first_segment=4)`): every
    step after the fourth reads the slots written before as the cache's past, which the
    beams reorder too; ids, scores and no-speech probabilities stay CTranslate2's."""
    import functools  # noqa: PLC0415

    import ctranslate2  # noqa: PLC0415

    from jaxformer.models.whisper import decoding  # noqa: PLC0415

    w, _, runtime = tiny
    prompt = whisper.prompt_ids(list(w.vocab), None, timestamps=True)
    features = np.stack([whisper.features_of(x) for x in _clips()])
    monkeypatch.setattr(decoding, "beam_program",
                        functools.partial(decoding.beam_program, first_segment=4))
    ours = _generate(w, features, prompt, 5)
    theirs = runtime.generate(
        ctranslate2.StorageView.from_array(np.ascontiguousarray(features.transpose(0, 2, 1))),
        [prompt] * 2, beam_size=5, max_length=224, return_scores=True,
        return_no_speech_prob=True)
    for g, ref in zip(ours, theirs):
        n = len(ref.sequences_ids[0])
        assert n > 4 and g.ids == ref.sequences_ids[0]
        np.testing.assert_allclose(g.avg_logprob, ref.scores[0] * n / (n + 1), atol=1e-4)
        np.testing.assert_allclose(g.no_speech_prob, ref.no_speech_prob, atol=1e-5)
    assert whisper.beam_segments(224, 4) == (4, 220) and whisper.beam_segments(20) == (20,)


def test_transcribe_with_beam_5_is_faster_whispers(tiny):
    faster_whisper = pytest.importorskip("faster_whisper", reason="needs the test extra")
    w, model_dir, _ = tiny
    reference = faster_whisper.WhisperModel(model_dir, device="cpu", compute_type="float32",
                                            cpu_threads=1)
    clips = [whisper.read_wav(FOX), _two_sentences()]  # no fallback: sampling differs
    ours = whisper.transcribe(w, clips, timestamps=True,  # beam_size=5: the default
                              condition_on_previous_text=False)  # as the reference
    for clip, result in zip(clips, ours):
        segments, _ = reference.transcribe(clip, beam_size=5, language="en",
                                           condition_on_previous_text=False)
        theirs = list(segments)
        assert result.text == "".join(s.text for s in theirs).strip()
        assert [(s.start, s.end, s.text) for s in result.segments] == [
            (round(s.start, 3), round(s.end, 3), s.text.strip()) for s in theirs]
    # Files of other lengths: nothing traced again (one program per batch shape; the
    # log-mel features are one program too, whatever the length of a file's last window).
    traced = []
    recording = [True]
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: recording[0] and traced.append(name))
    try:
        again = whisper.transcribe(w, [np.concatenate([np.zeros(SR // 2, np.float32), c])
                                      for c in clips], timestamps=True)
    finally:
        recording[0] = False
    assert all("lazy dog" in r.text for r in again)
    assert "/jax/core/compile/jaxpr_trace_duration" not in traced, traced


@pytest.mark.parametrize("options, message", [
    ({"beam_size": 0}, "beam_size must be an int >= 1"),
    ({"beam_size": 2.0}, "beam_size must be an int >= 1"),
    ({"patience": 0.0}, "patience must be a finite number > 0"),
    ({"length_penalty": float("inf")}, "length_penalty must be a finite number"),
])
def test_beam_options_out_of_range_are_named(tiny, options, message):
    w, _, _ = tiny
    with pytest.raises(ValueError, match=message):
        whisper.transcribe(w, FOX, **options)


def test_finished_slots_take_the_next_candidates_that_are_not_eos():
    """CTranslate2's loop by hand: the m-th finished slot continues with the m-th
    non-EOS candidate after the first W; none left, it keeps its own."""
    eos = np.array([[True, False, True, False, False, True, False, False],
                    [True, True, True, True, True, True, True, False]])
    slots = whisper.beam_replacements(eos, eos[:, :4], 4)
    assert np.asarray(slots).tolist() == [[4, 1, 6, 3], [7, 1, 2, 3]]
    last = np.ones((1, 2), bool)  # the last step: every slot finishes
    assert np.asarray(whisper.beam_replacements(np.zeros((1, 4), bool), last, 2)
                      ).tolist() == [[2, 3]]


@pytest.mark.parametrize("length_penalty, best", [(1.0, 0), (0.0, 1)])
def test_best_of_samples_is_chosen_by_ctranslate2s_score(length_penalty, best):
    """faster-whisper keeps CTranslate2's first hypothesis: the highest summed
    log-probability / length ** length_penalty, not the highest average over
    length + 1 (which would pick the short sample here at length penalty 1)."""
    params = {"stem": {"conv_0": {"kernel": np.zeros((3, 80, 4))}}}
    windows = whisper.Windows(whisper.Whisper(None, params, (), (), (), False), [], [], 1,
                              length_penalty=length_penalty)
    long_sample = whisper.Generated(list(range(10)), 0.1, -0.5)  # sum -5.5: -0.55 a token
    short = whisper.Generated([1, 2], 0.1, -0.45)  # sum -1.35: -0.675 a token
    samples = [long_sample, short]
    assert max(samples, key=windows.rank) is samples[best]
    assert short.avg_logprob > long_sample.avg_logprob


def test_top_candidates_are_top_k_of_the_flattened_candidates_ties_included():
    """Each beam's k best, then the best of those: the values and flat indices of one
    `lax.top_k` over all W * V candidates, in its order (rounded values: many ties)."""
    logp_BWV = np.round(jax.random.normal(jax.random.PRNGKey(0), (3, 5, 997)), 1)
    values, flat = whisper.top_candidates(jax.numpy.asarray(logp_BWV), 10)
    want_values, want_flat = jax.lax.top_k(logp_BWV.reshape(3, -1), 10)
    assert np.asarray(flat).tolist() == np.asarray(want_flat).tolist()
    assert np.asarray(values).tolist() == np.asarray(want_values).tolist()


def test_the_beam_program_sorts_no_vocabulary_sized_array():
    """XLA:CPU compiled one `top_k` over the W * V candidates, its results sliced, as a
    sort of all W * V of them: 55 ms of a 60 ms beam step for Whisper tiny. The
    compiled program (a small random Whisper, memory given) keeps XLA's TopK per
    beam and sorts only W * 2W candidates."""
    from jaxformer.nn.model import Transformer  # noqa: PLC0415
    from jaxformer.nn.stems import ConvStem  # noqa: PLC0415

    vocab, width, d = 4000, 4, 16
    config = whisper.whisper_config(vocab_size=vocab, d_model=d, num_heads=2, d_ff=32,
                                    encoder_layers=1, decoder_layers=1, encoder_len=8,
                                    decoder_len=16, pad_id=0, bos_id=1, eos_id=0)
    model = Transformer(config, stem=ConvStem(config))
    params = jax.eval_shape(lambda: model.init(
        jax.random.PRNGKey(0), np.zeros((1, 16, 80), np.float32),
        np.zeros((1, 4), np.int32))["params"])
    hlo = whisper.beam_program.lower(
        model, params, jax.ShapeDtypeStruct((1, 8, d), np.float32), None, max_new_tokens=6,
        processors=(), no_speech_id=2, beam_size=width, max_candidates=width,
        length_penalty=1.0).compile().as_text()
    sorts = [line for line in hlo.splitlines() if " sort(" in line]
    assert sorts and all(f"{width * vocab}]" not in line and f",{vocab}]" not in line
                         for line in sorts), sorts
    assert "TopK" in hlo

"""`hallucination_silence_threshold` (`jaxformer.models.whisper.hallucination`) against
faster-whisper's on the same CTranslate2 files: both decoders are scripted to return
the clip's tokens plus an invented segment in the noise after it (the tiny model does
not invent one on its own on a short clip), and the rule, run by each library on its
own word timings, must keep and drop the same segments; without the threshold the
invented segment stays (must differ). The rule's pieces are checked on hand-made
words; bad values are refused by name."""

import types

import numpy as np
import pytest

from jaxformer.models import whisper
from jaxformer.models.whisper import hallucination
from jaxformer.models.whisper import windows as windows_lib

FOX = "tests/data/fox_espeak.wav"
SR = 16000
INVENTED = " Banana telescope umbrella."


@pytest.fixture(scope="module")
def models(whisper_and_faster):
    return whisper_and_faster


@pytest.fixture(scope="module")
def audio():
    """The clip, then 40 s of low noise (the first window is a full 30 s)."""
    rng = np.random.default_rng(0)
    fox = whisper.read_wav(FOX)
    return np.concatenate([fox, rng.normal(0, 3e-3, 40 * SR)]).astype(np.float32)


@pytest.fixture(scope="module")
def script(models, audio):
    """The ids each decoder returns: for the first window, faster-whisper's greedy
    tokens of the clip's sentence and `INVENTED` timed 10 s to 12 s; every later window
    is no speech."""
    w, reference = models
    segments, _ = reference.transcribe(audio, beam_size=1, temperature=0.0,
                                       condition_on_previous_text=False)
    ids = list(next(iter(segments)).tokens)  # <|0.00|> The quick ... dog. <|3.xx|>
    begin = whisper.tokens_of(list(w.vocab)).timestamp_begin
    return ids + [begin + 500, *whisper.encode_text(w, INVENTED), begin + 600]


def ours(w, audio, script, threshold, monkeypatch):
    calls = []

    def scripted(model, params, vocab, features, prompts, **kwargs):
        calls.append(len(prompts))
        first = len(calls) == 1
        return [whisper.Generated(list(script) if first else [],
                                  0.01 if first else 0.99, -0.2 if first else -5.0)
                for _ in prompts]

    monkeypatch.setattr(windows_lib.decoding, "generate", scripted)
    result = whisper.transcribe(w, audio, word_timestamps=True, temperature=0.0, beam_size=1,
                                condition_on_previous_text=False,
                                hallucination_silence_threshold=threshold)
    return [(s.text, [x.word for x in s.words]) for s in result.segments], result


def theirs(reference, audio, script, threshold, monkeypatch):
    calls = []

    def scripted(encoder_output, prompt, tokenizer, options):
        calls.append(1)
        first = len(calls) == 1
        result = types.SimpleNamespace(sequences_ids=[list(script) if first else []],
                                       no_speech_prob=0.01 if first else 0.99)
        return result, (-0.2 if first else -5.0), 0.0, 1.0

    monkeypatch.setattr(reference, "generate_with_fallback", scripted)
    segments, _ = reference.transcribe(audio, beam_size=1, temperature=0.0,
                                       word_timestamps=True, condition_on_previous_text=False,
                                       hallucination_silence_threshold=threshold)
    segments = list(segments)
    return [(s.text.strip(), [x.word for x in s.words]) for s in segments], segments


@pytest.mark.parametrize("threshold", [None, 2.0], ids=["off", "2s"])
def test_kept_segments_are_faster_whispers(threshold, models, audio, script, monkeypatch):
    w, reference = models
    mine, result = ours(w, audio, script, threshold, monkeypatch)
    expected, segments = theirs(reference, audio, script, threshold, monkeypatch)
    assert mine == expected
    invented = any(INVENTED.strip() == text for text, _ in mine)
    assert invented == (threshold is None)  # must differ: the rule drops it
    np.testing.assert_allclose([s.start for s in result.segments],
                               [s.start for s in segments], atol=0.1)


def word(start, end, probability=0.9, text=" word"):
    return whisper.Word(text, start, end, probability)


def test_the_anomaly_score_is_the_rule():
    """openai-whisper's scores by hand: improbable 1, 0.033 s short 1.5, 3 s long 1."""
    assert hallucination.word_anomaly_score(word(0, 0.5, 0.1)) == 1.0
    assert hallucination.word_anomaly_score(word(0, 0.1)) == pytest.approx(0.495)
    assert hallucination.word_anomaly_score(word(0, 3.0)) == pytest.approx(1.0)
    assert hallucination.word_anomaly_score(word(0, 0.5)) == 0.0
    assert hallucination.is_segment_anomaly([word(0, 0.5, 0.1), word(0.5, 1, 0.1)])
    assert not hallucination.is_segment_anomaly([word(0, 0.5, 0.1), word(0.5, 1)])
    assert not hallucination.is_segment_anomaly([])
    punctuated = [word(0, 0.5, 0.1), word(0.5, 0.51, 0.9, ".")]  # "." is not counted
    assert hallucination.is_segment_anomaly(punctuated)
    # only the first 8 words count: 2 good then 6 improbable is an anomaly, 8 good
    # then 10 improbable is not
    assert hallucination.is_segment_anomaly([word(0, 0.5)] * 2 + [word(1, 1.5, 0.1)] * 6)
    assert not hallucination.is_segment_anomaly([word(0, 0.5)] * 8 + [word(1, 1.5, 0.1)] * 10)


def test_leading_silence_is_skipped_and_isolated_anomalies_dropped():
    good = [word(5.0, 5.5), word(5.5, 6.0)]
    bad = [word(20.0, 20.5, 0.05), word(20.5, 21.0, 0.05)]
    segments = [(5.0, 6.0, [1], good), (20.0, 21.0, [2], bad)]
    kept, seek, redo = hallucination.skip_hallucinations(segments, 2.0, 0, 3000, 0.0, 6000)
    assert (kept, seek, redo) == (segments[:1], 2000, False)  # cut at its start
    first_bad = [(4.0, 5.0, [2], bad), (6.0, 7.0, [1], good)]
    assert hallucination.skip_hallucinations(first_bad, 2.0, 0, 3000, 0.0, 6000) == (
        [], 400, True)  # decoded again from 4 s
    assert hallucination.skip_hallucinations(segments, 20.0, 0, 3000, 0.0, 6000) == (
        segments, None, False)  # no gap long enough
    late = [segments[0], (27.5, 28.5, [2], [word(27.5, 28.0, 0.05), word(28.0, 28.5, 0.05)])]
    assert hallucination.skip_hallucinations(late, 2.0, 0, 3000, 0.0, 3000) == (
        late[:1], 3000, False)  # less than 2 s after it: the file is done
    short = [segments[0], (15.0, 16.0, [2], [word(15.0, 15.5, 0.05), word(15.5, 16.0, 0.05)])]
    assert hallucination.skip_hallucinations(short, 2.0, 0, 1750, 0.0, 1750) == (
        short, None, False)  # the window's audio ends 1.5 s after it: no silence after


@pytest.mark.parametrize("value", [-1.0, float("nan"), "2", True])
def test_bad_thresholds_are_named(value, models):
    w, _ = models
    with pytest.raises(ValueError, match="hallucination_silence_threshold must be None"):
        whisper.transcribe(w, np.zeros(SR, np.float32), word_timestamps=True,
                           hallucination_silence_threshold=value)


def test_the_threshold_needs_word_timestamps(models):
    w, _ = models
    with pytest.raises(ValueError, match="needs word_timestamps=True"):
        whisper.transcribe(w, np.zeros(SR, np.float32), hallucination_silence_threshold=1.0)


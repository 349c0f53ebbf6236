"""`initial_prompt` and conditioning on the previous windows' text
(`jaxformer.models.whisper.prompt`), against faster-whisper on the same CTranslate2
files (greedy, beam 1, temperature 0): equal text and segments over a minute of
the committed clip repeated with quiet noise between the sentences, for each
setting; and the settings change the text (the prompt is really read)."""

import numpy as np
import pytest

from jaxformer.models import whisper
from jaxformer.models.whisper import Context, conditioned, encode_text

from model_files import whisper_model_dir

FOX = "tests/data/fox_espeak.wav"
SR = 16000


@pytest.fixture(scope="module")
def models(whisper_and_faster):
    """(jaxformer's Whisper, faster-whisper's model): conftest's, loaded once."""
    return whisper_and_faster


@pytest.fixture(scope="module")
def minute():
    """The sentence 14 times at random gains, 0.5 to 1.5 s apart: 60 s, with quiet
    noise throughout (digital silence, which jaxformer skips without decoding while
    faster-whisper decodes it, would make the two differ for that reason alone)."""
    fox, rng = whisper.read_wav(FOX), np.random.default_rng(0)
    parts = []
    for i in range(14):
        if i:
            parts.append(np.zeros(int(SR * (0.5 + rng.random())), np.float32))
        parts.append(fox * np.float32(0.6 + 0.4 * rng.random()))
    signal = np.concatenate(parts)
    return signal + rng.normal(0, 1e-3, len(signal)).astype(np.float32)


def ours_of(w, audio, timestamps=True, **options):
    return whisper.transcribe(w, audio, timestamps=timestamps, temperature=0.0, beam_size=1,
                              **options)


def both(models, audio, timestamps=True, **options):
    w, reference = models
    ours = ours_of(w, audio, timestamps, **options)
    segments, _ = reference.transcribe(audio, beam_size=1, best_of=1, temperature=0.0,
                                       without_timestamps=not timestamps, **options)
    return ours, list(segments)


def assert_same(ours, theirs):
    """Equal text and segment count; boundaries within 0.1 s (one timestamp of the
    conditioned run is a near tie: 47.5 s against faster-whisper's 47.4 s, the
    text and every other boundary equal)."""
    assert ours.text == "".join(s.text for s in theirs).strip()
    assert len(ours.segments) == len(theirs)
    np.testing.assert_allclose([(s.start, s.end) for s in ours.segments],
                               [(s.start, s.end) for s in theirs], atol=0.1 + 1e-6)


SETTINGS = {
    "conditioned": dict(condition_on_previous_text=True),
    "prompt-conditioned": dict(initial_prompt="Quick brown fox.",
                               condition_on_previous_text=True),
    "prompt-only": dict(initial_prompt="Jumping foxes and sleepy dogs.",
                        condition_on_previous_text=False),
}


@pytest.fixture(scope="module")
def texts():
    """{setting: our text of the minute}, filled by the test below (a minute's transcript
    is 4-10 s of CPU: the must-differ test reuses them rather than decoding them again)."""
    return {}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_text_and_segments_equal_faster_whispers(name, models, minute, texts):
    ours, theirs = both(models, minute, **SETTINGS[name])
    texts[name] = ours.text
    assert_same(ours, theirs)
    assert len(ours.segments) >= 2 and ours.segments[-1].end > 30  # several windows


def test_the_settings_change_the_text(models, minute, texts):
    """Must differ: without the prompt (and without the previous text) the same audio
    gives other text, so the equalities above test what the prompt does."""
    w = models[0]
    for name, options in SETTINGS.items():
        if name not in texts:  # (run alone)
            texts[name] = ours_of(w, minute, **options).text
    plain = ours_of(w, minute, condition_on_previous_text=False).text
    assert len({plain, *(texts[name] for name in SETTINGS)}) == 4


def test_conditioning_without_timestamps_equals_faster_whisper(models, minute):
    ours, theirs = both(models, minute, timestamps=False, initial_prompt="Quick brown fox.")
    assert ours.text == "".join(s.text for s in theirs).strip()


def test_the_prompt_is_faster_whispers():
    """The tokens: " " + text through tokenizer.json (faster-whisper's `Tokenizer`), the
    last 223 previous ids after <|startofprev|>, reset after a hot window."""
    faster_whisper = pytest.importorskip("faster_whisper.tokenizer", reason="needs the test extra")
    tokenizers = pytest.importorskip("tokenizers")
    model_dir = whisper_model_dir()
    w = whisper.load(model_dir)
    hf = tokenizers.Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    tok = faster_whisper.Tokenizer(hf, w.multilingual, task="transcribe", language="en")
    assert encode_text(w, "  Hello, JAX!  ") == tok.encode(" Hello, JAX!")
    assert encode_text(w, [1, 2, 3]) == [1, 2, 3]
    sot_prev = list(w.vocab).index("<|startofprev|>")
    assert sot_prev == tok.sot_prev
    previous = list(range(300))
    assert conditioned(previous, [9, 8], sot_prev) == [sot_prev, *range(77, 300), 9, 8]
    assert conditioned([], [9, 8], sot_prev) == [9, 8]
    ctx = Context(w.vocab, [[5]], condition=True)
    ctx.add(0, [[6, 7]], 0.4)
    assert ctx.prompt(0, [9]) == [sot_prev, 5, 6, 7, 9]
    ctx.add(0, [[1]], 0.6)  # above 0.5: forgotten
    assert ctx.prompt(0, [9]) == [9]
    off = Context(w.vocab, [[5]], condition=False)
    off.add(0, [[6]], 0.0)
    assert off.prompt(0, [9]) == [9]


@pytest.mark.parametrize("prompt, message", [
    ([1, 2, 10 ** 6], "initial_prompt ids"), ([True], "initial_prompt ids")])
def test_bad_prompts_are_named(models, prompt, message):
    with pytest.raises(ValueError, match=message):
        whisper.transcribe(models[0], np.zeros(SR, np.float32), initial_prompt=prompt)


def test_beam_search_after_previous_text_is_ctranslate2s(models):
    """Beam search (one row at a time after a previous-text prompt): the ids, the
    no-speech probability (read where <|startoftranscript|> is fed, not at BOS) and
    the average log-probability of ctranslate2's `generate` with the same prompt."""
    ctranslate2 = pytest.importorskip("ctranslate2", reason="needs the test extra")
    from conftest import whisper_ct2_runtime  # noqa: PLC0415

    w = models[0]
    vocab, t = list(w.vocab), whisper.tokens_of(list(w.vocab))
    features = whisper.features_of(whisper.read_wav(FOX))[None]
    prompt = conditioned(encode_text(w, "Jumping foxes and sleepy dogs."), [t.sot],
                         vocab.index("<|startofprev|>"))
    [ours] = whisper.generate(w.model, w.params, vocab, features, [prompt], beam_size=3,
                              suppress_ids=w.suppress_ids,
                              suppress_ids_begin=w.suppress_ids_begin)
    [theirs] = whisper_ct2_runtime().generate(
        ctranslate2.StorageView.from_array(np.ascontiguousarray(features.transpose(0, 2, 1))),
        [prompt], beam_size=3, return_no_speech_prob=True, return_scores=True,
        suppress_tokens=list(w.suppress_ids), max_length=448)
    ids = theirs.sequences_ids[0]
    assert ours.ids == ids
    assert abs(ours.no_speech_prob - theirs.no_speech_prob) < 1e-4
    assert abs(ours.avg_logprob - theirs.scores[0] * len(ids) / (len(ids) + 1)) < 1e-3

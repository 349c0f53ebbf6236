"""Hugging Face encoder-decoder directories (Whisper, Marian) against `transformers` itself.

`transformers` builds a tiny random float32 WhisperForConditionalGeneration and
MarianMTModel (weights large enough that every block matters, Marian's
final_logits_bias included) and saves them with `save_pretrained`; jaxformer
loads each directory with `jaxformer.models.load`. Logits agree to 1e-5
relative to the largest one; greedy tokens decoded with jaxformer's KV cache
equal a torch greedy loop (Whisper, also with its suppressed tokens, through
`whisper.load`) and transformers' `generate` (Marian). Bad directories are
refused by name before any tensor is read.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.models import load

torch = pytest.importorskip("torch", reason="the reference needs torch")
transformers = pytest.importorskip("transformers", reason="the reference needs transformers")
pytest.importorskip("safetensors", reason="needs the `llm` extra")
pytest.importorskip("tokenizers", reason="needs the `llm` extra")

from jaxformer.interop.flat import CheckpointMismatch  # noqa: E402
from jaxformer.models import hf_encdec, whisper  # noqa: E402

N_NEW = 8
# Whisper's vocabulary layout (text, <|endoftext|>, <|startoftranscript|>, languages,
# tasks, ..., <|notimestamps|>, timestamps) with 40 one-letter text tokens.
TEXT = [chr(c) for c in range(ord("A"), ord("A") + 40)]
SPECIAL = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|translate|>",
           "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nocaptions|>",
           "<|notimestamps|>"]
WHISPER_VOCAB = TEXT + SPECIAL + [f"<|{i * 0.02:.2f}|>" for i in range(1501)]
EOT, SOT = len(TEXT), len(TEXT) + 1
TIMESTAMPS = list(range(len(TEXT) + len(SPECIAL), len(WHISPER_VOCAB)))
SUPPRESS, SUPPRESS_BEGIN = [3, 5, 7, 11, EOT + 3] + TIMESTAMPS, [EOT, 2]


def perturb(model):
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # weights large enough that every block matters
        for name, p in model.named_parameters():
            if "embed_positions" in name and isinstance(model, transformers.MarianMTModel):
                continue  # computed, not saved: the file's reader computes them again
            noise = torch.randn(p.shape, generator=generator)
            p.copy_(p + 0.2 * noise if p.ndim == 1 else 0.3 * noise)
    return model


def write_whisper_tokenizer(directory):
    import tokenizers
    from tokenizers import models

    vocab = {token: i for i, token in enumerate(TEXT)}
    tokenizer = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="A"))
    tokenizer.add_special_tokens(WHISPER_VOCAB[len(TEXT):])
    tokenizer.save(os.path.join(directory, "tokenizer.json"))


@pytest.fixture(scope="module")
def whisper_dir(tmp_path_factory):
    """(directory, torch model): 80 mel bins over 3000 frames, as transcription reads."""
    directory = str(tmp_path_factory.mktemp("whisper"))
    torch.manual_seed(0)
    config = transformers.WhisperConfig(
        vocab_size=len(WHISPER_VOCAB), num_mel_bins=80, d_model=16, encoder_layers=2,
        decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=32, decoder_ffn_dim=32, max_source_positions=1500,
        max_target_positions=32, pad_token_id=EOT, bos_token_id=SOT, eos_token_id=EOT,
        decoder_start_token_id=SOT, begin_suppress_tokens=None)
    model = perturb(transformers.WhisperForConditionalGeneration(config).float().eval())
    model.save_pretrained(directory)
    write_whisper_tokenizer(directory)
    with open(os.path.join(directory, "generation_config.json")) as f:
        generation = json.load(f)
    generation.update(suppress_tokens=SUPPRESS, begin_suppress_tokens=SUPPRESS_BEGIN)
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump(generation, f)
    return directory, model


MARIAN_VOCAB, MARIAN_PAD = 40, 39


@pytest.fixture(scope="module")
def marian_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("marian"))
    torch.manual_seed(0)
    config = transformers.MarianConfig(
        vocab_size=MARIAN_VOCAB, decoder_vocab_size=MARIAN_VOCAB, d_model=16, encoder_layers=2,
        decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
        pad_token_id=MARIAN_PAD, eos_token_id=0, decoder_start_token_id=MARIAN_PAD,
        forced_eos_token_id=None, activation_function="swish", scale_embedding=True)
    model = perturb(transformers.MarianMTModel(config).float().eval())
    with torch.no_grad():
        model.final_logits_bias.copy_(torch.randn(1, MARIAN_VOCAB,
                                                  generator=torch.Generator().manual_seed(2)))
    model.save_pretrained(directory)
    return directory, model


@pytest.fixture(scope="module")
def whisper_loaded(whisper_dir):
    """`jaxformer.models.load` of the directory: (model, params, tokenizer, jitted apply)."""
    model, params, tokenizer = load(whisper_dir[0])
    return model, params, tokenizer, jax.jit(model.apply)


@pytest.fixture(scope="module")
def marian_loaded(marian_dir):
    model, params, tokenizer = load(marian_dir[0])
    return model, params, tokenizer, jax.jit(model.apply)


@pytest.fixture(scope="module")
def features():
    return np.random.default_rng(0).standard_normal((2, 3000, 80)).astype(np.float32)


def relative_error(ours, ref):
    return float(np.abs(np.asarray(ours) - ref).max() / np.abs(ref).max())


def torch_greedy(step_logits, start: int, steps: int, eos: int, suppress=(), begin=()):
    """Greedy ids after `start` from `step_logits(ids (1, T)) -> (V,)`, full recompute."""
    ids = [start]
    for step in range(steps):
        logits = step_logits(torch.tensor([ids])).clone()
        logits[list(suppress)] = -np.inf
        if step == 0:
            logits[list(begin)] = -np.inf
        ids.append(int(logits.argmax()))
        if ids[-1] == eos:
            break
    return ids[1:]


def whisper_step(reference, feats):
    with torch.no_grad():
        encoded = reference.model.encoder(torch.tensor(feats.T[None])).last_hidden_state

    def step(ids):
        with torch.no_grad():
            return reference(encoder_outputs=(encoded,), decoder_input_ids=ids).logits[0, -1]
    return step


def test_whisper_logits_equal_transformers(whisper_dir, whisper_loaded, features):
    reference = whisper_dir[1]
    model, params, tokenizer, forward = whisper_loaded
    assert isinstance(model, jf.Transformer) and tokenizer is not None
    tgt = np.array([[SOT, 3, 4, 5, 6, 7], [SOT, 8, 9, 10, 11, 12]])
    ours = forward({"params": params}, jnp.asarray(features), jnp.asarray(tgt))
    with torch.no_grad():
        ref = reference(input_features=torch.tensor(features.transpose(0, 2, 1)),
                        decoder_input_ids=torch.tensor(tgt)).logits.numpy()
    assert relative_error(ours, ref) < 1e-5


def test_whisper_greedy_and_suppression_through_transcribe(whisper_dir, features):
    """`whisper.load` reads the directory (vocabulary, suppressed tokens); greedy ids
    decoded with the KV cache, Whisper's prompt and suppression equal a torch greedy loop."""
    directory, reference = whisper_dir
    w = whisper.load(directory)
    assert w.vocab == tuple(WHISPER_VOCAB) and not w.multilingual
    assert (w.suppress_ids, w.suppress_ids_begin) == (tuple(SUPPRESS), tuple(SUPPRESS_BEGIN))
    step = whisper_step(reference, features[0])
    prompt = whisper.prompt_ids(list(w.vocab), language=None)  # [sot, notimestamps]
    ids = whisper.generate_ids(w.model, w.params, list(w.vocab), jnp.asarray(features[:1]),
                               [prompt], suppress_ids=w.suppress_ids,
                               suppress_ids_begin=w.suppress_ids_begin,
                               max_text_tokens=N_NEW)[0]

    def prompted(ids_1T):  # the forced <|notimestamps|> after <|startoftranscript|>
        return step(torch.cat([ids_1T[:, :1], torch.tensor([[prompt[1]]]), ids_1T[:, 1:]], 1))
    expected = torch_greedy(prompted, SOT, N_NEW, EOT, SUPPRESS, SUPPRESS_BEGIN)
    assert ids == [i for i in expected if i != EOT] and len(ids) >= 4
    assert expected != torch_greedy(prompted, SOT, N_NEW, EOT)  # the suppression matters


def marian_sources():
    rng = np.random.default_rng(3)
    src = np.full((3, 9), MARIAN_PAD, np.int64)
    for row, n in enumerate((9, 5, 7)):  # ragged, right-padded with PAD
        src[row, :n - 1], src[row, n - 1] = rng.integers(1, MARIAN_PAD, n - 1), 0
    return src


def marian_targets():
    return np.array([[MARIAN_PAD, 3, 4, 5, 6], [MARIAN_PAD, 7, 8, 9, 10],
                     [MARIAN_PAD, 11, 12, 13, 14]])


def test_marian_logits_and_greedy_equal_transformers(marian_dir, marian_loaded):
    reference = marian_dir[1]
    model, params, tokenizer, forward = marian_loaded
    assert tokenizer is None  # SentencePiece files, no tokenizer.json
    src = marian_sources()
    mask = torch.tensor(src != MARIAN_PAD)
    tgt = marian_targets()
    with torch.no_grad():
        ref = reference(input_ids=torch.tensor(src), attention_mask=mask,
                        decoder_input_ids=torch.tensor(tgt)).logits.numpy()
        generated = reference.generate(input_ids=torch.tensor(src), attention_mask=mask,
                                       num_beams=1, do_sample=False, max_new_tokens=N_NEW)
    ours = forward({"params": params}, jnp.asarray(src, jnp.int32), jnp.asarray(tgt))
    assert relative_error(ours, ref) < 1e-5
    out = jf.greedy_decode(model, params, jnp.asarray(src, jnp.int32), max_new_tokens=N_NEW)
    for row, (tokens, length) in enumerate(zip(np.asarray(out.tokens), np.asarray(out.lengths))):
        theirs = generated[row, 1:].tolist()
        theirs = theirs[:theirs.index(0) + 1] if 0 in theirs else theirs
        assert tokens[:int(length)].tolist() == theirs
    assert len({tuple(r) for r in np.asarray(out.tokens)}) > 1  # the sources matter


def test_marian_blocks_matter(marian_loaded):
    """Without final_logits_bias, or with the interleaved sinusoids, the logits differ."""
    _, params, _, forward = marian_loaded
    src = jnp.asarray(marian_sources(), jnp.int32)
    tgt = jnp.asarray(marian_targets())
    base = np.asarray(forward({"params": params}, src, tgt))
    no_bias = dict(params, decoder={**params["decoder"],
                                    "logits_bias": jnp.zeros(MARIAN_VOCAB)})
    from jaxformer.nn.layers import sinusoidal_table
    interleaved = jnp.asarray(sinusoidal_table(32, 16))
    swapped = dict(params, encoder={**params["encoder"], "positions": {
        "embedding": interleaved}}, decoder={**params["decoder"],
                                             "positions": {"embedding": interleaved}})
    for variant in (no_bias, swapped):
        assert relative_error(forward({"params": variant}, src, tgt), base) > 1e-2


@pytest.mark.parametrize("which,changes,field", [
    ("marian", dict(architectures=["BartForConditionalGeneration"]),
     "BartForConditionalGeneration"),
    ("marian", dict(normalize_before=True), "normalize_before"),
    ("marian", dict(decoder_vocab_size=41), "decoder_vocab_size"),
    ("whisper", dict(decoder_ffn_dim=64), "decoder_ffn_dim"),
    ("whisper", dict(activation_function="relu6"), "activation_function"),
])
def test_unsupported_config_is_refused_before_any_tensor_is_read(
        which, changes, field, whisper_dir, marian_dir, hf_dir_copy):
    directory = hf_dir_copy((whisper_dir if which == "whisper" else marian_dir)[0], **changes)
    os.remove(os.path.join(directory, "model.safetensors"))  # never reached
    with pytest.raises(ValueError, match=field):
        load(directory)


def test_wrong_shaped_tensors_are_listed_together(marian_dir, hf_dir_copy):
    from safetensors.numpy import load_file, save_file

    directory = hf_dir_copy(marian_dir[0])
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    tensors["model.encoder.layers.0.self_attn.q_proj.weight"] = np.zeros((8, 16), np.float32)
    tensors["final_logits_bias"] = np.zeros((1, 41), np.float32)
    del tensors["model.decoder.layers.1.fc2.bias"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointMismatch) as error:
        load(directory)
    for name in ("model.encoder.layers.0.self_attn.q_proj.weight", "final_logits_bias",
                 "model.decoder.layers.1.fc2.bias"):
        assert name in str(error.value)


def test_parameters_are_the_checkpoints(marian_loaded, whisper_loaded):
    """Every parameter comes from a named tensor (Marian's positions: computed)."""
    for (model, params, _, _), arch, mel in ((marian_loaded, hf_encdec.MARIAN, 0),
                                             (whisper_loaded, hf_encdec.WHISPER, 80)):
        tables = 2 * 32 * 16 if arch == hf_encdec.MARIAN else 0
        assert jf.count_params(params) == tables + sum(
            np.prod(s) for s in hf_encdec.expected_tensors(model.config, arch, mel).values())


def test_cli_generate_refuses_an_encoder_decoder_in_one_line(marian_dir, capsys):
    from jaxformer.cli.main import main

    assert main(["generate", "--model", marian_dir[0], "hello"]) == 2
    err = capsys.readouterr().err.strip()
    assert "encoder-decoder" in err and len(err.splitlines()) == 1

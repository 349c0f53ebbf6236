"""`save_hf` / `jaxformer export` against `transformers` itself.

The per-architecture round trip (six tiny random transformers models -> jaxformer
-> `save_hf` -> transformers) is in test_hf_dirs.py, on its loaded models; SmolLM2
in test_smollm2.py; the refusal of a CLI-trained run of the LayerNorm presets in
tests/train/test_lm.py. Here: a `--task lm` run directory (scanned layers, byte
tokenizer) exported and read by transformers with the same logits and token
ids, interleaved RoPE rows made half-split, bfloat16 tensors, and bad input:
configs no architecture expresses are refused by field, a non-empty --out is left
untouched, and a failed write leaves nothing behind.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.cli.main import main

torch = pytest.importorskip("torch", reason="the reference needs torch")
transformers = pytest.importorskip("transformers", reason="the reference needs transformers")
pytest.importorskip("safetensors", reason="needs the `llm` extra")
pytest.importorskip("tokenizers", reason="needs the `llm` extra")

from conftest import numpy_params, snapshot  # noqa: E402
from jaxformer.models.hf_export import architecture_of, save_hf  # noqa: E402

TOKENS = jax.ShapeDtypeStruct((1, 1), jnp.int32)
TEXT = "hé ✓ <pad>"  # multi-byte characters, and text that spells a special token


def tiny_llama(**overrides):
    return jf.config.llama(src_vocab_size=259, tgt_vocab_size=259, max_len=16, num_kv_heads=2,
                           **overrides)


def torch_logits(directory, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        return type(model).__name__, model(torch.tensor([list(ids)])).logits[0].numpy()


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    """(run directory, DecoderOnlyLM, params) of a `--task lm` run of a Llama-expressible
    model with scanned layers and the byte tokenizer; its checkpoint holds random params."""
    from jaxformer.train.checkpoint import Checkpoints
    from jaxformer.train import train_functions, TrainConfig

    config = tiny_llama(scan_layers=True, tie_output_embedding=False)
    train = TrainConfig(task="lm", data=("unused",), seq_len=16, steps=2, batch_size=2,
                        warmup_steps=0)
    out = str(tmp_path_factory.mktemp("runs") / "llama")
    os.makedirs(out)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({"preset": None, "model": config.to_dict(), "train": train.to_dict()}, f)
    model = jf.DecoderOnlyLM(config)
    params = numpy_params(model, TOKENS)
    abstract = jax.eval_shape(train_functions(config, train).init, 0)  # nothing compiled
    state = jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype), abstract).replace(
        params=params)
    with Checkpoints(os.path.join(out, "checkpoints")) as checkpoints:
        checkpoints.save(2, state)
    return out, model, params


def test_a_run_exports_to_transformers_with_its_logits_and_tokens(llama_run, tmp_path, capsys):
    from jaxformer.text import ByteTokenizer

    from jaxformer.train.run_lock import RunLock

    run, model, params = llama_run
    out = str(tmp_path / "hf")
    with RunLock(run):  # a reader: it works while a `train` holds the run (issue 47)
        assert main(["export", "--run", run, "--out", out]) == 0
    assert "LlamaForCausalLM" in capsys.readouterr().out
    ids = ByteTokenizer().encode_prompt(TEXT)  # BOS + bytes, as the run trained
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.encode(TEXT) == ids.tolist()
    assert tokenizer.decode(ids, skip_special_tokens=True) == TEXT
    name, want = torch_logits(out, ids)
    got = np.asarray(jax.jit(model.apply)({"params": params}, jnp.asarray(ids[None]))[0])
    assert name == "LlamaForCausalLM"
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_interleaved_rope_is_written_half_split_and_bfloat16_on_request(make_lm, tmp_path):
    """Interleaved rows (a GGUF read with rope="interleaved") are permuted to Hugging Face's
    half-split order: transformers computes jaxformer's function. bfloat16 tensors are the
    float32 ones rounded."""
    from safetensors.numpy import load_file

    config = tiny_llama(rope="interleaved", qk_norm=True)
    model, params = make_lm(config)
    out = save_hf(config, params, tmp_path / "qwen3")
    ids = np.random.default_rng(0).integers(3, 259, 12)
    name, want = torch_logits(out, ids)
    got = np.asarray(jax.jit(model.apply)({"params": params}, jnp.asarray(ids[None]))[0])
    assert name == "Qwen3ForCausalLM"
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    half = load_file(os.path.join(out, "model.safetensors"))
    bf16 = load_file(os.path.join(save_hf(config, params, tmp_path / "bf16", dtype="bfloat16"),
                                  "model.safetensors"))
    assert {k: v.dtype.name for k, v in bf16.items()} == {k: "bfloat16" for k in half}
    for key, value in half.items():
        np.testing.assert_array_equal(bf16[key], value.astype(bf16[key].dtype))
    with open(os.path.join(tmp_path / "bf16", "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"


def test_a_hugging_face_directory_exports_to_the_same_tensors_and_chat_template(llama_run,
                                                                                tmp_path):
    """`export --model DIR` of a directory `save_hf` wrote (from scanned-layout params):
    the same tensors, and its chat template carried into tokenizer_config.json."""
    from safetensors.numpy import load_file

    from jaxformer.text import byte_tokenizer

    _, model, params = llama_run
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    first = save_hf(model.config, params, tmp_path / "first", tokenizer=byte_tokenizer(),
                    chat_template=template)
    second = str(tmp_path / "second")
    assert main(["export", "--model", first, "--out", second]) == 0
    want, got = (load_file(os.path.join(d, "model.safetensors")) for d in (first, second))
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key])
    tokenizer = transformers.AutoTokenizer.from_pretrained(second)
    chat = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(chat, tokenize=False) == "[user] hi\n"


@pytest.mark.parametrize("config,arch", [
    (tiny_llama(), "LlamaForCausalLM"),
    (tiny_llama(sliding_window=4), "MistralForCausalLM"),
    (tiny_llama(attention_biases="qkv"), "Qwen2ForCausalLM"),
    (tiny_llama(qk_norm=True, sliding_window=4, attention_pattern="LG"), "Qwen3ForCausalLM"),
    (tiny_llama(norm="sandwich", norm_scale_plus_one=True, scale_embeddings=True),
     "Gemma2ForCausalLM"),
])
def test_the_architecture_is_the_one_the_blocks_name(config, arch):
    assert architecture_of(config) == arch


@pytest.mark.parametrize("config,field", [
    (jf.config.lm(), "norm_type"),  # `train --task lm`'s default: LayerNorm, positions
    (tiny_llama(norm="post"), "norm"),
    (tiny_llama(decoder_positions="learned"), "decoder_positions"),
    (tiny_llama(activation="relu"), "activation"),
    (tiny_llama(sliding_window=4, attention_pattern="LG"), "sliding_window"),
    (tiny_llama(tie_output_embedding=False, output_bias=True), "output_bias"),
    (tiny_llama(num_encoder_layers=2), "num_encoder_layers"),
])
def test_an_inexpressible_config_is_refused_by_field_before_writing(tmp_path, config, field):
    """The config is refused before the parameters are looked at (none are given)."""
    with pytest.raises(ValueError, match=rf"TransformerConfig\.{field}="):
        save_hf(config, {}, tmp_path / "out")
    assert os.listdir(tmp_path) == []


def test_a_non_empty_out_is_refused_and_left_untouched(llama_run, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    before = snapshot(out)
    assert main(["export", "--run", llama_run[0], "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "not empty" in err and len(err.strip().splitlines()) == 1
    assert snapshot(out) == before and os.listdir(tmp_path) == ["mine"]


def test_a_failed_write_leaves_nothing(llama_run, tmp_path, monkeypatch):
    import safetensors.numpy

    def disk_full(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(safetensors.numpy, "save_file", disk_full)
    _, model, params = llama_run
    with pytest.raises(OSError, match="No space"):
        save_hf(model.config, params, tmp_path / "hf")
    assert os.listdir(tmp_path) == []

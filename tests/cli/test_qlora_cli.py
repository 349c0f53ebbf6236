"""QLoRA from the command line: `jaxformer train --init SmolLM2.gguf --lora 8 --quantize
keep` trains adapters on the file's own Q4_1 blocks (frozen integers), and `export --run`
writes the dequantized, merged float model that transformers reads with the adapted
model's logits, saying on stdout that it dequantized. Bad combinations are one line.
(The library side, losses against LoRA on the dequantized base: tests/train/test_qlora.py.)
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.cli.main import main
from jaxformer.train.run import Run
from jaxformer.nn import lora
from jaxformer.train import train_functions
from jaxformer.train.checkpoint import Checkpoints

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs")
SEQ, BATCH, STEPS = 32, 2, 2


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    with open(os.path.join(DOCS, "training.md")) as f:
        (folder / "train.txt").write_text(f.read()[:2000])
    return str(folder / "train.txt")


def train_args(path, corpus, out, *extra):
    return ["train", "--task", "lm", "--init", path, "--data", corpus, "--seq-len", str(SEQ),
            "--batch", str(BATCH), "--steps", str(STEPS), "--warmup", "0", "--lr", "2e-3",
            "--scan-layers", "--samples", "0", "--no-progress", "--out", out, *extra]


@pytest.fixture(scope="module")
def qlora_run(smollm2, corpus, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("qlora") / "run")
    assert main(train_args(smollm2[3], corpus, out, "--lora", "8", "--quantize", "keep")) == 0
    run = Run.open(out)
    config, train = run.model_config, run.train_config
    with Checkpoints(os.path.join(out, "checkpoints")) as checkpoints:
        state = checkpoints.restore(train_functions(config, train).abstract_state())
    return out, config, state


def test_the_run_trains_adapters_on_the_files_q4_1_blocks(smollm2, qlora_run):
    _, config, state = qlora_run
    assert config.weight_quant == "int4" and config.lora_rank == 8
    adapters, base = lora.split_adapters(state.params)
    query = base["decoder"]["layers"]["self_attn"]["query"]
    assert query["kernel_q"].dtype == jnp.uint8 and "kernel" not in query
    assert any(np.any(np.asarray(b) != 0) for b in jax.tree_util.tree_leaves(adapters))


def test_export_dequantizes_merges_and_says_so(smollm2, qlora_run, tmp_path, capsys):
    transformers = pytest.importorskip("transformers", reason="the reference needs it")
    import torch
    from tokenizers import Tokenizer

    run, config, state = qlora_run
    out = str(tmp_path / "hf")
    capsys.readouterr()
    assert main(["export", "--run", run, "--out", out]) == 0
    assert "dequantized from int4" in capsys.readouterr().out
    prompt = Tokenizer.from_file(os.path.join(run, "tokenizer.json")).encode(
        "QLoRA trains").ids
    want = np.asarray(jax.jit(jf.DecoderOnlyLM(config).apply)(
        {"params": state.params}, jnp.array([prompt], jnp.int32))[0])
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        got = exported(torch.tensor([prompt])).logits[0].numpy()
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_generate_refuses_requantizing_the_quantized_run(qlora_run, capsys):
    capsys.readouterr()
    assert main(["generate", "--run", qlora_run[0], "--quantize", "int8", "Hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already quantized" in err[0], err


def test_quantize_without_lora_is_one_line(smollm2, corpus, tmp_path, capsys):
    capsys.readouterr()
    assert main(train_args(smollm2[3], corpus, str(tmp_path / "r"), "--quantize", "int8")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--quantize int8 freezes the base as integers: it needs --lora" \
        in err[0], err
    assert not os.path.exists(tmp_path / "r")


def test_quantize_without_init_is_one_line(corpus, tmp_path, capsys):
    capsys.readouterr()
    assert main(["train", "--task", "lm", "--data", corpus, "--quantize", "int4",
                 "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--quantize needs --init and --lora" in err[0], err

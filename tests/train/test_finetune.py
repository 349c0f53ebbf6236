"""Fine-tuning a pretrained LM (SmolLM2-135M, real weights): full and LoRA, from the
library (`fit(init_params=...)`) and the command line (`jaxformer train --init`),
then `generate --run` / `eval --run` on the fine-tuned run; LoRA adapters as a
config choice (`jaxformer.nn.lora`): inert when untrained, merged exactly, the
same scanned or unrolled; and the refusals of bad input.

The corpus is a slice of this repository's own docs (train) and another doc
(held out). Few steps on CPU: the fine-tuned runs are shared per module.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.cli.main import main
from jaxformer.nn import lora
from jaxformer.text import JSONTokenizer
from jaxformer.train.data import TextData
from jaxformer.train import evaluate_lm, fit, train_functions, TrainConfig

from jaxformer.train.run import Run
from jaxformer.train.checkpoint import Checkpoints

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs")
SEQ, BATCH, STEPS = 64, 4, 2


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    with open(os.path.join(DOCS, "training.md")) as f:
        (folder / "train.txt").write_text(f.read()[:4000])
    with open(os.path.join(DOCS, "scaling.md")) as f:
        (folder / "held_out.txt").write_text(f.read()[:800])
    return str(folder / "train.txt"), str(folder / "held_out.txt")


def train_config(corpus, lr):
    return TrainConfig(task="lm", data=(corpus[0],), eval_data=(corpus[1],), seq_len=SEQ,
                       steps=STEPS, batch_size=BATCH, warmup_steps=0, learning_rate=lr)


@pytest.fixture(scope="module")
def data(smollm2, corpus):
    model, _, tokenizer, _ = smollm2
    c = model.config
    wrapped = JSONTokenizer.wrap(tokenizer, pad_id=c.pad_id, bos_id=c.bos_id, eos_id=c.eos_id,
                                 vocab_size=c.tgt_vocab_size)
    return TextData([corpus[0]], wrapped, SEQ, eval_patterns=[corpus[1]])


def saved_state(out):
    """(model config, the latest TrainState) of a run, restored without an init."""
    run = Run.open(out)
    config, train = run.model_config, run.train_config
    with Checkpoints(os.path.join(out, "checkpoints")) as checkpoints:
        return config, checkpoints.restore(train_functions(config, train).abstract_state())


SCANNED = dict(scan_layers=True)  # one compiled layer: compiles in seconds, not minutes


@pytest.fixture(scope="module")
def full(smollm2, corpus, data):
    """(pretrained held-out loss, full fine-tuning's evals, its optimizer state's bytes):
    not the trained state itself, 1.6 GB that the module's other tests would hold on to."""
    model, params, _, _ = smollm2
    config = model.config.replace(**SCANNED)
    result = fit(config, train_config(corpus, 5e-5), data=data, init_params=params,
                 progress=False)
    before = evaluate_lm(jf.DecoderOnlyLM(config), jf.stack_layers(params), data,
                         batch_size=BATCH)["loss"]
    return before, result.evals, tree_bytes(result.state.opt_state)


def tree_bytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))


@pytest.fixture(scope="module")
def lora_run(smollm2, corpus, tmp_path_factory):
    """A `jaxformer train --init ... --lora 8` run directory (the CLI end to end)."""
    _, _, _, path = smollm2
    out = str(tmp_path_factory.mktemp("finetune") / "lora")
    code = main(["train", "--task", "lm", "--init", path, "--data", corpus[0], "--eval-data",
                 corpus[1], "--seq-len", str(SEQ), "--batch", str(BATCH), "--steps", str(STEPS),
                 "--warmup", "0", "--lr", "2e-3", "--lora", "8", "--scan-layers",
                 "--samples", "0", "--no-progress", "--out", out])
    assert code == 0
    return out


def test_full_fine_tuning_lowers_the_held_out_loss(full):
    before, evals, _ = full
    assert evals[-1]["eval_loss"] < before - 0.01, (before, evals)


def test_lora_trains_only_the_adapters_and_lowers_the_held_out_loss(smollm2, full, lora_run):
    _, params, _, _ = smollm2
    before, _, full_opt_state_bytes = full
    config, state = saved_state(lora_run)
    assert config.lora_rank == 8 and config.lora_targets == ("q", "v")
    with open(os.path.join(lora_run, "summary.json")) as f:
        assert json.load(f)["eval_loss"] < before - 0.01
    adapters, base = lora.split_adapters(state.params)
    # The frozen base: bitwise the pretrained weights (stacked by the scanned model).
    pretrained = jf.stack_layers(params)
    assert jax.tree_util.tree_structure(base) == jax.tree_util.tree_structure(pretrained)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(base),
                                                    jax.tree_util.tree_leaves(pretrained)))
    assert any(np.any(np.asarray(b) != 0) for b in
               jax.tree_util.tree_leaves(adapters))  # the adapters did train
    # The optimizer state holds the adapters only: under 2 % of full fine-tuning's.
    assert jax.tree_util.tree_structure(state.opt_state[1][0].mu) == \
        jax.tree_util.tree_structure(adapters)
    assert tree_bytes(state.opt_state) < 0.02 * full_opt_state_bytes


def test_generate_and_eval_read_the_fine_tuned_run(lora_run, corpus, capsys):
    config, state = saved_state(lora_run)
    capsys.readouterr()
    assert main(["eval", "--run", lora_run, "--data", corpus[1], "--seq-len", str(SEQ),
                 "--batch", str(BATCH), "--no-progress"]) == 0
    metrics = json.loads(capsys.readouterr().out.splitlines()[-1])
    with open(os.path.join(lora_run, "summary.json")) as f:
        assert metrics["loss"] == pytest.approx(json.load(f)["eval_loss"], rel=1e-5)
    assert main(["generate", "--run", lora_run, "--temperature", "0", "--max-new-tokens", "1",
                 "--json", "The model"]) == 0
    printed = json.loads(capsys.readouterr().out.splitlines()[-1])
    from tokenizers import Tokenizer  # the run's own copy of the checkpoint's tokenizer

    prompt = Tokenizer.from_file(os.path.join(lora_run, "tokenizer.json")).encode(
        "The model").ids
    logits = jax.jit(jf.DecoderOnlyLM(config).apply)({"params": state.params},
                                                     jnp.array([prompt], jnp.int32))
    assert printed["ids"] == [int(jnp.argmax(logits[0, -1]))]  # the adapted model's greedy


def test_export_merges_the_adapters_for_transformers(smollm2, lora_run, tmp_path, capsys):
    """`jaxformer export --run` of the LoRA run: transformers reads the merged model with
    the adapted model's logits (within 1e-5 of the largest), its tokenizer and the
    checkpoint's chat template."""
    transformers = pytest.importorskip("transformers", reason="the reference needs it")
    import torch
    from tokenizers import Tokenizer

    from jaxformer.text import chat_template

    config, state = saved_state(lora_run)
    out = str(tmp_path / "merged")
    assert main(["export", "--run", lora_run, "--out", out]) == 0
    text = "The model learns to"
    prompt = Tokenizer.from_file(os.path.join(lora_run, "tokenizer.json")).encode(text).ids
    assert transformers.AutoTokenizer.from_pretrained(out).encode(text) == prompt
    assert chat_template(out) == chat_template(smollm2[3])
    want = np.asarray(jax.jit(jf.DecoderOnlyLM(config).apply)(
        {"params": state.params}, jnp.array([prompt], jnp.int32))[0])
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        got = exported(torch.tensor([prompt])).logits[0].numpy()
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


# --------------------------------------------------------------------------- LoRA as a config

TINY = jf.tiny(num_encoder_layers=0, num_decoder_layers=2, gated_ffn=True, activation="silu",
               norm="pre", lora_rank=3, lora_alpha=6.0,
               lora_targets=("q", "k", "v", "o", "gate", "up", "down"))


def test_untrained_adapters_change_nothing_and_merge_lora_folds_trained_ones(tokens):
    x = tokens(0, (2, 7), TINY.tgt_vocab_size)

    def logits(config, params):
        return jax.jit(jf.DecoderOnlyLM(config).apply)({"params": params}, x)

    adapted = jax.jit(jf.DecoderOnlyLM(TINY).init)(jax.random.PRNGKey(0), x)["params"]
    adapters, base = lora.split_adapters(adapted)
    plain = TINY.replace(lora_rank=0)
    assert jax.tree_util.tree_structure(base) == jax.tree_util.tree_structure(
        jax.eval_shape(jf.DecoderOnlyLM(plain).init, jax.random.PRNGKey(0), x)["params"])
    # Zero B adds exactly 0 (eagerly bitwise; compiled, XLA may fuse the sum differently).
    np.testing.assert_allclose(logits(TINY, adapted), logits(plain, base), atol=2e-6, rtol=0)
    @jax.jit  # one compiled program for all leaves (tests stay fast)
    def perturbed(tree):
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
        return treedef.unflatten([x + 0.2 * jax.random.normal(k, x.shape)
                                  for x, k in zip(leaves, keys)])

    trained = lora.join(perturbed(adapters), base)
    adapted_logits = logits(TINY, trained)
    assert float(jnp.abs(adapted_logits - logits(plain, base)).max()) > 1e-2
    assert lora.merge_lora(TINY, trained)[0] == plain
    merged = jax.jit(lambda p: lora.merge_lora(TINY, p)[1])(trained)
    np.testing.assert_allclose(logits(plain, merged), adapted_logits, atol=2e-5, rtol=2e-5)
    # Scanned: the same logits, and merge_lora keeps the stacked layout.
    scanned = TINY.replace(scan_layers=True)
    stacked = jax.jit(jf.stack_layers)(trained)
    np.testing.assert_allclose(logits(scanned, stacked), adapted_logits, atol=2e-5, rtol=2e-5)
    merged_stacked = jax.jit(lambda p: jf.unstack_layers(lora.merge_lora(scanned, p)[1]))(
        stacked)
    assert all(np.allclose(a, b, atol=1e-6) for a, b in zip(
        jax.tree_util.tree_leaves(merged_stacked), jax.tree_util.tree_leaves(merged)))


def test_an_unknown_lora_target_names_the_valid_ones():
    with pytest.raises(ValueError, match="'qkv' is not a projection.*q, k, v, o, up, down"):
        jf.tiny(lora_rank=2, lora_targets="q,qkv")
    with pytest.raises(ValueError, match="lora_rank"):
        jf.tiny(lora_rank=-1)


@pytest.mark.parametrize("flags, message", [
    (["--lora-targets", "q,x"], "'x' is not a projection of this model; valid: q, k, v, o, "
                                "gate, up, down"),
    (["--d-model", "64"], "--init takes the model from the checkpoint: drop --d-model"),
    (["--tokenizer", "TOKENIZER"], "is not the tokenizer of --init"),
])
def test_bad_fine_tuning_flags_are_one_line_errors(smollm2, corpus, tmp_path, capsys, flags,
                                                   message):
    path = smollm2[3]
    other = tmp_path / "bytes.json"  # a tokenizer that is not SmolLM2's
    from tokenizers import Tokenizer, models  # noqa: PLC0415

    Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")).save(str(other))
    flags = [str(other) if f == "TOKENIZER" else f for f in flags]
    out = tmp_path / "run"
    code = main(["train", "--task", "lm", "--init", path, "--data", corpus[0], "--lora", "2",
                 "--out", str(out), "--no-progress", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert not out.exists()  # refused before anything was written
    assert main(["train", "--task", "lm", "--data", corpus[0], "--lora", "4",
                 "--out", str(out)]) == 2
    assert "--lora needs --init" in capsys.readouterr().err

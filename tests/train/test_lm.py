"""The decoder-only LM trained on text: the packed-batch forward, the loss, training
lowering held-out loss, resume bitwise, `jaxformer train --task lm`, `jaxformer
generate --run` and `jaxformer decode --run`, and their refusals of bad input.

The text is the source of Python's own `json` package (on every Python install).
"""

import glob
import json
import math
import os
import signal
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.cli import baselines
from jaxformer.decode import api as decoding
from jaxformer.cli.main import main
from jaxformer.text import ByteTokenizer
from jaxformer.train.data import LMBatch, TextData
from jaxformer.train import (evaluate_lm, fit, loss_and_metrics, model_logits,
                             train_functions, TrainConfig)

from conftest import saved_run, snapshot, tree_equal

JSON_SOURCES = os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py")
SEQ = 64
MODEL = jf.tiny(num_encoder_layers=0, num_decoder_layers=2, src_vocab_size=259,
                tgt_vocab_size=259, max_len=SEQ, norm="pre")
TRAIN = TrainConfig(task="lm", data=(JSON_SOURCES,), seq_len=SEQ, steps=40, batch_size=8,
                    warmup_steps=5, learning_rate=3e-3)


@pytest.fixture(scope="module")
def data():
    return TextData(TRAIN.data, ByteTokenizer(), SEQ, eval_fraction=TRAIN.eval_fraction,
                    seed=0)




# --------------------------------------------------------------------------- the forward pass


def test_a_packed_row_computes_each_document_as_if_alone(make_lm):
    """Two documents in one row: each one's logits equal those of the document fed
    alone from position 0 (no attention across the boundary, positions restart)."""
    model, params = make_lm(MODEL)
    r = np.random.default_rng(0)
    first, second = r.integers(3, 259, 5), r.integers(3, 259, 7)
    row = np.concatenate([first, second, [0, 0]])[None].astype(np.int32)
    segments = np.array([[1] * 5 + [2] * 7 + [0, 0]], np.int32)
    positions = np.array([list(range(5)) + list(range(7)) + [0, 0]], np.int32)
    batch = LMBatch(inputs=row, labels=row, weights=np.ones_like(row, np.float32),
                    positions=positions, segments=segments)
    logits, _, _ = model_logits(model, params, batch)
    alone = [model.apply({"params": params}, jnp.asarray(doc[None], jnp.int32))[0]
             for doc in (first, second)]
    np.testing.assert_allclose(logits[0, :5], alone[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits[0, 5:12], alone[1], rtol=1e-5, atol=1e-5)
    # Without the segment mask the second document would see the first: it must differ.
    leaky = model.apply({"params": params}, jnp.asarray(row), positions_BT=positions)
    assert not np.allclose(leaky[0, 5:12], alone[1], atol=1e-3)


def test_lm_loss_against_a_hand_computed_case():
    logits = np.log(np.array([[[0.5, 0.25, 0.25], [0.1, 0.8, 0.1], [1 / 3, 1 / 3, 1 / 3]]],
                             np.float32))
    labels = np.array([[1, 1, 2]])
    weights = np.array([[1.0, 1.0, 0.0]], np.float32)  # the last label crosses a boundary
    loss, metrics = loss_and_metrics(jnp.asarray(logits), jnp.asarray(labels), pad_id=0,
                                     weights_BT=jnp.asarray(weights))
    np.testing.assert_allclose(loss, (-math.log(0.25) - math.log(0.8)) / 2, rtol=1e-6)
    assert metrics["tokens"] == 2 and metrics["token_accuracy"] == 0.5
    # A PAD label (id 0) is masked whatever its weight.
    loss_pad, metrics_pad = loss_and_metrics(jnp.asarray(logits), jnp.asarray([[0, 1, 2]]),
                                             pad_id=0, weights_BT=jnp.ones((1, 3)))
    np.testing.assert_allclose(loss_pad, (-math.log(0.8) - math.log(1 / 3)) / 2, rtol=1e-6)
    assert metrics_pad["tokens"] == 2


def test_pad_equal_to_eos_keeps_the_eos_labels_in_the_loss(make_lm, make_transformer):
    """PAD == EOS (allowed in configs): an EOS label of weight 1 counts in the loss of the
    eval step, the train step and the LM evaluation (a `labels != pad_id` mask would drop
    it); a task Batch, without weights, is refused rather than silently losing its EOS."""
    import optax  # noqa: PLC0415

    from jaxformer.train import TrainState, make_train_step  # noqa: PLC0415
    from jaxformer.train.evaluation import make_eval_step, make_lm_eval_step  # noqa: PLC0415
    from jaxformer.train.tasks import Batch  # noqa: PLC0415

    B, E = 1, 2  # BOS; EOS, also PAD
    config = jf.tiny(num_encoder_layers=0, num_decoder_layers=1, bos_id=B, eos_id=E, pad_id=E)
    model, params = make_lm(config)
    # Two documents "B 5 6 E" and "B 7 E", then one PAD label (weight 0).
    batch = LMBatch(inputs=np.array([[B, 5, 6, E, B, 7, E]], np.int32),
                    labels=np.array([[5, 6, E, B, 7, E, E]], np.int32),
                    weights=np.array([[1, 1, 1, 0, 1, 1, 0]], np.float32),
                    positions=np.array([[0, 1, 2, 3, 0, 1, 2]], np.int32),
                    segments=np.array([[1, 1, 1, 1, 2, 2, 2]], np.int32))
    logits_BTV, labels_BT, weights_BT = model_logits(model, params, batch)
    xent_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, labels_BT)
    want = float((xent_BT * weights_BT).sum() / weights_BT.sum())  # 5 labels, 2 of them EOS

    sums = make_eval_step(model)(params, batch)
    assert float(sums["tokens"]) == 5
    np.testing.assert_allclose(sums["loss_sum"] / sums["tokens"], want, rtol=1e-5)
    lm_sums = make_lm_eval_step(model)(params, batch, jnp.ones(config.tgt_vocab_size))
    assert float(lm_sums["tokens"]) == 5
    np.testing.assert_allclose(lm_sums["nats"], 5 * want, rtol=1e-5)
    tx = optax.sgd(0.0)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params,
                                opt_state=tx.init(params), rng=jax.random.PRNGKey(0))
    _, metrics = make_train_step(model, tx)(state, batch)
    assert float(metrics["tokens"]) == 5
    np.testing.assert_allclose(metrics["loss"], want, rtol=1e-5)  # dropout 0 in tiny

    encdec, encdec_params = make_transformer(config.replace(num_encoder_layers=1))
    task_batch = Batch(src=jnp.array([[5, 6, E]]), tgt_in=jnp.array([[B, 5, 6]]),
                       labels=jnp.array([[5, 6, E]]))
    with pytest.raises(ValueError, match="pad_id == eos_id == 2.*drop every EOS label"):
        make_eval_step(encdec)(encdec_params, task_batch)
    with pytest.raises(ValueError, match="pad_id=None needs weights_BT"):
        loss_and_metrics(logits_BTV, labels_BT, pad_id=None)


def test_bits_per_byte_counts_the_bytes_of_the_predicted_tokens(data, make_lm):
    """A uniform model over 259 ids costs log2(259) bits per byte on byte tokens."""
    model, params = make_lm(MODEL)
    params = jax.tree_util.tree_map(jnp.zeros_like, params)  # zero logits: uniform
    metrics = evaluate_lm(model, params, data, batch_size=8)
    np.testing.assert_allclose(metrics["loss"], math.log(259), rtol=1e-5)
    # Every weighted label is a byte but the EOS of each document, which costs bits, no bytes.
    docs = metrics["tokens"] - metrics["bytes"]
    assert 0 < docs <= 2 and metrics["bytes"] > 1000
    np.testing.assert_allclose(metrics["bits_per_byte"],
                               math.log2(259) * metrics["tokens"] / metrics["bytes"], rtol=1e-5)
    for bad in (0, -8, 8.5):  # once rounded up to a whole batch per device without a word
        with pytest.raises(ValueError, match="batch_size must be a positive int"):
            evaluate_lm(model, params, data, batch_size=bad)


def test_baselines_on_known_texts():
    assert baselines.unigram_bits_per_byte(b"abab") == 1.0
    assert baselines.unigram_bits_per_byte(bytes(range(256)) * 4) == 8.0
    text = b"to be or not to be " * 2000
    assert baselines.xz_bits_per_byte(text) < 0.2  # repetitive: compresses
    noise = np.random.default_rng(0).integers(0, 256, 20000, np.uint8).tobytes()
    assert baselines.xz_bits_per_byte(noise) > 7.9  # random: does not
    with pytest.raises(ValueError, match="empty"):
        baselines.xz_bits_per_byte(b"")


# --------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory):
    directory = tmp_path_factory.mktemp("lm")
    result = fit(MODEL, TRAIN, data=data, checkpoint_dir=str(directory), save_every=20,
                 eval_every=20, progress=False)
    return result, directory


def test_training_lowers_held_out_loss(trained, data):
    result, _ = trained
    fns = train_functions(MODEL, TRAIN)
    initial = evaluate_lm(fns.model, fns.init(0).params, data, batch_size=8)
    assert [r["step"] for r in result.evals] == [20, 40]
    final = result.evals[-1]
    assert final["eval_loss"] < 0.8 * initial["loss"]
    assert final["eval_loss"] < result.evals[0]["eval_loss"]
    assert result.train_s > 0 and len(result.history) == TRAIN.steps


def test_ctrl_c_and_resume_equal_the_uninterrupted_lm_run_bitwise(trained, data, tmp_path):
    full, _ = trained

    def press(step):
        if step == 13:
            signal.raise_signal(signal.SIGINT)

    first = fit(MODEL, TRAIN, data=data, checkpoint_dir=str(tmp_path), on_step=press,
                progress=False)
    assert first.interrupted and int(first.state.step) == 13
    resumed = fit(MODEL, TRAIN, data=data, checkpoint_dir=str(tmp_path), resume=True,
                  progress=False)
    assert resumed.start_step == 13
    assert tree_equal(resumed.state.params, full.state.params)
    assert tree_equal(resumed.state.opt_state, full.state.opt_state)
    assert resumed.history == full.history[13:]  # the same batches, step by step


def test_lm_runs_refuse_a_model_that_does_not_fit_the_data(data):
    for model, match in ((MODEL.replace(tgt_vocab_size=200, src_vocab_size=200),
                          "more than the model's tgt_vocab_size=200"),
                         (MODEL.replace(max_len=32), "longer than the model's max_len=32"),
                         (MODEL.replace(num_encoder_layers=1), "num_encoder_layers=0")):
        with pytest.raises(ValueError, match=match):
            fit(model, TRAIN, data=data, progress=False)
    with pytest.raises(ValueError, match="needs data"):
        fit(MODEL, TRAIN, progress=False)


# --------------------------------------------------------------------------- the commands

LM_FLAGS = ["train", "--task", "lm", "--data", JSON_SOURCES, "--preset", "tiny", "--layers", "2",
            "--norm", "pre", "--seq-len", str(SEQ), "--batch", "8", "--steps", "12",
            "--warmup", "2", "--lr", "3e-3", "--eval-every", "6", "--samples", "2",
            "--sample-tokens", "20", "--no-progress", "--save-every", "6"]


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("runs") / "lm")
    return out, main(LM_FLAGS + ["--out", out])


def test_train_lm_fills_the_run_directory_and_reports_bits_per_byte(lm_run, data):
    out, code = lm_run
    assert code == 0
    assert sorted(os.listdir(out)) == ["checkpoints", "config.json", "loss.png",
                                       "metrics.jsonl", "summary.json"]
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    for key in ("bits_per_byte", "unigram_bits_per_byte", "xz_bits_per_byte", "tokens_per_s",
                "steps", "wall_s", "perplexity"):
        assert key in summary, key
    assert summary["steps"] == 12 and summary["tokens_per_s"] > 0
    assert summary["unigram_bits_per_byte"] == baselines.unigram_bits_per_byte(data.eval_bytes)
    assert summary["xz_bits_per_byte"] == baselines.xz_bits_per_byte(data.eval_bytes)
    np.testing.assert_allclose(summary["perplexity"], math.exp(summary["eval_loss"]), rtol=1e-9)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records if "eval_loss" in r] == [6, 12]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 13))


def test_generate_run_reproduces_the_library_generate(lm_run, capsys):
    out, _ = lm_run
    capsys.readouterr()
    # The CLI prefills in chunks of 3 (7 and 7 prompt tokens), the library in one pass.
    assert main(["generate", "--run", out, "--temperature", "0", "--max-new-tokens", "12",
                 "--prefill-chunk", "3", "def f(", "import"]) == 0
    printed = capsys.readouterr().out.splitlines()
    config, _, state = saved_run(out)
    params = state.params
    tok = ByteTokenizer()
    prompts = [[tok.bos_id, *tok.encode(p).tolist()] for p in ("def f(", "import")]
    batch = np.zeros((2, max(map(len, prompts))), np.int32)
    for row, p in zip(batch, prompts):
        row[:len(p)] = p
    result = decoding.generate(jf.DecoderOnlyLM(config), params, batch, max_new_tokens=12,
                               prompt_lengths=np.array([len(p) for p in prompts]))
    want = [prompt + tok.decode(np.asarray(t)[:n]) for prompt, t, n in
            zip(("def f(", "import"), result.tokens, result.lengths)]
    assert printed == want


def test_generate_streams_one_prompt_as_its_tokens_come(lm_run, capsys, monkeypatch):
    """One prompt: the text reaches stdout piece by piece from inside the decode loop
    (a write per new character), and the whole line equals the batched command's."""
    import io
    import sys

    out, _ = lm_run
    command = ["generate", "--run", out, "--temperature", "0", "--max-new-tokens", "12"]
    capsys.readouterr()
    assert main(command + ["def f(", "import"]) == 0
    batched = capsys.readouterr().out.splitlines()[0]
    writes = []

    class Recorder(io.StringIO):
        def write(self, text):
            writes.append(text)
            return super().write(text)

    monkeypatch.setattr(sys, "stdout", Recorder())
    assert main(command + ["def f("]) == 0
    assert "".join(writes) == batched + "\n"
    pieces = [w for w in writes[1:-1] if w]  # between the prompt and the newline
    assert len(pieces) == len(batched) - len("def f(")  # bytes: one character per step


def test_generate_refuses_more_new_tokens_than_the_context_holds(lm_run, capsys):
    """A prompt of P tokens leaves SEQ - P + 1 new ones: that many run, one more is refused
    before anything is printed (it was capped without a word); not given, the default is
    capped (as --help says)."""
    out, _ = lm_run
    prompt = "def f("  # BOS + 6 bytes
    room = SEQ - (1 + len(prompt)) + 1
    command = ["generate", "--run", out, "--temperature", "0", "--json", prompt]
    capsys.readouterr()
    for count in (room + 1, 10 ** 9):
        assert main(command + ["--max-new-tokens", str(count)]) == 2
        printed, err = capsys.readouterr()
        assert printed == "" and len(err.splitlines()) == 1, err
        assert f"--max-new-tokens {count} does not fit" in err and f"leaves {room}" in err
    assert main(command + ["--max-new-tokens", str(room)]) == 0
    assert len(json.loads(capsys.readouterr().out)["ids"]) <= room


def test_readers_work_while_a_run_holds_its_lock(lm_run, tmp_path, capsys):
    """generate/eval --run read the latest checkpoint while `train` holds the run's lock."""
    from jaxformer.train.run_lock import RunLock

    out, _ = lm_run
    capsys.readouterr()
    with RunLock(out):
        assert main(["generate", "--run", out, "--max-new-tokens", "4", "def"]) == 0
        assert main(["eval", "--run", out, "--data", JSON_SOURCES.replace("*", "tool"),
                     "--no-progress"]) == 0
        assert json.loads(capsys.readouterr().out.splitlines()[-1])["tokens"] > 0


def test_decode_run_prints_the_greedy_decodes_of_a_copy_run(tmp_path, capsys):
    out = str(tmp_path / "copy")
    assert main(["train", "--preset", "tiny", "--layers", "1", "--max-len", "6", "--batch", "8",
                 "--steps", "12", "--warmup", "2", "--lr", "1e-2", "--eval-examples", "16",
                 "--show", "0", "--no-progress", "--out", out]) == 0
    capsys.readouterr()
    assert main(["decode", "--run", out, "5 6 7", "9 4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("->")[0].strip() for line in lines] == ["5 6 7", "9 4"]
    config, _, state = saved_run(out)
    params = state.params
    src = np.array([[5, 6, 7], [9, 4, 0]], np.int32)
    tokens = decoding.greedy_decode(jf.Transformer(config), params, src,
                                    max_new_tokens=config.max_len)
    for line, row, n in zip(lines, np.asarray(tokens.tokens), np.asarray(tokens.lengths)):
        want = " ".join(str(t) for t in row[:n] if t not in (0, 2))
        assert line.split("->")[1].strip() == want
    assert main(["generate", "--run", out, "hello"]) == 2  # not an LM run
    assert "is a copy run" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--data", "/nonexistent/*.txt"], "/nonexistent/*.txt"),
    (["--tokenizer", "/nonexistent.json"], "/nonexistent.json"),
    (["--eval-every", "-1"], "--eval-every: must be an integer >= 0"),
], ids=["no-such-files", "no-such-tokenizer", "negative-eval-every"])
def test_bad_lm_flags_are_refused_before_anything_runs(flags, message, tmp_path, capsys):
    out = tmp_path / "run"
    argv = LM_FLAGS + ["--out", str(out)]
    if flags[0] == "--data":
        i = argv.index("--data")
        argv = argv[:i] + argv[i + 2:]
    assert main(argv + flags) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_empty_and_tiny_corpora_are_refused(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    small = tmp_path / "small.txt"
    small.write_text("tiny text")
    for path, message in ((empty, "empty"), (small, "")):
        out = tmp_path / f"run-{path.stem}"
        argv = [a if a != JSON_SOURCES else str(path) for a in LM_FLAGS]
        assert main(argv + ["--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert str(path) in err or "corpus" in err or "batch" in err, err
        assert message in err
        assert not out.exists()


def test_export_refuses_a_run_no_hugging_face_architecture_expresses(tmp_path, lm_run, capsys):
    """The presets of `train --task lm` (LayerNorm, sinusoidal positions) have no Hugging
    Face causal-LM form: refused naming the field, before the checkpoint is read."""
    out = tmp_path / "hf"
    assert main(["export", "--run", lm_run[0], "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "TransformerConfig.norm_type='layernorm'" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_commands_refuse_a_run_without_checkpoint(tmp_path, lm_run, capsys):
    assert main(["generate", "--run", str(tmp_path), "x"]) == 2
    assert "config.json does not exist" in capsys.readouterr().err
    out, _ = lm_run
    bare = tmp_path / "bare"
    os.makedirs(bare)
    with open(os.path.join(out, "config.json")) as f:
        (bare / "config.json").write_text(f.read())
    before = snapshot(bare)
    assert main(["generate", "--run", str(bare), "x"]) == 2
    assert "no checkpoint" in capsys.readouterr().err
    assert snapshot(bare) == before
    assert glob.glob(str(bare / "*")) == [str(bare / "config.json")]

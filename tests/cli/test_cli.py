"""The `jaxformer train` command: run directory, summary line, interrupt + resume,
refusals of bad input, `python -m jaxformer`, and the (shortened) example. Resuming
on other devices is test_distributed's (2 processes x 2 devices, resumed by one
process); reading a checkpoint into new shardings is test_scale_out's."""

import argparse
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys

import jax
import pytest

import jaxformer.train.loop
from jaxformer.cli.main import main
from jaxformer.config import TransformerConfig
from jaxformer.nn.model import Transformer
from jaxformer.train import evaluate, TrainConfig
from jaxformer.train.task import training_task
from jaxformer.train.run_lock import LOCK_NAME, RunLock

from conftest import saved_run, snapshot, tree_equal

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The tiny 1+1-layer model and schedule of test_training/test_checkpoint: one compilation.
# --no-cpu-tuning: only a process's first in-process run could be tuned (tuning must
# precede JAX's start), and tuned programs round differently in the last bits.
TINY = ["train", "--preset", "tiny", "--layers", "1", "--max-len", "6", "--batch", "8",
        "--steps", "12", "--warmup", "2", "--lr", "1e-2", "--eval-examples", "16",
        "--show", "2", "--save-every", "5", "--no-progress", "--dropout", "0.1",
        "--no-cpu-tuning"]




@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("compile-cache"))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, compile_cache):
    out = str(tmp_path_factory.mktemp("runs") / "copy")
    jax.clear_caches()  # compiled here, not reused from another file: the cache fills
    return out, main(TINY + ["--out", out, "--compile-cache", compile_cache])


def test_train_fills_the_run_directory(finished_run, capsys):
    out, code = finished_run
    assert code == 0
    assert sorted(os.listdir(out)) == ["attention.png", "checkpoints", "config.json",
                                       "loss.png", "metrics.jsonl", "summary.json"]
    with open(os.path.join(out, "config.json")) as f:
        saved = json.load(f)
    model = TransformerConfig.from_dict(saved["model"])
    train = TrainConfig.from_dict(saved["train"])
    assert (model.num_encoder_layers, model.d_model, train.steps, train.batch_size) == (1, 32,
                                                                                       12, 8)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == list(range(1, 13))
    assert {"loss", "token_accuracy", "grad_norm", "learning_rate"} <= set(records[0])
    assert sorted(map(int, os.listdir(os.path.join(out, "checkpoints")))) == [5, 10, 12]
    for name in ("loss.png", "attention.png"):
        with open(os.path.join(out, name), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.loads(f.read())
    assert {"exact_match", "token_accuracy", "steps", "wall_s"} <= set(summary)
    assert summary["steps"] == 12 and summary["eval_examples"] == 16
    # The summary reports the saved model: recompute its metrics from the checkpoint.
    model_config, train_config, state = saved_run(out)
    assert model_config.residual_dropout == 0.1 and int(state.step) == 12
    metrics = evaluate(Transformer(model_config), state.params,
                       training_task(model_config, train_config).heldout_set(16))
    assert summary["exact_match"] == metrics["exact_match"]
    assert summary["token_accuracy"] == metrics["token_accuracy"]
    assert summary["eval_loss"] == metrics["loss"]


def test_train_prints_examples_then_one_json_line(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert main(TINY + ["--out", out]) == 0  # same configuration: compiled once
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-4].startswith("source") and "prediction" in lines[-4]
    assert len(lines[-3].split()) >= 2  # a source and its prediction side by side
    summary = json.loads(lines[-1])
    assert summary["steps"] == 12 and summary["out"] == out


def test_existing_run_directory_is_not_overwritten(finished_run, capsys):
    out, _ = finished_run
    before = snapshot(out)
    assert main(TINY + ["--out", out]) == 2
    assert "already exists" in capsys.readouterr().err
    assert snapshot(out) == before


def test_resume_with_different_flags_is_refused(finished_run, capsys):
    out, _ = finished_run
    before = snapshot(out)
    assert main(["train", "--out", out, "--resume", "--steps", "20", "--norm", "pre"]) == 2
    err = capsys.readouterr().err
    assert "--steps 20 (saved: 12)" in err and "--norm pre (saved: post)" in err
    assert snapshot(out) == before


def test_ctrl_c_then_resume_through_the_cli(finished_run, tmp_path, monkeypatch, capsys):
    out = str(tmp_path / "interrupted")
    real_fit = jaxformer.train.loop.fit

    def fit_with_ctrl_c(*args, **kwargs):
        def press(step):
            if step == 3:
                signal.raise_signal(signal.SIGINT)
        return real_fit(*args, on_step=press, **kwargs)

    monkeypatch.setattr(jaxformer.train.loop, "fit", fit_with_ctrl_c)
    assert main(TINY + ["--out", out]) == 130
    assert f"--out {out} --resume" in capsys.readouterr().err
    assert os.listdir(os.path.join(out, "checkpoints")) == ["3"]
    monkeypatch.setattr(jaxformer.train.loop, "fit", real_fit)

    assert main(["train", "--out", out, "--resume", "--no-progress", "--eval-examples",
                 "16"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    with open(os.path.join(finished_run[0], "summary.json")) as f:
        uninterrupted = json.load(f)
    assert summary["resumed_from"] == 3 and summary["steps"] == 12
    for name in ("exact_match", "token_accuracy", "eval_loss"):  # the same final model
        assert summary[name] == uninterrupted[name]
    # ... bit for bit, dropout included: parameters and optimizer state.
    _, _, resumed = saved_run(out)
    _, _, full = saved_run(finished_run[0])
    assert int(resumed.step) == int(full.step) == 12
    assert tree_equal(resumed.params, full.params)
    assert tree_equal(resumed.opt_state, full.opt_state)


def test_resume_needs_a_run_with_a_checkpoint(tmp_path, capsys):
    assert main(["train", "--resume"]) == 2
    assert "--resume needs --out" in capsys.readouterr().err
    assert main(["train", "--resume", "--out", str(tmp_path)]) == 2
    assert "config.json does not exist" in capsys.readouterr().err
    shutil.copy(os.path.join(REPO, "pyproject.toml"), tmp_path / "config.json")  # not JSON
    assert main(["train", "--resume", "--out", str(tmp_path)]) == 2
    assert "not a valid run config" in capsys.readouterr().err


def test_corrupt_checkpoint_gives_a_clear_error(finished_run, tmp_path, capsys):
    out = str(tmp_path / "copy")
    shutil.copytree(finished_run[0], out)
    for root, _, names in os.walk(os.path.join(out, "checkpoints", "12")):
        for name in names:
            if "metadata" not in name.lower():
                with open(os.path.join(root, name), "wb") as f:
                    f.write(b"garbage")
    before = snapshot(out)
    assert main(["train", "--out", out, "--resume", "--no-progress"]) == 2
    assert "corrupt" in capsys.readouterr().err
    assert snapshot(out) == before


@pytest.mark.parametrize("flags, message", [
    (["--max-len", "40"], "longer than the model's max_len=32"),
    (["--steps", "0"], "--steps: must be a positive integer"),
    (["--dropout", "1.5"], "--dropout: must be in [0, 1)"),
    (["--lr", "-1"], "--lr: must be a positive finite number"),
    (["--heads", "3"], "not divisible by num_heads=3"),
    (["--vocab", "4"], "vocab_size must be an int >= 5"),
    (["--save-every", "0"], "--save-every: must be a positive integer"),
    (["--compile-cache", os.path.join(REPO, "pyproject.toml")], "is a file, not a directory"),
    (["--fallback"], "--fallback only applies with --resume"),
], ids=["length-beyond-model", "zero-steps", "dropout", "negative-lr", "heads", "vocab",
        "save-every", "compile-cache-file", "fallback-without-resume"])
def test_bad_flags_are_refused_before_anything_runs(flags, message, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(TINY + flags + ["--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_unknown_choices_are_refused_by_the_parser(capsys):
    for flags in (["--task", "shuffle"], ["--norm", "middle"], ["--dtype", "int8"]):
        assert main(["train"] + flags) == 2
        err = capsys.readouterr().err
        assert "invalid choice" in err and len(err.splitlines()) == 1


def test_python_dash_m_jaxformer():
    env = dict(os.environ, PYTHONPATH=REPO)
    top = subprocess.run([sys.executable, "-m", "jaxformer", "--help"], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert top.returncode == 0 and "train" in top.stdout
    train = subprocess.run([sys.executable, "-m", "jaxformer", "train", "--help"], env=env,
                           cwd=REPO, capture_output=True, text=True, timeout=600)
    assert train.returncode == 0
    for flag in ("--task", "--norm", "--steps", "--batch", "--lr", "--seed", "--out",
                 "--resume", "--dtype"):
        assert flag in train.stdout


def test_example_runs_shortened(capsys):
    spec = importlib.util.spec_from_file_location(
        "copy_task_example", os.path.join(REPO, "examples", "copy_task.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    summary = example.main(["--preset", "tiny", "--steps", "30", "--eval-examples", "20"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("source:") and "prediction:" in lines[0]
    assert json.loads(lines[-1]) == summary and summary["steps"] == 30


def test_the_default_run_learns_the_copy_task(tmp_path, capsys):
    """The README's claim, as `jaxformer train` runs it: defaults (800 steps of 64,
    the copy_task model, Post-LN, f32), 1,000 held-out sequences, exact match >= 0.99.
    `--norm pre --precision mixed` reaches it too (this test ran it until the suite
    needed its 4 minutes: a bf16 step is slow on a CPU)."""
    out = str(tmp_path / "run")
    assert main(["train", "--out", out, "--no-progress", "--show", "0"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 800 and summary["eval_examples"] == 1000
    assert summary["norm"] == "post" and summary["params"] == 674_848
    assert summary["exact_match"] >= 0.99, summary


def test_deep_model_flags_are_recorded_and_resumed(tmp_path):
    """--scan-layers --remat --precision reach the model and the run directory; the
    checkpoint holds stacked layers, and --resume refuses a different layout."""
    out = str(tmp_path / "deep")
    flags = ["--scan-layers", "--remat", "save_proj", "--precision", "mixed"]
    # --show 0: no example decode of this model (a program of its own); test_train_prints_
    # examples_then_one_json_line checks the examples
    assert main(TINY + ["--steps", "2", "--warmup", "1", "--save-every", "1", "--show", "0",
                        "--out", out] + flags) == 0
    model_config, _, state = saved_run(out)
    assert (model_config.scan_layers, model_config.remat, model_config.precision) == (
        True, "save_proj", "mixed")
    assert "layers" in state.params["encoder"] and int(state.step) == 2
    assert main(["train", "--out", out, "--resume", "--steps", "2", "--remat", "full"]) == 2


def test_resume_keeps_the_saved_mesh_when_it_fits(capsys):
    """--resume without --mesh continues on the saved mesh; one that does not fit
    the devices falls back to all of them on data, saying so; --mesh wins."""
    from jaxformer.cli.train_setup import resume_mesh_spec

    one = "data=1,fsdp=1,tensor=1"  # fits this process's single device
    resume, chosen = argparse.Namespace(mesh=None), argparse.Namespace(mesh="data=-1")
    assert resume_mesh_spec(resume, one) == one
    assert resume_mesh_spec(resume, None) is None
    assert capsys.readouterr().err == ""
    assert resume_mesh_spec(resume, "data=2,fsdp=2,tensor=1") is None
    assert "saved mesh data=2,fsdp=2,tensor=1 does not fit 1 device" in capsys.readouterr().err
    assert resume_mesh_spec(chosen, one) == "data=-1"


def test_a_rerun_loads_the_compiled_programs_from_the_compile_cache(finished_run,
                                                                    compile_cache, tmp_path):
    """Last in this file: it empties JAX's in-memory caches, so the run must read
    the programs finished_run wrote to --compile-cache, and train identically."""
    assert any(name.startswith("jit_train_step") for name in os.listdir(compile_cache))
    hits = []

    def count(event, **_):
        if event == "/jax/compilation_cache/cache_hits":
            hits.append(event)

    before = jax.config.jax_compilation_cache_dir
    jax.clear_caches()
    jax.monitoring.register_event_listener(count)
    try:
        out = str(tmp_path / "rerun")
        assert main(TINY + ["--out", out, "--compile-cache", compile_cache]) == 0
    finally:
        jax.monitoring.unregister_event_listener(count)
    assert hits  # loaded, not compiled
    assert jax.config.jax_compilation_cache_dir == before  # the setting ends with the command

    def losses(run):
        with open(os.path.join(run, "metrics.jsonl")) as f:
            return [(r["step"], r["loss"], r["grad_norm"]) for r in map(json.loads, f)]
    assert losses(out) == losses(finished_run[0])


def test_train_help_states_the_real_defaults(capsys):
    from jaxformer.train import TrainConfig
    assert main(["train", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"training window in tokens (default {TrainConfig.seq_len})" in help_text
    assert "--no-cpu-tuning" in help_text


def test_a_negative_seed_is_refused_before_the_run_directory_exists(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--task", "lm", "--data", __file__, "--seed", "-1",
                 "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "seed" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_a_mesh_the_model_does_not_split_over_is_one_line_and_no_run_directory(tmp_path):
    """4 heads over tensor=3: refused with exit 2 before the run directory exists."""
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "jaxformer", "train", "--cpu-devices", "3",
                           "--mesh", "tensor=3", "--steps", "2", "--out", str(out),
                           "--no-progress"], capture_output=True, text=True, cwd=REPO,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not divide over tensor=3" in lines[0]
    assert not out.exists()


def test_out_below_a_file_is_refused_in_one_line(tmp_path, capsys):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    out = a_file / "run"
    assert main(TINY + ["--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{a_file} is a file, not a directory" in err and len(err.splitlines()) == 1
    assert a_file.read_text() == "mine"


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere: no unwritable dir")
def test_out_in_an_unwritable_directory_is_refused(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        assert main(TINY + ["--out", str(locked / "run")]) == 2
        assert "permission denied" in capsys.readouterr().err
    finally:
        locked.chmod(0o700)


def test_a_ctrl_c_that_aborts_is_one_line_and_exit_130(tmp_path, monkeypatch, capsys):
    """A Ctrl-C that raises KeyboardInterrupt out of fit (while compiling, or a second
    one during the save the first one started): one line and status 130, no
    traceback; a new run without a checkpoint leaves no run directory (it could not
    be resumed, and would refuse the same command again)."""
    def fit_interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(jaxformer.train.loop, "fit", fit_interrupted)
    out = tmp_path / "run"
    assert main(TINY + ["--out", str(out)]) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "jaxformer train: interrupted by Ctrl-C"
    assert "Traceback" not in err
    assert not out.exists()


def test_verbose_shows_the_cause_of_an_error(tmp_path, capsys):
    """One line by default; --verbose adds the traceback of what the library raised."""
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    flags = ["train", "--task", "lm", "--data", __file__, "--tokenizer", str(bad),
             "--out", str(tmp_path / "run"), "--no-progress"]
    assert main(flags) == 2
    quiet = capsys.readouterr().err
    assert main(flags + ["--verbose"]) == 2
    verbose = capsys.readouterr().err
    assert len(quiet.strip().splitlines()) == 1 and "Traceback" not in quiet
    assert verbose.startswith(quiet.strip()) and "Traceback" in verbose


def test_generate_and_eval_refuse_bad_sources_in_one_line(finished_run, tmp_path, capsys):
    text = tmp_path / "doc.txt"
    text.write_text("some text")
    cases = [
        (["eval", "--model", str(tmp_path / "missing.gguf"), "--data", str(text)],
         "no such checkpoint directory or GGUF file"),
        (["eval", "--run", finished_run[0], "--data", str(text)], "needs a --task lm run"),
        (["generate", "--model", str(tmp_path), "hello"], "config.json"),
        (["generate", "--model", str(tmp_path), "--prefill-chunk", "0", "hello"],
         "--prefill-chunk: must be a positive integer"),
        (["eval", "--model", str(tmp_path), "--data", str(text), "--batch", "0"],
         "--batch: must be a positive integer"),
        (["decode", "--run", finished_run[0], "--max-new-tokens", "1000", "5 6"],
         "--max-new-tokens 1000 does not fit: the model's context is 32 tokens"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert main(["generate", "--run", finished_run[0], "--model", str(tmp_path),
                 "hello"]) == 2  # one source only
    assert "not allowed with argument" in capsys.readouterr().err


# --------------------------------------------------------------------------- one writer


def test_a_second_train_on_a_run_directory_in_use_is_refused_naming_the_holder(
        finished_run, tmp_path, capsys):
    """The lock is held here (another open file: flock refuses it in-process too)."""
    holder = f"pid {os.getpid()} on host {socket.gethostname()}"
    run = finished_run[0]
    before = snapshot(run)
    with RunLock(run):  # a --resume while the run trains: it would write the same files
        assert main(["train", "--out", run, "--resume", "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and holder in err and "is in use" in err, err
    assert snapshot(run) == before
    out = tmp_path / "run"
    with RunLock(out):  # a new run in a directory whose first run is only starting
        assert main(TINY + ["--out", str(out)]) == 2
        assert holder in capsys.readouterr().err
        assert os.listdir(out) == [LOCK_NAME]  # nothing written beside the holder's lock


def test_a_stale_lock_is_taken_over_saying_whose_and_held_for_the_run(tmp_path, monkeypatch,
                                                                      capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    during = []

    def fit_then_ctrl_c(*args, **kwargs):  # the lock during the run, then a second Ctrl-C
        during.append(json.loads((out / LOCK_NAME).read_text())["pid"])
        raise KeyboardInterrupt

    monkeypatch.setattr(jaxformer.train.loop, "fit", fit_then_ctrl_c)
    assert main(TINY + ["--out", str(out)]) == 130
    err = capsys.readouterr().err.splitlines()
    assert f"pid {dead.pid} on host {socket.gethostname()}" in err[0] and "taking over" in err[0]
    assert during == [os.getpid()]
    assert not (out / LOCK_NAME).exists()  # released at the end, however the run ends

"""Ctrl-C at any moment of a command: one line, exit status 130, nothing half-written
(issue 65 item 8).

`jaxformer export` (the command with the most imports before its work: JAX, the
tokenizer, Orbax, safetensors) interrupted by a real SIGINT from outside, at moments
spread over its run; and at chosen moments from inside, by a SIGINT the process sends
itself at an event of its own (an import, a file opened: `sys.addaudithook`), so each
phase is hit whatever the machine's speed. Before the fix a Ctrl-C during the imports
printed a 34-line traceback (and while jaxlib's extension initialised, crashed the
process); one that came while JAX's garbage collection callback ran was swallowed
("Exception ignored in: <function _xla_gc_callback>") and the export ran to its end.
`train` interrupted while it compiles leaves no run directory.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

import jaxformer as jf
from jaxformer.text import ByteTokenizer
from jaxformer.train import TextData, TrainConfig, fit

from conftest import REPO

INTERRUPTED = "jaxformer export: interrupted by Ctrl-C"
ENV = dict(os.environ, PYTHONPATH=REPO)

# `python -m jaxformer ARGS`, sending itself one SIGINT at the first EVENT matching NAME:
# "import" (a module's first import), "open" (a file opened by Python code, the path
# containing NAME), "call" (a call of a function of that name, in the main thread),
# "gc" (from inside the first garbage collection callback run after NAME is imported,
# as a Ctrl-C that comes while JAX's callback runs), or "exit" (as the process exits,
# after the command: from an `atexit` function). It creates the file $FIRED when it
# sends it.
SELF_INTERRUPTED = """
import atexit, gc, os, runpy, signal, sys
event, name = sys.argv[1:3]
sys.argv = ["jaxformer", *sys.argv[3:]]
state = {"armed": True, "gc": False}

def ctrl_c():
    state["armed"] = False
    open(os.environ["FIRED"], "w").close()
    signal.raise_signal(signal.SIGINT)
    for _ in range(100):  # the handler runs here (KeyboardInterrupt), not in the caller
        pass

def in_collection(phase, info):
    if state["armed"] and state["gc"]:
        ctrl_c()

def audit(what, args):
    if not state["armed"]:
        return
    if what == "import" and args[0] == name:
        if event == "gc":
            state["gc"] = True
        elif event == "import":
            ctrl_c()
    elif what == "open" and event == "open" and name in str(args[0]):
        ctrl_c()

def on_call(frame, what, arg):
    if state["armed"] and what == "call" and frame.f_code.co_name == name:
        ctrl_c()

gc.callbacks.append(in_collection)
sys.addaudithook(audit)
if event == "call":
    sys.setprofile(on_call)
if event == "exit":
    atexit.register(ctrl_c)  # the first registered: it runs after every other
runpy.run_module("jaxformer", run_name="__main__", alter_sys=True)
"""


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    """A finished one-layer Llama run (what `export --run` takes), as `jaxformer train
    --task lm` writes it: config.json, then `fit`'s checkpoints 1 and 2."""
    root = tmp_path_factory.mktemp("interrupts")
    data = root / "text.txt"
    data.write_text("".join(f"line {i}: the quick brown fox.\n" for i in range(100)))
    out = root / "run"
    config = jf.config.llama(src_vocab_size=260, tgt_vocab_size=260, max_len=16,
                             num_decoder_layers=1)
    train = TrainConfig(task="lm", data=(str(data),), seq_len=16, steps=2, batch_size=4,
                        warmup_steps=0)
    os.makedirs(out)
    (out / "config.json").write_text(json.dumps({"preset": None, "model": config.to_dict(),
                                                 "train": train.to_dict()}))
    fit(config, train, checkpoint_dir=str(out / "checkpoints"), save_every=1, progress=False,
        data=TextData([str(data)], ByteTokenizer(), train.seq_len))
    return str(out)


def export_args(run: str, out) -> list:
    return ["export", "--run", run, "--out", str(out)]


def assert_interrupted(done, out, may_have_finished: bool = False) -> None:
    """Exit 130, the one line, and no staging directory; no output directory either,
    unless the Ctrl-C may have come after its rename (then it is whole)."""
    assert done.returncode == 130, (done.returncode, done.stderr[-3000:])
    assert done.stderr.strip().splitlines() == [INTERRUPTED], done.stderr[-3000:]
    assert done.stdout == ""
    staging = [name for name in os.listdir(os.path.dirname(out))
               if name.startswith(f".{os.path.basename(out)}.")]
    assert staging == []
    if may_have_finished and os.path.exists(out):
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))
    else:
        assert not os.path.exists(out)


def assert_exported(done, out) -> None:
    assert done.returncode == 0 and done.stderr == "", done.stderr[-3000:]
    assert done.stdout.startswith("jaxformer export: LlamaForCausalLM")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))


def self_interrupted_export(run: str, out, event: str, name: str, fired):
    return subprocess.run([sys.executable, "-c", SELF_INTERRUPTED, event, name,
                           *export_args(run, out)], capture_output=True, text=True,
                          cwd=REPO, env=dict(ENV, FIRED=str(fired)), timeout=300)


@pytest.mark.parametrize("event, name", [
    ("import", "jax"),                   # as JAX's import starts
    ("import", "numpy"),                 # inside it: jaxlib's extension, initialising
    ("import", "jaxformer.cli.export"),  # the parser's imports
    ("import", "orbax.checkpoint"),      # the command's own imports, at its work
    ("open", "array_metadatas"),         # restoring the checkpoint
    ("call", "_read_shard"),             # in one of its reads (Orbax wraps what they
                                         # raise: not to be taken for damage)
    ("open", "generation_config.json"),  # writing the output (its staging directory)
    ("gc", "jaxformer.cli.export"),      # inside a garbage collection callback
], ids=["jax-import", "jaxlib-init", "parser-imports", "orbax-import", "restore",
        "restore-read", "writing", "gc-callback"])
def test_a_ctrl_c_at_each_phase_is_one_line_and_exit_130(lm_run, tmp_path, event, name):
    out, fired = tmp_path / "hf", tmp_path / "fired"
    done = self_interrupted_export(lm_run, out, event, name, fired)
    assert fired.exists(), "the Ctrl-C was not sent: the event did not happen"
    assert_interrupted(done, str(out))


def test_a_ctrl_c_in_a_read_of_resume_fallback_renames_no_checkpoint(lm_run, tmp_path):
    """`train --resume --fallback` renames a damaged latest step aside: a Ctrl-C in one
    of its reads (which Orbax wraps in another exception) is an interrupt, and the
    latest step stays as it is."""
    run = tmp_path / "run"
    shutil.copytree(lm_run, run)
    done = subprocess.run([sys.executable, "-c", SELF_INTERRUPTED, "call", "_read_shard",
                           "train", "--out", str(run), "--resume", "--fallback",
                           "--no-progress", "--no-cpu-tuning"], capture_output=True,
                          text=True, cwd=REPO, env=dict(ENV, FIRED=str(tmp_path / "fired")),
                          timeout=300)
    assert (tmp_path / "fired").exists()
    assert done.returncode == 130, done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == ["jaxformer train: interrupted by Ctrl-C"]
    assert sorted(os.listdir(run / "checkpoints")) == ["1", "2"]


def test_a_ctrl_c_after_the_command_is_ignored(lm_run, tmp_path):
    """Done, the command's exit status stands: a Ctrl-C while Python winds down (after
    every `atexit` function of the libraries) prints no traceback."""
    out, fired = tmp_path / "hf", tmp_path / "fired"
    done = self_interrupted_export(lm_run, out, "exit", "", fired)
    assert fired.exists()
    assert_exported(done, out)


def test_a_real_ctrl_c_at_moments_over_the_run(lm_run, tmp_path):
    """SIGINT from outside, as a terminal sends it, at fractions of an uninterrupted
    export's wall time: each run exits 130 with the one line and leaves nothing, or had
    finished (a late one), with a whole output directory."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "jaxformer", *export_args(lm_run,
                           tmp_path / "whole")], capture_output=True, text=True, cwd=REPO,
                          env=ENV, timeout=300)
    wall = time.perf_counter() - started
    assert_exported(done, tmp_path / "whole")
    interrupted = 0
    for i, fraction in enumerate((0.15, 0.3, 0.45, 0.6, 0.75, 0.9)):
        out = tmp_path / f"hf{i}"
        process = subprocess.Popen([sys.executable, "-m", "jaxformer",
                                    *export_args(lm_run, out)], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, cwd=REPO, env=ENV)
        # Not before 0.3 s: Python's own start (site, before any of jaxformer runs).
        time.sleep(max(0.3, fraction * wall))
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=300)
        done = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
        if done.returncode == 0:
            assert_exported(done, out)
        else:
            assert_interrupted(done, str(out), may_have_finished=True)
            interrupted += 1
    assert interrupted, "no run was interrupted: all finished before their SIGINT"


TRAIN = ["train", "--preset", "tiny", "--layers", "1", "--max-len", "6", "--batch", "8",
         "--steps", "2", "--warmup", "0", "--no-progress", "--show", "0",
         "--eval-examples", "8", "--no-cpu-tuning"]


def test_train_interrupted_while_compiling_leaves_no_run_directory(tmp_path):
    """The run announces itself, then compiles (seconds): a Ctrl-C then has no
    checkpoint to continue from, so the run's files go with it; the same command can
    run again."""
    out = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-m", "jaxformer", *TRAIN, "--out", str(out)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               cwd=REPO, env=ENV)
    announced = process.stdout.readline()
    assert "run dir" in announced, announced
    assert (out / "config.json").exists()
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 130, stderr[-3000:]
    assert stderr.strip().splitlines() == ["jaxformer train: interrupted by Ctrl-C"], stderr
    assert not out.exists()

"""Several processes: `jaxformer.parallel.distributed` settings and their errors, and, for real,
`jaxformer train` as 2 processes x 2 CPU devices (a localhost coordinator) against
this process's device(s) on the same global batches: the same losses and
parameters, a run directory written once, and the run resumed by this process on
its own mesh (`jaxformer train --resume`); the same for the LM through `fit`.

The cooperating pair (then the reference and the resume in this process) and
the LM pair (beside its reference) take 2.5 to 3.5 minutes on this shared 2-core
machine (another job loading it), nearly all of it compiling."""

import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig

import numpy as np
import pytest

import jaxformer as jf
from jaxformer.parallel import distributed
from jaxformer.train.checkpoint import Checkpoints
from jaxformer.cli.main import main
from jaxformer.text import ByteTokenizer
from jaxformer.train.data import TextData
from jaxformer.parallel.partitioning import make_mesh, mesh_spec_string
from jaxformer.train import fit, TrainConfig

from conftest import saved_run

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The tiny 1+1-layer model, dropout on (its masks must not depend on the split).
TINY = ["train", "--preset", "tiny", "--layers", "1", "--max-len", "6", "--batch", "8",
        "--steps", "8", "--warmup", "2", "--lr", "1e-2", "--eval-examples", "8",
        "--show", "0", "--save-every", "4", "--no-progress", "--dropout", "0.1"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _train(*flags):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    env.pop("XLA_FLAGS", None)
    return subprocess.Popen([sys.executable, "-m", "jaxformer", *TINY, *flags], env=env,
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _finish(proc):
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return out


def _metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _json(path):
    with open(path) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("distributed")
    two, resumed = str(root / "two"), str(root / "resumed")
    coordinator = f"localhost:{_free_port()}"
    pair = [_train("--cpu-devices", "2", "--mesh", "data=2,fsdp=2", "--out", two,
                   "--coordinator", coordinator, "--num-processes", "2", "--process-id", str(i))
            for i in (0, 1)]
    stdout = [_finish(proc) for proc in pair]
    # The reference: the same run in this process, on its device(s) ...
    model_config, train_config, _ = saved_run(two)
    one = fit(model_config, train_config, progress=False, mesh=make_mesh())
    # ... and the 2-process run stopped after its step-4 checkpoint, resumed here
    # (`jaxformer train --resume`, the same mesh: no new train step to compile).
    shutil.copytree(two, resumed)
    shutil.rmtree(os.path.join(resumed, "checkpoints", "8"))
    assert main(["train", "--out", resumed, "--resume", "--no-progress", "--show", "0",
                 "--eval-examples", "8"]) == 0
    return {"two": two, "one": one, "resumed": resumed, "stdout": stdout}


def _summary_lines(stdout):
    return [line for line in stdout.splitlines() if line.startswith("{")]


def _assert_same_params(got, want):
    # Attention key biases excepted (tests/test_partitioning.py): their true gradient is
    # 0 and Adam turns each reduction order's rounding noise into lr-sized steps.
    import jax

    flat_got = dict(jax.tree_util.tree_leaves_with_path(got))
    compared = 0
    for path, value in jax.tree_util.tree_leaves_with_path(want):
        if "['key']['bias']" not in jax.tree_util.keystr(path):
            np.testing.assert_allclose(flat_got[path], value, rtol=1e-5, atol=1e-6,
                                       err_msg=jax.tree_util.keystr(path))
            compared += 1
    assert compared > 10


def test_two_processes_train_like_one_device(runs):
    one, two = runs["one"].history, _metrics(runs["two"])
    assert [r["step"] for r in two] == list(range(1, 9))  # each step once: one writer
    np.testing.assert_allclose([r["loss"] for r in two], [r["loss"] for r in one], rtol=1e-5)
    _, _, state = saved_run(runs["two"])  # the checkpoint both processes wrote
    assert int(state.step) == 8
    _assert_same_params(state.params, runs["one"].state.params)


def test_the_run_directory_is_written_once(runs):
    two = runs["two"]
    saved = _json(os.path.join(two, "config.json"))
    assert (saved["mesh"], saved["processes"]) == ("data=2,fsdp=2,tensor=1", 2)
    assert sorted(map(int, os.listdir(os.path.join(two, "checkpoints")))) == [4, 8]
    first, second = runs["stdout"][:2]
    assert len(_summary_lines(first)) == 1 and not _summary_lines(second)
    assert "process 0 of 2, 2 of 4 cpu device(s)" in first
    assert "jaxformer train:" not in second
    summary = _json(os.path.join(two, "summary.json"))
    assert json.loads(_summary_lines(first)[0]) == summary
    assert (summary["devices"], summary["processes"], summary["steps"]) == (4, 2, 8)


def test_resume_onto_another_mesh_and_process_count_equals_the_uninterrupted_run(runs):
    summary = _json(os.path.join(runs["resumed"], "summary.json"))
    assert (summary["resumed_from"], summary["processes"]) == (4, 1)
    assert summary["mesh"] == mesh_spec_string(runs["one"].mesh) != "data=2,fsdp=2,tensor=1"
    resumed = _metrics(runs["resumed"])[8:]  # appended after the copied records
    assert [r["step"] for r in resumed] == [5, 6, 7, 8]
    np.testing.assert_allclose([r["loss"] for r in resumed],
                               [r["loss"] for r in runs["one"].history[4:]], rtol=1e-5)
    _, _, state = saved_run(runs["resumed"])
    _assert_same_params(state.params, runs["one"].state.params)


# --------------------------------------------------------------------------- the LM

LM_SCRIPT = """
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 2)
from jaxformer.parallel import distributed
distributed.initialize(sys.argv[1], 2, int(sys.argv[2]), timeout_s=120)
import os
sys.path[:0] = [sys.argv[4], os.path.dirname(sys.argv[4])]  # this file, conftest
from test_distributed import LM_MODEL, LM_TRAIN, lm_data
from jaxformer.parallel.partitioning import make_mesh
from jaxformer.train import fit
out = sys.argv[3]
fit(LM_MODEL, LM_TRAIN, mesh=make_mesh("data=2,fsdp=2"), data=lm_data(), progress=False,
    checkpoint_dir=out + "/checkpoints", metrics_file=out + "/metrics.jsonl")
"""
LM_MODEL = jf.tiny(num_encoder_layers=0, num_decoder_layers=1, src_vocab_size=259,
                   tgt_vocab_size=259, max_len=32, norm="pre", residual_dropout=0.1)
LM_TRAIN = TrainConfig(task="lm", data=(os.path.join(sysconfig.get_paths()["stdlib"], "json",
                                                     "*.py"),),
                       seq_len=32, steps=4, batch_size=8, warmup_steps=1, learning_rate=3e-3)


def lm_data():
    return TextData(LM_TRAIN.data, ByteTokenizer(), LM_TRAIN.seq_len, seed=0)


def test_two_processes_train_the_lm_like_one_device(tmp_path):
    """Task "lm": each process packs only its half of every batch (and its share of the
    held-out evaluation); the result is that of one device fed whole batches."""
    out = str(tmp_path / "two")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    env.pop("XLA_FLAGS", None)
    coordinator = f"localhost:{_free_port()}"
    procs = [subprocess.Popen([sys.executable, "-c", LM_SCRIPT, coordinator, str(i), out,
                               os.path.dirname(__file__)], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in (0, 1)]
    one = fit(LM_MODEL, LM_TRAIN, data=lm_data(), progress=False)  # meanwhile: the reference
    for proc in procs:
        _finish(proc)
    records = _metrics(out)
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]  # written once
    np.testing.assert_allclose([r["loss"] for r in train], [r["loss"] for r in one.history],
                               rtol=1e-5)
    (held_out,) = [r for r in records if "eval_loss" in r]
    np.testing.assert_allclose(held_out["eval_loss"], one.evals[0]["eval_loss"], rtol=1e-5)
    with Checkpoints(os.path.join(out, "checkpoints")) as checkpoints:
        state = checkpoints.restore(one.state)
    assert int(state.step) == 4
    _assert_same_params(state.params, one.state.params)


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("flags, message", [
    (["--coordinator", "localhost:1234"], "missing --num-processes, --process-id"),
    (["--coordinator", "localhost:1234", "--num-processes", "2", "--process-id", "2"],
     "--process-id must be in [0, 2) for 2 processes, got 2"),
    (["--coordinator", "localhost:1234", "--num-processes", "0", "--process-id", "0"],
     "--num-processes: must be a positive integer"),
    (["--coordinator", "localhost", "--num-processes", "2", "--process-id", "1"],
     "--coordinator 'localhost' must be HOST:PORT"),
    (["--coordinator", "auto", "--num-processes", "2"], "'auto' detects"),
    (["--cpu-devices", "0"], "--cpu-devices: must be a positive integer"),
    (["--mesh", "data=2,pipe=2"], "unknown axis 'pipe'"),
    (["--mesh", "data=3"], "the sizes must multiply to the device count"),
], ids=["partial", "id-too-large", "no-processes", "address", "auto-with-count",
        "cpu-devices", "axis", "mesh-size"])
def test_bad_process_and_mesh_flags_are_refused(flags, message, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(TINY + flags + ["--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not out.exists()


def test_an_unreachable_coordinator_is_named_after_the_timeout(tmp_path, capsys):
    address = f"localhost:{_free_port()}"  # nothing listens there
    out = tmp_path / "run"
    assert main(TINY + ["--coordinator", address, "--num-processes", "2", "--process-id",
                        "1", "--coordinator-timeout", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"no coordinator answered at {address} within 1 s" in err
    assert not out.exists()


def test_a_peer_that_never_joins_is_named_and_exits_2(tmp_path):
    """Process 0 of 2 alone: JAX's own timeout would abort it (status 134, a C++
    stack); it exits 2 after --coordinator-timeout with one line instead, and
    writes no run directory."""
    out = tmp_path / "run"
    coordinator = f"localhost:{_free_port()}"
    proc = _train("--coordinator", coordinator, "--num-processes", "2", "--process-id",
                  "0", "--coordinator-timeout", "3", "--out", str(out))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err[-3000:]
    assert f"waited 3 s for all 2 processes to join at {coordinator}" in err
    assert "Traceback" not in err and len(err.splitlines()) <= 4, err
    assert not out.exists()


def test_a_taken_coordinator_port_is_named(tmp_path, capsys):
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = tmp_path / "run"
        assert main(TINY + ["--coordinator", f"localhost:{port}", "--num-processes", "2",
                            "--process-id", "0", "--out", str(out)]) == 2
    assert f"port {port} is taken on this host" in capsys.readouterr().err
    assert not out.exists()


def test_batch_not_dividing_the_mesh_is_refused_before_compiling():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-m", "jaxformer", *TINY, "--cpu-devices", "4",
                           "--mesh", "data=2,fsdp=2", "--batch", "6"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2
    assert "--batch=6 does not divide over the 4 devices" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_settings_come_from_the_environment():
    env = {"JAXFORMER_COORDINATOR": "10.0.0.1:1234", "JAXFORMER_NUM_PROCESSES": "2",
           "JAXFORMER_PROCESS_ID": "1"}
    assert distributed.settings(environ=env) == distributed.Settings("10.0.0.1:1234", 2, 1)
    assert distributed.settings(environ={}) is None  # one process
    with pytest.raises(ValueError, match="missing JAXFORMER_PROCESS_ID"):
        distributed.settings(environ={k: v for k, v in env.items() if "ID" not in k})
    # Arguments win over the environment, as a whole.
    assert distributed.settings("h:1", 4, 3, environ=env) == distributed.Settings("h:1", 4, 3)

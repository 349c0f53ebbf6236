"""A full disk during `jaxformer train` is one line, and the earlier checkpoint stays
(issue 65 item 8).

The run's checkpoint of step 2 cannot be written: its largest file is beyond the
file size limit (RLIMIT_FSIZE, as `ulimit -f 64` sets it; Python ignores SIGXFSZ,
so the write fails with EFBIG, "File too large", as a full disk fails with
ENOSPC). Before the fix that was 800 lines of Orbax's threads' tracebacks and
tensorstore's callbacks into closed event loops, no line of jaxformer's, and
Orbax's temporary directory `2.orbax-checkpoint-tmp` left behind.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from jaxformer.cli.main import main

from conftest import REPO, snapshot

# The smallest run with a checkpoint every step; --no-cpu-tuning: the first run is
# in-process, where a command must not tune the test process (conftest).
TINY = ["train", "--preset", "tiny", "--layers", "1", "--max-len", "6", "--batch", "8",
        "--steps", "2", "--warmup", "0", "--save-every", "1", "--no-progress",
        "--show", "0", "--eval-examples", "8", "--no-cpu-tuning"]
RESUME = ["--resume", "--no-progress", "--show", "0", "--eval-examples", "8",
          "--no-cpu-tuning"]
# Below a checkpoint's largest file (its arrays, ~230 KB) and above every file the
# run writes before it (config, metrics, the lock); as `ulimit -f 64`.
FILE_LIMIT = 64 * 1024


@pytest.fixture
def run_after_step_1(tmp_path):
    """A run directory as a run leaves it when killed after its checkpoint of step 1
    (of 2): the finished run's later checkpoint and summary removed."""
    out = str(tmp_path / "run")
    assert main(TINY + ["--out", out]) == 0
    os.remove(os.path.join(out, "summary.json"))
    for name in os.listdir(os.path.join(out, "checkpoints")):
        if name != "1":
            shutil.rmtree(os.path.join(out, "checkpoints", name))
    return out


# `python -m jaxformer ARGS` under the limit: set in the child itself (a preexec_fn
# would run Python in a fork of this multithreaded process).
LIMITED = ("import resource, runpy, sys; "
           f"resource.setrlimit(resource.RLIMIT_FSIZE, ({FILE_LIMIT}, {FILE_LIMIT})); "
           "sys.argv[0] = 'jaxformer'; runpy.run_module('jaxformer', run_name='__main__')")


def test_a_checkpoint_beyond_the_disk_is_one_line_and_the_earlier_one_resumes(
        run_after_step_1, capsys):
    out = run_after_step_1
    checkpoints = os.path.join(out, "checkpoints")
    step_1 = snapshot(os.path.join(checkpoints, "1"))
    # JAXFORMER_COMPILE_CACHE=off (conftest): no compile cache entry is written either.
    done = subprocess.run([sys.executable, "-c", LIMITED, "train", "--out", out, *RESUME],
                          capture_output=True, text=True, cwd=REPO, timeout=600,
                          env=dict(os.environ, PYTHONPATH=REPO))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and len(lines) == 1, done.stderr[-3000:]
    assert lines[0] == (f"jaxformer train: no space left to write the checkpoint of step 2 "
                        f"in {checkpoints} (File too large); the checkpoint of step 1 is kept")
    assert os.listdir(checkpoints) == ["1"]  # no temporary directory left
    assert snapshot(os.path.join(checkpoints, "1")) == step_1
    # The disk has room again: the run continues from step 1.
    capsys.readouterr()
    assert main(["train", "--out", out, *RESUME]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["resumed_from"] == 1 and summary["steps"] == 2
    assert sorted(os.listdir(checkpoints)) == ["1", "2"]

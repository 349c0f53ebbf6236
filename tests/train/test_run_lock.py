"""One writer per run directory (`jaxformer.train.run_lock`, issue 47): a second process
is refused naming the holder, the lock of a process that died is taken over, the
lock file and the directories it made go with the release."""

import errno
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from jaxformer.train import run_lock
from jaxformer.train.run_lock import LOCK_NAME, RunLock, RunLockedError

# A second process holding the lock: run_lock.py needs only the standard library, so
# the child loads the file alone (no JAX import: it starts in a fraction of a second).
HOLDER = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("run_lock", sys.argv[1])
module = sys.modules["run_lock"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
module.RunLock(sys.argv[2]).acquire()
print("held", flush=True)
sys.stdin.read()  # until the test closes stdin or kills it
"""


@pytest.fixture
def holder(tmp_path):
    """A child process holding the lock of tmp_path/run (killed at the end)."""
    run = tmp_path / "run"
    child = subprocess.Popen([sys.executable, "-c", HOLDER, run_lock.__file__, str(run)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "held"
    yield run, child
    child.kill()
    child.wait()


def test_a_second_process_is_refused_naming_the_holder(holder):
    run, child = holder
    with pytest.raises(RunLockedError) as info:
        RunLock(run).acquire()
    message = str(info.value)
    assert f"pid {child.pid} on host {socket.gethostname()}" in message
    assert str(run) in message and "\n" not in message
    assert os.listdir(run) == [LOCK_NAME]  # the refused process removed nothing


def test_the_lock_of_a_killed_process_is_taken_over(holder):
    """SIGKILL: the holder cannot clean up; its file stays, the kernel frees the flock."""
    run, child = holder
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert os.listdir(run) == [LOCK_NAME]
    with RunLock(run) as lock:
        assert lock.stale_holder.pid == child.pid
        assert lock.stale_holder.host == socket.gethostname()
        with open(run / LOCK_NAME) as f:
            assert json.load(f)["pid"] == os.getpid()  # the record is the new holder's
    assert os.listdir(run) == []  # released: the file is gone (the child made the folder)


def test_an_exit_without_release_is_stale_and_a_release_is_not(holder):
    run, child = holder
    child.stdin.close()  # the child returns from read() and exits without release()
    child.wait()
    with RunLock(run) as lock:
        assert lock.stale_holder.pid == child.pid
    with RunLock(run) as lock:  # the previous holder released: nothing to take over
        assert lock.stale_holder is None


def test_release_removes_only_the_directories_the_lock_made_if_empty(tmp_path):
    deep = tmp_path / "a" / "b" / "run"
    with RunLock(deep):
        assert os.listdir(deep) == [LOCK_NAME]
    assert not (tmp_path / "a").exists()  # a refused run leaves no directory behind
    with RunLock(deep):
        (deep / "config.json").write_text("{}")
    assert os.listdir(deep) == ["config.json"]  # what the run wrote stays
    existing = tmp_path / "mine"
    existing.mkdir()
    with RunLock(existing):
        pass
    assert existing.is_dir() and os.listdir(existing) == []


def test_the_same_directory_is_refused_within_one_process_too(tmp_path):
    with RunLock(tmp_path) as first:
        with pytest.raises(RunLockedError, match=f"pid {os.getpid()} "):
            RunLock(tmp_path).acquire()
        assert first.stale_holder is None
    assert os.listdir(tmp_path) == []


def _record(path, pid, host):
    path.mkdir(exist_ok=True)
    (path / LOCK_NAME).write_text(json.dumps({"pid": pid, "host": host, "since": None}))


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.fixture
def no_flock(monkeypatch):
    """A file system without flock (some network file systems): ENOLCK."""
    def flock(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", flock)


def test_without_flock_a_live_pid_on_this_host_holds_the_lock(tmp_path, no_flock):
    _record(tmp_path, os.getppid(), socket.gethostname())  # the test runner's parent: alive
    with pytest.raises(RunLockedError, match=f"pid {os.getppid()} on host"):
        RunLock(tmp_path).acquire()
    _record(tmp_path, 1234, "elsewhere")  # cannot be probed from here: trusted alive
    with pytest.raises(RunLockedError, match="no flock; if that run is not running, delete"):
        RunLock(tmp_path).acquire()
    dead = _dead_pid()
    _record(tmp_path, dead, socket.gethostname())
    with RunLock(tmp_path) as lock:
        assert lock.stale_holder.pid == dead

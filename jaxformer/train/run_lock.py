"""One writer per run directory: the lock `jaxformer train` holds for the whole run.

    with RunLock("runs/lm") as lock:   # RunLockedError if another process holds it
        if lock.stale_holder:          # a holder that died without releasing it
            print(f"took over the lock of {lock.stale_holder}")
        ...                            # write checkpoints, metrics.jsonl, ...

The lock is `<run>/train.lock`, a file holding its holder's pid, host and start
time (JSON), locked with `fcntl.flock`. The kernel releases a flock when its
process ends however it ends (Ctrl-C, a crash, SIGKILL), so a lock file whose
flock is free is a stale one, left by a holder that is gone: it is taken over
and `stale_holder` says whose it was. Where the file system has no flock
(some network file systems), the holder's pid is probed instead on the same
host; a holder on another host is then trusted to be alive.

Readers (`generate --run`, `eval --run`, `export --run`) take no lock: they read
the latest complete checkpoint while a run trains.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import fcntl
import json
import os
import socket
from typing import Optional

LOCK_NAME = "train.lock"


class RunLockedError(ValueError):
    """Another live process holds the run directory's lock."""


@dataclasses.dataclass(frozen=True)
class Holder:
    """Who holds (or held) a lock: what its file records."""

    pid: Optional[int]
    host: Optional[str]
    since: Optional[str] = None

    def __str__(self) -> str:
        if self.pid is None:
            return "an unknown process (the lock file records none)"
        since = f" (since {self.since})" if self.since else ""
        return f"pid {self.pid} on host {self.host}{since}"

    @classmethod
    def read(cls, fd: int) -> Optional["Holder"]:
        """The holder recorded in the open lock file `fd`; None if it records none."""
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 4096).decode("utf-8", "replace").strip()
        if not text:
            return None
        try:
            record = json.loads(text)
            return cls(int(record["pid"]), str(record["host"]), record.get("since"))
        except (ValueError, KeyError, TypeError):
            return cls(None, None)


def _this_holder() -> Holder:
    return Holder(os.getpid(), socket.gethostname(),
                  datetime.datetime.now().isoformat(timespec="seconds"))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


class RunLock:
    """The exclusive lock of run directory `run_dir` (created if missing).

    `acquire()` (or `with`) takes it or raises `RunLockedError` naming the holder;
    `release()` removes the lock file, and a run directory this lock created and
    that is still empty (the run was refused before writing anything) with it.
    """

    def __init__(self, run_dir: str):
        self.run_dir = os.fspath(run_dir)
        self.path = os.path.join(self.run_dir, LOCK_NAME)
        self.stale_holder: Optional[Holder] = None
        self._fd: Optional[int] = None
        self._created: list[str] = []  # directories this lock made, deepest last

    def acquire(self) -> "RunLock":
        if self._fd is not None:
            raise RuntimeError(f"{self.path} is already held by this RunLock")
        self._make_dirs()
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                stale = self._lock(fd)
                if self._is_current(fd):
                    break
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # a releasing holder removed the file meanwhile: lock the new one
        self._fd, self.stale_holder = fd, stale
        record = dataclasses.asdict(_this_holder())
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(fd)
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(self.path)  # before the flock goes: no one locks a file being removed
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None
        for directory in reversed(self._created):
            try:
                os.rmdir(directory)  # only if empty: the run wrote nothing
            except OSError:
                break
        self._created = []

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    # -- helpers -----------------------------------------------------------------------

    def _make_dirs(self) -> None:
        missing, directory = [], os.path.abspath(self.run_dir)
        while not os.path.exists(directory):
            missing.append(directory)
            directory = os.path.dirname(directory)
        os.makedirs(self.run_dir, exist_ok=True)
        self._created = missing[::-1]

    def _lock(self, fd: int) -> Optional[Holder]:
        """flock `fd` or raise RunLockedError; the stale holder the file names, if any."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise self._locked(Holder.read(fd)) from None
            if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            return self._probe(Holder.read(fd))  # no flock here: judge by the pid
        return Holder.read(fd)  # still recorded: its holder ended without releasing it

    def _probe(self, holder: Optional[Holder]) -> Optional[Holder]:
        """Without flock: RunLockedError unless `holder` is gone; the stale holder, if any."""
        if holder is None:
            return None
        here = socket.gethostname()
        if holder.pid is None or holder.host != here or (
                holder.pid != os.getpid() and _pid_alive(holder.pid)):
            raise self._locked(holder, hint=f" (this file system has no flock; if that run "
                                            f"is not running, delete {self.path})"
                               if holder.host != here else "")
        return holder

    def _is_current(self, fd: int) -> bool:
        """Whether `fd` is still the file at `path` (not one a releasing holder removed)."""
        try:
            return os.path.samestat(os.fstat(fd), os.stat(self.path))
        except FileNotFoundError:
            return False

    def _locked(self, holder: Optional[Holder], hint: str = "") -> RunLockedError:
        who = holder if holder is not None else "another process (starting up)"
        return RunLockedError(f"run directory {self.run_dir} is in use: its lock "
                              f"{self.path} is held by {who}{hint}; wait for that run to "
                              "end or choose another directory")

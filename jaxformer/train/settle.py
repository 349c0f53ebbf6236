"""Event loops that settle their other tasks before a failure propagates.

Orbax runs a restore as one coroutine in a fresh event loop
(`asyncio.new_event_loop()`, `run_until_complete`, `close()`), and that
coroutine gathers one task per array read. When one read fails (a truncated or
overwritten data file), `asyncio.gather` passes the failure on at once and the
other reads stay pending: the loop closes under them, and Python reports each
one on stderr, when tensorstore completes it into the closed loop ("Event loop
is closed") and when its coroutine is collected, at the latest at interpreter
exit ("Exception ignored in: <coroutine object
_read_array_index_and_device_put>", with a whole TensorStore spec): thousands
of lines for one damaged file.

Inside `settled_on_failure()`, an event loop created in this thread waits, when
the coroutine it runs fails or is interrupted by Ctrl-C, until every other task of
the loop has finished (their results and failures collected, so none is
reported), and only then passes the failure on. Nothing is cancelled unless it is
still running after `SETTLE_TIMEOUT_S`: the reads in flight complete, so
tensorstore never calls back into a closed loop. Success is unchanged, and so are
other threads and the loops made outside the block. Python versions without event
loop policies (3.16) get the plain loops.

`settled_on_failure(every_thread=True)` settles the loops of every thread while
the block runs: an Orbax save writes its arrays from threads of its own, each
running a fresh loop, and the same leak follows one failed write (a full disk).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import warnings
from typing import Any, Iterator

# How long a failed run waits for the tasks still in flight before cancelling
# them (reads of a checkpoint finish; a task waiting on something that never
# comes must not hang the error message). Interrupted by Ctrl-C, less: the reads in
# flight end in milliseconds, and the user is waiting.
SETTLE_TIMEOUT_S = 60.0
INTERRUPTED_SETTLE_TIMEOUT_S = 5.0

_BASE_LOOP = asyncio.ProactorEventLoop if sys.platform == "win32" else asyncio.SelectorEventLoop


class SettlingEventLoop(_BASE_LOOP):  # type: ignore[misc, valid-type]
    """An event loop whose `run_until_complete`, on an `Exception` or a Ctrl-C, first
    runs the loop's other tasks to their end (SystemExit passes at once)."""

    def run_until_complete(self, future: Any) -> Any:
        try:
            return super().run_until_complete(future)
        except Exception:
            self.settle()
            raise
        except KeyboardInterrupt:  # the reads in flight too would call a closed loop
            self.settle(INTERRUPTED_SETTLE_TIMEOUT_S)
            raise

    def settle(self, timeout_s: float | None = None) -> None:
        """Run until no task of this loop is pending (tasks may start others);
        cancel those still running after `timeout_s` (`SETTLE_TIMEOUT_S`) seconds."""
        deadline = self.time() + (SETTLE_TIMEOUT_S if timeout_s is None else timeout_s)
        while pending := [task for task in asyncio.all_tasks(self) if not task.done()]:
            late = (left := deadline - self.time()) <= 0
            if late:  # cancelled, given a second to end, then left alone
                for task in pending:
                    task.cancel()
            super().run_until_complete(asyncio.wait(pending, timeout=1.0 if late else left))
            for task in pending:  # retrieved: not logged as "exception never retrieved"
                if task.done() and not task.cancelled():
                    task.exception()
            if late:
                return


def _asyncio_name(name: str) -> Any:
    """asyncio's policy names, without their deprecation warning (Python 3.14)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Pp]olicy", category=DeprecationWarning)
        return getattr(asyncio, name)


_HAS_POLICIES = hasattr(asyncio, "set_event_loop_policy")


class _Policy(_asyncio_name("AbstractEventLoopPolicy") if _HAS_POLICIES else object):
    """The process's event loop policy, except that `new_event_loop` makes a
    `SettlingEventLoop` in the threads inside `settled_on_failure()`."""

    def __init__(self, previous: Any):
        self.previous = previous
        self.every_thread = 0  # blocks inside that settle every thread's loops

    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        if getattr(_inside, "depth", 0) or self.every_thread:
            return SettlingEventLoop()
        return self.previous.new_event_loop()

    def get_event_loop(self) -> asyncio.AbstractEventLoop:
        return self.previous.get_event_loop()

    def set_event_loop(self, loop: Any) -> None:
        self.previous.set_event_loop(loop)

    def __getattr__(self, name: str) -> Any:  # child watchers (Python < 3.14), and more
        return getattr(self.previous, name)


_inside = threading.local()  # .depth: this thread's nesting of settled_on_failure()
_lock = threading.Lock()
_installed: list = []  # [our policy, the one it replaced, threads inside] while any is


@contextlib.contextmanager
def settled_on_failure(every_thread: bool = False) -> Iterator[None]:
    """Within the block, a failed `run_until_complete` of an event loop that this
    thread creates (`every_thread`: that any thread creates) leaves no task pending
    (see the module docstring)."""
    if not _HAS_POLICIES:
        yield
        return
    with _lock:
        if _installed:
            _installed[2] += 1
        else:
            previous = _asyncio_name("get_event_loop_policy")()
            ours = _Policy(previous)
            _asyncio_name("set_event_loop_policy")(ours)
            _installed[:] = [ours, previous, 1]
        _installed[0].every_thread += every_thread
    _inside.depth = getattr(_inside, "depth", 0) + 1
    try:
        yield
    finally:
        _inside.depth -= 1
        with _lock:
            _installed[2] -= 1
            _installed[0].every_thread -= every_thread
            if _installed[2] == 0:
                ours, previous, _ = _installed
                _installed.clear()
                # The old policy back, unless someone replaced ours meanwhile.
                if _asyncio_name("get_event_loop_policy")() is ours:
                    _asyncio_name("set_event_loop_policy")(previous)

"""Ctrl-C in a `jaxformer` command: one line and exit status 130, whenever it comes.

A Ctrl-C raises KeyboardInterrupt wherever the main thread is. When that is inside
a callback Python calls for itself, a garbage collection callback (JAX has one) or
a `__del__` method, Python cannot pass it on: it prints "Exception ignored in ...",
a traceback, and the command runs on as if no Ctrl-C had come. Inside
`interrupts_surface()` such a swallowed KeyboardInterrupt is delivered again, as a
new SIGINT, and raises where the main thread runs next, where the command's
`except KeyboardInterrupt` sees it; nothing is printed for it.

The command line enters the block in `cli.main.main`, never on import: the hook is
process state, and the library's users keep theirs. Run as the program itself, the
command ends its process right after the line (`end_process`): what libraries do
while a process winds down (threads joined, objects collected, `atexit`) prints
nothing more after a Ctrl-C, and a Ctrl-C then is not another traceback.

Files a command writes appear whole or not at all (`written_whole`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Iterator

INTERRUPTED = 130  # the exit status of a command stopped by Ctrl-C (128 + SIGINT)


@contextlib.contextmanager
def interrupts_surface() -> Iterator[None]:
    """Inside the block, a KeyboardInterrupt that Python would report as unraisable
    (and drop) is raised again in the main thread; other unraisable errors go to the
    hook that was there before."""
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            redeliver_interrupt()
        else:
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        if sys.unraisablehook is hook:  # unless someone replaced ours meanwhile
            sys.unraisablehook = previous


# How long the new SIGINT waits: until the main thread is out of the hook and of the
# callback that swallowed the first one (microseconds; were it still inside one, that
# one is swallowed and delivered again in turn).
REDELIVER_AFTER_S = 0.05


def redeliver_interrupt() -> None:
    """SIGINT again, a moment later, from another thread; its handler runs in the main
    thread (sent at once, the new KeyboardInterrupt would be raised in the hook, and
    dropped again)."""
    timer = threading.Timer(REDELIVER_AFTER_S, signal.raise_signal, (signal.SIGINT,))
    timer.daemon = True
    timer.start()


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """A Ctrl-C inside the block takes effect when the block ends (for code that must
    not be interrupted midway: an extension module's initialisation); in the main
    thread only, where Python runs signal handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:  # to the handler that was there: KeyboardInterrupt, as a rule
            signal.raise_signal(signal.SIGINT)


def end_process(status: int) -> None:
    """Exit now with `status`, stdout and stderr flushed, running nothing else: every
    `with` and `finally` of the command has run (its files are whole or removed)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def ignore_interrupts() -> None:
    """Ctrl-C ignored from now on: the command is done, its exit status stands."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextlib.contextmanager
def written_whole(path: str) -> Iterator[str]:
    """A file to write instead of `path` ("loss.png" -> "loss.part.png": the same
    extension, which plotting reads the format from), renamed to `path` when the
    block ends; removed if it does not end (a Ctrl-C, a full disk)."""
    root, extension = os.path.splitext(path)
    part = f"{root}.part{extension}"
    try:
        yield part
        os.replace(part, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(part)
        raise

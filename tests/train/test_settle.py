"""`settled_on_failure`: a failed event loop run leaves no task pending (issue 48).

The pattern of an Orbax restore, without Orbax: a fresh loop gathers reads, one
fails at once, another is completed later from a thread (as tensorstore does),
and the loop is closed. Outside the block the slow read is left pending and is
reported when collected; inside it, it completes first and nothing is reported.
"""

import asyncio
import gc
import sys
import threading
import time

import pytest

from jaxformer.train import settle
from jaxformer.train.settle import SettlingEventLoop, settled_on_failure


def _restore_like(finished: list) -> None:
    """Run a gather of a failing and a slow read in a fresh loop, then close it."""
    async def failing():
        raise OSError("truncated file")

    async def slow():
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def complete():  # a storage thread, some time later
            time.sleep(0.2)
            try:
                loop.call_soon_threadsafe(done.set_result, "data")
            except RuntimeError:  # the loop was closed under it
                pass

        threading.Thread(target=complete).start()
        try:
            finished.append(await done)
        except BaseException as error:  # as Orbax's read does
            raise Exception("read failed") from error

    async def restore():
        await asyncio.gather(failing(), slow())

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(restore())
    finally:
        loop.close()


def _unraisables(run) -> list:
    seen, hook = [], sys.unraisablehook
    sys.unraisablehook = seen.append
    try:
        run()
        time.sleep(0.3)  # the storage thread's callback, had the loop been closed
        gc.collect()
    finally:
        sys.unraisablehook = hook
    return seen


def test_a_failed_run_settles_its_pending_tasks_only_inside_the_block():
    finished_outside, finished_inside = [], []

    def outside():
        with pytest.raises(OSError, match="truncated file"):
            _restore_like(finished_outside)

    def inside():
        with settled_on_failure(), pytest.raises(OSError, match="truncated file"):
            _restore_like(finished_inside)

    # Without the block: the slow read is abandoned, and reported when collected.
    leaked = _unraisables(outside)
    assert finished_outside == [] and leaked, "the leak this module prevents did not occur"
    assert any("read failed" in str(u.exc_value) for u in leaked)
    # Inside: the same failure, raised after the slow read completed; nothing reported.
    assert _unraisables(inside) == []
    assert finished_inside == ["data"]


def test_only_loops_of_this_thread_inside_the_block_settle_and_the_policy_comes_back():
    before = asyncio.get_event_loop_policy()
    other_thread = []
    with settled_on_failure():
        with settled_on_failure():  # nests
            loop = asyncio.new_event_loop()
        thread = threading.Thread(target=lambda: other_thread.append(asyncio.new_event_loop()))
        thread.start()
        thread.join()
    after = asyncio.new_event_loop()
    assert isinstance(loop, SettlingEventLoop)
    assert not isinstance(other_thread[0], SettlingEventLoop)
    assert not isinstance(after, SettlingEventLoop)
    assert asyncio.get_event_loop_policy() is before
    for made in (loop, other_thread[0], after):
        made.close()


def test_every_thread_settles_the_loops_other_threads_create_inside_the_block():
    """As an Orbax save's writer threads: their fresh loops settle too, and only inside."""
    def loop_of_another_thread():
        made = []
        thread = threading.Thread(target=lambda: made.append(asyncio.new_event_loop()))
        thread.start()
        thread.join()
        return made[0]

    with settled_on_failure(every_thread=True):
        inside = loop_of_another_thread()
        with settled_on_failure():  # a nested block for this thread only keeps it on
            nested = loop_of_another_thread()
    after = loop_of_another_thread()
    assert isinstance(inside, SettlingEventLoop) and isinstance(nested, SettlingEventLoop)
    assert not isinstance(after, SettlingEventLoop)
    for made in (inside, nested, after):
        made.close()


def test_success_is_unchanged_and_a_task_that_never_ends_is_cancelled(monkeypatch):
    monkeypatch.setattr(settle, "SETTLE_TIMEOUT_S", 0.2)
    cancelled = []

    async def forever():
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def main(fail):
        asyncio.get_running_loop().create_task(forever())
        await asyncio.sleep(0)
        if fail:
            raise ValueError("failed")
        return "ok"

    with settled_on_failure():
        loop = asyncio.new_event_loop()
        assert loop.run_until_complete(main(fail=False)) == "ok"  # nothing waited for
        assert cancelled == []
        started = time.perf_counter()
        with pytest.raises(ValueError, match="failed"):
            loop.run_until_complete(main(fail=True))
        assert time.perf_counter() - started < 5
        loop.close()
    assert cancelled  # the never-ending task of the failed run, after the timeout

"""`--dist loadfile` that survives a crashed worker: the test it crashed in runs once more
on the replacement worker (then the rest of its file), and the run ends.

Why: XLA:CPU's compiler has segfaulted a worker a few times (always inside
`backend_compile_and_load`, in different tests, never reproduced alone; see
tests/conftest.py). pytest-xdist 3.8.0 replaces the worker but then hangs under
`loadfile` (pytest-dev/pytest-xdist#1323, #1327: the whole workload, finished files too,
goes back on the queue; a node handed a single test waits forever for a second), so one
crash cost the whole CI run. pytest-rerunfailures reruns crashed tests only under
`--dist load`, which would load each file's models on both workers.

A test that crashes its worker twice is reported failed, as xdist reports any crash;
one that passes on its rerun is reported "rerun" and listed at the end of the run.
"""

from __future__ import annotations

import pytest
from xdist.scheduler import LoadFileScheduling

RERUNS = 1  # a crashed test's further runs on a replacement worker


class CrashRerunScheduling(LoadFileScheduling):
    def __init__(self, config, log=None):
        super().__init__(config, log)
        self.crashes: dict[str, int] = {}  # node id -> crashes so far

    def will_rerun(self, nodeid: str) -> bool:
        return 0 < self.crashes.get(nodeid, 0) <= RERUNS

    def remove_node(self, node):
        """Put back only the unfinished files of a crashed node, first in the queue, with
        the test it crashed in still pending (if it may run again); return that test."""
        workload = self.assigned_work.pop(node)
        unfinished = {scope: unit for scope, unit in workload.items()
                      if not all(unit.values())}
        if not unfinished:
            return None
        scope, unit = next(iter(unfinished.items()))
        crashitem = next(nodeid for nodeid, done in unit.items() if not done)
        self.crashes[crashitem] = self.crashes.get(crashitem, 0) + 1
        if not self.will_rerun(crashitem):
            unit[crashitem] = True  # reported failed; the rest of its file still runs
            if all(unit.values()):
                del unfinished[scope]
        for scope, unit in reversed(list(unfinished.items())):
            self.workqueue[scope] = unit
            self.workqueue.move_to_end(scope, last=False)
        for other in self.assigned_work:
            self._reschedule(other)
        return crashitem

    def _reschedule(self, node):
        super()._reschedule(node)
        # A worker runs a test once it holds the next one (or is told to stop): one
        # left holding a single test, as a replacement can be, would wait forever.
        while (not node.shutting_down and self.workqueue
               and self._pending_of(self.assigned_work[node]) < 2):
            self._assign_work_unit(node)
        if (not node.shutting_down and not self.workqueue
                and self._pending_of(self.assigned_work[node]) < 2):
            node.shutdown()


# The hooks: tests/conftest.py imports them; `-p tests.crash_rerun` loads them elsewhere.
@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """The scheduler for `--dist loadfile`; None (xdist's own) for other modes."""
    if config.getvalue("dist") != "loadfile":
        return None
    return CrashRerunScheduling(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    if isinstance(sched, CrashRerunScheduling) and sched.will_rerun(crashitem):
        report.outcome = "rerun"


def pytest_report_teststatus(report):
    if report.outcome == "rerun":
        return "rerun", "R", ("RERUN", {"yellow": True})
    return None


def pytest_terminal_summary(terminalreporter, config):
    sched = getattr(config.pluginmanager.getplugin("dsession"), "sched", None)
    for nodeid, count in getattr(sched, "crashes", {}).items():
        terminalreporter.line(f"crashed its worker: {nodeid} ({count}x, "
                              f"{'passed on its rerun' if count <= RERUNS else 'failed'})")

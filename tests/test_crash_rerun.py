"""tests/crash_rerun.py: under `-n 2 --dist loadfile`, a test that segfaults its worker
runs once more on the replacement worker, the rest of its file runs, and the run ends
green (xdist alone reports the crash as a failure, and can hang after it); a test that
crashes every time is reported failed."""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("xdist", reason="needs the `test` extra (pytest-xdist)")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEGFAULT = "import ctypes; ctypes.string_at(0)"


def run_suite(tmp_path, crash_when: str) -> subprocess.CompletedProcess:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    for name in "acd":  # files before and after the crashing one, on either worker
        (tmp_path / f"test_{name}.py").write_text("def test_one(): pass\ndef test_two(): pass\n")
    (tmp_path / "test_b.py").write_text(textwrap.dedent(f"""
        import pathlib
        MARK = pathlib.Path(__file__).with_name("crashed")

        def test_before(): pass

        def test_crash():
            if {crash_when}:
                MARK.write_text("x")
                {SEGFAULT}

        def test_after(): pass
        """))
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.crash_rerun", "-n", "2",
                           "--dist", "loadfile", "-p", "no:cacheprovider", "-q"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)


def test_a_test_that_crashes_once_passes_on_its_rerun(tmp_path):
    out = run_suite(tmp_path, crash_when="not MARK.exists()")
    assert out.returncode == 0, out.stdout[-3000:]
    assert "9 passed, 1 rerun" in out.stdout, out.stdout[-3000:]
    assert "crashed its worker: test_b.py::test_crash (1x, passed on its rerun)" in out.stdout


def test_a_test_that_always_crashes_fails_and_its_file_goes_on(tmp_path):
    out = run_suite(tmp_path, crash_when="True")
    assert out.returncode == 1, out.stdout[-3000:]
    assert "1 failed, 8 passed, 1 rerun" in out.stdout, out.stdout[-3000:]
    assert "crashed its worker: test_b.py::test_crash (2x, failed)" in out.stdout

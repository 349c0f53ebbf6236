"""The quantized kernel's other instruction sets, on any x86 machine: the AVX2 path
(no VNNI, no AVX-512: `-march=haswell`, what an AMD EPYC of the Zen 2 kind runs) and
the wide AVX-512 VNNI path (`-march=icelake-server`) are each built and hold their own
instructions; the AVX2 build, where this CPU can run it, computes what the plain path
computes (a subprocess runs test_qmatmul.py's kernel tests against it). The native
build's run is test_qmatmul.py itself."""

import os
import shutil
import subprocess
import sys

import pytest

from jaxformer.backends import qmatmul

from conftest import REPO

# -march target -> (instructions its build must hold, that it must not, CPU flags to run it)
TARGETS = {"haswell": ({"vpmaddubsw", "vpmaddwd"}, {"zmm", "vpdpbusd"},
                       {"avx2", "fma", "f16c", "bmi2"}),
           "icelake-server": ({"zmm", "vpdpbusd"}, set(),
                              {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"})}
KERNEL_TESTS = "(kernel_equals and 13) or many_rows or k_quant_kernel"

pytestmark = pytest.mark.skipif(os.uname().machine not in ("x86_64", "AMD64"),
                                reason="the AVX2 and AVX-512 paths are x86's")


def cpu_flags() -> set:
    with open("/proc/cpuinfo") as f:
        return {flag for line in f if line.startswith("flags") for flag in line.split()[2:]}


@pytest.fixture(scope="module")
def cache_home(tmp_path_factory):
    """One kernel cache for this file's builds (the subprocess finds the AVX2 one)."""
    folder = str(tmp_path_factory.mktemp("xdg"))
    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = folder
    yield folder
    if before is None:
        del os.environ["XDG_CACHE_HOME"]
    else:
        os.environ["XDG_CACHE_HOME"] = before


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) is missing")
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_each_instruction_set_is_built_with_its_own_instructions(cache_home, target):
    must, must_not, _ = TARGETS[target]
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", qmatmul.build(target)],
                          capture_output=True, text=True, check=True).stdout
    words = set(text.replace(",", " ").replace("%", " ").split())
    held = {w for w in must | must_not if w in words or any(w in x for x in words)}
    assert must <= held, f"{target}: missing {sorted(must - held)}"
    assert not must_not & held, f"{target}: holds {sorted(must_not & held)}"


def test_the_avx2_path_equals_the_plain_path(cache_home):
    if not TARGETS["haswell"][2] <= cpu_flags():
        pytest.skip("this CPU cannot run AVX2 code")
    env = {**os.environ, qmatmul.ARCH_VARIABLE: "haswell", "PYTHONPATH": REPO}
    folder = os.path.dirname(qmatmul.build("haswell"))
    before = set(os.listdir(folder))
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-n", "0", "-p",
         "no:cacheprovider", os.path.join(REPO, "tests", "backends", "test_qmatmul.py"),
         "-k", KERNEL_TESTS], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    summary = (out.stdout.strip().splitlines() or [""])[-1]
    assert out.returncode == 0 and " passed" in summary and "failed" not in summary, (
        out.stdout[-3000:] + out.stderr[-2000:])
    assert set(os.listdir(folder)) == before  # it loaded the AVX2 build, built no other


def test_a_bad_target_name_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv(qmatmul.ARCH_VARIABLE, "haswell; rm -rf /")
    with pytest.raises(RuntimeError, match="JAXFORMER_KERNEL_ARCH=.* is not a -march target"):
        qmatmul.arch()

"""Each kernel header compiles on its own: it includes what it uses (no type it needs is
defined only in the .cc that includes it), and every header is in the build's cache key."""

import glob
import os
import shutil
import subprocess

import jax
import pytest

from jaxformer.backends import qmatmul

HEADERS = sorted(glob.glob(os.path.join(qmatmul.KERNELS, "*.h")))
# Every instruction-set branch of the headers, so code under #if AVX-512 is checked too
# (-fsyntax-only generates no code: the build machine's CPU does not matter).
ISA_FLAGS = {"baseline": (), "avx512": ("-mavx2", "-mf16c", "-mfma", "-mavx512f", "-mavx512bw",
                                        "-mavx512vl", "-mavx512vnni")}


def test_every_header_is_part_of_the_build_cache_key():
    assert sorted(qmatmul.HEADERS) == HEADERS


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ on the PATH")
@pytest.mark.parametrize("isa", sorted(ISA_FLAGS))
@pytest.mark.parametrize("header", HEADERS, ids=os.path.basename)
def test_header_compiles_alone(header, isa):
    command = ["g++", "-fsyntax-only", "-std=c++17", *ISA_FLAGS[isa],
               f"-I{jax.ffi.include_dir()}", "-x", "c++", header]
    out = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]

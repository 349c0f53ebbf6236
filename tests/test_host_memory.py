"""jaxformer.host_memory: XLA:CPU's temporaries reuse freed memory instead of faulting
fresh pages in at every execution. Each case runs in a fresh process: the setting
only takes before JAX's backend starts."""

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="keep_freed_memory sets glibc's malloc; this C library is not glibc")

# A program whose 64 MiB temporary (the first product) XLA allocates per execution,
# run 12 times after 5 warm-up runs; prints the median of the minor page faults per
# run. (A temporary is freed a little after its execution returns, so the heap can
# still grow now and then, more so on a busy machine: the median is the steady state.)
FAULTS_PER_CALL = """
import json, resource, statistics
import jax, jax.numpy as jnp
import jaxformer
x, w, u = jnp.ones((16384, 64)), jnp.ones((64, 1024)), jnp.ones((1024,))
f = jax.jit(lambda x, w, u: (x @ w) @ u)
for _ in range(5):
    f(x, w, u).block_until_ready()
faults = []
for _ in range(12):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x, w, u).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"kept": jaxformer.KEEPS_FREED_MEMORY, "faults": statistics.median(faults)}))
"""

TOO_LATE = """
import json, jax
jax.devices()  # the backend starts first
import jaxformer
from jaxformer import host_memory
print(json.dumps({"kept": jaxformer.KEEPS_FREED_MEMORY, "again": host_memory.keep_freed_memory()}))
"""


def run(code: str, **env) -> dict:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=repo, **env)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=repo,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_temporaries_are_not_faulted_in_again_at_every_execution():
    pages = 64 * 2 ** 20 // 4096  # of the temporary
    kept = run(FAULTS_PER_CALL)
    default = run(FAULTS_PER_CALL, JAXFORMER_KEEP_FREED_MEMORY="0")
    assert kept["kept"] and not default["kept"]
    # glibc's default: a fresh mmap per execution, every page faulted in again.
    assert default["faults"] > 0.9 * pages
    assert kept["faults"] < 0.1 * pages


def test_does_nothing_once_the_backend_has_started():
    assert run(TOO_LATE) == {"kept": False, "again": False}


DISPATCH = """
import json, jaxformer
from jax._src import xla_bridge
print(json.dumps({"kept": jaxformer.KEEPS_FREED_MEMORY,
                  "async": xla_bridge._CPU_ENABLE_ASYNC_DISPATCH.value}))
"""


def test_one_device_calls_run_inline_unless_the_environment_says_otherwise():
    assert run(DISPATCH) == {"kept": True, "async": False}
    assert run(DISPATCH, JAX_CPU_ENABLE_ASYNC_DISPATCH="1") == {"kept": True, "async": True}
    assert run(DISPATCH, JAXFORMER_KEEP_FREED_MEMORY="0") == {"kept": False, "async": True}

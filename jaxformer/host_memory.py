"""Host memory: XLA:CPU's temporaries reuse freed memory instead of faulting it in each step.

XLA:CPU allocates the temporaries of every execution in one block (255 MiB for
the bench train step) with `malloc` and frees it when the execution ends. glibc
serves a block that large with a fresh `mmap` and returns it with `munmap`, so
every step faulted its temporaries in again, a 4 KiB page at a time: 72,000
minor faults and about 110 ms of kernel time per bench train step summed over
both cores, 231-253 ms a step against 177-186 ms with the memory kept
(alternating processes on a 2-core CPU; the same parameters bit for bit). The cost fell on the kernels that
first write a temporary: broadcasts, copies and dropout masks ran 2-5x slower.

`keep_freed_memory()` changes two things, before JAX's CPU backend starts:

- glibc's malloc (`mallopt`) never uses `mmap` (`M_MMAP_MAX` 0) and does not
  return freed memory at the top of its heap to the system (`M_TRIM_THRESHOLD`
  unbounded): what tcmalloc or jemalloc do by default. The next step reuses the
  pages already faulted in; the process's resident memory stays at its peak
  instead of falling back between steps.
- JAX's CPU client runs a one-device computation on the calling thread
  (`jax_cpu_enable_async_dispatch` False) instead of a worker thread. The block
  is then allocated from the main heap: a worker thread's glibc arena grows in
  heaps of at most 64 MiB and maps anything larger afresh whatever `mallopt`
  says. (One arena for every thread would do it too, but XLA's compiler threads
  then contend for it: the bench train step compiled in 8.6-10.2 s instead of
  7.6-8.5.) A call on a CPU device returns when its result is ready; a train
  step's dispatch, a fraction of a millisecond, no longer overlaps the step.
  Computations over several devices, and GPUs and TPUs, dispatch as before.

`import jaxformer` calls it. `JAXFORMER_KEEP_FREED_MEMORY=0` opts out; an
explicit `JAX_CPU_ENABLE_ASYNC_DISPATCH` in the environment is left as set; on a
C library other than glibc, or once JAX's backends have started, it does nothing.
"""

from __future__ import annotations

import ctypes
import os
import platform

import jax

# mallopt's parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_NEVER = -1  # M_TRIM_THRESHOLD is a size_t inside glibc: -1 is its largest value
OPT_OUT = "JAXFORMER_KEEP_FREED_MEMORY"


def _backends_started() -> bool:
    try:
        from jax._src import xla_bridge  # noqa: PLC0415 (JAX's own, not public API)
        return xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):  # another JAX: assume started, change nothing
        return True


def keep_freed_memory() -> bool:
    """Keep freed host memory for reuse (no mmap, no trim; one-device CPU calls inline).

    Returns True if it took effect; False, changing nothing, if
    `JAXFORMER_KEEP_FREED_MEMORY=0`, the C library is not glibc, or JAX's
    backends have already started (the CPU client's dispatch is fixed then).
    """
    if os.environ.get(OPT_OUT, "1") == "0":
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if _backends_started():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    if not all(mallopt(param, value) == 1
               for param, value in ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _NEVER))):
        return False
    if "JAX_CPU_ENABLE_ASYNC_DISPATCH" not in os.environ:
        jax.config.update("jax_cpu_enable_async_dispatch", False)
    return True

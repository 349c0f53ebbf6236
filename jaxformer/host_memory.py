"""Host memory: freed memory kept for reuse, so XLA:CPU's temporaries fault in once.

XLA:CPU allocates the temporaries of every execution in one block (255 MiB for
the bench train step) with `malloc`, on one of its worker threads, and frees it
when the execution ends. glibc serves a block that large with a fresh `mmap`
(always, from a worker thread's arena) and returns it with `munmap`, so every
step faults its temporaries in again, a 4 KiB page at a time: 72,000 minor
faults and about 110 ms of kernel time per bench train step summed over both
cores, 231-253 ms a step against 203-220 ms with the memory kept (three
processes each, alternating, on a 2-core CPU). The cost is in the kernels that
first write a temporary: broadcasts, copies and dropout masks ran 2-5x slower.

`keep_freed_memory()` tells glibc's malloc, through `mallopt`, what tcmalloc or
jemalloc do by default: every thread allocates from one heap (`M_ARENA_MAX` 1),
never with `mmap` (`M_MMAP_MAX` 0), and freed memory at the top of the heap is
not returned to the system (`M_TRIM_THRESHOLD` unbounded), so the next step
reuses the pages already faulted in. The process's resident memory then stays
at its peak instead of falling back between steps; nothing else changes.

It has to run before JAX's CPU backend starts (the first computation or
`jax.devices()`): a thread that has allocated keeps the arena it had. `import
jaxformer` calls it (unless `JAXFORMER_KEEP_FREED_MEMORY=0`); on a C library
other than glibc, or once the backend has started, it does nothing.
"""

from __future__ import annotations

import ctypes
import os
import platform

from jax._src import xla_bridge

# mallopt's parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_NEVER = -1  # M_TRIM_THRESHOLD is a size_t inside glibc: -1 is its largest value
OPT_OUT = "JAXFORMER_KEEP_FREED_MEMORY"


def keep_freed_memory() -> bool:
    """Keep freed host memory in the process for reuse (one arena, no mmap, no trim).

    Returns True if glibc took the settings; False, changing nothing, if
    `JAXFORMER_KEEP_FREED_MEMORY=0`, the C library is not glibc, or JAX's
    backends have already started (too late to reach XLA's worker threads).
    """
    if os.environ.get(OPT_OUT, "1") == "0":
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if xla_bridge.backends_are_initialized():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in (
        (_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _NEVER)))

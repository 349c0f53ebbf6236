"""Hand freed host memory back to the operating system (glibc's `malloc_trim`).

Compiling an XLA program (on any backend: the compiler runs on the host) and
reading a checkpoint allocate and free hundreds of megabytes of small blocks;
glibc keeps freed heap memory for reuse, so a long-lived process (a server
between requests) keeps that peak as resident memory. `release_freed()` asks
glibc to return it. It is called, not run on import; elsewhere (macOS, musl,
Windows) it does nothing and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Optional


@functools.lru_cache(maxsize=1)
def glibc() -> Optional[ctypes.CDLL]:
    """The C library if it is glibc (has `malloc_trim`), else None."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim  # noqa: B018 - glibc only
    except (OSError, AttributeError, TypeError):
        return None
    return libc


def release_freed() -> bool:
    """Return freed heap memory to the OS (`malloc_trim(0)`); False where there is no glibc."""
    libc = glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True

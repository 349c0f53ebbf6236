"""Hand freed host memory back to the operating system (glibc's `malloc_trim`).

Compiling an XLA program (on any backend: the compiler runs on the host) and
reading a checkpoint allocate and free hundreds of megabytes of small blocks;
glibc keeps freed heap memory for reuse, so a long-lived process (a server
between requests) keeps that peak as resident memory. `release_freed()` asks
glibc to return it. It is called, not run on import; elsewhere (macOS, musl,
Windows) it does nothing and says so.

On Linux it also takes back the transparent-huge-page advice left on freed heap
ranges: NumPy advises each large array for huge pages, and where the array sits in
the heap (a tuned process keeps every allocation there, `cpu.tune_process`) the
advice outlives it, so the kernel's khugepaged later fills the trimmed range back
in 2 MB pages (+12 MB on an idle SmolLM2 server, seconds after its last request).
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


MADV_NOHUGEPAGE = 15  # <sys/mman.h>, Linux


def heap_huge_page_ranges() -> list[tuple[int, int]]:
    """(start, length) of each heap range advised for transparent huge pages (its
    VmFlags hold "hg" in /proc/self/smaps); [] where there is no such file."""
    ranges, heap_range = [], None
    try:
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                fields = line.split()
                if fields and not fields[0].endswith(":"):  # a mapping's first line
                    heap_range = fields[0] if fields[-1] == "[heap]" else None
                elif heap_range and fields[0] == "VmFlags:" and "hg" in fields[1:]:
                    start, end = (int(x, 16) for x in heap_range.split("-"))
                    ranges.append((start, end - start))
    except OSError:
        return []
    return ranges


def release_freed() -> bool:
    """Return freed heap memory to the OS (`malloc_trim(0)`) and take back the heap's
    huge-page advice (module docstring); False where there is no glibc."""
    libc = glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    for start, length in heap_huge_page_ranges():
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), MADV_NOHUGEPAGE)
    return True

"""backends.host_memory: freed heap memory goes back to the OS when asked (glibc)."""

import ctypes
import os

import pytest

from jaxformer.backends import host_memory


def rss_anon_mb() -> float:
    with open(f"/proc/{os.getpid()}/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    pytest.skip("no /proc/self/status RssAnon")


def test_release_freed_returns_the_heap_hole():
    if host_memory.glibc() is None:
        assert host_memory.release_freed() is False
        pytest.skip("not glibc: nothing to release")
    blocks = [bytes(2000) + bytes([i % 256]) for i in range(40_000)]  # ~80 MB of heap
    pin = [bytes(3000) + bytes([1])]  # above them: free() alone cannot shrink the heap
    del blocks
    before = rss_anon_mb()
    assert host_memory.release_freed() is True
    after = rss_anon_mb()
    assert before - after > 40, (before, after)
    del pin


def test_release_freed_takes_back_the_heaps_huge_page_advice():
    """A heap range advised for huge pages (as NumPy advises a large array placed there)
    keeps the advice after the array is freed; `release_freed` takes it back, so the
    kernel does not fill the trimmed range in 2 MB pages."""
    libc = host_memory.glibc()
    if libc is None or not os.path.exists("/proc/self/smaps"):
        pytest.skip("needs glibc and /proc/self/smaps")
    with open("/proc/self/smaps") as smaps:
        heap = next(line.split()[0] for line in smaps if line.rstrip().endswith("[heap]"))
    start, end = (int(x, 16) for x in heap.split("-"))
    page = os.sysconf("SC_PAGE_SIZE")
    assert end - start >= 4 * page, "the heap is too small for the test"
    advised = (start + page, 2 * page)
    assert libc.madvise(ctypes.c_void_p(advised[0]), ctypes.c_size_t(advised[1]),
                        14) == 0  # MADV_HUGEPAGE
    assert advised in host_memory.heap_huge_page_ranges()
    host_memory.release_freed()
    assert host_memory.heap_huge_page_ranges() == []

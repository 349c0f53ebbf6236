"""backends.host_memory: freed heap memory goes back to the OS when asked (glibc)."""

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

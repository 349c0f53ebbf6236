"""The page pool of the serving engine's KV cache, in plain Python (no JAX here).

The keys and values of every running request live in one pool of fixed-size
pages (`page_size` tokens each); a request's page table lists its pages in
order, so its token at position p sits in page `table[p // page_size]` at
offset `p % page_size`. Pages are taken when a request needs them and
returned when it ends (vLLM's block manager).

Page ids run 1..num_pages: id 0 is the null page, what an unused table entry
points at and where writes that belong to no request go (the device pool has
num_pages + 1 pages).

Prefix caching. A full page is keyed by a hash chain over its tokens:
`key_i = H(key_{i-1}, tokens of page i)`, so equal keys mean equal whole
prefixes, not just equal pages. A later request whose prompt starts with the
same full pages takes them (reference counted) instead of computing their keys
and values again. A cached page whose count drops to 0 stays in the pool,
evictable; when no free page is left the least recently used one is taken
(and forgotten by the cache).
"""

from __future__ import annotations

import collections
import hashlib
from typing import Optional, Sequence

import numpy as np

NULL_PAGE = 0


class OutOfPages(RuntimeError):
    """No free or evictable page is left in the pool."""


def chain_hash(parent: Optional[bytes], tokens: Sequence[int]) -> bytes:
    """The key of a full page: a digest of its parent's key and its token ids."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent or b"root")
    digest.update(np.asarray(tokens, np.int64).tobytes())
    return digest.digest()


def page_keys(tokens: Sequence[int], page_size: int,
              root: Optional[bytes] = None) -> list[bytes]:
    """The chain keys of the full pages of `tokens` (a trailing partial page has none);
    `root`: the first page's parent (`PageTable.root`)."""
    keys, parent = [], root
    for start in range(0, len(tokens) - page_size + 1, page_size):
        parent = chain_hash(parent, tokens[start:start + page_size])
        keys.append(parent)
    return keys


class PagePool:
    """Free list, reference counts and the prefix cache of `num_pages` pages.

    Not thread-safe: the engine's step thread owns it.
    """

    def __init__(self, num_pages: int, page_size: int, *, prefix_cache: bool = True):
        for name, value in (("num_pages", num_pages), ("page_size", page_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_pages, self.page_size, self.prefix_cache = num_pages, page_size, prefix_cache
        self.free: collections.deque[int] = collections.deque(range(1, num_pages + 1))
        self.refs: dict[int, int] = {}                  # page -> requests holding it
        self.key_of: dict[int, bytes] = {}              # cached page -> its chain key
        self.page_of: dict[bytes, int] = {}             # chain key -> cached page
        # Cached pages nobody holds, least recently used first (evictable).
        self.idle: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.hits = self.lookups = 0                    # prefix tokens found / looked up

    @property
    def available(self) -> int:
        """Pages that can be taken now: free ones plus evictable cached ones."""
        return len(self.free) + len(self.idle)

    def take(self) -> int:
        """One page for a request (reference count 1): a free one, else the least
        recently used idle cached page (evicted). Raises OutOfPages."""
        if self.free:
            page = self.free.popleft()
        elif self.idle:
            page, _ = self.idle.popitem(last=False)
            del self.page_of[self.key_of.pop(page)]
        else:
            raise OutOfPages(f"all {self.num_pages} pages are in use")
        self.refs[page] = 1
        return page

    def release(self, page: int) -> None:
        """Drop one reference; at 0 a cached page turns idle (newest), another is free."""
        count = self.refs[page] - 1
        if count:
            self.refs[page] = count
            return
        del self.refs[page]
        if page in self.key_of:
            self.idle[page] = None
        else:
            self.free.append(page)

    def register(self, page: int, key: bytes) -> None:
        """Make a full page (held by the caller) findable by its chain key. A key
        already cached keeps its page; this one stays private and is freed later."""
        if self.prefix_cache and key not in self.page_of and page not in self.key_of:
            self.page_of[key] = page
            self.key_of[page] = key

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """The cached pages of the longest run of `keys` from the first, each with
        one more reference (idle ones are no longer evictable)."""
        pages = []
        if self.prefix_cache:
            for key in keys:
                page = self.page_of.get(key)
                if page is None:
                    break
                pages.append(page)
                if page in self.idle:
                    del self.idle[page]
                    self.refs[page] = 1
                else:
                    self.refs[page] += 1
        return pages

    def count_lookup(self, looked_up: int, found: int) -> None:
        self.lookups += looked_up
        self.hits += found

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache / prompt tokens looked up."""
        return self.hits / self.lookups if self.lookups else 0.0


class PageTable:
    """One request's pages in order, and its full pages' chain keys.

    `adapter`: the parameter set the pages are computed with (`Request.adapter`, None =
    the base): it roots the hash chain, so requests share pages only within one set
    (the same tokens give other keys and values under an adapter's weights)."""

    def __init__(self, pool: PagePool, max_pages: int, adapter: Optional[str] = None):
        self.pool, self.max_pages = pool, max_pages
        self.root = None if adapter is None else b"adapter\0" + adapter.encode()
        self.pages: list[int] = []
        self.keys: list[bytes] = []   # chain keys of pages[0..len(keys)-1] (registered)

    def reuse_prefix(self, tokens: Sequence[int], limit: int) -> int:
        """Take the cached full pages that start `tokens`, at most `limit` tokens'
        worth; returns the number of tokens they hold."""
        size = self.pool.page_size
        keys = page_keys(tokens[:limit - limit % size], size, self.root)
        pages = self.pool.match(keys)
        self.pages.extend(pages)
        self.keys.extend(keys[:len(pages)])
        self.pool.count_lookup(len(tokens), len(pages) * size)
        return len(pages) * size

    def ensure(self, length: int) -> None:
        """Pages enough to hold `length` tokens."""
        needed = -(-length // self.pool.page_size)
        if needed > self.max_pages:
            raise OutOfPages(f"{length} tokens need {needed} pages, a table has {self.max_pages}")
        while len(self.pages) < needed:
            self.pages.append(self.pool.take())

    def register_full(self, tokens: Sequence[int]) -> None:
        """Register every page that `tokens` (all written to the pool) fill."""
        size = self.pool.page_size
        while (len(self.keys) + 1) * size <= len(tokens):
            i = len(self.keys)
            key = chain_hash(self.keys[-1] if self.keys else self.root,
                             tokens[i * size:(i + 1) * size])
            self.pool.register(self.pages[i], key)
            self.keys.append(key)

    def row(self) -> np.ndarray:
        """(max_pages,) int32: the pages, then the null page."""
        row = np.full((self.max_pages,), NULL_PAGE, np.int32)
        row[:len(self.pages)] = self.pages
        return row

    def free(self) -> None:
        """Return every page (shared ones lose one reference)."""
        for page in self.pages:
            self.pool.release(page)
        self.pages, self.keys = [], []

"""The page pool alone: free list, reference counts, the hash chain, LRU eviction."""

import pytest

from jaxformer.serve.pages import NULL_PAGE, OutOfPages, PagePool, PageTable, chain_hash, page_keys


def test_pages_are_taken_and_returned():
    pool = PagePool(3, 4)
    table = PageTable(pool, max_pages=3)
    table.ensure(5)                      # 5 tokens: 2 pages
    assert len(table.pages) == 2 and NULL_PAGE not in table.pages
    assert pool.available == 1
    assert list(table.row()) == table.pages + [NULL_PAGE]
    table.free()
    assert pool.available == 3 and not pool.refs


def test_out_of_pages_and_table_bound():
    pool = PagePool(2, 4)
    a, b = PageTable(pool, 2), PageTable(pool, 2)
    a.ensure(8)
    with pytest.raises(OutOfPages):
        b.ensure(1)
    with pytest.raises(OutOfPages, match="3 pages"):
        a.ensure(9)


def test_hash_chain_keys_the_whole_prefix():
    # The same page content after a different first page gets a different key.
    k1 = page_keys([1, 2, 3, 4, 5, 6], 2)
    k2 = page_keys([9, 9, 3, 4, 5, 6], 2)
    assert len(k1) == 3 and k1[0] != k2[0] and k1[1] != k2[1]
    assert k1[1] == chain_hash(k1[0], [3, 4])
    assert page_keys([1, 2, 3], 2) == k1[:1]     # a partial page has no key


def test_prefix_pages_are_shared_with_refcounts():
    pool = PagePool(8, 2)
    prompt = [5, 6, 7, 8, 9]
    first = PageTable(pool, 4)
    first.ensure(len(prompt))
    first.register_full(prompt)              # pages of [5,6] and [7,8]; 9 is partial
    second = PageTable(pool, 4)
    assert second.reuse_prefix(prompt, limit=len(prompt) - 1) == 4
    assert second.pages == first.pages[:2]
    assert all(pool.refs[p] == 2 for p in second.pages)
    assert pool.hit_rate == 4 / 5
    first.free()
    assert all(pool.refs[p] == 1 for p in second.pages)
    second.free()
    assert not pool.refs and len(pool.idle) == 2    # cached, idle, still findable
    third = PageTable(pool, 4)
    assert third.reuse_prefix([5, 6, 7, 8, 1], 4) == 4
    # A different second page: only the first is shared.
    fourth = PageTable(pool, 4)
    assert fourth.reuse_prefix([5, 6, 0, 8, 1], 4) == 2


def test_limit_keeps_the_last_prompt_token_uncached():
    pool = PagePool(4, 2)
    t = PageTable(pool, 4)
    t.ensure(4)
    t.register_full([1, 2, 3, 4])
    again = PageTable(pool, 4)
    assert again.reuse_prefix([1, 2, 3, 4], limit=3) == 2


def test_lru_eviction_takes_the_least_recently_used_idle_page():
    pool = PagePool(3, 1)
    tables = []
    for token in (10, 11, 12):
        t = PageTable(pool, 1)
        t.ensure(1)
        t.register_full([token])
        tables.append(t)
    page_of = {tok: t.pages[0] for tok, t in zip((10, 11, 12), tables)}
    for t in (tables[1], tables[0], tables[2]):     # idle order: 11, 10, 12
        t.free()
    assert pool.available == 3 and not pool.free
    newcomer = PageTable(pool, 1)
    newcomer.ensure(1)
    assert newcomer.pages == [page_of[11]]          # the oldest idle page
    assert PageTable(pool, 1).reuse_prefix([11, 0], 1) == 0   # forgotten
    assert PageTable(pool, 1).reuse_prefix([10, 0], 1) == 1   # still cached
    # A reused page is no longer evictable: the next take evicts 12, not 10.
    other = PageTable(pool, 1)
    other.ensure(1)
    assert other.pages == [page_of[12]]
    with pytest.raises(OutOfPages):
        PageTable(pool, 1).ensure(1)


def test_duplicate_key_stays_private_and_off_cache():
    pool = PagePool(4, 2, prefix_cache=True)
    a, b = PageTable(pool, 2), PageTable(pool, 2)
    for t in (a, b):
        t.ensure(2)
        t.register_full([3, 4])
    assert pool.page_of[a.keys[0]] == a.pages[0]
    b.free()
    assert b.pages == [] and pool.available == 3 and len(pool.free) == 3


def test_prefix_cache_off_shares_nothing():
    pool = PagePool(4, 2, prefix_cache=False)
    a = PageTable(pool, 2)
    a.ensure(4)
    a.register_full([1, 2, 3, 4])
    assert PageTable(pool, 2).reuse_prefix([1, 2, 3, 4, 5], 4) == 0
    a.free()
    assert len(pool.free) == 4


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_bad_sizes(value):
    with pytest.raises(ValueError, match="num_pages"):
        PagePool(value, 4)

"""nn.paged_kv: pages read and new slots written through a page table, against numpy
(position p of a row at pool slot table[p // Z] * Z + p % Z), both cache layouts and
the int8 cache."""

import numpy as np
import pytest

from jaxformer.nn import KV
from jaxformer.nn.kv_quant import QuantKV
from jaxformer.nn.paged_kv import PagedKV, read, write

G, K, Z, N = 2, 4, 4, 6  # kv heads, head dim, page size, pool pages (+ the null page)
P = (N + 1) * Z


def layout(x_GPK, axis):
    """(G, P, K) -> the pool's (1, G, P, K) (axis 2) or (1, P, G, K) (axis 1)."""
    return (x_GPK if axis == 2 else np.swapaxes(x_GPK, 0, 1))[None]


@pytest.mark.parametrize("axis", [2, 1], ids=["heads_major", "jax_layout"])
def test_write_then_read_match_numpy(axis):
    rng = np.random.default_rng(0)
    keys, values = (rng.normal(size=(G, P, K)).astype(np.float32) for _ in range(2))
    table = np.asarray([[3, 1, 0], [5, 2, 6]], np.int32)  # row 1 reads three pages
    slots = np.asarray([[1 * Z + 2, 0], [6 * Z + 0, 6 * Z + 1]], np.int32)  # row 0: one new
    new_BGCK = rng.normal(size=(2, G, 2, K)).astype(np.float32)
    new = (new_BGCK, new_BGCK + 1)
    if axis == 1:
        new = tuple(np.swapaxes(x, 1, 2) for x in new)
    cache = PagedKV(KV(layout(keys, axis), layout(values, axis)), table, slots, Z, axis)
    pool = write(cache, KV(*new))

    want = [keys.copy(), values.copy()]
    for w, x in zip(want, (new_BGCK, new_BGCK + 1)):
        for b in range(2):
            for c in range(2):
                if slots[b, c]:  # slot 0 (the null page) takes padding; not compared
                    w[:, slots[b, c]] = x[b, :, c]
    got = [np.asarray(x)[0] if axis == 2 else np.swapaxes(np.asarray(x)[0], 0, 1) for x in pool]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g[:, Z:], w[:, Z:])

    pages = read(cache.with_pool(pool))
    for g, w in zip(pages, want):
        g = np.asarray(g) if axis == 2 else np.swapaxes(np.asarray(g), 1, 2)
        assert g.shape == (2, G, 3 * Z, K)
        for b in range(2):
            for p in range(3 * Z):  # position p of row b (null-page reads not compared)
                if table[b, p // Z] == 0:
                    continue
                np.testing.assert_array_equal(g[b, :, p], w[:, table[b, p // Z] * Z + p % Z])


@pytest.mark.parametrize("axis", [2, 1], ids=["heads_major", "jax_layout"])
def test_one_new_key_lands_in_its_slot_only(axis):
    """One row, one new token (a 1-slot decode step, written as a dynamic update slice):
    the slot gets it, every other slot of the pool is unchanged."""
    rng = np.random.default_rng(3)
    keys, values = (rng.normal(size=(G, P, K)).astype(np.float32) for _ in range(2))
    slot = 5 * Z + 3
    cache = PagedKV(KV(layout(keys, axis), layout(values, axis)), np.asarray([[5]], np.int32),
                    np.asarray([[slot]], np.int32), Z, axis)
    new_GK = rng.normal(size=(G, K)).astype(np.float32)
    shape = (1, G, 1, K) if axis == 2 else (1, 1, G, K)
    pool = write(cache, KV(new_GK.reshape(shape), (new_GK + 1).reshape(shape)))
    for got, before, x in zip(pool, (keys, values), (new_GK, new_GK + 1)):
        want = before.copy()
        want[:, slot] = x
        got = np.asarray(got)[0] if axis == 2 else np.swapaxes(np.asarray(got)[0], 0, 1)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("axis,stacked", [(2, False), (1, False), (2, True)],
                         ids=["heads_major", "jax_layout", "stacked"])
def test_every_position_written_reads_back_at_its_position(axis, stacked):
    """Guards a page's last position going into the next page: two rows write all
    their positions 0 .. 3Z - 1 (each page's last one included) at the slots
    table[p // Z] * Z + p % Z, in one scatter; reading the rows' pages gives position p
    at index p, and the pool's other pages keep what they held."""
    rng = np.random.default_rng(5)
    keys, values = (rng.normal(size=(G, P, K)).astype(np.float32) for _ in range(2))
    table = np.asarray([[3, 1, 5], [2, 6, 4]], np.int32)
    positions = np.arange(3 * Z)
    slots = (table[:, positions // Z] * Z + positions % Z).astype(np.int32)
    new_BGCK = rng.normal(size=(2, G, 3 * Z, K)).astype(np.float32)
    new = KV(new_BGCK, new_BGCK + 1)
    if axis == 1:
        new = KV(*(np.swapaxes(x, 1, 2) for x in new))
    pool = KV(layout(keys, axis), layout(values, axis))
    if stacked:
        pool = KV(*(np.stack([x, x + 2]) for x in pool))
    cache = PagedKV(pool, table, slots, Z, axis, np.int32(1) if stacked else None)
    written = write(cache, new)
    pages = read(cache.with_pool(written))
    for got, x in zip(pages, (new_BGCK, new_BGCK + 1)):
        got = np.asarray(got) if axis == 2 else np.swapaxes(np.asarray(got), 1, 2)
        np.testing.assert_array_equal(got, x)
    untouched = [page * Z + i for page in range(N + 1) if page not in table
                 for i in range(Z)]
    for got, before in zip(written, pool):
        layer = np.asarray(got)[1] if stacked else np.asarray(got)
        was = np.asarray(before)[1] if stacked else np.asarray(before)
        np.testing.assert_array_equal(np.take(layer, untouched, axis=axis),
                                      np.take(was, untouched, axis=axis))


def test_int8_pool_pages_its_scales():
    rng = np.random.default_rng(1)
    arrays = [rng.integers(-127, 128, (1, G, P, K)).astype(np.int8) for _ in range(2)]
    scales = [rng.random((1, G, P)).astype(np.float32) for _ in range(2)]
    table = np.asarray([[2, 4]], np.int32)
    slots = np.asarray([[4 * Z + 3]], np.int32)
    cache = PagedKV(QuantKV(*arrays, *scales), table, slots, Z, 2)
    new = QuantKV(np.full((1, G, 1, K), 7, np.int8), np.full((1, G, 1, K), -7, np.int8),
                  np.full((1, G, 1), 0.5, np.float32), np.full((1, G, 1), 0.25, np.float32))
    pages = read(cache.with_pool(write(cache, new)))
    assert isinstance(pages, QuantKV)
    np.testing.assert_array_equal(pages.key[0, :, :Z], arrays[0][0, :, 2 * Z:3 * Z])
    np.testing.assert_array_equal(pages.key_scale[0, :, :Z], scales[0][0, :, 2 * Z:3 * Z])
    np.testing.assert_array_equal(pages.key[0, :, Z + 3], 7)      # position 7 = the new slot
    np.testing.assert_array_equal(pages.value_scale[0, :, Z + 3], 0.25)
    np.testing.assert_array_equal(pages.value[0, :, Z:Z + 3], arrays[1][0, :, 4 * Z:4 * Z + 3])


@pytest.mark.parametrize("axis,int8", [(2, False), (1, False), (2, True)],
                         ids=["heads_major", "jax_layout", "int8"])
def test_a_stacked_pool_reads_and_writes_its_layer_only(axis, int8):
    """A pool of L layers stacked (L, 1, ...) with `layer=i` (a scanned stack) reads and
    writes what layer i's own pool would; the other layers are untouched."""
    rng = np.random.default_rng(2)
    layers = 3
    per_layer = []
    for _ in range(layers):
        if int8:
            per_layer.append(QuantKV(*(rng.integers(-127, 128, (1, G, P, K)).astype(np.int8)
                                       for _ in range(2)),
                                     *(rng.random((1, G, P)).astype(np.float32)
                                       for _ in range(2))))
        else:
            per_layer.append(KV(*(layout(rng.normal(size=(G, P, K)).astype(np.float32), axis)
                                  for _ in range(2))))
    stacked = type(per_layer[0])(*(np.stack(xs) for xs in zip(*per_layer)))
    table = np.asarray([[3, 1, 0], [5, 2, 6]], np.int32)
    slots = np.asarray([[1 * Z + 2, 0], [6 * Z + 0, 6 * Z + 1]], np.int32)
    shape = (2, G, 2, K) if axis == 2 else (2, 2, G, K)
    if int8:
        new = QuantKV(*(rng.integers(-127, 128, shape).astype(np.int8) for _ in range(2)),
                      *(rng.random(shape[:3]).astype(np.float32) for _ in range(2)))
    else:
        new = KV(*(rng.normal(size=shape).astype(np.float32) for _ in range(2)))
    for i in range(layers):
        own = PagedKV(per_layer[i], table, slots, Z, axis)
        want_pool = write(own, new)
        want_pages = read(own.with_pool(want_pool))
        cache = PagedKV(stacked, table, slots, Z, axis, np.int32(i))
        pool = write(cache, new)
        pages = read(cache.with_pool(pool))
        for got, want in zip(pages, want_pages):
            np.testing.assert_array_equal(got, want)
        for got, want, before in zip(pool, want_pool, stacked):
            np.testing.assert_array_equal(np.asarray(got)[i], want)
            others = [j for j in range(layers) if j != i]
            np.testing.assert_array_equal(np.asarray(got)[others], before[others])

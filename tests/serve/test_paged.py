"""serve.paged: the engine's step reads keys/values through the page table
(`nn.paged_kv`) and updates the donated pool in place."""

import functools

import jax
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.nn import stacking
from jaxformer.serve import paged


@pytest.mark.parametrize("rows", [2, 1], ids=["two_rows", "one_row"])
@pytest.mark.parametrize("stacked", [False, True], ids=["unrolled", "scanned"])
def test_serving_step_updates_the_pool_in_place(make_lm, stacked, rows):
    """The step donates the pool; each layer writes its new slots before it reads its
    pages, so XLA needs no copy of the pool (with the read first, it copies every
    layer's pool to keep the read's input: a temporary of the pools' size). Scanned
    (stacked params and one stacked pool carried through the scan): the same. One row
    (a 1-slot engine's decode step): XLA turns a one-index scatter into a bounds-checked
    dynamic-update-slice that reads the old slot from the pool while writing into a
    copy of it (three copies of every layer's pool a step: 35 ms of SmolLM2's 1-slot
    step), so `paged_kv.write` writes a single slot with its own dynamic-update-slice."""
    config = jf.llama(tgt_vocab_size=32, src_vocab_size=32, max_len=64, num_kv_heads=2)
    model, params = make_lm(config)
    if stacked:
        params = stacking.stack_layers(params)
    pages, size = 256, 8
    pools = paged.init_pools(config, pages, size, stacked=stacked)
    table = np.arange(rows * 8, dtype=np.int32).reshape(rows, 8) + 1
    step = jax.jit(functools.partial(paged.paged_forward, model, page_size=size, view_len=32),
                   donate_argnums=(1,))
    compiled = step.lower(params, pools, table, np.asarray([5, 9][:rows], np.int32),
                          np.ones((rows, 1), np.int32), np.ones((rows, 1), bool)).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    one_layer = sum(x.size * x.dtype.itemsize for x in pools[0]) // (
        config.num_decoder_layers if stacked else 1)
    assert temp < one_layer / 2, (temp, one_layer)


@pytest.mark.parametrize("stacked", [False, True], ids=["unrolled", "scanned"])
def test_logits_at_one_position_are_the_full_logits_there(make_lm, stacked):
    """A prefill chunk projects only each row's last prompt token (`logits_at`): the
    same logits as the full (S, C, V) projection at those positions, the same pools."""
    config = jf.llama(tgt_vocab_size=32, src_vocab_size=32, max_len=64, num_kv_heads=2)
    model, params = make_lm(config)
    if stacked:
        params = stacking.stack_layers(params)
    rng = np.random.default_rng(0)
    table = np.arange(16, dtype=np.int32).reshape(2, 8) + 1
    args = (table, np.asarray([3, 0], np.int32), rng.integers(3, 32, (2, 6)).astype(np.int32),
            np.asarray([[True] * 6, [True] * 4 + [False] * 2]))
    at = np.asarray([5, 3], np.int32)
    step = functools.partial(paged.paged_forward, model, page_size=8, view_len=16)
    full, full_pools = step(params, paged.init_pools(config, 20, 8, stacked=stacked), *args)
    got, got_pools = step(params, paged.init_pools(config, 20, 8, stacked=stacked), *args,
                          logits_at=at)
    assert got.shape == (2, 1, config.tgt_vocab_size)
    np.testing.assert_allclose(got[:, 0], np.asarray(full)[np.arange(2), at], rtol=0,
                               atol=1e-6)
    assert not np.allclose(got[:, 0], np.asarray(full)[:, 0])  # a position that differs
    for a, b in zip(jax.tree_util.tree_leaves(got_pools), jax.tree_util.tree_leaves(full_pools)):
        np.testing.assert_array_equal(a, b)


def test_pool_slots_put_every_position_in_its_own_page():
    """Guards a page's last position landing in the next page: position p of a row is
    at slot table[p // Z] * Z + p % Z for every p of every page (the last one of each
    page included); invalid positions go to the null page's slot 0."""
    size = 4
    table = np.asarray([[3, 1, 5], [2, 6, 4]], np.int32)
    positions = np.tile(np.arange(3 * size, dtype=np.int32), (2, 1))
    valid = np.ones_like(positions, bool)
    valid[1, -2:] = False
    got = np.asarray(paged.pool_slots(table, positions, valid, size))
    want = np.asarray([[table[s, p // size] * size + p % size if valid[s, p] else 0
                        for p in positions[s]] for s in range(2)])
    np.testing.assert_array_equal(got, want)


def reference_paged_mask(lengths, read_slots, new, window=None):
    """numpy: query i of row s (position L_s + i) sees page slot k iff k < L_s, new key j
    iff j <= i; with a window, only keys less than `window` positions back."""
    mask = np.zeros((len(lengths), 1, new, read_slots + new), bool)
    for s, length in enumerate(lengths):
        for i in range(new):
            query = length + i
            for k in range(read_slots):
                mask[s, 0, i, k] = k < length and (window is None or query - k < window)
            for j in range(new):
                mask[s, 0, i, read_slots + j] = j <= i and (window is None or i - j < window)
    return mask


@pytest.mark.parametrize("window", [None, 3], ids=["global", "window_3"])
def test_paged_mask_sees_a_rows_cached_positions_and_not_one_slot_more(window):
    """Guards a paged read one slot past the row's length: page slot L_s (where the
    row's first new key is written before the read) is masked, as is every slot after;
    slots below L_s are seen (within the window)."""
    lengths = np.asarray([0, 3, 4, 7], np.int32)
    got = np.asarray(paged.paged_mask(lengths, 8, 3, window))
    np.testing.assert_array_equal(got, reference_paged_mask(lengths.tolist(), 8, 3, window))


@pytest.mark.parametrize("stacked", [False, True], ids=["unrolled", "scanned"])
def test_a_prefill_then_decode_steps_through_pages_give_the_full_forwards_logits(
        make_lm, stacked):
    """Pages of 4 slots, rows whose lengths cross page ends, a pool filled with noise
    (every slot not written is garbage): a prefill chunk, then three decode steps, give
    each row's logits of a plain causal forward pass over its whole sequence. Reading a
    slot past a row's length, or writing a page's last position elsewhere, changes
    them."""
    from jaxformer.nn.masks import causal_mask

    config = jf.llama(tgt_vocab_size=32, src_vocab_size=32, max_len=64, num_kv_heads=2)
    model, params = make_lm(config)
    step_params = stacking.stack_layers(params) if stacked else params
    size, view = 4, 16
    rng = np.random.default_rng(4)
    pools = paged.init_pools(config, 8, size, stacked=stacked)
    pools = tuple(type(kv)(*(rng.normal(size=x.shape).astype(x.dtype) for x in kv))
                  for kv in pools)
    table = np.asarray([[3, 1, 5, 8], [2, 6, 4, 7]], np.int32)
    prompt_lengths, steps = [5, 7], 3
    sequences = rng.integers(3, 32, (2, 7 + steps)).astype(np.int32)
    step = jax.jit(functools.partial(paged.paged_forward, model, page_size=size, view_len=view))

    def full_logits(row, length):
        tokens = sequences[row:row + 1, :length]
        return np.asarray(model.apply({"params": params}, tokens, causal_mask(length)))[0]

    valid = np.asarray([[p < n for p in range(7)] for n in prompt_lengths])
    logits, pools = step(step_params, pools, table, np.zeros(2, np.int32),
                         np.where(valid, sequences[:, :7], 0), valid)
    for row, n in enumerate(prompt_lengths):
        np.testing.assert_allclose(np.asarray(logits)[row, :n], full_logits(row, n),
                                   atol=1e-5, rtol=0)
    lengths = np.asarray(prompt_lengths, np.int32)
    for _ in range(steps):
        tokens = sequences[np.arange(2), lengths][:, None]
        logits, pools = step(step_params, pools, table, lengths, tokens, np.ones((2, 1), bool))
        for row in range(2):
            np.testing.assert_allclose(np.asarray(logits)[row, 0],
                                       full_logits(row, lengths[row] + 1)[-1], atol=1e-5,
                                       rtol=0)
        lengths = lengths + 1

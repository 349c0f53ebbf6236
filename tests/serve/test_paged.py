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

"""jaxformer.backends.paged_attention: the CPU kernel computes what attention over the
rows' pages computes (against a float64 numpy reference: each query over its own row's
positions 0 .. start + i, read through the page table, kv head h // (H / G)); a tuned
process's serving step calls it once per layer for decode-sized steps, with the same
logits as the plain path, and keeps the pool updated in place; an untuned process and a
prefill chunk keep the plain path."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.backends import cpu, paged_attention, qmatmul
from jaxformer.nn import stacking
from jaxformer.serve import paged


@pytest.fixture(scope="module")
def built():
    path = qmatmul.library()
    assert path is not None, "the kernels did not build (g++ is on CI)"
    return path


def _case(rows, new, heads, kv_heads, depth, size, pages, layers=None, seed=0):
    """Random pools (one layer, or `layers` stacked), a permuted page table, ragged
    starts (each row's new tokens fit its pages), queries."""
    rng = np.random.default_rng(seed)
    n = rows * pages + 2
    shape = (kv_heads, (n + 1) * size, depth)
    lead = (layers, 1) if layers else (1,)
    k, v = (rng.standard_normal(lead + shape).astype(np.float32) for _ in range(2))
    perm = rng.permutation(np.arange(1, n + 1))
    start = rng.integers(0, pages * size - new + 1, rows).astype(np.int32)
    table = np.zeros((rows, pages), np.int32)
    for b in range(rows):
        need = -(-(start[b] + new) // size)
        table[b, :need] = perm[b * pages:b * pages + need]
    q = rng.standard_normal((rows, new, heads, depth)).astype(np.float32)
    return q, k, v, table, start


def _reference(q, k, v, table, start, size, layer):
    """float64: query i of row b over positions 0 .. start_b + i of its pages."""
    rows, new, heads, depth = q.shape
    k = k.reshape((-1,) + k.shape[-3:])[layer].astype(np.float64)
    v = v.reshape((-1,) + v.shape[-3:])[layer].astype(np.float64)
    group = heads // k.shape[0]
    out = np.zeros(q.shape)
    for b in range(rows):
        for i in range(new):
            pos = np.arange(start[b] + i + 1)
            slots = table[b, pos // size] * size + pos % size
            for h in range(heads):
                s = k[h // group][slots] @ q[b, i, h] / math.sqrt(depth)
                w = np.exp(s - s.max())
                out[b, i, h] = (w / w.sum()) @ v[h // group][slots]
    return out


# (rows, new, heads, kv heads, depth, page size, pages, stacked layers, layer)
CASES = {
    "decode_gqa": (8, 1, 9, 3, 64, 16, 16, None, 0),
    "one_row": (1, 1, 4, 2, 64, 16, 4, None, 0),
    "drafts_mha_odd_depth": (3, 5, 4, 4, 20, 4, 6, None, 0),
    "stacked_layer_2": (3, 4, 6, 2, 32, 8, 5, 3, 2),
    "many_rows_threads": (32, 1, 9, 3, 64, 16, 16, None, 0),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_kernel_equals_the_reference(built, case):
    rows, new, heads, kv_heads, depth, size, pages, layers, layer = case
    q, k, v, table, start = _case(rows, new, heads, kv_heads, depth, size, pages, layers)
    got = paged_attention.kernel(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                 layer if layers else None, jnp.asarray(table),
                                 jnp.asarray(start), size, 1 / math.sqrt(depth))
    np.testing.assert_allclose(np.asarray(got), _reference(q, k, v, table, start, size, layer),
                               rtol=0, atol=2e-6)


def test_a_page_outside_the_pool_is_an_error(built):
    q, k, v, table, start = _case(2, 1, 4, 2, 16, 4, 3)
    table[1, 0] = k.shape[-2] // 4  # one past the last page
    with pytest.raises(Exception, match="page id is outside the pool"):
        jax.block_until_ready(paged_attention.kernel(
            jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), None, jnp.asarray(table),
            jnp.asarray(start), 4, 0.25))


# -- the serving step: a tuned process calls it for decode-sized steps --------------------

CONFIG = jf.llama(tgt_vocab_size=48, src_vocab_size=48, max_len=64, num_heads=4,
                  num_kv_heads=2)
SIZE, POOL_PAGES = 8, 64


@pytest.fixture(scope="module")
def lm(make_lm):
    return make_lm(CONFIG)


def _step(model, params, stacked, lengths, new, seed=3, donate=False, pool_pages=POOL_PAGES):
    """The jitted `paged.paged_forward` (a new function: traced under the current gate)
    over a pool holding random keys/values, rows of `lengths` feeding `new` tokens."""
    rows = len(lengths)
    rng = np.random.default_rng(seed)
    pools = paged.init_pools(CONFIG, pool_pages, SIZE, stacked=stacked)
    pools = jax.tree_util.tree_map(
        lambda x: jnp.asarray(rng.standard_normal(x.shape).astype(np.float32)), pools)
    table = (rng.permutation(pool_pages)[:rows * 8] + 1).astype(np.int32).reshape(rows, 8)
    args = (params, pools, table, np.asarray(lengths, np.int32),
            rng.integers(3, 48, (rows, new)).astype(np.int32), np.ones((rows, new), bool))
    step = jax.jit(functools.partial(paged.paged_forward, model, page_size=SIZE, view_len=64),
                   donate_argnums=(1,) if donate else ())
    return step, args


@pytest.mark.parametrize("stacked", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("new", [1, 3], ids=["decode", "drafts"])
def test_tuned_step_calls_the_kernel_with_the_plain_logits(built, lm, stacked, new,
                                                           monkeypatch):
    model, params = lm
    if stacked:
        params = stacking.stack_layers(params)
    step, args = _step(model, params, stacked, [5, 30, 0], new)
    want_logits, want_pools = step(*args)
    monkeypatch.setattr(cpu, "process_tuned", lambda: True)
    step, args = _step(model, params, stacked, [5, 30, 0], new)
    text = step.trace(*args).lower().as_text()
    calls = 1 if stacked else CONFIG.num_decoder_layers
    assert text.count(f"@{paged_attention.TARGET}(") == calls
    got_logits, got_pools = step(*args)
    np.testing.assert_allclose(got_logits, want_logits, rtol=0, atol=1e-5)
    for got, want in zip(jax.tree_util.tree_leaves(got_pools),  # later layers' keys
                         jax.tree_util.tree_leaves(want_pools)):  # follow the rounding
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_untuned_step_and_prefill_chunk_keep_the_plain_path(built, lm, monkeypatch):
    model, params = lm
    step, args = _step(model, params, False, [5, 9], 1)
    assert paged_attention.TARGET not in step.trace(*args).lower().as_text()
    monkeypatch.setattr(cpu, "process_tuned", lambda: True)
    step, args = _step(model, params, False, [5, 9], paged_attention.MAX_QUERIES + 1)
    assert paged_attention.TARGET not in step.trace(*args).lower().as_text()


@pytest.mark.parametrize("rows", [1, 2], ids=["one_row", "two_rows"])
def test_tuned_scanned_step_updates_the_pool_in_place(built, lm, rows, monkeypatch):
    """The kernel reads the stacked pool as it is: a reshape of it for the call made XLA
    keep a second copy of the pool updated by a one-slot write (a 1-slot engine's step
    went from 11 to 310 ms on SmolLM2)."""
    model, params = lm
    monkeypatch.setattr(cpu, "process_tuned", lambda: True)
    step, args = _step(model, stacking.stack_layers(params), True, [5, 9][:rows], 1,
                       donate=True, pool_pages=1024)
    compiled = step.lower(*args).compile()
    assert paged_attention.TARGET in compiled.as_text()
    temp = compiled.memory_analysis().temp_size_in_bytes
    one_layer = sum(x.size * x.dtype.itemsize for x in args[1][0]) // CONFIG.num_decoder_layers
    assert temp < one_layer / 2, (temp, one_layer)


def test_a_tuned_engine_compiles_one_decode_step_for_every_length(built, make_lm,
                                                                  monkeypatch):
    """The kernel reads each row's own pages whatever the step's view: a tuned engine's
    decode steps all take the whole table (`Engine.decode_view`), one program where an
    untuned engine compiles one per view bucket (128 and 256 here), with its tokens."""
    from jaxformer.serve.engine import Engine  # noqa: PLC0415
    from jaxformer.serve.request import Request, SamplingParams  # noqa: PLC0415

    lm = make_lm(CONFIG.replace(max_len=256))
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 48, n).tolist() for n in (10, 140)]

    def serve():
        engine = Engine(*lm, slots=2, max_len=256, page_size=SIZE, prefill_chunk=64)
        handles = [engine.submit(Request(p, SamplingParams(max_tokens=6))) for p in prompts]
        engine.run_until_idle()
        tokens = [[e.token for e in h.result(0) if e.token is not None] for h in handles]
        return tokens, {key[2] for key in engine.shapes if key[0] == "decode"}  # (_, rows, view, _)

    want, plain_views = serve()
    monkeypatch.setattr(cpu, "process_tuned", lambda: True)
    got, tuned_views = serve()
    assert plain_views == {128, 256} and tuned_views == {256}
    assert got == want

"""Long sequences: dense vs blockwise attention, memory and time per token, at the
level of a whole train step (default) or of attention alone (`--level attention`).

Train step (`--level train`): the decoder-only `lm` preset (4 Pre-LN layers, d_model
192, 6 heads, bytes), batch 1, float32, one packed window of T tokens in 3
documents; jitted loss + gradients + AdamW update, the mask handed as built by
`jaxformer train --task lm`: dense (B, 1, T, T) `segment_mask` for
attention_impl="einsum", a `segment_mask_spec` MaskSpec for "blockwise". Same
figures as below; dense runs only under --dense-max-gib, T >= 65536 only with
--run-64k (its compile and memory analysis always). JSON: temp_bytes_growth_1k_to_16k
(blockwise), max_train_seq_len (longest T whose blockwise step compiled and ran),
time_per_token_ratio_vs_dense_1k (dense time / blockwise time at 1k).

Prefill (with the train level): the peak temporary bytes of the compiled prefill
of a --prefill-length prompt (default 16384) into a KV cache of as many slots
(`decode.cache.prefill`), one pass over the prompt vs chunks of --prefill-chunk
tokens (default 1024); compiled only, never run. JSON:
prefill_chunked_peak_bytes_ratio (chunked over one-pass).

Attention level (`--level attention`):

Workload: batch 1, 4 heads, head dim 64, float32, causal, CPU. For each T the
step is a jitted `value_and_grad` of sum(attention output) with respect to
queries, keys and values (the attention part of a training step):

  dense      `jaxformer.nn.attention.dot_product_attention` on the materialised
             (1, 1, T, T) causal mask: (T, T) scores, weights and their gradients.
  blockwise  `jaxformer.nn.blockwise.blockwise_attention` with `MaskSpec(causal=True)`
             and the default blocks: online softmax over key blocks, blocks above
             the diagonal skipped, each query block recomputed under jax.checkpoint
             in the backward pass.

Figures per T: peak temporary bytes of the compiled step
(`compile().memory_analysis().temp_size_in_bytes`, no run needed) and time per
token (median wall time of a step / T, compile excluded; rounds alternate dense
and blockwise so the shared host's drift hits both). Dense runs only while its
temporaries stay under --dense-max-gib (default 8: 16k needs 12 GiB, too much
next to other jobs on this 24 GB host; its bytes are still reported; 64k would
need ~200 GiB and is never compiled). 64k blockwise is compiled (its bytes are
reported) but only timed with --run-64k (a step takes minutes here).

`--tune` times candidate block sizes at T = 1k instead (how the defaults in
blockwise.py were chosen).

Run (about 3-4 minutes on 2 shared CPU cores):
  nice -n 5 python benchmarks/long.py
Prints a table, then one JSON line: temp_bytes_growth_1k_to_16k (blockwise;
linear is 16, dense ~256), time_per_token_ratio_vs_dense_1k (dense time /
blockwise time at 1k; goal >= 0.8), max_attention_seq_len (the longest T whose
blockwise step compiled and ran), and the per-T figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.nn import (DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, MaskSpec, blockwise_attention,
                          dense_mask, dot_product_attention)
import jaxformer as jf
from jaxformer.config import PRESETS
from jaxformer.decode import init_cache, prefill
import optax
from jaxformer.train import LMBatch, loss_and_metrics, model_logits

HEADS, HEAD_DIM = 4, 64
CAUSAL = MaskSpec(causal=True)


def step(impl: str, length: int, block_q: int = DEFAULT_BLOCK_Q,
         block_k: int = DEFAULT_BLOCK_K):
    """Compiled value_and_grad of sum(attention(q, k, v)) for (1, HEADS, length, HEAD_DIM)."""
    if impl == "dense":
        def loss(q, k, v):
            return dot_product_attention(q, k, v, dense_mask(CAUSAL, length, length))[0].sum()
    else:
        def loss(q, k, v):
            return blockwise_attention(q, k, v, CAUSAL, block_q=block_q, block_k=block_k).sum()
    x = jax.ShapeDtypeStruct((1, HEADS, length, HEAD_DIM), jnp.float32)
    return jax.jit(jax.value_and_grad(loss, (0, 1, 2))).lower(x, x, x).compile()


def inputs(length: int):
    r = np.random.default_rng(0)
    return [jnp.asarray(r.normal(size=(1, HEADS, length, HEAD_DIM)), jnp.float32)
            for _ in range(3)]


def time_rounds(compiled: dict, args, rounds: int) -> dict:
    """{name: median seconds}, the compiled steps run alternately, after one warm-up each."""
    for fn in compiled.values():
        jax.block_until_ready(fn(*args))
    times = {name: [] for name in compiled}
    for _ in range(rounds):
        for name, fn in compiled.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def tune(rounds: int) -> None:
    length, args = 1024, inputs(1024)
    compiled = {"dense": step("dense", length)}
    for bq, bk in [(128, 128), (128, 256), (256, 128), (256, 256), (256, 512), (512, 256),
                   (512, 512), (1024, 1024)]:
        compiled[f"{bq}x{bk}"] = step("blockwise", length, bq, bk)
    seconds = time_rounds(compiled, args, rounds)
    for name, s in seconds.items():
        print(f"{name:>10}  {s * 1e3:8.1f} ms  dense/this {seconds['dense'] / s:5.2f}")


def lm_batch(length: int) -> LMBatch:
    """One packed window of `length` tokens: 3 documents (the last one runs to the end)."""
    r = np.random.default_rng(0)
    cuts = [length // 2, length // 2 + length // 3]
    segments = np.searchsorted(cuts, np.arange(length), side="right").astype(np.int32) + 1
    starts = np.concatenate([[0], cuts])[segments - 1]
    tokens = r.integers(3, 259, length).astype(np.int32)
    return LMBatch(inputs=tokens[None], labels=np.roll(tokens, -1)[None],
                   weights=np.ones((1, length), np.float32),
                   positions=(np.arange(length) - starts).astype(np.int32)[None],
                   segments=segments[None])


def train_step(impl: str, length: int):
    """(compiled step(params, opt_state, batch) -> (params, opt_state, loss), its args)."""
    config = PRESETS["lm"](max_len=length, attention_impl="einsum" if impl == "dense" else impl)
    model = jf.DecoderOnlyLM(config)
    optimizer = optax.adamw(1e-3)
    batch = lm_batch(length)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), batch.inputs[:, :8])["params"]
    opt_state = optimizer.init(params)

    def step_fn(params, opt_state, batch):
        def loss_fn(p):
            logits, labels, weights = model_logits(model, p, batch)
            return loss_and_metrics(logits, labels, pad_id=None, weights_BT=weights)[0]
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    args = (params, opt_state, jax.tree_util.tree_map(jnp.asarray, batch))
    return jax.jit(step_fn).lower(*args).compile(), args


def prefill_temp_bytes(length: int, chunk) -> int:
    """Peak temporary bytes of the compiled prefill of `length` prompt tokens into a cache
    of `length` slots (lm preset, batch 1, f32), in chunks of `chunk` (None: one pass)."""
    config = PRESETS["lm"](max_len=length)
    model = jf.DecoderOnlyLM(config)
    params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0),
                                               jnp.zeros((1, 8), jnp.int32))["params"])

    def fill(params, tokens_BP):
        cache = init_cache(config, 1, length)
        return prefill(model, params, cache, tokens_BP, chunk)

    compiled = jax.jit(fill).lower(params, jax.ShapeDtypeStruct((1, length), jnp.int32)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def prefill_level(args) -> dict:
    """{"prefill": per-setting bytes, "prefill_chunked_peak_bytes_ratio": chunked / one pass}."""
    one = prefill_temp_bytes(args.prefill_length, None)
    chunked = prefill_temp_bytes(args.prefill_length, args.prefill_chunk)
    print(f"prefill of {args.prefill_length} tokens: temp MiB one pass {one / 2 ** 20:.1f}, "
          f"chunks of {args.prefill_chunk} {chunked / 2 ** 20:.1f}", flush=True)
    return {"prefill": dict(length=args.prefill_length, chunk=args.prefill_chunk,
                            one_pass_temp_bytes=one, chunked_temp_bytes=chunked),
            "prefill_chunked_peak_bytes_ratio": round(chunked / one, 4)}


def train_level(args) -> dict:
    rows, max_len = {}, 0
    print(f"{'T':>6} {'impl':>9} {'temp MiB':>10} {'us/token':>10} {'compile s':>10}")
    for length in args.lengths:
        compiled, temp, step_args = {}, {}, None
        for impl in ("dense", "blockwise"):
            if impl == "dense" and length > 16384:
                continue  # hundreds of GiB of scores: not even compiled
            start = time.perf_counter()
            fn, step_args = train_step(impl, length)
            compile_s = time.perf_counter() - start
            temp[impl] = fn.memory_analysis().temp_size_in_bytes
            rows[f"{impl}_{length}"] = dict(temp_bytes=temp[impl], compile_s=round(compile_s, 1))
            if impl == "dense" and temp[impl] > args.dense_max_gib * 2 ** 30:
                continue
            if length < 65536 or args.run_64k:
                compiled[impl] = fn
        rounds = 3 if length <= 1024 else 2 if length <= 4096 else 1
        seconds = time_rounds(compiled, step_args, rounds) if compiled else {}
        if "blockwise" in seconds:
            max_len = length
        for impl in temp:
            per_token = seconds[impl] / length * 1e6 if impl in seconds else None
            rows[f"{impl}_{length}"]["us_per_token"] = per_token
            shown = "-" if per_token is None else f"{per_token:10.1f}"
            print(f"{length:>6} {impl:>9} {temp[impl] / 2 ** 20:>10.1f} {shown:>10} "
                  f"{rows[f'{impl}_{length}']['compile_s']:>10}", flush=True)
    return rows, max_len


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    parser.add_argument("--dense-max-gib", type=float, default=8.0,
                        help="run dense only if its temporaries fit under this")
    parser.add_argument("--run-64k", action="store_true", help="also time T >= 65536")
    parser.add_argument("--tune", action="store_true", help="time block sizes at 1k")
    parser.add_argument("--level", choices=("train", "attention"), default="train")
    parser.add_argument("--prefill-length", type=int, default=16384,
                        help="prompt tokens of the prefill measurement (0: skip it)")
    parser.add_argument("--prefill-chunk", type=int, default=1024)
    args = parser.parse_args(argv)
    if args.tune:
        tune(rounds=5)
        return {}
    if args.level == "train":
        rows, max_len = train_level(args)
        prefill = prefill_level(args) if args.prefill_length else {}
        return report(dict(rows=rows, level="train", block_q=DEFAULT_BLOCK_Q,
                           block_k=DEFAULT_BLOCK_K, max_train_seq_len=max_len, **prefill), rows)
    rows, max_len = {}, 0
    print(f"{'T':>6} {'impl':>9} {'temp MiB':>10} {'us/token':>10}")
    for length in args.lengths:
        compiled, temp = {}, {}
        for impl in ("dense", "blockwise"):
            if impl == "dense" and length > 16384:
                continue  # ~200 GiB of scores and weights: not even compiled
            fn = step(impl, length)
            temp[impl] = fn.memory_analysis().temp_size_in_bytes
            if impl == "dense" and temp[impl] > args.dense_max_gib * 2 ** 30:
                continue
            if length < 65536 or args.run_64k:
                compiled[impl] = fn
        rounds = 5 if length <= 1024 else 3 if length <= 4096 else 1
        seconds = time_rounds(compiled, inputs(length), rounds) if compiled else {}
        if "blockwise" in seconds:
            max_len = length
        for impl in temp:
            per_token = seconds[impl] / length * 1e6 if impl in seconds else None
            rows[f"{impl}_{length}"] = dict(temp_bytes=temp[impl], us_per_token=per_token)
            shown = "-" if per_token is None else f"{per_token:10.1f}"
            print(f"{length:>6} {impl:>9} {temp[impl] / 2 ** 20:>10.1f} {shown:>10}", flush=True)
    return report(dict(rows=rows, level="attention", block_q=DEFAULT_BLOCK_Q,
                       block_k=DEFAULT_BLOCK_K, max_attention_seq_len=max_len), rows)


def report(result: dict, rows: dict) -> dict:
    """Add the growth and ratio keys to `result`, print it as one JSON line."""
    if "blockwise_1024" in rows and "blockwise_16384" in rows:
        result["temp_bytes_growth_1k_to_16k"] = round(
            rows["blockwise_16384"]["temp_bytes"] / rows["blockwise_1024"]["temp_bytes"], 2)
    if rows.get("dense_1024", {}).get("us_per_token") and rows["blockwise_1024"]["us_per_token"]:
        result["time_per_token_ratio_vs_dense_1k"] = round(
            rows["dense_1024"]["us_per_token"] / rows["blockwise_1024"]["us_per_token"], 2)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

"""Where a bench step's time goes: XLA's own per-op timings, grouped by kind of work.

Runs the bench train step (dropout 0.1, AdamW; `jaxformer.training`) or the
bench greedy decode (batch 32, 128 new tokens, one device) under
`jax.profiler.trace`, reads the Perfetto trace it writes, and sums the busy
time of every XLA:CPU kernel (all threads) per step, by kind:

  matmul        YNNPACK / XLA dot kernels (ynn_fusion, dot, dot_general)
  dropout/mask  selects and the fusions that draw and apply masks
  copy/layout   copies, transposes and bitcast fusions (layout changes)
  loop          while-loop and call bookkeeping
  elementwise   every other fusion (norms, softmax, GELU/ReLU, AdamW, ...)

Kernel time sums over threads, so on 2 cores it can exceed the wall time of a
step. The largest single kernels are listed too, with the op that produced
them. What a step would cost if everything but the matmuls were free is
matmul / total of the wall time: the ceiling for removing overhead.

Run (1-2 minutes; a quiet machine, since contention inflates small kernels most):
  python benchmarks/breakdown.py train
  python benchmarks/breakdown.py decode
Prints a table, then one JSON line {"what", "wall_ms", "kernel_ms", "<kind>_ms", ...}.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp

import jaxformer as jf
from jaxformer import decoding
from jaxformer.training import TrainConfig, train_functions

BATCH, SRC_LEN, NEW_TOKENS = 32, 32, 128
# Trace events that are not kernels: runtime, Python and executor spans.
NOT_KERNELS = ("ThunkExecutor", "$", "np.", "Pjit", "Slinky", "end:", "Common", "Parse")


def kind(name: str) -> str:
    if name.startswith(("ynn_fusion", "dot", "convolution")):
        return "matmul"
    if "select" in name or name.startswith(("compare", "rng")):
        return "dropout/mask"
    if name.startswith(("copy", "transpose", "bitcast")) or "copy" in name:
        return "copy/layout"
    if name.startswith(("while", "call", "conditional")):
        return "loop"
    return "elementwise"


def train_step():
    """(run n steps -> seconds, what)"""
    tc = TrainConfig(task="copy", min_len=SRC_LEN, max_len=SRC_LEN, batch_size=BATCH,
                     steps=100_000, warmup_steps=100, learning_rate=1e-4)
    fns = train_functions(jf.bench(), tc)
    batch, box = fns.batch(0, 0), {"state": fns.init(0)}
    step, _ = fns.compiled_step(box["state"], batch)

    def run(n):
        start = time.perf_counter()
        for _ in range(n):
            box["state"], metrics = step(box["state"], batch)
        float(metrics["loss"])
        return time.perf_counter() - start
    return run, "train step"


def decode_loop():
    config = jf.bench()
    model = jf.Transformer(config)
    src = jax.random.randint(jax.random.PRNGKey(1), (BATCH, SRC_LEN), 3, config.src_vocab_size)
    params = model.init(jax.random.PRNGKey(0), src[:1], src[:1])["params"]

    def run(n):
        start = time.perf_counter()
        for _ in range(n):
            out = decoding.greedy_decode(model, params, src, max_new_tokens=NEW_TOKENS)
        jnp.asarray(out).block_until_ready()
        return time.perf_counter() - start
    return run, f"greedy decode of {NEW_TOKENS} tokens"


def kernel_times(trace_dir: str) -> dict[str, float]:
    """Microseconds of busy time per kernel name in the trace."""
    path = sorted(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True))[-1]
    with gzip.open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    busy = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and "dur" in e and not e["name"].startswith(NOT_KERNELS):
            busy[e["name"]] += e["dur"]
    return busy


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=("train", "decode"))
    parser.add_argument("--steps", type=int, default=3, help="steps traced (and timed)")
    parser.add_argument("--top", type=int, default=12, help="largest kernels listed")
    args = parser.parse_args(argv)
    run, what = train_step() if args.what == "train" else decode_loop()
    run(2)  # compile and warm up
    wall = statistics.median(run(1) for _ in range(args.steps)) * 1e3
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            run(args.steps)
        busy = kernel_times(trace_dir)
    per_step = {name: us / 1e3 / args.steps for name, us in busy.items()}
    by_kind = collections.Counter()
    for name, ms in per_step.items():
        by_kind[kind(re.sub(r"\.\d+$", "", name))] += ms
    total = sum(by_kind.values())
    print(f"bench {what}: wall {wall:.1f} ms; kernel busy time summed over threads "
          f"{total:.1f} ms per step")
    print(f"{'kind':<14} {'ms/step':>9} {'share':>7}")
    for name, ms in by_kind.most_common():
        print(f"{name:<14} {ms:>9.1f} {ms / total:>7.1%}")
    print(f"\nlargest kernels ({args.top}):")
    for name, ms in sorted(per_step.items(), key=lambda item: -item[1])[:args.top]:
        print(f"  {ms:8.2f} ms  {name}")
    result = {"what": args.what, "wall_ms": round(wall, 1), "kernel_ms": round(total, 1),
              **{f"{k.replace('/', '_')}_ms": round(v, 1) for k, v in by_kind.items()},
              "matmul_share": round(by_kind["matmul"] / total, 3)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

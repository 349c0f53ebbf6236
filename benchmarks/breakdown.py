"""Where a bench step's time goes: XLA's own per-op timings, grouped by kind of work.

Runs the bench train step (dropout 0.1, AdamW; `jaxformer.train`) or the
bench greedy decode (batch 32, 128 new tokens, one device) under
`jax.profiler.trace`, reads the Perfetto trace it writes, and sums the busy
time of every XLA:CPU kernel (all threads) per step, by kind:

  matmul        YNNPACK / XLA dot kernels (ynn_fusion, dot, dot_general)
  attention matmul  the dots with batch dimensions (Q K^T and weights V per head)
  reduction     YNNPACK fusions without a dot (sums and maxima of softmax and norms)
  dropout/mask  selects, compares and the fusions that draw and apply masks
  copy/layout   copies, transposes and bitcast fusions (layout changes)
  loop          call bookkeeping (while loops and conditionals are containers:
                their bodies' kernels count, their own spans do not)
  elementwise   every other fusion (norms, softmax, GELU/ReLU, AdamW, ...)

Kernel time sums over threads, so on 2 cores it can exceed the wall time of a
step. The largest single kernels are listed too, with the op that produced
them. What a step would cost if everything but the matmuls were free is
matmul / total of the wall time: the ceiling for removing overhead.

`train` and `decode` also time the program's dots alone: each dot of the
compiled HLO (shapes and dimension numbers; inside loop bodies counted once per
trip) compiled and timed on its own, warm, times how often it runs. That sum is
what the program would cost with every other kernel free and every dot as fast
as XLA:CPU runs it alone: the floor these kernels allow.

`decode` sets each kind of dot in the loop (kernel time from the trace)
against the same dots alone, and times one FFN with its weights in cache
against from memory (more distinct weights than the last-level cache holds),
since a decode step reads more weights and keys/values than that cache holds.
It also prints the step's roofline: its FLOPs at the machine's matmul
peak plus its bytes (weights, and the keys/values of all N cache slots, which
the masked attention reads every step) at the machine's read bandwidth, both
measured in the run; and, with transformers installed, Hugging Face's greedy
`generate` on the same sizes, so the best ratio_vs_hf this machine allows is
printed beside today's.

`train` sets its dots alone against the (2048)^3 matmul peak of
benchmarks/train.py (the faster of jax and torch), so the best
fraction_of_matmul_peak with every other kernel free, and, with transformers
installed, against Hugging Face's train step on the same batch: the best
ratio_vs_hf. It also times the step with every dropout rate 0 beside the step as
it is (interleaved): what dropout costs, and the fraction of peak with it free.

`compile` times where the train step's compile goes instead: jaxformer's
tracing and lowering, then XLA:CPU's phases from the same kind of trace (HLO
passes, the fusion emitters that turn each fusion into a kernel, LLVM's code
generation), for the bench step as it is and with `scan_layers`, with the
number of kernels each compiles.

Run (1-2 minutes; a quiet machine, since contention inflates small kernels most):
  python benchmarks/breakdown.py train
  python benchmarks/breakdown.py decode
  python benchmarks/breakdown.py compile
Prints a table, then one JSON line {"what", "wall_ms", "kernel_ms", "<kind>_ms", ...}
({"what", "<variant>_compile_s" (lower + XLA), "<variant>_<phase>_s", ...} for compile).
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import gzip
import json
import math
import re
import statistics
import sys
import tempfile
import time
from typing import Optional

import jax
import jax.numpy as jnp

import jaxformer as jf
from jaxformer.backends import cpu
from jaxformer.decode import (encdec_program, greedy, greedy_decode, segment_lengths,
                              segments_for)

import hf_peer  # Hugging Face transformers' MarianMTModel (optional)
from jaxformer.train import TrainConfig, train_functions

BATCH, SRC_LEN, NEW_TOKENS = 32, 32, 128
# Trace events that are not kernels: runtime, Python and executor spans, while
# loops (with YNNPACK dots a loop's event spans its whole body, whose kernels are
# events of their own), conditionals (dropout draws its masks in one: its
# event spans the branch's kernel) and the thread pool's instant markers.
NOT_KERNELS = ("ThunkExecutor", "$", "np.", "Pjit", "Slinky", "end:", "Common", "Parse",
               "while", "cond.", "Threadpool")


def kind(name: str, named: Optional[dict] = None) -> str:
    """The kind of kernel `name`; `named`: kinds by name (`named_kinds`)."""
    if named and name in named:
        return named[name]
    name = re.sub(r"\.\d+$", "", name)
    if name.startswith(("ynn_fusion", "dot", "convolution")):
        return "matmul"
    if "select" in name or "compare" in name or name.startswith("rng"):
        return "dropout/mask"
    if name.startswith(("copy", "transpose", "bitcast")) or "copy" in name:
        return "copy/layout"
    if name.startswith(("call", "conditional")):
        return "loop"
    return "elementwise"


def bench_train_functions(config=None):
    tc = TrainConfig(task="copy", min_len=SRC_LEN, max_len=SRC_LEN, batch_size=BATCH,
                     steps=100_000, warmup_steps=100, learning_rate=1e-4)
    return train_functions(bench_config() if config is None else config, tc)


def train_step(config=None):
    """(run n steps -> seconds, what, compiled HLO) of the bench train step (`config`:
    the bench model's, by default)."""
    fns = bench_train_functions(config)
    batch, box = fns.batch(0, 0), {"state": fns.init(0)}
    step, _ = fns.compiled_step(box["state"], batch)

    def run(n):
        start = time.perf_counter()
        for _ in range(n):
            box["state"], metrics = step(box["state"], batch)
        float(metrics["loss"])
        return time.perf_counter() - start
    run.batch = batch
    return run, "train step", step.as_text()


def decode_loop():
    config = bench_config()
    model = jf.Transformer(config)
    src = jax.random.randint(jax.random.PRNGKey(1), (BATCH, SRC_LEN), 3, config.src_vocab_size)
    params = model.init(jax.random.PRNGKey(0), src[:1], src[:1])["params"]
    hlo = encdec_program.lower(  # what greedy_decode compiles
        model, params, src, None, jax.random.PRNGKey(0), max_new_tokens=NEW_TOKENS,
        select=greedy, loop="scan", return_logits=False,
        segments=segments_for(NEW_TOKENS)).compile().as_text()

    def run(n):
        start = time.perf_counter()
        for _ in range(n):
            out = greedy_decode(model, params, src, max_new_tokens=NEW_TOKENS)
        out.tokens.block_until_ready()
        return time.perf_counter() - start
    return run, f"greedy decode of {NEW_TOKENS} tokens", hlo


def named_kinds(hlo_text: str) -> dict[str, str]:
    """The kernels whose kind their name does not tell, from compiled HLO text:
    dots with batch dimensions ("attention matmul") and YNNPACK fusions without a
    dot (its reductions: softmax's and the norms' sums and maxima, "reduction")."""
    kinds = {name: "attention matmul" for name in
             re.findall(r"%([\w.\-]+) = \S+ dot\([^\n]*lhs_batch_dims", hlo_text)}
    computations = {m.group(1): m.group(2) for m in
                    re.finditer(r"^%([\w.\-]+) [^\n]*\{\n(.*?)\n\}", hlo_text, re.M | re.S)}
    for name, callee in re.findall(r"%(ynn_fusion[\w.\-]*) = [^\n]*calls=%([\w.\-]+)", hlo_text):
        if " dot(" not in computations.get(callee, " dot("):
            kinds[name] = "reduction"
    return kinds


def ffn_from_memory(config, pairs_in_cache: int = 4, pairs_in_memory: int = 32,
                    steps: int = 32) -> tuple[float, float]:
    """(microseconds, microseconds): one decoder FFN on B = 32 rows, relu(x W1) W2,
    when its weights stay in cache against when they come from memory.

    A loop applies `pairs_in_cache` distinct (W1, W2) pairs (8 MiB at the bench
    sizes) or `pairs_in_memory` (64 MiB, twice a 32 MiB last-level cache) in turn,
    each FFN feeding the next; same FLOPs per FFN. The decode loop's weights and
    keys/values together (`decode_roofline`'s step_mib) are what decides which
    case its dots are in.
    """
    D, F = config.d_model, config.d_ff

    def per_ffn(pairs: int) -> float:
        keys = jax.random.split(jax.random.PRNGKey(0), 2 * pairs)
        w1 = tuple(jax.random.normal(k, (D, F)) / math.sqrt(D) for k in keys[:pairs])
        w2 = tuple(jax.random.normal(k, (F, D)) / math.sqrt(F) for k in keys[pairs:])
        rounds = pairs_in_memory // pairs  # the same number of FFNs either way

        @jax.jit
        def run(x, w1, w2):
            def step(x, _):
                for _ in range(rounds):
                    for a, b in zip(w1, w2):
                        x = jnp.tanh(jax.nn.relu(x @ a) @ b)
                return x, None
            return jax.lax.scan(step, x, None, length=steps)[0]
        x = jax.random.normal(jax.random.PRNGKey(1), (BATCH, D))
        return best_time(run, x, w1, w2, repeats=5) / (steps * pairs_in_memory) * 1e6
    return per_ffn(pairs_in_cache), per_ffn(pairs_in_memory)


def decode_roofline(config) -> dict:
    """What one bench decode step must at least cost on this machine.

    A step multiplies every decoder weight with B = 32 rows (FLOPs) and reads
    every weight, the self-attention cache slots it spans and the
    cross-attention keys/values (bytes). With the loop in segments (the
    default, `segments_for`) a step of segment i spans the slots of
    segments 0..i; averaged over the N steps that is about 60 % of N at 4.
    The machine's matmul peak (float32 2048^3) and read bandwidth (a sum over
    64 MiB, more than the last-level cache) are measured here; the floor is
    FLOPs / peak + bytes / bandwidth (no overlap) and their max (perfect overlap).
    """
    D, F, H, L = config.d_model, config.d_ff, config.num_heads, config.num_decoder_layers
    V, K, B = config.tgt_vocab_size, config.head_dim, BATCH
    weights = L * (6 * D * D + 2 * D * F) + D * V  # self q,k,v,o; cross q,o; FFN; output
    lengths = segment_lengths(NEW_TOKENS, segments_for(NEW_TOKENS))
    spans = [sum(lengths[:i + 1]) for i in range(len(lengths))]  # slots segment i reads
    slots = sum(n * span for n, span in zip(lengths, spans)) / NEW_TOKENS  # a step, on average
    flops = 2 * B * weights + L * 2 * 2 * B * H * K * (slots + SRC_LEN)
    cache_bytes = L * 2 * B * H * (slots + SRC_LEN) * K * 4  # keys and values, f32
    nbytes = weights * 4 + cache_bytes
    big = jnp.ones((64 << 20) // 4, jnp.float32)
    peak = xla_matmul_peak()
    bandwidth = big.nbytes / best_time(jax.jit(jnp.sum), big)
    compute_ms, memory_ms = flops / peak * 1e3, nbytes / bandwidth * 1e3
    return {"slots_read": slots, "step_gflop": flops / 1e9, "step_mib": nbytes / 2 ** 20,
            "cache_mib": cache_bytes / 2 ** 20, "peak_gflops": peak / 1e9,
            "bandwidth_gbs": bandwidth / 1e9, "step_compute_ms": compute_ms,
            "step_memory_ms": memory_ms, "step_floor_ms": compute_ms + memory_ms,
            "step_floor_overlapped_ms": max(compute_ms, memory_ms)}


def best_time(fn, *args, repeats: int = 10) -> float:
    """Fastest of `repeats` calls of `fn(*args)`, seconds (after one warm-up call)."""
    fn(*args).block_until_ready()
    return min(once(lambda: fn(*args).block_until_ready()) for _ in range(repeats))


def xla_matmul_peak(n: int = 2048) -> float:
    """FLOP/s of a float32 (n x n) @ (n x n) with XLA on this machine."""
    a = jnp.ones((n, n), jnp.float32)
    return 2 * n ** 3 / best_time(jax.jit(jnp.matmul), a, a)


def computation_runs(hlo_text: str) -> collections.Counter:
    """How often each computation of compiled HLO text runs per call of the program:
    ENTRY once, a while body `known_trip_count` times its caller, any other callee
    (fusions, conditional branches, reducers) once per run of its caller."""
    texts = {re.match(r"(?:ENTRY )?%([\w.\-]+)", c).group(1): c
             for c in re.split(r"\n(?=%|ENTRY)", hlo_text) if c.startswith(("%", "ENTRY"))}
    callees = {}
    for name, text in texts.items():
        edges = []
        for line in text.splitlines():
            trips = re.search(r'known_trip_count":\{"n":"(\d+)"', line)
            for attr, callee in re.findall(r"(body|condition|calls|to_apply)=%([\w.\-]+)", line):
                edges.append((callee, int(trips.group(1)) if attr == "body" and trips else 1))
            for branches in re.findall(r"branch_computations=\{([^}]*)\}", line):
                edges += [(callee, 1) for callee in re.findall(r"%([\w.\-]+)", branches)]
        callees[name] = edges
    runs = collections.Counter()

    def visit(name, times):
        runs[name] += times
        for callee, multiplier in callees.get(name, ()):
            visit(callee, times * multiplier)
    visit(re.search(r"^ENTRY %([\w.\-]+)", hlo_text, re.M).group(1), 1)
    return runs


def hlo_dots(hlo_text: str) -> collections.Counter:
    """{(lhs shape, rhs shape, dimension numbers): runs per call} of the f32 dots in
    compiled HLO text (inside fusions and loop bodies too: a fusion's operands are
    its computation's parameters; a loop body's dots run once per trip)."""
    runs = computation_runs(hlo_text)
    dots = collections.Counter()
    for computation in re.split(r"\n(?=%|ENTRY)", hlo_text):
        name = re.match(r"(?:ENTRY )?%?([\w.\-]*)", computation).group(1)
        shapes = dict(re.findall(r"%([\w.\-]+) = f32\[([\d,]*)\]", computation))
        for operands, attrs in re.findall(
                r"= f32\[[\d,]*\]\S* dot\(([^)]*)\), ([^\n]*)", computation):
            lhs, rhs = (shapes[name] for name in re.findall(r"%([\w.\-]+)", operands))

            def dims(key):
                found = re.search(key + r"=\{([\d,]*)\}", attrs)
                return tuple(int(d) for d in found.group(1).split(",")) if found else ()
            shape = (lambda text: tuple(int(d) for d in text.split(",") if d))
            dots[(shape(lhs), shape(rhs),
                  ((dims("lhs_contracting_dims"), dims("rhs_contracting_dims")),
                   (dims("lhs_batch_dims"), dims("rhs_batch_dims"))))] += runs[name]
    return dots


def dot_seconds(lhs: tuple, rhs: tuple, dimension_numbers) -> float:
    """Seconds of one f32 dot_general alone, warm: the fastest of 10 calls, each of
    `repeats` dots in one compiled loop for small dots (a call's dispatch would
    otherwise dominate). Each trip's lhs depends on the last product, so XLA cannot
    hoist the dot out of the loop."""
    key = jax.random.PRNGKey(0)
    a, b = jax.random.normal(key, lhs), jax.random.normal(key, rhs)

    def repeated(a, b, repeats):
        def trip(_, a):
            out = jax.lax.dot_general(a, b, dimension_numbers)
            return a + 0.0 * out.reshape(-1)[0]  # x * 0 is not folded for floats
        return jax.lax.fori_loop(0, repeats, trip, a)
    one = best_time(jax.jit(lambda a, b: jax.lax.dot_general(a, b, dimension_numbers)), a, b)
    if one > 1e-3:
        return one
    repeats = 100
    return best_time(jax.jit(functools.partial(repeated, repeats=repeats)), a, b) / repeats


def dots_alone(hlo_text: str) -> dict[str, tuple[float, float]]:
    """{kind: (seconds, FLOPs)} of a program's dots, each compiled and timed on its
    own (`dot_seconds`) times how often it runs, by `kind` ("matmul": the
    projections; "attention matmul": the dots with batch dimensions): what the
    program costs with every other kernel free and every dot as fast as it runs
    alone."""
    out = collections.defaultdict(lambda: (0.0, 0.0))
    for (lhs, rhs, dimension_numbers), runs in hlo_dots(hlo_text).items():
        contracted = math.prod(lhs[i] for i in dimension_numbers[0][0])
        out_shape = jax.eval_shape(
            lambda a, b: jax.lax.dot_general(a, b, dimension_numbers),
            jax.ShapeDtypeStruct(lhs, jnp.float32), jax.ShapeDtypeStruct(rhs, jnp.float32)).shape
        name = "attention matmul" if dimension_numbers[1][0] else "matmul"
        seconds, flops = out[name]
        out[name] = (seconds + runs * dot_seconds(lhs, rhs, dimension_numbers),
                     flops + runs * 2 * math.prod(out_shape) * contracted)
    return dict(out)


def all_dots(by_kind: dict[str, tuple[float, float]]) -> tuple[float, float]:
    """(seconds, FLOPs) summed over `dots_alone`'s kinds."""
    return tuple(map(sum, zip(*by_kind.values())))


def once(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def trace_events(trace_dir: str) -> list[dict]:
    """The complete events (name, dur in microseconds, ...) of the trace in `trace_dir`."""
    path = sorted(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True))[-1]
    with gzip.open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def kernel_times(trace_dir: str) -> dict[str, float]:
    """Microseconds of busy time per kernel name in the trace."""
    busy = collections.Counter()
    for e in trace_events(trace_dir):
        if not e["name"].startswith(NOT_KERNELS):
            busy[e["name"]] += e["dur"]
    return busy


# XLA:CPU's compile phases, by the trace spans that time them (busy time summed
# over threads: the fusion emitters run on both cores).
COMPILE_PHASES = {"hlo passes": "HLO passes", "fusion emitters": "FusionCompiler::Compile",
                  "llvm codegen": "Codegen", "xla total": "PjRtCpuClient::Compile"}


def compile_phases(config) -> dict:
    """Seconds of the bench train step's lowering and of each XLA compile phase."""
    fns = bench_train_functions(config)
    state, batch = fns.init(0), fns.batch(0, 0)
    start = time.perf_counter()
    lowered = fns.step.lower(state, batch)
    out = {"lower": time.perf_counter() - start}
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            start = time.perf_counter()
            lowered.compile()
            out["xla compile"] = time.perf_counter() - start
        events = trace_events(trace_dir)
    for phase, prefix in COMPILE_PHASES.items():
        out[phase] = sum(e["dur"] for e in events if e["name"].startswith(prefix)) / 1e6
    out["total"] = out["lower"] + out["xla compile"]
    out["kernels"] = sum(e["name"] == COMPILE_PHASES["fusion emitters"] for e in events)
    return out


def compile_main() -> dict:
    config = bench_config()
    variants = {"unrolled": config, "scanned": config.replace(scan_layers=True)}
    rows = {name: compile_phases(c) for name, c in variants.items()}
    columns = ("total", "lower", "xla compile", *COMPILE_PHASES)
    print("bench train step compile (s; phases are busy time summed over threads)")
    print(f"{'layers':<10}" + "".join(f"{c:>16}" for c in columns) + f"{'kernels':>9}")
    for name, row in rows.items():
        print(f"{name:<10}" + "".join(f"{row[c]:>16.2f}" for c in columns)
              + f"{row['kernels']:>9d}")
    result = {"what": "compile"}
    for name, row in rows.items():
        result[f"{name}_compile_s"] = round(row["total"], 2)
        result.update({f"{name}_{c.replace(' ', '_')}_s": round(row[c], 2)
                       for c in columns if c != "total"})
        result[f"{name}_kernels"] = row["kernels"]
    print(json.dumps(result))
    return result


TUNING = {"cpu_tuning": True}


def bench_config(**overrides) -> jf.TransformerConfig:
    """The bench workload, CPU-tuned unless --tuning default."""
    return jf.bench(**{**TUNING, **overrides})


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=("train", "decode", "compile"))
    parser.add_argument("--tuning", choices=("cpu", "default"), default="cpu",
                        help="profile with jaxformer.backends.cpu's tuning (default) or without")
    parser.add_argument("--steps", type=int, default=3, help="steps traced (and timed)")
    parser.add_argument("--top", type=int, default=12, help="largest kernels listed")
    args = parser.parse_args(argv)
    TUNING["cpu_tuning"] = args.tuning == "cpu"
    if TUNING["cpu_tuning"]:
        print(f"CPU tuning: on (tune_process: {cpu.tune_process()})", file=sys.stderr)
    if args.what == "compile":
        return compile_main()
    run, what, hlo = train_step() if args.what == "train" else decode_loop()
    named = named_kinds(hlo)
    run(2)  # compile and warm up
    wall = statistics.median(run(1) for _ in range(args.steps)) * 1e3
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            run(args.steps)
        busy = kernel_times(trace_dir)
    per_step = {name: us / 1e3 / args.steps for name, us in busy.items()}
    by_kind = collections.Counter()
    for name, ms in per_step.items():
        by_kind[kind(name, named)] += ms
    total = sum(by_kind.values())
    print(f"bench {what}: wall {wall:.1f} ms; kernel busy time summed over threads "
          f"{total:.1f} ms per step")
    print(f"{'kind':<17} {'ms/step':>9} {'share':>7}")
    for name, ms in by_kind.most_common():
        print(f"{name:<17} {ms:>9.1f} {ms / total:>7.1%}")
    print(f"\nlargest kernels ({args.top}):")
    for name, ms in sorted(per_step.items(), key=lambda item: -item[1])[:args.top]:
        print(f"  {ms:8.2f} ms  {name}")
    result = {"what": args.what, "wall_ms": round(wall, 1), "kernel_ms": round(total, 1),
              **{re.sub(r"[/ ]", "_", k) + "_ms": round(v, 1) for k, v in by_kind.items()},
              "matmul_share": round(by_kind["matmul"] / total, 3)}
    if args.what == "decode":
        result.update(decode_limits(hlo, wall, by_kind))
    else:
        result.update(train_limits(hlo, wall, run))
    print(json.dumps(result))
    return result


def decode_limits(hlo_text: str, wall_ms: float, in_loop_ms: dict) -> dict:
    """The roofline of a decode step, the loop's dots alone against the same dots
    in the loop (`in_loop_ms`: kernel ms by kind), and what they allow against
    Hugging Face."""
    roof = decode_roofline(bench_config())
    print(f"\nroofline of one decode step (batch {BATCH}, {roof['slots_read']:.0f} of "
          f"{NEW_TOKENS} cache slots read on average): "
          f"{roof['step_gflop']:.3f} GFLOP at a matmul peak of {roof['peak_gflops']:.0f} "
          f"GFLOP/s = {roof['step_compute_ms']:.2f} ms; {roof['step_mib']:.1f} MiB read "
          f"({roof['cache_mib']:.1f} MiB of it keys/values) at {roof['bandwidth_gbs']:.1f} "
          f"GB/s = {roof['step_memory_ms']:.2f} ms")
    floor, overlapped = (roof[f"step_{k}"] * NEW_TOKENS
                         for k in ("floor_ms", "floor_overlapped_ms"))
    print(f"{NEW_TOKENS} steps: measured {wall_ms:.0f} ms; floor {floor:.0f} ms "
          f"(compute + memory), {overlapped:.0f} ms if they overlapped perfectly")
    alone = dots_alone(hlo_text)
    alone_s, flops = all_dots(alone)
    alone_ms = alone_s * 1e3
    print(f"the loop's dots (encoder and prefill included), each alone: {alone_ms:.0f} ms "
          f"for {flops / 1e9:.1f} GFLOP ({flops / alone_s / 1e9:.0f} GFLOP/s)")
    slowdown = {}
    for name, (seconds, _) in sorted(alone.items()):
        slowdown[name] = in_loop_ms[name] / (seconds * 1e3)
        print(f"  {name}: {in_loop_ms[name]:.0f} ms in the loop, {seconds * 1e3:.0f} ms alone "
              f"({slowdown[name]:.1f}x)")
    hot_us, cold_us = ffn_from_memory(bench_config())
    print(f"a step reads {roof['step_mib']:.1f} MiB of weights and keys/values; one FFN "
          f"(B = {BATCH}) takes {hot_us:.0f} us with its weights in cache (8 MiB of them) "
          f"and {cold_us:.0f} us from memory (64 MiB), {cold_us / hot_us:.1f}x")
    out = {"floor_ms": round(floor, 1), "floor_overlapped_ms": round(overlapped, 1),
           "dots_alone_ms": round(alone_ms, 1), "ffn_weights_in_cache_us": round(hot_us, 1),
           "ffn_weights_from_memory_us": round(cold_us, 1),
           **{f"{name.replace(' ', '_')}_in_loop_vs_alone": round(x, 2)
              for name, x in slowdown.items()},
           **{k: round(v, 3) for k, v in roof.items()}}
    transformers = hf_peer.load()
    if transformers is not None:
        import numpy as np  # noqa: PLC0415
        hf = hf_peer.MarianGreedy(transformers, bench_config(),
                                  np.random.default_rng(0).integers(3, 100, (BATCH, SRC_LEN)))
        hf(4)  # warm-up
        hf_ms = statistics.median(once(lambda: hf(NEW_TOKENS)) for _ in range(3)) * 1e3
        print(f"hf generate: {hf_ms:.0f} ms; ratio_vs_hf now {hf_ms / wall_ms:.2f}, at the "
              f"floor {hf_ms / floor:.2f}, at the overlapped floor {hf_ms / overlapped:.2f}, "
              f"at the dots alone {hf_ms / alone_ms:.2f}")
        out.update(hf_ms=round(hf_ms, 1), ratio_vs_hf=round(hf_ms / wall_ms, 3),
                   ratio_vs_hf_at_dots_alone=round(hf_ms / alone_ms, 3),
                   ratio_vs_hf_at_floor=round(hf_ms / floor, 3),
                   ratio_vs_hf_at_overlapped_floor=round(hf_ms / overlapped, 3))
    return out


def train_limits(hlo_text: str, wall_ms: float, run) -> dict:
    """What XLA:CPU's dot kernels allow the train step (`run`): its dots alone,
    against the machine's matmul peak and, with transformers, against Hugging
    Face's step; and what the step costs with dropout off."""
    from train import matmul_peak  # noqa: PLC0415 (imports torch)

    alone_s, flops = all_dots(dots_alone(hlo_text))
    peak = max(matmul_peak().values())  # as benchmarks/train.py: the faster of jax and torch
    alone_ms = alone_s * 1e3
    print(f"\nthe step's dots, each alone: {alone_ms:.0f} ms for {flops / 1e9:.2f} GFLOP "
          f"({flops / alone_s / 1e9:.0f} GFLOP/s; peak {peak / 1e9:.0f}, train.py's). "
          f"fraction_of_matmul_peak now {flops / wall_ms * 1e3 / peak:.2f}, with every "
          f"other kernel free {flops / alone_s / peak:.2f}")
    out = {"dots_alone_ms": round(alone_ms, 1), "step_gflop": round(flops / 1e9, 2),
           "matmul_peak_gflops": round(peak / 1e9, 1),
           "fraction_of_matmul_peak": round(flops / wall_ms * 1e3 / peak, 3),
           "fraction_of_matmul_peak_at_dots_alone": round(flops / alone_s / peak, 3),
           **dropout_cost(run, flops, peak)}
    transformers = hf_peer.load()
    if transformers is not None:
        hf = hf_peer.MarianTrainStep(transformers, bench_config(), run.batch)
        hf()  # warm-up
        hf_ms = statistics.median(once(hf) for _ in range(5)) * 1e3
        print(f"hf train step: {hf_ms:.0f} ms; ratio_vs_hf now {hf_ms / wall_ms:.2f}, "
              f"at the dots alone {hf_ms / alone_ms:.2f}")
        out.update(hf_ms=round(hf_ms, 1), ratio_vs_hf=round(hf_ms / wall_ms, 3),
                   ratio_vs_hf_at_dots_alone=round(hf_ms / alone_ms, 3))
    return out


def dropout_cost(run, flops: float, peak: float, rounds: int = 5) -> dict:
    """The bench step with every dropout rate 0 beside the step as it is (`run`),
    interleaved, medians: what dropout costs in wall time (its masks are
    `jax.random.bernoulli`'s threefry bits, flax's, bit for bit), and the fraction of
    the matmul `peak` (FLOP/s) the step's `flops` would reach with dropout free."""
    rates = dict.fromkeys(("attention_dropout", "residual_dropout", "embedding_dropout",
                           "ffn_dropout"), 0.0)
    without, _, _ = train_step(bench_config(**rates))
    without(2)  # compile and warm up
    times = {"with": [], "without": []}
    for _ in range(rounds):
        times["with"].append(run(3) / 3)
        times["without"].append(without(3) / 3)
    with_ms, without_ms = (statistics.median(times[k]) * 1e3 for k in ("with", "without"))
    fraction = flops / without_ms * 1e3 / peak
    print(f"dropout off (every rate 0), interleaved: {without_ms:.1f} ms a step against "
          f"{with_ms:.1f}; fraction_of_matmul_peak with dropout free {fraction:.2f}")
    return {"dropout_off_ms": round(without_ms, 1), "dropout_on_ms": round(with_ms, 1),
            "fraction_of_matmul_peak_without_dropout": round(fraction, 3)}


if __name__ == "__main__":
    main()

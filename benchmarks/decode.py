"""Greedy decoding on the "bench" workload: jaxformer's cached loop vs recompute vs seed 001.

Workload (../shared/DESIGN.md "bench"): vocab 100, d_model 256, 8 heads, d_ff
1024, 4 encoder + 4 decoder layers, float32, batch 32, source length 32,
128 new tokens; random weights, eval mode (no dropout). Three decoders run
side by side in one process:

  jax cached     `jaxformer.decode.api.greedy_decode`: one jitted `lax.scan`,
                 KV cache carried as a pytree, cross K/V projected once,
                 in a process that asked for CPU tuning (`--tuning cpu`, the
                 default here: `jaxformer.backends.cpu.tune_process`: on a
                 CPU split into a device per core XLA's own dots rather
                 than YNNPACK's; the loop in segments). Data-parallel: every CPU core is a JAX
                 device (`use_cpu_cores_as_devices`), the batch is
                 split over them and the parameters replicated. Also timed:
                 the same loop on one of those devices (one core), with
                 `lax.while_loop`, and compiled with XLA's default options.
                 `--devices 1`: one device owning all cores, JAX's default and
                 what a new user gets (YNNPACK's dots).
  jax recompute  `greedy_decode_recompute`: the seeds' algorithm compiled --
                 a full decoder pass over the (B, N) prefix buffer every step
                 (data-parallel like the cached loop; XLA's default options).
  seed torch     seed 001's PyTorch `Transformer.greedy_decode` (verbatim in
                 benchmarks/seed001.py, bugs included): re-runs the decoder
                 over the growing prefix in a Python loop. It runs with torch
                 threads = CPU cores or 1, whichever decodes 32 tokens faster
                 here (on a shared machine OpenMP with 2 threads can be slower).

  hf generate    Hugging Face `MarianMTModel.generate` (benchmarks/hf_peer.py):
                 greedy with its KV cache (use_cache=True), the same sizes, random
                 weights, EOS disabled; torch threads = cores. ratio_vs_hf is
                 against this run's devices (the batch split over the cores);
                 ratio_vs_hf_one_device against the whole batch on one JAX
                 device that owns every core, JAX's default and what a GPU or
                 TPU user's single device compares to (timed with HF again, in
                 a child process with --devices 1, since a process's CPU devices
                 are fixed at start); ratio_vs_hf_one_core against one of this
                 run's one-core devices.

All of them generate every one of the N tokens: the JAX scan always runs N
steps, and the seed loop only stops early if *every* row emits EOS in the
same step (random weights do not; rows that emit EOS are counted and printed).
The host's speed drifts by tens of percent over minutes (shared cores), so the
128-token decoders run in paired rounds: each round times every JAX variant
and the seed loop once, back to back; a speed-up is the median over rounds of
that round's ratio. tokens/s = B * N / (median wall time of a full decode,
compile excluded); compile_s = first call - median call. Per-step times at
N = 32, 128, 512 show how each step's cost grows with N: cached and seed =
full loop time / N;
recompute = the time of one of its steps, a full decoder pass over the
(B, N) buffer (a full 512-step recompute loop would take many minutes).

Default against tuned: two more child processes, each one JAX device owning
every core, time the loop against HF generate, one with JAX and jaxformer as
they are (`--tuning default`), one after `tune_process()` (`--tuning cpu`):
ratio_vs_hf_default and ratio_vs_hf_tuned. `--sides-only` runs just those two.

Run (5-10 minutes on 2 shared CPU cores; the torch and recompute loops dominate):
  nice -n 5 python benchmarks/decode.py
Prints a table, then one JSON line with tokens_per_s, compile_s,
speedup_vs_recompute, speedup_vs_seed_torch, ratio_vs_hf, ratio_vs_hf_one_device
and the other figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jaxformer as jf
from jaxformer.decode import (encdec_program, greedy, greedy_decode, greedy_decode_recompute,
                              segments_for)
from jaxformer.backends import cpu
from jaxformer.parallel import make_mesh, replicate, shard_batch, use_cpu_cores_as_devices

import hf_peer  # Hugging Face transformers' MarianMTModel (optional)
from seed001 import Transformer as SeedTransformer  # the peer, verbatim from seed 001

# ---------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------

BATCH, SRC_LEN, NEW_TOKENS, VOCAB = 32, 32, 128, 100
STEP_LENGTHS = (32, 128, 512)
BOS, EOS = 1, 2


def timed(fn, repeats: int):
    """(first call seconds, median of `repeats` further calls, last result)."""
    start = time.perf_counter()
    result = fn()
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return first, statistics.median(times), result


def once(fn):
    """(seconds, result) of one call."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def block(result):
    return jax.tree_util.tree_map(lambda x: x.block_until_ready(), result)


def vs_hf_only(rounds: int) -> dict:
    """The cached loop on this process's devices against HF generate, interleaved
    rounds, medians; prints and returns one JSON line."""
    transformers = hf_peer.load()
    if transformers is None:
        raise SystemExit("--vs-hf-only needs transformers (pip install -e '.[bench]')")
    torch.set_num_threads(os.cpu_count() or 1)
    src_np = np.random.default_rng(0).integers(3, VOCAB, (BATCH, SRC_LEN))
    config = jf.bench(max_len=max(STEP_LENGTHS))
    model = jf.Transformer(config)
    src = jnp.asarray(src_np, jnp.int32)
    params = model.init(jax.random.PRNGKey(0), src, src[:, :4])["params"]
    hf_generate = hf_peer.MarianGreedy(transformers, config, src_np)
    jax_run = lambda: block(greedy_decode(model, params, src,  # noqa: E731
                                                   max_new_tokens=NEW_TOKENS))
    jax_run(), hf_generate(4)  # compile; warm up
    jax_s, hf_s = [], []
    for _ in range(rounds):
        jax_s.append(once(jax_run)[0])
        hf_s.append(once(lambda: hf_generate(NEW_TOKENS))[0])
    out = {"jax_devices": len(jax.devices()), "jax_s": round(statistics.median(jax_s), 4),
           "hf_s": round(statistics.median(hf_s), 4),
           "ratio_vs_hf": round(statistics.median(h / j for h, j in zip(hf_s, jax_s)), 2),
           "tokens_per_s": round(BATCH * NEW_TOKENS / statistics.median(jax_s), 1)}
    print(json.dumps(out))
    return out


def child_vs_hf_one_device(rounds: int, tuning: str = "cpu") -> dict:
    """`vs_hf_only` in a child process whose CPU is one JAX device (JAX's default),
    with `tuning` ("cpu": `backends.cpu.tune_process()`; "default": none)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--devices", "1", "--vs-hf-only",
           "--rounds", str(rounds), "--tuning", tuning]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the one-device child failed ({' '.join(cmd)}):\n"
                         + done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def sides(rounds: int) -> dict:
    """One device owning every core, default against CPU-tuned, each against HF
    generate in its own child process; prints a table and one JSON line."""
    got = {tuning: child_vs_hf_one_device(rounds, tuning) for tuning in ("default", "cpu")}
    print(f"{'one device':<14}{'jax s':>8}{'hf s':>8}{'vs hf':>8}")
    for tuning, row in got.items():
        print(f"{tuning:<14}{row['jax_s']:>8.3f}{row['hf_s']:>8.3f}{row['ratio_vs_hf']:>8.2f}")
    out = {"ratio_vs_hf_default": got["default"]["ratio_vs_hf"],
           "ratio_vs_hf_tuned": got["cpu"]["ratio_vs_hf"],
           "default_tokens_per_s": got["default"]["tokens_per_s"],
           "tuned_tokens_per_s": got["cpu"]["tokens_per_s"]}
    print(json.dumps(out))
    return out


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of the fast decoders")
    parser.add_argument("--rounds", type=int, default=3,
                        help="paired rounds of the 128-token decoders (jax variants and seed torch)")
    parser.add_argument("--devices", type=int, default=os.cpu_count() or 1,
                        help="JAX CPU devices to split the cores into (default: one per core)")
    parser.add_argument("--vs-hf-only", action="store_true",
                        help="only the cached loop against HF generate, interleaved: one JSON "
                             "line (what the default run starts with --devices 1 for the "
                             "one-device figure)")
    parser.add_argument("--tuning", choices=("cpu", "default"), default="cpu",
                        help="ask for jaxformer.backends.cpu's process tuning (default) or not")
    parser.add_argument("--sides-only", action="store_true",
                        help="only ratio_vs_hf_default and ratio_vs_hf_tuned (two children)")
    args = parser.parse_args(argv)
    if args.sides_only:
        return sides(args.rounds)
    if args.tuning == "cpu":
        print(f"CPU tuning: on (tune_process: {cpu.tune_process()})", file=sys.stderr)
    use_cpu_cores_as_devices(args.devices)  # before JAX's first computation
    if args.vs_hf_only:
        return vs_hf_only(args.rounds)

    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    src_np = rng.integers(3, VOCAB, (BATCH, SRC_LEN))  # no PAD: every source position is real

    # jaxformer: the bench preset; max_len only sizes the sinusoidal table.
    config = jf.bench(max_len=max(STEP_LENGTHS))
    model = jf.Transformer(config)
    src = jnp.asarray(src_np, jnp.int32)
    params = model.init(jax.random.PRNGKey(0), src, src[:, :4])["params"]
    # Data parallelism: rows split over the devices, parameters on every device.
    mesh = make_mesh()
    src_split, params_all = shard_batch(src, mesh), replicate(params, mesh)

    def cached(n, loop="scan", p=params_all, s=src_split):
        return lambda: block(greedy_decode(model, p, s, max_new_tokens=n, loop=loop))

    def recompute(n):
        return lambda: block(greedy_decode_recompute(model, params_all, src_split,
                                                              max_new_tokens=n))

    rows = {}
    print(f"bench workload: batch {BATCH}, source {SRC_LEN}, {NEW_TOKENS} new tokens, "
          f"jax {jax.__version__} on {len(jax.devices())} {jax.devices()[0].platform} device(s), "
          f"torch {torch.__version__} with {threads} threads")

    # 1. First calls: compile time, and the tokens every variant must agree on.
    default_options = jax.jit(encdec_program.__wrapped__,
                              static_argnames=encdec_program.static_argnames)
    jax_runs = {
        "jax cached (scan)": cached(NEW_TOKENS),
        "jax cached (while)": cached(NEW_TOKENS, "while"),
        # The scan loop compiled with XLA's default options (YNNPACK dots on the CPU).
        "jax cached (XLA default)": lambda: block(default_options(
            model, params_all, src_split, None, jax.random.PRNGKey(0),
            max_new_tokens=NEW_TOKENS, select=greedy, loop="scan",
            return_logits=False, segments=segments_for(NEW_TOKENS))),
    }
    if mesh.devices.size > 1:  # the whole batch on one of those devices (one core)
        jax_runs["jax cached (1 core)"] = cached(NEW_TOKENS, p=params, s=src)
    first_s, results = {}, {}
    for name, run in jax_runs.items():
        first_s[name], results[name] = once(run)
    result = results["jax cached (scan)"]
    eos_rows = int((np.asarray(result.lengths) < NEW_TOKENS).sum())

    # 2. seed 001's PyTorch loop, same sizes, eval mode.
    seed_model = SeedTransformer(src_vocab=VOCAB, tgt_vocab=VOCAB, d_model=256, num_heads=8,
                             d_ff=1024, num_layers=4, dropout=0.1, max_len=max(STEP_LENGTHS))
    seed_model.eval()
    src_torch = torch.as_tensor(src_np, dtype=torch.long)

    def seed(n):
        return lambda: seed_model.greedy_decode(src_torch, bos_id=BOS, eos_id=EOS,
                                                max_new_tokens=n)

    # torch threads = cores (as asked) or 1: on a shared, loaded machine OpenMP's
    # spinning barriers can make 2 threads slower than 1. The peer runs with
    # whichever is faster here at 32 new tokens (the conservative ratio).
    seed_32_s = {}
    for n_threads in sorted({threads, 1}, reverse=True):
        torch.set_num_threads(n_threads)
        seed(4)()  # warm-up with this thread count (allocator, thread pool)
        seed_32_s[n_threads] = once(seed(32))[0]
    seed_threads = min(seed_32_s, key=seed_32_s.get)
    torch.set_num_threads(seed_threads)
    seed_name = f"seed torch ({seed_threads} thr)"

    # 2b. Hugging Face MarianMTModel.generate (greedy, KV cache, EOS off), torch
    # threads = cores, as a user runs it.
    transformers = hf_peer.load()
    hf_name = "hf generate (cache)"
    if transformers is not None:
        torch.set_num_threads(threads)
        hf_generate = hf_peer.MarianGreedy(transformers, config, src_np)
        hf_generate(4)  # warm-up: the first generate call sets up its caches
    torch.set_num_threads(seed_threads)

    # 3. Paired rounds. This machine's speed drifts by tens of percent over
    # minutes (a shared host), so each round times every decoder once, back to
    # back, and speed-ups are the median over rounds of that round's ratio.
    times = {name: [] for name in [*jax_runs, seed_name]}
    if transformers is not None:
        times[hf_name] = []
    for _ in range(args.rounds):
        for name, run in jax_runs.items():
            times[name].append(once(run)[0])
        seconds, ys = once(seed(NEW_TOKENS))
        times[seed_name].append(seconds)
        if transformers is not None:
            torch.set_num_threads(threads)
            times[hf_name].append(once(lambda: hf_generate(NEW_TOKENS))[0])
            torch.set_num_threads(seed_threads)
    seed_generated = ys.shape[1] - 1
    seed_eos_rows = int((ys[:, 1:] == EOS).any(dim=1).sum())
    rows = {name: dict(compile_s=first_s.get(name, 0.0) - statistics.median(ts),
                       run_s=statistics.median(ts)) for name, ts in times.items()}
    rows[seed_name]["compile_s"] = 0.0
    if transformers is not None:
        rows[hf_name]["compile_s"] = 0.0

    # 4. jaxformer naive recompute (heavy: one timed run after the compile).
    first, median, recompute_result = timed(recompute(NEW_TOKENS), 1)
    rows["jax recompute"] = dict(compile_s=first - median, run_s=median)
    for name, row in rows.items():
        generated = seed_generated if name == seed_name else NEW_TOKENS
        row["tokens_per_s"] = BATCH * generated / row["run_s"]

    def speedup(name):  # median over rounds of seed time / jax time, per generated token
        return statistics.median(seed_s / jax_s * NEW_TOKENS / seed_generated
                                 for seed_s, jax_s in zip(times[seed_name], times[name]))

    def vs_hf(name):  # median over rounds of HF time / jax time (both generate N tokens)
        if transformers is None:
            return None
        return round(statistics.median(hf_s / jax_s for hf_s, jax_s in
                                       zip(times[hf_name], times[name])), 2)

    # 5. Per-step time against the number of new tokens.
    per_step = {"jax cached": {}, "jax recompute": {}, seed_name: {}}
    for n in STEP_LENGTHS:
        if n == NEW_TOKENS:
            run_s = rows["jax cached (scan)"]["run_s"]
        else:
            run_s = timed(cached(n), args.repeats)[1]
        per_step["jax cached"][n] = 1e3 * run_s / n
    # One recompute step = a full decoder pass over the (B, n) prefix buffer + argmax.
    decode_pass = jax.jit(lambda p, s, t: jnp.argmax(model.apply(
        {"params": p}, s, t, None, jf.causal_mask(t.shape[1]))[:, -1], axis=-1))
    for n in STEP_LENGTHS:
        tgt = shard_batch(jnp.ones((BATCH, n), jnp.int32), mesh)
        per_step["jax recompute"][n] = 1e3 * timed(
            lambda: decode_pass(params_all, src_split, tgt).block_until_ready(), 3)[1]
    for n in STEP_LENGTHS[:2]:  # 512 seed steps would take many minutes
        run_s = rows[seed_name]["run_s"] if n == NEW_TOKENS else timed(seed(n), 1)[1]
        per_step[seed_name][n] = 1e3 * run_s / n

    # 6. When does the early-exit while_loop win? Make every row stop early (EOS bias).
    early = {}
    for delta in (2.0, 3.0, 4.0, 6.0, 8.0):
        biased = jax.tree_util.tree_map(lambda x: x, params)
        biased["decoder"]["out_proj"]["bias"] = params["decoder"]["out_proj"]["bias"].at[
            EOS].add(delta)
        biased = replicate(biased, mesh)
        lengths = np.asarray(cached(NEW_TOKENS, p=biased)().lengths)
        if lengths.max() < NEW_TOKENS // 2:
            early = dict(eos_bias=delta, max_length=int(lengths.max()),
                         scan_s=timed(cached(NEW_TOKENS, p=biased), args.repeats)[1],
                         while_s=timed(cached(NEW_TOKENS, "while", p=biased), args.repeats)[1])
            break

    # 7. One device that owns every core (JAX's default), in a child process: a
    # process's CPU devices are fixed when JAX starts.
    one_device, one_device_default = None, None
    if transformers is not None:
        one_device_default = child_vs_hf_one_device(args.rounds, "default")
        print(f"one device, no CPU tuning (child process): jax "
              f"{one_device_default['jax_s']:.3f} s, hf {one_device_default['hf_s']:.3f} s, "
              f"ratio_vs_hf {one_device_default['ratio_vs_hf']}")
    if mesh.devices.size > 1 and transformers is not None:
        one_device = child_vs_hf_one_device(args.rounds, args.tuning)
        print(f"one device owning all {threads} cores (child process): jax "
              f"{one_device['jax_s']:.3f} s, hf {one_device['hf_s']:.3f} s, "
              f"ratio_vs_hf {one_device['ratio_vs_hf']}")

    # Report.
    cached_row = rows["jax cached (scan)"]
    speedup_seed = speedup("jax cached (scan)")
    speedup_recompute = cached_row["tokens_per_s"] / rows["jax recompute"]["tokens_per_s"]
    same_tokens = all(np.array_equal(np.asarray(result.tokens), np.asarray(other.tokens))
                      for other in (recompute_result, *results.values()))
    print(f"\n{'decoder':<26}{'compile s':>10}{'run s':>10}{'tokens/s':>12}{'vs seed':>9}"
          f"   (run s: median of {args.rounds} paired rounds; vs seed: median of per-round ratios)")
    for name, row in rows.items():
        if name == hf_name:
            ratio = f"{rows[seed_name]['run_s'] / row['run_s'] * NEW_TOKENS / seed_generated:>8.1f}x"
        else:
            ratio = (f"{speedup(name):>8.1f}x" if name in jax_runs else
                     f"{row['tokens_per_s'] / rows[seed_name]['tokens_per_s']:>8.1f}x")
        hf = f"{vs_hf(name):>8.2f}x" if name in jax_runs and transformers is not None else ""
        print(f"{name:<26}{row['compile_s']:>10.2f}{row['run_s']:>10.3f}"
              f"{row['tokens_per_s']:>12.0f}{ratio}{hf}")
    print(f"\n{'ms per step':<26}" + "".join(f"{'N=' + str(n):>10}" for n in STEP_LENGTHS))
    for name, values in per_step.items():
        print(f"{name:<26}" + "".join(f"{values[n]:>10.2f}" if n in values else f"{'-':>10}"
                                      for n in STEP_LENGTHS))
    print(f"\nrows that emitted EOS within {NEW_TOKENS} tokens: jax {eos_rows}/{BATCH}, "
          f"{seed_name} {seed_eos_rows}/{BATCH} (seed generated {seed_generated} tokens); "
          f"cached tokens == recompute tokens == default-options tokens: {same_tokens}")
    if early:
        print(f"early exit (EOS bias +{early['eos_bias']}, every row done by step "
              f"{early['max_length']}): scan {1e3 * early['scan_s']:.1f} ms, "
              f"while {1e3 * early['while_s']:.1f} ms")
    summary = {
        "workload": dict(batch=BATCH, src_len=SRC_LEN, new_tokens=NEW_TOKENS, d_model=256,
                         heads=8, d_ff=1024, layers="4+4", vocab=VOCAB, threads=threads),
        "jax_devices": int(mesh.devices.size),
        "tokens_per_s": round(cached_row["tokens_per_s"], 1),
        "compile_s": round(cached_row["compile_s"], 2),
        "speedup_vs_recompute": round(speedup_recompute, 2),
        "speedup_vs_seed_torch": round(speedup_seed, 2),
        "target_30x_met": speedup_seed >= 30,
        # vs Hugging Face MarianMTModel.generate (None: transformers absent).
        # ratio_vs_hf: this run's devices (by default the batch split over the
        # cores, one device each); one device: the whole batch on one JAX device
        # that owns every core, JAX's default (a child process with --devices 1);
        # one core: the whole batch on one of this run's one-core devices.
        "ratio_vs_hf": vs_hf("jax cached (scan)"),
        "ratio_vs_hf_one_device": (one_device["ratio_vs_hf"] if one_device else
                                   vs_hf("jax cached (scan)")),
        # one device owning every core: jaxformer as it is against CPU-tuned (--tuning)
        "ratio_vs_hf_default": (one_device_default or {}).get("ratio_vs_hf"),
        "ratio_vs_hf_tuned": (one_device["ratio_vs_hf"] if one_device else
                              vs_hf("jax cached (scan)")),
        **({"ratio_vs_hf_one_core": vs_hf("jax cached (1 core)")}
           if "jax cached (1 core)" in rows else {}),
        "hf_tokens_per_s": (round(rows[hf_name]["tokens_per_s"], 1)
                            if transformers is not None else None),
        "speedup_vs_seed_torch_by_round": [
            round(seed_s / jax_s * NEW_TOKENS / seed_generated, 2)
            for seed_s, jax_s in zip(times[seed_name], times["jax cached (scan)"])],
        "while_tokens_per_s": round(rows["jax cached (while)"]["tokens_per_s"], 1),
        "while_compile_s": round(rows["jax cached (while)"]["compile_s"], 2),
        "xla_default_options_tokens_per_s": round(
            rows["jax cached (XLA default)"]["tokens_per_s"], 1),
        "xla_default_options_speedup_vs_seed_torch": round(speedup("jax cached (XLA default)"), 2),
        **({"one_device_tokens_per_s": one_device["tokens_per_s"]} if one_device else {}),
        **({"one_core_tokens_per_s": round(rows["jax cached (1 core)"]["tokens_per_s"], 1),
            "one_core_speedup_vs_seed_torch": round(speedup("jax cached (1 core)"), 2)}
           if "jax cached (1 core)" in rows else {}),
        "recompute_tokens_per_s": round(rows["jax recompute"]["tokens_per_s"], 1),
        "recompute_compile_s": round(rows["jax recompute"]["compile_s"], 2),
        "seed_torch_tokens_per_s": round(rows[seed_name]["tokens_per_s"], 1),
        "seed_torch_threads": seed_threads,
        "seed_torch_32_tokens_s_by_threads": {str(k): round(v, 2) for k, v in seed_32_s.items()},
        "per_step_ms": {k: {str(n): round(v, 3) for n, v in d.items()}
                        for k, d in per_step.items()},
        "eos_rows": dict(jax=eos_rows, seed_torch=seed_eos_rows),
        "seed_generated_tokens": seed_generated,
        "cached_equals_recompute": same_tokens,
        "early_exit": {k: (round(v, 4) if isinstance(v, float) else v)
                       for k, v in early.items()},
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()

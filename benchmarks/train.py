"""Training throughput on the "bench" workload: jaxformer vs seed 001's PyTorch model.

Workload (../shared/DESIGN.md "bench"): vocab 100, d_model 256, 8 heads, d_ff
1024, 4 encoder + 4 decoder layers, dropout 0.1 while training, float32,
batch 32, source length 32, copy task (target input = BOS + source, labels =
source + EOS, so T = 33). Both sides train on the same batch every step
(data generation is not timed):

  jaxformer   `jaxformer.train`: the jitted train step of `jaxformer train`
              (AdamW + clipping + schedule, the state donated), compiled once.
  seed torch  seed 001's PyTorch classes, copied below unchanged, trained the
              way seed 001 trains them: CrossEntropyLoss(ignore_index=0), Adam,
              zero_grad / backward / step; eager PyTorch at its default thread
              count (= cores; 1 thread measured slower here: ~0.87 vs ~0.59 s/step).

  hf marian   Hugging Face `transformers.MarianMTModel` (benchmarks/hf_peer.py): the
              seeds' architecture at the same sizes, dropout 0.1, forward + backward
              + clipping + AdamW, eager PyTorch at its default thread count. The
              peer a user would pick; skipped, saying so, without transformers.

They alternate in windows of --steps steps (--rounds times) so that load from
other processes hits both alike; the figures are medians over the windows. One
untimed window of each side comes first: the process's heap reaches its steady
size there.

Default against tuned (`--tuning both`, the default): the whole comparison runs
twice, each in a child process: jaxformer as it is (`--tuning default`), and
with `jaxformer.backends.cpu`'s tuning (`--tuning cpu`: `tune_process()` before
JAX starts and `TransformerConfig(cpu_tuning=True)`). The JSON line is the tuned
run's, plus ratio_vs_hf_default and ratio_vs_hf_tuned and the default run's
figures prefixed "default_".
tokens/s = B * (S + T) / (seconds per step), source and target tokens both
processed. compile_s: jaxformer's lower + compile of the train step; the
torch column reports its first (warm-up) step for comparison.
compile_s_from_cache: the same once the program is in a persistent compile cache
(`jaxformer train --compile-cache DIR`, a rerun): tracing, lowering and loading.

The ceiling: a plain float32 (2048 x 2048) @ (2048 x 2048) matmul, timed with
both jax and torch after every round; the faster is the machine's peak FLOP/s
at that moment. Model FLOPs per train step are counted analytically (3 x the
forward's matmul and attention FLOPs: forward + two backward products) and the
same count is used for both implementations; fraction_of_matmul_peak = the
median over rounds of FLOPs/s / peak, each round's step against the peak
measured right after it (a ratio side by side, like the others: a slow period
slows both).

`--lm`: the decoder-only LM instead (bench widths in seed 004's layer: 4 Post-LN
layers, GELU, dropout 0.1, bytes), against seed 004's PyTorch decoder layer
(copied verbatim in seed004.py), both on one packed batch of 32 x 128 bytes of
the Python standard library's source, the same segment mask (no attention
across documents) and weighted cross-entropy. Prints lm_tokens_per_s,
seed004_tokens_per_s and lm_ratio_vs_seed_torch.

Run (about 6 minutes on 2 CPU cores; run it when the machine is quiet):
  nice -n 5 python benchmarks/train.py        # or --lm
Prints a table, then one JSON line with tokens_per_s, compile_s,
ratio_vs_seed_torch, ratio_vs_hf, fraction_of_matmul_peak and the other figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn as nn

import jaxformer as jf
from jaxformer.backends import cpu
from jaxformer.cli import compilation_cache
from jaxformer.text import ByteTokenizer
from jaxformer.train import (TextData, TrainConfig, compile_train_step, segment_mask,
                             train_functions)

import hf_peer  # Hugging Face transformers' MarianMTModel (optional)
from seed001 import Transformer as SeedTransformer  # the peer, verbatim from seed 001
from seed004 import SeedLM  # the LM peer: seed 004's decoder layer, verbatim

# ---------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------

BATCH, SRC_LEN = 32, 32


def train_flops(c: jf.TransformerConfig, batch: int, src_len: int, tgt_len: int) -> float:
    """Matmul + attention FLOPs of one training step (3 x forward), embeddings excluded."""
    D, F, V = c.d_model, c.d_ff, c.tgt_vocab_size
    S, T = batch * src_len, batch * tgt_len  # token counts
    macs = c.num_encoder_layers * (S * (4 * D * D + 2 * D * F)            # QKVO + FFN
                                   + 2 * batch * src_len * src_len * D)    # QK^T, AV
    macs += c.num_decoder_layers * (T * (4 * D * D + 2 * D * D + 2 * D * F)  # self, cross QO, FFN
                                    + S * 2 * D * D                        # cross K, V
                                    + 2 * batch * tgt_len * tgt_len * D    # self QK^T, AV
                                    + 2 * batch * tgt_len * src_len * D)   # cross QK^T, AV
    macs += T * D * V                                                      # output projection
    return 3 * 2 * macs


def matmul_peak(n: int = 2048, repeats: int = 10) -> dict:
    """FLOP/s of a plain float32 (n x n) @ (n x n), jax and torch; the median of `repeats`."""
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), jnp.float32)
    mm = jax.jit(jnp.matmul)
    mm(a, a).block_until_ready()
    jax_times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mm(a, a).block_until_ready()
        jax_times.append(time.perf_counter() - start)
    t = torch.from_numpy(np.array(a))
    torch.mm(t, t)
    torch_times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(t, t)
        torch_times.append(time.perf_counter() - start)
    flops = 2 * n ** 3
    return {"jax": flops / statistics.median(jax_times),
            "torch": flops / statistics.median(torch_times)}


class JaxSide:
    def __init__(self, config: jf.TransformerConfig, batch: int, src_len: int):
        tc = TrainConfig(task="copy", min_len=src_len, max_len=src_len, batch_size=batch,
                         steps=100_000, warmup_steps=100, learning_rate=1e-4)
        self.fns = train_functions(config, tc)
        self.batch = self.fns.batch(0, 0)
        self.state = self.fns.init(0)
        self.step, self.compile_s = self.fns.compiled_step(self.state, self.batch)
        self.first_loss = None

    def compile_from_cache(self) -> float:
        """Seconds to trace, lower and load the step from a persistent compile cache,
        JAX's in-memory caches emptied: what a rerun with `--compile-cache` pays
        instead of compile_s. (Writing the cache, done first, is not timed, nor is it
        part of compile_s.)"""
        with tempfile.TemporaryDirectory() as cache_dir, compilation_cache(cache_dir):
            jax.clear_caches()
            compile_train_step(self.fns.step, self.state, self.batch)  # writes the cache
            jax.clear_caches()
            start = time.perf_counter()
            compile_train_step(self.fns.step, self.state, self.batch)
            return time.perf_counter() - start

    def run(self, steps: int) -> float:
        """Seconds per step over `steps` steps (dispatch is async; one sync at the end)."""
        start = time.perf_counter()
        for _ in range(steps):
            self.state, metrics = self.step(self.state, self.batch)
        loss = float(metrics["loss"])
        if self.first_loss is None:
            self.first_loss = loss
        self.last_loss = loss
        return (time.perf_counter() - start) / steps


class TorchSide:
    def __init__(self, config: jf.TransformerConfig, batch_np):
        torch.manual_seed(0)
        assert config.num_encoder_layers == config.num_decoder_layers  # the seed has one N
        self.model = SeedTransformer(src_vocab=config.src_vocab_size, tgt_vocab=config.tgt_vocab_size,
                                 d_model=config.d_model, num_heads=config.num_heads,
                                 d_ff=config.d_ff, num_layers=config.num_encoder_layers,
                                 dropout=config.residual_dropout, max_len=config.max_len)
        self.model.train()
        self.criterion = nn.CrossEntropyLoss(ignore_index=0)
        self.optim = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.src = torch.from_numpy(np.asarray(batch_np.src)).long()
        self.tgt_inp = torch.from_numpy(np.asarray(batch_np.tgt_in)).long()
        self.tgt_out = torch.from_numpy(np.array(batch_np.labels)).long()
        # The seed passes pad flags (1 = PAD); this batch has none, like the seed's.
        self.src_pad = (self.src == 0).long()
        self.tgt_pad = (self.tgt_inp == 0).long()
        self.vocab = config.tgt_vocab_size
        self.first_loss = None

    def one_step(self) -> float:
        logits = self.model(self.src, self.tgt_inp, self.src_pad, self.tgt_pad)
        loss = self.criterion(logits.reshape(-1, self.vocab), self.tgt_out.reshape(-1))
        self.optim.zero_grad()
        loss.backward()
        self.optim.step()
        return loss.item()

    def run(self, steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            loss = self.one_step()
        if self.first_loss is None:
            self.first_loss = loss
        self.last_loss = loss
        return (time.perf_counter() - start) / steps


class HFSide(TorchSide):
    """Hugging Face MarianMTModel's train step (`hf_peer.MarianTrainStep`), timed alike."""

    def __init__(self, step):
        self.one_step = step
        self.first_loss = None


# --------------------------------------------------------------------------- --lm

LM_SEQ = 128  # the window of `jaxformer train --task lm`


def lm_config() -> jf.TransformerConfig:
    """Bench widths as a decoder-only LM, in seed 004's layer: Post-LN, exact GELU, LayerNorm
    eps 1e-12, dropout 0.1 on the attention weights and on the sublayer outputs; bytes."""
    return jf.bench(num_encoder_layers=0, src_vocab_size=259, tgt_vocab_size=259,
                    max_len=LM_SEQ, activation="gelu", layer_norm_epsilon=1e-12,
                    embedding_dropout=0.0, ffn_dropout=0.0)


def lm_train_flops(c: jf.TransformerConfig, batch: int, seq: int) -> float:
    """Matmul + attention FLOPs of one LM training step (3 x forward), embeddings excluded."""
    D, F, V, T = c.d_model, c.d_ff, c.tgt_vocab_size, batch * seq
    macs = c.num_decoder_layers * (T * (4 * D * D + 2 * D * F) + 2 * batch * seq * seq * D)
    return 3 * 2 * (macs + T * D * V)


class JaxLMSide(JaxSide):
    def __init__(self, config: jf.TransformerConfig, data, batch: int):
        tc = TrainConfig(task="lm", data=("(benchmark)",), seq_len=LM_SEQ, batch_size=batch,
                         steps=100_000, warmup_steps=100, learning_rate=1e-4)
        self.fns = train_functions(config, tc)
        self.batch = jax.device_put(data.train_batch(0, batch, 0))
        self.state = self.fns.init(0)
        self.step, self.compile_s = self.fns.compiled_step(self.state, self.batch)
        self.first_loss = None


class TorchLMSide(TorchSide):
    """Seed 004's decoder trained on the same packed batch: weighted cross-entropy, Adam."""

    def __init__(self, config: jf.TransformerConfig, batch_np):
        torch.manual_seed(0)
        self.model = SeedLM(config.tgt_vocab_size, config.d_model, config.num_heads,
                            config.num_decoder_layers, dropout=config.attention_dropout)
        self.model.train()
        self.optim = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.inputs = torch.from_numpy(np.array(batch_np.inputs)).long()
        self.labels = torch.from_numpy(np.array(batch_np.labels)).long()
        self.weights = torch.from_numpy(np.array(batch_np.weights))
        # The seed's mask convention (1 = visible, tril applied inside): same documents.
        self.mask = torch.from_numpy(np.asarray(segment_mask(batch_np.segments))).long()
        self.vocab = config.tgt_vocab_size
        self.first_loss = None

    def one_step(self) -> float:
        logits = self.model(self.inputs, self.mask)
        xent = nn.functional.cross_entropy(logits.reshape(-1, self.vocab),
                                           self.labels.reshape(-1), reduction="none")
        loss = (xent * self.weights.reshape(-1)).sum() / self.weights.sum()
        self.optim.zero_grad()
        loss.backward()
        self.optim.step()
        return loss.item()


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description="train-step throughput, jaxformer vs seed 001")
    parser.add_argument("--steps", type=int, default=5, help="steps per timing window")
    parser.add_argument("--rounds", type=int, default=5, help="alternating windows per side")
    parser.add_argument("--lm", action="store_true",
                        help="the decoder-only LM on packed text windows vs seed 004")
    parser.add_argument("--tuning", choices=("both", "cpu", "default"), default="both",
                        help="jaxformer as it is, CPU-tuned (jaxformer.backends.cpu), or both "
                             "side by side in two child processes")
    args = parser.parse_args(argv)
    if args.tuning == "both":
        return both_sides(argv if argv is not None else sys.argv[1:], args.lm)
    if args.tuning == "cpu":
        print(f"CPU tuning: on (tune_process: {cpu.tune_process()}, cpu_tuning=True)")
    if args.lm:
        return lm_main(args)

    config = jf.bench(cpu_tuning=args.tuning == "cpu")
    tgt_len = SRC_LEN + 1
    tokens_per_step = BATCH * (SRC_LEN + tgt_len)
    flops_per_step = train_flops(config, BATCH, SRC_LEN, tgt_len)
    print(f"bench: {jax.devices()[0].platform} x{len(jax.devices())}, torch "
          f"{torch.__version__} ({torch.get_num_threads()} threads), batch {BATCH}, "
          f"S={SRC_LEN}, T={tgt_len}, {flops_per_step / 1e9:.1f} GFLOP per train step",
          flush=True)

    jax_side = JaxSide(config, BATCH, SRC_LEN)  # compiles: compile_s
    compile_s_from_cache = jax_side.compile_from_cache()
    batch_np = jax.device_get(jax_side.batch)
    torch_side = TorchSide(config, batch_np)
    start = time.perf_counter()
    torch_side.one_step()
    torch_first = time.perf_counter() - start
    transformers = hf_peer.load()
    hf_side = None
    if transformers is not None:
        hf_side = HFSide(hf_peer.MarianTrainStep(transformers, config, batch_np))
        hf_side.run(args.steps)  # warm-up windows, untimed
    jax_side.run(args.steps)
    torch_side.run(args.steps)

    jax_times, torch_times, hf_times, peaks = [], [], [], []
    for _ in range(args.rounds):
        jax_times.append(jax_side.run(args.steps))
        torch_times.append(torch_side.run(args.steps))
        if hf_side is not None:
            hf_times.append(hf_side.run(args.steps))
        peaks.append(matmul_peak())  # this round's: the machine's speed drifts
    round_peaks = [max(p.values()) for p in peaks]
    peak = statistics.median(round_peaks)

    rows = {}
    sides = [("jaxformer", jax_times), ("seed torch", torch_times)]
    if hf_side is not None:
        sides.append(("hf marian", hf_times))
    for name, times in sides:
        step_s = statistics.median(times)
        rows[name] = {"step_s": step_s, "tokens_per_s": tokens_per_step / step_s,
                      "flops_per_s": flops_per_step / step_s,
                      # each round's step against the peak measured right after it
                      "fraction_of_matmul_peak": statistics.median(
                          flops_per_step / t / p for t, p in zip(times, round_peaks))}
    rows["jaxformer"]["compile_s"] = jax_side.compile_s
    rows["seed torch"]["compile_s"] = torch_first
    if hf_side is not None:
        rows["hf marian"]["compile_s"] = 0.0

    print("matmul peak (float32 2048^3) after each round, GFLOP/s: jax "
          + " ".join(f"{p['jax'] / 1e9:.0f}" for p in peaks) + "; torch "
          + " ".join(f"{p['torch'] / 1e9:.0f}" for p in peaks)
          + f"; median of the faster {peak / 1e9:.1f}")
    print(f"{'':<12}{'step ms':>10}{'tokens/s':>12}{'GFLOP/s':>10}{'of peak':>9}"
          f"{'compile s':>11}  windows (ms)")
    for (name, times), row in zip(sides, rows.values()):
        print(f"{name:<12}{row['step_s'] * 1e3:>10.1f}{row['tokens_per_s']:>12.0f}"
              f"{row['flops_per_s'] / 1e9:>10.1f}{row['fraction_of_matmul_peak']:>9.2f}"
              f"{row['compile_s']:>11.2f}  {' '.join(f'{t * 1e3:.0f}' for t in times)}")
    print(f"jaxformer from a compile cache (--compile-cache, a rerun): "
          f"{compile_s_from_cache:.2f} s instead of {jax_side.compile_s:.2f}")
    print(f"(torch 'compile s' is its first eager step.) losses first/last window: jaxformer "
          f"{jax_side.first_loss:.3f}/{jax_side.last_loss:.3f}, seed torch "
          f"{torch_side.first_loss:.3f}/{torch_side.last_loss:.3f}")
    jax_row, torch_row = rows["jaxformer"], rows["seed torch"]
    summary = {
        "tokens_per_s": round(jax_row["tokens_per_s"], 1),
        "compile_s": round(jax_row["compile_s"], 2),
        "compile_s_from_cache": round(compile_s_from_cache, 2),
        "ratio_vs_seed_torch": round(jax_row["tokens_per_s"] / torch_row["tokens_per_s"], 3),
        "fraction_of_matmul_peak": round(jax_row["fraction_of_matmul_peak"], 3),
        # vs Hugging Face MarianMTModel (AdamW, dropout 0.1): the median over
        # rounds of the per-round ratio (None: transformers absent).
        "ratio_vs_hf": (round(statistics.median(h / j for h, j in zip(hf_times, jax_times)), 3)
                        if hf_side is not None else None),
        "hf_tokens_per_s": (round(rows["hf marian"]["tokens_per_s"], 1)
                            if hf_side is not None else None),
        "seed_torch_tokens_per_s": round(torch_row["tokens_per_s"], 1),
        "seed_torch_fraction_of_matmul_peak": round(torch_row["fraction_of_matmul_peak"], 3),
        "matmul_peak_gflops": round(peak / 1e9, 1),
        "train_gflop_per_step": round(flops_per_step / 1e9, 2),
        "steps_per_window": args.steps, "rounds": args.rounds,
    }
    print(json.dumps(summary))
    return summary


def both_sides(argv: list[str], lm: bool) -> dict:
    """The benchmark with `--tuning default` and with `--tuning cpu`, each in a child
    process (process settings are fixed when JAX starts); one combined JSON line."""
    runs = {}
    for tuning in ("default", "cpu"):
        print(f"--- --tuning {tuning} (child process)", flush=True)
        done = subprocess.run([sys.executable, os.path.abspath(__file__), *argv,
                               "--tuning", tuning], stdout=subprocess.PIPE, text=True,
                              check=False)
        print(done.stdout, end="", flush=True)
        if done.returncode != 0:
            raise SystemExit(f"the --tuning {tuning} run failed")
        runs[tuning] = json.loads(done.stdout.strip().splitlines()[-1])
    default, tuned = runs["default"], runs["cpu"]
    key = "lm_ratio_vs_seed_torch" if lm else "ratio_vs_hf"
    summary = dict(tuned, **{f"default_{k}": v for k, v in default.items()})
    summary[f"{key}_default"], summary[f"{key}_tuned"] = default.get(key), tuned.get(key)
    print(json.dumps(summary))
    return summary


def lm_main(args) -> dict:
    """`--lm`: jaxformer's DecoderOnlyLM train step vs seed 004's, one packed text batch."""
    import sysconfig  # noqa: PLC0415

    stdlib = sysconfig.get_paths()["stdlib"]
    data = TextData([f"{stdlib}/*.py"], ByteTokenizer(), LM_SEQ)
    config = lm_config().replace(cpu_tuning=args.tuning == "cpu")
    tokens_per_step = BATCH * LM_SEQ
    flops_per_step = lm_train_flops(config, BATCH, LM_SEQ)
    print(f"bench --lm: decoder-only, 4 layers, d 256, batch {BATCH} x {LM_SEQ} bytes of the "
          f"Python standard library, {flops_per_step / 1e9:.1f} GFLOP per train step; torch "
          f"{torch.__version__} ({torch.get_num_threads()} threads)", flush=True)
    jax_side = JaxLMSide(config, data, BATCH)
    torch_side = TorchLMSide(config, jax.device_get(jax_side.batch))
    torch_side.one_step()
    jax_side.run(args.steps)  # warm-up windows, untimed
    torch_side.run(args.steps)
    jax_times, torch_times = [], []
    for _ in range(args.rounds):
        jax_times.append(jax_side.run(args.steps))
        torch_times.append(torch_side.run(args.steps))
    jax_s, torch_s = statistics.median(jax_times), statistics.median(torch_times)
    print(f"{'':<12}{'step ms':>10}{'tokens/s':>12}{'GFLOP/s':>10}  windows (ms)")
    for name, step_s, times in (("jaxformer", jax_s, jax_times),
                                ("seed 004", torch_s, torch_times)):
        print(f"{name:<12}{step_s * 1e3:>10.1f}{tokens_per_step / step_s:>12.0f}"
              f"{flops_per_step / step_s / 1e9:>10.1f}  "
              f"{' '.join(f'{t * 1e3:.0f}' for t in times)}")
    summary = {"lm_tokens_per_s": round(tokens_per_step / jax_s, 1),
               "seed004_tokens_per_s": round(tokens_per_step / torch_s, 1),
               "lm_ratio_vs_seed_torch": round(torch_s / jax_s, 3),
               "compile_s": round(jax_side.compile_s, 2),
               "steps_per_window": args.steps, "rounds": args.rounds}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()

"""What sharding costs and saves: the bench train step on 8 CPU devices, data vs fsdp vs tensor.

One process, 8 CPU devices (`jax_num_cpu_devices`), the bench model (DESIGN.md:
d_model 256, 8 heads, d_ff 1024, 4+4 layers, dropout 0.1, float32, batch 32,
source length 32, copy task) with the vocabulary padded from 100 to 104 so that
it divides over tensor=8 (the embedding and output projection are split along
the vocabulary there; MaxText pads its vocabularies the same way). Every mesh
trains the same model on the same batches:

  data=8     today's default: parameters and AdamW moments replicated
  fsdp=8     parameters and moments split along "embed" (ZeRO-3), gathered per use
  tensor=8   heads, FFN width and vocabulary split (Megatron), activations gathered

Per mesh: the bytes of parameters + optimizer state one device holds (the
largest over devices, from the arrays' addressable shards), compile seconds, and
seconds per train step (median over interleaved windows, so load from other
processes hits every mesh alike). CPU is not the target: 8 "devices" share 2
cores and a collective is a memory copy, so the step-time ratios show that the
layouts run and what their collectives cost here, not what a TPU slice gets.

Run (about 3 minutes on 2 cores; a quiet machine):
  python benchmarks/scale.py
Prints a table, then one JSON line with fsdp_bytes_ratio (goal <= 0.13),
fsdp_step_ratio, tensor_bytes_ratio and tensor_step_ratio (each over data=8).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts its backends

import jaxformer as jf  # noqa: E402
from jaxformer.parallel import make_mesh  # noqa: E402
from jaxformer.train import TrainConfig, train_functions  # noqa: E402

MESHES = ("data=8", "fsdp=8", "tensor=8")
BATCH, SRC_LEN, VOCAB = 32, 32, 104


def held_bytes(state) -> list[int]:
    """Bytes of parameters + optimizer state on each device."""
    held = {d.id: 0 for d in jax.devices()}
    for x in jax.tree_util.tree_leaves((state.params, state.opt_state)):
        for shard in x.addressable_shards:
            held[shard.device.id] += shard.data.nbytes
    return list(held.values())


class MeshRun:
    """One mesh's train state, batch and compiled step."""

    def __init__(self, spec: str):
        self.spec = spec
        mesh = make_mesh(spec)
        tc = TrainConfig(task="copy", min_len=SRC_LEN, max_len=SRC_LEN, batch_size=BATCH,
                         steps=100_000, warmup_steps=100, learning_rate=1e-4)
        fns = train_functions(jf.bench(src_vocab_size=VOCAB, tgt_vocab_size=VOCAB), tc, mesh)
        self.batch = fns.batch(0, 0)
        self.state = fns.init(0)
        self.bytes = max(held_bytes(self.state))
        self.step, self.compile_s = fns.compiled_step(self.state, self.batch)
        self.times: list[float] = []

    def run(self, steps: int) -> None:
        start = time.perf_counter()
        for _ in range(steps):
            self.state, metrics = self.step(self.state, self.batch)
        self.loss = float(metrics["loss"])  # one sync per window
        self.times.append((time.perf_counter() - start) / steps)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="steps per timed window")
    parser.add_argument("--rounds", type=int, default=5, help="windows per mesh")
    args = parser.parse_args(argv)
    if len(jax.devices()) != 8:
        raise SystemExit(f"needs 8 devices, JAX has {len(jax.devices())} "
                         f"({jax.devices()[0].platform}); run it on the CPU backend")

    runs = [MeshRun(spec) for spec in MESHES]
    for run in runs:
        run.run(1)  # warm-up window, not counted
        run.times.clear()
    for _ in range(args.rounds):
        for run in runs:
            run.run(args.steps)

    base = runs[0]
    step_s = {run.spec: statistics.median(run.times) for run in runs}
    print(f"bench train step on 8 CPU devices (vocab {VOCAB}), median of {args.rounds} "
          f"windows of {args.steps} steps")
    print(f"{'mesh':<10} {'state MiB/device':>17} {'x data=8':>9} {'compile s':>10} "
          f"{'s/step':>8} {'x data=8':>9} {'loss':>8}")
    for run in runs:
        print(f"{run.spec:<10} {run.bytes / 2**20:>17.2f} {run.bytes / base.bytes:>9.4f} "
              f"{run.compile_s:>10.1f} {step_s[run.spec]:>8.3f} "
              f"{step_s[run.spec] / step_s[base.spec]:>9.2f} {run.loss:>8.4f}")
    result = {
        "fsdp_bytes_ratio": round(runs[1].bytes / base.bytes, 4),
        "fsdp_step_ratio": round(step_s["fsdp=8"] / step_s["data=8"], 3),
        "tensor_bytes_ratio": round(runs[2].bytes / base.bytes, 4),
        "tensor_step_ratio": round(step_s["tensor=8"] / step_s["data=8"], 3),
        "data_step_s": round(step_s["data=8"], 4),
        "compile_s": {run.spec: round(run.compile_s, 1) for run in runs},
        "state_bytes_per_device": {run.spec: run.bytes for run in runs},
        "devices": 8, "vocab": VOCAB, "batch": BATCH,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

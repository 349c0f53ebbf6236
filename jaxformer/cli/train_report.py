"""What `jaxformer train` reports when training ends, on process 0: held-out metrics,
a few examples or continuations printed, loss.png / attention.png, and the one
summary line (printed and kept as summary.json)."""

from __future__ import annotations

import dataclasses
import json
import os
import time

from jaxformer.cli.generate import continue_prompts, strip_at
from jaxformer.cli.interrupts import written_whole


def finish_lm(args, model, params, mesh, result, data, train_config, out) -> dict:
    """Held-out bits per byte against the baselines, sampled continuations, the loss
    figure; the summary's LM fields.

    `params` and `mesh`: this process's copy of the trained parameters, its devices."""
    from jaxformer.cli import baselines, plots  # noqa: PLC0415
    from jaxformer.train.evaluation import evaluate_lm  # noqa: PLC0415

    step = int(result.state.step)
    final = result.evals[-1] if result.evals and result.evals[-1]["step"] == step else {
        f"eval_{k}": v for k, v in evaluate_lm(model, params, data, mesh=mesh,
                                               progress=not args.no_progress).items()}
    show_continuations(model, params, data, args.samples, args.sample_tokens)
    history = read_metrics(os.path.join(out, "metrics.jsonl"))
    plots.loss_curve([r for r in history if "loss" in r], os.path.join(out, "loss.png"),
                     title=f"language model on {len(data.eval_bytes):,} held-out bytes",
                     evals=[r for r in history if "eval_loss" in r])
    steps_run = step - result.start_step
    window_tokens = train_config.seq_len * train_config.batch_size
    return {
        "task": "lm", "bits_per_byte": final["eval_bits_per_byte"],
        "unigram_bits_per_byte": baselines.unigram_bits_per_byte(data.eval_bytes),
        "xz_bits_per_byte": baselines.xz_bits_per_byte(data.eval_bytes),
        "eval_loss": final["eval_loss"], "perplexity": final["eval_perplexity"],
        "eval_bytes": len(data.eval_bytes), "train_bytes": data.train_bytes_count,
        "tokens_per_s": (round(steps_run * window_tokens / result.train_s, 1)
                         if steps_run else None)}


def finish_seq2seq(args, model, params, mesh, task, train_config, model_config,
                   out) -> dict:
    """Greedy decoding of the held-out set, a few examples printed, the figures; the
    summary's task fields."""
    from jaxformer.train.evaluation import evaluate  # noqa: PLC0415

    heldout = task.heldout_set(args.eval_examples)
    metrics = evaluate(model, params, heldout, mesh=mesh)
    show_examples(model, params, heldout, args.show)
    history = read_metrics(os.path.join(out, "metrics.jsonl"))
    write_figures(model, params, heldout, history, out, train_config, model_config)
    return {"task": train_config.task, "norm": model_config.norm,
            "dtype": model_config.dtype, "exact_match": metrics["exact_match"],
            "token_accuracy": metrics["token_accuracy"], "eval_loss": metrics["loss"],
            "eval_examples": metrics["examples"]}


def write_summary(out: str, summary: dict, result, params, started: float) -> None:
    """The run's final JSON line, `summary` and what every run reports: printed, and
    kept as `out`/summary.json."""
    import jax  # noqa: PLC0415

    from jaxformer.nn.model import count_params  # noqa: PLC0415
    from jaxformer.parallel.partitioning import mesh_spec_string  # noqa: PLC0415

    summary = {**summary, "steps": int(result.state.step),
               "wall_s": round(time.perf_counter() - started, 2),
               "compile_s": round(result.compile_s, 2), "params": count_params(params),
               "devices": len(jax.devices()), "mesh": mesh_spec_string(result.mesh),
               "processes": jax.process_count(), "resumed_from": result.start_step or None,
               "out": out}
    line = json.dumps(summary)
    with written_whole(os.path.join(out, "summary.json")) as path, open(path, "w") as f:
        f.write(line + "\n")
    print(line, flush=True)


def show_examples(model, params, heldout, count: int) -> None:
    """Print `count` held-out sources, targets and greedy predictions side by side."""
    if count == 0:
        return
    from jaxformer.decode.api import greedy_decode  # noqa: PLC0415

    c = model.config
    rows = min(count, heldout.src.shape[0])
    tokens = greedy_decode(model, params, heldout.src[:rows],
                           max_new_tokens=heldout.labels.shape[1]).tokens
    width = 3 * heldout.src.shape[1]
    print(f"{'source':<{width}}  {'prediction':<{width}}  ok")
    for i in range(rows):
        src = " ".join(map(str, strip_at(heldout.src[i], {c.pad_id})))
        pred = " ".join(map(str, strip_at(tokens[i], {c.eos_id, c.pad_id})))
        ok = bool((tokens[i] == heldout.labels[i]).all())
        print(f"{src:<{width}}  {pred:<{width}}  {'yes' if ok else 'NO'}")


def show_continuations(model, params, data, count: int, max_new_tokens: int) -> None:
    """Print `count` held-out prompts, each followed by a sampled continuation."""
    if count == 0:
        return
    prompts = data.eval_prompts(count, min(64, model.config.max_len // 2))
    room = model.config.max_len - max(map(len, prompts)) + 1  # --sample-tokens' cap
    texts = [data.tokenizer.decode(ids) for ids in
             continue_prompts(model, params, prompts, min(max_new_tokens, room))]
    for i, (prompt, text) in enumerate(zip(prompts, texts)):
        print(f"--- held-out prompt {i + 1} (sampled continuation after >>>)")
        print(f"{data.tokenizer.decode(prompt)}>>>{text}")


def read_metrics(path: str) -> list[dict]:
    """Per-step records, a later record of a step updating an earlier one (after resume)."""
    by_step = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                record = json.loads(line)  # a train or a held-out record: merge them
                by_step.setdefault(record["step"], {}).update(record)
    return [by_step[s] for s in sorted(by_step)]


def cross_attention_maps(model, params, src_BS, tgt_in_BT) -> dict:
    """{"decoder/layers_i/cross_attn": (B, T, S) head-averaged weights}, teacher forced."""
    from jaxformer.nn.model import Transformer, attention_weights  # noqa: PLC0415

    # The fused "jax" attention does not expose its weights; same parameters.
    probe = Transformer(dataclasses.replace(model.config, attention_impl="einsum"))
    _, state = probe.apply({"params": params}, src_BS, tgt_in_BT, mutable="intermediates")
    return {name: weights.astype("float32").mean(axis=1)
            for name, weights in attention_weights(state["intermediates"]).items()
            if name.endswith("cross_attn")}


def write_figures(model, params, heldout, history, out, train_config, model_config) -> None:
    import numpy as np  # noqa: PLC0415

    from jaxformer.cli import plots  # noqa: PLC0415

    plots.loss_curve(history, os.path.join(out, "loss.png"),
                     title=f"{train_config.task}, {model_config.norm}-LN: training loss")
    lengths = (heldout.src != model_config.pad_id).sum(axis=1)
    i = int(np.argmax(lengths))  # the longest example shows the clearest pattern
    n = int(lengths[i])
    maps = cross_attention_maps(model, params, heldout.src[i:i + 1], heldout.tgt_in[i:i + 1])
    plots.attention_maps({k: np.asarray(v[0, :n + 1, :n]) for k, v in maps.items()},
                         heldout.src[i, :n].tolist(), heldout.tgt_in[i, :n + 1].tolist(),
                         os.path.join(out, "attention.png"),
                         title=f"{train_config.task}: decoder cross-attention (head mean)")


"""The `jaxformer` command (also `python -m jaxformer`).

    jaxformer train                       # copy task, copy_task model, Post-LN
    jaxformer train --norm pre --out runs/pre
    jaxformer train --task reverse --steps 1500
    jaxformer train --out runs/x --resume # continue an interrupted run

A run directory (`--out`, default runs/<task>-<norm>-<time>) holds:

    config.json     model and training configuration (what --resume reads)
    metrics.jsonl   one JSON record per step (a later record of a step supersedes)
    checkpoints/    Orbax checkpoints: every --save-every steps, at the end, on Ctrl-C
    loss.png        loss and token accuracy against step
    attention.png   decoder cross-attention of the trained model on a held-out example
    summary.json    the final JSON line

At the end the trained model greedy-decodes the held-out set (sequences the
training stream never contains, see `jaxformer.tasks`), prints a few sources
and predictions side by side, then one JSON line with exact_match,
token_accuracy, steps and wall_s.

Exit status: 0 done, 1 non-finite loss, 2 bad input or checkpoint,
130 interrupted by Ctrl-C (after saving a checkpoint).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
from typing import Optional, Sequence

# Flags that shape the model / the trajectory: on --resume they must agree with
# the run's config.json. flag -> TransformerConfig field(s) / TrainConfig field.
_MODEL_FLAGS = {"d_model": ("d_model",), "heads": ("num_heads",), "d_ff": ("d_ff",),
                "layers": ("num_encoder_layers", "num_decoder_layers"), "norm": ("norm",),
                "dtype": ("dtype",), "vocab": ("src_vocab_size", "tgt_vocab_size"),
                "dropout": ("attention_dropout", "residual_dropout", "embedding_dropout",
                            "ffn_dropout")}
_TRAIN_FLAGS = {"task": "task", "min_len": "min_len", "max_len": "max_len", "steps": "steps",
                "batch": "batch_size", "lr": "learning_rate", "warmup": "warmup_steps",
                "weight_decay": "weight_decay", "label_smoothing": "label_smoothing",
                "seed": "seed"}


class UsageError(ValueError):
    """Bad flags or run directory: reported as `jaxformer train: error: ...`, exit 2."""


def build_parser() -> argparse.ArgumentParser:
    from jaxformer.config import PRESETS  # noqa: PLC0415 (keep --help fast)
    from jaxformer.tasks import TASKS  # noqa: PLC0415

    parser = argparse.ArgumentParser(
        prog="jaxformer", description="The Transformer in JAX/Flax: train on synthetic tasks.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    train = commands.add_parser(
        "train", help="train an encoder-decoder Transformer on a synthetic task",
        description="Train on copy/reverse/sort, then greedy-decode held-out sequences. "
                    "Defaults: copy task, vocab 32, lengths 1..10, the copy_task model "
                    "(d_model 128, 4 heads, d_ff 256, 2+2 layers, Post-LN), 800 steps of "
                    "batch 64, AdamW lr 1e-3 with 100 warmup steps.")
    model = train.add_argument_group("model")
    model.add_argument("--preset", choices=sorted(PRESETS), default=None,
                       help="model preset to start from (default copy_task)")
    model.add_argument("--d-model", type=int, help="model width D")
    model.add_argument("--heads", type=int, help="attention heads H")
    model.add_argument("--d-ff", type=int, help="feed-forward width F")
    model.add_argument("--layers", type=int, help="encoder and decoder layers (each)")
    model.add_argument("--norm", choices=("post", "pre"),
                       help="LayerNorm placement (default post; Post-LN needs --warmup)")
    model.add_argument("--dtype", choices=("float32", "bfloat16"),
                       help="compute dtype; parameters stay float32 (default float32)")
    model.add_argument("--dropout", type=float, help="one rate for every dropout site")
    model.add_argument("--vocab", type=int, help="vocabulary incl. PAD/BOS/EOS (default 32)")
    data = train.add_argument_group("task and optimisation")
    data.add_argument("--task", choices=TASKS, help="synthetic task (default copy)")
    data.add_argument("--min-len", type=int, help="shortest source (default 1)")
    data.add_argument("--max-len", type=int, help="longest source (default 10)")
    data.add_argument("--steps", type=int, help="optimizer steps (default 800)")
    data.add_argument("--batch", type=int,
                      help="global batch, split over all devices (default 64)")
    data.add_argument("--lr", type=float, help="peak learning rate (default 1e-3)")
    data.add_argument("--warmup", type=int,
                      help="linear warmup steps (default min(100, steps // 8))")
    data.add_argument("--weight-decay", type=float, help="AdamW decay on matrices (0.01)")
    data.add_argument("--label-smoothing", type=float, help="(default 0)")
    data.add_argument("--seed", type=int, help="the one seed of the run (default 0)")
    run = train.add_argument_group("run")
    run.add_argument("--out", help="run directory (default runs/<task>-<norm>-<time>)")
    run.add_argument("--resume", action="store_true",
                     help="continue the run in --out from its latest checkpoint")
    run.add_argument("--save-every", type=int, default=200, help="checkpoint interval")
    run.add_argument("--log-every", type=int, default=20,
                     help="steps between progress/metrics updates")
    run.add_argument("--eval-examples", type=int, default=1000,
                     help="held-out sequences decoded at the end")
    run.add_argument("--show", type=int, default=5, help="held-out examples printed")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.set_defaults(func=_train_command)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of `jaxformer` and `python -m jaxformer`; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except UsageError as error:
        print(f"jaxformer {args.command}: error: {error}", file=sys.stderr)
        return 2


# --------------------------------------------------------------------------- train


def _configs_from_args(args):
    """(model config, train config, preset) from the flags given explicitly."""
    from jaxformer.config import PRESETS  # noqa: PLC0415
    from jaxformer.training import TrainConfig  # noqa: PLC0415

    model_overrides = {}
    for flag, fields in _MODEL_FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            model_overrides.update({field: value for field in fields})
    train_overrides = {field: getattr(args, flag) for flag, field in _TRAIN_FLAGS.items()
                       if getattr(args, flag) is not None}
    if "steps" in train_overrides and "warmup_steps" not in train_overrides:
        # Short runs keep a proportionate warmup instead of failing validation.
        train_overrides["warmup_steps"] = min(TrainConfig.warmup_steps,
                                              train_overrides["steps"] // 8)
    preset = args.preset or "copy_task"
    return PRESETS[preset], model_overrides, TrainConfig, train_overrides, preset


def _train_command(args) -> int:
    started = time.perf_counter()
    import jax  # noqa: PLC0415 (heavy imports after argument parsing)

    from jaxformer.checkpoint import CheckpointError  # noqa: PLC0415
    from jaxformer.config import TransformerConfig  # noqa: PLC0415
    from jaxformer.model import Transformer, count_params  # noqa: PLC0415
    from jaxformer.training import (NonFiniteLossError, TrainConfig, evaluate,  # noqa: PLC0415
                                    fit, task_for)

    for name in ("save_every", "log_every", "eval_examples"):
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got "
                             f"{getattr(args, name)}")
    if args.show < 0:
        raise UsageError(f"--show must be >= 0, got {args.show}")
    build_model, model_overrides, _, train_overrides, preset = _configs_from_args(args)

    if args.resume:
        if args.out is None:
            raise UsageError("--resume needs --out, the run directory to continue")
        out = args.out
        config_path = os.path.join(out, "config.json")
        if not os.path.isfile(config_path):
            raise UsageError(f"cannot resume: {config_path} does not exist (not a run "
                             f"directory)")
        try:
            with open(config_path) as f:
                saved = json.load(f)
            model_config = TransformerConfig.from_dict(saved["model"])
            train_config = TrainConfig.from_dict(saved["train"])
        except (ValueError, KeyError, TypeError) as error:
            raise UsageError(f"cannot resume: {config_path} is not a valid run config: "
                             f"{error}") from error
        conflicts = _conflicts(args, model_config, train_config, model_overrides,
                               train_overrides, saved.get("preset"))
        if conflicts:
            raise UsageError("--resume continues the saved run; these flags differ from "
                             f"{config_path}: {', '.join(conflicts)}")
        checkpoint_dir = os.path.join(out, "checkpoints")
        if not os.path.isdir(checkpoint_dir) or not _has_checkpoint(checkpoint_dir):
            raise UsageError(f"cannot resume: no checkpoint in {out}/checkpoints")
    else:
        try:
            model_config = build_model(**model_overrides)
            train_config = TrainConfig(**train_overrides)
        except (ValueError, TypeError) as error:
            raise UsageError(str(error)) from error
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        out = args.out or os.path.join("runs", f"{train_config.task}-{model_config.norm}-{stamp}")
        if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
            raise UsageError(f"run directory {out} already exists and is not empty: pass "
                             f"--resume to continue it, or choose another --out")

    try:  # everything checkable before compiling: task vs model, batch vs devices
        task = task_for(model_config, train_config)
        from jaxformer.sharding import check_divisible, make_mesh  # noqa: PLC0415

        mesh = make_mesh()
        check_divisible(train_config.batch_size, mesh, name="--batch")
    except ValueError as error:
        raise UsageError(str(error)) from error

    if not args.resume:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump({"preset": preset, "model": model_config.to_dict(),
                       "train": train_config.to_dict()}, f, indent=2)

    model = Transformer(model_config)
    print(f"jaxformer train: {train_config.task} task, {preset} model "
          f"({model_config.norm}-LN, {model_config.dtype}), "
          f"{len(jax.devices())} {jax.devices()[0].platform} device(s), run dir {out}",
          flush=True)
    try:
        result = fit(model_config, train_config, checkpoint_dir=os.path.join(out, "checkpoints"),
                     resume=args.resume, save_every=args.save_every, log_every=args.log_every,
                     progress=not args.no_progress,
                     metrics_file=os.path.join(out, "metrics.jsonl"), mesh=mesh)
    except CheckpointError as error:
        print(f"jaxformer train: error: {error}", file=sys.stderr)
        return 2
    except NonFiniteLossError as error:
        print(f"jaxformer train: {error}", file=sys.stderr)
        return 1
    step = int(result.state.step)
    if result.interrupted:
        print(f"jaxformer train: interrupted at step {step}; checkpoint saved in "
              f"{out}/checkpoints. Continue with: jaxformer train --out {out} --resume",
              file=sys.stderr)
        return 130

    params = result.state.params
    heldout = task.heldout_set(args.eval_examples)
    metrics = evaluate(model, params, heldout, mesh=mesh)
    _show_examples(model, params, heldout, args.show)
    history = _read_metrics(os.path.join(out, "metrics.jsonl"))
    _write_figures(model, params, heldout, history, out, train_config, model_config)
    summary = {"task": train_config.task, "norm": model_config.norm,
               "dtype": model_config.dtype, "exact_match": metrics["exact_match"],
               "token_accuracy": metrics["token_accuracy"], "eval_loss": metrics["loss"],
               "eval_examples": metrics["examples"], "steps": step,
               "wall_s": round(time.perf_counter() - started, 2),
               "compile_s": round(result.compile_s, 2), "params": count_params(params),
               "devices": len(jax.devices()), "resumed_from": result.start_step or None,
               "out": out}
    line = json.dumps(summary)
    with open(os.path.join(out, "summary.json"), "w") as f:
        f.write(line + "\n")
    print(line, flush=True)
    return 0


def _has_checkpoint(directory: str) -> bool:
    from jaxformer.checkpoint import Checkpoints  # noqa: PLC0415

    with Checkpoints(directory, create=False) as checkpoints:
        return bool(checkpoints.steps())


def _conflicts(args, model_config, train_config, model_overrides, train_overrides,
               saved_preset) -> list[str]:
    conflicts = []
    if args.preset is not None and args.preset != saved_preset:
        conflicts.append(f"--preset {args.preset} (saved: {saved_preset})")
    for flag, fields in _MODEL_FLAGS.items():
        value = getattr(args, flag)
        if value is not None and any(getattr(model_config, f) != value for f in fields):
            conflicts.append(f"--{flag.replace('_', '-')} {value} (saved: "
                             f"{getattr(model_config, fields[0])})")
    for flag, field in _TRAIN_FLAGS.items():
        value = getattr(args, flag)
        if value is not None and getattr(train_config, field) != value:
            conflicts.append(f"--{flag.replace('_', '-')} {value} (saved: "
                             f"{getattr(train_config, field)})")
    return conflicts


def _strip(tokens, stop: set) -> list[int]:
    """Token ids up to (not including) the first of `stop`."""
    kept = []
    for token in tokens:
        if int(token) in stop:
            break
        kept.append(int(token))
    return kept


def _show_examples(model, params, heldout, count: int) -> None:
    """Print `count` held-out sources, targets and greedy predictions side by side."""
    if count == 0:
        return
    from jaxformer.decoding import greedy_decode  # noqa: PLC0415

    c = model.config
    rows = min(count, heldout.src.shape[0])
    tokens = greedy_decode(model, params, heldout.src[:rows],
                           max_new_tokens=heldout.labels.shape[1]).tokens
    width = 3 * heldout.src.shape[1]
    print(f"{'source':<{width}}  {'prediction':<{width}}  ok")
    for i in range(rows):
        src = " ".join(map(str, _strip(heldout.src[i], {c.pad_id})))
        pred = " ".join(map(str, _strip(tokens[i], {c.eos_id, c.pad_id})))
        ok = bool((tokens[i] == heldout.labels[i]).all())
        print(f"{src:<{width}}  {pred:<{width}}  {'yes' if ok else 'NO'}")


def _read_metrics(path: str) -> list[dict]:
    """Per-step records, a later record of a step replacing an earlier one (after resume)."""
    by_step = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]


def cross_attention_maps(model, params, src_BS, tgt_in_BT) -> dict:
    """{"decoder/layers_i/cross_attn": (B, T, S) head-averaged weights}, teacher forced."""
    from jaxformer.model import Transformer, attention_weights  # noqa: PLC0415

    # The fused "jax" attention does not expose its weights; same parameters.
    probe = Transformer(dataclasses.replace(model.config, attention_impl="einsum"))
    _, state = probe.apply({"params": params}, src_BS, tgt_in_BT, mutable="intermediates")
    return {name: weights.astype("float32").mean(axis=1)
            for name, weights in attention_weights(state["intermediates"]).items()
            if name.endswith("cross_attn")}


def _write_figures(model, params, heldout, history, out, train_config, model_config) -> None:
    import numpy as np  # noqa: PLC0415

    from jaxformer import plots  # noqa: PLC0415

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


if __name__ == "__main__":
    sys.exit(main())

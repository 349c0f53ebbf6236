"""The `jaxformer` command (also `python -m jaxformer`).

    jaxformer train                       # copy task, copy_task model, Post-LN
    jaxformer train --norm pre --out runs/pre
    jaxformer train --task reverse --steps 1500
    jaxformer train --out runs/x --resume # continue an interrupted run
    jaxformer train --task lm --data 'texts/*.txt'   # a byte-level LM on text files
    jaxformer train --mesh data=2,fsdp=2,tensor=2    # shard over 8 devices (default: data)
    jaxformer train --task lm --init SmolLM2.gguf --data 'texts/*.txt' [--lora 8]  # fine-tune
    jaxformer generate --run runs/lm "def main("     # continue a prompt with a trained LM
    jaxformer decode --run runs/copy "5 6 7"         # decode a source with a trained model
    jaxformer generate --model SmolLM2.gguf "The capital of France is"   # a pretrained LM
    jaxformer eval --model SmolLM2.gguf --data 'texts/*.txt'   # loss, perplexity, bits/byte
    jaxformer transcribe --model DIR talk.wav        # speech to text (jaxformer.cli.transcribe)
    jaxformer export --run runs/lm --out my-lm-hf    # a Hugging Face directory (cli.export)
    jaxformer serve --model SmolLM2.gguf             # OpenAI-compatible HTTP API (cli.serve)

A run directory (`--out`, default runs/<task>-<norm>-<time>) holds:

    config.json     model and training configuration (what --resume reads)
    metrics.jsonl   one JSON record per step (a later record of a step supersedes)
    checkpoints/    Orbax checkpoints: every --save-every steps, at the end, on Ctrl-C
    loss.png        loss and token accuracy against step
    attention.png   decoder cross-attention of the trained model on a held-out example
    summary.json    the final JSON line
    tokenizer.json  (--init) the pretrained model's tokenizer, so the run stands alone
    chat_template.jinja  (--init) its chat template, if it has one (generate --chat)
    train.lock      while `train` runs: its pid and host (`jaxformer.train.run_lock`); a
                    second `train` on the directory is refused naming them, the lock of
                    a process that died is taken over; readers take no lock

With --task lm the model is `DecoderOnlyLM` on packed windows of the text
(`jaxformer.train.data`), loss.png also shows the held-out loss, there is no
attention.png, and the summary reports held-out bits per byte beside the
unigram and xz baselines of the same bytes, and a few sampled continuations of
held-out prompts are printed.

At the end the trained model greedy-decodes the held-out set (sequences the
training stream never contains, see `jaxformer.train.tasks`), prints a few sources
and predictions side by side, then one JSON line with exact_match,
token_accuracy, steps and wall_s.

Several hosts: start the same command on each, adding `--coordinator
HOST:PORT --num-processes N --process-id I` (HOST:PORT on process 0, which
writes the run directory; `jaxformer.parallel.distributed`); the mesh spans every
host's devices. `--cpu-devices N` splits a CPU into N devices (for trying
meshes on one machine).

Exit status: 0 done, 1 non-finite loss, 2 bad input or checkpoint,
130 interrupted by Ctrl-C (after saving a checkpoint).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import sys
import time
import traceback
from typing import Optional, Sequence

from jaxformer.cli import args as args_lib
from jaxformer.cli import evaluate as evaluate_command
from jaxformer.cli import export as export_command
from jaxformer.cli import serve as serve_command
from jaxformer.cli import transcribe as transcribe_command
from jaxformer.cli.args import non_negative_int, positive_int
from jaxformer.cli.chat import chat_prompts, read_template
from jaxformer.cli.export import source_chat_template
from jaxformer.cli.runs import (add_quantize_flag, has_checkpoint, language_model, load_run,
                               read_run_config)
from jaxformer.cli.streaming import TextStream
from jaxformer.cli.usage import UsageError

# Flags that shape the model / the trajectory: on --resume they must agree with
# the run's config.json. flag -> TransformerConfig field(s) / TrainConfig field.
_MODEL_FLAGS = {"d_model": ("d_model",), "heads": ("num_heads",), "d_ff": ("d_ff",),
                "layers": ("num_encoder_layers", "num_decoder_layers"), "norm": ("norm",),
                "dtype": ("dtype",), "vocab": ("src_vocab_size", "tgt_vocab_size"),
                "dropout": ("attention_dropout", "residual_dropout", "embedding_dropout",
                            "ffn_dropout"),
                "scan_layers": ("scan_layers",), "remat": ("remat",),
                "precision": ("precision",), "attention_impl": ("attention_impl",),
                "lora": ("lora_rank",), "lora_alpha": ("lora_alpha",),
                "lora_targets": ("lora_targets",)}
# What --init takes from the checkpoint: these flags would contradict it.
_SHAPE_FLAGS = ("preset", "d_model", "heads", "d_ff", "layers", "norm", "vocab")
_TRAIN_FLAGS = {"task": "task", "min_len": "min_len", "max_len": "max_len", "steps": "steps",
                "batch": "batch_size", "lr": "learning_rate", "warmup": "warmup_steps",
                "weight_decay": "weight_decay", "label_smoothing": "label_smoothing",
                "seed": "seed", "seq_len": "seq_len", "data": "data", "eval_data": "eval_data",
                "tokenizer": "tokenizer"}


def _flag_value(args, flag):
    """A flag's value as the configs hold it (repeatable flags: tuples)."""
    value = getattr(args, flag)
    return tuple(value) if isinstance(value, list) else value


def _model_fields(flag: str, task: Optional[str]) -> tuple:
    """The model fields a flag sets; the LM has no encoder, so --layers is its decoder's."""
    from jaxformer.train.task import trains_language_model  # noqa: PLC0415

    fields = _MODEL_FLAGS[flag]
    decoder_only = task is not None and trains_language_model(task)
    return ("num_decoder_layers",) if decoder_only and flag == "layers" else fields


DEFAULT_NEW_TOKENS = 200  # generate/decode --max-new-tokens when not given

_PROCESS_FLAGS = {"coordinator": "--coordinator", "num_processes": "--num-processes",
                  "process_id": "--process-id"}


def build_parser() -> argparse.ArgumentParser:
    from jaxformer.config import PRESETS  # noqa: PLC0415 (keep --help fast)
    from jaxformer.train.task import TASK_TYPES  # noqa: PLC0415
    from jaxformer.train.train_config import TrainConfig  # noqa: PLC0415

    parser = args_lib.Parser(
        prog="jaxformer", description="The Transformer in JAX/Flax: train on synthetic tasks "
                                      "or text, then decode with the trained model.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    train = commands.add_parser(
        "train", help="train a Transformer on a synthetic task, or the decoder-only LM on text",
        description="Train on copy/reverse/sort, then greedy-decode held-out sequences. "
                    "Defaults: copy task, vocab 32, lengths 1..10, the copy_task model "
                    "(d_model 128, 4 heads, d_ff 256, 2+2 layers, Post-LN), 800 steps of "
                    "batch 64, AdamW lr 1e-3 with 100 warmup steps.")
    model = train.add_argument_group("model")
    model.add_argument("--preset", choices=sorted(PRESETS), default=None,
                       help="model preset to start from (default copy_task)")
    model.add_argument("--d-model", type=positive_int, help="model width D")
    model.add_argument("--heads", type=positive_int, help="attention heads H")
    model.add_argument("--d-ff", type=positive_int, help="feed-forward width F")
    model.add_argument("--layers", type=positive_int, help="encoder and decoder layers (each)")
    model.add_argument("--norm", choices=("post", "pre"),
                       help="LayerNorm placement (default post; Post-LN needs --warmup)")
    model.add_argument("--dtype", choices=("float32", "bfloat16"),
                       help="compute dtype; parameters stay float32 (default float32)")
    model.add_argument("--dropout", type=args_lib.fraction, help="one rate for every dropout site")
    model.add_argument("--scan-layers", action="store_true", default=None,
                       help="run each stack as one scanned layer (compile time flat in depth)")
    model.add_argument("--remat", choices=("none", "full", "save_proj", "save_dots"),
                       help="rematerialise each layer on the backward pass (default none)")
    model.add_argument("--precision", choices=("default", "mixed"),
                       help="mixed: bfloat16 matmuls, float32 params, norms, logits and loss "
                            "(leave --dtype at float32)")
    model.add_argument("--attention-impl", choices=("einsum", "jax", "blockwise", "auto"),
                       help="blockwise: memory linear in --seq-len (long documents); auto: "
                            "picked by backend and length (default einsum)")
    model.add_argument("--vocab", type=positive_int, help="vocabulary incl. PAD/BOS/EOS (default 32)")
    data = train.add_argument_group("task and optimisation")
    data.add_argument("--task", choices=tuple(TASK_TYPES),
                      help="synthetic task, or lm: the decoder-only LM on --data (default copy)")
    data.add_argument("--min-len", type=positive_int, help="shortest source (default 1)")
    data.add_argument("--max-len", type=positive_int, help="longest source (default 10)")
    data.add_argument("--steps", type=positive_int, help="optimizer steps (default 800)")
    data.add_argument("--batch", type=positive_int,
                      help="global batch, split over all devices (default 64)")
    data.add_argument("--lr", type=args_lib.positive_float, help="peak learning rate (default 1e-3)")
    data.add_argument("--warmup", type=non_negative_int,
                      help="linear warmup steps (default min(100, steps // 8))")
    data.add_argument("--weight-decay", type=args_lib.fraction, help="AdamW decay on matrices (0.01)")
    data.add_argument("--label-smoothing", type=args_lib.fraction, help="(default 0)")
    data.add_argument("--seed", type=args_lib.seed, help="the one seed of the run (default 0)")
    text = train.add_argument_group("text (--task lm)")
    text.add_argument("--data", action="append", metavar="PATH",
                      help="text file or glob, one document per file (repeatable)")
    text.add_argument("--eval-data", action="append", metavar="PATH",
                      help="held-out files (default: a held-out 5%% of the --data documents)")
    text.add_argument("--tokenizer", metavar="FILE",
                      help="a Hugging Face tokenizers JSON file (default: bytes)")
    text.add_argument("--seq-len", type=args_lib.at_least(2),
                      help=f"training window in tokens (default {TrainConfig.seq_len})")
    text.add_argument("--eval-every", type=non_negative_int, default=0,
                      help="held-out evaluation interval in steps (default: at the end)")
    text.add_argument("--samples", type=non_negative_int, default=3,
                      help="held-out prompts continued by sampling at the end")
    text.add_argument("--sample-tokens", type=positive_int, default=160,
                      help="tokens sampled per continuation (at most what the model's "
                           "context leaves after the prompt)")
    tune = train.add_argument_group("fine-tuning (--task lm)")
    tune.add_argument("--init", metavar="PATH",
                      help="start from a pretrained LM (a GGUF file or a Hugging Face "
                           "directory): its architecture, weights and tokenizer")
    tune.add_argument("--lora", type=positive_int, metavar="RANK",
                      help="train only low-rank adapters of this rank (needs --init)")
    tune.add_argument("--lora-alpha", type=args_lib.positive_float, metavar="A",
                      help="adapter scale alpha / rank (default alpha = rank)")
    tune.add_argument("--lora-targets", metavar="q,k,v,o,...",
                      type=lambda s: tuple(t.strip() for t in s.split(",") if t.strip()),
                      help="projections with adapters: q k v o gate up down (default q,v)")
    add_quantize_flag(tune, "--init's weights, frozen under --lora adapters (QLoRA): ")
    run = train.add_argument_group("run")
    run.add_argument("--out", help="run directory (default runs/<task>-<norm>-<time>)")
    run.add_argument("--resume", action="store_true",
                     help="continue the run in --out from its latest checkpoint")
    run.add_argument("--fallback", action="store_true",
                     help="with --resume: if the latest checkpoint is damaged, continue from "
                          "the newest step that restores (the damaged steps are kept, "
                          "renamed <step>.damaged)")
    run.add_argument("--save-every", type=positive_int, default=200, help="checkpoint interval")
    run.add_argument("--log-every", type=positive_int, default=20,
                     help="steps between progress/metrics updates")
    run.add_argument("--eval-examples", type=positive_int, default=1000,
                     help="held-out sequences decoded at the end")
    run.add_argument("--show", type=non_negative_int, default=5, help="held-out examples printed")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument("--no-cpu-tuning", action="store_true",
                     help="on a CPU, train without jaxformer.backends.cpu's tuning (same "
                          "results, slower)")
    _add_compile_cache_flag(run)
    scale = train.add_argument_group("devices and processes")
    scale.add_argument("--mesh", metavar="SPEC",
                       help="device mesh, e.g. data=2,fsdp=2,tensor=2 (one size may be -1: "
                            "the rest; default: every device on data, or on --resume the "
                            "saved run's mesh if it fits)")
    scale.add_argument("--cpu-devices", type=positive_int, metavar="N",
                       help="split the CPU into N devices (per process)")
    scale.add_argument("--coordinator", metavar="HOST:PORT",
                       help="process 0's address, the same on every process (or 'auto': "
                            "Slurm / Open MPI / Cloud TPU detection)")
    scale.add_argument("--num-processes", type=positive_int, metavar="N", help="processes in the run")
    scale.add_argument("--process-id", type=non_negative_int, metavar="I", help="this process, 0..N-1")
    scale.add_argument("--coordinator-timeout", type=args_lib.positive_float, default=300.0, metavar="S",
                       help="seconds to wait for the coordinator and the other processes")
    train.set_defaults(func=_train_command)

    generate = commands.add_parser(
        "generate", help="continue prompts with a pretrained LM or a `--task lm` run",
        description="Continue each prompt with a pretrained language model (--model: a "
                    "GGUF file or a Hugging Face directory; greedy by default) or the latest "
                    "checkpoint of a --task lm run (--run; sampled at 0.8 by default).")
    generate.add_argument("prompts", nargs="+", metavar="PROMPT")
    source = generate.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", help="the run directory (--out of train)")
    source.add_argument("--model", metavar="PATH",
                        help="a GGUF file or a Hugging Face checkpoint directory")
    generate.add_argument("--json", action="store_true",
                          help="one JSON line per prompt: prompt, ids (the new tokens), text, "
                               "seconds")
    generate.add_argument("--chat", action="store_true",
                          help="each prompt is a user message, formatted by the model's chat "
                               "template (--model)")
    generate.add_argument("--system", metavar="TEXT",
                          help="with --chat: a system message before each prompt")
    _add_sampling_flags(generate, temperature=None)
    generate.add_argument("--prefill-chunk", type=positive_int, metavar="N",
                          help="fill the KV cache N prompt tokens at a time (bounded memory "
                               "for long prompts; default: the whole prompt in one pass)")
    add_quantize_flag(generate)
    _add_compile_cache_flag(generate)
    generate.set_defaults(func=_generate_command)

    decode = commands.add_parser(
        "decode", help="decode sources with the model of a copy/reverse/sort run",
        description="Load the latest checkpoint of an encoder-decoder run and decode "
                    "sources given as space-separated token ids (default: held-out examples).")
    decode.add_argument("sources", nargs="*", metavar="IDS", help='e.g. "5 6 7"')
    decode.add_argument("--run", required=True, help="the run directory (--out of train)")
    decode.add_argument("--examples", type=positive_int, default=5,
                        help="held-out examples decoded when no source is given")
    _add_sampling_flags(decode, temperature=0.0)
    _add_compile_cache_flag(decode)
    decode.set_defaults(func=_decode_command)
    evaluate_command.add_parser(commands, _add_compile_cache_flag)
    transcribe_command.add_parser(commands, _add_compile_cache_flag)
    export_command.add_parser(commands, _add_compile_cache_flag)
    serve_command.add_parser(commands, _add_compile_cache_flag)
    return parser


def _add_sampling_flags(parser, *, temperature: Optional[float]) -> None:
    parser.add_argument("--max-new-tokens", type=positive_int, metavar="N",
                        help=f"tokens to generate per input (default {DEFAULT_NEW_TOKENS}, "
                             "fewer where the model's context has no room for them; a value "
                             "given beyond the context is refused)")
    parser.add_argument("--temperature", type=args_lib.non_negative_float, default=temperature,
                        help="0 = greedy (default " + (
                            f"{temperature})" if temperature is not None else
                            "0 with --model, 0.8 with --run)"))
    parser.add_argument("--top-k", type=positive_int, help="sample among the k likeliest tokens")
    parser.add_argument("--top-p", type=args_lib.probability,
                        help="sample in the nucleus of probability mass p, 0 < p <= 1")
    parser.add_argument("--seed", type=args_lib.seed, default=0,
                        help="sampling seed, 0 <= seed < 2**32")


def _add_compile_cache_flag(parser) -> None:
    """--compile-cache, and --verbose (every command has both)."""
    parser.add_argument("--compile-cache", metavar="DIR",
                        help="keep compiled programs in DIR (created if missing): a rerun "
                             "with the same shapes loads them instead of compiling")
    parser.add_argument("--verbose", action="store_true",
                        help="on an error, also print the traceback of its cause")


def _compile_cache(directory: Optional[str]):
    """The --compile-cache context (checked before anything runs), or a no-op."""
    if directory is None:
        return contextlib.nullcontext()
    from jaxformer.cli.compile_cache import check_cache_dir, compilation_cache  # noqa: PLC0415
    try:
        check_cache_dir(directory)
    except ValueError as error:
        raise UsageError(str(error)) from error
    return compilation_cache(directory)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of `jaxformer` and `python -m jaxformer`; returns the exit status."""
    parser = build_parser()
    try:  # a bad flag: one line (`args.Parser`), status 2; --help: status 0
        args = parser.parse_args(argv)
    except SystemExit as done:
        return done.code
    if args.command is None:
        parser.print_help()
        return 2
    try:
        with _compile_cache(args.compile_cache):
            return args.func(args)
    except UsageError as error:
        print(f"jaxformer {args.command}: error: {error}", file=sys.stderr)
        if args.verbose and error.__cause__ is not None:
            traceback.print_exception(error.__cause__)
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C (the first one saves and stops cleanly)
        print(f"jaxformer {args.command}: aborted by Ctrl-C", file=sys.stderr)
        return 130


# --------------------------------------------------------------------------- train


def _configs_from_args(args):
    """(model config, train config, preset) from the flags given explicitly."""
    from jaxformer.config import PRESETS  # noqa: PLC0415
    from jaxformer.train.task import task_type  # noqa: PLC0415
    from jaxformer.train.train_config import TrainConfig  # noqa: PLC0415

    model_overrides = {}
    for flag in _MODEL_FLAGS:
        value = getattr(args, flag)
        if value is not None:
            model_overrides.update({field: value for field in _model_fields(flag, args.task)})
    train_overrides = {field: _flag_value(args, flag) for flag, field in _TRAIN_FLAGS.items()
                       if getattr(args, flag) is not None}
    if "steps" in train_overrides and "warmup_steps" not in train_overrides:
        # Short runs keep a proportionate warmup instead of failing validation.
        train_overrides["warmup_steps"] = min(TrainConfig.warmup_steps,
                                              train_overrides["steps"] // 8)
    preset = args.preset or task_type(args.task or TrainConfig.task).default_preset
    return PRESETS[preset], model_overrides, TrainConfig, train_overrides, preset


def _train_command(args) -> int:
    with contextlib.ExitStack() as held:  # the run directory's lock, for the whole run
        return _train(args, held)


def _train(args, held: contextlib.ExitStack) -> int:
    started = time.perf_counter()
    import jax  # noqa: PLC0415 (heavy imports after argument parsing)

    from jaxformer.parallel import distributed  # noqa: PLC0415
    from jaxformer.train.checkpoint import CheckpointError  # noqa: PLC0415
    from jaxformer.train.evaluation import evaluate  # noqa: PLC0415
    from jaxformer.train.loop import fit, NonFiniteLossError  # noqa: PLC0415
    from jaxformer.train.task import training_task, trains_language_model  # noqa: PLC0415
    from jaxformer.train.train_config import TrainConfig  # noqa: PLC0415
    from jaxformer.train.run_lock import LOCK_NAME  # noqa: PLC0415

    processes = _process_settings(args)
    if processes is not None and args.out is None:
        raise UsageError("several processes need --out: the one run directory, the same "
                         "path on every process")
    build_model, model_overrides, _, train_overrides, preset = _configs_from_args(args)

    if args.fallback and not args.resume:
        raise UsageError("--fallback only applies with --resume")
    _check_init_flags(args)
    _check_text_files(args)
    if args.out is not None:
        check_writable_dir(args.out, "--out")
    if args.resume:
        if args.out is None:
            raise UsageError("--resume needs --out, the run directory to continue")
        out = args.out
        config_path = os.path.join(out, "config.json")
        model_config, train_config, saved = read_run_config(out, "cannot resume: ")
        conflicts = _conflicts(args, model_config, train_config, model_overrides,
                               train_overrides, saved.get("preset"))
        saved_init = (saved.get("init") or {}).get("path")
        if args.init is not None and os.path.abspath(args.init) != saved_init:
            conflicts.append(f"--init {args.init} (saved: {saved_init})")
        if args.quantize not in (None, "keep", model_config.weight_quant):
            conflicts.append(f"--quantize {args.quantize} (saved: "
                             f"{model_config.weight_quant or 'float'})")
        if conflicts:
            raise UsageError("--resume continues the saved run; these flags differ from "
                             f"{config_path}: {', '.join(conflicts)}")
    else:
        try:
            tokenizer_path = None
            if args.init is not None:  # the model comes from the checkpoint, loaded below
                tokenizer_path = train_overrides.pop("tokenizer", None)
                model_config = None
            else:
                if trains_language_model(train_overrides.get("task", TrainConfig.task)):
                    model_overrides = _lm_model_overrides(model_overrides, train_overrides)
                model_config = build_model(**model_overrides)
            train_config = TrainConfig(**train_overrides)
        except (ValueError, TypeError) as error:
            raise UsageError(str(error)) from error
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        kind = "finetune" if model_config is None else model_config.norm
        out = args.out or os.path.join("runs", f"{train_config.task}-{kind}-{stamp}")
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"run directory {out} already exists and is a file: choose "
                         "another --out")
    # One writer per run directory: process 0 holds its lock (`train.run_lock`) until
    # the run ends; when process ids come from the cluster ("auto"), once it knows it.
    if processes is None or processes.process_id == 0:
        _lock_run(out, held)
    if not args.resume and set(os.listdir(out) if os.path.isdir(out) else ()) - {LOCK_NAME}:
        raise UsageError(f"run directory {out} already exists and is not empty: pass "
                         f"--resume to continue it, or choose another --out")

    cpu_tuning = _cpu_tuning(args)  # before JAX starts
    # After the checks of --out: no process wrote yet. Giving up on the others releases
    # the lock (and the directory it made) first: that exit skips every `with` block.
    _start_processes(args, processes, on_give_up=held.close)
    if processes is not None and processes.process_id is None and distributed.is_primary():
        _lock_run(out, held)
    checkpoint_dir = os.path.join(out, "checkpoints")
    if args.resume and not (os.path.isdir(checkpoint_dir) and has_checkpoint(checkpoint_dir)):
        raise UsageError(f"cannot resume: no checkpoint in {out}/checkpoints")  # (Orbax: JAX)
    from jaxformer.parallel.partitioning import make_mesh, mesh_spec_string  # noqa: PLC0415
    from jaxformer.parallel.sharding import check_divisible  # noqa: PLC0415

    try:  # the devices known, the mesh and the batch before --init loads
        mesh = make_mesh(resume_mesh_spec(args, saved.get("mesh") if args.resume else None))
    except ValueError as error:
        raise UsageError(f"--mesh {args.mesh}: {error}") from error
    try:
        check_divisible(train_config.batch_size, mesh, name="--batch")
    except ValueError as error:
        raise UsageError(str(error)) from error
    init_params = pretrained_tokenizer = None
    if model_config is None:  # --init: the checkpoint's model, weights and tokenizer
        model_config, init_params, pretrained_tokenizer = _load_init(
            args, model_overrides, tokenizer_path)
    model_config = model_config.replace(cpu_tuning=cpu_tuning)
    try:  # everything checkable before compiling: data/task vs model, mesh vs parameters
        task = training_task(model_config, train_config)
        model = task.model_class(model_config)
        _check_mesh_fits(model, mesh)
        data = None
        if task.device_batch is None:  # host-fed: the text of --data
            data = _text_data(train_config, _run_tokenizer(
                out, model_config, train_config, saved if args.resume else {},
                pretrained_tokenizer))
            task = training_task(model_config, train_config, data)
        task.check(model_config)
    except ValueError as error:
        raise UsageError(str(error)) from error

    primary = distributed.is_primary()  # writes the run directory and prints
    if not args.resume and primary:
        from jaxformer.train.run import CHAT_TEMPLATE, TOKENIZER, Run  # noqa: PLC0415

        os.makedirs(out, exist_ok=True)
        extra = {"preset": None if args.init else preset, "mesh": mesh_spec_string(mesh),
                 "processes": jax.process_count()}
        if args.init is not None:  # the run stands alone: tokenizer and chat template copied
            pretrained_tokenizer.save(os.path.join(out, TOKENIZER))
            extra["init"] = {"path": os.path.abspath(args.init), "tokenizer": TOKENIZER}
            template = source_chat_template(args.init)
            if template is not None:
                with open(os.path.join(out, CHAT_TEMPLATE), "w") as f:
                    f.write(template)
        saved = Run.create(out, model_config, train_config, **extra).saved
    if args.resume and saved.get("init"):
        preset = f"fine-tuned {saved['init']['path']}"
    elif args.init is not None:
        preset = f"fine-tuned {args.init}"

    if primary:
        print(f"jaxformer train: {train_config.task} task, {preset} model "
              f"({model_config.norm}-LN, {model_config.dtype}), mesh "
              f"{mesh_spec_string(mesh)}, {distributed.describe()}, run dir {out}",
              flush=True)
        if model_config.cpu_tuning:
            print("jaxformer train: CPU tuning on (jaxformer.backends.cpu; same results up to "
                  "rounding; --no-cpu-tuning turns it off)", flush=True)
    try:
        result = fit(model_config, train_config, checkpoint_dir=checkpoint_dir,
                     resume=args.resume, save_every=args.save_every, log_every=args.log_every,
                     progress=not args.no_progress,
                     metrics_file=os.path.join(out, "metrics.jsonl"), mesh=mesh, task=task,
                     eval_every=args.eval_every, fallback=args.fallback,
                     init_params=init_params)
    except CheckpointError as error:
        raise UsageError(str(error)) from error
    except NonFiniteLossError as error:
        print(f"jaxformer train: {error}", file=sys.stderr)
        return 1
    step = int(result.state.step)
    if result.interrupted and primary:
        print(f"jaxformer train: interrupted at step {step}; checkpoint saved in "
              f"{out}/checkpoints. Continue with: jaxformer train --out {out} --resume",
              file=sys.stderr)
    if result.interrupted:
        return 130

    # The rest (evaluation, figures, summary) is process 0's, on its own devices.
    params, local_mesh = distributed.host_copy(result.state.params), mesh
    if jax.process_count() > 1:
        if not primary:
            return 0
        local_mesh = make_mesh(devices=jax.local_devices())
    if data is not None:
        return _finish_lm(args, model, params, local_mesh, result, data, train_config, out,
                          started)
    heldout = task.heldout_set(args.eval_examples)
    metrics = evaluate(model, params, heldout, mesh=local_mesh)
    _show_examples(model, params, heldout, args.show)
    history = _read_metrics(os.path.join(out, "metrics.jsonl"))
    _write_figures(model, params, heldout, history, out, train_config, model_config)
    summary = {"task": train_config.task, "norm": model_config.norm,
               "dtype": model_config.dtype, "exact_match": metrics["exact_match"],
               "token_accuracy": metrics["token_accuracy"], "eval_loss": metrics["loss"],
               "eval_examples": metrics["examples"]}
    _write_summary(out, summary, result, params, started)
    return 0


def _lock_run(out: str, held: contextlib.ExitStack) -> None:
    """Hold the lock of run directory `out` until `held` closes (`train.run_lock`):
    UsageError naming the holder if another live process has it; a stale lock (its
    holder died) is taken over, saying so."""
    from jaxformer.train.run_lock import RunLock, RunLockedError  # noqa: PLC0415

    try:
        lock = held.enter_context(RunLock(out))
    except RunLockedError as error:
        raise UsageError(str(error)) from error
    except OSError as error:
        raise UsageError(f"--out {out}: cannot lock the run directory: {error}") from error
    if lock.stale_holder is not None:
        print(f"jaxformer train: taking over {lock.path} from {lock.stale_holder}, "
              "which ended without releasing it", file=sys.stderr, flush=True)


def _write_summary(out: str, summary: dict, result, params, started: float) -> None:
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
    with open(os.path.join(out, "summary.json"), "w") as f:
        f.write(line + "\n")
    print(line, flush=True)


def check_writable_dir(path: str, flag: str) -> None:
    """UsageError unless `path` is a directory this process can write, or can be created
    as one: its nearest existing ancestor must be a writable directory."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise UsageError(f"{flag} {path}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: cannot write in {existing} (permission denied)")


def _process_settings(args):
    """`distributed.Settings` of --coordinator/--num-processes/--process-id (or the
    environment; None: one process), checked before anything starts."""
    from jaxformer.parallel import distributed  # noqa: PLC0415

    try:
        return distributed.settings(args.coordinator, args.num_processes, args.process_id,
                                    names=_PROCESS_FLAGS)
    except ValueError as error:
        raise UsageError(str(error)) from error


def _check_mesh_fits(model, mesh) -> None:
    """ValueError, before anything is written, if a parameter dimension does not split
    over its mesh axes (abstract shapes only: nothing is computed)."""
    import jax  # noqa: PLC0415

    from jaxformer.parallel.partitioning import example_inputs, param_shardings  # noqa: PLC0415

    inputs = example_inputs(model)
    abstract = jax.eval_shape(model.init, jax.random.PRNGKey(0), *inputs)["params"]
    param_shardings(model, abstract, mesh, *inputs)


def _cpu_tuning(args) -> bool:
    """Ask for CPU tuning (`backends.cpu`) when JAX will run on the CPU, unless
    --no-cpu-tuning; True if it is on."""
    from jaxformer.backends import cpu  # noqa: PLC0415

    if args.no_cpu_tuning or not cpu.cpu_is_the_backend():
        return False
    try:
        cpu.tune_process()
    except cpu.CPUTuningError:  # JAX started already (a caller of main() in-process)
        return False
    return True


def _start_processes(args, processes, on_give_up=None) -> None:
    """--cpu-devices, then join the other processes (before JAX starts its devices)."""
    from jaxformer.parallel import distributed  # noqa: PLC0415
    from jaxformer.parallel.sharding import use_cpu_cores_as_devices  # noqa: PLC0415

    try:
        if args.cpu_devices is not None:
            use_cpu_cores_as_devices(args.cpu_devices)
        if processes is not None:
            if processes.process_id is not None:  # context for JAX's own abort, if it comes
                print(f"jaxformer train: process {processes.process_id} of "
                      f"{processes.num_processes}: joining the others at "
                      f"{processes.coordinator} (up to {args.coordinator_timeout:g} s)",
                      file=sys.stderr, flush=True)
            distributed.initialize(processes.coordinator, processes.num_processes,
                                   processes.process_id, timeout_s=args.coordinator_timeout,
                                   on_give_up=on_give_up)
    except (RuntimeError, ValueError) as error:  # incl. CoordinatorUnreachable
        raise UsageError(str(error)) from error


def _lm_model_overrides(model_overrides: dict, train_overrides: dict) -> dict:
    """Task "lm": the vocabulary and special ids come from the tokenizer, the positions
    from the window length, unless given."""
    from jaxformer.text import training_tokenizer  # noqa: PLC0415
    from jaxformer.train.train_config import TrainConfig  # noqa: PLC0415

    tokenizer = training_tokenizer(train_overrides.get("tokenizer"))
    vocab = model_overrides.get("tgt_vocab_size", tokenizer.vocab_size)
    seq_len = train_overrides.get("seq_len", TrainConfig.seq_len)
    return {"src_vocab_size": vocab, "tgt_vocab_size": vocab, "pad_id": tokenizer.pad_id,
            "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id, "max_len": seq_len,
            **model_overrides, "num_encoder_layers": 0}


def _check_init_flags(args) -> None:
    """--init takes the model from the checkpoint; --lora needs it (one line each)."""
    from jaxformer.train.task import trains_language_model  # noqa: PLC0415

    if args.init is None:
        lora = [f"--{f.replace('_', '-')}" for f in ("lora", "lora_alpha", "lora_targets")
                if getattr(args, f) is not None]
        if lora and not args.resume:
            raise UsageError(f"{lora[0]} needs --init: adapters go on a pretrained model")
        if args.quantize is not None and not args.resume:
            raise UsageError("--quantize needs --init and --lora: it quantizes the pretrained "
                             "base the adapters train on (QLoRA)")
        return
    shape = [f"--{f.replace('_', '-')}" for f in _SHAPE_FLAGS if getattr(args, f) is not None]
    if shape and not args.resume:
        raise UsageError(f"--init takes the model from the checkpoint: drop "
                         f"{', '.join(shape)}")
    if args.task is None or not trains_language_model(args.task):
        raise UsageError("--init fine-tunes a language model: it needs --task lm")
    if not os.path.exists(args.init):
        raise UsageError(f"--init {args.init}: no such checkpoint directory or GGUF file")
    if args.lora is None and (args.lora_alpha is not None or args.lora_targets is not None):
        raise UsageError("--lora-alpha and --lora-targets need --lora RANK")
    if args.lora is None and args.quantize is not None:
        raise UsageError(f"--quantize {args.quantize} freezes the base as integers: it needs "
                         "--lora RANK (QLoRA); full fine-tuning trains float weights")
    from jaxformer.config import LORA_TARGETS  # noqa: PLC0415

    for target in args.lora_targets or ():  # before the checkpoint is read
        if target not in LORA_TARGETS:
            raise UsageError(f"--lora-targets: {target!r} is not a projection of this model; "
                             f"valid: {', '.join(LORA_TARGETS)}")


def _check_text_files(args) -> None:
    """--data and --eval-data name readable files (read later, after JAX starts and
    --init loads)."""
    from jaxformer.train.data import document_paths  # noqa: PLC0415

    for flag in ("data", "eval_data"):
        if getattr(args, flag):
            try:
                document_paths(getattr(args, flag))
            except ValueError as error:
                raise UsageError(f"--{flag.replace('_', '-')}: {error}") from error


def _load_init(args, model_overrides: dict, tokenizer_path: Optional[str]):
    """(model config, params, `tokenizers.Tokenizer`) of --init, with the flags' model
    overrides (dropout, scan, remat, precision, attention, LoRA); a --tokenizer that is
    not the checkpoint's is refused."""
    from jaxformer.cli.runs import load_pretrained  # noqa: PLC0415

    if tokenizer_path is not None:
        from tokenizers import Tokenizer  # noqa: PLC0415

        try:
            given = Tokenizer.from_file(tokenizer_path)
        except Exception as error:  # noqa: BLE001 (tokenizers raises plain Exceptions)
            raise UsageError(f"--tokenizer {tokenizer_path}: not a tokenizers JSON file "
                             f"({error})") from error
        from jaxformer.text import checkpoint_tokenizer  # noqa: PLC0415

        try:  # the checkpoint's tokenizer alone first: no weights read for a refusal
            own = checkpoint_tokenizer(args.init)
        except (ImportError, ValueError):
            own = None  # load_pretrained below says what is wrong with the checkpoint
        if own is not None and (given.get_vocab(with_added_tokens=True)
                                != own.get_vocab(with_added_tokens=True)):
            raise UsageError(f"--tokenizer {tokenizer_path} is not the tokenizer of --init "
                             f"{args.init}; fine-tuning uses the checkpoint's (drop "
                             f"--tokenizer)")
    model, params, tokenizer = load_pretrained(args.init, "--init", args.quantize)
    try:
        config = model.config.replace(**model_overrides)
    except (ValueError, TypeError) as error:
        raise UsageError(str(error)) from error
    return config, params, tokenizer


def _run_tokenizer(out, model_config, train_config, saved: dict, pretrained=None):
    """The tokenizer of an LM run: --init's (wrapped with the model's ids), a resumed
    fine-tuning run's copy in `out`, or the train config's."""
    from jaxformer.cli.runs import run_tokenizer  # noqa: PLC0415
    from jaxformer.text import JSONTokenizer  # noqa: PLC0415

    if pretrained is not None:
        c = model_config
        return JSONTokenizer.wrap(pretrained, pad_id=c.pad_id, bos_id=c.bos_id,
                                  eos_id=c.eos_id, vocab_size=c.tgt_vocab_size,
                                  name="the --init tokenizer")
    return run_tokenizer(out, model_config, train_config, saved)


def _text_data(train_config, tokenizer=None):
    """The `TextData` of an LM run: files read, tokenized, split and packed (may raise
    ValueError naming a file). `tokenizer`: default the train config's."""
    from jaxformer.text import training_tokenizer  # noqa: PLC0415
    from jaxformer.train.data import TextData  # noqa: PLC0415

    tc = train_config
    tokenizer = training_tokenizer(tc.tokenizer) if tokenizer is None else tokenizer
    return TextData(tc.data, tokenizer, tc.seq_len,
                    eval_patterns=tc.eval_data or None, eval_fraction=tc.eval_fraction,
                    seed=tc.seed)


def _finish_lm(args, model, params, mesh, result, data, train_config, out, started) -> int:
    """Held-out bits per byte against the baselines, sampled continuations, figures, summary.

    `params` and `mesh`: this process's copy of the trained parameters, its devices."""
    from jaxformer.cli import baselines, plots  # noqa: PLC0415
    from jaxformer.train.evaluation import evaluate_lm  # noqa: PLC0415

    step = int(result.state.step)
    final = result.evals[-1] if result.evals and result.evals[-1]["step"] == step else {
        f"eval_{k}": v for k, v in evaluate_lm(model, params, data, mesh=mesh,
                                               progress=not args.no_progress).items()}
    _show_continuations(model, params, data, args.samples, args.sample_tokens)
    history = _read_metrics(os.path.join(out, "metrics.jsonl"))
    plots.loss_curve([r for r in history if "loss" in r], os.path.join(out, "loss.png"),
                     title=f"language model on {len(data.eval_bytes):,} held-out bytes",
                     evals=[r for r in history if "eval_loss" in r])
    steps_run = step - result.start_step
    window_tokens = train_config.seq_len * train_config.batch_size
    summary = {
        "task": "lm", "bits_per_byte": final["eval_bits_per_byte"],
        "unigram_bits_per_byte": baselines.unigram_bits_per_byte(data.eval_bytes),
        "xz_bits_per_byte": baselines.xz_bits_per_byte(data.eval_bytes),
        "eval_loss": final["eval_loss"], "perplexity": final["eval_perplexity"],
        "eval_bytes": len(data.eval_bytes), "train_bytes": data.train_bytes_count,
        "tokens_per_s": (round(steps_run * window_tokens / result.train_s, 1)
                         if steps_run else None)}
    _write_summary(out, summary, result, params, started)
    return 0


def resume_mesh_spec(args, saved_spec: Optional[str]) -> Optional[str]:
    """The mesh spec to train on: --mesh if given; on --resume, else the saved run's
    mesh if it fits this run's devices (the run continues split as it was), else
    None (all devices on data), saying so."""
    import jax  # noqa: PLC0415

    from jaxformer.parallel import distributed  # noqa: PLC0415
    from jaxformer.parallel.partitioning import parse_mesh_spec  # noqa: PLC0415

    if args.mesh is not None or saved_spec is None:
        return args.mesh
    try:
        parse_mesh_spec(saved_spec, len(jax.devices()))
    except ValueError:
        if distributed.is_primary():
            print(f"jaxformer train: the saved mesh {saved_spec} does not fit "
                  f"{len(jax.devices())} device(s); resuming with all of them on data "
                  f"(pass --mesh to choose)", file=sys.stderr)
        return None
    return saved_spec


def _generate_command(args) -> int:
    if args.system is not None and not args.chat:
        raise UsageError("--system needs --chat")
    template = read_template(args.model, args.run) if args.chat else None
    model, params, tokenizer = language_model(args.run, args.model, args.quantize)
    temperature = args.temperature if args.temperature is not None else (
        0.8 if args.run is not None else 0.0)
    if args.chat:
        prompts = chat_prompts(template, tokenizer, args.prompts, args.system)
    else:
        prompts = [tokenizer.encode_prompt(p).tolist() for p in args.prompts]
    for text, prompt in zip(args.prompts, prompts):
        if not prompt:
            raise UsageError(f"prompt {text!r} encodes to no tokens")
    max_new_tokens = new_token_budget(model.config.decoder_len, max(map(len, prompts)),
                                      args.max_new_tokens)
    # One prompt streams its text as the tokens come; a batch prints when it ends.
    # A chat prints the replies alone.
    shown = [""] * len(prompts) if args.chat else args.prompts
    stream = None if args.json or len(prompts) > 1 else TextStream(
        tokenizer, shown[0], stop={model.config.eos_id, model.config.pad_id})
    started = time.perf_counter()
    try:  # the flags were checked as parsed: the library's own checks are a backstop
        new_ids = _continue_prompts(model, params, prompts, max_new_tokens,
                                    temperature=temperature, top_k=args.top_k,
                                    top_p=args.top_p, seed=args.seed,
                                    on_token=stream and stream.on_token,
                                    prefill_chunk=args.prefill_chunk)
    except (TypeError, ValueError) as error:
        raise UsageError(str(error)) from error
    seconds = round(time.perf_counter() - started, 3)
    for prompt, ids, before in zip(args.prompts, new_ids, shown):
        text = tokenizer.decode(ids)
        if args.json:
            print(json.dumps({"prompt": prompt, "ids": ids, "text": text,
                              "seconds": seconds}, ensure_ascii=False), flush=True)
        elif stream is not None:
            stream.finish(text)
        else:
            print(before + text, flush=True)
    return 0


def _decode_command(args) -> int:
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from jaxformer.decode.api import greedy_decode, sample  # noqa: PLC0415
    from jaxformer.nn.model import Transformer  # noqa: PLC0415
    from jaxformer.train.task import training_task  # noqa: PLC0415

    try:  # before the checkpoint is read
        rows = [[int(t) for t in source.split()] for source in args.sources]
    except ValueError as error:
        raise UsageError(f"sources must be space-separated token ids: {error}") from error
    if not all(rows):
        raise UsageError("a source is empty")
    model_config, train_config, params = load_run(args.run, language_model=False)
    model = Transformer(model_config)
    kwargs = dict(max_new_tokens=new_token_budget(model_config.decoder_len, 1,
                                                  args.max_new_tokens))
    if rows:
        src = np.full((len(rows), max(map(len, rows))), model_config.pad_id, np.int32)
        for i, row in enumerate(rows):
            src[i, :len(row)] = row
    else:
        src = training_task(model_config, train_config).heldout_set(args.examples).src
    try:
        out = (greedy_decode(model, params, src, **kwargs) if args.temperature == 0 else
               sample(model, params, src, rng=jax.random.PRNGKey(args.seed),
                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                      **kwargs))
    except (TypeError, ValueError) as error:
        raise UsageError(str(error)) from error
    stop = {model_config.pad_id}
    for row, tokens, n in zip(src, np.asarray(out.tokens), np.asarray(out.lengths)):
        source = " ".join(map(str, _strip(row, stop)))
        decoded = " ".join(map(str, _strip(tokens[:n], {model_config.eos_id, *stop})))
        print(f"{source}  ->  {decoded}")
    return 0


def _conflicts(args, model_config, train_config, model_overrides, train_overrides,
               saved_preset) -> list[str]:
    conflicts = []
    if args.preset is not None and args.preset != saved_preset:
        conflicts.append(f"--preset {args.preset} (saved: {saved_preset})")
    for flag in _MODEL_FLAGS:
        value = getattr(args, flag)
        fields = _model_fields(flag, train_config.task)
        if value is not None and any(getattr(model_config, f) != value for f in fields):
            conflicts.append(f"--{flag.replace('_', '-')} {value} (saved: "
                             f"{getattr(model_config, fields[0])})")
    for flag, field in _TRAIN_FLAGS.items():
        value = _flag_value(args, flag)
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
    from jaxformer.decode.api import greedy_decode  # noqa: PLC0415

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


def new_token_budget(context: int, prompt_width: int, requested: Optional[int]) -> int:
    """How many tokens `generate` / `decode` ask for: --max-new-tokens as given, refused
    beyond what a prompt of `prompt_width` tokens leaves of the model's `context`
    (generation feeds back all but its last token); when not given, the default,
    capped there."""
    room = context - prompt_width + 1
    if room < 1:
        raise UsageError(f"a prompt of {prompt_width} tokens leaves no room in the model's "
                         f"context of {context} tokens (max_len)")
    if requested is None:
        return min(DEFAULT_NEW_TOKENS, room)
    if requested > room:
        raise UsageError(f"--max-new-tokens {requested} does not fit: the model's context "
                         f"is {context} tokens (max_len) and the "
                         + (f"longest prompt has {prompt_width}, which leaves {room}"
                            if prompt_width > 1 else f"most it generates is {room}"))
    return requested


def _continue_prompts(model, params, prompts, max_new_tokens: int, *,
                      temperature: float = 0.8, top_k=None, top_p=None, seed: int = 0,
                      on_token=None, prefill_chunk=None) -> list[list[int]]:
    """Sampled (temperature 0: greedy) continuations of token prompts: the new ids,
    up to and without EOS. `max_new_tokens`: within the model's context
    (`new_token_budget`). `on_token`: as `jaxformer.decode.api.generate`'s."""
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from jaxformer.decode.api import generate  # noqa: PLC0415

    width = max(len(p) for p in prompts)
    batch = np.full((len(prompts), width), model.config.pad_id, np.int32)
    for row, prompt in zip(batch, prompts):
        row[:len(prompt)] = prompt
    out = generate(model, params, batch, max_new_tokens=max_new_tokens,
                   prompt_lengths=np.array([len(p) for p in prompts], np.int32),
                   rng=jax.random.PRNGKey(seed), temperature=temperature, top_k=top_k,
                   top_p=top_p, on_token=on_token, prefill_chunk=prefill_chunk)
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    return [[int(i) for i in row[:n] if i != model.config.eos_id]
            for row, n in zip(tokens, lengths)]


def _show_continuations(model, params, data, count: int, max_new_tokens: int) -> None:
    """Print `count` held-out prompts, each followed by a sampled continuation."""
    if count == 0:
        return
    prompts = data.eval_prompts(count, min(64, model.config.max_len // 2))
    room = model.config.max_len - max(map(len, prompts)) + 1  # --sample-tokens' cap
    texts = [data.tokenizer.decode(ids) for ids in
             _continue_prompts(model, params, prompts, min(max_new_tokens, room))]
    for i, (prompt, text) in enumerate(zip(prompts, texts)):
        print(f"--- held-out prompt {i + 1} (sampled continuation after >>>)")
        print(f"{data.tokenizer.decode(prompt)}>>>{text}")


def _read_metrics(path: str) -> list[dict]:
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


def _write_figures(model, params, heldout, history, out, train_config, model_config) -> None:
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


if __name__ == "__main__":
    sys.exit(main())

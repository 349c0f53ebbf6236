"""`jaxformer train`: train a Transformer on a synthetic task, or the decoder-only LM on text.

    jaxformer train                       # copy task, copy_task model, Post-LN
    jaxformer train --norm pre --out runs/pre
    jaxformer train --task reverse --steps 1500
    jaxformer train --out runs/x --resume # continue an interrupted run
    jaxformer train --task lm --data 'texts/*.txt'   # a byte-level LM on text files
    jaxformer train --mesh data=2,fsdp=2,tensor=2    # shard over 8 devices (default: data)
    jaxformer train --task lm --init SmolLM2.gguf --data 'texts/*.txt' [--lora 8]  # fine-tune

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

Exit status: 0 done, 1 non-finite loss or a checkpoint that could not be written (a
full disk: the unfinished step is removed, the earlier ones are kept), 2 bad input or
checkpoint, 130 interrupted by Ctrl-C (after saving a checkpoint).

The flags' checks, the resume rules and the processes are `cli.train_setup`'s; what
the run reports at the end is `cli.train_report`'s; the run directory is
`jaxformer.train.run.Run`.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import time
from typing import TYPE_CHECKING, NamedTuple, Optional

from jaxformer.cli import args as args_lib
from jaxformer.cli import train_report
from jaxformer.cli import train_setup as setup
from jaxformer.cli.args import non_negative_int, positive_int
from jaxformer.cli.export import source_chat_template
from jaxformer.cli.runs import add_quantize_flag, cpu_tuning as tune_cpu, open_run
from jaxformer.cli.usage import UsageError

if TYPE_CHECKING:  # annotations only: the heavy imports wait for a run
    from jaxformer.config import TransformerConfig
    from jaxformer.train.run import Run
    from jaxformer.train.train_config import TrainConfig


def add_parser(commands, add_common_flags) -> None:
    """Register the subcommand on `commands` (argparse subparsers)."""
    from jaxformer.config import PRESETS  # noqa: PLC0415 (keep --help fast)
    from jaxformer.train.task import TASK_TYPES  # noqa: PLC0415
    from jaxformer.train.train_config import TrainConfig  # noqa: PLC0415

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
    run_flags = train.add_argument_group("run")
    run_flags.add_argument("--out", help="run directory (default runs/<task>-<norm>-<time>)")
    run_flags.add_argument("--resume", action="store_true",
                     help="continue the run in --out from its latest checkpoint")
    run_flags.add_argument("--fallback", action="store_true",
                     help="with --resume: if the latest checkpoint is damaged, continue from "
                          "the newest step that restores (the damaged steps are kept, "
                          "renamed <step>.damaged)")
    run_flags.add_argument("--save-every", type=positive_int, default=200, help="checkpoint interval")
    run_flags.add_argument("--log-every", type=positive_int, default=20,
                     help="steps between progress/metrics updates")
    run_flags.add_argument("--eval-examples", type=positive_int, default=1000,
                     help="held-out sequences decoded at the end")
    run_flags.add_argument("--show", type=non_negative_int, default=5, help="held-out examples printed")
    run_flags.add_argument("--no-progress", action="store_true", help="no progress bar")
    run_flags.add_argument("--no-cpu-tuning", action="store_true",
                     help="on a CPU, train without jaxformer.backends.cpu's tuning (same "
                          "results, slower)")
    add_common_flags(run_flags)
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
    train.set_defaults(func=run)


def run(args) -> int:
    with contextlib.ExitStack() as held:  # the run directory's lock, for the whole run
        return _train(args, held)


class RunPlan(NamedTuple):
    """What to train and where: from the flags, or with --resume from the saved run."""

    out: str
    model_config: Optional[TransformerConfig]  # None with --init: the checkpoint's, loaded later
    train_config: TrainConfig
    model_overrides: dict
    tokenizer_path: Optional[str]  # --tokenizer with --init
    preset: Optional[str]
    saved_run: Optional[Run]  # --resume


def _train(args, held: contextlib.ExitStack) -> int:
    """The stages in order: every check that needs no device before the lock, the lock
    before any process writes, the mesh before --init loads, everything checkable before
    compiling; then fit, and process 0's report."""
    started = time.perf_counter()
    import jax  # noqa: PLC0415 (heavy imports after argument parsing)

    from jaxformer.parallel import distributed  # noqa: PLC0415
    from jaxformer.train.checkpoint import CheckpointWriteError  # noqa: PLC0415
    from jaxformer.train.loop import NonFiniteLossError  # noqa: PLC0415

    processes = setup.process_settings(args)
    plan = plan_run(args, processes)
    lock_run_dir(args, plan.out, processes, held)
    cpu_tuning = start_run(args, plan, processes, held)
    mesh = run_mesh(args, plan)
    model_config, init_params, pretrained_tokenizer = run_model(args, plan, cpu_tuning)
    task, model, data = training_inputs(args, plan, model_config, mesh, pretrained_tokenizer)

    primary = distributed.is_primary()  # writes the run directory and prints
    new_run = not args.resume and primary
    try:
        if new_run:
            create_run_dir(args, plan, model_config, mesh, pretrained_tokenizer)
        if primary:
            announce(plan, model_config, mesh, model_description(args, plan))
        result = fit_run(args, plan, model_config, mesh, task, init_params)
    except (NonFiniteLossError, CheckpointWriteError) as error:  # the run stopped early
        print(f"jaxformer train: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # before the loop (compiling): no checkpoint to resume
        if new_run:
            remove_unstarted_run(plan.out)
        raise
    if result.interrupted:
        if primary:
            print(f"jaxformer train: interrupted at step {int(result.state.step)}; checkpoint "
                  f"saved in {plan.out}/checkpoints. Continue with: jaxformer train --out "
                  f"{plan.out} --resume", file=sys.stderr)
        return 130
    # The rest (evaluation, figures, summary) is process 0's, on its own devices; the
    # parameters' host copy is a collective, so every process takes it first.
    params = distributed.host_copy(result.state.params)
    if jax.process_count() > 1 and not primary:
        return 0
    report(args, plan, model_config, mesh, task, model, data, result, params, started)
    return 0


def plan_run(args, processes) -> RunPlan:
    """The run's configurations and directory, every flag checked (UsageError)."""
    from jaxformer.train.task import trains_language_model  # noqa: PLC0415
    from jaxformer.train.train_config import TrainConfig  # noqa: PLC0415

    if processes is not None and args.out is None:
        raise UsageError("several processes need --out: the one run directory, the same "
                         "path on every process")
    build_model, model_overrides, _, train_overrides, preset = setup.configs_from_args(args)

    if args.fallback and not args.resume:
        raise UsageError("--fallback only applies with --resume")
    setup.check_init_flags(args)
    setup.check_text_files(args)
    if args.out is not None:
        setup.check_writable_dir(args.out, "--out")
    if args.resume:
        if args.out is None:
            raise UsageError("--resume needs --out, the run directory to continue")
        saved_run = open_run(args.out, "cannot resume: ")
        conflicts = setup.resume_conflicts(args, saved_run)
        if conflicts:
            raise UsageError("--resume continues the saved run; these flags differ from "
                             f"{saved_run.config_path}: {', '.join(conflicts)}")
        return RunPlan(args.out, saved_run.model_config, saved_run.train_config,
                       model_overrides, None, preset, saved_run)
    try:
        tokenizer_path = None
        if args.init is not None:  # the model comes from the checkpoint, loaded later
            tokenizer_path = train_overrides.pop("tokenizer", None)
            model_config = None
        else:
            if trains_language_model(train_overrides.get("task", TrainConfig.task)):
                model_overrides = setup.lm_model_overrides(model_overrides, train_overrides)
            model_config = build_model(**model_overrides)
        train_config = TrainConfig(**train_overrides)
    except (ValueError, TypeError) as error:
        raise UsageError(str(error)) from error
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    kind = "finetune" if model_config is None else model_config.norm
    out = args.out or os.path.join("runs", f"{train_config.task}-{kind}-{stamp}")
    return RunPlan(out, model_config, train_config, model_overrides, tokenizer_path, preset,
                   None)


def lock_run_dir(args, out: str, processes, held: contextlib.ExitStack) -> None:
    """Take `out`'s lock (process 0, when its id is known) and refuse a directory that is
    a file, or holds another run without --resume."""
    from jaxformer.train.run_lock import LOCK_NAME  # noqa: PLC0415

    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"run directory {out} already exists and is a file: choose "
                         "another --out")
    # One writer per run directory: process 0 holds its lock (`train.run_lock`) until
    # the run ends; when process ids come from the cluster ("auto"), once it knows it.
    if processes is None or processes.process_id == 0:
        setup.lock_run(out, held)
    if not args.resume and set(os.listdir(out) if os.path.isdir(out) else ()) - {LOCK_NAME}:
        raise UsageError(f"run directory {out} already exists and is not empty: pass "
                         f"--resume to continue it, or choose another --out")


def start_run(args, plan: RunPlan, processes, held: contextlib.ExitStack) -> bool:
    """CPU tuning (before JAX starts) and the other processes; whether tuning is on."""
    from jaxformer.parallel import distributed  # noqa: PLC0415

    cpu_tuning = tune_cpu(not args.no_cpu_tuning)  # before JAX starts
    # After the checks of --out: no process wrote yet. Giving up on the others releases
    # the lock (and the directory it made) first: that exit skips every `with` block.
    setup.start_processes(args, processes, on_give_up=held.close)
    if processes is not None and processes.process_id is None and distributed.is_primary():
        setup.lock_run(plan.out, held)
    if args.resume and not plan.saved_run.has_checkpoint():
        raise UsageError(f"cannot resume: no checkpoint in {plan.out}/checkpoints")  # (Orbax: JAX)
    return cpu_tuning


def run_mesh(args, plan: RunPlan):
    """The device mesh (--mesh, or the saved run's), checked against --batch: the
    devices known, before --init loads."""
    from jaxformer.parallel.partitioning import make_mesh  # noqa: PLC0415
    from jaxformer.parallel.sharding import check_divisible  # noqa: PLC0415

    try:
        mesh = make_mesh(setup.resume_mesh_spec(
            args, plan.saved_run.saved.get("mesh") if args.resume else None))
    except ValueError as error:
        raise UsageError(f"--mesh {args.mesh}: {error}") from error
    try:
        check_divisible(plan.train_config.batch_size, mesh, name="--batch")
    except ValueError as error:
        raise UsageError(str(error)) from error
    return mesh


def run_model(args, plan: RunPlan, cpu_tuning: bool):
    """(model config, --init's parameters or None, its tokenizer or None)."""
    init_params = pretrained_tokenizer = None
    model_config = plan.model_config
    if model_config is None:  # --init: the checkpoint's model, weights and tokenizer
        model_config, init_params, pretrained_tokenizer = setup.load_init(
            args, plan.model_overrides, plan.tokenizer_path)
    return model_config.replace(cpu_tuning=cpu_tuning), init_params, pretrained_tokenizer


def training_inputs(args, plan: RunPlan, model_config, mesh, pretrained_tokenizer):
    """(task, model, text data or None), everything checkable before compiling: data and
    task against the model, the mesh against the parameters (UsageError)."""
    from jaxformer.train.task import training_task  # noqa: PLC0415

    train_config = plan.train_config
    try:
        task = training_task(model_config, train_config)
        model = task.model_class(model_config)
        setup.check_mesh_fits(model, mesh)
        data = None
        if task.device_batch is None:  # host-fed: the text of --data
            data = setup.text_data(train_config, setup.lm_run_tokenizer(
                plan.out, model_config, train_config,
                plan.saved_run.saved if args.resume else {}, pretrained_tokenizer))
            task = training_task(model_config, train_config, data)
        task.check(model_config)
    except ValueError as error:
        raise UsageError(str(error)) from error
    return task, model, data


def remove_unstarted_run(out: str) -> None:
    """What a new run wrote in `out` (config, tokenizer, metrics), if it has no finished
    checkpoint: it cannot be resumed, and would refuse the same command again. The lock
    stays for its release (which removes the directory it made)."""
    import shutil  # noqa: PLC0415

    from jaxformer.train.run import CHECKPOINTS  # noqa: PLC0415
    from jaxformer.train.run_lock import LOCK_NAME  # noqa: PLC0415

    checkpoints = os.path.join(out, CHECKPOINTS)
    if os.path.isdir(checkpoints) and any(name.isdigit() for name in os.listdir(checkpoints)):
        return  # a step to resume from (Orbax names a finished step by its number)
    for name in os.listdir(out):
        path = os.path.join(out, name)
        if name == LOCK_NAME:
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


def create_run_dir(args, plan: RunPlan, model_config, mesh, pretrained_tokenizer) -> None:
    """A new run's directory; a fine-tuning run stands alone: its copies of --init's
    tokenizer and chat template."""
    import jax  # noqa: PLC0415

    from jaxformer.parallel.partitioning import mesh_spec_string  # noqa: PLC0415
    from jaxformer.train.run import Run  # noqa: PLC0415

    Run.create(plan.out, model_config, plan.train_config, init=args.init,
               init_tokenizer=pretrained_tokenizer,
               chat_template=None if args.init is None else source_chat_template(args.init),
               preset=None if args.init else plan.preset, mesh=mesh_spec_string(mesh),
               processes=jax.process_count())


def model_description(args, plan: RunPlan):
    """The preset's name, or what the run fine-tunes."""
    if args.resume and plan.saved_run.init:
        return f"fine-tuned {plan.saved_run.init['path']}"
    if args.init is not None:
        return f"fine-tuned {args.init}"
    return plan.preset


def announce(plan: RunPlan, model_config, mesh, description) -> None:
    """The run's first lines: task, model, mesh, processes, directory, CPU tuning."""
    from jaxformer.parallel import distributed  # noqa: PLC0415
    from jaxformer.parallel.partitioning import mesh_spec_string  # noqa: PLC0415

    print(f"jaxformer train: {plan.train_config.task} task, {description} model "
          f"({model_config.norm}-LN, {model_config.dtype}), mesh "
          f"{mesh_spec_string(mesh)}, {distributed.describe()}, run dir {plan.out}",
          flush=True)
    if model_config.cpu_tuning:
        print("jaxformer train: CPU tuning on (jaxformer.backends.cpu; same results up to "
              "rounding; --no-cpu-tuning turns it off)", flush=True)


def fit_run(args, plan: RunPlan, model_config, mesh, task, init_params):
    """`train.fit` on the run directory; a damaged checkpoint is a UsageError (one that
    cannot be written, a full disk, is not: `_train` reports it)."""
    from jaxformer.train.checkpoint import CheckpointError, CheckpointWriteError  # noqa: PLC0415
    from jaxformer.train.loop import fit  # noqa: PLC0415
    from jaxformer.train.run import CHECKPOINTS  # noqa: PLC0415

    try:
        return fit(model_config, plan.train_config,
                   checkpoint_dir=os.path.join(plan.out, CHECKPOINTS), resume=args.resume,
                   save_every=args.save_every, log_every=args.log_every,
                   progress=not args.no_progress,
                   metrics_file=os.path.join(plan.out, "metrics.jsonl"), mesh=mesh, task=task,
                   eval_every=args.eval_every, fallback=args.fallback,
                   init_params=init_params, donate_init_params=True)
    except CheckpointWriteError:
        raise
    except CheckpointError as error:
        raise UsageError(str(error)) from error


def report(args, plan: RunPlan, model_config, mesh, task, model, data, result, params,
           started: float) -> None:
    """Process 0's end of the run on its own devices: evaluation, figures, summary
    (`params`: the trained parameters' host copy)."""
    import jax  # noqa: PLC0415

    from jaxformer.parallel.partitioning import make_mesh  # noqa: PLC0415

    local_mesh = mesh
    if jax.process_count() > 1:
        local_mesh = make_mesh(devices=jax.local_devices())
    if data is not None:
        summary = train_report.finish_lm(args, model, params, local_mesh, result, data,
                                         plan.train_config, plan.out)
    else:
        summary = train_report.finish_seq2seq(args, model, params, local_mesh, task,
                                              plan.train_config, model_config, plan.out)
    train_report.write_summary(plan.out, summary, result, params, started)

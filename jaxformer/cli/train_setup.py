"""What `jaxformer train` does before it trains: its flags turned into configs and
checked (one UsageError each, before anything is written or loaded), the resume
rules against the saved run (`jaxformer.train.run.Run.resume_conflicts`), the run
directory's lock, the processes joined, `--init`'s checkpoint loaded."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Optional

from jaxformer.cli.usage import UsageError

# Flags that shape the model / the trajectory: on --resume they must agree with
# the run's config.json. flag -> TransformerConfig field(s) / TrainConfig field.
MODEL_FLAGS = {"d_model": ("d_model",), "heads": ("num_heads",), "d_ff": ("d_ff",),
                "layers": ("num_encoder_layers", "num_decoder_layers"), "norm": ("norm",),
                "dtype": ("dtype",), "vocab": ("src_vocab_size", "tgt_vocab_size"),
                "dropout": ("attention_dropout", "residual_dropout", "embedding_dropout",
                            "ffn_dropout"),
                "scan_layers": ("scan_layers",), "remat": ("remat",),
                "precision": ("precision",), "attention_impl": ("attention_impl",),
                "lora": ("lora_rank",), "lora_alpha": ("lora_alpha",),
                "lora_targets": ("lora_targets",)}
# What --init takes from the checkpoint: these flags would contradict it.
SHAPE_FLAGS = ("preset", "d_model", "heads", "d_ff", "layers", "norm", "vocab")
TRAIN_FLAGS = {"task": "task", "min_len": "min_len", "max_len": "max_len", "steps": "steps",
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

    fields = MODEL_FLAGS[flag]
    decoder_only = task is not None and trains_language_model(task)
    return ("num_decoder_layers",) if decoder_only and flag == "layers" else fields


PROCESS_FLAGS = {"coordinator": "--coordinator", "num_processes": "--num-processes",
                  "process_id": "--process-id"}


def configs_from_args(args):
    """(preset's config builder, model overrides, TrainConfig, train overrides, preset
    name) from the flags given explicitly."""
    from jaxformer.config import PRESETS  # noqa: PLC0415
    from jaxformer.train.task import task_type  # noqa: PLC0415
    from jaxformer.train.train_config import TrainConfig  # noqa: PLC0415

    model_overrides = {}
    for flag in MODEL_FLAGS:
        value = getattr(args, flag)
        if value is not None:
            model_overrides.update({field: value for field in _model_fields(flag, args.task)})
    train_overrides = {field: _flag_value(args, flag) for flag, field in TRAIN_FLAGS.items()
                       if getattr(args, flag) is not None}
    if "steps" in train_overrides and "warmup_steps" not in train_overrides:
        # Short runs keep a proportionate warmup instead of failing validation.
        train_overrides["warmup_steps"] = min(TrainConfig.warmup_steps,
                                              train_overrides["steps"] // 8)
    preset = args.preset or task_type(args.task or TrainConfig.task).default_preset
    return PRESETS[preset], model_overrides, TrainConfig, train_overrides, preset


def lock_run(out: str, held: contextlib.ExitStack) -> None:
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


def process_settings(args):
    """`distributed.Settings` of --coordinator/--num-processes/--process-id (or the
    environment; None: one process), checked before anything starts."""
    from jaxformer.parallel import distributed  # noqa: PLC0415

    try:
        return distributed.settings(args.coordinator, args.num_processes, args.process_id,
                                    names=PROCESS_FLAGS)
    except ValueError as error:
        raise UsageError(str(error)) from error


def check_mesh_fits(model, mesh) -> None:
    """ValueError, before anything is written, if a parameter dimension does not split
    over its mesh axes (abstract shapes only: nothing is computed)."""
    import jax  # noqa: PLC0415

    from jaxformer.parallel.partitioning import example_inputs, param_shardings  # noqa: PLC0415

    inputs = example_inputs(model)
    abstract = jax.eval_shape(model.init, jax.random.PRNGKey(0), *inputs)["params"]
    param_shardings(model, abstract, mesh, *inputs)




def start_processes(args, processes, on_give_up=None) -> None:
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


def lm_model_overrides(model_overrides: dict, train_overrides: dict) -> dict:
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


def check_init_flags(args) -> None:
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
    shape = [f"--{f.replace('_', '-')}" for f in SHAPE_FLAGS if getattr(args, f) is not None]
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


def check_text_files(args) -> None:
    """--data and --eval-data name readable files (read later, after JAX starts and
    --init loads)."""
    from jaxformer.train.data import document_paths  # noqa: PLC0415

    for flag in ("data", "eval_data"):
        if getattr(args, flag):
            try:
                document_paths(getattr(args, flag))
            except ValueError as error:
                raise UsageError(f"--{flag.replace('_', '-')}: {error}") from error


def load_init(args, model_overrides: dict, tokenizer_path: Optional[str]):
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


def resume_conflicts(args, run) -> list[str]:
    """The flags given that differ from what `run` (a `jaxformer.train.run.Run`)
    saved, as "--flag value (saved: value)"; --resume refuses them."""
    model = {field: getattr(args, flag) for flag in MODEL_FLAGS
             for field in _model_fields(flag, run.train_config.task)}
    train = {field: _flag_value(args, flag) for flag, field in TRAIN_FLAGS.items()}
    differ = {(c.section, c.field): c for c in run.resume_conflicts(
        preset=args.preset, init=args.init, model=model, train=train)}
    conflicts = [f"--preset {args.preset} (saved: {differ['run', 'preset'].saved})"
                 ] if ("run", "preset") in differ else []
    for flag in MODEL_FLAGS:
        fields = _model_fields(flag, run.train_config.task)
        if any(("model", f) in differ for f in fields):
            conflicts.append(f"--{flag.replace('_', '-')} {getattr(args, flag)} (saved: "
                             f"{getattr(run.model_config, fields[0])})")
    conflicts += [f"--{flag.replace('_', '-')} {differ['train', field].given} (saved: "
                  f"{differ['train', field].saved})"
                  for flag, field in TRAIN_FLAGS.items() if ("train", field) in differ]
    if ("run", "init") in differ:
        conflicts.append(f"--init {args.init} (saved: {differ['run', 'init'].saved})")
    if args.quantize not in (None, "keep", run.model_config.weight_quant):
        conflicts.append(f"--quantize {args.quantize} (saved: "
                         f"{run.model_config.weight_quant or 'float'})")
    return conflicts


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


def lm_run_tokenizer(out, model_config, train_config, saved: dict, pretrained=None):
    """The tokenizer an LM run trains with: --init's (wrapped with the model's ids), else
    the run's (`Run.tokenizer`: a resumed fine-tuning run's copy in `out`, or the train
    config's)."""
    from jaxformer.cli.runs import run_tokenizer  # noqa: PLC0415
    from jaxformer.text import JSONTokenizer  # noqa: PLC0415
    from jaxformer.train.run import Run  # noqa: PLC0415

    if pretrained is not None:
        c = model_config
        return JSONTokenizer.wrap(pretrained, pad_id=c.pad_id, bos_id=c.bos_id,
                                  eos_id=c.eos_id, vocab_size=c.tgt_vocab_size,
                                  name="the --init tokenizer")
    return run_tokenizer(Run(out, model_config, train_config, saved))


def text_data(train_config, tokenizer=None):
    """The `TextData` of an LM run: files read, tokenized, split and packed (may raise
    ValueError naming a file). `tokenizer`: default the train config's."""
    from jaxformer.text import training_tokenizer  # noqa: PLC0415
    from jaxformer.train.data import TextData  # noqa: PLC0415

    tc = train_config
    tokenizer = training_tokenizer(tc.tokenizer) if tokenizer is None else tokenizer
    return TextData(tc.data, tokenizer, tc.seq_len,
                    eval_patterns=tc.eval_data or None, eval_fraction=tc.eval_fraction,
                    seed=tc.seed)

"""The training loop: `fit`, and the jitted pieces of a run it builds once (`TrainFunctions`).

Determinism: a run is a pure function of the seed. The parameters are
initialised from `fold_in(PRNGKey(seed), 0)`, the batch of step s is drawn
from `fold_in(fold_in(PRNGKey(seed), 1), s)` and the dropout key of step s is
`fold_in(state.rng, s)`, all with JAX's default PRNG implementation (the
user's `jax_default_prng_impl`). Nothing depends on how many steps ran before
in this process, so a run resumed from a checkpoint replays the uninterrupted
run bit for bit (on the same machine and device count). With JAX's default
threefry (partitionable), the bits of each dropout element are a function of
the key and the element's global index, so several devices train to the
losses of one. The train step is jitted with the state's in/out shardings and
donates the state; the batch is split over "data" x "fsdp".
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
import signal
import sys
import threading
import time
from typing import Any, Callable, Optional

import jax

from jaxformer.config import TransformerConfig
from jaxformer.nn.precision import check_backend as check_precision_backend
from jaxformer.parallel.partitioning import make_mesh
from jaxformer.parallel.sharding import check_divisible, data_sharding
from jaxformer.train.data import TextData
from jaxformer.train.optimizer import learning_rate_schedule, make_optimizer
from jaxformer.train.state import TrainState, make_init, make_init_from, train_state_shardings
from jaxformer.train.step import compile_train_step, make_train_step
from jaxformer.train.task import TrainingTask, training_task
from jaxformer.train.tasks import Batch
from jaxformer.train.train_config import TrainConfig


# --------------------------------------------------------------------------- the loop


class TrainFunctions:
    """The jitted pieces of a run, built once per (model config, train config, mesh).

    `train_functions` caches these bundles, so runs that differ only in their
    seed (or a resumed run in the same process) reuse the compiled code.

      init(seed) -> TrainState             created in `shardings` (jitted, out_shardings)
      init_from(seed, init_params, donate=False) -> TrainState   the same from given
                                                   parameters (donate: take their buffers)
      shardings: TrainState                 of NamedShardings (`train_state_shardings`)
      task: TrainingTask                    what the run trains on (`training_task`, no data)
      model                                 task.model_class(model_config)
      batch(seed, step) -> Batch           the training batch of `step`, split over "data"
                                           (device-drawn tasks; None if host-fed)
      step(state, batch) -> (state, metrics)   jitted, donates `state`
      compiled_step(state, batch) -> (compiled step, seconds compiling)   compiled once
      abstract_state() -> TrainState       of ShapeDtypeStructs (restore targets)
    """

    def __init__(self, model_config: TransformerConfig, train_config: TrainConfig, mesh,
                 task: Optional[TrainingTask] = None):
        tc = train_config
        self.mesh = mesh
        self.tx = make_optimizer(tc)
        self.schedule = learning_rate_schedule(tc)
        self.task = task = training_task(model_config, tc) if task is None else task
        task.check_model(model_config)
        self.model = task.model_class(model_config)
        input_shapes = task.input_shapes()
        self.batch = (None if task.device_batch is None else
                      jax.jit(task.device_batch, out_shardings=data_sharding(mesh)))
        self.shardings = train_state_shardings(self.model, self.tx, input_shapes, mesh)
        self.init = make_init(self.model, self.tx, input_shapes, mesh, self.shardings)
        self.init_from = make_init_from(self.model, self.tx, input_shapes, mesh,
                                        self.shardings)
        self.step = make_train_step(self.model, self.tx, label_smoothing=tc.label_smoothing,
                                    schedule=self.schedule, mesh=mesh,
                                    shardings=self.shardings,
                                    loss_chunk_tokens=tc.loss_chunk_tokens)
        self._compiled = None

    def abstract_state(self) -> TrainState:
        """The state's shapes, dtypes and shardings (`jax.ShapeDtypeStruct`s): the target
        to restore a checkpoint into without initialising anything."""
        return jax.eval_shape(self.init, 0)

    def compiled_step(self, state: TrainState, batch: Batch):
        """(the compiled train step, seconds spent compiling now: 0.0 when already compiled);
        compiled by `step.compile_train_step` (its temporaries in small heaps)."""
        if self._compiled is not None:
            return self._compiled, 0.0
        start = time.perf_counter()
        self._compiled = compile_train_step(self.step, state, batch)
        return self._compiled, time.perf_counter() - start


@functools.lru_cache(maxsize=8)
def _train_functions(model_config, train_config, mesh, task) -> TrainFunctions:
    return TrainFunctions(model_config, train_config, mesh, task)


def train_functions(model_config: TransformerConfig, train_config: TrainConfig,
                    mesh=None, task: Optional[TrainingTask] = None) -> TrainFunctions:
    """The (cached) `TrainFunctions` of a run; the seed is an argument, not part of the key.

    `task`: a `TrainingTask` of one's own, part of the cache key (default: the one
    `train_config.task` names, without data: only its model class, input shapes and
    device batches matter here, so every run of a config shares the compiled step).
    """
    quantized = model_config.weight_quant or model_config.quant_format("embed")
    if quantized and not model_config.lora_rank:
        raise ValueError("TransformerConfig.weight_quant: quantized kernels are frozen integers "
                         "and cannot be trained; train LoRA adapters on them (QLoRA: "
                         "lora_rank > 0) or the float model "
                         "(jaxformer.nn.quant_params.dequantize_params)")
    mesh = make_mesh() if mesh is None else mesh
    check_divisible(train_config.batch_size, mesh)
    check_precision_backend(model_config, mesh.devices.flat)
    return _train_functions(model_config, train_config.replace(seed=0), mesh, task)


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN or infinite; `step` names the first such step."""

    def __init__(self, step: int, value: float, last_checkpoint: Optional[int]):
        self.step = step
        kept = ("no checkpoint was written" if last_checkpoint is None else
                f"the last good checkpoint (step {last_checkpoint}) is kept")
        super().__init__(f"loss is {value} at step {step}: stopping; {kept}")


@dataclasses.dataclass
class FitResult:
    """What `fit` returns. `history` has one dict per step run in this call;
    `evals` the held-out records (tasks with a held-out set: "lm"); `train_s` the seconds spent in
    train steps (no compile, no evaluation)."""

    state: TrainState
    history: list
    start_step: int
    interrupted: bool
    compile_s: float
    wall_s: float
    task: TrainingTask
    mesh: Any
    train_s: float = 0.0
    evals: list = dataclasses.field(default_factory=list)


def fit(model_config: TransformerConfig, train_config: TrainConfig, *,
        checkpoint_dir: Optional[str] = None, resume: bool = False, save_every: int = 500,
        log_every: int = 25, progress: bool = True, metrics_file: Optional[str] = None,
        on_step: Optional[Callable[[int], None]] = None, mesh=None,
        data: Optional[TextData] = None, eval_every: int = 0,
        fallback: bool = False, init_params: Any = None, donate_init_params: bool = False,
        task: Optional[TrainingTask] = None) -> FitResult:
    """Train `task.model_class(model_config)` on `task`: by default the task that
    `train_config.task` names (`training_task`): a synthetic seq2seq task, or, for
    "lm", the decoder-only LM on the text of `data`.

    Args:
      task: what to train on (a `jaxformer.train.task.TrainingTask`); default
        `training_task(model_config, train_config, data)`.
      data: the `jaxformer.train.data.TextData` of task "lm" (built from
        `train_config.data`); step s trains on its batch s, so resuming
        continues the data stream exactly.
      eval_every: tasks with a held-out set ("lm": loss and bits per byte):
        evaluated every this many steps and at the end (0: only at the end),
        in `evals` and `metrics_file`.
      checkpoint_dir: where Orbax checkpoints go (every `save_every` steps, at
        the end and on Ctrl-C). None: no checkpoints.
      resume: restore the latest checkpoint of `checkpoint_dir` and continue
        to `train_config.steps`; the result equals the uninterrupted run's.
        A missing or unreadable checkpoint raises `CheckpointError`; a damaged
        latest one names the newest step that restores, and `fallback=True`
        continues from that step. Temporary directories of saves killed
        midway are removed first.
      log_every: steps between host syncs: the progress bar, `metrics_file`
        (one JSON line per step, appended) and the non-finite check.
      mesh: may span several processes (`jaxformer.parallel.distributed`): every process
        calls `fit` alike and feeds its own devices' rows of each batch; they
        write one checkpoint together (Orbax); only process 0 shows the bar
        and writes `metrics_file`.
      on_step: called with the step count after every step (tests use it).
      init_params: start from these parameters (a pretrained model's:
        `jaxformer.models.load`) instead of random ones; any layer layout;
        with `model_config.lora_rank > 0` they are the frozen base (which may be
        quantized: QLoRA) and only the adapters (initialised from the seed) train. Ignored on `resume` (the
        checkpoint holds every parameter).
      donate_init_params: the train state takes `init_params`' buffers (the arrays
        passed are deleted), so the weights are not held twice: for parameters
        loaded only to start from (the command line does this).
    Ctrl-C (SIGINT) finishes the current step, saves, and returns with
    `interrupted=True`; a second Ctrl-C aborts at once. A non-finite loss
    raises `NonFiniteLossError` naming the step, without saving; a checkpoint that
    cannot be written (a full disk) `CheckpointWriteError`, the earlier ones kept.
    """
    from tqdm.auto import tqdm  # noqa: PLC0415 (only the loop needs it)

    from jaxformer.train.checkpoint import Checkpoints  # noqa: PLC0415

    started = time.perf_counter()
    tc = train_config
    for name, value, low in (("save_every", save_every, 1), ("log_every", log_every, 1),
                             ("eval_every", eval_every, 0)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if resume and checkpoint_dir is None:
        raise ValueError("resume=True needs checkpoint_dir")
    mesh = make_mesh() if mesh is None else mesh
    own_task = task
    task = training_task(model_config, tc, data) if task is None else task
    task.check(model_config)
    fns = train_functions(model_config, tc, mesh, own_task)  # checks the batch against the mesh
    if task.device_batch is None:
        def next_batch(step):  # this process's rows of the global batch of `step`
            return jax.tree_util.tree_map(
                lambda x: jax.make_array_from_process_local_data(data_sharding(mesh), x),
                task.host_batch(step))
    else:
        def next_batch(step):
            return fns.batch(tc.seed, step)
    checkpoints = (Checkpoints(checkpoint_dir, create=not resume)
                   if checkpoint_dir is not None else None)
    if checkpoints is not None and jax.process_index() == 0:
        for path in checkpoints.remove_unfinished_saves():
            print(f"jaxformer: removed {path}, the unfinished save of a killed run",
                  file=sys.stderr)
    state = (fns.init(tc.seed) if resume or init_params is None else
             fns.init_from(tc.seed, init_params, donate=donate_init_params))
    if resume:
        try:
            state = checkpoints.restore(state, fallback=fallback)
        except Exception:
            checkpoints.close()
            raise
    start_step = int(state.step)
    if start_step > tc.steps:
        checkpoints.close()
        raise ValueError(f"the checkpoint is at step {start_step}, beyond steps={tc.steps}")
    primary = jax.process_index() == 0  # several processes: one bar, one metrics file
    if progress and primary:  # compiling takes seconds to minutes before the bar moves
        print(f"jaxformer: compiling the train step on {mesh.devices.size} device(s)...",
              file=sys.stderr, flush=True)
    train_step, compile_s = fns.compiled_step(state, next_batch(start_step))

    stop = _StopFlag()
    history, pending = [], []
    bar = tqdm(total=tc.steps, initial=start_step, disable=not (progress and primary),
               dynamic_ncols=True, desc=f"{task.name} {model_config.norm}-LN", unit="step")
    metrics_out = open(metrics_file, "a") if metrics_file and primary else None  # noqa: SIM115

    def flush():
        """Sync: check losses, log them, advance the bar."""
        if not pending:
            return
        for step, metrics in jax.device_get(pending):
            record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
            if not math.isfinite(record["loss"]):
                raise NonFiniteLossError(step, record["loss"],
                                         checkpoints.latest_step() if checkpoints else None)
            history.append(record)
            if metrics_out:
                metrics_out.write(json.dumps(record) + "\n")
        if metrics_out:
            metrics_out.flush()
        bar.update(len(pending))
        bar.set_postfix(loss=f"{history[-1]['loss']:.4f}",
                        acc=f"{history[-1]['token_accuracy']:.3f}")
        pending.clear()

    def save(step):
        if checkpoints is not None:
            checkpoints.save(step, state)

    evals, eval_s = [], 0.0

    def held_out(step):
        """Held-out metrics of the current parameters (if the task has a held-out set),
        logged as a record."""
        nonlocal eval_s
        begin = time.perf_counter()
        metrics = task.held_out(fns.model, state.params, mesh, progress and primary)
        if metrics is None:
            return
        record = {"step": step, **{f"eval_{k}": v for k, v in metrics.items()}}
        evals.append(record)
        if metrics_out:
            metrics_out.write(json.dumps(record) + "\n")
            metrics_out.flush()
        eval_s += time.perf_counter() - begin

    step = start_step
    loop_started = time.perf_counter()
    try:
        with stop.catch_sigint():
            while step < tc.steps and not stop.requested:
                state, metrics = train_step(state, next_batch(step))
                step += 1
                pending.append((step, metrics))
                if on_step is not None:
                    on_step(step)
                if step % log_every == 0 or step % save_every == 0 or stop.requested:
                    flush()
                if step % save_every == 0:
                    save(step)
                if eval_every and step % eval_every == 0 and step < tc.steps:
                    held_out(step)
            flush()
            save(step)  # the final state (or where Ctrl-C stopped us)
            train_s = time.perf_counter() - loop_started - eval_s
            if step == tc.steps and step > start_step:
                held_out(step)
    finally:
        bar.close()
        if metrics_out:
            metrics_out.close()
        if checkpoints is not None:
            checkpoints.close()
    return FitResult(state=state, history=history, start_step=start_step,
                     interrupted=stop.requested and step < tc.steps, compile_s=compile_s,
                     wall_s=time.perf_counter() - started, task=task, mesh=mesh,
                     train_s=train_s, evals=evals)


class _StopFlag:
    """Turns the first Ctrl-C into a request to stop after the current step."""

    def __init__(self):
        self.requested = False

    def _handle(self, signum, frame):
        self.requested = True
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C aborts

    def catch_sigint(self):
        flag = self

        class _Context:
            def __enter__(self):
                self.installed = threading.current_thread() is threading.main_thread()
                if self.installed:
                    self.previous = signal.signal(signal.SIGINT, flag._handle)

            def __exit__(self, *exc):
                if self.installed:
                    signal.signal(signal.SIGINT, self.previous)

        return _Context()

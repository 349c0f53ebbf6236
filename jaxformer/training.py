"""Training on optax: loss and metrics, the optimizer, an explicit train state, jitted steps.

Pieces, each usable on its own::

    loss_and_metrics(logits_BTV, labels_BT, pad_id)  cross-entropy ignoring PAD
    make_optimizer(tc)                               AdamW + warmup/cosine + clipping
    create_train_state(model, tx, seed, ...)         TrainState(step, params, opt_state, rng)
    make_train_step(model, tx, ...)                  jitted, donates the state
    make_eval_step(model, ...), evaluate(...)        teacher-forced metrics + greedy exact match
    fit(model_config, train_config, ...)             the loop: data, mesh, checkpoints, progress

Determinism: a run is a pure function of the seed. The parameters are
initialised from `fold_in(PRNGKey(seed), 0)`, the batch of step s is drawn
from `fold_in(fold_in(PRNGKey(seed), 1), s)` and the dropout key of step s is
`fold_in(state.rng, s)`. Nothing depends on how many steps ran before in this
process, so a run resumed from a checkpoint replays the uninterrupted run
bit for bit (on the same machine and device count).

Dropout on several devices: the random bits of a step do not depend on how
the batch is split. JAX's threefry keys are "partitionable"
(`jax_threefry_partitionable`, on by default since JAX 0.5): each element's
bits are a function of the key and the element's global index, so every
device draws its own slice of the mask the one-device run draws. 4 devices
train to the losses of 1 device with dropout on (tests/test_training.py);
with the flag off they do not, so a multi-device run refuses it.

Warmup: Post-LN (the paper's x = LN(x + f(x)), `norm="post"`) needs the
linear learning-rate warmup: without it the first large Adam updates put the
un-normalised residual path out of range and training stalls or diverges.
Pre-LN is more forgiving; the same warmup costs it little.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import signal
import threading
import time
from typing import Any, Callable, Optional

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxformer import checks
from jaxformer.config import ConfigMixin, TransformerConfig
from jaxformer.decoding import greedy_decode
from jaxformer.model import Transformer
from jaxformer.sharding import (check_divisible, data_sharding, make_mesh, replicate,
                                replicated, shard_batch)
from jaxformer.tasks import Batch, Task, make_task


@dataclasses.dataclass(frozen=True)
class TrainConfig(ConfigMixin):
    """Everything about a training run that is not the architecture.

    Defaults are those of `jaxformer train` (copy task on the `copy_task`
    model preset), tuned to reach exact match >= 0.99 in a few CPU minutes.
    """

    task: str = "copy"
    min_len: int = 1
    max_len: int = 10          # source lengths are drawn per example in [min_len, max_len]
    steps: int = 800
    batch_size: int = 64
    learning_rate: float = 1e-3   # peak, after warmup
    warmup_steps: int = 100       # linear from 0; Post-LN needs it (module docstring)
    end_lr_fraction: float = 0.05  # cosine decay to this fraction of the peak
    weight_decay: float = 0.01    # matrices only, see `decay_mask`
    clip_norm: float = 1.0        # global gradient norm
    b1: float = 0.9
    b2: float = 0.98
    label_smoothing: float = 0.0
    seed: int = 0

    def __post_init__(self):
        for name in ("steps", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"TrainConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.warmup_steps, int) or not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"TrainConfig.warmup_steps must be an int in [0, steps={self.steps})"
                             f", got {self.warmup_steps!r}")
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise ValueError(f"TrainConfig.learning_rate must be positive, got "
                             f"{self.learning_rate!r}")
        for name, high in (("weight_decay", 1.0), ("label_smoothing", 1.0),
                           ("end_lr_fraction", 1.0 + 1e-12)):  # end_lr_fraction may be 1
            if not 0.0 <= getattr(self, name) < high:
                raise ValueError(f"TrainConfig.{name} must be in [0, 1), got "
                                 f"{getattr(self, name)!r}")
        if not self.clip_norm > 0:
            raise ValueError(f"TrainConfig.clip_norm must be positive, got {self.clip_norm!r}")
        make_task(self.task, min_len=self.min_len, max_len=self.max_len)  # validates


@flax.struct.dataclass
class TrainState:
    """The whole state of a run, an explicit pytree (what a checkpoint holds).

    step: int32 scalar, optimizer steps taken. params: the model's parameter
    pytree. opt_state: optax state. rng: base dropout key (raw uint32 key);
    step s uses `fold_in(rng, s)`, so the key never has to be split in place.
    """

    step: jnp.ndarray
    params: Any
    opt_state: Any
    rng: jnp.ndarray


# --------------------------------------------------------------------------- task <-> model


def task_for(model_config: TransformerConfig, train_config: TrainConfig) -> Task:
    """The `Task` of a run, checked against the model before anything compiles."""
    c = model_config
    if c.src_vocab_size != c.tgt_vocab_size:
        raise ValueError(f"the synthetic tasks need src_vocab_size == tgt_vocab_size, got "
                         f"{c.src_vocab_size} and {c.tgt_vocab_size}")
    task = make_task(train_config.task, vocab_size=c.src_vocab_size,
                     min_len=train_config.min_len, max_len=train_config.max_len,
                     pad_id=c.pad_id, bos_id=c.bos_id, eos_id=c.eos_id)
    if task.tgt_len > c.max_len:
        raise ValueError(f"max_len={train_config.max_len} needs targets of length "
                         f"{task.tgt_len} (BOS/EOS + sequence), longer than the model's "
                         f"max_len={c.max_len}")
    return task


# --------------------------------------------------------------------------- loss


def loss_and_metrics(logits_BTV: jnp.ndarray, labels_BT: jnp.ndarray, pad_id: int = 0,
                     label_smoothing: float = 0.0) -> tuple[jnp.ndarray, dict]:
    """Mean token cross-entropy over non-PAD labels, and metrics.

    Returns (loss, {"loss", "token_accuracy", "tokens"}). PAD labels get
    weight 0 (so a PAD label's value changes nothing); the mean is over the
    non-PAD tokens of the whole (global) batch. With `label_smoothing` a the
    target is (1 - a) one_hot + a / V.
    """
    logits_BTV = logits_BTV.astype(jnp.float32)
    weights_BT = (labels_BT != pad_id).astype(jnp.float32)
    if label_smoothing > 0.0:
        targets_BTV = optax.smooth_labels(
            jax.nn.one_hot(labels_BT, logits_BTV.shape[-1]), label_smoothing)
        xent_BT = optax.softmax_cross_entropy(logits_BTV, targets_BTV)
    else:
        xent_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, labels_BT)
    tokens = weights_BT.sum()
    denominator = jnp.maximum(tokens, 1.0)  # an all-PAD batch has loss 0, not NaN
    loss = (xent_BT * weights_BT).sum() / denominator
    correct = ((logits_BTV.argmax(-1) == labels_BT) * weights_BT).sum()
    return loss, {"loss": loss, "token_accuracy": correct / denominator, "tokens": tokens}


# --------------------------------------------------------------------------- optimizer


def learning_rate_schedule(tc: TrainConfig) -> optax.Schedule:
    """Linear warmup 0 -> peak over `warmup_steps`, then cosine decay to end_lr_fraction*peak."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=tc.learning_rate, warmup_steps=tc.warmup_steps,
        decay_steps=tc.steps, end_value=tc.learning_rate * tc.end_lr_fraction)


def decay_mask(params) -> Any:
    """True for matrices (ndim >= 2: kernels, embeddings); biases and LayerNorm are not decayed."""
    return jax.tree_util.tree_map(lambda p: p.ndim >= 2, params)


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """The one optimizer: clip the global gradient norm, then AdamW on the schedule."""
    return optax.chain(
        optax.clip_by_global_norm(tc.clip_norm),
        optax.adamw(learning_rate_schedule(tc), b1=tc.b1, b2=tc.b2, eps=1e-9,
                    weight_decay=tc.weight_decay, mask=decay_mask))


# --------------------------------------------------------------------------- state and steps


def _init_state(model: Transformer, tx: optax.GradientTransformation, src_len: int,
                tgt_len: int, seed) -> TrainState:
    """Traceable init; `seed` may be traced, so one compilation serves every seed."""
    root = jax.random.PRNGKey(seed)
    src = jnp.zeros((1, src_len), jnp.int32)
    tgt = jnp.zeros((1, tgt_len), jnp.int32)
    params = model.init(jax.random.fold_in(root, 0), src, tgt)["params"]
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=tx.init(params), rng=jax.random.fold_in(root, 2))


def create_train_state(model: Transformer, tx: optax.GradientTransformation, seed: int,
                       src_len: int, tgt_len: int, mesh=None) -> TrainState:
    """Initialise parameters and optimizer state, replicated over `mesh` (default: all devices)."""
    mesh = make_mesh() if mesh is None else mesh
    init = jax.jit(functools.partial(_init_state, model, tx, src_len, tgt_len),
                   out_shardings=replicated(mesh))
    return init(seed)


def make_train_step(model: Transformer, tx: optax.GradientTransformation, *,
                    label_smoothing: float = 0.0,
                    schedule: Optional[optax.Schedule] = None) -> Callable:
    """jit(train_step)(state, batch) -> (new_state, metrics); the input state is donated.

    Dropout is on (deterministic=False) with key fold_in(state.rng, state.step).
    metrics: loss, token_accuracy, tokens, grad_norm (before clipping), and
    learning_rate if `schedule` is given.
    """
    pad_id = model.config.pad_id

    def train_step(state: TrainState, batch: Batch):
        dropout_key = jax.random.fold_in(state.rng, state.step)

        def loss_fn(params):
            logits_BTV = model.apply({"params": params}, batch.src, batch.tgt_in,
                                     deterministic=False, rngs={"dropout": dropout_key})
            return loss_and_metrics(logits_BTV, batch.labels, pad_id, label_smoothing)

        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = dict(metrics, grad_norm=optax.tree.norm(grads))
        if schedule is not None:
            metrics["learning_rate"] = schedule(state.step)
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return jax.jit(train_step, donate_argnums=0)


@functools.lru_cache(maxsize=16)  # one compilation per model config, not per call
def make_eval_step(model: Transformer) -> Callable:
    """jit(eval_step)(params, batch) -> sums {loss_sum, correct, tokens} (teacher forcing).

    Sums, not means, so that chunks of a large evaluation set add up exactly.
    """
    pad_id = model.config.pad_id

    def eval_step(params, batch: Batch):
        logits_BTV = model.apply({"params": params}, batch.src, batch.tgt_in)
        loss, metrics = loss_and_metrics(logits_BTV, batch.labels, pad_id)
        return {"loss_sum": loss * metrics["tokens"],
                "correct": metrics["token_accuracy"] * metrics["tokens"],
                "tokens": metrics["tokens"]}

    return jax.jit(eval_step)


def check_batch(config: TransformerConfig, batch: Batch) -> None:
    """Host check of a (concrete) batch: ranks, one batch size, lengths, ids in the vocabularies.

    Raises ValueError naming the field (`batch.src`, ...) before anything is
    dispatched: inside the jitted steps an out-of-range id would only show as
    a NaN loss.
    """
    checks.check_tokens("batch.src", batch.src, config.src_vocab_size, config.max_len)
    for name in ("tgt_in", "labels"):
        checks.check_tokens(f"batch.{name}", getattr(batch, name), config.tgt_vocab_size,
                            config.max_len)
    checks.check_same_batch(**{f"batch.{k}": v for k, v in batch._asdict().items()})
    if batch.tgt_in.shape != batch.labels.shape:
        raise ValueError(f"batch.tgt_in {batch.tgt_in.shape} and batch.labels "
                         f"{batch.labels.shape} must have the same shape")


def make_predict(model: Transformer, max_new_tokens: int) -> Callable:
    """predict(params, src_BS) -> greedy tokens (B, max_new_tokens), PAD after EOS.

    `jaxformer.decoding.greedy_decode` (cached, compiled once per shape).
    """
    def predict(params, src_BS):
        return greedy_decode(model, params, src_BS, max_new_tokens=max_new_tokens).tokens

    return predict


def evaluate(model: Transformer, params, batch: Batch, *, mesh=None, chunk: int = 1000,
             eval_step: Optional[Callable] = None,
             predict: Optional[Callable] = None) -> dict:
    """Metrics of `params` on a (held-out) batch, in chunks sharded over the mesh.

    Returns {"loss", "token_accuracy"} (teacher-forced, over non-PAD labels),
    "exact_match" (fraction of examples whose greedy decode equals labels
    exactly, EOS included) and "examples". The last chunk is padded to a
    multiple of the device count with copies of its first row, which are
    dropped from every metric.
    """
    batch = Batch(*(np.asarray(x) for x in batch))
    check_batch(model.config, batch)
    mesh = make_mesh() if mesh is None else mesh
    eval_step = make_eval_step(model) if eval_step is None else eval_step
    predict = make_predict(model, batch.labels.shape[1]) if predict is None else predict
    params = replicate(params, mesh)  # a no-op if already there
    total = batch.src.shape[0]
    devices = mesh.devices.size
    chunk = max(devices, chunk - chunk % devices)
    sums = {"loss_sum": 0.0, "correct": 0.0, "tokens": 0.0}
    exact = 0
    for start in range(0, total, chunk):
        part = Batch(*(x[start:start + chunk] for x in batch))
        rows = part.src.shape[0]
        padded = -rows % devices
        if padded:
            part = Batch(*(np.concatenate([x, np.repeat(x[:1], padded, 0)]) for x in part))
        weights = np.arange(rows + padded) < rows
        sharded = shard_batch(part, mesh)
        if padded:  # teacher-forced sums must not count the filler rows
            sharded = sharded._replace(labels=jnp.where(
                jax.device_put(weights[:, None], data_sharding(mesh)), sharded.labels,
                model.config.pad_id))
        for name, value in jax.device_get(eval_step(params, sharded)).items():
            sums[name] += float(value)
        tokens = np.asarray(jax.device_get(predict(params, sharded.src)))
        exact += int(np.all(tokens == part.labels, axis=1)[weights].sum())
    return {"loss": sums["loss_sum"] / max(sums["tokens"], 1.0),
            "token_accuracy": sums["correct"] / max(sums["tokens"], 1.0),
            "exact_match": exact / total, "examples": total}


# --------------------------------------------------------------------------- the loop


class TrainFunctions:
    """The jitted pieces of a run, built once per (model config, train config, mesh).

    `train_functions` caches these bundles, so runs that differ only in their
    seed (or a resumed run in the same process) reuse the compiled code.

      init(seed) -> TrainState             replicated over the mesh
      batch(seed, step) -> Batch           the training batch of `step`, split over "data"
      step(state, batch) -> (state, metrics)   jitted, donates `state`
      compiled_step(state, batch) -> (compiled step, seconds compiling)   compiled once
    """

    def __init__(self, model_config: TransformerConfig, train_config: TrainConfig, mesh):
        tc = train_config
        self.task = task_for(model_config, tc)
        self.mesh = mesh
        self.model = Transformer(model_config)
        self.tx = make_optimizer(tc)
        self.schedule = learning_rate_schedule(tc)
        self.init = jax.jit(functools.partial(_init_state, self.model, self.tx,
                                              self.task.src_len, self.task.tgt_len),
                            out_shardings=replicated(mesh))
        task, batch_size = self.task, tc.batch_size

        def batch(seed, step):
            data_key = jax.random.fold_in(jax.random.PRNGKey(seed), 1)
            return task.train_batch(jax.random.fold_in(data_key, step), batch_size)

        self.batch = jax.jit(batch, out_shardings=data_sharding(mesh))
        self.step = make_train_step(self.model, self.tx, label_smoothing=tc.label_smoothing,
                                    schedule=self.schedule)
        self._compiled = None

    def compiled_step(self, state: TrainState, batch: Batch):
        """(the compiled train step, seconds spent compiling now: 0.0 when already compiled)."""
        if self._compiled is not None:
            return self._compiled, 0.0
        start = time.perf_counter()
        self._compiled = self.step.lower(state, batch).compile()
        return self._compiled, time.perf_counter() - start


@functools.lru_cache(maxsize=8)
def _train_functions(model_config, train_config, mesh) -> TrainFunctions:
    return TrainFunctions(model_config, train_config, mesh)


def train_functions(model_config: TransformerConfig, train_config: TrainConfig,
                    mesh=None) -> TrainFunctions:
    """The (cached) `TrainFunctions` of a run; the seed is an argument, not part of the key."""
    mesh = make_mesh() if mesh is None else mesh
    check_divisible(train_config.batch_size, mesh)
    if mesh.devices.size > 1 and not jax.config.jax_threefry_partitionable:
        raise ValueError("jax_threefry_partitionable is off: dropout masks would depend on "
                         "how the batch is split over devices. Turn it back on with "
                         "jax.config.update('jax_threefry_partitionable', True)")
    return _train_functions(model_config, train_config.replace(seed=0), mesh)


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN or infinite; `step` names the first such step."""

    def __init__(self, step: int, value: float, last_checkpoint: Optional[int]):
        self.step = step
        kept = ("no checkpoint was written" if last_checkpoint is None else
                f"the last good checkpoint (step {last_checkpoint}) is kept")
        super().__init__(f"loss is {value} at step {step}: stopping; {kept}")


@dataclasses.dataclass
class FitResult:
    """What `fit` returns. `history` has one dict per step run in this call."""

    state: TrainState
    history: list
    start_step: int
    interrupted: bool
    compile_s: float
    wall_s: float
    task: Task
    mesh: Any


def fit(model_config: TransformerConfig, train_config: TrainConfig, *,
        checkpoint_dir: Optional[str] = None, resume: bool = False, save_every: int = 500,
        log_every: int = 25, progress: bool = True, metrics_file: Optional[str] = None,
        on_step: Optional[Callable[[int], None]] = None, mesh=None) -> FitResult:
    """Train `Transformer(model_config)` on the task of `train_config`.

    Args:
      checkpoint_dir: where Orbax checkpoints go (every `save_every` steps, at
        the end and on Ctrl-C). None: no checkpoints.
      resume: restore the latest checkpoint of `checkpoint_dir` and continue
        to `train_config.steps`; the result equals the uninterrupted run's.
        A missing or unreadable checkpoint raises `CheckpointError`.
      log_every: steps between host syncs: the progress bar, `metrics_file`
        (one JSON line per step, appended) and the non-finite check.
      on_step: called with the step count after every step (tests use it).
    Ctrl-C (SIGINT) finishes the current step, saves, and returns with
    `interrupted=True`; a second Ctrl-C aborts at once. A non-finite loss
    raises `NonFiniteLossError` naming the step, without saving.
    """
    from tqdm.auto import tqdm  # noqa: PLC0415 (only the loop needs it)

    from jaxformer.checkpoint import Checkpoints  # noqa: PLC0415

    started = time.perf_counter()
    tc = train_config
    if save_every <= 0 or log_every <= 0:
        raise ValueError(f"save_every and log_every must be positive, got {save_every}, "
                         f"{log_every}")
    if resume and checkpoint_dir is None:
        raise ValueError("resume=True needs checkpoint_dir")
    task = task_for(model_config, tc)
    mesh = make_mesh() if mesh is None else mesh
    fns = train_functions(model_config, tc, mesh)  # checks the batch against the mesh
    checkpoints = (Checkpoints(checkpoint_dir, create=not resume)
                   if checkpoint_dir is not None else None)
    state = fns.init(tc.seed)
    if resume:
        try:
            state = checkpoints.restore(state)
        except Exception:
            checkpoints.close()
            raise
    start_step = int(state.step)
    if start_step > tc.steps:
        checkpoints.close()
        raise ValueError(f"the checkpoint is at step {start_step}, beyond steps={tc.steps}")
    train_step, compile_s = fns.compiled_step(state, fns.batch(tc.seed, start_step))

    stop = _StopFlag()
    history, pending = [], []
    bar = tqdm(total=tc.steps, initial=start_step, disable=not progress, dynamic_ncols=True,
               desc=f"{tc.task} {model_config.norm}-LN", unit="step")
    metrics_out = open(metrics_file, "a") if metrics_file else None  # noqa: SIM115

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

    step = start_step
    try:
        with stop.catch_sigint():
            while step < tc.steps and not stop.requested:
                state, metrics = train_step(state, fns.batch(tc.seed, step))
                step += 1
                pending.append((step, metrics))
                if on_step is not None:
                    on_step(step)
                if step % log_every == 0 or step % save_every == 0 or stop.requested:
                    flush()
                if step % save_every == 0:
                    save(step)
            flush()
            save(step)  # the final state (or where Ctrl-C stopped us)
    finally:
        bar.close()
        if metrics_out:
            metrics_out.close()
        if checkpoints is not None:
            checkpoints.close()
    return FitResult(state=state, history=history, start_step=start_step,
                     interrupted=stop.requested and step < tc.steps, compile_s=compile_s,
                     wall_s=time.perf_counter() - started, task=task, mesh=mesh)


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

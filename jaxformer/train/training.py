"""Training on optax: loss and metrics, the optimizer, an explicit train state, jitted steps.

Pieces, each usable on its own::

    loss_and_metrics(logits_BTV, labels_BT, pad_id)  cross-entropy ignoring PAD
    label_pad_id(config, weights_BT)                 what is PAD (None: PAD is EOS, weights mask)
    make_optimizer(tc)                               AdamW + warmup/cosine + clipping
    trainable_params(config, params)                 what the optimizer sees (LoRA: adapters)
    create_train_state(model, tx, seed, ...)         TrainState(step, params, opt_state, rng)
    train_state_shardings(model, tx, shapes, mesh)   where each leaf of the state lives
    make_train_step(model, tx, ...)                  jitted, donates the state
    make_eval_step(model, ...), evaluate(...)        teacher-forced metrics + greedy exact match
    fit(model_config, train_config, ...)             the loop: data, mesh, checkpoints, progress

Determinism: a run is a pure function of the seed. The parameters are
initialised from `fold_in(PRNGKey(seed), 0)`, the batch of step s is drawn
from `fold_in(fold_in(PRNGKey(seed), 1), s)` and the dropout key of step s is
`fold_in(state.rng, s)`, all with JAX's default PRNG implementation (the
user's `jax_default_prng_impl`). Nothing depends on how many steps ran before
in this process, so a run resumed from a checkpoint replays the uninterrupted
run bit for bit (on the same machine and device count). With JAX's default
threefry (partitionable), the bits of each dropout element are a function of
the key and the element's global index, so several devices train to the
losses of one.

Sharding (`jaxformer.parallel.partitioning`): the state is created directly in its
shardings (abstract shapes first, then a jitted init with `out_shardings`),
parameters and each optimizer moment split by the logical-axis rules over the
mesh's "fsdp" / "tensor" axes, the batch over "data" x "fsdp". On a mesh of
"data" alone (the default) everything is replicated: plain data parallelism.
The train step is jitted with the same in/out shardings and donates the state.

Fine-tuning: `fit(..., init_params=...)` starts from given (pretrained)
parameters instead of random ones. With `config.lora_rank > 0` only the LoRA
adapters train (`jaxformer.nn.lora`): `TrainState.params` holds the whole tree
(base and adapters), `TrainState.opt_state` is the optimizer state of the
adapters alone (`trainable_params`), the step differentiates the loss with
respect to the adapters only, and the base leaves pass through untouched.

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
import sys
import threading
import time
from typing import Any, Callable, Optional

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxformer.nn import checks, lora, stacking
from jaxformer.nn.attention_select import uses_mask_spec
from jaxformer.parallel import partitioning
from jaxformer.backends import cpu
from jaxformer.config import ConfigMixin, TransformerConfig
from jaxformer.train.data import LMBatch, TextData, segment_mask, segment_mask_spec
from jaxformer.decode.api import greedy_decode
from jaxformer.nn.model import DecoderOnlyLM, Transformer
from jaxformer.nn.precision import check_backend as check_precision_backend
from jaxformer.parallel.partitioning import make_mesh
from jaxformer.parallel.sharding import check_divisible, data_sharding, replicated, shard_batch
from jaxformer.train.tasks import Batch, Task, make_task


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
    # task="lm": the decoder-only LM on text files (jaxformer.train.data), in windows of
    # seq_len tokens. `data` / `eval_data` are file paths or globs; no eval_data =
    # the held-out split is `eval_fraction` of the documents.
    seq_len: int = 128
    data: tuple = ()
    eval_data: tuple = ()
    tokenizer: Optional[str] = None   # a `tokenizers` JSON file; None = bytes
    eval_fraction: float = 0.05

    def __post_init__(self):
        for name in ("data", "eval_data"):  # JSON gives lists; keep the config hashable
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in ("steps", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"TrainConfig.{name} must be a positive int, got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or \
                not 0 <= self.seed < 2 ** 32:
            raise ValueError(f"TrainConfig.seed must be an int in [0, 2**32), got {self.seed!r}")
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
        if self.task == "lm":
            if not self.data:
                raise ValueError("TrainConfig.data: task 'lm' needs text files (--data PATH)")
            if not isinstance(self.seq_len, int) or self.seq_len < 2:
                raise ValueError(f"TrainConfig.seq_len must be an int >= 2, got "
                                 f"{self.seq_len!r}")
            if not 0.0 < self.eval_fraction < 1.0:
                raise ValueError(f"TrainConfig.eval_fraction must be in (0, 1), got "
                                 f"{self.eval_fraction!r}")
        else:
            make_task(self.task, min_len=self.min_len, max_len=self.max_len)  # validates


@flax.struct.dataclass
class TrainState:
    """The whole state of a run, an explicit pytree (what a checkpoint holds).

    step: int32 scalar, optimizer steps taken. params: the model's parameter
    pytree (all of it, LoRA adapters included). opt_state: optax state of
    `trainable_params(config, params)` (LoRA: the adapters only). rng: base dropout key (raw uint32 key);
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


def check_lm_data(model_config: TransformerConfig, train_config: TrainConfig,
                  data: Optional[TextData]) -> None:
    """Task "lm": the model fits the data's tokenizer and windows, before anything compiles."""
    c = model_config
    if data is None:
        raise ValueError("task 'lm' needs data: fit(..., data=TextData(...))")
    if c.num_encoder_layers:
        raise ValueError("task 'lm' trains the decoder-only LM: set num_encoder_layers=0")
    tok = data.tokenizer
    if c.tgt_vocab_size < tok.vocab_size:
        raise ValueError(f"the tokenizer has {tok.vocab_size} ids, more than the model's "
                         f"tgt_vocab_size={c.tgt_vocab_size}")
    ids = (c.pad_id, c.bos_id, c.eos_id)
    if ids != (tok.pad_id, tok.bos_id, tok.eos_id):
        raise ValueError(f"the model's pad/bos/eos ids {ids} differ from the tokenizer's "
                         f"{(tok.pad_id, tok.bos_id, tok.eos_id)}")
    if train_config.seq_len > c.max_len:
        raise ValueError(f"seq_len={train_config.seq_len} is longer than the model's "
                         f"max_len={c.max_len}")
    if data.seq_len != train_config.seq_len:
        raise ValueError(f"the data is packed in windows of {data.seq_len}, the run asks "
                         f"for seq_len={train_config.seq_len}")
    data.check_batch_size(train_config.batch_size, jax.process_count())


# --------------------------------------------------------------------------- loss


def loss_and_metrics(logits_BTV: jnp.ndarray, labels_BT: jnp.ndarray,
                     pad_id: Optional[int] = 0, label_smoothing: float = 0.0,
                     weights_BT: Optional[jnp.ndarray] = None) -> tuple[jnp.ndarray, dict]:
    """Mean token cross-entropy over non-PAD labels, and metrics.

    Returns (loss, {"loss", "token_accuracy", "tokens"}). PAD labels get
    weight 0 (so a PAD label's value changes nothing); the mean is over the
    non-PAD tokens of the whole (global) batch. `weights_BT` (0/1) masks more
    labels (a packed LM batch: no label across a document boundary). With
    `label_smoothing` a the target is (1 - a) one_hot + a / V.

    `pad_id=None`: no label is PAD by its id, `weights_BT` alone is the mask
    (required). For a model whose PAD id is also its EOS id (`label_pad_id`):
    a test `labels != pad_id` would drop every EOS label from the loss, and
    the model would never learn to stop.
    """
    logits_BTV = logits_BTV.astype(jnp.float32)
    if pad_id is None:
        if weights_BT is None:
            raise ValueError("loss_and_metrics: pad_id=None needs weights_BT (the mask)")
        weights_BT = jnp.asarray(weights_BT, jnp.float32)
    else:
        weights_BT = (labels_BT != pad_id).astype(jnp.float32) * (
            1.0 if weights_BT is None else weights_BT)
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


def label_pad_id(config: TransformerConfig, weights_BT) -> Optional[int]:
    """The `pad_id` that `loss_and_metrics` masks labels by, for a batch of `config`'s model.

    `config.pad_id`, or None (the batch's weights are the mask) when PAD is
    also EOS (allowed in configs: many tokenizers reuse EOS as PAD): there a
    label equal to pad_id may be a real EOS, which must count. A batch without
    weights (a task `Batch`: labels = target + EOS, then PAD) cannot tell them
    apart, so it is refused, before anything compiles.
    """
    if config.pad_id != config.eos_id:
        return config.pad_id
    if weights_BT is None:
        raise ValueError(
            f"pad_id == eos_id == {config.pad_id}: a batch without weights (a task Batch) "
            f"cannot tell its EOS labels from PAD labels, and masking labels != pad_id would "
            f"drop every EOS label from the loss (the model would never learn to stop). "
            f"Give PAD its own id in the config for training, or train on batches that "
            f"carry weights (data.LMBatch: weights 1 exactly where a label counts)")
    return None


def model_logits(model, params, batch, *, deterministic: bool = True, rngs=None):
    """(logits (B, T, V), labels (B, T), weights (B, T) or None) of either kind of batch.

    A task `Batch` runs the encoder-decoder with teacher forcing; an `LMBatch`
    runs the decoder-only LM on packed windows: attention stays inside each
    document (`data.segment_mask`; as a MaskSpec, `data.segment_mask_spec`, under
    attention_impl "blockwise" or "auto": no (T, T) array) and positions restart
    with each document.
    """
    if isinstance(batch, LMBatch):
        mask = (segment_mask_spec if uses_mask_spec(model.config) else segment_mask)(
            batch.segments)
        logits_BTV = model.apply({"params": params}, batch.inputs, mask,
                                 positions_BT=batch.positions, deterministic=deterministic,
                                 rngs=rngs)
        return logits_BTV, batch.labels, batch.weights
    logits_BTV = model.apply({"params": params}, batch.src, batch.tgt_in,
                             deterministic=deterministic, rngs=rngs)
    return logits_BTV, batch.labels, None


# --------------------------------------------------------------------------- optimizer


def learning_rate_schedule(tc: TrainConfig) -> optax.Schedule:
    """Linear warmup 0 -> peak over `warmup_steps`, then cosine decay to end_lr_fraction*peak."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=tc.learning_rate, warmup_steps=tc.warmup_steps,
        decay_steps=tc.steps, end_value=tc.learning_rate * tc.end_lr_fraction)


def decay_mask(params) -> Any:
    """True for matrices (ndim >= 2: kernels, embeddings); biases and LayerNorm are not decayed.

    A stacked (scanned) layer's leaves carry a leading layer axis, not counted.
    """
    def is_matrix(path, p):
        stacked = any(getattr(k, "key", None) == stacking.STACKED for k in path)
        return p.ndim - stacked >= 2
    return jax.tree_util.tree_map_with_path(is_matrix, params)


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """The one optimizer: clip the global gradient norm, then AdamW on the schedule."""
    return optax.chain(
        optax.clip_by_global_norm(tc.clip_norm),
        optax.adamw(learning_rate_schedule(tc), b1=tc.b1, b2=tc.b2, eps=1e-9,
                    weight_decay=tc.weight_decay, mask=decay_mask))


# --------------------------------------------------------------------------- state and steps


def trainable_params(config: TransformerConfig, params: Any) -> Any:
    """The part of `params` (or of any params-shaped tree) that training updates:
    all of it, or with `config.lora_rank > 0` the LoRA adapters alone."""
    return lora.split_adapters(params)[0] if config.lora_rank else params


def with_trainable(config: TransformerConfig, params: Any, trainable: Any) -> Any:
    """`params` with its `trainable_params` part replaced by `trainable`."""
    return lora.join(trainable, lora.split_adapters(params)[1]) if config.lora_rank \
        else trainable


def check_init_params(model, init_params: Any, input_shapes: tuple) -> Any:
    """`init_params` in the model's layer layout, checked against the model's tree
    (every parameter but the LoRA adapters, same shapes); ValueError naming the
    first differing entries. Nothing is computed (abstract shapes)."""
    c = model.config
    init_params = stacking.to_layout(init_params, c.scan_layers)
    inputs = [jax.ShapeDtypeStruct(shape, jnp.int32) for shape in input_shapes]
    abstract = jax.eval_shape(model.init, jax.random.PRNGKey(0), *inputs)["params"]
    want = flax.traverse_util.flatten_dict(lora.split_adapters(abstract)[1], sep="/")
    have = flax.traverse_util.flatten_dict(dict(init_params), sep="/")
    differ = sorted(set(want) ^ set(have))[:4] or [
        f"{k} {tuple(have[k].shape)} (model: {want[k].shape})" for k in sorted(want)
        if tuple(have[k].shape) != tuple(want[k].shape)][:4]
    if differ:
        raise ValueError(f"init_params do not fit the model (LoRA adapters excepted); "
                         f"differing entries: {', '.join(differ)}")
    return init_params


def init_train_state(model, tx: optax.GradientTransformation, input_shapes: tuple, seed,
                     init_params: Any = None) -> TrainState:
    """Traceable init from token inputs of `input_shapes` ((src, tgt) or (tokens,));
    `seed` may be traced, so one compilation serves every seed.

    `init_params` (checked by `check_init_params`): the starting parameters
    (fine-tuning), cast to the model's parameter dtype; LoRA adapters absent
    from them are initialised from the seed. The random parameters they
    replace are never computed under jit (dead code)."""
    root = jax.random.PRNGKey(seed)
    inputs = [jnp.zeros(shape, jnp.int32) for shape in input_shapes]
    params = model.init(jax.random.fold_in(root, 0), *inputs)["params"]
    if init_params is not None:
        adapters, base = lora.split_adapters(params)
        base = jax.tree_util.tree_map(lambda new, old: jnp.asarray(new, old.dtype),
                                      lora.split_adapters(init_params)[1], base)
        params = lora.join(adapters, base)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=tx.init(trainable_params(model.config, params)),
                      rng=jax.random.fold_in(root, 2))


def train_state_shardings(model, tx: optax.GradientTransformation, input_shapes: tuple,
                          mesh, rules=partitioning.LOGICAL_AXIS_RULES) -> TrainState:
    """A `TrainState` of `NamedSharding`s: parameters by their logical axes under `rules`,
    every optax leaf shaped like a parameter as that parameter, the rest replicated.

    Nothing is computed (`jax.eval_shape`). Raises ValueError, by parameter path,
    if a split dimension does not divide over its mesh axes.
    """
    inputs = [jax.ShapeDtypeStruct(shape, jnp.int32) for shape in input_shapes]
    specs = partitioning.mesh_specs(partitioning.logical_specs(model, *inputs), rules)
    abstract = jax.eval_shape(functools.partial(init_train_state, model, tx, input_shapes), 0)
    partitioning.check_divisible_params(abstract.params, specs, mesh)
    params = partitioning.shardings(specs, mesh)
    return TrainState(step=replicated(mesh), params=params,
                      opt_state=partitioning.state_shardings(
                          tx, abstract.opt_state, trainable_params(model.config, params), mesh),
                      rng=replicated(mesh))


def make_init(model, tx: optax.GradientTransformation, input_shapes: tuple, mesh,
              shardings: Optional[TrainState] = None) -> Callable:
    """jit(init)(seed) -> TrainState, each leaf created directly in its sharding."""
    if shardings is None:
        shardings = train_state_shardings(model, tx, input_shapes, mesh)
    return jax.jit(functools.partial(init_train_state, model, tx, input_shapes),
                   out_shardings=shardings)


def make_init_from(model, tx: optax.GradientTransformation, input_shapes: tuple, mesh,
                   shardings: Optional[TrainState] = None) -> Callable:
    """init_from(seed, init_params) -> TrainState starting from `init_params` (fine-tuning;
    `init_train_state`), checked (`check_init_params`), created in its shardings."""
    if shardings is None:
        shardings = train_state_shardings(model, tx, input_shapes, mesh)
    start_from = jax.jit(functools.partial(init_train_state, model, tx, input_shapes),
                         out_shardings=shardings)
    base_shardings = lora.split_adapters(shardings.params)[1]

    def init_from(seed, init_params):
        init_params = check_init_params(model, init_params, input_shapes)
        # In the shardings of the state (a no-op if already there): jit takes no
        # committed arguments on other devices.
        return start_from(seed, jax.device_put(init_params, base_shardings))

    return init_from


def create_train_state(model: Transformer, tx: optax.GradientTransformation, seed: int,
                       src_len: int, tgt_len: int, mesh=None) -> TrainState:
    """Initialise parameters and optimizer state on `mesh` (default: all devices on
    "data", i.e. replicated), sharded by `train_state_shardings`."""
    mesh = make_mesh() if mesh is None else mesh
    return make_init(model, tx, ((1, src_len), (1, tgt_len)), mesh)(seed)


def dropout_key(rng: jax.Array, step, config: Optional[TransformerConfig] = None) -> jax.Array:
    """The dropout key of `step`: `jax.random.fold_in(rng, step)`, with the key's own
    PRNG implementation; under `config.cpu_tuning` the same bits from
    `backends.cpu.dropout_key`."""
    if config is not None and config.cpu_tuning:
        return cpu.dropout_key(rng, step)
    return jax.random.fold_in(rng, step)


def make_train_step(model, tx: optax.GradientTransformation, *,
                    label_smoothing: float = 0.0,
                    schedule: Optional[optax.Schedule] = None, mesh=None,
                    shardings: Optional[TrainState] = None) -> Callable:
    """jit(train_step)(state, batch) -> (new_state, metrics); the input state is donated.

    With `mesh` and `shardings` (`train_state_shardings`) the step is jitted
    with those in/out shardings (the batch split over the mesh's batch axes,
    metrics replicated) and activations are constrained at layer boundaries
    (`partitioning.constrain`); without, the shardings follow the inputs.

    `model` is a `Transformer` fed task `Batch`es or a `DecoderOnlyLM` fed
    `data.LMBatch`es (`model_logits`).

    Dropout is on (deterministic=False) with key `dropout_key(state.rng, state.step)`.
    Only `trainable_params` change (LoRA: the adapters).
    metrics: loss, token_accuracy, tokens, grad_norm (before clipping), and
    learning_rate if `schedule` is given.
    """

    def train_step(state: TrainState, batch: Batch):
        key = dropout_key(state.rng, state.step, model.config)

        def loss_fn(params):
            with partitioning.activation_sharding(mesh if shardings is not None else None):
                logits_BTV, labels_BT, weights_BT = model_logits(
                    model, params, batch, deterministic=False, rngs={"dropout": key})
            return loss_and_metrics(logits_BTV, labels_BT,
                                    label_pad_id(model.config, weights_BT),
                                    label_smoothing, weights_BT)

        # LoRA: differentiate with respect to the adapters alone (no base gradients are
        # computed); the frozen base leaves pass through unchanged.
        trainable = trainable_params(model.config, state.params)
        (_, metrics), grads = jax.value_and_grad(
            lambda t: loss_fn(with_trainable(model.config, state.params, t)),
            has_aux=True)(trainable)
        updates, opt_state = tx.update(grads, state.opt_state, trainable)
        params = with_trainable(model.config, state.params,
                                optax.apply_updates(trainable, updates))
        metrics = dict(metrics, grad_norm=optax.tree.norm(grads))
        if schedule is not None:
            metrics["learning_rate"] = schedule(state.step)
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

    if shardings is None:
        return jax.jit(train_step, donate_argnums=0)
    if mesh is None:
        raise ValueError("make_train_step: shardings need their mesh")
    return jax.jit(train_step, in_shardings=(shardings, data_sharding(mesh)),
                   out_shardings=(shardings, replicated(mesh)), donate_argnums=0)


@functools.lru_cache(maxsize=16)  # one compilation per model config, not per call
def make_eval_step(model) -> Callable:
    """jit(eval_step)(params, batch) -> sums {loss_sum, correct, tokens} (teacher forcing).

    Sums, not means, so that chunks of a large evaluation set add up exactly.
    """
    def eval_step(params, batch):
        logits_BTV, labels_BT, weights_BT = model_logits(model, params, batch)
        loss, metrics = loss_and_metrics(logits_BTV, labels_BT,
                                         label_pad_id(model.config, weights_BT),
                                         weights_BT=weights_BT)
        return {"loss_sum": loss * metrics["tokens"],
                "correct": metrics["token_accuracy"] * metrics["tokens"],
                "tokens": metrics["tokens"]}

    return jax.jit(eval_step)


@functools.lru_cache(maxsize=16)
def make_lm_eval_step(model: DecoderOnlyLM) -> Callable:
    """jit(step)(params, batch, token_bytes_V) -> sums {nats, tokens, bytes} over weighted labels."""

    def step(params, batch: LMBatch, token_bytes_V):
        logits_BTV, labels_BT, weights_BT = model_logits(model, params, batch)
        pad_id = label_pad_id(model.config, weights_BT)
        if pad_id is not None:
            weights_BT = weights_BT * (labels_BT != pad_id)
        xent_BT = optax.softmax_cross_entropy_with_integer_labels(
            logits_BTV.astype(jnp.float32), labels_BT)
        return {"nats": (xent_BT * weights_BT).sum(), "tokens": weights_BT.sum(),
                "bytes": (token_bytes_V[labels_BT] * weights_BT).sum()}

    return jax.jit(step)


@functools.lru_cache(maxsize=4)
def token_byte_counts(tokenizer) -> np.ndarray:
    """(V,) the UTF-8 bytes each token id stands for (0 for the specials)."""
    return np.array([tokenizer.byte_count(np.array([i], np.int32))
                     for i in range(tokenizer.vocab_size)], np.float32)


def evaluate_lm(model: DecoderOnlyLM, params, data: TextData, *, batch_size: int = 32,
                mesh=None, progress: bool = False) -> dict:
    """Held-out metrics of a decoder-only LM on every held-out window of `data`.

    Returns {"loss" (nats per token), "perplexity", "bits_per_byte", "tokens",
    "bytes"}: bits per byte = total cross-entropy in bits over the UTF-8 bytes
    the predicted tokens stand for, comparable across tokenizers (and with a
    compressor's output size). `progress`: a progress bar over the held-out
    batches (on stderr; it disappears when done).
    """
    from tqdm.auto import tqdm  # noqa: PLC0415

    mesh = make_mesh() if mesh is None else mesh
    shards = partitioning.batch_shards(mesh)
    batch_size = max(batch_size - batch_size % shards, shards)
    step = make_lm_eval_step(model)
    token_bytes_V = jnp.asarray(token_byte_counts(data.tokenizer), jnp.float32)
    params = partitioning.place_params(model, params, mesh)  # as `evaluate`
    sums = {"nats": 0.0, "tokens": 0.0, "bytes": 0.0}
    batches = tqdm(data.eval_batches(batch_size), disable=not progress, leave=False,
                   total=-(-data.num_eval_windows // batch_size), unit="batch",
                   desc="held-out evaluation", dynamic_ncols=True)
    for batch in batches:
        for name, value in jax.device_get(step(params, shard_batch(batch, mesh),
                                               token_bytes_V)).items():
            sums[name] += float(value)
    loss = sums["nats"] / max(sums["tokens"], 1.0)
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)),
            "bits_per_byte": sums["nats"] / math.log(2) / max(sums["bytes"], 1.0),
            "tokens": int(sums["tokens"]), "bytes": int(sums["bytes"])}


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

    `jaxformer.decode.api.greedy_decode` (cached, compiled once per shape).
    """
    def predict(params, src_BS):
        return greedy_decode(model, params, src_BS, max_new_tokens=max_new_tokens).tokens

    return predict


def _init_inputs(*arrays) -> tuple:
    """(1, ...) ShapeDtypeStructs of `arrays`' rows: what `model.init` takes."""
    return tuple(jax.ShapeDtypeStruct((1,) + x.shape[1:], x.dtype) for x in arrays)


def evaluate(model: Transformer, params, batch: Batch, *, mesh=None, chunk: int = 1000,
             eval_step: Optional[Callable] = None,
             predict: Optional[Callable] = None) -> dict:
    """Metrics of `params` on a (held-out) batch, in chunks sharded over the mesh.

    `params` are placed by the logical-axis rules (`partitioning.place_params`):
    split over the mesh's "fsdp" and "tensor" axes, replicated over "data".
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
    # Split by the rules over fsdp / tensor (a model no device holds whole still
    # evaluates), replicated over data; a no-op if already there.
    params = partitioning.place_params(model, params, mesh, *_init_inputs(batch.src,
                                                                          batch.tgt_in))
    total = batch.src.shape[0]
    devices = partitioning.batch_shards(mesh)  # rows per chunk: a multiple of this
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

      init(seed) -> TrainState             created in `shardings` (jitted, out_shardings)
      init_from(seed, init_params) -> TrainState   the same from given parameters
      shardings: TrainState                 of NamedShardings (`train_state_shardings`)
      batch(seed, step) -> Batch           the training batch of `step`, split over "data"
                                           (synthetic tasks; None for task "lm")
      step(state, batch) -> (state, metrics)   jitted, donates `state`
      compiled_step(state, batch) -> (compiled step, seconds compiling)   compiled once
      abstract_state() -> TrainState       of ShapeDtypeStructs (restore targets)
    """

    def __init__(self, model_config: TransformerConfig, train_config: TrainConfig, mesh):
        tc = train_config
        self.mesh = mesh
        self.tx = make_optimizer(tc)
        self.schedule = learning_rate_schedule(tc)
        if tc.task == "lm":  # batches come from the host pipeline (`fit(data=...)`)
            self.task, self.batch = None, None
            self.model = DecoderOnlyLM(model_config)
            input_shapes = ((1, tc.seq_len),)
        else:
            self.task = task = task_for(model_config, tc)
            self.model = Transformer(model_config)
            input_shapes = ((1, task.src_len), (1, task.tgt_len))

            def batch(seed, step):
                data_key = jax.random.fold_in(jax.random.PRNGKey(seed), 1)
                return task.train_batch(jax.random.fold_in(data_key, step), tc.batch_size)

            self.batch = jax.jit(batch, out_shardings=data_sharding(mesh))
        self.shardings = train_state_shardings(self.model, self.tx, input_shapes, mesh)
        self.init = make_init(self.model, self.tx, input_shapes, mesh, self.shardings)
        self.init_from = make_init_from(self.model, self.tx, input_shapes, mesh,
                                        self.shardings)
        self.step = make_train_step(self.model, self.tx, label_smoothing=tc.label_smoothing,
                                    schedule=self.schedule, mesh=mesh,
                                    shardings=self.shardings)
        self._compiled = None

    def abstract_state(self) -> TrainState:
        """The state's shapes, dtypes and shardings (`jax.ShapeDtypeStruct`s): the target
        to restore a checkpoint into without initialising anything."""
        return jax.eval_shape(self.init, 0)

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
    check_precision_backend(model_config, mesh.devices.flat)
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
    """What `fit` returns. `history` has one dict per step run in this call;
    `evals` the held-out records of task "lm"; `train_s` the seconds spent in
    train steps (no compile, no evaluation)."""

    state: TrainState
    history: list
    start_step: int
    interrupted: bool
    compile_s: float
    wall_s: float
    task: Optional[Task]
    mesh: Any
    train_s: float = 0.0
    evals: list = dataclasses.field(default_factory=list)


def fit(model_config: TransformerConfig, train_config: TrainConfig, *,
        checkpoint_dir: Optional[str] = None, resume: bool = False, save_every: int = 500,
        log_every: int = 25, progress: bool = True, metrics_file: Optional[str] = None,
        on_step: Optional[Callable[[int], None]] = None, mesh=None,
        data: Optional[TextData] = None, eval_every: int = 0,
        fallback: bool = False, init_params: Any = None) -> FitResult:
    """Train `Transformer(model_config)` on the task of `train_config`, or, for
    task "lm", `DecoderOnlyLM(model_config)` on the text of `data`.

    Args:
      data: the `jaxformer.train.data.TextData` of task "lm" (built from
        `train_config.data`); step s trains on its batch s, so resuming
        continues the data stream exactly.
      eval_every: task "lm": held-out loss and bits per byte every this many
        steps and at the end (0: only at the end), in `evals` and `metrics_file`.
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
        with `model_config.lora_rank > 0` they are the frozen base and only the
        adapters (initialised from the seed) train. Ignored on `resume` (the
        checkpoint holds every parameter).
    Ctrl-C (SIGINT) finishes the current step, saves, and returns with
    `interrupted=True`; a second Ctrl-C aborts at once. A non-finite loss
    raises `NonFiniteLossError` naming the step, without saving.
    """
    from tqdm.auto import tqdm  # noqa: PLC0415 (only the loop needs it)

    from jaxformer.train.checkpoint import Checkpoints  # noqa: PLC0415

    started = time.perf_counter()
    tc = train_config
    if save_every <= 0 or log_every <= 0:
        raise ValueError(f"save_every and log_every must be positive, got {save_every}, "
                         f"{log_every}")
    if resume and checkpoint_dir is None:
        raise ValueError("resume=True needs checkpoint_dir")
    if eval_every < 0:
        raise ValueError(f"eval_every must be >= 0, got {eval_every}")
    mesh = make_mesh() if mesh is None else mesh
    if tc.task == "lm":
        task = None
        check_lm_data(model_config, tc, data)
    else:
        task = task_for(model_config, tc)
    fns = train_functions(model_config, tc, mesh)  # checks the batch against the mesh
    if tc.task == "lm":
        def next_batch(step):  # this process's rows of the global batch of `step`
            local = data.train_batch(step, tc.batch_size, tc.seed,
                                     process_index=jax.process_index(),
                                     process_count=jax.process_count())
            return jax.tree_util.tree_map(
                lambda x: jax.make_array_from_process_local_data(data_sharding(mesh), x), local)
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
             fns.init_from(tc.seed, init_params))
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
               dynamic_ncols=True, desc=f"{tc.task} {model_config.norm}-LN", unit="step")
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
        """Task "lm": held-out metrics of the current parameters, logged as a record."""
        nonlocal eval_s
        begin = time.perf_counter()
        metrics = evaluate_lm(fns.model, state.params, data, batch_size=tc.batch_size,
                              mesh=mesh, progress=progress and primary)
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
            if tc.task == "lm" and step == tc.steps and step > start_step:
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

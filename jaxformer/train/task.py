"""What a training run trains on: the interface `fit` takes, its two implementations, and
the one place where a task's name (`TrainConfig.task`, `--task`) picks one.

A `TrainingTask` tells the loop everything that depends on the data::

    model_class                      Transformer (seq2seq tasks) or DecoderOnlyLM (text)
    input_shapes() -> ((1, S), ...)  the token inputs of `model.init`, batch 1
    check_model(model_config)        the model fits the task, before anything compiles
    check(model_config)              ... and its data, which it must have (what `fit` calls)
    device_batch(seed, step)         a pure (jittable) batch of `step`; None if host-fed
    host_batch(step)                 this process's rows of the batch of `step` (host-fed)
    held_out(model, params, mesh, progress) -> metrics, or None (no held-out set in `fit`)

`SyntheticTask` (copy / reverse / sort: `jaxformer.train.tasks`, batches drawn on the
device) and `TextTask` (text files: `jaxformer.train.data.TextData`, batches from the
host pipeline) implement it. `training_task(model_config, train_config, data)` maps a
name to one; a new kind of task is a new class and a line in `TASK_TYPES`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Protocol

import jax

from jaxformer.config import TransformerConfig, is_finite_number
from jaxformer.nn.model import DecoderOnlyLM, Transformer
from jaxformer.train.data import TextData
from jaxformer.train.evaluation import evaluate_lm
from jaxformer.train.tasks import TASKS, Batch, Task, make_task


class TrainingTask(Protocol):
    """What `fit` needs from the data of a run (the module docstring lists the members)."""

    name: str
    model_class: type
    default_preset: str

    def input_shapes(self) -> tuple[tuple[int, ...], ...]: ...

    def check_model(self, model_config: TransformerConfig) -> None: ...

    def check(self, model_config: TransformerConfig) -> None: ...

    def device_batch(self, seed, step) -> Any: ...

    def host_batch(self, step: int) -> Any: ...

    def held_out(self, model, params, mesh, progress: bool) -> Optional[dict]: ...


@dataclasses.dataclass(frozen=True)
class SyntheticTask:
    """A seq2seq task of `jaxformer.train.tasks` (`task`), trained with batches of
    `batch_size` drawn on the device: the batch of step s of seed n is
    `task.train_batch(fold_in(fold_in(PRNGKey(n), 1), s))`. Evaluated by the caller
    (`jaxformer.train.evaluate` on `heldout_set`: exact match needs decoding)."""

    task: Task
    batch_size: int

    model_class = Transformer
    default_preset = "copy_task"

    @property
    def name(self) -> str:
        return self.task.name

    def input_shapes(self) -> tuple[tuple[int, ...], ...]:
        return (1, self.task.src_len), (1, self.task.tgt_len)

    def check_model(self, model_config: TransformerConfig) -> None:
        c = model_config
        if c.src_vocab_size != c.tgt_vocab_size:
            raise ValueError(f"the synthetic tasks need src_vocab_size == tgt_vocab_size, got "
                             f"{c.src_vocab_size} and {c.tgt_vocab_size}")
        if self.task.tgt_len > c.max_len:
            raise ValueError(f"max_len={self.task.max_len} needs targets of length "
                             f"{self.task.tgt_len} (BOS/EOS + sequence), longer than the "
                             f"model's max_len={c.max_len}")

    check = check_model  # the data is drawn from the task itself

    def device_batch(self, seed, step) -> Batch:
        data_key = jax.random.fold_in(jax.random.PRNGKey(seed), 1)
        return self.task.train_batch(jax.random.fold_in(data_key, step), self.batch_size)

    def host_batch(self, step: int):
        raise TypeError("a synthetic task's batches are drawn on the device (device_batch)")

    def held_out(self, model, params, mesh, progress: bool) -> None:
        return None

    def heldout_set(self, num_examples: int, seed: int = 0) -> Batch:
        """`num_examples` held-out examples (`Task.heldout_set`)."""
        return self.task.heldout_set(num_examples, seed)


@dataclasses.dataclass(frozen=True, eq=False)
class TextTask:
    """The decoder-only LM on text files: windows of `seq_len` tokens of `data` (None
    where only the shapes are needed), `batch_size` windows a step from the host
    pipeline, held-out loss and bits per byte (`evaluate_lm`)."""

    seq_len: int
    batch_size: int
    seed: int = 0
    data: Optional[TextData] = None

    name = "lm"
    model_class = DecoderOnlyLM
    default_preset = "lm"

    def input_shapes(self) -> tuple[tuple[int, ...], ...]:
        return ((1, self.seq_len),)

    def check_model(self, model_config: TransformerConfig) -> None:
        c = model_config
        if c.num_encoder_layers:
            raise ValueError("task 'lm' trains the decoder-only LM: set num_encoder_layers=0")
        if self.seq_len > c.max_len:
            raise ValueError(f"seq_len={self.seq_len} is longer than the model's "
                             f"max_len={c.max_len}")

    def check(self, model_config: TransformerConfig) -> None:
        c = model_config
        if self.data is None:
            raise ValueError("task 'lm' needs data: fit(..., data=TextData(...))")
        self.check_model(c)
        tok = self.data.tokenizer
        if c.tgt_vocab_size < tok.vocab_size:
            raise ValueError(f"the tokenizer has {tok.vocab_size} ids, more than the model's "
                             f"tgt_vocab_size={c.tgt_vocab_size}")
        ids = (c.pad_id, c.bos_id, c.eos_id)
        if ids != (tok.pad_id, tok.bos_id, tok.eos_id):
            raise ValueError(f"the model's pad/bos/eos ids {ids} differ from the tokenizer's "
                             f"{(tok.pad_id, tok.bos_id, tok.eos_id)}")
        if self.data.seq_len != self.seq_len:
            raise ValueError(f"the data is packed in windows of {self.data.seq_len}, the run "
                             f"asks for seq_len={self.seq_len}")
        self.data.check_batch_size(self.batch_size, jax.process_count())

    device_batch = None  # host-fed: `host_batch`

    def host_batch(self, step: int):
        return self.data.train_batch(step, self.batch_size, self.seed,
                                     process_index=jax.process_index(),
                                     process_count=jax.process_count())

    def held_out(self, model, params, mesh, progress: bool) -> dict:
        return evaluate_lm(model, params, self.data, batch_size=self.batch_size, mesh=mesh,
                           progress=progress)


# The one map from a task's name to its kind (the CLI's --task choices come from here).
TASK_TYPES: dict[str, type] = {**{name: SyntheticTask for name in TASKS}, "lm": TextTask}


def task_type(name: str) -> type:
    """The class implementing task `name`; ValueError listing the names otherwise."""
    if name not in TASK_TYPES:
        raise ValueError(f"unknown task {name!r} (choose from {', '.join(TASK_TYPES)})")
    return TASK_TYPES[name]


def trains_language_model(name: str) -> bool:
    """Task `name` trains a decoder-only LM (what generate, eval and export take)."""
    return task_type(name).model_class is DecoderOnlyLM


def check_task_fields(tc) -> None:
    """The `TrainConfig` fields task `tc.task` uses, checked (called by TrainConfig)."""
    if task_type(tc.task) is TextTask:
        if not tc.data:
            raise ValueError("TrainConfig.data: task 'lm' needs text files (--data PATH)")
        if not isinstance(tc.seq_len, int) or tc.seq_len < 2:
            raise ValueError(f"TrainConfig.seq_len must be an int >= 2, got {tc.seq_len!r}")
        if not (is_finite_number(tc.eval_fraction) and 0.0 < tc.eval_fraction < 1.0):
            raise ValueError(f"TrainConfig.eval_fraction must be in (0, 1), got "
                             f"{tc.eval_fraction!r}")
    else:
        make_task(tc.task, min_len=tc.min_len, max_len=tc.max_len)  # validates


def training_task(model_config: TransformerConfig, tc,
                  data: Optional[TextData] = None) -> TrainingTask:
    """The `TrainingTask` of a run of `model_config` under `TrainConfig` `tc` (`data`: the
    text of task "lm"; None where only shapes are needed)."""
    if task_type(tc.task) is TextTask:
        return TextTask(seq_len=tc.seq_len, batch_size=tc.batch_size, seed=tc.seed, data=data)
    c = model_config
    return SyntheticTask(make_task(tc.task, vocab_size=c.src_vocab_size, min_len=tc.min_len,
                                   max_len=tc.max_len, pad_id=c.pad_id, bos_id=c.bos_id,
                                   eos_id=c.eos_id), tc.batch_size)

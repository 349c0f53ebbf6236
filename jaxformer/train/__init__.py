"""Training: the loss, the optimizer, an explicit train state, jitted steps, the `fit` loop.

Modules, one job each::

    train_config  TrainConfig: everything about a run that is not the architecture
    task          TrainingTask, what `fit` trains on; `training_task` maps a name to one
    tasks         the synthetic tasks (copy, reverse, sort) and their batches
    data          text files to packed LM batches (grain)
    loss          loss_and_metrics (cross-entropy ignoring PAD), label_pad_id, model_logits
    optimizer     make_optimizer: clipping + AdamW on the warmup/cosine schedule
    state         TrainState(step, params, opt_state, rng), created in its shardings
    step          make_train_step: jitted, donates the state; compile_train_step: its
                  temporaries in small heaps (kept mapped between steps on a host)
    evaluation    evaluate (teacher-forced + greedy exact match), evaluate_lm (bits per byte)
    loop          fit: data, mesh, checkpoints, progress; TrainFunctions, train_functions
    checkpoint    Checkpoints: Orbax save / restore / resume
    run           Run: a run directory (config, latest parameters, tokenizer, chat template)
    run_lock      RunLock: one writer per run directory
    settle        settled_on_failure: a failed Orbax read or write leaves none of the
                  others in flight

The names below are the public surface; the modules are free to move.
"""

from jaxformer.train.checkpoint import CheckpointError, CheckpointWriteError, Checkpoints
from jaxformer.train.data import LMBatch, TextData, segment_mask
from jaxformer.train.evaluation import evaluate, evaluate_lm, make_lm_eval_step
from jaxformer.train.loop import FitResult, NonFiniteLossError, TrainFunctions, fit, train_functions
from jaxformer.train.loss import loss_and_metrics, model_logits
from jaxformer.train.optimizer import make_optimizer
from jaxformer.train.run import Run, RunError
from jaxformer.train.state import TrainState, init_train_state
from jaxformer.train.step import compile_train_step, make_train_step
from jaxformer.train.task import SyntheticTask, TextTask, TrainingTask, training_task
from jaxformer.train.tasks import Batch
from jaxformer.train.train_config import TrainConfig

__all__ = ["CheckpointError", "CheckpointWriteError", "Checkpoints", "LMBatch", "TextData",
           "segment_mask", "Batch", "FitResult", "NonFiniteLossError", "TrainConfig",
           "TrainFunctions", "TrainState", "evaluate", "evaluate_lm", "make_lm_eval_step", "fit",
           "init_train_state",
           "loss_and_metrics", "make_optimizer", "make_train_step", "compile_train_step", "model_logits",
           "train_functions", "SyntheticTask", "TextTask", "TrainingTask", "training_task", "Run", "RunError"]

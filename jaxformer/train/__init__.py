"""Training: loss, optimizer, jitted steps, the `fit` loop, data, tasks, checkpoints.

Modules: `tasks` (synthetic tasks), `data` (text pipeline for the LM),
`checkpoint` (Orbax save / restore / resume), `training` (TrainConfig, steps,
`fit`, `evaluate`). The names below are the public surface; the modules are free
to move.
"""

from jaxformer.train.checkpoint import CheckpointError, Checkpoints
from jaxformer.train.data import ByteTokenizer, LMBatch, TextData, segment_mask
from jaxformer.train.tasks import Batch
from jaxformer.train.training import (FitResult, TrainConfig, TrainFunctions, TrainState,
                                      evaluate, evaluate_lm, fit, init_train_state,
                                      loss_and_metrics, make_optimizer, make_train_step,
                                      model_logits, train_functions)

__all__ = ["CheckpointError", "Checkpoints", "ByteTokenizer", "LMBatch", "TextData",
           "segment_mask", "Batch", "FitResult", "TrainConfig", "TrainFunctions", "TrainState",
           "evaluate", "evaluate_lm", "fit", "init_train_state", "loss_and_metrics",
           "make_optimizer", "make_train_step", "model_logits", "train_functions"]

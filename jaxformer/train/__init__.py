"""Training: loss, optimizer, jitted steps, the `fit` loop, data, tasks, checkpoints.

Modules: `tasks` (synthetic tasks), `data` (text pipeline for the LM),
`checkpoint` (Orbax save / restore / resume), `training` (TrainConfig, steps,
`fit`, `evaluate`).
"""

from jaxformer.train.training import TrainConfig, TrainState, evaluate, fit, make_train_step

__all__ = ["TrainConfig", "TrainState", "evaluate", "fit", "make_train_step"]

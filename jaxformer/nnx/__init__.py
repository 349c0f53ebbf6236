"""Flax NNX: any jaxformer model as an `nnx.Module` holding given parameters, and back.

Modules: `bridge` (`to_nnx`, `to_params`, logical specs and shardings by the rules
table), `steps` (an `nnx.Optimizer` train step and the cached decode step through
the module). Recipe: docs/nnx.md.
"""

from jaxformer.nnx.bridge import logical_specs, param_shardings, shard, to_nnx, to_params
from jaxformer.nnx.steps import decode_step, linen, loss_fn, train_step

__all__ = ["decode_step", "linen", "logical_specs", "loss_fn", "param_shardings", "shard",
           "to_nnx", "to_params", "train_step"]

"""The one optimizer: global-norm clipping, then AdamW on a warmup + cosine schedule.

Warmup: Post-LN (the paper's x = LN(x + f(x)), `norm="post"`) needs the
linear learning-rate warmup: without it the first large Adam updates put the
un-normalised residual path out of range and training stalls or diverges.
Pre-LN is more forgiving; the same warmup costs it little.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxformer.nn import stacking
from jaxformer.train.rounding import update_rounding
from jaxformer.train.train_config import TrainConfig


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


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """`optax.clip_by_global_norm` (the same state, `optax.EmptyState`), with the clipped
    gradients as g * (max_norm / norm) instead of (g / norm) * max_norm: a multiply by a
    scalar, which XLA fuses into each of AdamW's moment updates, while optax's per-element
    division made it store the clipped gradients (a temporary the size of the
    parameters: 513 MiB for SmolLM2-135M). Unclipped steps are bit-identical to optax's;
    clipped ones differ by float rounding."""
    def update(updates, state, params=None):
        del params
        norm = optax.global_norm(updates)
        clipped = ~(norm < max_norm)  # as optax: a NaN norm clips (to NaN)
        scale = max_norm / jnp.where(clipped, norm, 1.0)
        return jax.tree_util.tree_map(
            lambda g: jnp.where(clipped, g * scale.astype(g.dtype), g), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """The one optimizer: clip the global gradient norm, then AdamW on the schedule.

    `tc.update_rounding` "kahan" or "stochastic" (bfloat16 parameters:
    `jaxformer.train.rounding`) adds the transformation that applies the updates
    without rounding them away; "nearest" leaves the chain (and checkpoints) as they were.
    """
    parts = [clip_by_global_norm(tc.clip_norm),
             optax.adamw(learning_rate_schedule(tc), b1=tc.b1, b2=tc.b2, eps=1e-9,
                         weight_decay=tc.weight_decay, mask=decay_mask)]
    if tc.update_rounding != "nearest":
        parts.append(update_rounding(tc.update_rounding))
    return optax.chain(*parts)

"""The jitted train step: dropout key, loss, gradients of the trainable part, optimizer update."""

from __future__ import annotations

from typing import Callable, Optional

import jax
import optax

from jaxformer.backends import cpu
from jaxformer.config import TransformerConfig
from jaxformer.parallel import partitioning
from jaxformer.parallel.sharding import data_sharding, replicated
from jaxformer.train.loss import (chunked_lm_loss, label_pad_id, loss_and_metrics,
                                  loss_chunk_length, model_logits)
from jaxformer.train.state import TrainState, trainable_params, with_trainable
from jaxformer.train.tasks import Batch


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
                    shardings: Optional[TrainState] = None,
                    loss_chunk_tokens: Optional[int] = None) -> Callable:
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

    `loss_chunk_tokens` (`TrainConfig.loss_chunk_tokens`): a decoder-only LM's loss is
    computed over chunks of about this many tokens (`loss.chunked_lm_loss`: the batch's
    (B, T, V) logits never exist); None = where the logits are large (vocabularies of
    pretrained models), 0 = never.
    """

    def train_step(state: TrainState, batch: Batch):
        key = dropout_key(state.rng, state.step, model.config)

        tc = loss_chunk_length(model, batch, loss_chunk_tokens)

        def loss_fn(params):
            if tc:
                with partitioning.activation_sharding(mesh if shardings is not None else None):
                    return chunked_lm_loss(model, params, batch, tc, deterministic=False,
                                           rngs={"dropout": key},
                                           label_smoothing=label_smoothing,
                                           project_grads=not model.config.lora_rank)
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

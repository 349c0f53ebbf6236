"""The jitted train step: dropout key, loss, gradients of the trainable part, optimizer update."""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
import optax
from jax.extend import core as jex_core

from jaxformer.backends import threefry
from jaxformer.config import TransformerConfig
from jaxformer.parallel import partitioning
from jaxformer.parallel.sharding import data_sharding, replicated
from jaxformer.train.loss import (chunked_lm_loss, label_pad_id, loss_and_metrics,
                                  loss_chunk_length, model_logits)
from jaxformer.train.state import TrainState, trainable_params, with_trainable
from jaxformer.train.tasks import Batch


def dropout_key(rng: jax.Array, step, config: Optional[TransformerConfig] = None) -> jax.Array:
    """The dropout key of `step`: `jax.random.fold_in(rng, step)`. A raw threefry key
    (uint32 (2,), JAX's default implementation) becomes a key of
    `backends.threefry.UNROLLED_THREEFRY`: the same bits, drawn by the unrolled hash on
    every platform (JAX's own threefry is a rolled loop on the CPU, whose state words
    for every mask of the step were alive at once: 134 of the bench step's 373 MiB of
    temporaries). Other key kinds are left as they are. `config` is accepted for
    callers that pass it; the key does not depend on it."""
    del config
    if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key) or rng.shape != (2,) or \
            jax.config.jax_default_prng_impl != "threefry2x32":
        return jax.random.fold_in(rng, step)
    return jax.random.fold_in(threefry.unrolled(rng), step)


# XLA places a program's temporaries in one block by default, allocated and freed at every
# call. On a host (XLA:CPU) a block that large is a fresh `mmap` each step with the C
# library's default allocator, faulted in page by page (the bench train step: 372 MiB,
# 95,000 faults, about a quarter of its CPU time). Heaps of at most HEAP_BYTES are small
# enough for glibc's heap to keep and reuse (its mmap threshold grows to at most 32 MiB);
# on an accelerator they are allocations of the device allocator like the one block.
HEAP_BYTES = 16 * 2**20
HEAPS_OPTION = "xla_multiheap_size_constraint_per_heap"


def largest_array_bytes(jaxpr) -> int:
    """Bytes of the largest array a (closed) jaxpr or any jaxpr inside it produces."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    largest = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            aval = var.aval
            if hasattr(aval, "shape") and hasattr(aval, "dtype"):
                largest = max(largest, aval.size * aval.dtype.itemsize)
        for sub in jex_core.jaxprs_in_params(eqn.params):
            largest = max(largest, largest_array_bytes(sub))
    return largest


def heap_options(jaxpr, heap_bytes: int = HEAP_BYTES) -> Optional[dict]:
    """Compiler options that split a program's temporaries into heaps of at most
    `heap_bytes`, or None where one of its arrays is larger (XLA would warn about each
    such array, and a heap that large is a fresh mapping each call anyway)."""
    if largest_array_bytes(jaxpr) > heap_bytes:
        return None
    return {HEAPS_OPTION: heap_bytes}


def compile_train_step(step, state, batch):
    """`step.lower(state, batch).compile()` for a jitted train step (`make_train_step`),
    its temporaries in small heaps where its arrays allow (`heap_options`): the same
    program, the same results bit for bit; on a CPU host the step's memory stays mapped
    between steps instead of being faulted in again at each one."""
    traced = step.trace(state, batch)
    return traced.lower().compile(compiler_options=heap_options(traced.jaxpr))


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

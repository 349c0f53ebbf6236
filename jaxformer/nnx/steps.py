"""Training and cached decoding through an NNX bridge module (`bridge.to_nnx`).

    optimizer = nnx.Optimizer(module, make_optimizer(train_config), wrt=nnx.Param)
    metrics = train_step(module, optimizer, batch)      # module and optimizer updated in place
    logits_BTV, cache = decode_step(module, cache, tokens_BT)

The loss, the batches and the decoders are jaxformer's own (`train.loss`,
`decode.cache`), run on the module's `nnx.Param` state: `linen(module)` is the
(Linen model, parameter pytree) pair every jaxformer entry point takes, so
`jf.generate(*linen(module), prompt_BP, max_new_tokens=8)` decodes with it.
"""

from __future__ import annotations

from typing import Optional

import jax
import optax
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from jaxformer.decode.cache import DecodeCache, cached_forward
from jaxformer.nnx.bridge import to_params
from jaxformer.parallel import partitioning
from jaxformer.train.loss import label_pad_id, loss_and_metrics, model_logits


def linen(module) -> tuple:
    """(the wrapped Linen model, its parameter pytree from the module's state)."""
    return module.to_nnx__module, to_params(module)


def loss_fn(module, batch, *, label_smoothing: float = 0.0,
            dropout_key: Optional[jax.Array] = None) -> tuple[jax.Array, dict]:
    """(loss, metrics) of a task `Batch` (a `Transformer`) or a `data.LMBatch` (a
    `DecoderOnlyLM`): `train.loss.loss_and_metrics` of the module's logits. Dropout
    is on iff `dropout_key` is given."""
    model, params = linen(module)
    logits_BTV, labels_BT, weights_BT = model_logits(
        model, params, batch, deterministic=dropout_key is None,
        rngs=None if dropout_key is None else {"dropout": dropout_key})
    return loss_and_metrics(logits_BTV, labels_BT, label_pad_id(model.config, weights_BT),
                            label_smoothing, weights_BT)


@nnx.jit(static_argnames=("label_smoothing", "mesh"))
def train_step(module, optimizer: nnx.Optimizer, batch, *, label_smoothing: float = 0.0,
               dropout_key: Optional[jax.Array] = None, mesh: Optional[Mesh] = None) -> dict:
    """One optimizer step on `batch`: gradients of `loss_fn` with respect to the
    module's `nnx.Param`s, `optimizer.update`; returns the metrics (with
    "grad_norm").

    `mesh`: the step of a sharded module (`bridge.shard`): activations are
    constrained at layer boundaries and the new parameters and optimizer moments
    kept in their rules-table shardings, as jaxformer's own train step does;
    without, shardings are left to the compiler.
    """
    def loss(m):
        with partitioning.activation_sharding(mesh):
            return loss_fn(m, batch, label_smoothing=label_smoothing, dropout_key=dropout_key)

    (_, metrics), grads = nnx.value_and_grad(loss, has_aux=True)(module)
    optimizer.update(module, grads)
    if mesh is not None:
        pin_to_rules(module, mesh)
        pin_to_rules(optimizer, mesh)
    return {**metrics, "grad_norm": _global_norm(grads)}


def pin_to_rules(node, mesh: Mesh) -> None:
    """Constrain (under jit) every variable of `node` that carries logical axis names
    (`out_sharding` metadata: parameters, optimizer moments) to its sharding under
    jaxformer's rules table on `mesh`; everything else replicated."""
    state = nnx.state(node)
    for _, var in state.flat_state():
        names = var.get_metadata().get("out_sharding")
        spec = partitioning.mesh_specs(P(*names)) if names else P()
        var.set_value(jax.lax.with_sharding_constraint(
            var.get_value(), partitioning.shardings(spec, mesh)))
    nnx.update(node, state)


def _global_norm(grads) -> jax.Array:
    return optax.global_norm(jax.tree_util.tree_leaves(grads))


def decode_step(module, cache: DecodeCache, tokens_BT: jax.Array) -> tuple[jax.Array, DecodeCache]:
    """`decode.cache.cached_forward` on the module: feed (B, T) tokens into the cache;
    returns (logits (B, T, V) float32, the cache after them). Jit it with `nnx.jit`."""
    return cached_forward(*linen(module), cache, tokens_BT)

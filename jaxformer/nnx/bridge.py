"""Any jaxformer model as a Flax NNX module holding given parameters, and back.

    module = to_nnx(model, params)          # nnx.Module; its nnx.Param state IS `params`
    logits = module(tokens_BT)              # the Linen model's logits, exactly
    params = to_params(module)              # the parameter pytree again, bitwise

A wrapper over `flax.nnx.bridge.ToNNX`, not a rewrite: the Linen module runs
unchanged. The bridge is built abstractly (`nnx.eval_shape`: nothing is
initialised, no random weights are drawn) with the logical axis names of
`jaxformer.nn.axes` attached, then each variable's value is replaced by the
given array, so every `nnx.Param` carries `out_sharding` = its logical names
(("embed", "heads", "kv"), ...) and `nnx.get_partition_spec` and the rules table
of `jaxformer.parallel.partitioning` apply (`logical_specs`, `param_shardings`,
`shard`). The state's tree is the parameter tree's: `layers_0/self_attn/query/
kernel` is a path in both.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import numpy as np
from flax import nnx
from flax.traverse_util import flatten_dict, unflatten_dict
from jax.sharding import Mesh

from jaxformer.nn import axes
from jaxformer.parallel import partitioning


def _abstract_bridge(model, inputs: tuple) -> nnx.bridge.ToNNX:
    """The ToNNX module of `model` with abstract (ShapeDtypeStruct) parameters that
    carry their logical axis names; nothing is computed."""
    def build(*xs):
        return nnx.bridge.lazy_init(nnx.bridge.ToNNX(model, rngs=nnx.Rngs(0)), *xs)

    # eager sharding off: the names are metadata here, placement is `shard`'s job.
    with axes.logical_names(), nnx.use_eager_sharding(False):
        return nnx.eval_shape(build, *inputs)


def to_nnx(model, params, *inputs, rngs: Optional[nnx.Rngs] = None) -> nnx.bridge.ToNNX:
    """`model` (a `DecoderOnlyLM` or `Transformer`) as an `nnx.Module` holding `params`.

    `params`: the model's parameter pytree (the inside of {"params": ...}, e.g.
    from `jaxformer.models.load`); the module's state holds these very arrays,
    nothing is re-initialised. `inputs`: what `model.init` takes after the key
    (default `partitioning.example_inputs(model)`; a model with a stem needs its
    own). `rngs`: streams drawn per call (e.g. `nnx.Rngs(dropout=0)` for training
    with dropout); default none (deterministic calls need none).

    Calling the module is calling the Linen model: `module(tokens_BT)`,
    `module(src, tgt)`, any method by `method=` (`module.encode(src)` too).
    Raises ValueError naming the first parameter whose path, shape or dtype
    differs from the model's.
    """
    inputs = inputs or partitioning.example_inputs(model)
    abstract = _abstract_bridge(model, tuple(jax.ShapeDtypeStruct(x.shape, x.dtype)
                                             for x in inputs))
    abstract.to_nnx__rngs = rngs  # the init streams were abstract; keep the caller's
    graphdef, state, rest = nnx.split(abstract, nnx.Param, ...)
    given = flatten_dict(params, sep="/")
    wanted = {"/".join(map(str, path)): var for path, var in state.flat_state()}
    missing, extra = sorted(set(wanted) - set(given)), sorted(set(given) - set(wanted))
    if missing or extra:
        raise ValueError(f"params do not have the tree of this {type(model).__name__}: "
                         f"missing {missing[:3]}, unexpected {extra[:3]} (a scanned/unscanned "
                         "layout mismatch, or another model's parameters?)")
    for name, var in wanted.items():
        value, spec = given[name], var.get_value()
        if tuple(value.shape) != tuple(spec.shape) or np.dtype(value.dtype) != np.dtype(
                spec.dtype):
            raise ValueError(f"params[{name!r}] is {value.dtype}{list(value.shape)}, the model "
                             f"wants {np.dtype(spec.dtype)}{list(spec.shape)}")
        var.set_value(value)
    return nnx.merge(graphdef, state, rest)


def to_params(module_or_state) -> dict:
    """The parameter pytree (nested dicts of arrays, the tree `model.init` returns) of
    an NNX bridge module or of its `nnx.Param` state: the same arrays, bitwise."""
    state = module_or_state if isinstance(module_or_state, nnx.State) else nnx.state(
        module_or_state, nnx.Param)
    flat = {path: var.get_value() if isinstance(var, nnx.Variable) else var
            for path, var in state.flat_state()}
    return unflatten_dict({tuple(str(k) for k in path): v for path, v in flat.items()})


def logical_specs(module) -> dict:
    """Params-shaped tree of logical PartitionSpecs (P("embed", "heads", "kv"), ...),
    read from the module's metadata by `nnx.get_partition_spec`."""
    specs = nnx.get_partition_spec(nnx.state(module, nnx.Param))
    return to_params(specs)


def param_shardings(module, mesh: Mesh) -> dict:
    """Params-shaped tree of NamedShardings on `mesh` under jaxformer's rules table
    (`partitioning.LOGICAL_AXIS_RULES`); raises ValueError, by parameter path, for a
    dimension that does not split evenly."""
    specs = partitioning.mesh_specs(logical_specs(module))
    partitioning.check_divisible_params(to_params(module), specs, mesh)
    return partitioning.shardings(specs, mesh)


def shard(module, mesh: Mesh):
    """Place the module's parameters on `mesh` by the rules (in place; returns the module):
    split over "fsdp" and "tensor", replicated over "data"."""
    placed = jax.device_put(to_params(module), param_shardings(module, mesh))
    state = nnx.state(module, nnx.Param)
    nnx.replace_by_pure_dict(state, _keyed_like(state, placed))
    nnx.update(module, state)
    return module


def _keyed_like(state: nnx.State, params: dict) -> Any:
    """`params` re-keyed with the state's own keys (ints stay ints)."""
    flat = flatten_dict(params, sep="/")
    return unflatten_dict({path: flat["/".join(map(str, path))]
                           for path, _ in state.flat_state()})



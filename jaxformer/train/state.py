"""The train state, an explicit pytree, and how it is created in its shardings.

Sharding (`jaxformer.parallel.partitioning`): the state is created directly in its
shardings (abstract shapes first, then a jitted init with `out_shardings`),
parameters and each optimizer moment split by the logical-axis rules over the
mesh's "fsdp" / "tensor" axes. On a mesh of "data" alone (the default)
everything is replicated: plain data parallelism.

Fine-tuning: `init_params` start from given (pretrained) parameters instead of
random ones. With `config.lora_rank > 0` only the LoRA adapters train
(`jaxformer.nn.lora`): `TrainState.params` holds the whole tree (base and
adapters), `TrainState.opt_state` is the optimizer state of the adapters alone
(`trainable_params`).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Optional

import flax
import jax
import jax.numpy as jnp
import optax

from jaxformer.config import TransformerConfig
from jaxformer.nn import lora, stacking
from jaxformer.nn.model import Transformer
from jaxformer.parallel import partitioning
from jaxformer.parallel.partitioning import make_mesh
from jaxformer.parallel.sharding import replicated


@flax.struct.dataclass
class TrainState:
    """The whole state of a run, an explicit pytree (what a checkpoint holds).

    step: int32 scalar, optimizer steps taken. params: the model's parameter
    pytree (all of it, LoRA adapters included). opt_state: optax state of
    `trainable_params(config, params)` (LoRA: the adapters only). rng: base dropout key (raw uint32 key);
    step s uses `fold_in(rng, s)`, so the key never has to be split in place.
    """

    step: jnp.ndarray
    params: Any
    opt_state: Any
    rng: jnp.ndarray


def trainable_params(config: TransformerConfig, params: Any) -> Any:
    """The part of `params` (or of any params-shaped tree) that training updates:
    all of it, or with `config.lora_rank > 0` the LoRA adapters alone."""
    return lora.split_adapters(params)[0] if config.lora_rank else params


def with_trainable(config: TransformerConfig, params: Any, trainable: Any) -> Any:
    """`params` with its `trainable_params` part replaced by `trainable`."""
    return lora.join(trainable, lora.split_adapters(params)[1]) if config.lora_rank \
        else trainable


def check_init_params(model, init_params: Any, input_shapes: tuple) -> Any:
    """`init_params` in the model's layer layout, checked against the model's tree
    (every parameter but the LoRA adapters, same shapes); ValueError naming the
    first differing entries. Nothing is computed (abstract shapes)."""
    c = model.config
    init_params = stacking.to_layout(init_params, c.scan_layers)
    inputs = [jax.ShapeDtypeStruct(shape, jnp.int32) for shape in input_shapes]
    abstract = jax.eval_shape(model.init, jax.random.PRNGKey(0), *inputs)["params"]
    want = flax.traverse_util.flatten_dict(lora.split_adapters(abstract)[1], sep="/")
    have = flax.traverse_util.flatten_dict(dict(init_params), sep="/")
    differ = sorted(set(want) ^ set(have))[:4] or [
        f"{k} {tuple(have[k].shape)} (model: {want[k].shape})" for k in sorted(want)
        if tuple(have[k].shape) != tuple(want[k].shape)][:4]
    if differ:
        raise ValueError(f"init_params do not fit the model (LoRA adapters excepted); "
                         f"differing entries: {', '.join(differ)}")
    return init_params


def init_train_state(model, tx: optax.GradientTransformation, input_shapes: tuple, seed,
                     init_params: Any = None) -> TrainState:
    """Traceable init from token inputs of `input_shapes` ((src, tgt) or (tokens,));
    `seed` may be traced, so one compilation serves every seed.

    `init_params` (checked by `check_init_params`): the starting parameters
    (fine-tuning), cast to the model's parameter dtype; LoRA adapters absent
    from them are initialised from the seed. The random parameters they
    replace are never computed under jit (dead code)."""
    root = jax.random.PRNGKey(seed)
    inputs = [jnp.zeros(shape, jnp.int32) for shape in input_shapes]
    params = model.init(jax.random.fold_in(root, 0), *inputs)["params"]
    if init_params is not None:
        adapters, base = lora.split_adapters(params)
        base = jax.tree_util.tree_map(lambda new, old: jnp.asarray(new, old.dtype),
                                      lora.split_adapters(init_params)[1], base)
        params = lora.join(adapters, base)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=tx.init(trainable_params(model.config, params)),
                      rng=jax.random.fold_in(root, 2))


def train_state_shardings(model, tx: optax.GradientTransformation, input_shapes: tuple,
                          mesh, rules=partitioning.LOGICAL_AXIS_RULES) -> TrainState:
    """A `TrainState` of `NamedSharding`s: parameters by their logical axes under `rules`,
    every optax leaf shaped like a parameter as that parameter, the rest replicated.

    Nothing is computed (`jax.eval_shape`). Raises ValueError, by parameter path,
    if a split dimension does not divide over its mesh axes.
    """
    inputs = [jax.ShapeDtypeStruct(shape, jnp.int32) for shape in input_shapes]
    specs = partitioning.mesh_specs(partitioning.logical_specs(model, *inputs), rules)
    abstract = jax.eval_shape(functools.partial(init_train_state, model, tx, input_shapes), 0)
    partitioning.check_divisible_params(abstract.params, specs, mesh)
    params = partitioning.shardings(specs, mesh)
    return TrainState(step=replicated(mesh), params=params,
                      opt_state=partitioning.state_shardings(
                          tx, abstract.opt_state, trainable_params(model.config, params), mesh),
                      rng=replicated(mesh))


def make_init(model, tx: optax.GradientTransformation, input_shapes: tuple, mesh,
              shardings: Optional[TrainState] = None) -> Callable:
    """jit(init)(seed) -> TrainState, each leaf created directly in its sharding."""
    if shardings is None:
        shardings = train_state_shardings(model, tx, input_shapes, mesh)
    return jax.jit(functools.partial(init_train_state, model, tx, input_shapes),
                   out_shardings=shardings)


def make_init_from(model, tx: optax.GradientTransformation, input_shapes: tuple, mesh,
                   shardings: Optional[TrainState] = None) -> Callable:
    """init_from(seed, init_params, donate=False) -> TrainState starting from
    `init_params` (fine-tuning; `init_train_state`), checked (`check_init_params`),
    created in its shardings. `donate=True` hands `init_params`' buffers to the state
    (no second copy of the weights; the arrays passed are deleted): for parameters
    loaded only to start training from."""
    if shardings is None:
        shardings = train_state_shardings(model, tx, input_shapes, mesh)
    start = functools.partial(init_train_state, model, tx, input_shapes)
    start_from = jax.jit(start, out_shardings=shardings)
    start_donating = jax.jit(start, out_shardings=shardings, donate_argnums=1)
    base_shardings = lora.split_adapters(shardings.params)[1]

    def init_from(seed, init_params, donate: bool = False):
        init_params = check_init_params(model, init_params, input_shapes)
        # In the shardings of the state (a no-op if already there): jit takes no
        # committed arguments on other devices.
        init_params = jax.device_put(init_params, base_shardings)
        if not donate:
            return start_from(seed, init_params)
        with warnings.catch_warnings():  # buffers of another dtype than the state's: copied
            warnings.filterwarnings("ignore", "Some donated buffers were not usable")
            return start_donating(seed, init_params)

    return init_from


def create_train_state(model: Transformer, tx: optax.GradientTransformation, seed: int,
                       src_len: int, tgt_len: int, mesh=None) -> TrainState:
    """Initialise parameters and optimizer state on `mesh` (default: all devices on
    "data", i.e. replicated), sharded by `train_state_shardings`."""
    mesh = make_mesh() if mesh is None else mesh
    return make_init(model, tx, ((1, src_len), (1, tgt_len)), mesh)(seed)

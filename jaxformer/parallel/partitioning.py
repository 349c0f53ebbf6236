"""Logical-axis sharding: parameter axis names, the one rules table, the mesh, state shardings.

Every parameter's dimensions carry logical names (Flax partitioning
metadata, `nn.with_logical_partitioning`); one table maps those names to the
axes of a 3-D device mesh, as MaxText's `logical_axis_rules` do::

    mesh axes   data    the batch is split, parameters are replicated
                fsdp    the batch is split AND parameters / optimizer moments are
                        split along their "embed" dimension (ZeRO-3 / FSDP):
                        each device holds 1/fsdp of them, gathered per use
                tensor  heads, FFN width and vocabulary are split (Megatron)

Logical names (letters of the package's dimension key)::

    batch B   length T/S   embed D   heads H   kv_heads G   kv K   mlp F
    vocab V   layers L (the stacked axis of a scanned stack)   norm (norm
    scales and biases)   conv_width, conv_in (a stem's convolutions)

Shapes of the parameters (see `model.py` for the whole tree)::

    embedding (V, D)                 ("vocab", "embed")
    query kernel (D, H, K)           ("embed", "heads", "kv")
    key / value kernel (D, G, K)     ("embed", "kv_heads", "kv")
    out kernel (H, K, D)             ("heads", "kv", "embed")
    ffn wi / gate (D, F), wo (F, D)  ("embed", "mlp"), ("mlp", "embed")
    out_proj (D, V)                  ("embed", "vocab")
    scanned stacks                   ("layers", ...) in front
    LoRA adapter a (*in, r), b (r, *out)   the kernel's names, "lora" for r

`model.init` still returns plain arrays: the names are attached only while
`logical_specs` traces the model (abstractly, `jax.eval_shape`), so the
parameter tree users see, save and convert is unchanged, and so is every
initial value (the wrapper only boxes what the initializer returns).

Pieces::

    make_mesh("data=2,fsdp=2,tensor=2")      a Mesh; one entry may be -1 (the rest)
    logical_specs(model, *inputs)            params-shaped tree of logical PartitionSpecs
    mesh_specs(logical)                      the same in mesh axes (LOGICAL_AXIS_RULES)
    check_divisible_params(params, specs, mesh)   every split dimension divides
    place_params(model, params, mesh)        params placed by the rules (decoding, eval)
    shardings(specs, mesh)                   NamedShardings (axes the mesh lacks dropped)
    state_shardings(tx, abstract_state, param_shardings, mesh)   + every optax leaf
    activation_sharding(mesh), constrain(x, names)   layer-boundary constraints
"""

from __future__ import annotations

import functools
import math
from typing import Any, Mapping, Optional, Sequence

import flax.linen as nn
import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxformer.nn import axes
from jaxformer.nn.model import DecoderOnlyLM, Transformer

MESH_AXES = ("data", "fsdp", "tensor")

# The one rules table: logical name -> mesh axis (or axes, or None = not split).
# A mesh axis is used at most once per array: the first rule that claims it wins
# (Flax's `logical_to_mesh_axes`), so "batch" of an activation takes data and fsdp.
LOGICAL_AXIS_RULES: tuple = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("activation_embed", None),  # the residual stream (B, T, D) is split by batch only
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("kv", None),
    ("norm", None),
    ("layers", None),
    ("lora", None),  # the rank of a LoRA adapter (jaxformer.nn.lora)
    ("conv_width", None),
    ("conv_in", None),
)



# --------------------------------------------------------------------------- the mesh


def parse_mesh_spec(spec: str | Mapping[str, int] | None, num_devices: int) -> dict[str, int]:
    """{"data": d, "fsdp": f, "tensor": t} with d * f * t == num_devices.

    `spec`: "data=2,fsdp=2,tensor=2" or {"data": 2, ...}; omitted axes have
    size 1; one entry may be -1 (the rest of the devices); None or "" puts
    every device on "data". Raises ValueError on malformed entries, unknown
    axis names, repeated names, non-positive sizes, two -1s, or sizes whose
    product is not the device count.
    """
    if spec is None or (isinstance(spec, str) and not spec.strip()):
        return {"data": num_devices, "fsdp": 1, "tensor": 1}
    if isinstance(spec, str):
        entries = []
        for part in spec.split(","):
            name, eq, value = part.strip().partition("=")
            name = name.strip()
            try:
                size = int(value.strip()) if eq else None
            except ValueError:
                size = None
            if size is None:
                raise ValueError(f"mesh spec {spec!r}: entry {part.strip()!r} is not "
                                 f"name=size (e.g. 'data=2,fsdp=2,tensor=2')")
            entries.append((name, size))
    elif isinstance(spec, Mapping):
        entries = list(spec.items())
    else:
        raise TypeError(f"mesh spec must be a str like 'data=2,fsdp=4' or a dict, got "
                        f"{type(spec).__name__}")
    sizes: dict[str, int] = {}
    for name, size in entries:
        if name not in MESH_AXES:
            raise ValueError(f"mesh spec {spec!r}: unknown axis {name!r}; the axes are "
                             f"{', '.join(MESH_AXES)}")
        if name in sizes:
            raise ValueError(f"mesh spec {spec!r}: axis {name!r} is given twice")
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or (
                size < 1 and size != -1):
            raise ValueError(f"mesh spec {spec!r}: {name}={size} must be a positive int "
                             f"(or -1 for the rest of the devices)")
        sizes[name] = int(size)
    rest = [name for name, size in sizes.items() if size == -1]
    if len(rest) > 1:
        raise ValueError(f"mesh spec {spec!r}: only one axis may be -1, got "
                         f"{', '.join(rest)}")
    full = {name: sizes.get(name, 1) for name in MESH_AXES}
    known = math.prod(size for size in full.values() if size != -1)
    if rest:
        if num_devices % known:
            raise ValueError(f"mesh spec {spec!r}: the other axes take {known} devices, "
                             f"which does not divide the {num_devices} devices")
        full[rest[0]] = num_devices // known
    elif known != num_devices:
        raise ValueError(f"mesh spec {spec!r} has {known} devices "
                         f"({'x'.join(str(full[a]) for a in MESH_AXES)}) but there are "
                         f"{num_devices}: the sizes must multiply to the device count "
                         f"(or give one axis as -1)")
    return full


def make_mesh(spec: str | Mapping[str, int] | None = None, *,
              devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A ("data", "fsdp", "tensor") mesh over `devices` (default: all of `jax.devices()`).

    `spec` as in `parse_mesh_spec`: "data=2,fsdp=2,tensor=2", {"fsdp": -1}, or
    None (all devices on "data": today's data parallelism). Errors come before
    anything compiles. Devices are laid out by `mesh_utils.create_device_mesh`
    (on TPU / GPU it puts the last axis, "tensor", on the fastest links).
    """
    from jax.experimental import mesh_utils  # noqa: PLC0415

    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("devices must not be empty")
    sizes = parse_mesh_spec(spec, len(devices))
    shape = tuple(sizes[a] for a in MESH_AXES)
    try:
        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    except Exception:  # noqa: BLE001 (CPU or an odd topology: plain order)
        grid = np.array(devices).reshape(shape)
    return Mesh(grid, MESH_AXES)


def mesh_spec_string(mesh: Mesh) -> str:
    """"data=2,fsdp=2,tensor=2": the mesh's axis sizes, as `make_mesh` reads them."""
    return ",".join(f"{name}={size}" for name, size in mesh.shape.items())


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes a batch is split over: those of "batch" in the rules that the mesh has."""
    return tuple(a for a in _rule("batch") if a in mesh.axis_names)


def batch_shards(mesh: Mesh) -> int:
    """How many pieces a batch is split into (data x fsdp)."""
    return math.prod(mesh.shape[a] for a in batch_axes(mesh))


def _rule(name: str) -> tuple[str, ...]:
    for logical, axes in LOGICAL_AXIS_RULES:
        if logical == name:
            return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return ()


# --------------------------------------------------------------------------- parameter names


def _keystr(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def logical_specs(model: nn.Module, *inputs, **kwargs) -> Any:
    """Params-shaped tree of `PartitionSpec`s of logical names, e.g. P("embed", "heads", "kv").

    `inputs`: what `model.init` takes after the key (arrays or
    `jax.ShapeDtypeStruct`s); traced abstractly (`jax.eval_shape`), nothing is
    computed. Raises ValueError naming any parameter without logical axes.
    """
    with axes.logical_names():
        boxed = jax.eval_shape(functools.partial(model.init, **kwargs),
                               jax.random.PRNGKey(0), *inputs)["params"]
    is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)  # noqa: E731
    unnamed = [_keystr(path) for path, leaf in
               jax.tree_util.tree_leaves_with_path(boxed, is_leaf=is_box) if not is_box(leaf)]
    if unnamed:
        raise ValueError(f"parameters without logical axis names: {', '.join(unnamed)}")
    return jax.tree_util.tree_map(lambda box: P(*box.names), boxed, is_leaf=is_box)


def mesh_specs(logical_tree: Any, rules: Sequence = LOGICAL_AXIS_RULES) -> Any:
    """Logical PartitionSpecs -> PartitionSpecs of mesh axes under `rules`."""
    return jax.tree_util.tree_map(lambda spec: nn.logical_to_mesh_axes(tuple(spec), rules),
                                  logical_tree, is_leaf=lambda x: isinstance(x, P))


def _fit_spec(spec: P, mesh: Mesh) -> P:
    """`spec` without the axes `mesh` lacks or has of size 1 (a 1-D "data" mesh works too)."""
    def keep(entry):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        axes = tuple(a for a in axes if mesh.shape.get(a, 1) > 1)
        return None if not axes else axes[0] if len(axes) == 1 else axes
    out = [keep(entry) for entry in spec]
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def shardings(specs: Any, mesh: Mesh) -> Any:
    """PartitionSpecs of mesh axes -> NamedShardings on `mesh`."""
    return jax.tree_util.tree_map(lambda spec: NamedSharding(mesh, _fit_spec(spec, mesh)),
                                  specs, is_leaf=lambda x: isinstance(x, P))


def check_divisible_params(abstract_params: Any, specs: Any, mesh: Mesh) -> None:
    """Raise ValueError, by parameter path, for any dimension that does not split evenly.

    `abstract_params`: arrays or ShapeDtypeStructs; `specs`: mesh-axis specs.
    """
    bad = []
    leaves = jax.tree_util.tree_leaves_with_path(abstract_params)
    spec_leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P))
    for (path, leaf), spec in zip(leaves, spec_leaves):
        for dim, entry in enumerate(_fit_spec(spec, mesh)):
            axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
            pieces = math.prod(mesh.shape[a] for a in axes)
            if leaf.shape[dim] % pieces:
                split = "x".join(f"{a}={mesh.shape[a]}" for a in axes)
                bad.append(f"{_keystr(path)} {tuple(leaf.shape)}: dimension {dim} of size "
                           f"{leaf.shape[dim]} does not divide over {split}")
    if bad:
        more = f"; and {len(bad) - 4} more" if len(bad) > 4 else ""
        raise ValueError("parameters do not split evenly over the mesh "
                         f"({mesh_spec_string(mesh)}): " + "; ".join(bad[:4]) + more)


def example_inputs(model: nn.Module) -> tuple:
    """What `model.init` takes after the key, as (1, 1) ShapeDtypeStructs: (tokens,)
    of a `DecoderOnlyLM`, (src, tgt) of a `Transformer` (src embedded (1, 1, D) if
    `config.encoder_input == "embedded"`). A model with a stem raises ValueError:
    its input's channels are the stem's, pass inputs explicitly."""
    tokens = jax.ShapeDtypeStruct((1, 1), np.int32)
    if isinstance(model, DecoderOnlyLM):
        return (tokens,)
    if isinstance(model, Transformer) and model.stem is None:
        c = model.config
        src = tokens if c.encoder_input == "tokens" else jax.ShapeDtypeStruct(
            (1, 1, c.d_model), np.float32)
        return (src, tokens)
    raise ValueError(f"no default inputs for a {type(model).__name__}"
                     f"{' with a stem' if getattr(model, 'stem', None) else ''}: pass the "
                     f"arrays (or ShapeDtypeStructs) its init takes")


@functools.lru_cache(maxsize=32)
def _param_specs(model: nn.Module, input_specs: tuple) -> Any:
    inputs = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in input_specs]
    return mesh_specs(logical_specs(model, *inputs))


def param_shardings(model: nn.Module, params: Any, mesh: Mesh, *inputs) -> Any:
    """NamedShardings of `params` on `mesh` by the logical-axis rules.

    `inputs`: what `model.init` takes after the key (default `example_inputs`).
    Raises ValueError, by parameter path, if `params` is not the model's tree or
    a split dimension does not divide over its mesh axes (nothing is placed).
    """
    inputs = inputs or example_inputs(model)
    specs = _param_specs(model, tuple((tuple(x.shape), np.dtype(x.dtype)) for x in inputs))
    want = jax.tree_util.tree_structure(specs, is_leaf=lambda x: isinstance(x, P))
    if jax.tree_util.tree_structure(params) != want:
        have = {_keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)}
        model_names = {_keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(
            specs, is_leaf=lambda x: isinstance(x, P))}
        diff = sorted(model_names - have)[:3] + sorted(have - model_names)[:3]
        raise ValueError(f"params do not have the tree of this {type(model).__name__} (a "
                         f"scanned/unscanned layout mismatch, or another model?); differing "
                         f"entries: {', '.join(diff) or 'the container types'}")
    check_divisible_params(params, specs, mesh)
    return shardings(specs, mesh)


def place_params(model: nn.Module, params: Any, mesh: Mesh, *inputs) -> Any:
    """`params` placed on `mesh` by the rules (`param_shardings`): split over "fsdp"
    and "tensor", replicated over "data". Jitted functions (the decoding entry
    points, `training.evaluate`) follow these shardings: tensor-parallel decoding
    is `greedy_decode(model, place_params(model, params, mesh), src_BS, ...)`.
    A no-op for arrays already placed so."""
    return jax.device_put(params, param_shardings(model, params, mesh, *inputs))


def state_shardings(tx: optax.GradientTransformation, abstract_opt_state: Any,
                    param_shardings: Any, mesh: Mesh) -> Any:
    """Shardings of an optax state: each parameter-shaped leaf (Adam's moments, ...) as
    its parameter, everything else (step counts) replicated."""
    return optax.tree_map_params(
        tx, lambda _, sharding: sharding, abstract_opt_state, param_shardings,
        transform_non_params=lambda _: NamedSharding(mesh, P()))


# --------------------------------------------------------------------------- activations


def activation_sharding(mesh: Optional[Mesh], rules: Sequence = LOGICAL_AXIS_RULES):
    """While tracing inside, `nn.axes.constrain` pins activations to `mesh` under `rules`."""
    return axes.activation_sharding(mesh, rules)

"""Converters between the two parameter layouts of a layer stack.

Per-layer (the default, `scan_layers=False`): one subtree per layer,
``encoder/layers_0/...``, ``encoder/layers_1/...`` (mirrors torch state dicts).
Stacked (`scan_layers=True`): one subtree ``encoder/layers/...`` whose every
leaf has a leading layer axis L (what `nn.scan` over the layer module wants).

The converters are pure and exact (stack / index, no arithmetic) and walk any
pytree: a parameter tree, a `TrainState`, or an optax state whose moments
(mu, nu) mirror the parameters. Each dict holding ``layers_{i}`` keys is
stacked, and each dict holding ``layers`` is unstacked; everything else is
kept as is.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Optional

import flax
import jax
import jax.numpy as jnp

STACKED = "layers"  # the key of a stacked stack
_PER_LAYER = re.compile(r"^layers_(\d+)$")


def layer_key(key) -> bool:
    """Whether a pytree path entry names a layer stack: ``layers`` or ``layers_{i}``."""
    name = str(getattr(key, "key", ""))
    return name == STACKED or bool(_PER_LAYER.match(name))


def _is_mapping(x) -> bool:
    return isinstance(x, Mapping)


def _map_mappings(fn, tree: Any) -> Any:
    """Apply `fn` to each outermost Mapping in `tree` (dataclasses, tuples traversed)."""
    return jax.tree_util.tree_map(lambda x: fn(x) if _is_mapping(x) else x, tree,
                                  is_leaf=_is_mapping)


def _rebuild(original: Mapping, items: dict) -> Mapping:
    return flax.core.freeze(items) if isinstance(original, flax.core.FrozenDict) else items


def _stack_dict(d: Mapping) -> Mapping:
    out, layers = {}, {}
    for key, value in d.items():
        match = _PER_LAYER.match(str(key))
        if match:
            layers[int(match.group(1))] = _stack_dict(value) if _is_mapping(value) else value
        else:
            out[key] = _map_mappings(_stack_dict, value)
    if layers:
        if sorted(layers) != list(range(len(layers))):
            raise ValueError(f"layers are not numbered 0..L-1: {sorted(layers)}")
        if STACKED in out:
            raise ValueError("a dict holds both 'layers' and 'layers_{i}': mixed layouts")
        out[STACKED] = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs),
                                              *(layers[i] for i in range(len(layers))))
    return _rebuild(d, out)


def _unstack_dict(d: Mapping) -> Mapping:
    out = {}
    for key, value in d.items():
        if key == STACKED:
            num_layers = {x.shape[0] for x in jax.tree_util.tree_leaves(value)}
            if len(num_layers) != 1:
                raise ValueError(f"stacked leaves disagree on the layer count: {num_layers}")
            for i in range(num_layers.pop()):
                out[f"layers_{i}"] = jax.tree_util.tree_map(lambda x, i=i: x[i], value)
        else:
            out[key] = _map_mappings(_unstack_dict, value)
    return _rebuild(d, out)


def stack_layers(tree: Any) -> Any:
    """Per-layer -> stacked: ``layers_{i}/...`` (each X) become ``layers/...`` (L, *X)."""
    return _map_mappings(_stack_dict, tree)


def unstack_layers(tree: Any) -> Any:
    """Stacked -> per-layer: ``layers/...`` (L, *X) become ``layers_{i}/...`` (each X)."""
    return _map_mappings(_unstack_dict, tree)


def layout(tree: Any) -> Optional[str]:
    """"stacked", "per-layer" or None (no layer stack found) of a pytree with params."""
    keys = set()
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys.update(str(getattr(p, "key", getattr(p, "name", ""))) for p in path)
    if STACKED in keys:
        return "stacked"
    if any(_PER_LAYER.match(k) for k in keys):
        return "per-layer"
    return None


def to_layout(tree: Any, scan_layers: bool) -> Any:
    """`tree` in the layout of a model with `scan_layers` (a no-op if it already is)."""
    have = layout(tree)
    if scan_layers and have == "per-layer":
        return stack_layers(tree)
    if not scan_layers and have == "stacked":
        return unstack_layers(tree)
    return tree


def check_layout(params: Any, scan_layers: bool, what: str = "params") -> None:
    """ValueError naming the converter when `params` do not fit `scan_layers`."""
    have = layout(params)
    if scan_layers and have == "per-layer":
        raise ValueError(f"{what} are per-layer (layers_0, layers_1, ...) but the model has "
                         "scan_layers=True: convert them with jaxformer.nn.stacking.stack_layers")
    if not scan_layers and have == "stacked":
        raise ValueError(f"{what} are stacked (layers/...) but the model has "
                         "scan_layers=False: convert them with jaxformer.nn.stacking.unstack_layers")


def for_decoding(model, params):
    """(the model unrolled without remat, params in the per-layer layout).

    Every decoding entry point goes through this, so decoding, beam search and
    the KV cache take both layouts: a cached step is one token deep, so it
    gains nothing from scan or remat, and the per-layer cache stays as it is.
    (Unstacking is a gather of each layer's slice, once per call, inside jit.)
    """
    c = model.config
    check_layout(params, c.scan_layers)
    if not c.scan_layers and c.remat == "none":
        return model, params
    return (type(model)(c.replace(scan_layers=False, remat="none")),
            unstack_layers(params) if c.scan_layers else params)

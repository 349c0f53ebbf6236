"""Logical axis names on parameters and activations (Flax's partitioning metadata).

Layers name each parameter's dimensions (`logical(init, ("embed", "mlp"))`) and
pin activations at layer boundaries (`constrain(x, ACTIVATION_BTD)`); the table
mapping names to mesh axes lives in `jaxformer.parallel.partitioning`, which
reads the names (`logical_names()`) and sets the mesh (`activation_sharding`).
Outside those contexts both are identities, so `model.init` returns plain arrays.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Optional, Sequence

import flax.linen as nn
import jax
from jax.sharding import Mesh

# Residual-stream activations (B, T, D) at layer boundaries.
ACTIVATION_BTD = ("batch", "length", "activation_embed")

_NAMING = contextvars.ContextVar("jaxformer_logical_names", default=False)
_ACTIVATIONS = contextvars.ContextVar("jaxformer_activation_sharding", default=None)


@contextlib.contextmanager
def logical_names():
    """Inside, initializers wrapped by `logical` box their values with their names."""
    token = _NAMING.set(True)
    try:
        yield
    finally:
        _NAMING.reset(token)


def logical(init_fn, names: tuple):
    """`init_fn`, whose values carry logical axis `names` inside `logical_names()`.

    Elsewhere it is `init_fn` itself (same values either way:
    `nn.with_logical_partitioning` only boxes the initializer's output).
    """
    if _NAMING.get():
        return nn.with_logical_partitioning(init_fn, names)
    return init_fn


@contextlib.contextmanager
def activation_sharding(mesh: Optional[Mesh], rules: Sequence):
    """While tracing inside, `constrain` pins activations to `mesh` under `rules`."""
    token = _ACTIVATIONS.set(None if mesh is None else (mesh, tuple(rules)))
    try:
        yield
    finally:
        _ACTIVATIONS.reset(token)


def constrain(x: jax.Array, names: tuple) -> jax.Array:
    """`x` constrained to the sharding of its logical `names` (`nn.with_logical_constraint`)
    inside `activation_sharding`; `x` itself elsewhere (init, decoding, eager calls)."""
    current = _ACTIVATIONS.get()
    if current is None:
        return x
    mesh, rules = current
    # Rules restricted to the axes this mesh really splits, so a 1-D "data" mesh works.
    fitted = tuple((name, tuple(a for a in ((axes,) if isinstance(axes, str) else axes or ())
                                if mesh.shape.get(a, 1) > 1) or None) for name, axes in rules)
    return nn.with_logical_constraint(x, names, mesh=mesh, rules=fitted)

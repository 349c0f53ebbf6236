"""Data parallelism with `jax.sharding`: one code path for 1 CPU, 8 GPUs or a TPU slice.

A 1-D `Mesh` over the local devices with the axis name "data". Batches are
split along their leading (B) axis, `NamedSharding(mesh, P("data"))`; the
parameters and optimizer state are replicated, `NamedSharding(mesh, P())`.
`jax.jit` then partitions the train step itself (GSPMD): each device computes
the loss of its slice and the gradient mean becomes an all-reduce. No `pmap`,
no per-device code.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA_AXIS = "data"


def make_mesh(devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A 1-D mesh named "data" over `devices` (default: all of `jax.devices()`)."""
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("devices must not be empty")
    return Mesh(np.array(devices), (DATA_AXIS,))


def data_sharding(mesh: Mesh) -> NamedSharding:
    """Leading axis split over the "data" axis."""
    return NamedSharding(mesh, P(DATA_AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def check_divisible(batch_size: int, mesh: Mesh, name: str = "batch_size") -> None:
    """Raise ValueError unless `batch_size` splits evenly over the mesh's devices."""
    devices = mesh.devices.size
    if batch_size % devices:
        raise ValueError(f"{name}={batch_size} does not divide over the {devices} devices of "
                         f"the mesh: use a multiple of {devices}")


def shard_batch(batch: Any, mesh: Mesh) -> Any:
    """Place every array of `batch` (leading axis B) split along "data"."""
    leaves = jax.tree_util.tree_leaves(batch)
    if leaves:
        check_divisible(leaves[0].shape[0], mesh)
    return jax.device_put(batch, data_sharding(mesh))


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Place every array of `tree` on all devices of the mesh."""
    return jax.device_put(tree, replicated(mesh))

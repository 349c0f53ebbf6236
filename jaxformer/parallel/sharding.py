"""Batch placement with `jax.sharding`: one code path for 1 CPU, 8 GPUs or a TPU slice.

On the mesh of `partitioning.make_mesh()` (every device on "data"), batches are
split along their leading (B) axis, `NamedSharding(mesh, P("data"))`; the
parameters and optimizer state are replicated, `NamedSharding(mesh, P())`.
`jax.jit` then partitions the train step itself (GSPMD): each device computes
the loss of its slice and the gradient mean becomes an all-reduce. No `pmap`,
no per-device code. Decoding follows the data the same way: a source batch
placed with `shard_batch` (parameters with `replicate`) decodes data-parallel,
each device running the loop on its own rows.

With "fsdp" or "tensor" axes too (`partitioning.make_mesh("data=2,fsdp=2")`),
parameters are split by logical axes; a batch is split over "data" x "fsdp".

On a CPU host JAX's default is one device for all cores, and the small ops of
a decode step (mostly (B, 256) x (256, F) matmuls) cannot keep several threads
busy. `use_cpu_cores_as_devices()` makes each core a device, so that a sharded
batch runs as one program per core.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxformer.parallel.partitioning import batch_axes, batch_shards


def use_cpu_cores_as_devices(num_devices: Optional[int] = None) -> int:
    """Split the CPU backend into `num_devices` devices (default: one per core).

    Call it right after `import jax`: JAX fixes its devices when its backends
    start (the first computation or `jax.devices()`). Only the CPU backend is
    affected; a GPU or TPU stays the default device. Returns the count.
    (A batch split over one device per core decodes faster on a CPU than one
    device owning every core: benchmarks/decode.py.)
    """
    count = (os.cpu_count() or 1) if num_devices is None else num_devices
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"num_devices must be a positive int, got {num_devices!r}")
    if jax.config.jax_num_cpu_devices == count:
        return count
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError as e:  # backends already started
        raise RuntimeError(
            f"use_cpu_cores_as_devices({num_devices}) came too late: JAX's backends have "
            "started (a JAX computation or jax.devices() ran first). Call it right after "
            "`import jax`.") from e
    return count


def data_sharding(mesh: Mesh) -> NamedSharding:
    """Leading axis split over the mesh's batch axes ("data", and "fsdp" if it has one)."""
    return NamedSharding(mesh, P(batch_axes(mesh)))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def check_divisible(batch_size: int, mesh: Mesh, name: str = "batch_size") -> None:
    """Raise ValueError unless `batch_size` splits evenly over the mesh's batch axes."""
    shards = batch_shards(mesh)
    if batch_size % shards:
        over = "x".join(f"{a}={mesh.shape[a]}" for a in batch_axes(mesh))
        raise ValueError(f"{name}={batch_size} does not divide over the {shards} devices of "
                         f"the mesh's batch axes ({over}): use a multiple of {shards}")


def shard_batch(batch: Any, mesh: Mesh) -> Any:
    """Place every array of `batch` (leading axis B) split along "data"."""
    leaves = jax.tree_util.tree_leaves(batch)
    if leaves:
        check_divisible(leaves[0].shape[0], mesh)
    return jax.device_put(batch, data_sharding(mesh))


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Place every array of `tree` on all devices of the mesh."""
    return jax.device_put(tree, replicated(mesh))

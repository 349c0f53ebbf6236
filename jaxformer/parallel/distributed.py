"""Several processes, one run: start and describe JAX's multi-process runtime.

Every process (one per host, typically) runs the same program; after
`initialize` `jax.devices()` lists the devices of all of them, a mesh spans
them all, and each jitted step runs as one program over the whole mesh, each
process feeding and computing its own devices' part (`jaxformer.train.fit`).

Where the settings come from, first match wins::

    initialize("10.0.0.1:1234", num_processes=2, process_id=0)   explicit
    JAXFORMER_COORDINATOR=10.0.0.1:1234 JAXFORMER_NUM_PROCESSES=2
        JAXFORMER_PROCESS_ID=0                                    the environment
    initialize("auto")     JAX's cluster detection (Slurm, Open MPI, Cloud TPU, k8s)
    none of them           one process: nothing to start

Process 0 runs the coordinator at HOST:PORT (it must be an address the other
hosts reach). Inconsistent settings raise ValueError before anything starts.
Then process 0 checks that the port is free (RuntimeError naming it), and any
other process waits, up to `timeout_s`, for the coordinator's port to answer
and raises `CoordinatorUnreachable` naming the address if it never does: JAX
itself would abort the process with a C++ log after its own timeout. Peers that
never come: every process that waited `timeout_s` for the others prints one line
naming what it waited for and exits with status 2 (JAX's wait cannot be
interrupted, and its own timeout is a C++ abort: status 134 and a stack dump).

CPU: cross-process collectives go over gloo (TCP), the default of JAX 0.10
(`jax_cpu_collectives_implementation`); nothing to configure.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import threading
import time
from typing import Any, Callable, Mapping, Optional

ENV = {"coordinator": "JAXFORMER_COORDINATOR", "num_processes": "JAXFORMER_NUM_PROCESSES",
       "process_id": "JAXFORMER_PROCESS_ID"}
AUTO = "auto"


class CoordinatorUnreachable(RuntimeError):
    """The coordinator did not answer within the timeout."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """Who this process is. `coordinator` "auto": JAX detects all three."""

    coordinator: str
    num_processes: Optional[int] = None
    process_id: Optional[int] = None


def settings(coordinator: Optional[str] = None, num_processes: Optional[int] = None,
             process_id: Optional[int] = None, environ: Mapping[str, str] = os.environ,
             names: Optional[Mapping[str, str]] = None) -> Optional[Settings]:
    """The checked settings from the arguments, else from `ENV`; None = one process.

    Raises ValueError when only some of the three are given, a number is not
    an int, num_processes < 1, process_id outside [0, num_processes), or the
    coordinator is not HOST:PORT. `names`: what messages call the arguments
    (the CLI's flags); settings from the environment are named by variable.
    """
    given = {"coordinator": coordinator, "num_processes": num_processes,
             "process_id": process_id}
    names = {name: name for name in given} | dict(names or {})
    if all(value is None for value in given.values()):
        given = {name: environ.get(var) or None for name, var in ENV.items()}
        names = ENV
    if given["coordinator"] == AUTO:
        if given["num_processes"] is not None or given["process_id"] is not None:
            raise ValueError(f"{names['coordinator']} 'auto' detects the process count and "
                             f"id itself: give neither {names['num_processes']} nor "
                             f"{names['process_id']}")
        return Settings(AUTO)
    missing = [names[name] for name, value in given.items() if value is None]
    if len(missing) == 3:
        return None
    if missing:
        raise ValueError(f"several processes need all of {', '.join(names.values())}; "
                         f"missing {', '.join(missing)}")
    count = _int(names["num_processes"], given["num_processes"])
    index = _int(names["process_id"], given["process_id"])
    if count < 1:
        raise ValueError(f"{names['num_processes']} must be >= 1, got {count}")
    if not 0 <= index < count:
        raise ValueError(f"{names['process_id']} must be in [0, {count}) for {count} "
                         f"processes, got {index}")
    split_address(given["coordinator"], names["coordinator"])
    return Settings(given["coordinator"], count, index)


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an int, got {value!r}") from None


def split_address(address: str, name: str = "coordinator") -> tuple[str, int]:
    """("10.0.0.1", 1234) from "10.0.0.1:1234" ("[::1]:1234" for IPv6); ValueError if not."""
    host, colon, port = str(address).rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{name} {address!r} must be HOST:PORT, e.g. 10.0.0.1:1234")
    return host, int(port)


def wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Return once `address` accepts a TCP connection; CoordinatorUnreachable after
    `timeout_s` seconds of refusals."""
    host, port = split_address(address)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(
                    2.0, deadline - time.monotonic()))):
                return
        except OSError as error:
            if time.monotonic() >= deadline:
                raise CoordinatorUnreachable(
                    f"no coordinator answered at {address} within {timeout_s:g} s "
                    f"({error.strerror or error}): is process 0 running, and is "
                    f"{address} its address as the other hosts see it?") from None
            time.sleep(0.2)


def check_port_free(address: str) -> None:
    """Process 0 serves the coordinator on `address`'s port: RuntimeError naming the
    port if something on this host already listens there."""
    _, port = split_address(address)
    with socket.socket(socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
        try:
            probe.bind(("", port))
        except OSError as error:
            raise RuntimeError(f"cannot serve the coordinator {address}: port {port} is "
                               f"taken on this host ({error.strerror or error})") from None


def initialize(coordinator: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None, *, timeout_s: float = 300.0,
               on_give_up: Optional[Callable[[], None]] = None) -> int:
    """Join the run's processes (see the module docstring); returns the process count.

    Call it before anything touches JAX's devices. One process (no settings
    anywhere): does nothing and returns 1. If they do not all join within
    `timeout_s`, the process prints one line and exits with status 2 (JAX's own
    deadline would abort it); `on_give_up()` runs first (e.g. releasing a lock:
    no `finally` or `with` block runs after that exit).
    """
    import jax  # noqa: PLC0415

    chosen = settings(coordinator, num_processes, process_id)
    if chosen is None:
        return 1
    if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < float("inf")):
        raise ValueError(f"timeout_s must be a positive finite number, got {timeout_s!r}")
    if chosen.coordinator == AUTO:
        kwargs = {}
    else:
        if chosen.process_id == 0:
            check_port_free(chosen.coordinator)
        else:
            wait_for_coordinator(chosen.coordinator, timeout_s)
        kwargs = dict(coordinator_address=chosen.coordinator,
                      num_processes=chosen.num_processes, process_id=chosen.process_id)
    who = ("this process" if chosen.coordinator == AUTO else
           f"process {chosen.process_id} of {chosen.num_processes}")
    waited_for = ("the other processes" if chosen.coordinator == AUTO else
                  f"all {chosen.num_processes} processes to join at {chosen.coordinator}")
    watchdog = threading.Timer(timeout_s, _give_up, args=(
        f"jaxformer: {who} waited {timeout_s:g} s for {waited_for}; they did not all come. "
        "Start every process with the same coordinator and process count (or allow more "
        "time: --coordinator-timeout).", on_give_up))
    watchdog.daemon = True
    watchdog.start()
    try:  # JAX's own deadline later than the watchdog's: its expiry is a C++ abort
        jax.distributed.initialize(initialization_timeout=int(timeout_s) + 30, **kwargs)
    except RuntimeError as error:  # backends already started, or initialised twice
        raise RuntimeError(f"cannot start the distributed runtime: {error}") from None
    finally:
        watchdog.cancel()
    return jax.process_count()


def _give_up(message: str, on_give_up: Optional[Callable[[], None]]) -> None:
    print(message, file=sys.stderr, flush=True)
    try:
        if on_give_up is not None:
            on_give_up()
    finally:
        os._exit(2)  # the main thread is blocked inside JAX's C++ wait


def is_primary() -> bool:
    """True in the process that writes the run's files (process 0)."""
    import jax  # noqa: PLC0415

    return jax.process_index() == 0


def host_copy(tree: Any) -> Any:
    """Every array of `tree` as a whole numpy array in every process (a collective:
    every process must call it). One process: just `jax.device_get`."""
    import jax  # noqa: PLC0415

    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils  # noqa: PLC0415

    return multihost_utils.process_allgather(tree, tiled=True)


def describe() -> str:
    """"process 1 of 2, 2 of 4 cpu devices" (or "4 cpu devices" for one process)."""
    import jax  # noqa: PLC0415

    devices = f"{len(jax.devices())} {jax.devices()[0].platform} device(s)"
    if jax.process_count() == 1:
        return devices
    return (f"process {jax.process_index()} of {jax.process_count()}, "
            f"{len(jax.local_devices())} of {devices}")

"""Save / restore / resume a `TrainState` with Orbax.

`Checkpoints(directory)` wraps an `orbax.checkpoint.CheckpointManager` whose
steps are subdirectories `<directory>/<step>/`. Saves are synchronous and
atomic (Orbax writes to a temporary directory and renames it), so an
interrupted save never leaves a half-written step behind, and they only add:
nothing is overwritten, only the oldest steps beyond `max_to_keep` are pruned.
A save that fails (a full disk: ENOSPC, EFBIG, EDQUOT) raises `CheckpointWriteError`
in one line naming the step, the directory and the cause, after removing its
temporary directory; the earlier steps are untouched and restore.

Restoring needs a target: a state of the right structure, either concrete (a
freshly initialised one) or abstract, a tree of `jax.ShapeDtypeStruct`s with
`sharding=` (`jax.eval_shape(fns.init, 0)` of a `training.train_functions`
bundle has exactly the bundle's shardings). Its shapes, dtypes and shardings
decide how the arrays come back: each device reads only its own shards, so a
state saved on one mesh restores straight onto another mesh or device count
(resharding), and an abstract target allocates nothing before. Every failure -- no
checkpoint, unreadable or corrupt files, a structure that does not match --
raises `CheckpointError` naming the directory, and writes nothing. A damaged
latest step is reported in one line naming the newest step that does restore;
`restore(..., fallback=True)` continues from that step instead, after moving the
damaged ones aside (renamed `<step>.damaged`, never deleted). A save killed
midway leaves only Orbax's temporary directory, which `remove_unfinished_saves`
deletes (training calls it when it starts). Quietly: the one line and nothing
after it. A corrupt array index is read alone before Orbax's concurrent reads
(`_check_index`), and a read that fails leaves none of the others in flight
(`settle.settled_on_failure`: each would print a traceback when collected). A
Ctrl-C is a KeyboardInterrupt, never taken for damage.

Layer layouts (`config.scan_layers`): a checkpoint of a scanned model holds
stacked layers (`layers/...`), an unscanned one per-layer layers (`layers_0`,
...). Restoring into the other layout is refused with the fix named, unless
`restore(..., convert_layout=True)`, which converts exactly (`stacking`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
from typing import Any, Iterator, Optional

import jax

from jaxformer.nn import stacking
from jaxformer.train.settle import settled_on_failure


def orbax_checkpoint():
    """`orbax.checkpoint`, imported at first use: every `jaxformer` command builds its
    parser from `jaxformer.train`, and only training and resuming touch checkpoints
    (the import was 0.4 s of each command's start)."""
    import orbax.checkpoint  # noqa: PLC0415

    return orbax.checkpoint


class CheckpointError(Exception):
    """A checkpoint is missing, unreadable or does not fit the model."""


class CheckpointDamaged(CheckpointError):
    """A checkpoint's files are unreadable or corrupt (an earlier step may restore)."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (a full disk, most often); the earlier steps
    are kept. `errno`: the storage error's number, if one was found."""

    def __init__(self, message: str, errno_code: Optional[int]):
        super().__init__(message)
        self.errno = errno_code


# Orbax writes a step into `<step>.orbax-checkpoint-tmp-<time>` and renames it when done.
UNFINISHED_MARK = ".orbax-checkpoint-tmp"


class Checkpoints:
    """Periodic checkpoints of one run, in `directory`."""

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: Optional[int] = 3,
                 create: bool = True):
        """`create=False` (for resuming) refuses a missing directory instead of making it."""
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep!r}")
        self.directory = os.path.abspath(os.fspath(directory))
        if not create and not os.path.isdir(self.directory):
            raise CheckpointError(f"no checkpoint directory {self.directory}")
        ocp = orbax_checkpoint()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=create,
            # Synchronous: the train step donates the state's buffers right
            # after a save, and small states save in milliseconds anyway.
            enable_async_checkpointing=False)
        # The handler named up front: a reopened run's metadata (shapes, layout) is
        # readable before any restore.
        self._manager = ocp.CheckpointManager(self.directory, options=options,
                                              item_handlers=ocp.StandardCheckpointHandler())

    def steps(self) -> list[int]:
        """Steps with a complete checkpoint, ascending."""
        self._manager.reload()  # another process (an earlier run) may have written steps
        return sorted(self._manager.all_steps())

    def latest_step(self) -> Optional[int]:
        steps = self.steps()
        return steps[-1] if steps else None

    def remove_unfinished_saves(self) -> list[str]:
        """Delete the temporary directories of saves that were killed midway (never a
        finished step); returns their paths. Call it only while no save is running."""
        import shutil  # noqa: PLC0415

        removed = []
        for name in sorted(os.listdir(self.directory)) if os.path.isdir(self.directory) else []:
            path = os.path.join(self.directory, name)
            if UNFINISHED_MARK in name and os.path.isdir(path):
                shutil.rmtree(path)
                removed.append(path)
        return removed

    def save(self, step: int, state: Any) -> None:
        """Write `state` as checkpoint `step` (a no-op if that step already exists).

        A failed write (a full disk) raises `CheckpointWriteError` naming the step,
        the directory and the cause, after removing the unfinished step; the
        earlier steps stay restorable."""
        if step in self.steps():
            return
        try:
            with _failure_raised_once():
                self._manager.save(int(step), args=orbax_checkpoint().args.StandardSave(state),
                                   force=True)
                self._manager.wait_until_finished()
        except Exception as error:  # orbax/tensorstore raise many types; one message
            if jax.process_index() == 0:
                self.remove_unfinished_saves()
            raise self._write_error(step, error) from error

    def _write_error(self, step: int, error: BaseException) -> CheckpointWriteError:
        code = storage_errno(error)
        kept = self.latest_step()
        kept = (f"the checkpoint of step {kept} is kept" if kept is not None else
                "no earlier checkpoint exists")
        if code in NO_SPACE:
            return CheckpointWriteError(
                f"no space left to write the checkpoint of step {step} in {self.directory} "
                f"({os.strerror(code)}); {kept}", code)
        return CheckpointWriteError(f"cannot write the checkpoint of step {step} in "
                                    f"{self.directory}: {_storage_cause(error)}; {kept}", code)

    def restore(self, target: Any, step: Optional[int] = None, *,
                convert_layout: bool = False, fallback: bool = False) -> Any:
        """Return the state saved at `step` (default: the latest), shaped like `target`.

        `target`: a state of arrays, or of `jax.ShapeDtypeStruct(shape, dtype,
        sharding=...)`; every restored leaf has the target leaf's sharding.
        `convert_layout=True` restores a checkpoint of the other layer layout
        (scanned <-> unscanned) into `target`'s layout. A damaged latest step
        raises `CheckpointDamaged` naming the newest step that restores;
        `fallback=True` restores that step instead and renames the damaged
        newer ones `<step>.damaged`.
        """
        abstract = _abstract(target)  # ValueError before any file is read
        steps = self.steps()
        if not steps:
            raise CheckpointError(f"no checkpoint found in {self.directory}")
        if step is not None:
            if step not in steps:
                raise CheckpointError(f"no checkpoint for step {step} in {self.directory} "
                                      f"(available: {steps})")
            return self._restore_step(target, abstract, step, convert_layout)
        try:
            return self._restore_step(target, abstract, steps[-1], convert_layout)
        except CheckpointDamaged as damaged:
            for older in reversed(steps[:-1]):
                try:
                    state = self._restore_step(target, abstract, older, convert_layout)
                except CheckpointDamaged:
                    continue
                if not fallback:
                    raise CheckpointDamaged(
                        f"{damaged}; step {older} restores: continue from it with "
                        f"--resume --fallback (restore(..., fallback=True))") from damaged
                for newer in steps[steps.index(older) + 1:]:
                    path = os.path.join(self.directory, str(newer))
                    os.rename(path, path + ".damaged")
                self._manager.reload()
                return state
            raise CheckpointDamaged(f"{damaged}; no earlier step restores either") from damaged

    def saved_structure(self, sharding: Optional[jax.sharding.Sharding] = None) -> Any:
        """The newest readable step's state as a tree of `jax.ShapeDtypeStruct`s (dicts,
        as saved), each with `sharding` (default: this process's first device): a target
        that needs neither the model nor the optimizer (`restore(saved_structure())`)."""
        sharding = sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        for step in reversed(self.steps()):
            try:
                with _settled():
                    metadata = self._manager.item_metadata(step)
            except Exception:  # unreadable: an older step's may do
                continue
            tree = getattr(metadata, "tree", metadata)
            return jax.tree_util.tree_map(
                lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
                dict(tree))
        raise CheckpointDamaged(f"no checkpoint in {self.directory} has readable metadata"
                                if self.steps() else f"no checkpoint found in {self.directory}")

    def _restore_step(self, target: Any, abstract: Any, step: int,
                      convert_layout: bool) -> Any:
        path = os.path.join(self.directory, str(step))
        saved, wanted = self._saved_layout(step), stacking.layout(abstract)
        if saved and wanted and saved != wanted:
            if not convert_layout:
                fix = "stack_layers" if wanted == "stacked" else "unstack_layers"
                raise CheckpointError(
                    f"checkpoint {path} holds {saved} layers but the target state is "
                    f"{wanted} (config.scan_layers={wanted == 'stacked'}): restore with "
                    f"convert_layout=True, or convert with jaxformer.nn.stacking.{fix}")
            as_saved = self.restore(_in_layout(abstract, saved == "stacked"), step)
            converted = stacking.to_layout(as_saved, wanted == "stacked")
            return jax.device_put(converted, jax.tree_util.tree_map(
                lambda x: x.sharding, abstract))
        self._check_against_saved(step, path, abstract)
        _check_index(path)
        # Settled: a failed read leaves none of the others in flight (they would
        # each print a traceback when collected, thousands of lines).
        with _settled():
            try:
                restored = self._manager.restore(
                    step, args=orbax_checkpoint().args.StandardRestore(abstract))
            except Exception as error:  # orbax/tensorstore raise many types; one message
                raise CheckpointDamaged(f"checkpoint {path} is unreadable or corrupt: "
                                        f"{_storage_cause(error)}") from error
        got = jax.tree_util.tree_structure(restored)
        want = jax.tree_util.tree_structure(target)
        if got != want:
            raise CheckpointError(f"checkpoint {path} has a different structure than the "
                                  f"train state: {got} vs {want}")
        for saved, expected in zip(jax.tree_util.tree_leaves(restored),
                                   jax.tree_util.tree_leaves(target)):
            if saved.shape != expected.shape or saved.dtype != expected.dtype:
                raise CheckpointError(f"checkpoint {path} holds an array {saved.shape} "
                                      f"{saved.dtype} where the train state has "
                                      f"{expected.shape} {expected.dtype}")
        return restored

    def _check_against_saved(self, step: int, path: str, target: Any) -> None:
        """Compare the saved arrays' metadata with `target` by parameter path, before
        any array is read: missing, unexpected and mis-shaped entries, together."""
        try:
            with _settled():
                metadata = self._manager.item_metadata(step)
        except Exception:  # unreadable: restore() reports it
            return
        saved = _shapes_by_path(getattr(metadata, "tree", metadata))
        wanted = _shapes_by_path(target)
        if not saved:  # no metadata: restore() below checks what it reads
            return
        problems = [f"missing from the checkpoint: {name} {wanted[name]}"
                    for name in wanted if name not in saved]
        problems += [f"not in the train state: {name} {saved[name]}"
                     for name in saved if name not in wanted]
        problems += [f"{name}: saved {saved[name]}, the train state has {wanted[name]}"
                     for name in wanted if name in saved and saved[name] != wanted[name]]
        if problems:
            shown = problems[:8] + ([f"... and {len(problems) - 8} more"]
                                    if len(problems) > 8 else [])
            raise CheckpointError(f"checkpoint {path} does not match this model/optimizer "
                                  f"({len(problems)} differences):\n  " + "\n  ".join(shown))

    def _saved_layout(self, step: int) -> Optional[str]:
        try:
            with _settled():
                metadata = self._manager.item_metadata(step)
        except Exception:  # unreadable: restore() below reports it
            return None
        return stacking.layout(getattr(metadata, "tree", metadata))

    def close(self) -> None:
        self._manager.close()

    def __enter__(self) -> "Checkpoints":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# A full disk, a file beyond the size limit (RLIMIT_FSIZE; Python ignores SIGXFSZ, so
# the write fails instead), a full quota.
NO_SPACE = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})


def storage_errno(error: BaseException) -> Optional[int]:
    """The OS error number behind `error`, searched through its causes and contexts:
    an `OSError`'s, or the one tensorstore writes into its message
    ("[os_error_code='28']"); None if there is none."""
    for cause in _causes(error):
        if isinstance(cause, OSError) and cause.errno is not None:
            return cause.errno
        found = re.search(r"os_error_code='(\d+)'", str(cause))
        if found:
            return int(found.group(1))
    return None


@contextlib.contextmanager
def _settled(every_thread: bool = False) -> Iterator[None]:
    """`settled_on_failure`, and a Ctrl-C raised as the KeyboardInterrupt it is: Orbax
    wraps whatever a read raises (`raise Exception(...) from error`), and a wrapped
    Ctrl-C must not pass for a damaged checkpoint (which `fallback` renames)."""
    with settled_on_failure(every_thread):
        try:
            yield
        except Exception as error:
            if any(isinstance(cause, KeyboardInterrupt) for cause in _causes(error)):
                raise KeyboardInterrupt from error
            raise


def _causes(error: Optional[BaseException]) -> Iterator[BaseException]:
    """`error`, then what it was raised from or while handling, and so on."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


@contextlib.contextmanager
def _failure_raised_once() -> Iterator[None]:
    """An Orbax save as quiet as its failure: its writes run in threads of their own,
    each in a fresh event loop; a failed one leaves the others in flight (each a
    traceback when tensorstore calls back into the closed loop) unless every thread's
    loop settles, and each thread logs the failure, with its traceback, before the
    saving thread raises it. Raised once, by `save`, not logged."""
    absl = logging.getLogger("absl")
    absl.addFilter(_no_logged_tracebacks)
    try:
        with _settled(every_thread=True):
            yield
    finally:
        absl.removeFilter(_no_logged_tracebacks)


def _no_logged_tracebacks(record: logging.LogRecord) -> bool:
    return not (record.levelno >= logging.ERROR and record.exc_info)


def _shapes_by_path(tree: Any) -> dict[str, tuple]:
    """{"params/encoder/.../kernel": "(32, 4, 8) float32"} of a state or its saved metadata."""
    def name(path):
        return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                        for k in path)

    return {name(path): f"{tuple(leaf.shape)} {leaf.dtype}"
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _abstract(target: Any) -> Any:
    """`target` as ShapeDtypeStructs with shardings; ValueError naming abstract leaves
    without a sharding (Orbax would not know where to put them)."""
    unplaced = [jax.tree_util.keystr(path) for path, leaf in
                jax.tree_util.tree_leaves_with_path(target)
                if isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is None]
    if unplaced:
        more = f" and {len(unplaced) - 4} more" if len(unplaced) > 4 else ""
        raise ValueError("restore: an abstract target needs a sharding on every leaf "
                         "(jax.ShapeDtypeStruct(shape, dtype, sharding=...), e.g. "
                         "jax.eval_shape(train_functions(...).init, 0)); none on "
                         + ", ".join(unplaced[:4]) + more)
    return jax.tree_util.tree_map(orbax_checkpoint().utils.to_shape_dtype_struct, target)


def _in_layout(abstract: Any, stacked: bool) -> Any:
    """An abstract state in the other layer layout, each leaf sharded as its layers
    in `abstract`: a stacked leaf (L, *X) as layer 0's X, the layer axis whole; a
    per-layer leaf X as the stack's (L, *X) without its layer axis."""
    shapes = jax.eval_shape(lambda tree: stacking.to_layout(tree, stacked), abstract)
    source = dict(jax.tree_util.tree_leaves_with_path(abstract))
    layer = jax.tree_util.DictKey("layers_0" if stacked else stacking.STACKED)

    def place(path, leaf):
        keys = tuple(layer if stacking.layer_key(k) else k for k in path)
        sharding = source[keys].sharding
        if isinstance(sharding, jax.sharding.NamedSharding):
            spec = tuple(sharding.spec)
            spec = (None, *spec) if stacked else spec[1:]
            sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(
                *spec))
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

    return jax.tree_util.tree_map_with_path(place, shapes)


def _check_index(path: str) -> None:
    """Read the index (OCDBT manifest and B-tree) of the arrays saved at `path`, alone.

    A corrupt index then fails here, in one synchronous read, named as such,
    instead of failing every one of the concurrent reads of an Orbax restore.
    """
    item = os.path.join(path, "default")
    if not os.path.exists(os.path.join(item, "manifest.ocdbt")):
        return  # not an OCDBT checkpoint: Orbax reads and checks it
    import tensorstore as ts  # noqa: PLC0415 (Orbax's own storage library)

    try:
        ts.KvStore.open({"driver": "ocdbt", "base": f"file://{item}/"}).result().list().result()
    except Exception as error:  # noqa: BLE001 (tensorstore raises ValueError and others)
        raise CheckpointDamaged(f"checkpoint {path} is corrupt: its array index cannot be "
                                f"read: {first_line(error)}") from error


def _storage_cause(error: BaseException, limit: int = 160) -> str:
    """`first_line` of the error at the bottom of `error`'s causes, which names the
    array and the damage (Orbax's wrapper names a slice and holds a whole TensorStore
    spec), less tensorstore's restatement of the checkpoint's path."""
    while error.__cause__ is not None:
        error = error.__cause__
    lines = str(error).strip().splitlines()
    text = re.sub(r' in OCDBT database at [^:]*"(?=:)', "", lines[0] if lines else "")
    return _cut(f"{type(error).__name__}: {text}", limit)


def first_line(error: BaseException, limit: int = 160) -> str:
    """"TypeName: the first line of the message", cut to `limit` characters (storage
    libraries put whole specs, tens of lines, into their messages)."""
    lines = str(error).strip().splitlines()
    return _cut(f"{type(error).__name__}: {lines[0] if lines else ''}", limit)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."

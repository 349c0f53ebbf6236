"""JAX's persistent compilation cache, with the directory checked first; on by default
for the command line (`command_cache`: $XDG_CACHE_HOME/jaxformer/xla, opt out with
--no-compile-cache or JAXFORMER_COMPILE_CACHE=off).

Compiled programs are written to disk, keyed by the program, its shardings and the
JAX/XLA version, so a rerun, a `--resume` or another process with the same shapes
loads them instead of compiling again (MaxText's `jax_cache_dir`). What remains is
tracing and lowering, and loading the program (`benchmarks/train.py` prints
compile_s and compile_s_from_cache). XLA:CPU cannot serialize some programs (e.g. the
CPU-tuned train step: "Multiple temp buffer allocations found"); those compile on each
run, and JAX's warning about each failed write is silenced inside the cache's block.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from typing import Iterator, Optional

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache


def check_cache_dir(directory: str) -> str:
    """The absolute path of a usable cache directory, created if missing; ValueError
    naming the problem (a file in the way, no write permission) otherwise."""
    path = os.path.abspath(os.path.expanduser(directory))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"compile cache {directory} is a file, not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        raise ValueError(f"cannot create the compile cache {directory}: "
                         f"{error.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"compile cache {directory} is not writable")
    return path


UNWRITABLE_ENTRY = "Error writing persistent compilation cache entry"  # JAX's warning


@contextlib.contextmanager
def compilation_cache(directory: str) -> Iterator[str]:
    """Compile through the cache in `directory` inside the block (every program, however
    quick to compile); the previous settings (usually none) are restored after it."""
    path = check_cache_dir(directory)
    previous = jax.config.jax_compilation_cache_dir
    previous_min = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_compilation_cache_dir", path)
    # Every program, not only those compiling for over a second: a command's start
    # is many small programs (loading, sampling) besides the big ones.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax_cache.reset_cache()  # JAX decides once whether to use a cache: ask again
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=UNWRITABLE_ENTRY, category=UserWarning)
            yield path
    finally:
        jax.config.update("jax_compilation_cache_dir", previous)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", previous_min)
        jax_cache.reset_cache()


# The command line's default cache: on unless JAXFORMER_COMPILE_CACHE says "off"
# (or names another directory) or --no-compile-cache is given.
CACHE_ENV = "JAXFORMER_COMPILE_CACHE"
OFF = ("", "0", "off", "false", "no")


def default_cache_dir() -> Optional[str]:
    """Where the command line keeps compiled programs unless told otherwise:
    $JAXFORMER_COMPILE_CACHE (None when it is "off", "0" or empty), else
    $XDG_CACHE_HOME/jaxformer/xla (~/.cache/jaxformer/xla)."""
    value = os.environ.get(CACHE_ENV)
    if value is not None:
        return None if value.strip().lower() in OFF else value
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxformer", "xla")


def command_cache(directory: Optional[str], disabled: bool = False):
    """The compile-cache context of a command: `directory` (--compile-cache: checked,
    ValueError naming the problem), else the default (`default_cache_dir`; one that
    cannot be created or written is skipped with a line on stderr, the command runs
    without a cache); `disabled` (--no-compile-cache): none."""
    if disabled:
        return contextlib.nullcontext()
    if directory is not None:
        check_cache_dir(directory)
        return compilation_cache(directory)
    directory = default_cache_dir()
    if directory is None:
        return contextlib.nullcontext()
    try:
        check_cache_dir(directory)
    except ValueError as error:
        print(f"jaxformer: no compile cache ({error}); set {CACHE_ENV}=off to silence this",
              file=sys.stderr)
        return contextlib.nullcontext()
    return compilation_cache(directory)

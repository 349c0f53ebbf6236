"""JAX's persistent compilation cache, with the directory checked first.

Compiled programs are written to disk, keyed by the program, its shardings and the
JAX/XLA version, so a rerun, a `--resume` or another process with the same shapes
loads them instead of compiling again (MaxText's `jax_cache_dir`). What remains is
tracing and lowering, and loading the program (`benchmarks/train.py` prints
compile_s and compile_s_from_cache).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

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


@contextlib.contextmanager
def compilation_cache(directory: str) -> Iterator[str]:
    """Compile through the cache in `directory` inside the block; the previous
    setting (usually none) is restored after it."""
    path = check_cache_dir(directory)
    previous = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", path)
    jax_cache.reset_cache()  # JAX decides once whether to use a cache: ask again
    try:
        yield path
    finally:
        jax.config.update("jax_compilation_cache_dir", previous)
        jax_cache.reset_cache()

"""The `jaxformer` command (`main`), its plots, baselines and compilation cache.

`main` imports nothing heavy until it runs (its Ctrl-C handling comes first:
`cli.interrupts`); `compilation_cache` (JAX's) imports on first use.
"""

from jaxformer.cli.main import main

__all__ = ["compilation_cache", "main"]


def __getattr__(name: str):
    if name == "compilation_cache":
        from jaxformer.cli.compile_cache import compilation_cache  # noqa: PLC0415
        return compilation_cache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

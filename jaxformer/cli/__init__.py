"""The `jaxformer` command (`main`), its plots, baselines and compilation cache."""

from jaxformer.cli.compile_cache import compilation_cache
from jaxformer.cli.main import main

__all__ = ["compilation_cache", "main"]

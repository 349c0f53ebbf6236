"""The `jaxformer` command (`main`), its plots, baselines and compilation cache."""

from jaxformer.cli.main import main

__all__ = ["main"]

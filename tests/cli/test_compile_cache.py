"""The command line's compile cache (issue 44 item 5): on by default in the user's cache
directory, off with --no-compile-cache or JAXFORMER_COMPILE_CACHE=off (tests/conftest.py
sets it off, so no test writes the user's real cache), a chosen --compile-cache checked."""

import os
import warnings

import jax
import jax.numpy as jnp
import pytest

from jaxformer.cli import compile_cache
from jaxformer.cli.main import main


def test_the_default_directory_follows_xdg_and_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(compile_cache.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_cache.default_cache_dir() == str(tmp_path / "jaxformer" / "xla")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_cache.default_cache_dir() == str(tmp_path / "home" / ".cache" / "jaxformer"
                                                    / "xla")
    monkeypatch.setenv(compile_cache.CACHE_ENV, str(tmp_path / "mine"))
    assert compile_cache.default_cache_dir() == str(tmp_path / "mine")
    for off in ("off", "0", ""):
        monkeypatch.setenv(compile_cache.CACHE_ENV, off)
        assert compile_cache.default_cache_dir() is None


def test_by_default_compiled_programs_land_in_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.delenv(compile_cache.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    before = jax.config.jax_compilation_cache_dir
    with compile_cache.command_cache(None):
        jax.jit(lambda x: jnp.sin(x) * 3.0 + 0.25)(jnp.arange(7.0)).block_until_ready()
    assert any(os.scandir(tmp_path / "jaxformer" / "xla"))  # even a quick program
    assert jax.config.jax_compilation_cache_dir == before  # restored
    with compile_cache.command_cache(None, disabled=True):
        assert jax.config.jax_compilation_cache_dir == before


def test_an_unwritable_default_is_skipped_with_one_line(monkeypatch, tmp_path, capsys):
    (tmp_path / "jaxformer").write_text("a file in the way")
    monkeypatch.delenv(compile_cache.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with compile_cache.command_cache(None):
        pass
    assert "no compile cache" in capsys.readouterr().err


@pytest.mark.parametrize("flags, want", [([], (None, False)),
                                         (["--no-compile-cache"], (None, True)),
                                         (["--compile-cache", "DIR"], ("DIR", False))],
                         ids=["default", "opt_out", "chosen"])
def test_every_command_passes_its_flags_to_the_cache(monkeypatch, tmp_path, flags, want):
    seen = []
    monkeypatch.setattr(compile_cache, "command_cache",
                        lambda *a: seen.append(a) or compile_cache.contextlib.nullcontext())
    missing = str(tmp_path / "missing.txt")
    assert main(["eval", "--model", missing, "--data", missing] + flags) == 2
    assert seen == [want]


def test_a_program_the_cache_cannot_store_warns_nothing_inside_the_block(tmp_path):
    """JAX warns when XLA cannot serialize a program (the CPU-tuned train step); a
    command's output stays clean, and other warnings still show."""
    message = ("Error writing persistent compilation cache entry for 'jit_train_step': "
               "JaxRuntimeError: INTERNAL: Multiple temp buffer allocations found")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with compile_cache.compilation_cache(str(tmp_path)):
            warnings.warn(message, UserWarning)
            warnings.warn("another warning", UserWarning)
        warnings.warn(message, UserWarning)  # outside the block: JAX's warning again
    assert [str(w.message) for w in caught] == ["another warning", message]

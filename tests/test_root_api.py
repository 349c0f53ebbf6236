"""The root namespace: `jf.fit`, `jf.load`, `jf.Engine`, ... are their home modules'
objects, imported on first use, so `import jaxformer` loads no server, no file reader."""

import importlib
import subprocess
import sys

import pytest

import jaxformer as jf
from conftest import REPO

HOMES = {"fit": "jaxformer.train", "TrainConfig": "jaxformer.train", "Run": "jaxformer.train",
         "load": "jaxformer.models", "Engine": "jaxformer.serve"}


@pytest.mark.parametrize("name", sorted(HOMES))
def test_a_root_name_is_its_home_modules_object(name):
    assert getattr(jf, name) is getattr(importlib.import_module(HOMES[name]), name)


def test_every_lazy_name_is_public_in_its_home_and_in_the_root():
    for name, home in jf.LAZY.items():
        assert name in importlib.import_module(home).__all__, (name, home)
        assert name in jf.__all__ and name in dir(jf), name
    for package in jf.SUBPACKAGES:
        assert getattr(jf, package) is importlib.import_module(f"jaxformer.{package}")


def test_import_jaxformer_imports_no_lazy_subpackage_and_changes_no_process_state():
    code = ("import os, sys, jax\n"
            "env, flags = dict(os.environ), dict(jax.config.values)\n"
            "import jaxformer\n"
            "assert dict(os.environ) == env and dict(jax.config.values) == flags\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('starlette', 'uvicorn', 'gguf', 'orbax', 'grain') or m.startswith(("
            "'jaxformer.serve', 'jaxformer.train', 'jaxformer.models'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


def test_an_unknown_name_raises_attribute_error_naming_it():
    with pytest.raises(AttributeError, match="no_such_name"):
        jf.no_such_name  # noqa: B018
    assert not hasattr(jf, "no_such_name")

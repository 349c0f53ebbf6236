"""The package's shape: packages by concept, imports only downward, no cycles."""

import ast
import pathlib

import pytest

from conftest import REPO

# Each package may import itself and the ones before it, never one after it.
LAYERS = ("errors", "config", "backends", "nn", "parallel", "decode", "train", "interop", "models", "cli")
PACKAGE = pathlib.Path(REPO) / "jaxformer"


def _layer(module: str) -> str:
    """'jaxformer.nn.attention' -> 'nn'; 'jaxformer.config' -> 'config'."""
    return module.split(".")[1]


def _imports(path: pathlib.Path) -> set[str]:
    """jaxformer modules imported anywhere in `path` (function-level imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(
                "jaxformer"):
            names = [node.module] if node.module != "jaxformer" else [
                f"jaxformer.{a.name}" for a in node.names]
            found.update(names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("jaxformer."))
    return found


MODULES = sorted(p for p in PACKAGE.rglob("*.py")
                 if p.relative_to(PACKAGE).parts[0] not in ("__init__.py", "__main__.py"))


def test_every_module_sits_in_a_known_layer():
    unknown = {str(p.relative_to(PACKAGE)) for p in MODULES
               if p.relative_to(PACKAGE).parts[0].removesuffix(".py") not in LAYERS}
    assert not unknown, f"modules outside the layers {LAYERS}: {sorted(unknown)}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_only_go_downward(path):
    here = LAYERS.index(path.relative_to(PACKAGE).parts[0].removesuffix(".py"))
    upward = sorted(m for m in _imports(path) if m.count(".") >= 1
                    and LAYERS.index(_layer(m)) > here)
    assert not upward, f"{path.relative_to(PACKAGE)} imports upward: {upward}"


def test_import_jaxformer_loads_no_command_line_or_optional_reader():
    """`import jaxformer` is the model, decoding and configs; the CLI, the file readers
    and torch load when asked for."""
    import subprocess
    import sys
    code = ("import sys, jaxformer; print(sorted(m for m in sys.modules if m.startswith("
            "('jaxformer.cli', 'jaxformer.interop', 'jaxformer.models', 'torch', 'gguf'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout

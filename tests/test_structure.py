"""The package's shape: packages by concept, imports only downward, no cycles."""

import ast
import importlib
import pathlib
import re

import pytest

from conftest import REPO

# Each package may import itself and the ones before it, never one after it.
LAYERS = ("errors", "config", "backends", "nn", "parallel", "interop", "text", "decode", "train",
          "models", "nnx", "harness", "serve", "cli")
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


def test_the_command_line_parser_loads_no_checkpoint_or_data_pipeline_library():
    """Every command builds the whole parser (its flags come from `jaxformer.train`);
    orbax and grain load only when a checkpoint or a training batch is touched (they
    were 0.25 s and 0.7 s of every `jaxformer generate` start)."""
    import subprocess
    import sys
    code = ("import sys; from jaxformer.cli.main import build_parser; build_parser(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('orbax', 'grain', 'tensorstore')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_readme_layout_table_names_every_module():
    """Each module is listed, by its name, in the row of its package."""
    readme = (pathlib.Path(REPO) / "README.md").read_text()
    table = readme[readme.index("## Layout"):]
    rows = {}
    for line in table.splitlines():
        if line.startswith("| `") and "|" in line[1:]:
            first, rest = line[1:].split("|", 1)
            for name in first.replace("`", "").split(","):
                rows[name.strip()] = rest
    missing = []
    for path in MODULES:
        parts = path.relative_to(PACKAGE).parts
        if len(parts) == 1:  # top-level module: its own row
            if parts[0] not in rows:
                missing.append(parts[0])
        elif path.stem != "__init__" and f"`{path.stem}`" not in rows.get(parts[0] + "/", ""):
            missing.append("/".join(parts))
    assert not missing, f"README's layout table misses {missing}"


DOTTED = re.compile(r"\bjaxformer(?:\.[A-Za-z_]\w*)+")


def _resolves(dotted: str) -> bool:
    """'jaxformer.nn.masks.causal_mask' names a module, or an attribute of one."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        try:
            for name in parts[split:]:
                obj = getattr(obj, name)
        except AttributeError:
            return False
        return True
    return False


def test_dotted_paths_in_docs_and_docstrings_exist():
    """No stale `jaxformer.x.y` in the README, docs/, examples, benchmarks or the package."""
    root = pathlib.Path(REPO)
    files = [root / "README.md", *root.glob("docs/*.md"), *root.glob("examples/*.py"),
             *root.glob("benchmarks/*.py"), *PACKAGE.rglob("*.py")]
    stale = sorted({f"{f.relative_to(root)}: {m}" for f in files
                    for m in DOTTED.findall(f.read_text()) if not _resolves(m)})
    assert not stale, stale


def _python_sources():
    """(name, source) of every example, benchmark and `python` block of README and docs/."""
    root = pathlib.Path(REPO)
    for path in [*root.glob("examples/*.py"), *root.glob("benchmarks/*.py")]:
        yield str(path.relative_to(root)), path.read_text()
    for path in [root / "README.md", *root.glob("docs/*.md")]:
        for i, block in enumerate(re.findall(r"```python\n(.*?)```", path.read_text(), re.S)):
            yield f"{path.relative_to(root)} block {i}", block


def test_examples_benchmarks_and_docs_import_only_public_names():
    """`from jaxformer.P import x`: P is jaxformer, a package or a top-level module, and x
    is in P's `__all__` (implementation modules stay free to move)."""
    wrong = []
    for name, source in _python_sources():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                wrong += [f"{name}: import {a.name}" for a in node.names
                          if a.name.startswith("jaxformer.")]
            if not (isinstance(node, ast.ImportFrom) and node.module
                    and node.module.split(".")[0] == "jaxformer"):
                continue
            module = importlib.import_module(node.module)
            if node.module.count(".") > 1 or (node.module.count(".") == 1 and not hasattr(
                    module, "__path__") and not (PACKAGE / f"{node.module[10:]}.py").exists()):
                wrong.append(f"{name}: from {node.module} (a module inside a package)")
                continue
            public = getattr(module, "__all__", ())
            wrong += [f"{name}: {a.name} is not in {node.module}.__all__" for a in node.names
                      if a.name not in public and not (node.module == "jaxformer" and (
                          PACKAGE / a.name).is_dir())]  # a package: its own __all__
    assert not wrong, "\n".join(wrong)


def test_the_command_line_and_models_load_without_the_optional_packages():
    """A base install (`pip install -e .`, README's first command) has no gguf, tokenizers,
    safetensors, jinja2 or torch: `jaxformer --help` and `import jaxformer.models` must not
    import them (each is blocked here as if missing)."""
    import subprocess
    import sys
    blocked = ("gguf", "tokenizers", "safetensors", "jinja2", "torch", "transformers")
    code = ("import sys\n"
            f"for name in {blocked!r}: sys.modules[name] = None\n"
            "import jaxformer.models, jaxformer.text\n"
            "from jaxformer.cli.main import build_parser\n"
            "build_parser()\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]

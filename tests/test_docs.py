"""The documentation runs: every ```python block of README.md and docs/*.md.

Each file's blocks (fences tagged exactly `python`; `python no-test` is
skipped) run in order in one fresh namespace, in a subprocess started in the
repository root, so a later block may use the names of an earlier one. Also:
the README stays short, and every relative link points to a file that exists.
"""

import os
import re
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(
    os.path.join("docs", name) for name in os.listdir(os.path.join(REPO, "docs"))
    if name.endswith(".md"))
README_MAX_LINES = 300
TIMEOUT_S = 300

# [text](target): a markdown link; images too. Targets with a scheme or only an
# anchor are not files.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def python_blocks(text: str) -> list[str]:
    """The bodies of the ```python blocks of `text`, in order (not `python no-test`),
    dedented (a block may sit in a list item)."""
    blocks, body, info = [], None, None
    for line in text.splitlines():
        stripped = line.strip()
        if body is None:
            if stripped.startswith("```"):
                info, body = stripped[3:].strip(), []
        elif stripped == "```":
            if info == "python":
                blocks.append(textwrap.dedent("\n".join(body)) + "\n")
            body = None
        else:
            body.append(line)
    assert body is None, "a code block is not closed"
    return blocks


def _read(name: str) -> str:
    with open(os.path.join(REPO, name), encoding="utf-8") as f:
        return f.read()


# The child runs the blocks one by one so that a failure names its block.
RUNNER = """
import sys
blocks = {blocks!r}
namespace = {{"__name__": "__main__"}}
for number, source in enumerate(blocks, 1):
    try:
        exec(compile(source, f"{name} python block {{number}}", "exec"), namespace)
    except BaseException:
        print(f"--- {name}: python block {{number}} of {{len(blocks)}} failed:\\n{{source}}",
              file=sys.stderr)
        raise
"""


@pytest.mark.parametrize("name", DOCS, ids=[os.path.basename(n) for n in DOCS])
def test_python_blocks_run(name):
    blocks = python_blocks(_read(name))
    if not blocks:
        pytest.skip(f"{name} has no python block")
    try:
        result = subprocess.run([sys.executable, "-c", RUNNER.format(blocks=blocks, name=name)],
                                cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"{name}: the python blocks ran longer than {TIMEOUT_S} s\n"
                    f"{(error.stderr or b'')[-3000:]}")
    assert result.returncode == 0, (f"{name}: the python blocks failed (exit "
                                    f"{result.returncode}):\n{result.stderr[-3000:]}")


def test_readme_is_short():
    lines = len(_read("README.md").splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"


def test_python_block_extraction():
    text = "a\n```python\nx = 1\n```\n```python no-test\nboom\n```\n```bash\nls\n```\n" \
           "```python\ny = x\n```\n"
    assert python_blocks(text) == ["x = 1\n", "y = x\n"]


def _local_links(text: str) -> list[str]:
    text = re.sub(r"```.*?```", "", text, flags=re.S)   # code blocks hold no links
    text = re.sub(r"`[^`\n]*`", "", text)                # nor does inline code
    targets = []
    for target in LINK.findall(text):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            continue  # http:, https:, mailto: ... or an anchor in the same file
        targets.append(target.split("#", 1)[0])
    return targets


@pytest.mark.parametrize("name", DOCS, ids=[os.path.basename(n) for n in DOCS])
def test_relative_links_exist(name):
    folder = os.path.dirname(os.path.join(REPO, name))
    missing = [target for target in _local_links(_read(name))
               if not os.path.exists(os.path.normpath(os.path.join(folder, target)))]
    assert not missing, f"{name} links to missing files: {missing}"

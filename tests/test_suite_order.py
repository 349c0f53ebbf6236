"""The suite's own scheduling: pytest-xdist hands out whole files in the collection
order that tests/conftest.py sorts (LONGEST_FIRST), and that list names real files."""

import os
import re
import shlex

from conftest import LONGEST_FIRST, REPO


def test_xdist_keeps_the_collection_order():
    """xdist's default for --dist loadfile reorders the files by their number of tests
    (most first), which ignores LONGEST_FIRST: the long files with few tests ran last."""
    with open(os.path.join(REPO, "pyproject.toml"), encoding="utf-8") as f:
        (line,) = re.findall(r'^addopts = "(.*)"$', f.read(), flags=re.M)  # tomllib: 3.11+
    addopts = shlex.split(line)
    assert "loadfile" in addopts and "--no-loadscope-reorder" in addopts, addopts


def test_the_longest_files_exist():
    missing = [p for p in LONGEST_FIRST if not os.path.exists(os.path.join(REPO, "tests", p))]
    assert not missing, f"LONGEST_FIRST names files that do not exist: {missing}"

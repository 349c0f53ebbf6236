"""The one error a file reader raises: which file, what is wrong with it, what to do.

Every reader (GGUF, CTranslate2, WAV, tokenizer files, weights) raises
`FileFormatError`, a `ValueError`, instead of letting a third-party library's
traceback reach the user; the library's own exception stays as `__cause__`.
"""

from __future__ import annotations

import os


class FileFormatError(ValueError):
    """`path` cannot be read as what it should be."""

    def __init__(self, path, problem: str, hint: str = ""):
        self.path = os.fspath(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}" + (f"; {hint}" if hint else ""))


def require_file(path, what: str) -> str:
    """`path` as a str if it is a readable regular file, else FileFormatError."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileFormatError(path, f"no such {what}")
    if not os.path.isfile(path):
        raise FileFormatError(path, f"is not a file (a {what} was expected)")
    if not os.access(path, os.R_OK):
        raise FileFormatError(path, "is not readable (permissions)")
    return path

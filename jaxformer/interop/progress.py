"""A progress bar over the tensors of a checkpoint being read.

    bar = tensor_bar(total, "reading model.gguf", progress)
    for name in names:
        ... read one tensor ...
        bar.update(1)
    bar.close()

`progress=None` (the loaders' default) shows the bar only when stderr is a
terminal; True forces it on, False off.
"""

from __future__ import annotations

import sys
from typing import Optional


def show_progress(progress: Optional[bool]) -> bool:
    """Whether to draw a bar: `progress` if given, else whether stderr is a terminal."""
    if progress is not None:
        return bool(progress)
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def tensor_bar(total: int, desc: str, progress: Optional[bool] = None):
    """A tqdm bar on stderr counting `total` tensors (disabled: a no-op bar)."""
    from tqdm.auto import tqdm  # noqa: PLC0415 - only the loaders need it

    return tqdm(total=total, desc=desc, unit="tensor", file=sys.stderr, leave=False,
                dynamic_ncols=True, disable=not show_progress(progress))

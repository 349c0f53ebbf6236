"""Argument types of every `jaxformer` command: a flag's value is checked as it is parsed.

    parser.add_argument("--top-p", type=probability)

Each type turns the flag's text into a value or raises `argparse.ArgumentTypeError`
with what the value must be; `Parser` reports it in one line naming the flag
(`jaxformer generate: error: argument --top-p: must be in (0, 1], got 2`) and
exits with status 2, before any model is loaded or anything is printed. Numbers
are finite: "nan" and "inf" parse as floats and are refused here.
"""

from __future__ import annotations

import argparse
import math

SEED_LIMIT = 2 ** 32  # JAX keys take 32-bit seeds; larger ones wrap onto smaller ones


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: `prog: error: message` (exit 2).

    Sub-commands made by `add_subparsers` are Parsers too (argparse uses the
    parent's class), so every command reports bad flags alike.
    """

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _number(text: str, kind):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be {'an integer' if kind is int else 'a number'}, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def _bounded(kind, test, rule: str):
    """An argparse type: `kind(text)` (int or float), finite, for which `test` holds."""
    def parse(text: str):
        value = _number(text, kind)
        if not test(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value
    parse.__name__ = rule  # argparse names the type in some messages
    return parse


positive_int = _bounded(int, lambda v: v >= 1, "a positive integer")
non_negative_int = _bounded(int, lambda v: v >= 0, "an integer >= 0")
seed = _bounded(int, lambda v: 0 <= v < SEED_LIMIT, "an integer in [0, 2**32)")
positive_float = _bounded(float, lambda v: v > 0, "a positive finite number")
non_negative_float = _bounded(float, lambda v: v >= 0, "a finite number >= 0")
probability = _bounded(float, lambda v: 0 < v <= 1, "in (0, 1]")
fraction = _bounded(float, lambda v: 0 <= v < 1, "in [0, 1)")
finite_float = _bounded(float, lambda v: True, "a finite number")


def at_least(low: int):
    """An integer type with a lower bound other than 0 or 1 (e.g. --seq-len: 2)."""
    return _bounded(int, lambda v: v >= low, f"an integer >= {low}")


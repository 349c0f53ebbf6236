"""Logits processors: pure, jittable edits of the next-token logits.

A processor has the signature

    process(logits_BV, step, tokens_BN) -> logits_BV

where `step` () int32 is the index of the token about to be picked (0 = the
first token after BOS) and `tokens_BN` (B, N) int32 holds the tokens picked so
far (columns < step; PAD beyond). Every decoding entry point (greedy_decode,
sample, generate, beam_search) takes `processors=` and applies them, in order,
to the logits before the selector (greedy, a sampler, or beam log-softmax).

Processors are frozen dataclasses: hashable, so the jitted loops take them as
static arguments and compile once per setting. A removed token gets the most
negative finite float32 (never -inf: a row stays finite). `check(vocab_size)`
raises a ValueError naming a bad id before anything is compiled; the entry
points call it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax.numpy as jnp
import numpy as np

from jaxformer.nn import checks

NEG = jnp.finfo(jnp.float32).min

Processor = Callable[[jnp.ndarray, jnp.ndarray, jnp.ndarray], jnp.ndarray]


def _ids(name: str, ids: Sequence[int]) -> tuple[int, ...]:
    ids = tuple(int(i) for i in ids)
    if not ids:
        raise ValueError(f"{name}: needs at least one token id")
    return ids


def _check_ids(name: str, ids: tuple[int, ...], vocab_size: int) -> None:
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"{name}: token id(s) {bad} are outside the vocabulary "
                         f"0..{vocab_size - 1}")


def check_inputs(owner: str, logits_BV, step, tokens_BN) -> None:
    """A processor's arguments fit each other: logits (B, V), step a scalar, tokens
    (B, N). ValueError naming the argument; shapes are static (free under jit)."""
    checks.check_shape(f"{owner}: logits_BV", logits_BV, (None, None), "(batch, vocab)")
    checks.check_shape(f"{owner}: step", step if hasattr(step, "shape") else np.asarray(step),
                       (), "(a scalar step index)")
    checks.check_shape(f"{owner}: tokens_BN", tokens_BN, (logits_BV.shape[0], None),
                       "(the logits' batch, tokens so far)")


def _banned_V(ids: tuple[int, ...], vocab_size: int) -> jnp.ndarray:
    return jnp.zeros((vocab_size,), bool).at[jnp.array(ids)].set(True)


@dataclasses.dataclass(frozen=True)
class SuppressTokens:
    """Never pick `ids` (Whisper's suppress_tokens)."""

    ids: tuple[int, ...]

    def check(self, vocab_size: int) -> None:
        _check_ids("SuppressTokens", self.ids, vocab_size)

    def __call__(self, logits_BV, step, tokens_BN):
        check_inputs("SuppressTokens", logits_BV, step, tokens_BN)
        del step, tokens_BN
        return jnp.where(_banned_V(self.ids, logits_BV.shape[-1]), NEG, logits_BV)


@dataclasses.dataclass(frozen=True)
class SuppressAtStep:
    """Never pick `ids` at step `at` (Whisper's begin_suppress_tokens: blank and EOS
    at the first generated step)."""

    ids: tuple[int, ...]
    at: int = 0

    def check(self, vocab_size: int) -> None:
        _check_ids("SuppressAtStep", self.ids, vocab_size)
        if self.at < 0:
            raise ValueError(f"SuppressAtStep: step must be >= 0, got {self.at}")

    def __call__(self, logits_BV, step, tokens_BN):
        check_inputs("SuppressAtStep", logits_BV, step, tokens_BN)
        del tokens_BN
        banned_V = _banned_V(self.ids, logits_BV.shape[-1]) & (step == self.at)
        return jnp.where(banned_V, NEG, logits_BV)


@dataclasses.dataclass(frozen=True)
class ForceToken:
    """Pick `token_id` at step `at`, whatever the model says (a forced language token)."""

    token_id: int
    at: int

    def check(self, vocab_size: int) -> None:
        _check_ids("ForceToken", (self.token_id,), vocab_size)
        if self.at < 0:
            raise ValueError(f"ForceToken: step must be >= 0, got {self.at}")

    def __call__(self, logits_BV, step, tokens_BN):
        check_inputs("ForceToken", logits_BV, step, tokens_BN)
        del tokens_BN
        only_V = jnp.arange(logits_BV.shape[-1]) == self.token_id
        forced_BV = jnp.where(only_V, 0.0, NEG).astype(logits_BV.dtype)
        return jnp.where(step == self.at, forced_BV, logits_BV)


@dataclasses.dataclass(frozen=True)
class MinLength:
    """No EOS before `min_tokens` tokens were generated (EOS is never the i-th token
    for i < min_tokens, counting from 1)."""

    min_tokens: int
    eos_id: int

    def check(self, vocab_size: int) -> None:
        _check_ids("MinLength", (self.eos_id,), vocab_size)
        if self.min_tokens < 0:
            raise ValueError(f"MinLength: min_tokens must be >= 0, got {self.min_tokens}")

    def __call__(self, logits_BV, step, tokens_BN):
        check_inputs("MinLength", logits_BV, step, tokens_BN)
        del tokens_BN
        eos_V = jnp.arange(logits_BV.shape[-1]) == self.eos_id
        return jnp.where(eos_V & (step + 1 < self.min_tokens), NEG, logits_BV)


def suppress_tokens(ids: Sequence[int]) -> SuppressTokens:
    return SuppressTokens(_ids("suppress_tokens", ids))


def suppress_at_step(ids: Sequence[int], at: int = 0) -> SuppressAtStep:
    return SuppressAtStep(_ids("suppress_at_step", ids), int(at))


def force_token(token_id: int, at: int) -> ForceToken:
    return ForceToken(int(token_id), int(at))


def min_length(min_tokens: int, eos_id: int) -> MinLength:
    return MinLength(int(min_tokens), int(eos_id))


def normalize(processors, vocab_size: int) -> tuple:
    """`None`, one processor or a sequence -> a checked tuple (hashable: a static arg).

    Raises:
      TypeError if an item is not callable; ValueError (from `check`) on an id
      outside the vocabulary.
    """
    if processors is None:
        return ()
    if callable(processors):
        processors = (processors,)
    processors = tuple(processors)
    for p in processors:
        if not callable(p):
            raise TypeError(f"processors must be callables (logits, step, tokens) -> logits, "
                            f"got {p!r}")
        if hasattr(p, "check"):
            p.check(vocab_size)
    return processors


def apply(processors: tuple, logits_BV, step, tokens_BN):
    """Apply `processors` in order (an empty tuple is the identity)."""
    check_inputs("processors", logits_BV, step, tokens_BN)
    for p in processors:
        logits_BV = p(logits_BV, step, tokens_BN)
    return logits_BV

"""Token selection rules: logits (B, V) -> token ids (B,). Pure functions.

A selector has the signature `select(logits_BV, rng) -> tokens_B` and knows
nothing about models or caches, so the decode loop takes any of them:

  greedy                   argmax (ties: the lowest id, as `jnp.argmax`)
  make_sampler(...)        temperature, then top-k, then top-p (nucleus), then
                           a categorical draw with the explicit key `rng`

Filters replace removed logits by the most negative finite float32, never by
-inf, so a row stays finite whatever is filtered.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from jaxformer.config import is_finite_number

Selector = Callable[[jnp.ndarray, jax.Array], jnp.ndarray]

NEG = jnp.finfo(jnp.float32).min


def first_argmax(logits_BV: jnp.ndarray) -> jnp.ndarray:
    """`jnp.argmax(logits_BV, axis=-1)` as int32, (..., V) -> (...) (ties: the lowest id;
    a row with a NaN: its first NaN), computed as the row's max and then the lowest id
    holding it: two plain reductions, where XLA:CPU runs argmax's (value, index)
    reduction element by element (8 x 49152 logits: 1.8 ms against 0.2)."""
    ids_V = jnp.arange(logits_BV.shape[-1], dtype=jnp.int32)
    max_B1 = jnp.max(logits_BV, axis=-1, keepdims=True)
    hit_BV = (logits_BV == max_B1) | jnp.isnan(logits_BV)
    return jnp.min(jnp.where(hit_BV, ids_V, logits_BV.shape[-1]), axis=-1)


def greedy(logits_BV: jnp.ndarray, rng: Optional[jax.Array] = None) -> jnp.ndarray:
    """argmax over the vocabulary, (B, V) -> (B,) int32. `rng` is ignored."""
    del rng
    return first_argmax(logits_BV)


def top_k_filter(logits_BV: jnp.ndarray, k: int) -> jnp.ndarray:
    """Keep the k largest logits of each row (ties at the k-th value are all kept)."""
    kth_B1 = jax.lax.top_k(logits_BV, k)[0][:, -1:]
    return jnp.where(logits_BV >= kth_B1, logits_BV, NEG)


def top_p_filter(logits_BV: jnp.ndarray, p: float) -> jnp.ndarray:
    """Nucleus: keep the smallest set of most likely tokens whose probability reaches p.

    A token is kept if the probability mass of the tokens strictly more likely
    than it is below p, so the most likely token is always kept.
    """
    sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    kept_BV = mass_before_BV < p
    # The smallest kept logit is the threshold (kept tokens are a prefix of the sort).
    threshold_B1 = jnp.min(jnp.where(kept_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits_BV >= threshold_B1, logits_BV, NEG)


@functools.lru_cache(maxsize=None)
def make_sampler(temperature: float = 1.0, top_k: Optional[int] = None,
                 top_p: Optional[float] = None) -> Selector:
    """A selector that samples from softmax(logits / temperature), optionally filtered.

    Args:
      temperature: > 0 (finite) scales the logits; 0 means greedy (argmax).
      top_k: keep only the k most likely tokens (k >= 1); None = all.
      top_p: keep the nucleus of mass p, 0 < p <= 1; None = all.
    Raises:
      ValueError naming the argument if a value is out of range.

    Cached: equal settings return the same function object, so a jitted loop
    that takes the selector as a static argument compiles once per setting.
    """
    if not (is_finite_number(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)
                              or top_k < 1):
        raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
    if top_p is not None and not (is_finite_number(top_p) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")
    if temperature == 0:
        return greedy

    def select(logits_BV: jnp.ndarray, rng: jax.Array) -> jnp.ndarray:
        logits_BV = logits_BV.astype(jnp.float32) / temperature
        if top_k is not None and top_k < logits_BV.shape[-1]:
            logits_BV = top_k_filter(logits_BV, top_k)
        if top_p is not None and top_p < 1:
            logits_BV = top_p_filter(logits_BV, top_p)
        return jax.random.categorical(rng, logits_BV, axis=-1).astype(jnp.int32)
    return select

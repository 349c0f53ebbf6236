"""Per-row token selection for the engine's step: each slot its own settings and key.

`decode.sampling` picks with one setting per call (static); an engine step
holds requests with different temperatures, top-k, top-p, min-p and seeds side
by side, so here they are (S,) arrays, given to the same filter chain
(`sampling.filter_logits`): greedy is the argmax of the raw logits (temperature
0); else temperature, then top-k (ties at the k-th value kept), then top-p (the
smallest most likely set whose mass reaches p), then min-p (the tokens at least
min_p times as likely as the most likely one), then a categorical draw with the
row's key
`fold_in(PRNGKey(seed), position)`: a request's samples depend on its own seed
and positions only, never on its neighbours.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jaxformer.decode import sampling
from jaxformer.decode.sampling import NEG, first_argmax

MAX_LOGPROBS = 20  # top-n logprobs a request may ask for (OpenAI's bound)


@flax.struct.dataclass
class SlotParams:
    """(S,) sampling settings of the rows: temperature 0 = greedy, top_k 0 = all,
    top_p 1 = all, min_p 0 = all."""
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    seed: jax.Array


@flax.struct.dataclass
class Picks:
    """(S,) tokens and their logprobs (under the distribution drawn from: the
    temperature-scaled logits, raw for greedy), and the (S, MAX_LOGPROBS) best."""
    token: jax.Array
    logprob: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


def filtered_logits(logits_SV: jnp.ndarray, params: SlotParams) -> jnp.ndarray:
    """Temperature-scaled (greedy rows: by 1), top-k, top-p and min-p filtered float32
    logits per row: `decode.sampling.filter_logits` with the rows' settings."""
    temperature_S = jnp.where(params.temperature > 0, params.temperature, 1.0)
    return sampling.filter_logits(logits_SV, temperature_S, params.top_k, params.top_p,
                                  params.min_p)


def scaled_filtered_logits(logits_SV: jnp.ndarray, params: SlotParams) -> jnp.ndarray:
    """`filtered_logits`, its sort skipped at run time (`lax.cond`) when no row filters:
    then only the temperature scaling (1 for greedy rows)."""
    logits_SV = logits_SV.astype(jnp.float32)
    temperature_S1 = jnp.where(params.temperature > 0, params.temperature, 1.0)[:, None]
    filters = jnp.any((params.top_k > 0) | (params.top_p < 1) | (params.min_p > 0))
    return jax.lax.cond(filters, lambda: filtered_logits(logits_SV, params),
                        lambda: logits_SV / temperature_S1)


def pick(logits_SV: jnp.ndarray, params: SlotParams, positions_S: jnp.ndarray,
         want_top: jnp.ndarray) -> Picks:
    """Each row's next token under its own settings; `positions_S` are the positions
    the picked tokens will have (their keys' `fold_in` value); `want_top` () bool: some
    row asked for top-n logprobs.

    Work is skipped at run time (`lax.cond`) when no row needs it: the draw when every
    row is greedy, the sort of top-k/top-p/min-p when no row filters, the top-n when no row
    asks (a sort of the vocabulary per row costs more than the argmax by 100x on a CPU).
    """
    logits_SV = logits_SV.astype(jnp.float32)
    greedy_S = params.temperature <= 0
    argmax_S = first_argmax(logits_SV)
    temperature_S1 = jnp.where(greedy_S, 1.0, params.temperature)[:, None]

    def draw(_):
        filtered_SV = scaled_filtered_logits(logits_SV, params)
        keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.PRNGKey(s), p))(
            params.seed.astype(jnp.uint32), positions_S)
        drawn_S = jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, filtered_SV)
        return jnp.where(greedy_S, argmax_S, drawn_S).astype(jnp.int32)

    token_S = jax.lax.cond(jnp.all(greedy_S), lambda _: argmax_S, draw, None)
    logp_SV = jax.nn.log_softmax(logits_SV / temperature_S1, axis=-1)
    n = min(MAX_LOGPROBS, logp_SV.shape[-1])
    top_lp, top_ids = jax.lax.cond(
        want_top, lambda: tuple(jax.lax.top_k(logp_SV, n)),
        lambda: (jnp.zeros(logp_SV.shape[:1] + (n,), jnp.float32),
                 jnp.zeros(logp_SV.shape[:1] + (n,), jnp.int32)))
    return Picks(token=token_S,
                 logprob=jnp.take_along_axis(logp_SV, token_S[:, None], axis=1)[:, 0],
                 top_ids=top_ids.astype(jnp.int32), top_logprobs=top_lp)


def prompt_logprobs(logits_CV: jnp.ndarray, next_C: jnp.ndarray) -> tuple[jnp.ndarray, ...]:
    """For echo: the logprob of each next prompt token (C,) and the (C, n) best, from
    the raw logits of the positions before them."""
    logp_CV = jax.nn.log_softmax(logits_CV.astype(jnp.float32), axis=-1)
    top_lp, top_ids = jax.lax.top_k(logp_CV, min(MAX_LOGPROBS, logp_CV.shape[-1]))
    return (jnp.take_along_axis(logp_CV, next_C[:, None], axis=1)[:, 0],
            top_ids.astype(jnp.int32), top_lp)

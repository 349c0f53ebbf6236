"""Speculative decoding as pure functions: propose k draft tokens, verify them in one pass.

Shapes: k draft tokens, T = k + 1 positions verified (the last accepted token, then
the k drafts), V the vocabulary, L a sequence buffer.

Drafting.
  `ngram_draft`: prompt lookup (Saxena's prompt-lookup decoding, vLLM's ngram proposer,
  `transformers`' `prompt_lookup_num_tokens`): the last n tokens of the sequence are
  searched for earlier in the prompt and output; the k tokens that followed the most
  recent earlier occurrence are the draft. The longest n in n_min..n_max that matches
  wins; by default 2..5 (`NGRAM`, as vLLM's common `prompt_lookup_min/max` settings):
  what follows a single repeated token is mostly not what comes next, and a rejected
  draft costs a wider pass. No model, no cost but the lookup; good when the output
  copies its input (rewriting, summarising, code edits).
  A draft model (`spec_decode.speculative_generate(draft=...)`) proposes k tokens of
  its own instead, with its distribution q.

Verification: the target model runs once over the T positions; position i's logits
give the target's distribution p_i of the token after draft i - 1.
  `greedy_verify`: accept the longest prefix of drafts that equals the target's
  argmax, then the target's own token at the first disagreement (or the bonus token
  after k accepted drafts): output = argmax_i for i = 0..n, n + 1 tokens per pass.
  `rejection_verify` (Leviathan et al. 2023, Chen et al. 2023): draft i is accepted
  with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the token is
  drawn from norm(max(0, p_i - q_i)), after k acceptances from p_k. The emitted
  tokens are distributed exactly as sampling from p alone. A deterministic draft
  (prompt lookup) is q = one_hot(d).

All functions are for one sequence; `jax.vmap` them for a batch.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jaxformer.decode import sampling
from jaxformer.decode.sampling import NEG

__all__ = ["NGRAM", "ngram_draft", "greedy_verify", "rejection_verify", "target_probs"]

NGRAM = (2, 5)  # prompt lookup's default (n_min, n_max)


def ngram_draft(tokens_L: jax.Array, length: jax.Array, *, k: int, n_max: int = NGRAM[1],
                n_min: int = NGRAM[0]) -> tuple[jax.Array, jax.Array]:
    """Prompt-lookup draft of one sequence.

    Args:
      tokens_L: (L,) the sequence so far (prompt then output) in slots 0..length-1;
        what lies beyond `length` is ignored.
      length: () int, the number of valid tokens.
      k: tokens to propose; n_max >= n_min >= 1: n-gram sizes tried.
    Returns:
      (draft (k,) int32, count () int32 in 0..k): the first `count` ids of `draft` are
      the proposal (fewer than k when the match is near the end; 0 when none matched).
    """
    if not (1 <= n_min <= n_max):
        raise ValueError(f"ngram sizes must satisfy 1 <= n_min <= n_max, got {n_min}, {n_max}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    size = tokens_L.shape[0]
    padded = jnp.concatenate([tokens_L, jnp.zeros((k + n_max,), tokens_L.dtype)])
    start_J = jnp.arange(size)
    draft, count = jnp.zeros((k,), jnp.int32), jnp.zeros((), jnp.int32)
    for n in range(n_min, n_max + 1):  # later (longer) matches override shorter ones
        tail = jax.lax.dynamic_slice(padded, (jnp.maximum(length - n, 0),), (n,))
        match_J = jnp.ones((size,), bool)
        for i in range(n):
            match_J &= padded[start_J + i] == tail[i]
        # An earlier occurrence, followed by at least one known token.
        match_J &= (start_J + n < length) & (length >= n + 1)
        best = jnp.max(jnp.where(match_J, start_J, -1))
        follow = best + n
        found_draft = jax.lax.dynamic_slice(padded, (jnp.maximum(follow, 0),), (k,))
        found_count = jnp.clip(length - follow, 0, k)
        draft = jnp.where(best >= 0, found_draft.astype(jnp.int32), draft)
        count = jnp.where(best >= 0, found_count, count).astype(jnp.int32)
    return draft, count


def greedy_verify(logits_TV: jax.Array, draft_k: jax.Array,
                  count: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Greedy acceptance of k drafts against the target's (k + 1, V) logits.

    Returns (tokens (k + 1,) int32, emitted () int32 in 1..count + 1): the first
    `emitted` tokens are the output; they are the target's argmax at positions
    0..n (an accepted draft equals it), so the result is plain greedy decoding.
    """
    k = draft_k.shape[0]
    target_T = jnp.argmax(logits_TV, axis=-1).astype(jnp.int32)
    agree_k = (draft_k == target_T[:k]) & (jnp.arange(k) < count)
    accepted = jnp.sum(jnp.cumprod(agree_k.astype(jnp.int32)))
    return target_T, (accepted + 1).astype(jnp.int32)


def rejection_verify(p_TV: jax.Array, q_kV: jax.Array, draft_k: jax.Array, count: jax.Array,
                     rng: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Speculative sampling: accept draft i with probability min(1, p_i(d_i) / q_i(d_i)).

    Args:
      p_TV: (k + 1, V) the target's probabilities (after temperature / top-k / top-p).
      q_kV: (k, V) the draft's probabilities each draft was drawn from (one-hot for a
        deterministic draft such as prompt lookup).
      draft_k: (k,) draft ids; count: () how many of them are real (0..k).
      rng: a key.
    Returns:
      (tokens (k + 1,) int32, emitted () int32 in 1..count + 1): the accepted drafts,
      then one token from norm(max(0, p_n - q_n)) at the first rejection n, or from
      p_n when every real draft was accepted.
    """
    k = draft_k.shape[0]
    accept_rng, residual_rng = jax.random.split(rng)
    p_at = jnp.take_along_axis(p_TV[:k], draft_k[:, None], axis=-1)[:, 0]
    q_at = jnp.take_along_axis(q_kV, draft_k[:, None], axis=-1)[:, 0]
    u_k = jax.random.uniform(accept_rng, (k,))
    accept_k = (u_k * q_at < p_at) & (jnp.arange(k) < count)
    accepted = jnp.sum(jnp.cumprod(accept_k.astype(jnp.int32)))
    p_V = p_TV[accepted]
    q_V = jnp.where(accepted < count, q_kV[jnp.minimum(accepted, k - 1)], 0.0)
    residual_V = jnp.maximum(p_V - q_V, 0.0)
    # p == q to rounding leaves nothing: then rejection had probability ~0; fall back to p.
    residual_V = jnp.where(jnp.sum(residual_V) > 0, residual_V, p_V)
    logits_V = jnp.where(residual_V > 0, jnp.log(jnp.maximum(residual_V, 1e-38)), NEG)
    last = jax.random.categorical(residual_rng, logits_V).astype(jnp.int32)
    tokens = jnp.where(jnp.arange(k + 1) < accepted,
                       jnp.concatenate([draft_k.astype(jnp.int32), jnp.zeros((1,), jnp.int32)]),
                       last)
    return tokens, (accepted + 1).astype(jnp.int32)


def target_probs(logits_TV: jax.Array, temperature: float, top_k: Optional[int] = None,
                 top_p: Optional[float] = None) -> jax.Array:
    """(T, V) probabilities of `sampling.make_sampler(temperature, top_k, top_p)`'s draw."""
    logits_TV = sampling.filter_logits(logits_TV, temperature, top_k, top_p)
    return jax.nn.softmax(logits_TV, axis=-1)

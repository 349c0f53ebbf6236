"""Beam search with a length penalty, for the encoder-decoder model.

Same cache and same step as greedy decoding: the B * W beams are rows of one
`DecodeCache` (the memory's cross keys/values are projected once for B rows
and shared by each row's W beams, read once a step for all of them). After each step every batch element keeps the W best
of its W * V candidates and the cache rows are gathered from their parent
beams.

Scoring. A beam's log-probability is the sum of its tokens' log-softmax. It is
ranked by the GNMT length-normalised score (Wu et al. 2016)

    score = log_prob / ((5 + length) / 6) ** length_penalty

where length counts tokens up to and including EOS. `length_penalty=0` ranks by
raw log-probability. A beam that emitted EOS stays in the pool, extended only
by PAD at no cost, so its score is frozen and it competes with the live beams
at every step (finished and live beams share the W slots). With W = 1 this is
exactly greedy decoding.

Processors and forced prefixes act on the logits before the log-softmax: a
processor sees every beam as a row (tokens (B*W, N)); a beam inside its row's
forced prefix may only take the prefix token, at no cost. With either one set,
step log-probabilities are floored at DEAD so that repeated suppressions stay
finite.
"""

from __future__ import annotations

from typing import Any, Optional

import flax.struct
import jax
import jax.numpy as jnp

from jaxformer.decode import cache as cache_lib
from jaxformer.decode import processors as processors_lib
from jaxformer.decode.inputs import check_encdec, decodable
from jaxformer.decode.cache import memory_cache
from jaxformer.decode.loop import (TRACE_COUNTS, DecodeResult, cached_logits_fn, decode_jit,
                                   run_in_segments, segment_lengths, segments_for)
from jaxformer.nn.model import DecoderOnlyLM, Transformer

DEAD = -1e9  # log-probability of a beam that must never be chosen (finite: no NaN)


@flax.struct.dataclass
class BeamState:
    """The beam loop carry; rows are batch-major, beam-minor (row = b * W + w).

    Attributes:
      step: () int32, tokens generated so far.
      token_R: (B*W,) int32, the token each beam feeds next.
      cache: the `DecodeCache` of all B*W beams.
      tokens_BWN: (B, W, N) int32, each beam's tokens so far, PAD-initialised.
      log_prob_BW: (B, W) float32, summed log-probabilities.
      lengths_BW: (B, W) int32, tokens up to and including EOS (or generated so far).
      finished_BW: (B, W) bool.
    """

    step: jax.Array
    token_R: jax.Array
    cache: Any
    tokens_BWN: jax.Array
    log_prob_BW: jax.Array
    lengths_BW: jax.Array
    finished_BW: jax.Array


def length_normalised(log_prob, lengths, length_penalty: float):
    """GNMT: log_prob / ((5 + length) / 6) ** length_penalty."""
    return log_prob / ((5.0 + lengths.astype(jnp.float32)) / 6.0) ** length_penalty


def top_candidates(logp_BWV, k: int):
    """(values (B, k), flat indices w * V + token (B, k)) of the k best of each window's
    W * V candidates, best first: `lax.top_k` of the flattened candidates, ties
    included (the lower beam, then the lower token, first), in two steps: each
    beam's k best, then the k best of those W * k. One `top_k` over W * V whose
    results are then sliced is compiled by XLA:CPU as a sort of all of them
    (259,320 for Whisper at W = 5: 55 ms a step, most of its beam step's time);
    the per-beam `top_k` stays XLA's TopK and the second sorts W * k values."""
    batch, width, vocab = logp_BWV.shape
    value_BWk, token_BWk = jax.lax.top_k(logp_BWV, k)
    value_BK, pick_BK = jax.lax.top_k(value_BWk.reshape(batch, width * k), k)
    flat_BWk = token_BWk + (jnp.arange(width) * vocab)[None, :, None]
    return value_BK, jnp.take_along_axis(flat_BWk.reshape(batch, width * k), pick_BK, axis=1)


def beam_step(state: BeamState, logits_RV: jnp.ndarray, cache, *, beam_size: int,
              length_penalty: float, eos_id: int, pad_id: int) -> BeamState:
    """Extend every beam by every token, keep the W best candidates per batch element."""
    batch, width, _ = state.tokens_BWN.shape
    vocab = logits_RV.shape[-1]
    log_probs_BWV = jax.nn.log_softmax(logits_RV.astype(jnp.float32)).reshape(
        batch, width, vocab)
    # Live beams: every continuation. Finished beams: only PAD, at no cost.
    pad_only_V = jnp.where(jnp.arange(vocab) == pad_id, 0.0, DEAD)
    step_BWV = jnp.where(state.finished_BW[..., None], pad_only_V, log_probs_BWV)
    candidate_BWV = state.log_prob_BW[..., None] + step_BWV
    lengths_BW = jnp.where(state.finished_BW, state.lengths_BW, state.step + 1)
    ranking_BWV = length_normalised(candidate_BWV, lengths_BW[..., None], length_penalty)
    _, best_BW = top_candidates(ranking_BWV, beam_size)
    parent_BW, token_BW = best_BW // vocab, (best_BW % vocab).astype(jnp.int32)

    def from_parent(x_BW):
        return jnp.take_along_axis(x_BW, parent_BW, axis=1)

    was_finished_BW = from_parent(state.finished_BW)
    token_BW = jnp.where(was_finished_BW, pad_id, token_BW)
    tokens_BWN = jnp.take_along_axis(state.tokens_BWN, parent_BW[..., None], axis=1)
    tokens_BWN = jax.lax.dynamic_update_slice(tokens_BWN, token_BW[..., None], (0, 0, state.step))
    log_prob_BW = jnp.take_along_axis(candidate_BWV.reshape(batch, width * vocab), best_BW,
                                      axis=1)
    # The cache rows follow their parents (cross keys/values are equal within a batch
    # element, so only the self-attention cache is gathered).
    rows_R = (jnp.arange(batch)[:, None] * width + parent_BW).reshape(-1)
    def reorder(kvs):  # every beam continues its parent's keys and values
        return None if kvs is None else tuple(type(kv)(*(x[rows_R] for x in kv)) for kv in kvs)
    cache = cache.replace(self_kv=reorder(cache.self_kv), past_kv=reorder(cache.past_kv))
    return state.replace(
        step=state.step + 1, token_R=token_BW.reshape(-1), cache=cache,
        tokens_BWN=tokens_BWN, log_prob_BW=log_prob_BW,
        lengths_BW=from_parent(lengths_BW),
        finished_BW=was_finished_BW | (token_BW == eos_id))


def force_prefix_logits(logits_RV, step, prefix_RP, prefix_len_R):
    """Rows still inside their prefix: only the prefix token is possible (logit 0)."""
    column = jnp.minimum(step, prefix_RP.shape[1] - 1)
    forced_R = jax.lax.dynamic_index_in_dim(prefix_RP, column, axis=1, keepdims=False)
    only_RV = jnp.arange(logits_RV.shape[-1])[None, :] == forced_R[:, None]
    forced_RV = jnp.where(only_RV, 0.0, processors_lib.NEG).astype(logits_RV.dtype)
    return jnp.where((step < prefix_len_R)[:, None], forced_RV, logits_RV)


@decode_jit(static_argnames=("model", "max_new_tokens", "beam_size", "length_penalty",
                             "processors", "segments"))
def _beam_jit(model, params, src, src_mask, prefix_BP=None, prefix_len_B=None, *,
              max_new_tokens, beam_size, length_penalty, processors=(), segments=1):
    TRACE_COUNTS["beam"] += 1
    c = model.config
    batch, width = src.shape[0], beam_size
    # Row b * W + w is beam w of example b. The memory is projected once and
    # shared by the W beams (not repeated); the loop never re-projects it.
    cache = memory_cache(model, params, src, src_mask,
                         segment_lengths(max_new_tokens, segments)[0], repeats=width)
    state = BeamState(
        step=jnp.zeros((), jnp.int32),
        token_R=jnp.full((batch * width,), c.bos_id, jnp.int32),
        cache=cache,
        tokens_BWN=jnp.full((batch, width, max_new_tokens), c.pad_id, jnp.int32),
        # All beams start identical: only beam 0 may expand at the first step.
        log_prob_BW=jnp.where(jnp.arange(width) == 0, 0.0, DEAD)[None].repeat(batch, 0),
        lengths_BW=jnp.zeros((batch, width), jnp.int32),
        finished_BW=jnp.zeros((batch, width), bool))
    logits_fn = cached_logits_fn(model, params)
    edits = bool(processors) or prefix_BP is not None
    if prefix_BP is not None:
        prefix_RP, prefix_len_R = (jnp.repeat(x, width, axis=0) for x in (prefix_BP, prefix_len_B))

    def body(state, _):
        logits_RV, cache = logits_fn(state.token_R, state.cache, state.step)
        if edits:
            tokens_RN = state.tokens_BWN.reshape(batch * width, -1)
            logits_RV = processors_lib.apply(processors, logits_RV.astype(jnp.float32),
                                             state.step, tokens_RN)
            if prefix_BP is not None:
                logits_RV = force_prefix_logits(logits_RV, state.step, prefix_RP, prefix_len_R)
            # Floor at DEAD (after log-softmax) so sums of suppressed steps stay finite.
            logits_RV = jnp.maximum(jax.nn.log_softmax(logits_RV), DEAD)
        return beam_step(state, logits_RV, cache, beam_size=width,
                         length_penalty=length_penalty, eos_id=c.eos_id,
                         pad_id=c.pad_id), None

    state = run_in_segments(lambda s, steps: jax.lax.scan(body, s, None, length=steps)[0],
                            state, max_new_tokens, segments, cache_lib.fold)
    scores_BW = length_normalised(state.log_prob_BW, state.lengths_BW, length_penalty)
    best_B1 = jnp.argmax(scores_BW, axis=1)[:, None]
    return DecodeResult(
        tokens=jnp.take_along_axis(state.tokens_BWN, best_B1[..., None], axis=1)[:, 0],
        lengths=jnp.take_along_axis(state.lengths_BW, best_B1, axis=1)[:, 0],
        scores=jnp.take_along_axis(scores_BW, best_B1, axis=1)[:, 0])


def beam_search(model: Transformer, params, src_BS, *, max_new_tokens: int, beam_size: int,
                length_penalty: float = 0.6, src_mask=None, processors=None, prefix=None,
                prefix_lengths=None, segments: Optional[int] = None) -> DecodeResult:
    """Beam search decoding of an encoder-decoder `Transformer`.

    Args:
      model, params, src_BS, max_new_tokens, src_mask: as `decoding.greedy_decode`.
      beam_size: W >= 1 beams per example (W <= target vocabulary).
      length_penalty: alpha >= 0 of the GNMT penalty (0 = raw log-probability).
      processors, prefix, prefix_lengths, segments: as `decoding.greedy_decode`;
        forced prefix tokens add 0 to the log-probability.
    Returns:
      DecodeResult(tokens (B, N) of the best beam, lengths (B,), scores (B,) its
      length-normalised log-probability).
    Raises:
      ValueError for a decoder-only LM, naming beam search and why (its beams start from
      one BOS per source; a `DecoderOnlyLM` continues prompts: `generate`).
    """
    if isinstance(model, DecoderOnlyLM):
        raise ValueError("beam_search decodes encoder-decoder Transformers only (every beam "
                         "starts from BOS); a DecoderOnlyLM has no beam search: use generate()")
    procs, prefix_BP, prefix_len_B = check_encdec(
        model, src_BS, src_mask, max_new_tokens=max_new_tokens, processors=processors,
        prefix=prefix, prefix_lengths=prefix_lengths)
    vocab = model.config.tgt_vocab_size
    if isinstance(beam_size, bool) or not isinstance(beam_size, int) or not 1 <= beam_size <= vocab:
        raise ValueError(f"beam_size must be an int in 1..{vocab} (the target vocabulary), "
                         f"got {beam_size!r}")
    if isinstance(length_penalty, bool) or not isinstance(length_penalty, (int, float)) or \
            not 0 <= length_penalty < float("inf"):
        raise ValueError(f"length_penalty must be a number >= 0, got {length_penalty!r}")
    return _beam_jit(*decodable(model, params), jnp.asarray(src_BS), src_mask,
                     prefix_BP, prefix_len_B, max_new_tokens=int(max_new_tokens),
                     beam_size=beam_size, length_penalty=float(length_penalty),
                     processors=procs, segments=segments_for(int(max_new_tokens), segments))

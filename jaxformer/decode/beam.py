"""Beam search with a length penalty, for the encoder-decoder model and the decoder-only LM.

Same cache and same step as greedy decoding: the B * W beams are rows of one
`DecodeCache` (the memory's cross keys/values are projected once for B rows
and shared by each row's W beams, read once a step for all of them). After each step every batch element keeps the W best
of its W * V candidates and the cache rows are gathered from their parent
beams. A decoder-only LM's prompts are prefilled once, B rows (left-aligned, as
`generate` does); the filled cache is then repeated to the B * W beam rows and the
prompt's last logits give the first step (so its W beams start from W distinct tokens).
Sliding-window rings are gathered like full caches: each beam keeps its parent's ring.

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
from jaxformer.decode.inputs import check_encdec, check_lm_prompt, decodable, left_align
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


def start_state(cache, token_R, *, batch: int, width: int, max_new_tokens: int,
                pad_id: int) -> BeamState:
    """The carry before the first step: W identical beams per example, so only beam 0
    may expand at the first step."""
    return BeamState(
        step=jnp.zeros((), jnp.int32), token_R=token_R, cache=cache,
        tokens_BWN=jnp.full((batch, width, max_new_tokens), pad_id, jnp.int32),
        log_prob_BW=jnp.where(jnp.arange(width) == 0, 0.0, DEAD)[None].repeat(batch, 0),
        lengths_BW=jnp.zeros((batch, width), jnp.int32),
        finished_BW=jnp.zeros((batch, width), bool))


def step_fn(config, *, width: int, length_penalty: float, processors=(), prefix_BP=None,
            prefix_len_B=None):
    """`advance(state, logits_RV, cache)`: the processors and the forced prefix applied
    to a step's logits, then `beam_step`."""
    edits = bool(processors) or prefix_BP is not None
    if prefix_BP is not None:
        prefix_RP, prefix_len_R = (jnp.repeat(x, width, axis=0) for x in (prefix_BP, prefix_len_B))

    def advance(state: BeamState, logits_RV, cache) -> BeamState:
        if edits:
            tokens_RN = state.tokens_BWN.reshape(logits_RV.shape[0], -1)
            logits_RV = processors_lib.apply(processors, logits_RV.astype(jnp.float32),
                                             state.step, tokens_RN)
            if prefix_BP is not None:
                logits_RV = force_prefix_logits(logits_RV, state.step, prefix_RP, prefix_len_R)
            # Floor at DEAD (after log-softmax) so sums of suppressed steps stay finite.
            logits_RV = jnp.maximum(jax.nn.log_softmax(logits_RV), DEAD)
        return beam_step(state, logits_RV, cache, beam_size=width,
                         length_penalty=length_penalty, eos_id=config.eos_id,
                         pad_id=config.pad_id)

    return advance


def best_beams(state: BeamState, length_penalty: float) -> DecodeResult:
    scores_BW = length_normalised(state.log_prob_BW, state.lengths_BW, length_penalty)
    best_B1 = jnp.argmax(scores_BW, axis=1)[:, None]
    return DecodeResult(
        tokens=jnp.take_along_axis(state.tokens_BWN, best_B1[..., None], axis=1)[:, 0],
        lengths=jnp.take_along_axis(state.lengths_BW, best_B1, axis=1)[:, 0],
        scores=jnp.take_along_axis(scores_BW, best_B1, axis=1)[:, 0])


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
    state = start_state(cache, jnp.full((batch * width,), c.bos_id, jnp.int32), batch=batch,
                        width=width, max_new_tokens=max_new_tokens, pad_id=c.pad_id)
    logits_fn = cached_logits_fn(model, params)
    advance = step_fn(c, width=width, length_penalty=length_penalty, processors=processors,
                      prefix_BP=prefix_BP, prefix_len_B=prefix_len_B)

    def body(state, _):
        return advance(state, *logits_fn(state.token_R, state.cache, state.step)), None

    state = run_in_segments(lambda s, steps: jax.lax.scan(body, s, None, length=steps)[0],
                            state, max_new_tokens, segments, cache_lib.fold)
    return best_beams(state, length_penalty)


@decode_jit(static_argnames=("model", "max_new_tokens", "beam_size", "length_penalty",
                             "processors"))
def lm_beam_program(model, params, prompt_BP, lengths_B, *, max_new_tokens, beam_size,
                    length_penalty, processors=()):
    """Beam search continuing right-padded prompts (B, P) of `lengths_B` tokens."""
    TRACE_COUNTS["beam"] += 1
    c = model.config
    (batch, width_P), width = prompt_BP.shape, beam_size
    cache = cache_lib.init_cache(c, batch, width_P + max_new_tokens - 1)
    cache = cache.replace(start_B=(width_P - lengths_B).astype(jnp.int32))
    last_BV, cache = cache_lib.prefill(model, params, cache,
                                       left_align(prompt_BP, lengths_B, c.pad_id))

    def repeated(kvs):  # row b * W + w: beam w of prompt b
        return tuple(type(kv)(*(jnp.repeat(x, width, axis=0) for x in kv)) for kv in kvs)

    cache = cache.replace(self_kv=repeated(cache.self_kv),
                          start_B=jnp.repeat(cache.start_B, width, axis=0))
    state = start_state(cache, jnp.full((batch * width,), c.pad_id, jnp.int32), batch=batch,
                        width=width, max_new_tokens=max_new_tokens, pad_id=c.pad_id)
    advance = step_fn(c, width=width, length_penalty=length_penalty, processors=processors)
    state = advance(state, jnp.repeat(last_BV, width, axis=0), cache)  # the first new token
    logits_fn = cached_logits_fn(model, params)

    def body(state, _):
        return advance(state, *logits_fn(state.token_R, state.cache, state.step)), None

    state = jax.lax.scan(body, state, None, length=max_new_tokens - 1)[0]
    return best_beams(state, length_penalty)


def beam_search(model: Transformer | DecoderOnlyLM, params, src_BS, *, max_new_tokens: int,
                beam_size: int, length_penalty: float = 0.6, src_mask=None, processors=None,
                prefix=None, prefix_lengths=None, segments: Optional[int] = None,
                prompt_lengths=None) -> DecodeResult:
    """Beam search decoding of an encoder-decoder `Transformer`, or of a `DecoderOnlyLM`
    continuing prompts.

    Args:
      model, params, src_BS, max_new_tokens, src_mask: as `decoding.greedy_decode`; for a
        `DecoderOnlyLM`, src_BS is the (B, P) right-padded prompts, as `generate`'s.
      beam_size: W >= 1 beams per example (W <= target vocabulary).
      length_penalty: alpha >= 0 of the GNMT penalty (0 = raw log-probability).
      processors, prefix, prefix_lengths, segments: as `decoding.greedy_decode`;
        forced prefix tokens add 0 to the log-probability (encoder-decoder only; a
        decoder-only LM takes processors, its step 0 the first new token).
      prompt_lengths: (B,) for a `DecoderOnlyLM`, as `generate`'s.
    Returns:
      DecodeResult(tokens (B, N) of the best beam's new tokens, lengths (B,), scores (B,)
      its length-normalised log-probability).
    Raises:
      ValueError naming the argument, before anything compiles.
    """
    vocab = model.config.tgt_vocab_size
    if isinstance(beam_size, bool) or not isinstance(beam_size, int) or not 1 <= beam_size <= vocab:
        raise ValueError(f"beam_size must be an int in 1..{vocab} (the target vocabulary), "
                         f"got {beam_size!r}")
    if isinstance(length_penalty, bool) or not isinstance(length_penalty, (int, float)) or \
            not 0 <= length_penalty < float("inf"):
        raise ValueError(f"length_penalty must be a number >= 0, got {length_penalty!r}")
    if isinstance(model, DecoderOnlyLM):
        return lm_beam_search(model, params, src_BS, max_new_tokens=max_new_tokens,
                              beam_size=beam_size, length_penalty=float(length_penalty),
                              processors=processors, prompt_lengths=prompt_lengths,
                              unsupported={"src_mask": src_mask, "prefix": prefix,
                                           "prefix_lengths": prefix_lengths,
                                           "segments": segments})
    if prompt_lengths is not None:
        raise ValueError("prompt_lengths: for a DecoderOnlyLM's prompts; an encoder-decoder "
                         "model's sources are masked by src_mask")
    procs, prefix_BP, prefix_len_B = check_encdec(
        model, src_BS, src_mask, max_new_tokens=max_new_tokens, processors=processors,
        prefix=prefix, prefix_lengths=prefix_lengths)
    return _beam_jit(*decodable(model, params), jnp.asarray(src_BS), src_mask,
                     prefix_BP, prefix_len_B, max_new_tokens=int(max_new_tokens),
                     beam_size=beam_size, length_penalty=float(length_penalty),
                     processors=procs, segments=segments_for(int(max_new_tokens), segments))


def lm_beam_search(model: DecoderOnlyLM, params, prompt_BP, *, max_new_tokens: int,
                   beam_size: int, length_penalty: float, processors, prompt_lengths,
                   unsupported: dict) -> DecodeResult:
    """`beam_search` of a decoder-only LM, after its own checks (`generate`'s)."""
    for name, value in unsupported.items():
        if value is not None:
            raise ValueError(f"{name}: an encoder-decoder beam search argument; a "
                             "DecoderOnlyLM's beam search takes prompts, prompt_lengths "
                             "and processors")
    procs = processors_lib.normalize(processors, model.config.tgt_vocab_size)
    prompt, lengths = check_lm_prompt(model.config, prompt_BP, prompt_lengths, max_new_tokens)
    return lm_beam_program(*decodable(model, params), jnp.asarray(prompt, jnp.int32),
                           jnp.asarray(lengths, jnp.int32), max_new_tokens=int(max_new_tokens),
                           beam_size=beam_size, length_penalty=length_penalty,
                           processors=procs)

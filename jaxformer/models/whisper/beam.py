"""Beam search for Whisper as CTranslate2 runs it (`BeamSearch::search`, which
faster-whisper calls at temperature 0), in one compiled program per shape.

    tokens, lengths, logprob, no_speech = beam_program(
        model, params, memory_BSD, prefix_BP, beam_size=5, max_candidates=5,
        length_penalty=1.0, ...)

The W beams of each window are rows of one batch (row b * W + w; the memory is
projected once per window and shared by its beams, read once a step for all W). The prompt (`prefix_BP`) is fed to
every beam, forced. After it, each step:

1. the logits of every beam go through Whisper's processors (suppressed
   tokens, the timestamp rules, on each beam's own history), then log-softmax,
   plus the beam's summed log-probability;
2. the 2W best of the W * V candidates of each window are taken, best first;
3. of the first W, each one that is EOS (or any, at the last step) is a
   finished hypothesis (its summed log-probability, EOS included; its tokens,
   EOS excluded), and its slot goes to the next candidate of W..2W-1 that is
   not EOS (none left: the slot keeps it);
4. a window is done once it has `max_candidates` (= round(W * patience))
   hypotheses, or, with no length penalty, once its best candidate finished.

The self-attention cache grows: `FIRST_SEGMENT` (32) slots for the first steps,
then the rest (`decode.cache.fold`: the slots written so far become its read-only
past), so a step of a window that ends early reads and reorders 32 slots of
keys and values by beam, not the 224 or more of the longest window (CTranslate2's
cache grows with the steps too).

The kept hypothesis is the one with the highest score / length **
length_penalty (length: its tokens, EOS excluded). Returned, per window: its
tokens (after the prompt), their count, its summed log-probability and the
no-speech probability after <|startoftranscript|>.
"""

from __future__ import annotations

import math

import flax.struct
import jax
import jax.numpy as jnp

from jaxformer.decode import cache as cache_lib, processors as processors_lib
from jaxformer.decode.beam import top_candidates
from jaxformer.decode.cache import encoded_cache
from jaxformer.decode.loop import TRACE_COUNTS, cached_logits_fn, decode_jit


# The self-attention cache starts this many slots long and grows to the whole length only
# if a window runs past it: most windows end within it (two sentences, ~30 tokens), and a
# step then reads and reorders 32 slots of keys and values by beam instead of 224 or more.
FIRST_SEGMENT = 32


def beam_segments(num_steps: int, first: int = FIRST_SEGMENT) -> tuple[int, ...]:
    """The steps of each while loop: `first`, then the rest (one segment if that is all)."""
    return (num_steps,) if num_steps <= first else (first, num_steps - first)


def max_candidates(beam_size: int, patience: float) -> int:
    """Hypotheses a window collects before it stops (CTranslate2: round(W * patience),
    at least 1)."""
    return max(1, int(round(beam_size * patience)))


def check_beam(beam_size, patience, length_penalty) -> None:
    """ValueError naming the first beam setting out of range."""
    if isinstance(beam_size, bool) or not isinstance(beam_size, int) or beam_size < 1:
        raise ValueError(f"beam_size must be an int >= 1, got {beam_size!r}")
    if isinstance(patience, bool) or not isinstance(patience, (int, float)) or not (
            math.isfinite(patience) and patience > 0):
        raise ValueError(f"patience must be a finite number > 0, got {patience!r}")
    if isinstance(length_penalty, bool) or not isinstance(length_penalty, (int, float)) or \
            not math.isfinite(length_penalty):
        raise ValueError(f"length_penalty must be a finite number, got {length_penalty!r}")


@flax.struct.dataclass
class Beams:
    """The loop carry: R = B * W rows, N = prompt + generated columns.

    step: () int32; token_R: the token each row feeds next; cache: all rows;
    tokens_RN: each beam's tokens (prompt included); score_BW: summed
    log-probabilities; best_*: each window's best finished hypothesis so far
    (normalised score, summed log-probability, tokens, length); count_B:
    hypotheses finished; top_done_B: the best candidate finished once;
    done_B: the window stopped; no_speech_B.
    """

    step: jax.Array
    token_R: jax.Array
    cache: object
    tokens_RN: jax.Array
    score_BW: jax.Array
    best_norm_B: jax.Array
    best_sum_B: jax.Array
    best_tokens_BN: jax.Array
    best_len_B: jax.Array
    count_B: jax.Array
    top_done_B: jax.Array
    done_B: jax.Array
    no_speech_B: jax.Array


def beam_replacements(eos_BK, finished_BW, width: int):
    """The candidate (0..2W-1) each slot continues with: itself, or, for the m-th
    finished slot, the m-th candidate of W..2W-1 that is not EOS (if any)."""
    rank_BW = jnp.cumsum(finished_BW, axis=1) - 1
    ok_BJ = ~eos_BK[:, width:]
    order_BJ = jnp.cumsum(ok_BJ, axis=1) - 1
    match_BWJ = finished_BW[..., None] & ok_BJ[:, None, :] & (
        rank_BW[..., None] == order_BJ[:, None, :])
    return jnp.where(match_BWJ.any(axis=-1), width + jnp.argmax(match_BWJ, axis=-1),
                     jnp.arange(width)[None])


@decode_jit(static_argnames=("model", "max_new_tokens", "processors", "no_speech_id", "sot_step",
                             "beam_size", "max_candidates", "length_penalty", "first_segment"))
def beam_program(model, params, memory_BSD, prefix_BP, *, max_new_tokens, processors,
                 no_speech_id, beam_size, max_candidates, length_penalty, sot_step=0,
                 first_segment=FIRST_SEGMENT):
    """(tokens (B, N), lengths (B,), summed log-probability (B,), no-speech
    probability (B,), read at step `sot_step`: where <|startoftranscript|> is fed) of
    each window's chosen hypothesis (module docstring), from the windows' encoder
    output `memory_BSD` (B, 1500, D) (`decoding.encode_windows`).
    `tokens` hold the prompt after BOS, then the hypothesis (EOS excluded, PAD after);
    `lengths` count the hypothesis only. The self-attention cache holds `first_segment`
    slots for the first steps (`beam_segments`), then all of them."""
    TRACE_COUNTS["whisper_beam"] += 1
    c = model.config
    batch, width, n = memory_BSD.shape[0], beam_size, max_new_tokens
    rows = batch * width
    begin = 0 if prefix_BP is None else prefix_BP.shape[1]
    prefix_RP = None if prefix_BP is None else jnp.repeat(prefix_BP, width, axis=0)
    step_fn = cached_logits_fn(model, params)
    neg_inf = jnp.float32(-jnp.inf)
    state = Beams(
        step=jnp.zeros((), jnp.int32), token_R=jnp.full((rows,), c.bos_id, jnp.int32),
        cache=encoded_cache(model, params, memory_BSD, jnp.ones(
            (batch, 1, 1, memory_BSD.shape[1]), bool), beam_segments(n, first_segment)[0],
            repeats=width),
        tokens_RN=jnp.full((rows, n), c.pad_id, jnp.int32),
        # All beams start equal: only beam 0 expands at the first free step.
        score_BW=jnp.where(jnp.arange(width) == 0, 0.0, neg_inf)[None].repeat(batch, 0),
        best_norm_B=jnp.full((batch,), neg_inf), best_sum_B=jnp.full((batch,), neg_inf),
        best_tokens_BN=jnp.full((batch, n), c.pad_id, jnp.int32),
        best_len_B=jnp.zeros((batch,), jnp.int32), count_B=jnp.zeros((batch,), jnp.int32),
        top_done_B=jnp.zeros((batch,), bool), done_B=jnp.zeros((batch,), bool),
        no_speech_B=jnp.zeros((batch,), jnp.float32))

    def forced(s: Beams, logits_RV, cache) -> Beams:
        token_R = jax.lax.dynamic_index_in_dim(prefix_RP, jnp.minimum(s.step, begin - 1),
                                               axis=1, keepdims=False)
        return s.replace(step=s.step + 1, token_R=token_R, cache=cache,
                         tokens_RN=jax.lax.dynamic_update_slice(
                             s.tokens_RN, token_R[:, None], (0, s.step)))

    def free(s: Beams, logits_RV, cache) -> Beams:
        vocab = logits_RV.shape[-1]
        logits_RV = processors_lib.apply(processors, logits_RV.astype(jnp.float32), s.step,
                                         s.tokens_RN)
        logp_BWV = s.score_BW[..., None] + jax.nn.log_softmax(logits_RV).reshape(
            batch, width, vocab)
        value_BK, flat_BK = top_candidates(logp_BWV, 2 * width)
        parent_BK, token_BK = flat_BK // vocab, (flat_BK % vocab).astype(jnp.int32)
        eos_BK = token_BK == c.eos_id
        last = s.step == n - 1
        finished_BW = eos_BK[:, :width] | last
        # Finished hypotheses: EOS excluded from the tokens, included in the sum.
        generated = s.step - begin  # tokens generated before this step
        length_BW = jnp.where(eos_BK[:, :width], generated, generated + 1)
        norm_BW = value_BK[:, :width] / jnp.power(length_BW.astype(jnp.float32),
                                                  jnp.float32(length_penalty))
        norm_BW = jnp.where(finished_BW, norm_BW, neg_inf)
        pick_B = jnp.argmax(norm_BW, axis=1)
        pick_norm_B = jnp.take_along_axis(norm_BW, pick_B[:, None], axis=1)[:, 0]
        better_B = ~s.done_B & finished_BW.any(axis=1) & (pick_norm_B > s.best_norm_B)
        pick_row_B = jnp.arange(batch) * width + jnp.take_along_axis(
            parent_BK, pick_B[:, None], axis=1)[:, 0]
        pick_tok_B = jnp.take_along_axis(token_BK, pick_B[:, None], axis=1)[:, 0]
        pick_eos_B = pick_tok_B == c.eos_id
        pick_tokens_BN = s.tokens_RN[pick_row_B].at[:, s.step].set(
            jnp.where(pick_eos_B, c.pad_id, pick_tok_B))

        def keep(new, old):
            return jnp.where(better_B.reshape((-1,) + (1,) * (old.ndim - 1)), new, old)

        count_B = s.count_B + jnp.where(s.done_B, 0, finished_BW.sum(axis=1))
        top_done_B = s.top_done_B | finished_BW[:, 0]
        stop_B = (top_done_B & (count_B >= 1)) if length_penalty == 0 else (
            count_B >= max_candidates)
        # The live beams: finished slots continue with the next non-EOS candidate.
        slot_BW = beam_replacements(eos_BK, finished_BW, width)
        parent_BW = jnp.take_along_axis(parent_BK, slot_BW, axis=1)
        token_BW = jnp.take_along_axis(token_BK, slot_BW, axis=1)
        rows_R = (jnp.arange(batch)[:, None] * width + parent_BW).reshape(-1)
        def reorder(kvs):  # every beam continues its parent's keys and values
            return None if kvs is None else tuple(type(kv)(*(x[rows_R] for x in kv))
                                                  for kv in kvs)

        cache = cache.replace(self_kv=reorder(cache.self_kv), past_kv=reorder(cache.past_kv))
        token_R = token_BW.reshape(-1)
        return s.replace(
            step=s.step + 1, token_R=token_R, cache=cache,
            tokens_RN=s.tokens_RN[rows_R].at[:, s.step].set(token_R),
            score_BW=jnp.take_along_axis(value_BK, slot_BW, axis=1),
            best_norm_B=keep(pick_norm_B, s.best_norm_B),
            best_sum_B=keep(jnp.take_along_axis(value_BK, pick_B[:, None], axis=1)[:, 0],
                            s.best_sum_B),
            best_tokens_BN=keep(pick_tokens_BN, s.best_tokens_BN),
            best_len_B=keep(jnp.take_along_axis(length_BW, pick_B[:, None], axis=1)[:, 0],
                            s.best_len_B),
            count_B=count_B, top_done_B=top_done_B, done_B=s.done_B | stop_B | last)

    def body(s: Beams) -> Beams:
        logits_RV, cache = step_fn(s.token_R, s.cache, s.step)
        logits_RV32 = logits_RV.astype(jnp.float32)
        p_R = jnp.exp(logits_RV32[:, no_speech_id] - jax.nn.logsumexp(logits_RV32, axis=-1))
        s = s.replace(no_speech_B=jnp.where(s.step == sot_step, p_R[::width], s.no_speech_B))
        if begin == 0:
            return free(s, logits_RV, cache)
        return jax.lax.cond(s.step < begin, forced, free, s, logits_RV, cache)

    stop = 0
    for i, steps in enumerate(beam_segments(n, first_segment)):  # the cache grows between segments
        if i:
            state = state.replace(cache=cache_lib.fold(state.cache, steps))
        stop += steps
        state = jax.lax.while_loop(lambda s, stop=stop: (s.step < stop) & ~jnp.all(s.done_B),
                                   body, state)
    return state.best_tokens_BN, state.best_len_B, state.best_sum_B, state.no_speech_B

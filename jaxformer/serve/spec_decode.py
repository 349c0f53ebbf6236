"""`speculative_generate`: `decode.generate` with k tokens verified per forward pass.

Each round drafts k tokens (prompt lookup, `speculative.ngram_draft`, or a smaller
draft model with the same vocabulary), feeds [last token, k drafts] to the target in
one cached pass, keeps what `speculative.greedy_verify` / `rejection_verify` accept and
rolls the cache back over the rest: the rejected keys stay in their slots but the
cache index moves back to the last accepted one, so they are invisible (masks go by
slot) and the next round overwrites them. Greedy output equals `generate`'s (up to the
float rounding of a k+1-token pass against a 1-token one); sampled output is
distributed as `generate`'s sampling (not the same draws). With one row, a round whose
lookup finds no draft feeds the last token alone (`lax.cond`: a plain decode step's
cost, not k + 1 positions'; under `vmap` the batched predicate would run both).

Cache invariants per sequence of `length` tokens (prompt + output), its first token
in slot `offset` = P - prompt length (the prompt left-aligned, as `generate` has it):
  target: slots offset..offset+length-2 hold the keys of every token but the last
  (index = offset + length - 1);
  draft model: slots offset..offset+length-3 (index = offset + length - 2), so each
  round feeds it the last two tokens (a fixed shape whether 0 or k drafts were
  accepted last round).
One sequence is decoded by `lax.while_loop`; a batch is its `jax.vmap` (rows accept
different counts, so each row's cache index is its own).

Sliding-window (ring) layers keep k slots beyond their window (`init_cache(...,
rollback=k)`): a round writes at most k slots past the index it rolls back to, so the
rejected keys land only where keys already out of every window were.
"""

from __future__ import annotations

from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.decode import cache as cache_lib
from jaxformer.decode import sampling
from jaxformer.decode.inputs import (check_max_new_tokens, check_prompt, check_rng, decodable,
                                     left_align)
from jaxformer.decode.loop import decode_jit
from jaxformer.nn import stacking
from jaxformer.nn.model import DecoderOnlyLM
from jaxformer.serve import speculative

__all__ = ["SpecResult", "speculative_generate"]


@flax.struct.dataclass
class SpecResult:
    """tokens (B, N) int32 (PAD after EOS), lengths (B,) as `DecodeResult`;
    drafted (B,): draft tokens proposed (real ones, not padding), accepted (B,):
    how many of them the target accepted; rounds (B,): target passes after the prompt."""
    tokens: jax.Array
    lengths: jax.Array
    drafted: jax.Array
    accepted: jax.Array
    rounds: jax.Array

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted over the batch (0 when nothing was drafted)."""
        drafted = int(np.sum(self.drafted))
        return float(np.sum(self.accepted)) / drafted if drafted else 0.0


@flax.struct.dataclass
class SpecState:
    seq_L: jax.Array           # prompt then output; `length` valid
    length: jax.Array
    cache: cache_lib.DecodeCache
    draft_cache: Optional[cache_lib.DecodeCache]
    done: jax.Array
    drafted: jax.Array
    accepted: jax.Array
    rounds: jax.Array


def draft_model_tokens(draft_model, draft_params, cache, seq_L, length, *, k, select_probs,
                       rng, offset):
    """k tokens drawn from the draft model after `seq_L[:length]`, their (k, V)
    distributions, and the draft cache (index at offset + length - 2 + k - 1, rolled
    back by the caller; `offset`: the cache slot of the sequence's first token)."""
    cache = cache.replace(index=(offset + length - 2).astype(jnp.int32))
    last_two = jax.lax.dynamic_slice(seq_L, (length - 2,), (2,))
    logits, cache = cache_lib.cached_forward(draft_model, draft_params, cache, last_two[None])
    rngs = jax.random.split(rng, k)

    def pick(logits_V, key):
        q_V = select_probs(logits_V[None])[0]
        token = jax.random.categorical(key, jnp.log(jnp.maximum(q_V, 1e-38))
                                       ).astype(jnp.int32)
        token = jnp.where(jnp.max(q_V) >= 1.0, jnp.argmax(q_V).astype(jnp.int32), token)
        return token, q_V

    first, q_first = pick(logits[0, -1], rngs[0])

    def step(carry, key):
        cache, token = carry
        logits, cache = cache_lib.cached_forward(draft_model, draft_params, cache,
                                                 token[None, None])
        new, q_V = pick(logits[0, -1], key)
        return (cache, new), (new, q_V)

    (cache, _), (rest, q_rest) = jax.lax.scan(step, (cache, first), rngs[1:])
    return (jnp.concatenate([first[None], rest]), jnp.concatenate([q_first[None], q_rest]),
            cache)


def decode_one(model, params, prompt_P, prompt_len, rng, draft_model, draft_params, *,
               max_new_tokens, k, ngram, temperature, top_k, top_p, skip_empty=False):
    """Speculative decoding of one prompt (P,) of `prompt_len` valid ids; see module doc.
    `skip_empty`: a round without drafts feeds one position (prompt lookup only: a draft
    model always drafts k; not under `vmap`, where the batched predicate would run both
    branches)."""
    c = model.config
    width = prompt_P.shape[0]
    size = width + max_new_tokens + k + 1
    seq_L = jnp.full((size,), c.pad_id, jnp.int32).at[:width].set(prompt_P)
    greedy = temperature == 0

    if greedy:
        def probs(logits_TV):
            return jax.nn.one_hot(jnp.argmax(logits_TV, -1), logits_TV.shape[-1])
    else:
        def probs(logits_TV):
            return speculative.target_probs(logits_TV, temperature, top_k, top_p)

    # The prompt left-aligned, as `generate` fills it (the row's start at `offset`): its
    # last token's key in the last prompt slot, so no padding is written after it, where
    # a ring would keep the padding's keys instead of the prompt's.
    offset = (width - prompt_len).astype(jnp.int32)

    def filled(m, p, slots):
        cache = cache_lib.init_cache(m.config, 1, slots, rollback=k)
        cache = cache.replace(start_B=offset[None])
        _, cache = cache_lib.cached_forward(m, p, cache, left_align(
            prompt_P[None], prompt_len[None], c.pad_id))
        return cache

    slots = width + max_new_tokens + k - 1
    cache = filled(model, params, slots)
    draft_cache = None if draft_model is None else filled(draft_model, draft_params, slots)
    zero = jnp.zeros((), jnp.int32)
    state = SpecState(seq_L, prompt_len.astype(jnp.int32), cache, draft_cache,
                      jnp.zeros((), bool), zero, zero, zero)
    end = prompt_len + max_new_tokens

    def body(s: SpecState) -> SpecState:
        key = jax.random.fold_in(rng, s.rounds)
        draft_key, verify_key = jax.random.split(key)
        room = end - s.length - 1  # drafts beyond it could not be emitted
        draft_cache = s.draft_cache
        if draft_model is None:
            draft, count = speculative.ngram_draft(s.seq_L, s.length, k=k, n_max=ngram[1],
                                                   n_min=ngram[0])
            q_kV = jax.nn.one_hot(draft, c.tgt_vocab_size)
        else:
            draft, q_kV, draft_cache = draft_model_tokens(
                draft_model, draft_params, s.draft_cache, s.seq_L, s.length, k=k,
                select_probs=probs, rng=draft_key, offset=offset)
            count = jnp.asarray(k, jnp.int32)
        count = jnp.minimum(count, room).astype(jnp.int32)
        last = jax.lax.dynamic_slice(s.seq_L, (s.length - 1,), (1,))
        cache = s.cache.replace(index=(offset + s.length - 1).astype(jnp.int32))

        def verify(cache):
            return cache_lib.cached_forward(model, params, cache,
                                            jnp.concatenate([last, draft])[None])

        def step(cache):  # no draft: one position (a plain decode step), not k + 1
            logits, cache = cache_lib.cached_forward(model, params, cache, last[None])
            return jnp.pad(logits, ((0, 0), (0, k), (0, 0))), cache  # rows 1..k unread

        logits, cache = (jax.lax.cond(count > 0, verify, step, cache) if skip_empty
                         else verify(cache))
        if greedy:
            tokens, emitted = speculative.greedy_verify(logits[0], draft, count)
        else:
            tokens, emitted = speculative.rejection_verify(probs(logits[0]), q_kV, draft,
                                                           count, verify_key)
        is_eos = (tokens == c.eos_id) & (jnp.arange(k + 1) < emitted)
        finished = jnp.any(is_eos)
        emitted = jnp.where(finished, jnp.argmax(is_eos) + 1, emitted).astype(jnp.int32)
        seq_L = jax.lax.dynamic_update_slice(s.seq_L, tokens, (s.length,))
        length = s.length + emitted
        if draft_cache is not None:
            draft_cache = draft_cache.replace(index=(offset + length - 2).astype(jnp.int32))
        return SpecState(seq_L, length,
                         cache.replace(index=(offset + length - 1).astype(jnp.int32)),
                         draft_cache, finished | (length >= end), s.drafted + count,
                         s.accepted + jnp.minimum(emitted - 1, count), s.rounds + 1)

    state = jax.lax.while_loop(lambda s: ~s.done, body, state)
    index = prompt_len + jnp.arange(max_new_tokens)
    out = jnp.take(state.seq_L, index)
    new = state.length - prompt_len
    out = jnp.where(jnp.arange(max_new_tokens) < new, out, c.pad_id)
    return SpecResult(out, new, state.drafted, state.accepted, state.rounds)


@decode_jit(static_argnames=("model", "draft_model", "max_new_tokens", "k", "ngram",
                             "temperature", "top_k", "top_p"))
def spec_program(model, params, prompt_BP, lengths_B, rng_B, *, draft_model=None,
                 draft_params=None, max_new_tokens, k, ngram, temperature, top_k, top_p):
    if draft_model is not None:
        draft_model, draft_params = stacking.for_decoding(draft_model, draft_params)

    def one(prompt_P, length, rng, skip_empty=False):
        return decode_one(model, params, prompt_P, length, rng, draft_model, draft_params,
                          max_new_tokens=max_new_tokens, k=k, ngram=ngram,
                          temperature=temperature, top_k=top_k, top_p=top_p,
                          skip_empty=skip_empty)

    if prompt_BP.shape[0] == 1:  # no vmap: the cache index stays a scalar (slices, not scatters)
        return jax.tree_util.tree_map(lambda x: x[None], one(prompt_BP[0], lengths_B[0],
                                                             rng_B[0],
                                                             skip_empty=draft_model is None))
    return jax.vmap(one)(prompt_BP, lengths_B, rng_B)


def speculative_generate(model: DecoderOnlyLM, params, prompt_BP, *, max_new_tokens: int,
                         k: int = 4, ngram: tuple[int, int] = speculative.NGRAM, draft=None,
                         prompt_lengths=None, rng: Optional[jax.Array] = None,
                         temperature: float = 0.0, top_k: Optional[int] = None,
                         top_p: Optional[float] = None) -> SpecResult:
    """Continue right-padded prompts as `decode.generate` does, verifying k drafts a pass.

    Args:
      model, params, prompt_BP, max_new_tokens, prompt_lengths, rng, temperature, top_k,
        top_p: as `generate` (rng needed iff temperature > 0; row b uses
        `fold_in(rng, b)`).
      k: draft tokens per round (>= 1).
      ngram: (n_min, n_max), the n-gram sizes prompt lookup tries (longest first;
        default `speculative.NGRAM`, 2..5).
      draft: None for prompt lookup, or (draft_model, draft_params): a smaller
        `DecoderOnlyLM` with the target's vocabulary, which then proposes the k
        tokens (sampled from its own distribution when temperature > 0); prompts need
        >= 2 tokens.
    Returns:
      SpecResult: tokens and lengths as `generate`'s, and the draft statistics.
    Raises:
      TypeError/ValueError naming the argument, before anything compiles.
    """
    if not isinstance(model, DecoderOnlyLM):
        raise TypeError(f"model must be a jaxformer DecoderOnlyLM, got {type(model).__name__}")
    c = model.config
    sampling.make_sampler(temperature, top_k, top_p)  # validates the three
    if temperature != 0:
        check_rng(rng)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    if (not isinstance(ngram, tuple) or len(ngram) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) for n in ngram)
            or not 1 <= ngram[0] <= ngram[1]):
        raise ValueError(f"ngram must be (n_min, n_max) ints with 1 <= n_min <= n_max, "
                         f"got {ngram!r}")
    prompt, lengths = check_prompt(prompt_BP, prompt_lengths, vocab_size=c.tgt_vocab_size,
                                   pad_id=c.pad_id)
    width = prompt.shape[1]
    check_max_new_tokens(max_new_tokens, c.decoder_len - width - k + 1,
                         f"prompt width {width} + {max_new_tokens} new tokens + k={k} exceeds "
                         f"the decoder's max_len={c.decoder_len}")
    draft_model = draft_params = None
    if draft is not None:
        draft_model, draft_params = draft
        if not isinstance(draft_model, DecoderOnlyLM):
            raise TypeError(f"draft must be (DecoderOnlyLM, params), got a "
                            f"{type(draft_model).__name__}")
        if draft_model.config.tgt_vocab_size != c.tgt_vocab_size:
            raise ValueError(f"draft: its vocabulary has {draft_model.config.tgt_vocab_size} "
                             f"ids, the model's {c.tgt_vocab_size}: they must share one")
        if draft_model.config.decoder_len < width + max_new_tokens + k:
            raise ValueError(f"draft: its max_len={draft_model.config.decoder_len} is shorter "
                             f"than prompt width + max_new_tokens + k = "
                             f"{width + max_new_tokens + k}")
        if int(np.min(lengths)) < 2:
            raise ValueError("prompt_lengths: a draft model needs prompts of >= 2 tokens")
        draft_model, draft_params = decodable(draft_model, draft_params)
    base = jax.random.PRNGKey(0) if rng is None else rng
    rng_B = jax.vmap(lambda b: jax.random.fold_in(base, b))(jnp.arange(prompt.shape[0]))
    return spec_program(*decodable(model, params), jnp.asarray(prompt, jnp.int32),
                        jnp.asarray(lengths, jnp.int32), rng_B, draft_model=draft_model,
                        draft_params=draft_params,
                        max_new_tokens=int(max_new_tokens), k=k, ngram=ngram,
                        temperature=float(temperature), top_k=top_k, top_p=top_p)

"""Decoding entry points: check inputs on the host, then run one compiled loop.

    greedy_decode(model, params, src_BS, *, max_new_tokens)      encoder-decoder
    sample(model, params, src_BS, *, max_new_tokens, rng, temperature, top_k, top_p)
    generate(lm, params, prompt_BP, *, max_new_tokens, ...)      decoder-only, prompted
    greedy_decode_recompute(...)                                 the naive O(T^2) baseline
    greedy_decode_one(model, params, src_S, *, max_new_tokens)   one example, for jax.vmap

(and `beam.beam_search`). Each is a host check (`decode_inputs.py`), then a
function compiled once per shape and setting (`decode_loop.decode_jit`) that
builds a cache and a `DecodeState` and runs `decode_loop.decode_loop` over
the cached step; the loop, its state, the output convention and the choice
between scan and while_loop are documented in `decode_loop.py`.

Several devices: every entry point follows its inputs' shardings. A batch
placed with `sharding.shard_batch` (parameters with `sharding.replicate`)
decodes data-parallel, each device running the loop on its rows, with the
tokens of the unsplit batch (tested). Parameters placed by the logical-axis
rules, `partitioning.place_params(model, params, mesh)`, decode tensor- (heads,
FFN, vocabulary over "tensor") or fsdp-parallel: greedy, sampled and beam
tokens equal those of one device (tests/test_scale_out.py), for a model no
single device holds. On a CPU host, making each core a device
(`sharding.use_cpu_cores_as_devices()`) and splitting the batch decodes faster
than one device owning every core (`benchmarks/decode.py`).

Decoder-only prompts are right-padded by the caller (the usual batch layout)
with lengths; inside the jitted function they are shifted to *left* padding
(`decode_inputs.left_align`), so every row's last prompt token is in the same
slot and all rows then write the same cache slot at each step (slices, not
scatters), while each row keeps its own positions (`cache.start_B`): a token's
position is its index in its own sequence, exactly as if the row were decoded
alone.
"""

from __future__ import annotations

import functools
from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp

from jaxformer.decode import cache as cache_lib
from jaxformer.nn import checks, stacking
from jaxformer.decode import processors as processors_lib, sampling
from jaxformer.decode.inputs import (check_encdec, check_lm_prompt, check_prefill_chunk,
                                     check_rng, decodable, left_align)
# DecodeResult and DecodeState are the entry points' result and carry;
# TRACE_COUNTS counts their traces.
from jaxformer.decode.loop import (TRACE_COUNTS, DecodeResult, DecodeState, advance, check_loop,
                                   cached_logits_fn, decode_jit, decode_loop, init_state,
                                   segment_lengths, segments_for)
from jaxformer.decode.cache import encode_memory, memory_cache
from jaxformer.nn.masks import causal_mask
from jaxformer.nn.model import DecoderOnlyLM, Transformer

__all__ = ["DecodeResult", "DecodeState", "TRACE_COUNTS", "generate", "greedy_decode",
           "greedy_decode_one", "greedy_decode_recompute", "sample", "start_lm_state",
           "check_lm_request"]

# --------------------------------------------------------------------------
# Encoder-decoder


def _encdec_core(model: Transformer, params, src, src_mask, rng, *, max_new_tokens: int,
                 select, loop: str, return_logits: bool, processors: tuple = (),
                 prefix_BP=None, prefix_len_B=None, segments: int = 1,
                 return_scores: bool = False) -> DecodeResult:
    """Traceable encoder-decoder decode of a batch (no host checks)."""
    c = model.config
    cache = memory_cache(model, params, src, src_mask,
                         segment_lengths(max_new_tokens, segments)[0])
    state = init_state(jnp.full((src.shape[0],), c.bos_id, jnp.int32), cache, max_new_tokens,
                       pad_id=c.pad_id, rng=rng,
                       vocab_size=c.tgt_vocab_size if return_logits else None,
                       prefix_BP=prefix_BP, prefix_len_B=prefix_len_B, scores=return_scores)
    state = decode_loop(cached_logits_fn(model, params), state, max_new_tokens, select=select,
                        eos_id=c.eos_id, pad_id=c.pad_id, loop=loop, processors=processors,
                        segments=segments, fold=cache_lib.fold)
    return state.result


@decode_jit(static_argnames=("model", "max_new_tokens", "select", "loop", "return_logits",
                             "processors", "segments", "return_scores"))
def encdec_program(model, params, src, src_mask, rng, prefix_BP=None, prefix_len_B=None, *,
                max_new_tokens, select, loop, return_logits, processors=(), segments=1,
                return_scores=False):
    TRACE_COUNTS["encdec"] += 1
    return _encdec_core(model, params, src, src_mask, rng, max_new_tokens=max_new_tokens,
                        select=select, loop=loop, return_logits=return_logits,
                        processors=processors, prefix_BP=prefix_BP, prefix_len_B=prefix_len_B,
                        segments=segments, return_scores=return_scores)


def greedy_decode(model: Transformer, params, src_BS, *, max_new_tokens: int,
                  src_mask=None, loop: str = "scan", return_logits: bool = False,
                  processors=None, prefix=None, prefix_lengths=None,
                  segments: Optional[int] = None, return_scores: bool = False) -> DecodeResult:
    """Greedy decoding of an encoder-decoder `Transformer`, compiled once per shape.

    Args:
      model: a `Transformer`; params: its parameters (or `{"params": ...}`).
      src_BS: (B, S) source ids (or (B, S, D) embedded sources).
      max_new_tokens: N >= 1, tokens to generate after BOS (<= config.decoder_len).
      src_mask: (B|1, 1, 1, S) bool, True = visible; default hides PAD ids.
      loop: "scan" (N steps) or "while" (early exit once every row emitted EOS).
      return_logits: also return the (B, N, V) logits each token was picked from
        (after the processors).
      processors: logits processors (`jaxformer.decode.processors`), applied in order.
      prefix: (P,) or (B, P) ids forced as the first tokens after BOS (per row;
        ragged with `prefix_lengths` (B,)); they appear in the output and count
        towards max_new_tokens. See `decode_inputs.check_prefix`.
      segments: run the loop in this many segments over a chunked cache, each
        attending over the slots written so far (`decode_loop.decode_loop`);
        default `decode_loop.segments_for(max_new_tokens)`: 1 below 64 steps,
        up to 4. More segments read less per step and compile longer.
      return_scores: also return `scores` (B,): the summed log-probability
        (log-softmax of the processed logits) of each row's picks after its forced
        prefix, EOS included.
    Returns:
      DecodeResult(tokens (B, N) int32, lengths (B,) int32[, logits][, scores]).
    Raises:
      TypeError/ValueError on bad inputs, before anything is compiled.
    """
    procs, prefix_BP, prefix_len_B = check_encdec(
        model, src_BS, src_mask, max_new_tokens=max_new_tokens, loop=loop,
        processors=processors, prefix=prefix, prefix_lengths=prefix_lengths)
    return encdec_program(*decodable(model, params), jnp.asarray(src_BS), src_mask,
                       jax.random.PRNGKey(0), prefix_BP, prefix_len_B,
                       max_new_tokens=int(max_new_tokens), select=sampling.greedy, loop=loop,
                       return_logits=return_logits, processors=procs,
                       segments=segments_for(int(max_new_tokens), segments),
                       return_scores=bool(return_scores))


def sample(model: Transformer, params, src_BS, *, max_new_tokens: int, rng: jax.Array,
           temperature: float = 1.0, top_k: Optional[int] = None,
           top_p: Optional[float] = None, src_mask=None, loop: str = "scan",
           processors=None, prefix=None, prefix_lengths=None,
           segments: Optional[int] = None) -> DecodeResult:
    """Ancestral sampling (temperature, then top-k, then top-p) with an explicit key.

    The same `rng` gives the same tokens (step t uses `fold_in(rng, t)`);
    `temperature=0` or `top_k=1` is greedy. The processors edit the logits before
    temperature. Other arguments as `greedy_decode`.
    """
    select = sampling.make_sampler(temperature, top_k, top_p)
    procs, prefix_BP, prefix_len_B = check_encdec(
        model, src_BS, src_mask, max_new_tokens=max_new_tokens, loop=loop,
        processors=processors, prefix=prefix, prefix_lengths=prefix_lengths)
    check_rng(rng)
    return encdec_program(*decodable(model, params), jnp.asarray(src_BS), src_mask, rng,
                       prefix_BP, prefix_len_B, max_new_tokens=int(max_new_tokens),
                       select=select, loop=loop, return_logits=False, processors=procs,
                       segments=segments_for(int(max_new_tokens), segments))


def greedy_decode_one(model: Transformer, params, src_S: jnp.ndarray, *, max_new_tokens: int,
                      src_mask_S: Optional[jnp.ndarray] = None, loop: str = "scan"
                      ) -> DecodeResult:
    """Greedy decode of ONE example: src (S,) -> tokens (N,), length ().

    Pure and traceable (no host checks, no jit of its own), so that
    `jax.vmap(lambda s: greedy_decode_one(model, params, s, max_new_tokens=N))(src_BS)`
    is batched decoding; it equals `greedy_decode(model, params, src_BS, ...)`.
    `src_mask_S` (S,) bool marks visible source positions (default: not PAD).
    Concrete token ids are checked (a no-op on the tracers of `vmap`/`jit`).
    """
    if jnp.issubdtype(src_S.dtype, jnp.integer):
        c = model.config
        checks.check_rank("src_S", src_S, 1, "(length,) token ids: one example")
        checks.check_tokens("src_S", src_S[None], c.src_vocab_size, c.encoder_len)
    mask = None if src_mask_S is None else src_mask_S[None, None, None, :]
    result = _encdec_core(*stacking.for_decoding(*decodable(model, params)), src_S[None], mask, jax.random.PRNGKey(0),
                          max_new_tokens=max_new_tokens, select=sampling.greedy, loop=loop,
                          return_logits=False)
    return jax.tree_util.tree_map(lambda x: x[0], result)


# --------------------------------------------------------------------------
# The naive baseline: recompute the whole prefix every step (the seeds' loop, compiled).


@flax.struct.dataclass
class RecomputeCarry:
    """What the naive loop carries instead of a KV cache: the prefix and the memory."""

    prefix_BN: jax.Array  # fed tokens so far (slot t = token fed at step t), PAD beyond
    memory_BSD: jax.Array
    src_mask: jax.Array


# XLA's default options, not the decode loops' CPU tuning: a full pass has large
# (B * N, D) matmuls (benchmarks/NOTES.md).
@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens"))
def _recompute_jit(model, params, src, src_mask, *, max_new_tokens):
    TRACE_COUNTS["recompute"] += 1
    model, params = stacking.for_decoding(model, params)
    c = model.config
    memory_BSD, src_mask = encode_memory(model, params, src, src_mask)
    tgt_mask = causal_mask(max_new_tokens)  # generated PAD ids are tokens, not padding

    def logits_fn(token_B, carry: RecomputeCarry, step):
        prefix_BN = jax.lax.dynamic_update_slice(carry.prefix_BN, token_B[:, None], (0, step))
        # The whole prefix buffer, every step; the causal mask hides unfilled slots.
        logits_BNV = model.apply({"params": params}, prefix_BN, carry.memory_BSD,
                                 carry.src_mask, tgt_mask, method=Transformer.decode)
        logits_BV = jax.lax.dynamic_index_in_dim(logits_BNV, step, axis=1, keepdims=False)
        return logits_BV, carry.replace(prefix_BN=prefix_BN)

    batch = src.shape[0]
    carry = RecomputeCarry(jnp.full((batch, max_new_tokens), c.pad_id, jnp.int32),
                           memory_BSD, src_mask)
    state = init_state(jnp.full((batch,), c.bos_id, jnp.int32), carry, max_new_tokens,
                       pad_id=c.pad_id)
    state = decode_loop(logits_fn, state, max_new_tokens, eos_id=c.eos_id, pad_id=c.pad_id)
    return state.result


def greedy_decode_recompute(model: Transformer, params, src_BS, *, max_new_tokens: int,
                            src_mask=None) -> DecodeResult:
    """Greedy decode WITHOUT a cache: a full decoder pass over the prefix every step.

    The O(N^2) algorithm of the seeds, compiled; a baseline for benchmarks and
    an independent check of the cached loop. Same arguments and result as
    `greedy_decode`.
    """
    check_encdec(model, src_BS, src_mask, max_new_tokens=max_new_tokens)
    return _recompute_jit(*decodable(model, params), jnp.asarray(src_BS), src_mask,
                          max_new_tokens=int(max_new_tokens))


# --------------------------------------------------------------------------
# Decoder-only LM with a prompt


def start_lm_state(model: DecoderOnlyLM, params, prompt_BP, lengths_B, rng, *,
                   max_new_tokens: int, select, return_logits: bool = False,
                   processors: tuple = (), segments: int = 1,
                   prefill_chunk: Optional[int] = None, on_token=None) -> DecodeState:
    """Traceable: the cache filled with the (right-padded) prompts and the first new
    token of every row picked: the `DecodeState` that `decode_loop` continues for the
    other `max_new_tokens - 1` steps (the cache holds room for all of them, or for the
    first of `segments` chunks)."""
    c = model.config
    batch, width = prompt_BP.shape
    lengths = segment_lengths(max_new_tokens - 1, segments)
    chunked = len(lengths) > 1  # then the prompt fills the past, the loop its chunks
    cache = cache_lib.init_cache(c, batch, width if chunked else width + max_new_tokens - 1)
    cache = cache.replace(start_B=(width - lengths_B).astype(jnp.int32))
    # Prefill: the (left-aligned) prompt in one parallel pass, or chunk by chunk.
    last_BV, cache = cache_lib.prefill(model, params, cache,
                                       left_align(prompt_BP, lengths_B, c.pad_id), prefill_chunk)
    if chunked:
        cache = cache_lib.fold(cache, lengths[0])
    state = init_state(jnp.full((batch,), c.pad_id, jnp.int32), cache, max_new_tokens,
                       pad_id=c.pad_id, rng=rng,
                       vocab_size=c.tgt_vocab_size if return_logits else None)
    # Every row's last prompt token sits in the last prompt slot after left alignment.
    return advance(state, last_BV, cache, select=select, eos_id=c.eos_id,
                   pad_id=c.pad_id, processors=processors, on_token=on_token)


def _lm_core(model: DecoderOnlyLM, params, prompt_BP, lengths_B, rng, *, max_new_tokens: int,
             select, loop: str, return_logits: bool, processors: tuple = (),
             segments: int = 1, prefill_chunk: Optional[int] = None,
             on_token=None) -> DecodeResult:
    c = model.config
    state = start_lm_state(model, params, prompt_BP, lengths_B, rng,
                           max_new_tokens=max_new_tokens, select=select,
                           return_logits=return_logits, processors=processors,
                           segments=segments, prefill_chunk=prefill_chunk, on_token=on_token)
    state = decode_loop(cached_logits_fn(model, params), state, max_new_tokens - 1,
                        select=select, eos_id=c.eos_id, pad_id=c.pad_id, loop=loop,
                        processors=processors, segments=segments, fold=cache_lib.fold,
                        on_token=on_token)
    return state.result


@decode_jit(static_argnames=("model", "max_new_tokens", "select", "loop", "return_logits",
                             "processors", "segments", "prefill_chunk", "on_token"))
def lm_program(model, params, prompt_BP, lengths_B, rng, *, max_new_tokens, select, loop,
            return_logits, processors=(), segments=1, prefill_chunk=None, on_token=None):
    TRACE_COUNTS["lm"] += 1
    return _lm_core(model, params, prompt_BP, lengths_B, rng, max_new_tokens=max_new_tokens,
                    select=select, loop=loop, return_logits=return_logits,
                    processors=processors, segments=segments, prefill_chunk=prefill_chunk,
                    on_token=on_token)


def generate(model: DecoderOnlyLM, params, prompt_BP, *, max_new_tokens: int,
             prompt_lengths=None, rng: Optional[jax.Array] = None, temperature: float = 0.0,
             top_k: Optional[int] = None, top_p: Optional[float] = None, loop: str = "scan",
             return_logits: bool = False, processors=None,
             segments: Optional[int] = None,
             prefill_chunk: Optional[int] = None, on_token=None) -> DecodeResult:
    """Continue right-padded prompts with a decoder-only LM: prefill once, then loop.

    Args:
      model: a `DecoderOnlyLM`; params: its parameters.
      prompt_BP: (B, P) ids, row b = its prompt then PAD (right padding).
      max_new_tokens: N >= 1; needs P + N - 1 <= config.decoder_len.
      prompt_lengths: (B,) ints in 1..P; default: the number of non-PAD ids
        (PAD must then only trail).
      rng: key for sampling; needed iff temperature > 0.
      temperature, top_k, top_p: as `sample`; temperature 0 (default) = greedy.
      loop, return_logits, processors, segments: as `greedy_decode` (step 0 = the first
        new token; the segments split the N - 1 steps after the prompt).
      prefill_chunk: C >= 1 fills the cache C prompt tokens at a time
        (`cache.prefill`): the prefill's attention temporaries are O(C x (P + N))
        instead of O(P^2). Default None: the whole prompt in one pass.
      on_token: `on_token(step, token_B)`, called on the host with each step's picks
        (numpy; PAD for finished rows) while the loop runs: streaming output. Not
        under `vmap`; the function is part of the compilation key (reuse one).
    Returns:
      DecodeResult of the new tokens only (B, N).
    """
    select, procs, prompt, lengths = check_lm_request(
        model, prompt_BP, prompt_lengths, max_new_tokens, rng=rng, temperature=temperature,
        top_k=top_k, top_p=top_p, processors=processors, prefill_chunk=prefill_chunk)
    check_loop(loop)
    return lm_program(*decodable(model, params), jnp.asarray(prompt, jnp.int32),
                   jnp.asarray(lengths, jnp.int32),
                   jax.random.PRNGKey(0) if rng is None else rng,
                   max_new_tokens=int(max_new_tokens), select=select, loop=loop,
                   return_logits=return_logits, processors=procs,
                   segments=segments_for(int(max_new_tokens) - 1, segments),
                   prefill_chunk=None if prefill_chunk is None else int(prefill_chunk),
                   on_token=on_token)


def check_lm_request(model: DecoderOnlyLM, prompt_BP, prompt_lengths, max_new_tokens: int, *,
                     rng, temperature: float, top_k, top_p, processors,
                     prefill_chunk) -> tuple:
    """`generate`'s host checks: (selector, processors, prompt (B, P), lengths (B,)), or
    the TypeError / ValueError naming the first bad argument."""
    if not isinstance(model, DecoderOnlyLM):
        raise TypeError(f"model must be a jaxformer DecoderOnlyLM, got {type(model).__name__}")
    c = model.config
    select = sampling.make_sampler(temperature, top_k, top_p)
    if select is not sampling.greedy:
        check_rng(rng)
    procs = processors_lib.normalize(processors, c.tgt_vocab_size)
    prompt, lengths = check_lm_prompt(c, prompt_BP, prompt_lengths, max_new_tokens)
    check_prefill_chunk(prefill_chunk)
    return select, procs, prompt, lengths

"""Autoregressive decoding: one compiled loop over a pytree cache.

Three layers, each testable alone:

1. `cache.cached_forward` -- the pure model step: (params, cache, tokens) ->
   (logits, cache).
2. `decode_loop` -- model-agnostic: it only sees a `logits_fn(token_B, cache,
   step) -> (logits_BV, cache)` and a selector (`sampling.greedy`, a sampler).
   It carries a `DecodeState` through `lax.scan` (a static number of steps) or
   `lax.while_loop` (stops once every row has emitted EOS).
3. Entry points that check inputs on the host, then call a jitted function
   (compiled once per shape and setting):

   greedy_decode(model, params, src_BS, *, max_new_tokens)      encoder-decoder
   sample(model, params, src_BS, *, max_new_tokens, rng, temperature, top_k, top_p)
   generate(lm, params, prompt_BP, *, max_new_tokens, ...)      decoder-only, prompted
   greedy_decode_recompute(...)                                 the naive O(T^2) baseline
   greedy_decode_one(model, params, src_S, *, max_new_tokens)   one example, for jax.vmap

Output convention (all entry points): `tokens` (B, N) exclude BOS, include
EOS, and hold PAD after it; `lengths` (B,) count tokens up to and including
EOS, or N if a row never emitted it. A row that finished keeps being fed PAD
(batch shapes are static) but its outputs are frozen and its cache is unread.

scan or while_loop? `lax.scan` always runs N steps; `lax.while_loop` stops
when every row is finished, but re-checks a predicate each step and, under
`jax.vmap` (or simply in a batch), runs until the *slowest* row is done. It
wins when all rows stop well before N (a trained model on short outputs); scan
wins slightly when some row runs to N, e.g. an untrained model. Measured by
`benchmarks/decode.py` (bench workload, batch 32, N = 128, split over 2 shared
CPU cores): no row stops early -> scan 0.71 s, while 0.84 s (medians of 5
paired rounds); every row stops at step 1 -> scan 0.73 s, while 0.07 s. Both
give identical results (tested).

Several devices: every entry point follows its inputs' shardings. A batch
placed with `sharding.shard_batch` (parameters with `sharding.replicate`)
decodes data-parallel, each device running the loop on its rows, with the
tokens of the unsplit batch (tested). On a CPU host, first make each core a
device with `sharding.use_cpu_cores_as_devices()`: the bench workload (batch
32, 2 cores) then takes about 5.5 ms per step instead of about 9 ms
(`benchmarks/decode.py`).

Decoder-only prompts are right-padded by the caller (the usual batch layout)
with lengths; inside the jitted function they are shifted to *left* padding,
so every row's last prompt token is in the same slot and all rows then write
the same cache slot at each step (slices, not scatters), while each row keeps
its own positions (`cache.start_B`): a token's position is its index in its
own sequence, exactly as if the row were decoded alone.
"""

from __future__ import annotations

import collections
import functools
from typing import Any, Callable, Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxformer import cache as cache_lib
from jaxformer import checks, processors as processors_lib, sampling, stacking
from jaxformer.cache import DecodeCache
from jaxformer.masks import causal_mask, padding_mask
from jaxformer.model import DecoderOnlyLM, Transformer

# How often each jitted entry point was traced (a Python side effect, so it
# runs at trace time only). Tests use it to prove one compile per shape.
TRACE_COUNTS: collections.Counter = collections.Counter()

LogitsFn = Callable[[jnp.ndarray, Any, jnp.ndarray], tuple[jnp.ndarray, Any]]

# XLA compiler options of the decode loops, by backend. XLA:CPU hands matmuls to
# YNNPACK by default; a decode step's are small, (B, D) x (D, F) for B rows, and
# for those XLA's own dots are faster: on the bench workload (batch 32, 128
# steps, split over 2 CPU cores) 0.71 s against 0.88 s with YNNPACK, medians
# of paired rounds in `benchmarks/decode.py`, which times both. Same tokens.
# Training keeps the defaults: its larger matmuls are faster with YNNPACK
# (benchmarks/train.py: 0.93 s against 1.17 s per step). Other backends
# compile with their defaults.
DECODE_COMPILER_OPTIONS = {"cpu": {"xla_cpu_experimental_ynn_fusion_type": ""}}


def decode_jit(*, static_argnames: tuple[str, ...]):
    """`jax.jit` with the `DECODE_COMPILER_OPTIONS` of the default backend.

    The backend is looked up at the first call (not at import, which would
    initialise JAX's backends); one compiled function per backend and shape.
    Like a jitted function it has `.lower(...)`; the undecorated function is
    `__wrapped__` and its static arguments `static_argnames`.
    """

    def wrap(fn):
        jitted = {}

        def for_backend():
            backend = jax.default_backend()
            if backend not in jitted:
                jitted[backend] = jax.jit(fn, static_argnames=static_argnames,
                                          compiler_options=DECODE_COMPILER_OPTIONS.get(backend))
            return jitted[backend]

        @functools.wraps(fn)
        def call(*args, **kwargs):
            return for_backend()(*args, **kwargs)

        call.lower = lambda *args, **kwargs: for_backend().lower(*args, **kwargs)
        call.static_argnames = static_argnames
        return call

    return wrap


@flax.struct.dataclass
class DecodeResult:
    """tokens (B, N) int32; lengths (B,) int32; logits (B, N, V) float32 if requested;
    scores (B,) float32 for beam search (length-penalised log-probability)."""

    tokens: jax.Array
    lengths: jax.Array
    logits: Optional[jax.Array] = None
    scores: Optional[jax.Array] = None


@flax.struct.dataclass
class DecodeState:
    """The loop carry, with named fields.

    Attributes:
      step: () int32, tokens generated so far (= next column of `tokens_BN`).
      token_B: (B,) int32, the token fed at the next step (BOS, then the last pick).
      cache: whatever `logits_fn` carries (a `DecodeCache` for the cached loop).
      tokens_BN: (B, N) int32 output buffer, PAD-initialised.
      lengths_B: (B,) int32.
      finished_B: (B,) bool, True once the row emitted EOS.
      rng: PRNG key; step t draws with `fold_in(rng, t)` (reproducible, loop-agnostic).
      logits_BNV: (B, N, V) float32 buffer of the logits each pick was made from, or None.
      prefix_BP: (B, P) int32 forced tokens: row b's first prefix_len_B[b] picks are
        prefix_BP[b, :prefix_len_B[b]] whatever the model says; or None.
      prefix_len_B: (B,) int32 forced prefix length of each row (ragged), or None.
    """

    step: jax.Array
    token_B: jax.Array
    cache: Any
    tokens_BN: jax.Array
    lengths_B: jax.Array
    finished_B: jax.Array
    rng: jax.Array
    logits_BNV: Optional[jax.Array] = None
    prefix_BP: Optional[jax.Array] = None
    prefix_len_B: Optional[jax.Array] = None


def init_state(first_token_B: jnp.ndarray, cache: Any, max_new_tokens: int, *,
               pad_id: int, rng: Optional[jax.Array] = None, vocab_size: Optional[int] = None,
               prefix_BP: Optional[jax.Array] = None, prefix_len_B: Optional[jax.Array] = None
               ) -> DecodeState:
    """A fresh state: nothing generated; `vocab_size` set = also record logits;
    `prefix_BP`/`prefix_len_B` set = force each row's first picks."""
    batch = first_token_B.shape[0]
    return DecodeState(
        step=jnp.zeros((), jnp.int32),
        token_B=first_token_B.astype(jnp.int32),
        cache=cache,
        tokens_BN=jnp.full((batch, max_new_tokens), pad_id, jnp.int32),
        lengths_B=jnp.zeros((batch,), jnp.int32),
        finished_B=jnp.zeros((batch,), bool),
        rng=jax.random.PRNGKey(0) if rng is None else rng,
        logits_BNV=(None if vocab_size is None else
                    jnp.zeros((batch, max_new_tokens, vocab_size), jnp.float32)),
        prefix_BP=None if prefix_BP is None else prefix_BP.astype(jnp.int32),
        prefix_len_B=None if prefix_len_B is None else prefix_len_B.astype(jnp.int32))


def forced_prefix(state, token_B: jnp.ndarray) -> jnp.ndarray:
    """`token_B` with the rows still inside their forced prefix replaced by it."""
    if state.prefix_BP is None:
        return token_B
    column = jnp.minimum(state.step, state.prefix_BP.shape[1] - 1)
    forced_B = jax.lax.dynamic_index_in_dim(state.prefix_BP, column, axis=1, keepdims=False)
    return jnp.where(state.step < state.prefix_len_B, forced_B, token_B)


def advance(state: DecodeState, logits_BV: jnp.ndarray, cache: Any, *,
            select: sampling.Selector, eos_id: int, pad_id: int,
            processors: tuple = ()) -> DecodeState:
    """Pick the next token of every row from `logits_BV` and record it.

    The processors edit the logits first; a row inside its forced prefix takes
    the prefix token instead of the pick. Finished rows get PAD and keep their
    length; a row whose pick is EOS becomes finished (its length includes the EOS).
    """
    step = state.step
    logits_BV = processors_lib.apply(processors, logits_BV, step, state.tokens_BN)
    token_B = forced_prefix(state, select(logits_BV, jax.random.fold_in(state.rng, step)))
    token_B = jnp.where(state.finished_B, pad_id, token_B).astype(jnp.int32)
    tokens_BN = jax.lax.dynamic_update_slice(state.tokens_BN, token_B[:, None], (0, step))
    logits_BNV = state.logits_BNV
    if logits_BNV is not None:
        logits_BNV = jax.lax.dynamic_update_slice(
            logits_BNV, logits_BV[:, None, :].astype(jnp.float32), (0, step, 0))
    return state.replace(
        step=step + 1, token_B=token_B, cache=cache, tokens_BN=tokens_BN,
        lengths_B=jnp.where(state.finished_B, state.lengths_B, step + 1),
        finished_B=state.finished_B | (token_B == eos_id), logits_BNV=logits_BNV)


def decode_loop(logits_fn: LogitsFn, state: DecodeState, num_steps: int, *,
                select: sampling.Selector = sampling.greedy, eos_id: int, pad_id: int,
                loop: str = "scan", processors: tuple = ()) -> DecodeState:
    """Run `num_steps` (static) decode steps from `state`: feed, pick, record.

    Args:
      logits_fn: `(token_B, cache, step) -> (logits_BV, cache)`; pure.
      state: the carry; `state.step + num_steps` must not exceed N.
      num_steps: steps for "scan"; the upper bound for "while".
      select: `(logits_BV, rng) -> token_B`.
      loop: "scan" (always num_steps) or "while" (stops when all rows finished).
      processors: logits processors applied before `select` (see `processors.py`).
    """

    def body(state: DecodeState) -> DecodeState:
        logits_BV, cache = logits_fn(state.token_B, state.cache, state.step)
        return advance(state, logits_BV, cache, select=select, eos_id=eos_id, pad_id=pad_id,
                       processors=processors)

    if loop == "scan":
        state, _ = jax.lax.scan(lambda s, _: (body(s), None), state, None, length=num_steps)
        return state
    if loop == "while":
        stop = state.step + num_steps
        return jax.lax.while_loop(
            lambda s: (s.step < stop) & ~jnp.all(s.finished_B), body, state)
    raise ValueError(f"loop must be 'scan' or 'while', got {loop!r}")


def cached_logits_fn(model, params) -> LogitsFn:
    """The cached step as a `logits_fn`: feed one token per row into the `DecodeCache`."""

    def logits_fn(token_B, cache: DecodeCache, step):
        del step  # the cache knows its own slot
        logits_B1V, cache = cache_lib.cached_forward(model, params, cache, token_B[:, None])
        return logits_B1V[:, 0], cache

    return logits_fn


# --------------------------------------------------------------------------
# Encoder-decoder


def _unwrap(params):
    """Accept `params` or `{"params": params}` (what `init` returns)."""
    if isinstance(params, (dict, flax.core.FrozenDict)) and set(params.keys()) == {"params"}:
        return params["params"]
    return params


def _decodable(model, params):
    """(model, params) unwrapped and, for a scanned/rematted model, unrolled (`stacking`)."""
    return stacking.for_decoding(model, _unwrap(params))


def _memory_mask(src, src_mask, memory_BSD, pad_id):
    """(B, 1, 1, S) mask of the memory: given, PAD ids hidden, or all visible
    (embedded or stem inputs, whose S is the memory's length)."""
    batch, length = memory_BSD.shape[:2]
    if src_mask is None:
        src_mask = (padding_mask(src, pad_id) if jnp.issubdtype(src.dtype, jnp.integer)
                    else jnp.ones((batch, 1, 1, length), bool))
    return jnp.broadcast_to(src_mask, (batch, 1, 1, length))


def _encode(model, params, src, src_mask):
    """Memory (B, S, D) and its (B, 1, 1, S) mask."""
    memory_BSD = model.apply({"params": params}, src, src_mask, method=Transformer.encode)
    return memory_BSD, _memory_mask(src, src_mask, memory_BSD, model.config.pad_id)


def _encdec_core(model: Transformer, params, src, src_mask, rng, *, max_new_tokens: int,
                 select, loop: str, return_logits: bool, processors: tuple = (),
                 prefix_BP=None, prefix_len_B=None) -> DecodeResult:
    """Traceable encoder-decoder decode of a batch (no host checks)."""
    c = model.config
    memory_BSD, src_mask = _encode(model, params, src, src_mask)
    cache = cache_lib.init_cache(c, src.shape[0], max_new_tokens)
    cache = cache_lib.with_memory(model, params, cache, memory_BSD, src_mask)
    state = init_state(jnp.full((src.shape[0],), c.bos_id, jnp.int32), cache, max_new_tokens,
                       pad_id=c.pad_id, rng=rng,
                       vocab_size=c.tgt_vocab_size if return_logits else None,
                       prefix_BP=prefix_BP, prefix_len_B=prefix_len_B)
    state = decode_loop(cached_logits_fn(model, params), state, max_new_tokens, select=select,
                        eos_id=c.eos_id, pad_id=c.pad_id, loop=loop, processors=processors)
    return DecodeResult(tokens=state.tokens_BN, lengths=state.lengths_B, logits=state.logits_BNV)


@decode_jit(static_argnames=("model", "max_new_tokens", "select", "loop", "return_logits",
                             "processors"))
def _encdec_jit(model, params, src, src_mask, rng, prefix_BP=None, prefix_len_B=None, *,
                max_new_tokens, select, loop, return_logits, processors=()):
    TRACE_COUNTS["encdec"] += 1
    return _encdec_core(model, params, src, src_mask, rng, max_new_tokens=max_new_tokens,
                        select=select, loop=loop, return_logits=return_logits,
                        processors=processors, prefix_BP=prefix_BP, prefix_len_B=prefix_len_B)


def check_prefix(prefix_BP, prefix_lengths, *, batch: int, vocab_size: int,
                 max_new_tokens: int, max_len: int):
    """Host check of a forced decoder prefix -> (prefix (B, P) int32, lengths (B,) int32),
    or (None, None) when `prefix_BP` is None.

    A prefix is the first tokens after BOS, forced row by row; rows may be
    ragged (`prefix_lengths`, default: P for every row; values past a row's
    length are ignored). The forced tokens are part of the output and count
    towards `max_new_tokens`.
    """
    if prefix_BP is None:
        if prefix_lengths is not None:
            raise ValueError("prefix_lengths given without a prefix")
        return None, None
    prefix = np.asarray(prefix_BP)
    if prefix.ndim == 1:
        prefix = np.broadcast_to(prefix[None], (batch, prefix.shape[0]))
    if prefix.ndim != 2 or prefix.shape[0] != batch or prefix.shape[1] < 1:
        raise ValueError(f"prefix must be (P,) or ({batch}, P) token ids with P >= 1, got "
                         f"shape {prefix.shape}")
    if not np.issubdtype(prefix.dtype, np.integer):
        raise ValueError(f"prefix must hold integer token ids, got {prefix.dtype}")
    width = prefix.shape[1]
    lengths = (np.full((batch,), width) if prefix_lengths is None
               else np.asarray(prefix_lengths))
    if lengths.shape != (batch,) or not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(f"prefix_lengths must be ({batch},) ints, got {lengths.dtype} "
                         f"{lengths.shape}")
    if np.any(lengths < 0) or np.any(lengths > width):
        raise ValueError(f"prefix_lengths must be in 0..{width}, got {lengths.tolist()}")
    used = np.arange(width)[None, :] < lengths[:, None]
    bad = prefix[used & ((prefix < 0) | (prefix >= vocab_size))]
    if bad.size:
        raise ValueError(f"prefix has token id(s) {sorted(set(bad.tolist()))} outside the "
                         f"target vocabulary 0..{vocab_size - 1}")
    longest = int(lengths.max())
    if longest >= max_len:
        raise ValueError(f"prefix of {longest} tokens is too long: BOS + prefix needs "
                         f"{longest + 1} decoder positions, the decoder has {max_len} "
                         f"(config.decoder_max_len or max_len)")
    if longest > max_new_tokens:
        raise ValueError(f"prefix of {longest} tokens is longer than max_new_tokens="
                         f"{max_new_tokens} (forced tokens count towards it)")
    return jnp.asarray(prefix, jnp.int32), jnp.asarray(lengths, jnp.int32)


def _check_max_new_tokens(max_new_tokens, limit: int, what: str) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)):
        raise TypeError(f"max_new_tokens must be an int, got {type(max_new_tokens).__name__}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if max_new_tokens > limit:
        raise ValueError(f"max_new_tokens={max_new_tokens} is too long: {what}")


def _check_encdec_inputs(model, src, src_mask, max_new_tokens, loop) -> None:
    if not isinstance(model, Transformer):
        raise TypeError(f"model must be a jaxformer Transformer (encoder-decoder), got "
                        f"{type(model).__name__}; use generate() for a DecoderOnlyLM")
    c = model.config
    if not hasattr(src, "ndim") or src.ndim not in (2, 3):
        raise ValueError("src_BS must be (batch, length) token ids or (batch, length, d_model) "
                         f"embeddings, got shape {getattr(src, 'shape', None)}")
    if model.stem is not None:  # the stem's input: its own channels and length
        if src.ndim != 3:
            raise ValueError(f"src_BS must be (batch, length, channels) for the model's stem, "
                             f"got shape {src.shape}")
    elif src.ndim == 3:
        checks.check_embedded("src_BS", src, c.d_model, c.encoder_len)
    elif c.encoder_input != "tokens":
        raise ValueError('src_BS: this encoder reads embedded inputs (config.encoder_input='
                         f'"embedded"), got token ids of shape {src.shape}')
    else:
        checks.check_tokens("src_BS", src, c.src_vocab_size, c.encoder_len)
    if src.shape[0] < 1 or src.shape[1] < 1:
        raise ValueError(f"src_BS must be non-empty, got shape {src.shape}")
    if src_mask is not None:
        checks.check_mask("src_mask", src_mask, src.shape[0], 1, src.shape[1])
        if model.stem is None and src_mask.shape[3] != src.shape[1]:
            raise ValueError(f"src_mask has key size {src_mask.shape[3]}, expected "
                             f"{src.shape[1]} (the source length)")
    # The decoder feeds BOS and the first N-1 picks at positions 0..N-1.
    _check_max_new_tokens(max_new_tokens, c.decoder_len,
                          f"decoder positions 0..{max_new_tokens - 1} must stay below "
                          f"the decoder's max_len={c.decoder_len}")
    if loop not in ("scan", "while"):
        raise ValueError(f"loop must be 'scan' or 'while', got {loop!r}")


def greedy_decode(model: Transformer, params, src_BS, *, max_new_tokens: int,
                  src_mask=None, loop: str = "scan", return_logits: bool = False,
                  processors=None, prefix=None, prefix_lengths=None) -> DecodeResult:
    """Greedy decoding of an encoder-decoder `Transformer`, compiled once per shape.

    Args:
      model: a `Transformer`; params: its parameters (or `{"params": ...}`).
      src_BS: (B, S) source ids (or (B, S, D) embedded sources).
      max_new_tokens: N >= 1, tokens to generate after BOS (<= config.decoder_len).
      src_mask: (B|1, 1, 1, S) bool, True = visible; default hides PAD ids.
      loop: "scan" (N steps) or "while" (early exit once every row emitted EOS).
      return_logits: also return the (B, N, V) logits each token was picked from
        (after the processors).
      processors: logits processors (`jaxformer.processors`), applied in order.
      prefix: (P,) or (B, P) ids forced as the first tokens after BOS (per row;
        ragged with `prefix_lengths` (B,)); they appear in the output and count
        towards max_new_tokens. See `check_prefix`.
    Returns:
      DecodeResult(tokens (B, N) int32, lengths (B,) int32[, logits]).
    Raises:
      TypeError/ValueError on bad inputs, before anything is compiled.
    """
    _check_encdec_inputs(model, src_BS, src_mask, max_new_tokens, loop)
    c = model.config
    procs = processors_lib.normalize(processors, c.tgt_vocab_size)
    prefix_BP, prefix_len_B = check_prefix(
        prefix, prefix_lengths, batch=src_BS.shape[0], vocab_size=c.tgt_vocab_size,
        max_new_tokens=int(max_new_tokens), max_len=c.decoder_len)
    return _encdec_jit(*_decodable(model, params), jnp.asarray(src_BS), src_mask,
                       jax.random.PRNGKey(0), prefix_BP, prefix_len_B,
                       max_new_tokens=int(max_new_tokens), select=sampling.greedy, loop=loop,
                       return_logits=return_logits, processors=procs)


def sample(model: Transformer, params, src_BS, *, max_new_tokens: int, rng: jax.Array,
           temperature: float = 1.0, top_k: Optional[int] = None,
           top_p: Optional[float] = None, src_mask=None, loop: str = "scan",
           processors=None, prefix=None, prefix_lengths=None) -> DecodeResult:
    """Ancestral sampling (temperature, then top-k, then top-p) with an explicit key.

    The same `rng` gives the same tokens (step t uses `fold_in(rng, t)`);
    `temperature=0` or `top_k=1` is greedy. The processors edit the logits before
    temperature. Other arguments as `greedy_decode`.
    """
    select = sampling.make_sampler(temperature, top_k, top_p)
    _check_encdec_inputs(model, src_BS, src_mask, max_new_tokens, loop)
    _check_rng(rng)
    c = model.config
    procs = processors_lib.normalize(processors, c.tgt_vocab_size)
    prefix_BP, prefix_len_B = check_prefix(
        prefix, prefix_lengths, batch=src_BS.shape[0], vocab_size=c.tgt_vocab_size,
        max_new_tokens=int(max_new_tokens), max_len=c.decoder_len)
    return _encdec_jit(*_decodable(model, params), jnp.asarray(src_BS), src_mask, rng,
                       prefix_BP, prefix_len_B, max_new_tokens=int(max_new_tokens),
                       select=select, loop=loop, return_logits=False, processors=procs)


def _check_rng(rng) -> None:
    if rng is None or not hasattr(rng, "shape"):
        raise TypeError(f"rng must be a jax.random key, got {rng!r}")


def greedy_decode_one(model: Transformer, params, src_S: jnp.ndarray, *, max_new_tokens: int,
                      src_mask_S: Optional[jnp.ndarray] = None, loop: str = "scan"
                      ) -> DecodeResult:
    """Greedy decode of ONE example: src (S,) -> tokens (N,), length ().

    Pure and traceable (no host checks, no jit of its own), so that
    `jax.vmap(lambda s: greedy_decode_one(model, params, s, max_new_tokens=N))(src_BS)`
    is batched decoding; it equals `greedy_decode(model, params, src_BS, ...)`.
    Compile it with `decode_jit(static_argnames=())(fn)` rather than `jax.jit`
    to get the `DECODE_COMPILER_OPTIONS` the library's own loops use.
    `src_mask_S` (S,) bool marks visible source positions (default: not PAD).
    Concrete token ids are checked (a no-op on the tracers of `vmap`/`jit`).
    """
    if jnp.issubdtype(src_S.dtype, jnp.integer):
        c = model.config
        checks.check_rank("src_S", src_S, 1, "(length,) token ids: one example")
        checks.check_tokens("src_S", src_S[None], c.src_vocab_size, c.encoder_len)
    mask = None if src_mask_S is None else src_mask_S[None, None, None, :]
    result = _encdec_core(*_decodable(model, params), src_S[None], mask, jax.random.PRNGKey(0),
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


# XLA's default options, not DECODE_COMPILER_OPTIONS: a full pass has large
# (B * N, D) matmuls, which are no faster without YNNPACK, and this loop
# compiled without YNNPACK and split over 2 CPU devices returned wrong tokens,
# differently from run to run (bench workload at N = 128; one device was right).
@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens"))
def _recompute_jit(model, params, src, src_mask, *, max_new_tokens):
    TRACE_COUNTS["recompute"] += 1
    c = model.config
    memory_BSD, src_mask = _encode(model, params, src, src_mask)
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
    return DecodeResult(tokens=state.tokens_BN, lengths=state.lengths_B)


def greedy_decode_recompute(model: Transformer, params, src_BS, *, max_new_tokens: int,
                            src_mask=None) -> DecodeResult:
    """Greedy decode WITHOUT a cache: a full decoder pass over the prefix every step.

    The O(N^2) algorithm of the seeds, compiled; a baseline for benchmarks and
    an independent check of the cached loop. Same arguments and result as
    `greedy_decode`.
    """
    _check_encdec_inputs(model, src_BS, src_mask, max_new_tokens, "scan")
    return _recompute_jit(*_decodable(model, params), jnp.asarray(src_BS), src_mask,
                          max_new_tokens=int(max_new_tokens))


# --------------------------------------------------------------------------
# Decoder-only LM with a prompt


def left_align(prompt_BP: jnp.ndarray, lengths_B: jnp.ndarray, pad_id: int) -> jnp.ndarray:
    """Right-padded prompts (B, P) -> left-padded: row b shifted right by P - lengths_B[b]."""
    width = prompt_BP.shape[1]
    shift_B1 = (width - lengths_B)[:, None]
    source_BP = jnp.arange(width)[None, :] - shift_B1
    shifted_BP = jnp.take_along_axis(prompt_BP, jnp.clip(source_BP, 0, width - 1), axis=1)
    return jnp.where(source_BP >= 0, shifted_BP, pad_id)


def _lm_core(model: DecoderOnlyLM, params, prompt_BP, lengths_B, rng, *, max_new_tokens: int,
             select, loop: str, return_logits: bool, processors: tuple = ()) -> DecodeResult:
    c = model.config
    batch, width = prompt_BP.shape
    cache = cache_lib.init_cache(c, batch, width + max_new_tokens - 1)
    cache = cache.replace(start_B=(width - lengths_B).astype(jnp.int32))
    # Prefill: the whole (left-aligned) prompt in one parallel pass.
    logits_BPV, cache = cache_lib.cached_forward(
        model, params, cache, left_align(prompt_BP, lengths_B, c.pad_id))
    state = init_state(jnp.full((batch,), c.pad_id, jnp.int32), cache, max_new_tokens,
                       pad_id=c.pad_id, rng=rng,
                       vocab_size=c.tgt_vocab_size if return_logits else None)
    # Every row's last prompt token sits in the last prompt slot after left alignment.
    state = advance(state, logits_BPV[:, -1], cache, select=select, eos_id=c.eos_id,
                    pad_id=c.pad_id, processors=processors)
    state = decode_loop(cached_logits_fn(model, params), state, max_new_tokens - 1,
                        select=select, eos_id=c.eos_id, pad_id=c.pad_id, loop=loop,
                        processors=processors)
    return DecodeResult(tokens=state.tokens_BN, lengths=state.lengths_B, logits=state.logits_BNV)


@decode_jit(static_argnames=("model", "max_new_tokens", "select", "loop", "return_logits",
                             "processors"))
def _lm_jit(model, params, prompt_BP, lengths_B, rng, *, max_new_tokens, select, loop,
            return_logits, processors=()):
    TRACE_COUNTS["lm"] += 1
    return _lm_core(model, params, prompt_BP, lengths_B, rng, max_new_tokens=max_new_tokens,
                    select=select, loop=loop, return_logits=return_logits,
                    processors=processors)


def generate(model: DecoderOnlyLM, params, prompt_BP, *, max_new_tokens: int,
             prompt_lengths=None, rng: Optional[jax.Array] = None, temperature: float = 0.0,
             top_k: Optional[int] = None, top_p: Optional[float] = None, loop: str = "scan",
             return_logits: bool = False, processors=None) -> DecodeResult:
    """Continue right-padded prompts with a decoder-only LM: prefill once, then loop.

    Args:
      model: a `DecoderOnlyLM`; params: its parameters.
      prompt_BP: (B, P) ids, row b = its prompt then PAD (right padding).
      max_new_tokens: N >= 1; needs P + N - 1 <= config.decoder_len.
      prompt_lengths: (B,) ints in 1..P; default: the number of non-PAD ids
        (PAD must then only trail).
      rng: key for sampling; needed iff temperature > 0.
      temperature, top_k, top_p: as `sample`; temperature 0 (default) = greedy.
      loop, return_logits, processors: as `greedy_decode` (step 0 = the first new token).
    Returns:
      DecodeResult of the new tokens only (B, N).
    """
    if not isinstance(model, DecoderOnlyLM):
        raise TypeError(f"model must be a jaxformer DecoderOnlyLM, got {type(model).__name__}")
    c = model.config
    select = sampling.make_sampler(temperature, top_k, top_p)
    if select is not sampling.greedy:
        _check_rng(rng)
    procs = processors_lib.normalize(processors, c.tgt_vocab_size)
    checks.check_tokens("prompt_BP", prompt_BP, c.tgt_vocab_size)
    prompt = np.asarray(prompt_BP)
    batch, width = prompt.shape
    if batch < 1 or width < 1:
        raise ValueError(f"prompt_BP must be non-empty, got shape {prompt.shape}")
    if prompt_lengths is None:
        lengths = (prompt != c.pad_id).sum(axis=1)
        trailing = np.arange(width)[None, :] >= lengths[:, None]
        if np.any((prompt == c.pad_id) != trailing):
            raise ValueError("prompt_BP has PAD ids inside a prompt: pass prompt_lengths "
                             "explicitly (prompts are right-padded)")
    else:
        lengths = np.asarray(prompt_lengths)
        if lengths.shape != (batch,) or not np.issubdtype(lengths.dtype, np.integer):
            raise ValueError(f"prompt_lengths must be ({batch},) ints, got "
                             f"{lengths.dtype} {lengths.shape}")
    if np.any(lengths < 1) or np.any(lengths > width):
        raise ValueError(f"prompt_lengths must be in 1..{width} (every row needs a prompt "
                         f"token), got {lengths.tolist()}")
    _check_max_new_tokens(max_new_tokens, c.decoder_len - width + 1,
                          f"prompt width {width} + {max_new_tokens} new tokens - 1 exceeds "
                          f"the decoder's max_len={c.decoder_len}")
    if loop not in ("scan", "while"):
        raise ValueError(f"loop must be 'scan' or 'while', got {loop!r}")
    return _lm_jit(*_decodable(model, params), jnp.asarray(prompt, jnp.int32),
                   jnp.asarray(lengths, jnp.int32),
                   jax.random.PRNGKey(0) if rng is None else rng,
                   max_new_tokens=int(max_new_tokens), select=select, loop=loop,
                   return_logits=return_logits, processors=procs)

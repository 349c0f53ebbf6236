"""The decode loop and its state: model-agnostic, shared by every decoding entry point.

Three layers, each testable alone:

1. `cache.cached_forward` -- the pure model step: (params, cache, tokens) ->
   (logits, cache); `cached_logits_fn` wraps it as a `logits_fn`, and
   `cache.memory_cache` builds the encoder-decoder cache it reads (memory
   encoded and projected once).
2. `decode_loop` -- only sees a `logits_fn(token_B, cache, step) -> (logits_BV,
   cache)` and a selector (`sampling.greedy`, a sampler). It carries a
   `DecodeState` (`init_state`) through `lax.scan` (a static number of steps)
   or `lax.while_loop` (stops once every row has emitted EOS); each step is
   `advance`: processors, pick, forced prefix, record.
3. The entry points (`api.py`, `beam.py`) check inputs on the host
   (`inputs.py`), then call a function compiled by `decode_jit`.

Output convention (all entry points): `tokens` (B, N) exclude BOS, include
EOS, and hold PAD after it; `lengths` (B,) count tokens up to and including
EOS, or N if a row never emitted it. A row that finished keeps being fed PAD
(batch shapes are static) but its outputs are frozen and its cache is unread.

scan or while_loop? `lax.scan` always runs N steps; `lax.while_loop` stops
when every row is finished, but re-checks a predicate each step and, under
`jax.vmap` (or simply in a batch), runs until the *slowest* row is done. It
wins when all rows stop well before N (a trained model on short outputs); scan
wins slightly when some row runs to N, e.g. an untrained model
(`benchmarks/decode.py` times both). Both give identical results (tested).
"""

from __future__ import annotations

import collections
import functools
from typing import Any, Callable, Optional

import flax.struct
import jax
import jax.numpy as jnp

from jaxformer.backends import cpu
from jaxformer.decode import cache as cache_lib
from jaxformer.decode import processors as processors_lib, sampling
from jaxformer.decode.cache import DecodeCache
from jaxformer.nn import stacking

# How often each jitted entry point was traced (a Python side effect, so it
# runs at trace time only). Tests use it to prove one compile per shape.
TRACE_COUNTS: collections.Counter = collections.Counter()

LogitsFn = Callable[[jnp.ndarray, Any, jnp.ndarray], tuple[jnp.ndarray, Any]]
# on_token(step, token_B): numpy arrays, on the host, as each step's picks are made.
OnToken = Callable[[Any, Any], None]

def decode_jit(*, static_argnames: tuple[str, ...], donate_argnums: tuple[int, ...] = ()):
    """`jax.jit` of a decode entry `fn(model, params, ...)` whose program first puts
    the parameters in the per-layer layout (`stacking.for_decoding`: a scanned
    model's stacked parameters are sliced inside the compiled program, not on
    the host at every call), compiled with `backends.cpu.decode_compiler_options`
    (XLA's defaults unless the process asked for CPU tuning).

    The backend is looked up at the first call (not at import, which would
    initialise JAX's backends); one compiled function per backend and shape.
    Like a jitted function it has `.lower(...)`; the undecorated function is
    `__wrapped__` and its static arguments `static_argnames`. `donate_argnums`:
    positional arguments (counting `model` and `params`) whose buffers the program
    may reuse.
    """

    def wrap(fn):
        jitted = {}

        def per_layer(model, params, *args, **kwargs):
            return fn(*stacking.for_decoding(model, params), *args, **kwargs)

        def for_backend():
            backend = jax.default_backend()
            key = (backend, cpu.process_tuned())
            if key not in jitted:
                jitted[key] = jax.jit(per_layer, static_argnames=static_argnames,
                                      donate_argnums=donate_argnums,
                                      compiler_options=cpu.decode_compiler_options(backend))
            return jitted[key]

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
    scores (B,) float32: beam search's length-penalised log-probability, or (greedy
    and sampled decoding, if requested) the summed log-probability of each row's
    picks after its forced prefix, EOS included (`DecodeState.logprob_B`)."""

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
      logprob_B: (B,) float32 sum of log_softmax(processed logits)[pick] over each
        row's free picks (after its forced prefix, up to and including EOS), or None.
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
    logprob_B: Optional[jax.Array] = None

    @property
    def result(self) -> DecodeResult:
        """What the entry points return: tokens, lengths and (if recorded) logits."""
        return DecodeResult(tokens=self.tokens_BN, lengths=self.lengths_B,
                            logits=self.logits_BNV, scores=self.logprob_B)


def init_state(first_token_B: jnp.ndarray, cache: Any, max_new_tokens: int, *,
               pad_id: int, rng: Optional[jax.Array] = None, vocab_size: Optional[int] = None,
               prefix_BP: Optional[jax.Array] = None, prefix_len_B: Optional[jax.Array] = None,
               scores: bool = False) -> DecodeState:
    """A fresh state: nothing generated; `vocab_size` set = also record logits;
    `prefix_BP`/`prefix_len_B` set = force each row's first picks; `scores` = also
    sum the log-probabilities of the free picks (`logprob_B`)."""
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
        prefix_len_B=None if prefix_len_B is None else prefix_len_B.astype(jnp.int32),
        logprob_B=jnp.zeros((batch,), jnp.float32) if scores else None)


def forced_prefix(state, token_B: jnp.ndarray) -> jnp.ndarray:
    """`token_B` with the rows still inside their forced prefix replaced by it."""
    if state.prefix_BP is None:
        return token_B
    column = jnp.minimum(state.step, state.prefix_BP.shape[1] - 1)
    forced_B = jax.lax.dynamic_index_in_dim(state.prefix_BP, column, axis=1, keepdims=False)
    return jnp.where(state.step < state.prefix_len_B, forced_B, token_B)


def advance(state: DecodeState, logits_BV: jnp.ndarray, cache: Any, *,
            select: sampling.Selector, eos_id: int, pad_id: int,
            processors: tuple = (), on_token: Optional[OnToken] = None) -> DecodeState:
    """Pick the next token of every row from `logits_BV` and record it.

    The processors edit the logits first; a row inside its forced prefix takes
    the prefix token instead of the pick. Finished rows get PAD and keep their
    length; a row whose pick is EOS becomes finished (its length includes the EOS).
    `on_token(step, token_B)` is called on the host with every pick, in step order
    (`jax.debug.callback(ordered=True)`: not under `vmap`).
    """
    step = state.step
    logits_BV = processors_lib.apply(processors, logits_BV, step, state.tokens_BN)
    token_B = forced_prefix(state, select(logits_BV, jax.random.fold_in(state.rng, step)))
    token_B = jnp.where(state.finished_B, pad_id, token_B).astype(jnp.int32)
    tokens_BN = jax.lax.dynamic_update_slice(state.tokens_BN, token_B[:, None], (0, step))
    if on_token is not None:
        jax.debug.callback(on_token, step, token_B, ordered=True)
    logits_BNV = state.logits_BNV
    if logits_BNV is not None:
        logits_BNV = jax.lax.dynamic_update_slice(
            logits_BNV, logits_BV[:, None, :].astype(jnp.float32), (0, step, 0))
    logprob_B = state.logprob_B
    if logprob_B is not None:
        logp_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1)
        free_B = ~state.finished_B
        if state.prefix_len_B is not None:
            free_B &= step >= state.prefix_len_B
        picked_B = jnp.take_along_axis(logp_BV, token_B[:, None], axis=1)[:, 0]
        logprob_B = logprob_B + jnp.where(free_B, picked_B, 0.0)
    return state.replace(
        step=step + 1, token_B=token_B, cache=cache, tokens_BN=tokens_BN,
        lengths_B=jnp.where(state.finished_B, state.lengths_B, step + 1),
        finished_B=state.finished_B | (token_B == eos_id), logits_BNV=logits_BNV,
        logprob_B=logprob_B)


def segments_for(num_steps: int, segments: Optional[int] = None) -> int:
    """`segments` if given (a positive int, checked), else 1: one loop over the whole
    cache, unless the process asked for CPU tuning (`backends.cpu.decode_segments`)."""
    if segments is None:
        return cpu.decode_segments(num_steps, jax.default_backend())
    if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1:
        raise ValueError(f"segments must be a positive int or None, got {segments!r}")
    return segments


def segment_lengths(num_steps: int, segments: int) -> tuple[int, ...]:
    """`num_steps` split into `segments` (at most one a step) near-equal parts, longest first."""
    segments = max(1, min(segments, num_steps))
    size, extra = divmod(num_steps, segments)
    return tuple(size + (i < extra) for i in range(segments))


def check_loop(loop) -> None:
    if loop not in ("scan", "while"):
        raise ValueError(f"loop must be 'scan' or 'while', got {loop!r}")


def decode_loop(logits_fn: LogitsFn, state: DecodeState, num_steps: int, *,
                select: sampling.Selector = sampling.greedy, eos_id: int, pad_id: int,
                loop: str = "scan", processors: tuple = (), segments: int = 1,
                fold: Optional[Callable[[Any, int], Any]] = None,
                on_token: Optional[OnToken] = None) -> DecodeState:
    """Run `num_steps` (static) decode steps from `state`: feed, pick, record.

    Args:
      logits_fn: `(token_B, cache, step) -> (logits_BV, cache)`; pure.
      state: the carry; `state.step + num_steps` must not exceed N.
      num_steps: steps for "scan"; the upper bound for "while".
      select: `(logits_BV, rng) -> token_B`.
      loop: "scan" (always num_steps) or "while" (stops when all rows finished).
      processors: logits processors applied before `select` (see `processors.py`).
      segments, fold: run the steps as `segment_lengths(num_steps, segments)`, one
        loop each, with `cache = fold(cache, next_length)` between two (a chunked
        cache, `cache.fold`: each segment attends over the slots written so far
        instead of all of them). The cache must start with room for exactly the
        first segment. Same tokens; one compiled loop body per segment.
      on_token: host callback of every pick (`advance`).
    """

    def body(state: DecodeState) -> DecodeState:
        logits_BV, cache = logits_fn(state.token_B, state.cache, state.step)
        return advance(state, logits_BV, cache, select=select, eos_id=eos_id, pad_id=pad_id,
                       processors=processors, on_token=on_token)

    def run(state: DecodeState, steps: int) -> DecodeState:
        if loop == "scan":
            return jax.lax.scan(lambda s, _: (body(s), None), state, None, length=steps)[0]
        stop = state.step + steps
        return jax.lax.while_loop(
            lambda s: (s.step < stop) & ~jnp.all(s.finished_B), body, state)

    check_loop(loop)
    return run_in_segments(run, state, num_steps, segments if fold else 1, fold)


def run_in_segments(run: Callable[[Any, int], Any], state, num_steps: int, segments: int,
                    fold: Optional[Callable[[Any, int], Any]]):
    """`run(state, steps)` for each of `segment_lengths(num_steps, segments)`, with
    `state.cache = fold(state.cache, steps)` before every segment but the first."""
    for i, steps in enumerate(segment_lengths(num_steps, segments)):
        if i:
            state = state.replace(cache=fold(state.cache, steps))
        state = run(state, steps)
    return state


def cached_logits_fn(model, params) -> LogitsFn:
    """The cached step as a `logits_fn`: feed one token per row into the `DecodeCache`."""

    def logits_fn(token_B, cache: DecodeCache, step):
        del step  # the cache knows its own slot
        logits_B1V, cache = cache_lib.cached_forward(model, params, cache, token_B[:, None])
        return logits_B1V[:, 0], cache

    return logits_fn

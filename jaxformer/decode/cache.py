"""The decode cache as data, and the one cached forward call both models share.

A `DecodeCache` is a pytree (a `flax.struct.dataclass`) that the caller holds
and `lax.scan` carries; there is no mutable Flax collection and no hidden
state. Layout of the self-attention keys/values is the one the attention
implementation reads in place (`attention.kv_length_axis`): (B, G, T_max, K)
for "einsum", (B, T_max, G, K) for "jax" (G = kv heads: H, or fewer with
grouped-query attention, which shrinks the cache by H/G); a step writes its new
key/value with one `dynamic_update_slice`.

Slots and positions. Slot t of the cache holds the token fed at step t. Every
row of a batch writes the same slot at the same step (one scalar `index`, so
writes are slices, not scatters). Rows may start late: a left-padded prompt of
row b occupies slots `start_B[b]..`, and its token in slot t sits at position
`t - start_B[b]`. The self-attention mask of a query in slot t is

    start_B[b] <= key_slot <= t

-- a per-row *range*, computed from slot numbers, not a top-left `tril` of a
(1, T_max) block (which would let the query at t see only key 0).

Cross-attention keys/values of the encoder memory live in the cache too, each
(B, H, S, K): projected once before the loop (`Transformer.cross_kv`) and read,
never rewritten, by every step.

Chunks. A step's attention reads every slot it spans, written or not, so a
cache of T_max slots costs T_max reads per step from the first step on. A
loop run in segments (`decode_loop(..., segments=n)`) keeps the slots in two
parts instead: `past_kv`, the P slots of earlier segments (read, never
written), and `self_kv`, the current segment's chunk. `fold` moves a full
chunk into the past between segments (one copy per segment); a step then
reads P + chunk slots, on average about 60 % of T_max at 4 segments
(80 of 128). Slot numbers stay
global: the chunk's slot i is slot P + i.

Local layers (`config.sliding_window`, `config.attention_pattern`). A local
layer's query never sees a key more than `sliding_window` - 1 slots back, so its
cache is a ring of R = min(sliding_window, T_max) slots: slot s lives in ring
position s mod R. A call feeding T tokens at slots a..a+T-1 attends over the
ring as it was (each ring position's slot is the newest s < a with s = j mod R)
and the T new keys, masked by `ring_mask` (window, causality, the row's
start), then writes the newest R of the slots into the ring. Cache bytes: a
global layer holds T_max slots, a local one R, so an all-local model's cache
is min(W, T_max) / T_max of a full one. Chunking (`fold`) leaves the rings
alone (their past is empty).
"""

from __future__ import annotations

import numbers
from typing import Any, Optional

import chex
import flax.struct
import jax
import jax.numpy as jnp

from jaxformer.nn import kv_quant
from jaxformer.nn.attention import KV, kv_length_axis
from jaxformer.config import TransformerConfig
from jaxformer.nn import checks
from jaxformer.nn.masks import padding_mask


@flax.struct.dataclass
class DecodeCache:
    """Everything a decode step reads besides the parameters and the new token.

    Attributes:
      self_kv: per decoder layer, self-attention keys and values, each (B, G, T_max, K);
        keys already rotated (RoPE) by their positions.
      index: () int32, the next slot to write (= tokens already cached).
      start_B: (B,) int32, first valid slot of each row (left padding); 0 if none.
      cross_kv: per decoder layer, cross-attention keys/values (B', G, S, K), or None
        (decoder-only LM); B' = B, or B / r where r consecutive rows (beams, samples)
        share one source's keys (`encoded_cache`).
      cross_mask: (B', 1, 1, S) bool, True = memory position may be attended, or None.
      past_kv: per decoder layer, keys and values (B, G, P, K) of slots 0..P-1 when the
        cache is kept in chunks (`self_kv` then holds slots P..), or None.
      length_axis: the slot axis of every key/value array (static;
        `attention.kv_length_axis`): 2 for (B, G, T, K), 1 for (B, T, G, K).
      local: per decoder layer, whether its self_kv is a sliding-window ring (static).
      window: the rings' most slots, `config.sliding_window` + init_cache's rollback
        (static; 0 without rings).
    """

    self_kv: tuple[KV, ...]
    index: jax.Array
    start_B: jax.Array
    cross_kv: Optional[tuple[KV, ...]] = None
    cross_mask: Optional[jax.Array] = None
    past_kv: Optional[tuple[KV, ...]] = None
    length_axis: int = flax.struct.field(pytree_node=False, default=2)
    local: tuple[bool, ...] = flax.struct.field(pytree_node=False, default=())
    window: int = flax.struct.field(pytree_node=False, default=0)

    @property
    def batch(self) -> int:
        return self.start_B.shape[0]

    def _full_layer(self) -> int:
        """A layer with a full (not ring) cache, or 0 if every layer is a ring."""
        return next((i for i, ring in enumerate(self.local_flags) if not ring), 0)

    @property
    def local_flags(self) -> tuple[bool, ...]:
        return self.local or (False,) * len(self.self_kv)

    @property
    def past_len(self) -> int:
        """P: slots held in `past_kv` (0 without)."""
        if self.past_kv is None:
            return 0
        return self.past_kv[self._full_layer()].key.shape[self.length_axis]

    @property
    def max_len(self) -> int:
        """T_max: the number of slots, past and current chunk (of a full layer)."""
        return self.past_len + self.self_kv[self._full_layer()].key.shape[self.length_axis]


def init_cache(config: TransformerConfig, batch: int, max_len: int,
               dtype: Any = None, *, rollback: int = 0) -> DecodeCache:
    """An empty cache: zero keys/values for `max_len` slots, index 0, no cross state.

    Args:
      config: the model's configuration (layers, heads, head dim).
      batch: B, rows decoded together (batch * beams for beam search).
      max_len: T_max, slots to allocate = prompt length + new tokens fed.
      dtype: of keys/values; defaults to the compute dtype (an int8 cache,
        `config.kv_cache_quant`, dequantizes to the compute dtype when read).
      rollback: how many slots past its index a caller may write and then give back
        (moving the index back over them: speculative decoding's rejected drafts).
        Rings keep that many slots beyond the window: a rolled-back slot s then sits
        where slot s - R was, R - rollback >= window behind any later query, so the
        mask (which reads each ring position as its newest slot below the index) never
        shows it, and no key a window still needs was overwritten.
    """
    for name, value in (("batch", batch), ("max_len", max_len)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"init_cache: {name} must be a positive int, got {value!r}")
    if isinstance(rollback, bool) or not isinstance(rollback, int) or rollback < 0:
        raise ValueError(f"init_cache: rollback must be an int >= 0, got {rollback!r}")
    if max_len > config.decoder_len:
        raise ValueError(f"init_cache: max_len={max_len} exceeds the model's decoder "
                         f"max_len={config.decoder_len} (config.decoder_max_len or max_len; positions "
                         f"would run off the table)")
    dtype = config.compute_dtype if dtype is None else jnp.dtype(dtype)
    local = config.local_layers(config.num_decoder_layers)
    layers = []
    ring_len = (config.sliding_window or 0) + rollback if any(local) else 0
    for ring in local:  # int8 with per-(head, token) scales if config.kv_cache_quant
        shape = kv_shape(config, batch, min(max_len, ring_len) if ring else max_len)
        layers.append(kv_quant.empty(shape, config.kv_cache_quant == "int8", dtype))
    return DecodeCache(self_kv=tuple(layers), index=jnp.zeros((), jnp.int32),
                       start_B=jnp.zeros((batch,), jnp.int32),
                       length_axis=kv_length_axis(config), local=local, window=ring_len)


def cache_bytes(cache: DecodeCache) -> int:
    """Bytes of the self-attention keys and values (past and current chunk)."""
    arrays = [x for kv in cache.self_kv for x in kv]
    if cache.past_kv is not None:
        arrays += [x for kv in cache.past_kv for x in kv]
    return sum(x.size * x.dtype.itemsize for x in arrays)


def kv_shape(config: TransformerConfig, batch: int, slots: int) -> tuple[int, ...]:
    """The shape of one layer's cached keys (or values) of `slots` positions."""
    shape = [batch, config.kv_heads, config.head_dim]
    shape.insert(kv_length_axis(config), slots)
    return tuple(shape)


def check_cache(cache: DecodeCache, config: TransformerConfig) -> None:
    """chex checks that `cache` fits `config` (shapes are static: free under jit)."""
    if not isinstance(cache, DecodeCache):
        raise TypeError(f"cache must be a DecodeCache, got {type(cache).__name__}")
    if len(cache.self_kv) != config.num_decoder_layers:
        raise ValueError(f"cache has {len(cache.self_kv)} layers, config has "
                         f"{config.num_decoder_layers} decoder layers")
    if cache.length_axis != kv_length_axis(config):
        raise ValueError(f"cache has its slots on axis {cache.length_axis}, attention_impl="
                         f"{config.attention_impl!r} reads them on axis "
                         f"{kv_length_axis(config)}: build it with init_cache(config, ...)")
    local = config.local_layers(config.num_decoder_layers)
    if cache.local_flags != local:
        raise ValueError(f"cache has sliding-window rings on layers {cache.local_flags}, the "
                         f"config's local layers are {local}: build it with init_cache(config, ...)")
    batch, slots = cache.batch, cache.max_len - cache.past_len
    if any(local) and cache.window < config.sliding_window:
        raise ValueError(f"cache rings hold {cache.window} slots, fewer than the config's "
                         f"sliding_window={config.sliding_window}: build it with "
                         "init_cache(config, ...)")
    ring = min(slots + cache.past_len, cache.window or 1)
    quantized = config.kv_cache_quant == "int8"
    if any(isinstance(kv, kv_quant.QuantKV) != quantized for kv in cache.self_kv):
        raise ValueError(f"cache keys/values are {cache.self_kv[0].key.dtype}, the config's "
                         f"kv_cache_quant is {config.kv_cache_quant!r}: build it with "
                         "init_cache(config, ...)")

    def check_slots(kv, shape):
        chex.assert_shape([kv.key, kv.value], shape)
        if quantized:
            chex.assert_shape([kv.key_scale, kv.value_scale], shape[:-1])

    for kv, is_ring in zip(cache.self_kv, local):
        check_slots(kv, kv_shape(config, batch, ring if is_ring else slots))
    if cache.past_kv is not None:
        if len(cache.past_kv) != config.num_decoder_layers:
            raise ValueError("cache.past_kv must have one KV per decoder layer")
        for kv, is_ring in zip(cache.past_kv, local):
            check_slots(kv, kv_shape(config, batch, 0 if is_ring else cache.past_len))
    chex.assert_shape(cache.index, ())
    chex.assert_type([cache.index, cache.start_B], jnp.int32)
    if cache.cross_kv is not None:
        if len(cache.cross_kv) != config.num_decoder_layers:
            raise ValueError("cache.cross_kv must have one KV per decoder layer")
        memory_len = cache.cross_kv[0].key.shape[kv_length_axis(config)]
        sources = cache.cross_kv[0].key.shape[0]  # rows share a source (`encoded_cache`)
        if sources < 1 or batch % sources:
            raise ValueError(f"cache.cross_kv has {sources} rows: the cache's {batch} rows "
                             "must be a multiple of them")
        chex.assert_shape([x for kv in cache.cross_kv for x in kv],
                          kv_shape(config, sources, memory_len))
        if cache.cross_mask is not None:
            chex.assert_shape(cache.cross_mask, (sources, 1, 1, memory_len))


def check_tokens_for(cache: DecodeCache, config: TransformerConfig, tokens_BT,
                     name: str = "tokens_BT") -> None:
    """`check_cache`, and (B, T) tokens of the cache's batch that fit its slots."""
    check_cache(cache, config)
    checks.check_shape(name, tokens_BT, (cache.batch, None),
                       f"(the cache's batch {cache.batch}, new tokens)")
    # Rings take any number of tokens (each keeps the last `sliding_window`); a full
    # layer's cache only as many as it has slots.
    if not all(cache.local_flags) and tokens_BT.shape[1] > cache.max_len:
        raise ValueError(f"{name} feeds {tokens_BT.shape[1]} tokens, more than the cache's "
                         f"{cache.max_len} slots")


def self_attention_mask(cache: DecodeCache, num_queries: int) -> jnp.ndarray:
    """(B, 1, T, T_max): query in slot index+i sees key slots start_B[b]..index+i."""
    query_slot_T = cache.index + jnp.arange(num_queries)
    key_slot = jnp.arange(cache.max_len)
    visible_TK = key_slot[None, :] <= query_slot_T[:, None]
    started_BK = key_slot[None, :] >= cache.start_B[:, None]
    return (visible_TK[None, :, :] & started_BK[:, None, :])[:, None]


def ring_mask(cache: DecodeCache, num_queries: int, ring_len: int, window: int) -> jnp.ndarray:
    """(B, 1, T, R + T): what the T queries at slots index.. of a local layer see in
    [its ring of R slots before the write, the T new keys]: keys at most window - 1
    slots back, written, not after the query, not before the row's start."""
    first = cache.index
    query_T = first + jnp.arange(num_queries)
    ring_slot_R = first - 1 - jnp.remainder(first - 1 - jnp.arange(ring_len), ring_len)
    new_slot_T = first + jnp.arange(num_queries)
    key_slot = jnp.concatenate([ring_slot_R, new_slot_T])
    distance_TK = query_T[:, None] - key_slot[None, :]
    visible_TK = (distance_TK >= 0) & (distance_TK < window) & (key_slot >= 0)[None, :]
    started_BK = key_slot[None, :] >= cache.start_B[:, None]
    return (visible_TK[None] & started_BK[:, None, :])[:, None]


def positions(cache: DecodeCache, num_queries: int) -> jnp.ndarray:
    """(B, T) positions of the next T tokens: slot minus the row's start (>= 0).

    Left-padding slots (before the row's start) get position 0; nothing
    attends to them, so their value is irrelevant but stays in the table.
    """
    slot_T = cache.index + jnp.arange(num_queries)
    return jnp.maximum(slot_T[None, :] - cache.start_B[:, None], 0)


def _call_decoder(module, *args, **kwargs):
    return module.decoder(*args, **kwargs)


def cached_forward(model, params, cache: DecodeCache,
                   tokens_BT: jnp.ndarray) -> tuple[jnp.ndarray, DecodeCache]:
    """Feed T tokens into slots index..index+T-1: the pure decode step (T = 1) or prefill.

    Works for `Transformer` (cross-attends to `cache.cross_kv`) and
    `DecoderOnlyLM` alike: both own a `decoder`.

    Args:
      model: the Flax module (static).
      params: its parameter pytree (the inside of {"params": ...}).
      cache: the state before the call.
      tokens_BT: (B, T) int ids.
    Returns:
      (logits (B, T, V) float32, the cache with the new keys/values and index + T).
    Raises:
      ValueError naming `cache` or `tokens_BT` when their shapes disagree with
      each other or the model (`check_tokens_for`; at trace time, free under jit).
    """
    logits_BTV, self_kv = apply_decoder(model, params, cache, tokens_BT)
    return logits_BTV, cache.replace(self_kv=self_kv, index=cache.index + tokens_BT.shape[1])


def apply_decoder(model, params, cache: DecodeCache, tokens_BT: jnp.ndarray, **apply_kwargs):
    """`model.apply` of the decoder on T tokens at the cache's slots, with the cache's
    masks and positions: the call `cached_forward` makes. Returns what `apply` returns
    ((logits (B, T, V), new self keys/values), and the mutable state when
    `apply_kwargs` asks for it, e.g. `capture_intermediates=..., mutable=...`)."""
    check_tokens_for(cache, model.config, tokens_BT)
    num_queries = tokens_BT.shape[1]
    rings = [kv for kv, ring in zip(cache.self_kv, cache.local_flags) if ring]
    local_mask = None
    if rings:
        local_mask = ring_mask(cache, num_queries, rings[0].key.shape[cache.length_axis],
                               model.config.sliding_window)
    return model.apply(
        {"params": params}, tokens_BT, self_attention_mask(cache, num_queries),
        cache.cross_kv, cache.cross_mask,
        positions_BT=positions(cache, num_queries), caches=cache.self_kv,
        cache_index=cache.index - cache.past_len, past_kvs=cache.past_kv,
        ring_mask=local_mask, ring_index=cache.index if rings else None,
        deterministic=True, method=_call_decoder, **apply_kwargs)


def prefill(model, params, cache: DecodeCache, tokens_BP: jnp.ndarray,
            chunk: Optional[int] = None) -> tuple[jnp.ndarray, DecodeCache]:
    """Feed a prompt (B, P) into the cache, `chunk` tokens per call (None: one call).

    Each call's queries attend over the cache (C x T_max scores) instead of
    the prompt over itself (P x P), so a long prompt's temporaries are bounded
    by the chunk. A first call takes the P mod C leading tokens, then a
    `lax.scan` feeds the C-token chunks (one compiled body). Results equal one
    pass up to float rounding: every query sees the same keys.

    Returns:
      (the logits (B, V) float32 of the last prompt token, the filled cache).
    """
    check_tokens_for(cache, model.config, tokens_BP, "tokens_BP")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"chunk must be a positive int or None, got {chunk!r}")
    width = tokens_BP.shape[1]
    if chunk is None or chunk >= width:
        logits_BPV, cache = cached_forward(model, params, cache, tokens_BP)
        return logits_BPV[:, -1], cache
    lead, count = width % chunk, width // chunk
    if lead:
        _, cache = cached_forward(model, params, cache, tokens_BP[:, :lead])
    chunks_NBC = jnp.moveaxis(tokens_BP[:, lead:].reshape(tokens_BP.shape[0], count, chunk),
                              1, 0)

    def step(cache, tokens_BC):
        logits_BCV, cache = cached_forward(model, params, cache, tokens_BC)
        return cache, logits_BCV[:, -1]

    cache, last_NBV = jax.lax.scan(step, cache, chunks_NBC)
    return last_NBV[-1], cache


def fold(cache: DecodeCache, chunk_len: int) -> DecodeCache:
    """The cache with its current chunk moved into the past and an empty chunk of
    `chunk_len` slots after it (one copy of the keys/values written so far).

    Every slot of the current chunk must have been written: a slot that was
    not would stay visible to later queries (masks go by slot number).
    """
    if isinstance(chunk_len, bool) or not isinstance(chunk_len, numbers.Integral) or chunk_len < 1:
        raise ValueError(f"fold: chunk_len must be a positive int, got {chunk_len!r}")

    def joined(past: Optional[KV], chunk: KV) -> KV:
        if past is None:
            return chunk
        return type(chunk)(*(jnp.concatenate(pair, axis=cache.length_axis)
                             for pair in zip(past, chunk)))

    pasts = (None,) * len(cache.self_kv) if cache.past_kv is None else cache.past_kv
    axis = cache.length_axis

    def resized(kv: KV, length: int) -> KV:  # a KV or a QuantKV (kv_quant)
        return type(kv)(*(jnp.zeros(x.shape[:axis] + (length,) + x.shape[axis + 1:], x.dtype)
                          for x in kv))

    past, chunk = [], []
    for kv, old, ring in zip(cache.self_kv, pasts, cache.local_flags):
        if ring:  # a sliding-window ring stays; its past is empty
            past.append(resized(kv, 0))
            slots = kv.key.shape[axis]
            # A ring shorter than the window has never wrapped (it held every slot so
            # far): it grows towards the window with the slots to come.
            grow = min(cache.window, slots + chunk_len) - slots
            chunk.append(kv if grow <= 0 else type(kv)(*(
                jnp.concatenate([x, resized(KV(x, x), grow).key], axis=axis) for x in kv)))
        else:
            past.append(joined(old, kv))
            chunk.append(resized(kv, chunk_len))
    return cache.replace(past_kv=tuple(past), self_kv=tuple(chunk))


def with_memory(model, params, cache: DecodeCache, memory_BSD: jnp.ndarray,
                src_mask: Optional[jnp.ndarray]) -> DecodeCache:
    """Project the encoder memory's cross-attention keys/values once, into the cache.

    `src_mask` (B, 1, 1, S) hides PAD memory positions (None: all visible).
    """
    c = model.config
    checks.check_shape("memory_BSD", memory_BSD, (cache.batch, None, c.d_model),
                       f"(the cache's batch {cache.batch}, memory length, d_model)")
    if src_mask is not None:
        checks.check_shape("src_mask", src_mask, (cache.batch, 1, 1, memory_BSD.shape[1]),
                           "(batch, 1, 1, memory length)")
    cross_kv = model.apply({"params": params}, memory_BSD, method=type(model).cross_kv)
    return cache.replace(cross_kv=tuple(cross_kv), cross_mask=src_mask)


def encode_memory(model, params, src, src_mask
                  ) -> tuple[jnp.ndarray, jnp.ndarray]:
    """The encoder's memory (B, S, D) and its (B, 1, 1, S) mask.

    The mask is `src_mask` broadcast to the batch, or by default PAD ids hidden
    (token sources) or all visible (embedded or stem inputs, whose S is the
    memory's length, not the input's).
    """
    memory_BSD = model.apply({"params": params}, src, src_mask, method=type(model).encode)
    batch, length = memory_BSD.shape[:2]
    if src_mask is None:
        src_mask = (padding_mask(src, model.config.pad_id)
                    if jnp.issubdtype(src.dtype, jnp.integer)
                    else jnp.ones((batch, 1, 1, length), bool))
    return memory_BSD, jnp.broadcast_to(src_mask, (batch, 1, 1, length))


def memory_cache(model, params, src, src_mask, max_len: int, *,
                 repeats: int = 1) -> DecodeCache:
    """An empty decoder cache of `max_len` slots holding the encoded source.

    The source is encoded once (`encode_memory`) and its cross-attention
    keys/values projected once (`encoded_cache`); `repeats` > 1 repeats each
    example's keys/values that many times (row b * repeats + r: beam r of example b).
    """
    memory_BSD, mask_B11S = encode_memory(model, params, src, src_mask)
    return encoded_cache(model, params, memory_BSD, mask_B11S, max_len, repeats=repeats)


def encoded_cache(model, params, memory_BSD: jnp.ndarray, mask_B11S: Optional[jnp.ndarray],
                  max_len: int, *, repeats: int = 1) -> DecodeCache:
    """An empty decoder cache of `max_len` slots over an encoder output (B, S, D)
    (`encode_memory`, or one the caller kept: a window decoded several times is
    encoded once). The cross-attention keys/values are projected once per
    example and shared by its `repeats` rows (row b * repeats + r): `cross_kv` and
    `cross_mask` keep B rows, each read once per step for all of its rows.
    """
    cache = init_cache(model.config, memory_BSD.shape[0] * repeats, max_len)
    if repeats == 1:
        return with_memory(model, params, cache, memory_BSD, mask_B11S)
    # Not repeated in memory: the `repeats` rows of an example share its keys and
    # values (`attention.MultiHeadAttention`: their queries are attended together).
    cross_kv = model.apply({"params": params}, memory_BSD, method=type(model).cross_kv)
    return cache.replace(cross_kv=tuple(cross_kv), cross_mask=mask_B11S)

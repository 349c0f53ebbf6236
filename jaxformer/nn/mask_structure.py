"""Attention masks described by structure, never materialised whole: `MaskSpec`.

A `MaskSpec` says which key a query may attend to (True = may attend, the
convention of `masks.py`) as the conjunction of a few rules, each optional:

  causal          key position <= query position
  window w        |query position - key position| < w: with `causal`, the w keys
                  (q - w, q], the sliding window of Mistral / Gemma 2 and cuDNN's
                  `sliding_window_length` (`jax.nn.dot_product_attention`'s
                  `local_window_size=(w - 1, 0)`); without it, w - 1 keys either side
  prefix p        (with `causal`) keys at positions < p are visible to every query
                  (prefix-LM: a bidirectional prompt); per row (B,) or an int
  segment ids     query and key in the same segment (packed documents)
  kv_lengths      key index < kv_lengths[b] (right padding; a cache's fill level)
  q_lengths       query index < q_lengths[b] (rows after it see nothing)

Positions are the indices (query i at `q_offset + i`: a chunk of queries that
continues a longer sequence, e.g. a prefill chunk against its cache) unless
`q_positions` and `kv_positions` are given (e.g. a ring-buffer cache whose slots
are not in position order). Indices make the causal and window structure
static: which key blocks a query block can see is known from the shapes, so
`band` bounds a blockwise loop and the compute of a sliding window is linear.
Everything else (segments, lengths, explicit positions) is data: `block_visible`
decides per block pair at run time, conservatively (it may say visible for a
block that is all masked, never the reverse).

This is how the fused kernels take masks (`jax.nn.dot_product_attention`'s
`is_causal` / `local_window_size` / `*_seq_lengths`, splash attention's
`CausalMask` / `LocalMask` and segment ids), so one spec serves every
implementation; `dense_mask` gives the (B, 1, T, S) boolean for the dense path
and for arbitrary patterns that have no structure.

`LayerKindMask` picks, per scanned layer of a mixed stack, a local or a global spec;
`densified` turns any of these masks into the dense boolean.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Union

import flax.struct
import jax.numpy as jnp
from jax import lax

from jaxformer.nn import checks

Int = Union[int, jnp.ndarray]


@flax.struct.dataclass
class MaskSpec:
    """Which keys each query may attend to (module docstring); a pytree.

    Attributes (all optional; B may be 1 to broadcast over the batch):
      causal, window: static structure (see the module docstring).
      q_offset: position of query 0 when positions are indices; int or () int32.
      q_segment_ids (B, T), kv_segment_ids (B, S): int; both or neither.
      q_positions (B, T), kv_positions (B, S): int; both or neither.
      kv_lengths (B,), q_lengths (B,): int32 valid lengths.
      prefix_length: int or (B,) int32; only with `causal`.
    """

    causal: bool = flax.struct.field(pytree_node=False, default=False)
    window: Optional[int] = flax.struct.field(pytree_node=False, default=None)
    q_offset: Int = 0
    q_segment_ids: Optional[jnp.ndarray] = None
    kv_segment_ids: Optional[jnp.ndarray] = None
    q_positions: Optional[jnp.ndarray] = None
    kv_positions: Optional[jnp.ndarray] = None
    kv_lengths: Optional[jnp.ndarray] = None
    q_lengths: Optional[jnp.ndarray] = None
    prefix_length: Optional[Int] = None

    def __post_init__(self):
        if self.window is not None and (not isinstance(self.window, int) or self.window < 1):
            raise ValueError(f"MaskSpec.window must be an int >= 1 or None, got {self.window!r}")
        for a, b in (("q_segment_ids", "kv_segment_ids"), ("q_positions", "kv_positions")):
            if (getattr(self, a) is None) != (getattr(self, b) is None):
                raise ValueError(f"MaskSpec.{a} and MaskSpec.{b} come together: got only one")
        if self.prefix_length is not None and not self.causal:
            raise ValueError("MaskSpec.prefix_length needs causal=True (it lifts causality "
                             "for the prefix)")

    @property
    def has_positions(self) -> bool:
        return self.q_positions is not None


def check_spec(spec: MaskSpec, batch: Optional[int], num_queries: int, num_keys: int,
               name: str = "mask") -> None:
    """ValueError naming the field of `spec` whose shape does not fit `batch` rows of
    `num_queries` queries and `num_keys` keys (`batch` None: any, but one for all
    fields): per-token arrays (B|1, T) or (B|1, S), per-row arrays () or (B|1,).
    Shapes are static: this costs nothing under jit."""
    if not isinstance(spec, MaskSpec):
        raise TypeError(f"{name} must be a MaskSpec or None, got {type(spec).__name__}")
    if batch is None:
        sizes = {x.shape[0] for x in (spec.q_segment_ids, spec.kv_segment_ids, spec.q_positions,
                                      spec.kv_positions, spec.kv_lengths, spec.q_lengths,
                                      spec.prefix_length)
                 if getattr(x, "ndim", 0) >= 1 and x.shape[0] != 1}
        batch = max(sizes) if sizes else 1
    rows = (1, batch)
    per_token = {"q_segment_ids": (rows, num_queries), "q_positions": (rows, num_queries),
                 "kv_segment_ids": (rows, num_keys), "kv_positions": (rows, num_keys)}
    for field, expected in per_token.items():
        value = getattr(spec, field)
        if value is not None:
            checks.check_shape(f"{name}.{field}", value, expected,
                               "(batch or 1, queries)" if field.startswith("q_")
                               else "(batch or 1, keys)")
    for field in ("kv_lengths", "q_lengths", "prefix_length", "q_offset"):
        value = getattr(spec, field)
        if value is None or isinstance(value, int):
            continue
        ndim = getattr(value, "ndim", None)
        if field == "q_offset" or ndim == 0:
            checks.check_shape(f"{name}.{field}", value, (), "(a scalar)")
        else:
            checks.check_shape(f"{name}.{field}", value, (rows,), "(batch or 1,) per row")


def _slice(x: Optional[jnp.ndarray], start: Int, size: int) -> Optional[jnp.ndarray]:
    """x[:, start:start + size] for a (B, N) array; start may be traced."""
    if x is None:
        return None
    return lax.dynamic_slice_in_dim(jnp.asarray(x), start, size, axis=1)


def _positions(spec: MaskSpec, q_start: Int, size_q: int, k_start: Int, size_k: int):
    """(query positions (B|1, bq), key positions (B|1, bk)) of a block pair."""
    if spec.has_positions:
        return _slice(spec.q_positions, q_start, size_q), _slice(spec.kv_positions, k_start,
                                                                 size_k)
    q = (spec.q_offset + q_start + jnp.arange(size_q))[None, :]
    return q, (k_start + jnp.arange(size_k))[None, :]


def _per_row(x: Int) -> jnp.ndarray:
    """An int or (B,) array as (B|1, 1, 1) for broadcasting against (B, bq, bk)."""
    return jnp.reshape(jnp.asarray(x), (-1, 1, 1))


def block_mask(spec: MaskSpec, q_start: Int, size_q: int, k_start: Int,
               size_k: int) -> jnp.ndarray:
    """(B|1, 1, size_q, size_k) bool: queries q_start.. against keys k_start.. (True = may
    attend). Starts may be traced; sizes are static. Costs O(size_q * size_k), so a
    blockwise loop builds each block's mask when it needs it."""
    q_pos, k_pos = _positions(spec, q_start, size_q, k_start, size_k)
    diff = q_pos[:, :, None] - k_pos[:, None, :]  # (B|1, bq, bk) query minus key position
    ok = jnp.ones(diff.shape, bool)
    if spec.causal:
        ok = diff >= 0
    if spec.window is not None:
        ok &= diff < spec.window
        if not spec.causal:
            ok &= diff > -spec.window
    if spec.prefix_length is not None:
        ok |= k_pos[:, None, :] < _per_row(spec.prefix_length)
    if spec.q_segment_ids is not None:
        q_seg = _slice(spec.q_segment_ids, q_start, size_q)
        k_seg = _slice(spec.kv_segment_ids, k_start, size_k)
        ok &= q_seg[:, :, None] == k_seg[:, None, :]
    if spec.kv_lengths is not None:
        ok &= (k_start + jnp.arange(size_k))[None, None, :] < _per_row(spec.kv_lengths)
    if spec.q_lengths is not None:
        ok &= (q_start + jnp.arange(size_q))[None, :, None] < _per_row(spec.q_lengths)
    return ok[:, None]


def dense_mask(spec: MaskSpec, num_queries: int, num_keys: int) -> jnp.ndarray:
    """(B|1, 1, T, S) bool, the whole mask: for the dense path and for tests."""
    check_spec(spec, None, num_queries, num_keys, "spec")
    return block_mask(spec, 0, num_queries, 0, num_keys)


def block_visible(spec: MaskSpec, q_start: Int, size_q: int, k_start: Int,
                  size_k: int) -> jnp.ndarray:
    """() bool: may any query of the block see any key of the block, in any batch row?

    Conservative and cheap (O(size_q + size_k)): it compares each rule's ranges
    (min/max positions, min/max segment ids), so False means the block pair is
    all masked and can be skipped; True may still be all masked (segment ids
    that are not sorted, say).
    """
    q_pos, k_pos = _positions(spec, q_start, size_q, k_start, size_k)
    q_lo, q_hi = q_pos.min(axis=1), q_pos.max(axis=1)  # (B|1,)
    k_lo, k_hi = k_pos.min(axis=1), k_pos.max(axis=1)
    ok = jnp.ones(jnp.broadcast_shapes(q_lo.shape, k_lo.shape), bool)
    if spec.causal:
        ok = k_lo <= q_hi
    if spec.window is not None:
        ok &= q_lo - k_hi < spec.window
        if not spec.causal:
            ok &= k_lo - q_hi < spec.window
    if spec.prefix_length is not None:
        ok |= k_lo < jnp.reshape(jnp.asarray(spec.prefix_length), (-1,))
    if spec.q_segment_ids is not None:
        q_seg = _slice(spec.q_segment_ids, q_start, size_q)
        k_seg = _slice(spec.kv_segment_ids, k_start, size_k)
        ok &= (q_seg.min(axis=1) <= k_seg.max(axis=1)) & (k_seg.min(axis=1) <= q_seg.max(axis=1))
    if spec.kv_lengths is not None:
        ok &= k_start < jnp.asarray(spec.kv_lengths)
    if spec.q_lengths is not None:
        ok &= q_start < jnp.asarray(spec.q_lengths)
    return jnp.any(ok)


def band(spec: MaskSpec, block_q: int, block_k: int, num_key_blocks: int) -> int:
    """The most key blocks (static) any query block of `block_q` queries can see, from the
    static structure: `num_key_blocks` unless a window (with index positions and no
    prefix) bounds it. `first_key_block` gives where a query block's band starts."""
    if spec.window is None or spec.has_positions or spec.prefix_length is not None:
        return num_key_blocks
    # Key positions a query block can see span block_q + w - 1 (causal) or + 2(w - 1).
    span = block_q + (spec.window - 1) * (1 if spec.causal else 2)
    return min(num_key_blocks, math.ceil((span - 1) / block_k) + 1)


def first_key_block(spec: MaskSpec, q_start: Int, block_k: int, num_key_blocks: int,
                    width: int) -> Int:
    """Index of the first key block in the band of the query block at `q_start` (traced or
    int), such that blocks first .. first + width - 1 hold every key the block can see."""
    if width == num_key_blocks:
        return 0
    lowest_key = spec.q_offset + q_start - (spec.window - 1)
    first = jnp.clip(lowest_key // block_k, 0, num_key_blocks - width)
    return first


class LayerKindMask(NamedTuple):
    """The self-attention mask of a scanned layer in a stack of mixed kinds: the
    traced per-layer flag `is_local` picks `local` (with the window) or `global_`.
    (A MaskSpec's window is static, so it cannot be selected with `jnp.where`.)"""

    is_local: jnp.ndarray
    local: MaskSpec
    global_: MaskSpec


def densified(mask, num_queries: int, num_keys: int) -> Optional[jnp.ndarray]:
    """`mask` as a dense boolean (B|1, 1, T, S) (None and dense arrays as they are)."""
    if isinstance(mask, LayerKindMask):
        return jnp.where(mask.is_local, dense_mask(mask.local, num_queries, num_keys),
                         dense_mask(mask.global_, num_queries, num_keys))
    if isinstance(mask, MaskSpec):
        return dense_mask(mask, num_queries, num_keys)
    return mask

"""Boundary checks: shapes and dtypes by chex, token ranges by value.

Shapes are static under `jax.jit`, so the chex checks fire at trace time,
before any compilation, with a message naming the argument. Token *values* are
only known outside `jit`: `check_tokens` raises eagerly on concrete arrays and
is a no-op on tracers. Inside a jitted function an out-of-range id embeds as
NaN (see `layers.TokenEmbedding`), so it cannot pass silently; the library's
own jitted entry points (decoding, training) check on the host first.
"""

from __future__ import annotations

import weakref

import chex
import jax
import jax.numpy as jnp
import numpy as np


def is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def check_tokens(name: str, tokens, vocab_size: int, max_len: int | None = None) -> None:
    """(B, T) integer ids in [0, vocab_size), T <= max_len; raise ValueError otherwise."""
    chex.assert_rank(tokens, 2, custom_message=f"argument {name} must be (batch, length)")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"{name} must hold integer token ids, got dtype {tokens.dtype}")
    check_length(name, tokens.shape[1], max_len)
    if is_concrete(tokens):
        values = np.asarray(tokens)
        if values.size and (values.min() < 0 or values.max() >= vocab_size):
            bad = values[(values < 0) | (values >= vocab_size)]
            raise ValueError(f"{name} holds token ids outside [0, {vocab_size}): "
                             f"{sorted(set(bad.tolist()))[:10]}")


def shape_text(expected) -> str:
    """(None, 1|4, 16) -> "(*, 1|4, 16)": a pattern for messages."""
    def one(e):
        if e is None:
            return "*"
        if isinstance(e, tuple):
            return "|".join(str(v) for v in e)
        return str(e)
    return "(" + ", ".join(one(e) for e in expected) + ("," if len(expected) == 1 else "") + ")"


def check_shape(name: str, x, expected, layout: str = "") -> None:
    """`x.shape` matches `expected`: per axis an int, a tuple of allowed ints, or None
    (any size). ValueError naming the argument, the layout, the expected and the
    actual shape; shapes are static, so this runs at trace time (free under jit)."""
    shape = getattr(x, "shape", None)
    if shape is None:
        raise TypeError(f"{name} must be an array {layout}, got {type(x).__name__}".strip())
    ok = len(shape) == len(expected) and all(
        e is None or (size in e if isinstance(e, tuple) else size == e)
        for size, e in zip(shape, expected))
    if not ok:
        what = f" {layout}" if layout else ""
        raise ValueError(f"{name} must have shape {shape_text(expected)}{what}, got "
                         f"{tuple(shape)}")


def check_qkv(query_BHTK, key_BGSK, value_BGSK) -> None:
    """Queries (B, H, T, K), keys (B, G, S, K) with G dividing H, values of the keys'
    shape: ValueError naming the argument (the fused attention functions)."""
    check_shape("query_BHTK", query_BHTK, (None,) * 4, "(batch, heads, queries, depth)")
    batch, heads, _, depth = query_BHTK.shape
    check_shape("key_BGSK", key_BGSK, (batch, None, None, depth),
                "(batch, kv heads, keys, depth)")
    check_shape("value_BGSK", value_BGSK, key_BGSK.shape, "(the keys' shape)")
    kv_heads = key_BGSK.shape[1]
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of kv heads ({kv_heads})")


def check_rank(name: str, x, rank, layout: str) -> None:
    """`x` has rank `rank` (an int or a set of ints); `layout` names the axes for the message."""
    chex.assert_rank(x, rank, custom_message=f"argument {name} must be {layout}")


def check_length(name: str, length: int, max_len: int | None) -> None:
    if max_len is not None and length > max_len:
        raise ValueError(f"{name} has length {length}, longer than the model's "
                         f"max_len={max_len}")


def check_embedded(name: str, x, d_model: int, max_len: int) -> None:
    """(B, S, D) float inputs (already-embedded sources)."""
    chex.assert_rank(x, 3, custom_message=f"argument {name} must be (batch, length, d_model)")
    if x.shape[-1] != d_model:
        raise ValueError(f"{name} has feature size {x.shape[-1]}, expected d_model={d_model}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must be floating point, got dtype {x.dtype}")
    check_length(name, x.shape[1], max_len)


def check_same_batch(**arrays) -> None:
    """All arrays share their leading (batch) dimension."""
    sizes = {name: a.shape[0] for name, a in arrays.items() if a is not None}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"batch sizes disagree: {sizes}")


def check_mask(name: str, mask, batch: int, queries: int, keys: int,
               heads: int | None = None) -> None:
    """A boolean mask broadcastable to (B, 1 or H, T, S)."""
    if mask is None:
        return
    chex.assert_rank(mask, 4, custom_message=f"argument {name} must be (B, 1, T, S)")
    if mask.dtype != jnp.bool_:
        raise TypeError(f"{name} must be boolean (True = may attend), got {mask.dtype}")
    for got, want, axis in zip(mask.shape[::2], (batch, queries), ("batch", "query")):
        if got not in (1, want):
            raise ValueError(f"{name} has {axis} size {got}, expected 1 or {want}")
    if heads is not None and mask.shape[1] not in (1, heads):
        raise ValueError(f"{name} has head size {mask.shape[1]}, expected 1 or {heads}")
    if mask.shape[3] not in (1, keys):
        raise ValueError(f"{name} has key size {mask.shape[3]}, expected 1 or {keys}")


@jax.jit
def _finite_leaves(tree):
    return jax.tree_util.tree_map(lambda x: jnp.all(jnp.isfinite(x)), tree)


# id -> weak reference of a concrete jax.Array already checked (finite, or not floating):
# jax arrays are immutable, so one stays so. A loop calling `generate` on the same params
# then skips the pass and its host round trips, one per leaf (SmolLM2's kept tree: 2,400
# leaves, 20-45 ms a call, 10-20% of a 32-token batch-1 decode). numpy arrays can be
# written in place: never remembered.
_CHECKED: dict = {}


def _checked(leaf) -> bool:
    ref = _CHECKED.get(id(leaf))
    return ref is not None and ref() is leaf


def _remember(leaf) -> None:
    if not isinstance(leaf, jax.Array) or not is_concrete(leaf) or _checked(leaf):
        return
    key = id(leaf)

    def forget(ref, key=key):
        if _CHECKED.get(key) is ref:
            del _CHECKED[key]

    _CHECKED[key] = weakref.ref(leaf, forget)


def check_finite_params(params, what: str = "params") -> None:
    """ValueError naming the parameters that hold NaN or inf (concrete params only).

    One pass over the parameters on their devices; only a bool per array comes back
    to the host. NaN weights would otherwise decode to an arbitrary token (argmax of
    NaN logits) without a word. jax arrays that passed before are not checked again
    (they are immutable).
    """
    if all(_checked(leaf) for leaf in jax.tree_util.tree_leaves(params)):
        return
    leaves = jax.tree_util.tree_leaves_with_path(params)
    floating = {jax.tree_util.keystr(path): leaf for path, leaf in leaves
                if is_concrete(leaf) and not _checked(leaf)
                and jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)}
    if floating:
        with jax.ensure_compile_time_eval():  # concrete even inside a caller's jit/vmap trace
            finite = jax.device_get(_finite_leaves(floating))
        bad = [name for name, ok in finite.items() if not ok]
        if bad:
            more = f" and {len(bad) - 4} more" if len(bad) > 4 else ""
            raise ValueError(f"{what} hold NaN or inf values in {', '.join(bad[:4])}{more}: "
                             "the model diverged or its checkpoint is damaged")
    for _, leaf in leaves:
        _remember(leaf)

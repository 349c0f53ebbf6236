"""Parameter updates that survive low-precision (bfloat16) parameters: Kahan-compensated
sums or stochastic rounding, as the last optax transformation of the chain.

With parameters stored in bfloat16 (8 significant bits), `p + u` rounds every update
smaller than half a unit in the last place of `p` (2**-9 of |p|) away: late in training,
where AdamW's steps are small, the weights stop moving. Two known cures, both exact
where the parameters are float32 (the leaves are passed through untouched):

  "kahan"       a compensation buffer c (bfloat16, one per parameter) carries what
                the last rounding lost: y = u + c, t = round(p + y), c = y - (t - p)
                (Kahan summation; Zamirai et al. 2020, "Revisiting BFloat16 Training").
  "stochastic"  p + u rounded up or down at random with the probabilities that make
                the rounding unbiased in expectation (Gupta et al. 2015), from a key
                held in the optimizer state (a pure function of the step).

The transformation returns float32 updates t - p (exact: t and p are neighbouring
bfloat16 values), so `optax.apply_updates` lands on t.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

UPDATE_ROUNDINGS = ("nearest", "kahan", "stochastic")


def _low_precision(p) -> bool:
    return jnp.dtype(p.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


class KahanState(NamedTuple):
    compensation: Any   # per low-precision parameter, in its dtype; None for the rest


class StochasticState(NamedTuple):
    key: jnp.ndarray    # raw uint32 key
    count: jnp.ndarray  # int32, updates taken


def kahan_updates() -> optax.GradientTransformation:
    """Kahan-compensated application of the updates to low-precision parameters."""

    def init(params):
        return KahanState(jax.tree_util.tree_map(
            lambda p: jnp.zeros_like(p) if _low_precision(p) else None, params))

    def update(updates, state, params):
        if params is None:
            raise ValueError("kahan_updates needs the parameters (optax's params argument)")

        def one(u, c, p):
            if c is None:
                return u, None
            p32 = p.astype(jnp.float32)
            y = u.astype(jnp.float32) + c.astype(jnp.float32)
            t = (p32 + y).astype(p.dtype).astype(jnp.float32)
            return t - p32, (y - (t - p32)).astype(c.dtype)

        pairs = jax.tree_util.tree_map(one, updates, state.compensation, params,
                                       is_leaf=lambda x: x is None)
        is_pair = lambda x: isinstance(x, tuple)  # noqa: E731
        new_updates = jax.tree_util.tree_map(lambda x: x[0], pairs, is_leaf=is_pair)
        compensation = jax.tree_util.tree_map(lambda x: x[1], pairs, is_leaf=is_pair)
        return new_updates, KahanState(compensation)

    return optax.GradientTransformation(init, update)


def stochastic_round(x_f32: jnp.ndarray, key: jax.Array, dtype) -> jnp.ndarray:
    """float32 `x` to bfloat16, rounded up with probability (x - down) / (up - down)."""
    if jnp.dtype(dtype) != jnp.dtype(jnp.bfloat16):
        return x_f32.astype(dtype)  # float16: 10 significant bits, nearest
    bits = jax.lax.bitcast_convert_type(x_f32, jnp.uint32)
    noise = jax.random.bits(key, x_f32.shape, jnp.uint32) & jnp.uint32(0xFFFF)
    rounded = (bits + noise) & jnp.uint32(0xFFFF0000)
    finite = jnp.isfinite(x_f32)
    out = jax.lax.bitcast_convert_type(rounded, jnp.float32)
    return jnp.where(finite, out, x_f32).astype(dtype)  # exact: the low bits are zero


def stochastic_updates(seed: int = 0) -> optax.GradientTransformation:
    """Unbiased (stochastically rounded) application of the updates to bfloat16 parameters."""

    def init(params):
        del params
        return StochasticState(jax.random.key_data(jax.random.PRNGKey(seed)),
                               jnp.zeros((), jnp.int32))

    def update(updates, state, params):
        if params is None:
            raise ValueError("stochastic_updates needs the parameters (optax's params argument)")
        key = jax.random.fold_in(jax.random.wrap_key_data(state.key), state.count)
        leaves, treedef = jax.tree_util.tree_flatten(updates)
        p_leaves = treedef.flatten_up_to(params)
        out = []
        for i, (u, p) in enumerate(zip(leaves, p_leaves)):
            if not _low_precision(p):
                out.append(u)
                continue
            p32 = p.astype(jnp.float32)
            t = stochastic_round(p32 + u.astype(jnp.float32), jax.random.fold_in(key, i),
                                 p.dtype)
            out.append(t.astype(jnp.float32) - p32)
        return treedef.unflatten(out), StochasticState(state.key, state.count + 1)

    return optax.GradientTransformation(init, update)


def update_rounding(kind: str, seed: int = 0) -> optax.GradientTransformation:
    """The transformation of `TrainConfig.update_rounding`: "nearest" (optax's own
    `p + u`, rounded to nearest), "kahan" or "stochastic"."""
    if kind == "nearest":
        return optax.identity()
    if kind == "kahan":
        return kahan_updates()
    if kind == "stochastic":
        return stochastic_updates(seed)
    raise ValueError(f"update_rounding must be one of {UPDATE_ROUNDINGS}, got {kind!r}")

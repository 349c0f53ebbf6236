"""Cross-entropy over a large vocabulary in chunks of tokens: the (B, T, V) logits of the
whole batch never exist, neither forward nor backward (Liger's fused linear cross-entropy).

The loss is the last operation of the step, so its gradient is known while the loss is
computed: for each chunk of Tc positions the output projection runs once (`jax.vjp`),
the logits' gradient (softmax - target) * weight / tokens is formed at once and pulled
back through the projection, giving the chunk's hidden-state gradient and adding to
the projection's parameter gradient. Only (B, Tc, V) logits are alive at a time; the
backward pass scales the stored gradients by the loss's cotangent, with no recompute.

Transformations: reverse mode, and forward mode over it (`jax.jvp` of a gradient, e.g.
Hessian-vector products through a train step), equal the plain loss's (tested). Forward
mode of the loss value itself is not defined for a custom_vjp; the train step only takes
gradients, and the public loss (`loss.loss_and_metrics`, or `loss_chunk_tokens=0`) is
plain autodiff.

Shapes: hidden_BTD (B, T, D) are the final normed hidden states
(`DecoderOnlyLM(..., hidden=True)`), the chunks are cut along T (the batch axis stays
whole, so a batch split over devices stays split), T padded with weight-0 positions to
a multiple of Tc.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from jaxformer.decode.sampling import first_argmax

# Auto chunking: chunk when the batch's float32 logits would exceed AUTO_MIN_BYTES, in
# chunks whose logits hold about CHUNK_BYTES. A chunk's step holds about 4 such arrays
# (logits, their softmax gradient, the pieces of the reductions), so the loss's
# temporaries are ~128 MiB instead of ~2.5x the batch's logits (1 GB for SmolLM2 at
# 8 x 256); benchmarks/NOTES.md has the measurements (issue 44).
AUTO_MIN_BYTES = 64 * 2 ** 20
CHUNK_BYTES = 32 * 2 ** 20


def chunk_length(batch: int, length: int, vocab: int, chunk_tokens: Optional[int]) -> int:
    """Tc, the positions per chunk, or 0 for the plain loss.

    `chunk_tokens`: None = auto (chunk when the float32 logits of the batch exceed
    `AUTO_MIN_BYTES`, about `CHUNK_BYTES` of logits a chunk); 0 = off; n > 0 = about n
    tokens (B x Tc) a chunk. Tc is a divisor of T when one is close (no padding)."""
    if chunk_tokens == 0:
        return 0
    if chunk_tokens is None:
        if batch * length * vocab * 4 <= AUTO_MIN_BYTES:
            return 0
        chunk_tokens = max(1, CHUNK_BYTES // (vocab * 4))
    tc = max(1, min(length, chunk_tokens // batch))
    divisors = [d for d in range(tc, 0, -1) if length % d == 0]
    return divisors[0] if divisors[0] * 2 > tc else tc


def _target_terms(logits, labels, label_smoothing: float):
    """(logsumexp, the target's logit sum, argmax == label) per position:
    xent = lse - target_logit."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    label_logit = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    correct = first_argmax(logits) == labels  # not jnp.argmax: slow on XLA:CPU (5 % of a step)
    if label_smoothing:  # target (1 - a) one_hot + a / V
        label_logit = (1.0 - label_smoothing) * label_logit + \
            label_smoothing * logits.mean(-1)
    return lse, label_logit, correct


def _chunks(x, tc: int):
    """(B, T, ...) -> (T / Tc, B, Tc, ...), T already a multiple of Tc."""
    b, t = x.shape[:2]
    return jnp.moveaxis(x.reshape((b, t // tc, tc) + x.shape[2:]), 1, 0)


def _unchunk(x):
    """(T / Tc, B, Tc, ...) -> (B, T, ...)."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape((x.shape[0], x.shape[1] * x.shape[2]) + x.shape[3:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _chunked(project, tc, label_smoothing, project_grads, proj_params, hidden_BTD,
             labels_BT, weights_BT):
    loss, correct, _ = _forward(project, tc, label_smoothing, None, proj_params,
                                hidden_BTD, labels_BT, weights_BT)
    return loss, correct


def _forward(project, tc, label_smoothing, grads, proj_params, hidden_BTD, labels_BT,
             weights_BT):
    """(loss, accuracy, (d proj_params or None, d hidden or None)) for the loss's
    cotangent 1; `grads`: None (loss only), "hidden" or "all"."""
    denominator = jnp.maximum(weights_BT.sum(), 1.0)

    def chunk(carry, xs):
        total, correct, d_params = carry
        h, labels, weights = xs
        if grads == "all":
            logits, pull = jax.vjp(project, proj_params, h)
        elif grads == "hidden":
            logits, pull_h = jax.vjp(lambda x: project(proj_params, x), h)
        else:
            logits = project(proj_params, h)
        lse, target, hit = _target_terms(logits, labels, label_smoothing)
        total = total + ((lse - target) * weights).sum()
        correct = correct + (hit * weights).sum()
        if grads is None:
            return (total, correct, d_params), None
        one_hot = jax.nn.one_hot(labels, logits.shape[-1], dtype=logits.dtype)
        target_V = (1.0 - label_smoothing) * one_hot + label_smoothing / logits.shape[-1]
        d_logits = (jnp.exp(logits - lse[..., None]) - target_V) * \
            (weights / denominator)[..., None]
        if grads == "all":
            d_p, d_h = pull(d_logits)
            d_params = d_p if d_params is None else jax.tree_util.tree_map(jnp.add, d_params, d_p)
        else:
            (d_h,) = pull_h(d_logits)
        return (total, correct, d_params), d_h

    zero = jnp.zeros((), jnp.float32)
    xs = (_chunks(hidden_BTD, tc), _chunks(labels_BT, tc), _chunks(weights_BT, tc))
    if grads != "all":
        (total, correct, d_params), d_h = jax.lax.scan(chunk, (zero, zero, None), xs)
    else:
        # The first chunk's projection gradient starts the sum: no (V, D) zeros written
        # and added to (a 113 MB memset a step for SmolLM2, page faults included).
        carry, d_h0 = chunk((zero, zero, None), jax.tree_util.tree_map(lambda x: x[0], xs))
        rest = jax.tree_util.tree_map(lambda x: x[1:], xs)
        (total, correct, d_params), d_h = jax.lax.scan(chunk, carry, rest) \
            if xs[0].shape[0] > 1 else (carry, d_h0[None][:0])
        d_h = jnp.concatenate([d_h0[None], d_h])
    return total / denominator, correct / denominator, \
        (d_params, None if d_h is None else _unchunk(d_h))


def _fwd(project, tc, label_smoothing, project_grads, proj_params, hidden_BTD, labels_BT,
         weights_BT):
    loss, correct, grads = _forward(project, tc, label_smoothing,
                                    "all" if project_grads else "hidden", proj_params,
                                    hidden_BTD, labels_BT, weights_BT)
    return (loss, correct), (grads, proj_params)


def _bwd(project, tc, label_smoothing, project_grads, residuals, cotangents):
    (d_params, d_h), proj_params = residuals
    g = cotangents[0]
    d_h = (d_h * g).astype(d_h.dtype)
    if d_params is None:  # frozen projection: zero cotangents of its parameters
        d_params = jax.tree_util.tree_map(jnp.zeros_like, proj_params)
    else:
        d_params = jax.tree_util.tree_map(lambda d: (d * g).astype(d.dtype), d_params)
    return d_params, d_h, None, None


_chunked.defvjp(_fwd, _bwd)


def chunked_loss_and_metrics(project: Callable, proj_params: Any, hidden_BTD: jnp.ndarray,
                             labels_BT: jnp.ndarray, weights_BT: jnp.ndarray, tc: int, *,
                             label_smoothing: float = 0.0, project_grads: bool = True
                             ) -> tuple[jnp.ndarray, dict]:
    """`loss_and_metrics` of `project(proj_params, hidden_BTD)` logits, in chunks of Tc positions.

    `weights_BT`: float 0/1, every label that counts (PAD already masked); the mean is
    over their sum (at least 1). `project(proj_params, h_BcD)` -> float32 logits
    (B, Tc, V). `project_grads=False`: the projection is frozen (LoRA), only the
    hidden states get gradients (no (V, D) gradient is accumulated).
    Returns (loss, {"loss", "token_accuracy", "tokens"}).
    """
    t = hidden_BTD.shape[1]
    pad = -t % tc
    if pad:
        widths = [(0, 0), (0, pad)]
        hidden_BTD = jnp.pad(hidden_BTD, widths + [(0, 0)])
        labels_BT = jnp.pad(labels_BT, widths)
        weights_BT = jnp.pad(weights_BT, widths)
    labels_BT = labels_BT.astype(jnp.int32)
    weights_BT = weights_BT.astype(jnp.float32)
    if not project_grads:
        proj_params = jax.lax.stop_gradient(proj_params)
    loss, accuracy = _chunked(project, tc, float(label_smoothing), bool(project_grads),
                              proj_params, hidden_BTD, labels_BT, weights_BT)
    tokens = weights_BT.sum()
    return loss, {"loss": loss, "token_accuracy": jax.lax.stop_gradient(accuracy),
                  "tokens": tokens}

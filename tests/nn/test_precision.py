"""bfloat16 compute against the float32 computation on the same parameters, under
error bounds derived from bf16's precision.

bf16 keeps 8 significant bits: rounding a value x gives x(1 + d) with
|d| <= u = 2**-8. Inputs are bf16-representable here, so every error comes from
rounding inside the computation.

- Attention, elementwise (first-order analysis of `dot_product_attention`):
  the logits l = q.k / sqrt(K) come out of a bf16 dot, rounded: |dl| <= u |l|.
  Softmax (in f32) turns a logit error into a relative weight error of at most
  2 max|dl|; rounding the weights to bf16 adds u. The output o = sum w v then
  errs by at most (2u max_s|l| + u) sum_s w|v| from the weights, plus u|o|
  from its own rounding.
- A layer stack, the model, a train step, normwise: each bf16 rounding of an
  intermediate perturbs it by at most u relative, so to first order the
  result errs by at most u times the number of roundings on the longest path
  (`roundings`) through stages that do not amplify relative error (LayerNorm
  renormalises after every sublayer). Gradients run the path twice (forward
  and backward).
Each comparison also checks the error is not below u / 16: bf16 really ran.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxformer as jf
from jaxformer.train.tasks import Batch
from jaxformer.train import (loss_and_metrics, make_optimizer, make_train_step, TrainConfig,
                             TrainState)

from conftest import numpy_params

U = 2.0 ** -8  # bf16 unit roundoff

# bf16 roundings of intermediates on the longest path through each block.
EMBEDDING = 2   # the looked-up (scaled) embedding, + positions
ATTENTION = 7   # q/k/v projections, logits, weights, context, out projection, + residual, norm
FFN = 5         # first projection, activation, second projection, + residual, norm
OUTPUT = 1      # the logits' projection


def roundings(config, encoder=True, decoder=True) -> int:
    n = 0
    if encoder:
        n += EMBEDDING + config.num_encoder_layers * (ATTENTION + FFN)
    if decoder:
        n += EMBEDDING + config.num_decoder_layers * (2 * ATTENTION + FFN) + OUTPUT
    return n


def relative_error(got, want) -> float:
    got, want = (jax.tree_util.tree_leaves(t) for t in (got, want))
    diff = sum(float(jnp.sum((jnp.asarray(a, jnp.float32) - b) ** 2)) for a, b in zip(got, want))
    return (diff / sum(float(jnp.sum(jnp.square(b))) for b in want)) ** 0.5


def bf16_exact(shape, seed):
    x = np.random.default_rng(seed).normal(size=shape)
    return jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)


@pytest.mark.parametrize("masked", [False, True], ids=["full", "causal"])
def test_attention_error_is_within_the_elementwise_bound(masked):
    B, H, T, K = 4, 4, 12, 16
    q, k, v = (bf16_exact((B, H, T, K), seed) * scale for seed, scale in ((0, 2.0), (1, 1.0),
                                                                          (2, 1.0)))
    mask = jnp.tril(jnp.ones((T, T), bool))[None, None] if masked else None
    out32, w32 = jf.dot_product_attention(q, k, v, mask)
    out16, w16 = jf.dot_product_attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), mask)
    assert out16.dtype == w16.dtype == jnp.bfloat16
    logits = np.einsum("bhtk,bhsk->bhts", q, k) / np.sqrt(K)
    if masked:
        logits = np.where(np.asarray(mask), logits, 0.0)
    spread = 2 * U * np.abs(logits).max(-1, keepdims=True) + U
    bound = spread * np.einsum("bhts,bhsk->bhtk", np.asarray(w32), np.abs(v)) + U * np.abs(out32)
    error = np.abs(np.asarray(out16, np.float32) - np.asarray(out32))
    assert np.all(error <= bound), f"worst error / bound = {(error / bound).max():.2f}"
    assert relative_error(out16, out32) > U / 16


@pytest.fixture(scope="module", params=["post", "pre"])
def pair(request):
    """(f32 model, bf16 model, shared f32 params, src, tgt) for one norm placement."""
    config = jf.tiny(norm=request.param, num_encoder_layers=1, num_decoder_layers=1)
    f32, bf16 = jf.Transformer(config), jf.Transformer(config.replace(dtype="bfloat16"))
    r = np.random.default_rng(3)
    src = jnp.asarray(r.integers(3, 16, (8, 10)), jnp.int32)
    tgt = jnp.asarray(r.integers(3, 16, (8, 9)), jnp.int32)
    return f32, bf16, numpy_params(f32, src, tgt), src, tgt


def test_encoder_layers_within_the_bound(pair):
    f32, bf16, params, src, _ = pair
    want = jax.jit(lambda p: f32.apply({"params": p}, src, method=f32.encode))(params)
    got = jax.jit(lambda p: bf16.apply({"params": p}, src, method=bf16.encode))(params)
    assert got.dtype == jnp.bfloat16
    error = relative_error(got, want)
    assert U / 16 < error <= roundings(f32.config, decoder=False) * U, error / U


def test_model_logits_within_the_bound(pair):
    f32, bf16, params, src, tgt = pair
    want = jax.jit(lambda p: f32.apply({"params": p}, src, tgt))(params)
    got = jax.jit(lambda p: bf16.apply({"params": p}, src, tgt))(params)
    assert got.dtype == jnp.float32  # logits come back in float32
    error = relative_error(got, want)
    assert U / 16 < error <= roundings(f32.config) * U, error / U


def test_train_step_within_the_bound(pair):
    """Loss and gradients of the train step; params and optimizer state stay f32."""
    f32, bf16, params, src, tgt = pair
    labels = jnp.concatenate([tgt[:, 1:], jnp.full((tgt.shape[0], 1), 2)], axis=1)
    n = roundings(f32.config)

    def loss_fn(model):
        return lambda p: loss_and_metrics(model.apply({"params": p}, src, tgt), labels)[0]

    loss32, grads32 = jax.jit(jax.value_and_grad(loss_fn(f32)))(params)
    loss16, grads16 = jax.jit(jax.value_and_grad(loss_fn(bf16)))(params)
    assert U / 16 < relative_error(grads16, grads32) <= 2 * n * U
    assert relative_error(loss16, loss32) <= n * U
    # The jitted bf16 train step itself: its metrics within the same bounds of the f32
    # loss and gradients above, and f32 state after.
    tx = make_optimizer(TrainConfig(steps=10, warmup_steps=0))
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params,
                       opt_state=tx.init(params), rng=jax.random.PRNGKey(0))
    state = jax.tree_util.tree_map(jnp.array, state)  # own buffers: the step donates
    state16, m16 = make_train_step(bf16, tx)(state, Batch(src, tgt, labels))
    assert relative_error(m16["loss"], loss32) <= n * U
    assert relative_error(m16["grad_norm"], optax.tree.norm(grads32)) <= 2 * n * U
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(
        (state16.params, state16.opt_state)) if jnp.issubdtype(x.dtype, jnp.floating))

"""The chunked LM loss (`jaxformer.train.chunked_loss`, issue 44): the same loss, metrics and
gradients as the plain loss over the full logits, and a compiled train step whose
temporaries no longer hold the (B, T, V) logits."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxformer as jf
from jaxformer.train import TrainConfig, make_optimizer
from jaxformer.train.chunked_loss import chunk_length, chunked_loss_and_metrics
from jaxformer.train.data import LMBatch
from jaxformer.train.loss import (chunked_lm_loss, label_pad_id, loss_and_metrics,
                                  model_logits)
from jaxformer.train.state import init_train_state
from jaxformer.train.step import make_train_step

V = 512


def lm_config(**overrides):
    return jf.tiny(num_encoder_layers=0, num_decoder_layers=2, src_vocab_size=V,
                   tgt_vocab_size=V, max_len=32, norm="pre").replace(**overrides)


def lm_batch(b=2, t=12, seed=0):
    r = np.random.default_rng(seed)
    inputs = r.integers(3, V, (b, t)).astype(np.int32)
    labels = r.integers(3, V, (b, t)).astype(np.int32)
    labels[0, -2:] = 0  # PAD labels
    weights = np.ones((b, t), np.float32)
    weights[1, 3] = 0.0  # a label across a document boundary
    segments = np.ones((b, t), np.int32)
    segments[1, 4:] = 2
    positions = np.tile(np.arange(t, dtype=np.int32), (b, 1))
    positions[1, 4:] = np.arange(t - 4)
    return LMBatch(inputs=inputs, labels=labels, weights=weights, positions=positions,
                   segments=segments)


def plain_loss(model, params, batch, label_smoothing):
    logits, labels, weights = model_logits(model, params, batch)
    return loss_and_metrics(logits, labels, label_pad_id(model.config, weights),
                            label_smoothing, weights)


TIED = dict(tie_output_embedding=True, tied_output_bias=True)
OWN_KERNEL = dict(tie_output_embedding=False, output_bias=True, final_logit_softcapping=5.0)


@pytest.mark.parametrize("overrides, tc, smoothing", [
    (TIED, 5, 0.0), (OWN_KERNEL, 5, 0.1), (TIED, 12, 0.1)],
    ids=["tied_padded_chunks", "own_kernel_bias_softcap_smoothed", "tied_one_chunk_smoothed"])
def test_chunked_loss_and_gradients_equal_the_plain_loss(overrides, tc, smoothing):
    model = jf.DecoderOnlyLM(lm_config(**overrides))
    batch = lm_batch()
    params = model.init(jax.random.key(1), jnp.asarray(batch.inputs))["params"]
    (want, want_m), want_g = jax.value_and_grad(
        lambda p: plain_loss(model, p, batch, smoothing), has_aux=True)(params)
    (got, got_m), got_g = jax.jit(jax.value_and_grad(
        lambda p: chunked_lm_loss(model, p, batch, tc, label_smoothing=smoothing),
        has_aux=True))(params)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for k in ("token_accuracy", "tokens"):
        np.testing.assert_allclose(got_m[k], want_m[k], rtol=1e-6)
    jax.tree_util.tree_map_with_path(
        lambda path, g, w: np.testing.assert_allclose(
            g, w, rtol=2e-5, atol=2e-7, err_msg=jax.tree_util.keystr(path)), got_g, want_g)
    assert all(np.abs(g).max() > 0 for g in jax.tree_util.tree_leaves(got_g))


def test_a_frozen_projection_gets_zero_gradients_and_the_rest_the_plain_ones():
    model = jf.DecoderOnlyLM(lm_config(**TIED))
    batch = lm_batch()
    params = model.init(jax.random.key(1), jnp.asarray(batch.inputs))["params"]
    want = jax.grad(lambda p: plain_loss(model, p, batch, 0.0)[0])(params)
    got = jax.grad(lambda p: chunked_lm_loss(model, p, batch, 4, project_grads=False)[0]
                   )(params)
    np.testing.assert_allclose(got["decoder"]["layers_1"]["ffn"]["wo"]["kernel"],
                               want["decoder"]["layers_1"]["ffn"]["wo"]["kernel"],
                               rtol=2e-5, atol=2e-7)
    # The tied embedding's gradient is the input lookup's alone (the projection's part left out).
    diff = np.abs(got["embed"]["embedding"] - want["embed"]["embedding"]).max()
    assert diff > 0.1 * np.abs(want["embed"]["embedding"]).max()


def test_chunk_length_auto_off_and_divisors():
    assert chunk_length(8, 256, 49152, None) == 16    # SmolLM2, 8 x 256: 16 chunks of 8 x 16
    assert chunk_length(8, 256, 259, None) == 0       # byte vocabulary: logits are small
    assert chunk_length(8, 256, 49152, 0) == 0        # off
    assert chunk_length(2, 14, 512, 10) == 5          # no divisor of 14 near 5: padded
    assert chunk_length(2, 12, 512, 8) == 4


def step_temp_bytes(model, batch, loss_chunk_tokens):
    tc = TrainConfig(steps=2, warmup_steps=0)
    tx = make_optimizer(tc)
    state = jax.eval_shape(lambda: init_train_state(model, tx, (batch.inputs.shape,), 0))
    step = make_train_step(model, tx, loss_chunk_tokens=loss_chunk_tokens)
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    return step.lower(state, abstract).compile().memory_analysis().temp_size_in_bytes


def test_the_chunked_train_step_holds_no_full_logits():
    """Vocabulary 8192, 4 x 64 tokens: the f32 logits are 8 MiB; the plain step's
    temporaries hold them (and their gradient: 21 MiB in all), the chunked step's a
    few chunks' logits (4 x 2 x 8192 floats) and the rest (6 MiB)."""
    model = jf.DecoderOnlyLM(lm_config(tgt_vocab_size=8192, src_vocab_size=8192, max_len=64))
    batch = lm_batch(b=4, t=64)
    plain = step_temp_bytes(model, batch, 0)
    chunked = step_temp_bytes(model, batch, 8)
    logits_bytes = 4 * 64 * 8192 * 4
    assert plain > 2 * logits_bytes
    assert chunked < plain - 1.5 * logits_bytes, (plain, chunked)


def test_train_config_refuses_a_bad_chunk():
    assert TrainConfig(loss_chunk_tokens=0).loss_chunk_tokens == 0
    with pytest.raises(ValueError, match="loss_chunk_tokens must be None"):
        TrainConfig(loss_chunk_tokens=-3)


# --------------------------------------------------------------------------- evaluation


def test_lm_evaluation_compiles_once_and_chunks_to_the_same_figures(tmp_path, monkeypatch):
    """7 held-out windows in batches of 3: the ragged last batch is padded, so the step is
    traced once; the chunked cross-entropy gives the plain figures."""
    from jaxformer.text import ByteTokenizer
    from jaxformer.train import evaluate_lm, evaluation
    from jaxformer.train.data import TextData

    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 3)
    data = TextData(None, ByteTokenizer(), 20, eval_patterns=[str(tmp_path / "a.txt")])
    assert data.num_eval_windows == 7
    config = lm_config(src_vocab_size=259, tgt_vocab_size=259, d_ff=72)  # a config of its own
    model = jf.DecoderOnlyLM(config)
    params = model.init(jax.random.key(0), jnp.zeros((1, 20), jnp.int32))["params"]
    traces = []
    plain_logits = evaluation.model_logits
    monkeypatch.setattr(evaluation, "model_logits",
                        lambda *a, **k: traces.append(1) or plain_logits(*a, **k))
    plain = evaluate_lm(model, params, data, batch_size=3, loss_chunk_tokens=0)
    assert len(traces) == 1
    chunked = evaluate_lm(model, params, data, batch_size=3, loss_chunk_tokens=6)
    assert len(traces) == 1  # the chunked step projects the hidden states itself
    assert plain["tokens"] == chunked["tokens"] > 6 * 20
    np.testing.assert_allclose(chunked["loss"], plain["loss"], rtol=1e-6)
    np.testing.assert_allclose(chunked["bits_per_byte"], plain["bits_per_byte"], rtol=1e-6)


@pytest.mark.parametrize("overrides", [TIED, dict(TIED, lora_rank=4, lora_targets=("q", "v"))],
                         ids=["full", "lora"])
def test_a_chunked_train_step_equals_the_plain_one(overrides):
    """The jitted train step (dropout on; LoRA: adapters only) with and without chunks:
    the same metrics and the same new parameters (SGD, so that the parameters move by
    the gradients: Adam's first step, g / |g|, would blow rounding up wherever a
    gradient is near 0)."""
    model = jf.DecoderOnlyLM(lm_config(**overrides, residual_dropout=0.1))
    batch = lm_batch()
    tx = optax.sgd(1.0)
    init = jax.jit(lambda: init_train_state(model, tx, (batch.inputs.shape,), 0))
    plain, plain_m = make_train_step(model, tx, loss_chunk_tokens=0)(init(), batch)
    chunked, chunked_m = make_train_step(model, tx, loss_chunk_tokens=10)(init(), batch)
    for k in ("loss", "token_accuracy", "grad_norm"):
        np.testing.assert_allclose(chunked_m[k], plain_m[k], rtol=1e-5)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                           chunked.params, plain.params)
    before = init().params
    moved = jax.tree_util.tree_map(lambda a, b: bool(np.any(a != b)), plain.params, before)
    assert sum(jax.tree_util.tree_leaves(moved)) >= (2 if overrides.get("lora_rank") else 10)


def test_forward_over_reverse_through_the_chunked_loss_equals_the_plain_loss():
    """The chunked loss is a custom_vjp (reverse mode only), yet what a user differentiates
    forward through a train step, its gradient, stays forward-differentiable: the
    Hessian-vector product (jvp of grad) equals the plain loss's. The loss itself under
    jvp is the plain loss's job (`loss_and_metrics`, or `loss_chunk_tokens=0`)."""
    model = jf.DecoderOnlyLM(lm_config(**TIED))
    batch = lm_batch()
    params = model.init(jax.random.key(1), jnp.asarray(batch.inputs))["params"]
    leaves, tree = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    tangent = tree.unflatten([jax.random.normal(k, p.shape, p.dtype)
                              for k, p in zip(keys, leaves)])

    def hvp(loss):
        grad = jax.grad(lambda p: loss(p)[0])
        return jax.jvp(grad, (params,), (tangent,))[1]

    want = hvp(lambda p: plain_loss(model, p, batch, 0.0))
    got = hvp(lambda p: chunked_lm_loss(model, p, batch, 5))
    scale = max(float(jnp.abs(w).max()) for w in jax.tree_util.tree_leaves(want))
    assert scale > 0.1  # a curvature worth comparing
    for w, g in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got)):
        np.testing.assert_allclose(g, w, atol=2e-5 * scale)


def test_chunked_accuracy_is_argmax_among_ties_and_infinities():
    """token_accuracy counts argmax == label, argmax the first of tied maxima: the chunked
    loss finds it without jnp.argmax's (value, index) reduction, slow on XLA:CPU. Every
    (row, label) pair of these logits alone, against numpy's argmax."""
    logits = np.array([[0.0, 0.0, 0.0, 0.0, 0.0, 0.0],        # all tied: argmax 0
                       [1.0, 3.0, 3.0, -1.0, 3.0, 0.0],       # tied at 1, 2, 4
                       [-np.inf] * 6,                          # all -inf: argmax 0
                       [0.0, np.inf, 2.0, np.inf, 1.0, 0.0],  # +inf at 1 and 3
                       [0.5, -2.0, 0.25, 4.0, 1.0, 4.5]], np.float32)  # a plain maximum

    def project(table, h_BcD):  # h holds a row number: that row's logits
        return jnp.take(table, h_BcD[..., 0].astype(jnp.int32), axis=0)

    @jax.jit
    def accuracy(row, label):
        return chunked_loss_and_metrics(
            project, jnp.asarray(logits), jnp.full((1, 1, 1), row, jnp.float32),
            jnp.full((1, 1), label, jnp.int32), jnp.ones((1, 1), jnp.float32), 1,
            project_grads=False)[1]["token_accuracy"]

    got = [[float(accuracy(r, v)) for v in range(logits.shape[1])] for r in range(len(logits))]
    want = (logits.argmax(-1)[:, None] == np.arange(logits.shape[1])).astype(float)
    np.testing.assert_array_equal(got, want)

"""attention_impl="blockwise" in the encoder-decoder `Transformer`: its default masks
(encoder key padding, decoder causal + padding, cross-attention source padding) are
MaskSpecs, so every attention runs blockwise; logits, loss and gradients equal the dense
"einsum" path on ragged, padded sources and targets, and no (T, S) mask is built."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.train import loss_and_metrics

# Lengths above the default 256 blocks (two key blocks, the second padded), different
# for source and target, so a (T, S) array would show in the program text.
S, T = 300, 280
SRC_LENGTHS, TGT_LENGTHS = (300, 170), (280, 200)
# Encoder and decoder each a local (window 70) and a global layer; 2 kv heads for 4.
CONFIG = jf.tiny(max_len=S, num_kv_heads=2, sliding_window=70, attention_pattern="LG",
                 rope="half", encoder_positions="none", decoder_positions="none")


def padded(seed, lengths, width):
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, CONFIG.src_vocab_size, (len(lengths), width)).astype(np.int32)
    ids[np.arange(width)[None, :] >= np.asarray(lengths)[:, None]] = CONFIG.pad_id
    return jnp.asarray(ids)


SRC, TGT_IN, LABELS = padded(0, SRC_LENGTHS, S), padded(1, TGT_LENGTHS, T), padded(2,
                                                                                   TGT_LENGTHS, T)


def run(impl, params):
    """((loss, logits), grads) of the jitted step, and whether the program text holds an
    array with a (T, S), (S, S) or (T, T) trailing pair of axes."""
    model = jf.Transformer(CONFIG.replace(attention_impl=impl))

    def loss(p):
        logits = model.apply({"params": p}, SRC, TGT_IN)
        # PAD rows 270.. of row 1 see no key in the local layer's window: dense gives
        # them uniform weights, blockwise zeros (both finite, neither in the loss).
        visible = (TGT_IN != CONFIG.pad_id)[..., None]
        return loss_and_metrics(logits, LABELS, pad_id=CONFIG.pad_id)[0], logits * visible

    lowered = jax.jit(jax.value_and_grad(loss, has_aux=True)).lower(params)
    text = lowered.as_text()
    quadratic = any(f"{q}x{k}x" in text for q, k in ((T, S), (S, S), (T, T)))
    return lowered.compile()(params), quadratic


@pytest.fixture(scope="module")
def params():
    return jax.jit(jf.Transformer(CONFIG).init)(jax.random.PRNGKey(0), SRC[:, :8],
                                                TGT_IN[:, :8])["params"]


def test_blockwise_encoder_decoder_equals_einsum_forward_and_gradients(params):
    ((loss_e, logits_e), grads_e), dense_quadratic = run("einsum", params)
    ((loss_b, logits_b), grads_b), blockwise_quadratic = run("blockwise", params)
    assert dense_quadratic and not blockwise_quadratic
    np.testing.assert_allclose(logits_b, logits_e, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(loss_b, loss_e, rtol=1e-6)
    for g_b, g_e in zip(jax.tree_util.tree_leaves(grads_b), jax.tree_util.tree_leaves(grads_e)):
        np.testing.assert_allclose(g_b, g_e, atol=2e-5, rtol=1e-4)

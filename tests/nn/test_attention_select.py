"""choose_attention_impl: its cuDNN rule agrees with what jax lowers for CUDA (on this CPU,
with `lowering_platforms`); lengths and mask kinds pick blockwise or dense."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.nn.attention_select import (BLOCKWISE_MIN_LENGTH, GPU_BLOCKWISE_MIN_LENGTH,
                                           choose_attention_impl, jax_nn_mask_arguments)
from jaxformer.nn.mask_structure import MaskSpec

B, T, H = 2, 64, 4
LENGTHS = np.array([64, 40], np.int32)


@pytest.fixture
def cudnn_for_lowering(monkeypatch):
    """jax checks the installed cuDNN's version before lowering a cuDNN call; this CPU
    machine has none, so the check is given a version (9.10). Lowering itself needs no
    GPU. Skipped if jax's internals moved."""
    try:
        fused = importlib.import_module("jax._src.cudnn.fused_attention_stablehlo")
    except ImportError:
        pytest.skip("jax's cuDNN attention module moved")
    if not hasattr(fused, "cuda_versions"):
        pytest.skip("jax's cuDNN version check moved")

    class Versions:
        @staticmethod
        def cudnn_get_version():
            return 91000

    monkeypatch.setattr(fused, "cuda_versions", Versions)


def _cuda_hlo(head_dim, dtype, mask, grad=False):
    """StableHLO text of a cuDNN call lowered for CUDA, or None if jax refuses it."""
    arguments = jax_nn_mask_arguments(mask)
    if arguments is None and mask.window is not None and not mask.causal:
        # Ask jax itself: a window on both sides (its symmetric local_window_size).
        arguments = dict(local_window_size=(mask.window - 1, mask.window - 1))
    elif arguments is None:
        return None  # parts jax.nn has no argument for
    lengths = {k: arguments.pop(k) for k in ("query_seq_lengths", "key_value_seq_lengths")
               if k in arguments}
    x = jnp.zeros((B, T, H, head_dim), dtype)

    def attend(q, k, v, lengths):
        return jax.nn.dot_product_attention(q, k, v, implementation="cudnn", **arguments,
                                            **lengths)

    f = (jax.grad(lambda *a: attend(*a).astype(jnp.float32).sum(), (0, 1, 2)) if grad
         else attend)
    try:
        return jax.jit(f).trace(x, x, x, lengths).lower(lowering_platforms=("cuda",)).as_text()
    except (NotImplementedError, ValueError):
        return None


MASKS = {
    "none": None,
    "causal": MaskSpec(causal=True),
    "causal_window_lengths": MaskSpec(causal=True, window=16, kv_lengths=LENGTHS,
                                      q_lengths=LENGTHS),
    "segments": MaskSpec(causal=True, q_segment_ids=jnp.zeros((B, T), jnp.int32),
                         kv_segment_ids=jnp.zeros((B, T), jnp.int32)),
    "two_sided_window": MaskSpec(window=8),
}


@pytest.mark.parametrize("head_dim,dtype,mask", [
    (64, jnp.bfloat16, "causal_window_lengths"), (128, jnp.float16, "none"),
    (64, jnp.float32, "causal"), (100, jnp.bfloat16, "causal"), (64, jnp.bfloat16, "segments"),
    (64, jnp.bfloat16, "two_sided_window")])
def test_cudnn_is_chosen_exactly_where_jax_lowers_it(cudnn_for_lowering, head_dim, dtype, mask):
    choice = choose_attention_impl("cuda", head_dim, dtype, MASKS[mask], 4096)
    hlo = _cuda_hlo(head_dim, dtype, MASKS[mask])
    lowered = hlo is not None and "__cudnn$fmha" in hlo
    assert (choice == "cudnn") == lowered, (choice, lowered)
    if choice != "cudnn":
        assert choice == "blockwise"  # long: the fallback is the linear-memory path


@pytest.mark.parametrize("mask", ["causal_window_lengths", "segments"])
def test_cudnn_training_step_lowers_to_fused_forward_and_backward(cudnn_for_lowering, mask):
    hlo = _cuda_hlo(64, jnp.bfloat16, MASKS[mask], grad=True)
    # segments: `__cudnn$fmhaScaleBiasSoftmax` (the mask as a bias) and its backward
    assert "__cudnn$fmha" in hlo and "SoftmaxBackward(" in hlo


def test_length_picks_blockwise_or_dense_where_no_fused_kernel_takes_the_call():
    causal = MASKS["causal"]
    for platform, threshold in (("cpu", BLOCKWISE_MIN_LENGTH), ("tpu", BLOCKWISE_MIN_LENGTH),
                                ("cuda", GPU_BLOCKWISE_MIN_LENGTH)):
        # float32: no cuDNN on GPU either; head dim 64: no splash on TPU
        assert choose_attention_impl(platform, 64, jnp.float32, causal,
                                     threshold) == "blockwise"
        assert choose_attention_impl(platform, 64, jnp.float32, causal,
                                     threshold - 1) == "dense"
    # A packed batch's segment ids reach cuDNN as a (B, 1, T, S) mask up to 4096 x 4096;
    # beyond, blockwise (the mask would grow quadratically); blockwise on a CPU.
    def packed(n):
        ids = jnp.ones((1, n), jnp.int32)
        return MaskSpec(causal=True, q_segment_ids=ids, kv_segment_ids=ids)

    assert choose_attention_impl("cuda", 64, jnp.bfloat16, packed(2048), 2048) == "cudnn"
    assert choose_attention_impl("cuda", 64, jnp.bfloat16, packed(8192), 8192) == "blockwise"
    assert choose_attention_impl("cuda", 64, jnp.float32, packed(2048), 2048) == "dense"
    assert choose_attention_impl("cpu", 64, jnp.bfloat16, packed(2048), 2048) == "blockwise"
    dense_mask = jnp.ones((1, 1, 8192, 8192), bool)  # an arbitrary pattern: dense only
    assert choose_attention_impl("cuda", 64, jnp.bfloat16, dense_mask, 8192) == "dense"

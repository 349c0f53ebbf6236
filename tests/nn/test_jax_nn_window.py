"""The window handed to `jax.nn.dot_product_attention` (cuDNN's fused kernel on GPU) is the
window the einsum path applies: a query at t sees keys t - window < s <= t
(`local_window_size=(window - 1, 0)`), no more, no fewer.

On CPU, jax's own "xla" implementation of the same call reads the same arguments, so the
keys it sees can be checked here: the arguments from `jax_nn_mask_arguments` against the
dense mask of the same MaskSpec, and a model traced for CUDA (`target_platform`) whose
cuDNN calls are run by the xla implementation against the einsum model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.nn.attention import dot_product_attention
from jaxformer.nn.attention_select import jax_nn_mask_arguments, target_platform
from jaxformer.nn.mask_structure import MaskSpec, dense_mask

B, T, H, K = 2, 9, 2, 8
LENGTHS = np.array([9, 6], np.int32)
SEGMENTS = jnp.asarray([[0, 0, 0, 1, 1, 1, 1, 2, 2], [0, 0, 0, 0, 0, 1, 1, 1, 1]], jnp.int32)


@pytest.mark.parametrize("spec", [
    MaskSpec(causal=True, window=1), MaskSpec(causal=True, window=3),
    MaskSpec(causal=True, window=4, kv_lengths=LENGTHS, q_lengths=LENGTHS),
    MaskSpec(causal=True, window=T + 5),
    MaskSpec(causal=True, q_segment_ids=SEGMENTS, kv_segment_ids=SEGMENTS),
    MaskSpec(causal=True, window=2, q_segment_ids=SEGMENTS, kv_segment_ids=SEGMENTS)],
    ids=["window_1", "window_3", "window_4_lengths", "window_beyond_T", "segments",
         "segments_window_2"])
def test_jax_nn_arguments_see_the_keys_of_the_dense_mask(spec):
    q, k, v = (np.random.default_rng(i).normal(size=(B, T, H, K)).astype(np.float32)
               for i in range(3))
    args = jax_nn_mask_arguments(spec)
    got = jax.nn.dot_product_attention(q, k, v, implementation="xla", **args)
    heads_major = lambda x: jnp.swapaxes(jnp.asarray(x), 1, 2)  # noqa: E731
    want, _ = dot_product_attention(heads_major(q), heads_major(k), heads_major(v),
                                    dense_mask(spec, T, T))
    rows = LENGTHS if spec.q_lengths is not None else [T] * B  # padded queries: any value
    for b, n in enumerate(rows):
        np.testing.assert_allclose(np.asarray(got)[b, :n], np.asarray(heads_major(want))[b, :n],
                                   rtol=1e-5, atol=1e-5)


def test_window_is_w_minus_1_keys_back_and_none_ahead():
    assert jax_nn_mask_arguments(MaskSpec(causal=True, window=3))["local_window_size"] == (2, 0)


def test_a_model_traced_for_cuda_sees_the_einsum_models_window(make_lm, monkeypatch):
    config = jf.llama(num_decoder_layers=2, sliding_window=3, attention_pattern="LG",
                      attention_impl="auto", precision="mixed", max_len=16)
    model, params = make_lm(config, seed=5)
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 16, (2, 10)), jnp.int32)
    calls, original = [], jax.nn.dot_product_attention

    def cudnn_on_cpu(*args, implementation=None, **kwargs):  # the call as made, run by xla
        calls.append((implementation, kwargs.get("local_window_size")))
        return original(*args, implementation="xla" if implementation == "cudnn"
                        else implementation, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", cudnn_on_cpu)
    with target_platform("cuda"):
        got = jax.jit(lambda p, t: model.apply({"params": p}, t, MaskSpec(causal=True)))(
            params, tokens)
    assert calls == [("cudnn", (2, 0)), ("cudnn", None)]  # the local layer, the global one

    def einsum_logits(window):
        other = jf.DecoderOnlyLM(config.replace(attention_impl="einsum", sliding_window=window))
        return np.asarray(jax.jit(other.apply)({"params": params}, tokens, jf.causal_mask(10)))

    want = einsum_logits(3)
    error = np.abs(np.asarray(got) - want).max()
    # bfloat16 rounding differs between the two paths; a window one key wider is far off.
    assert error < 0.02 * np.abs(want).max()
    assert np.abs(einsum_logits(4) - want).max() > 4 * error

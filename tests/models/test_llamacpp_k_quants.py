"""A Q4_K_M file made by llama.cpp, kept as it is, against llama.cpp's own logits.

tests/data/tiny_q4_k_m.gguf is a random 4-layer llama (every kernel input a multiple of
256) that llama.cpp's `llama_model_quantize` turned into Q4_K_M: Q4_K kernels, Q6_K
value and down projections of layers 2 and 3 and the tied table.
tests/data/llamacpp_tiny_q4_k_m_logits.npz holds llama.cpp's logits at every position
of three id sequences; tests/data/make_tiny_q4_k_m.py made both (llama.cpp is not
needed here).

Kept (`quantize="keep"`), every tensor stays in its own type's layout and the model
computes the file's dequantized float model to float rounding (1e-5 of the largest logit). Against llama.cpp, which
rounds the activations to 8 bits (Q8_K blocks) for its K-quant dot products, the
measured difference is 5.9 % of a row's largest logit at most and 2.6 % at the
median, the argmax equal at every position; the bounds are 1.6x those.
"""

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.backends import cpu, qmatmul
from jaxformer.nn.quant_params import param_bytes

pytest.importorskip("gguf", reason="needs the `llm` extra: pip install 'jaxformer[llm]'")

DATA = os.path.join(os.path.dirname(__file__), "..", "data")
LARGEST, MEDIAN = 0.095, 0.041


@pytest.fixture(scope="module")
def files():
    from jaxformer.models import load  # noqa: PLC0415

    path = os.path.join(DATA, "tiny_q4_k_m.gguf")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every type is kept exactly: no conversion warned
        kept = load(path, quantize="keep")[:2]
    data = np.load(os.path.join(DATA, "llamacpp_tiny_q4_k_m_logits.npz"))
    prompts = np.split(data["prompt_ids"], np.cumsum(data["prompt_lengths"])[:-1])
    batch = np.zeros((len(prompts), max(map(len, prompts))), np.int32)
    for row, ids in enumerate(prompts):
        batch[row, :len(ids)] = ids  # right padding: causal, earlier positions unchanged
    return kept, load(path)[:2], jnp.asarray(batch), prompts, data["logits"]


def rows(logits, prompts):
    return np.concatenate([np.asarray(logits)[r, :len(ids)] for r, ids in enumerate(prompts)])


def forward(model):
    return jax.jit(lambda p, t: model.apply({"params": p}, t))


def test_each_tensor_keeps_its_type_and_the_model_is_the_files(files):
    (model, params), (float_model, floats), batch, prompts, _ = files
    config = model.config
    assert (config.weight_quant, config.embed_quant) == ("q4_k", "q6_k")
    assert sorted(config.quant_layouts) == sorted(
        (f"decoder/layers_{i}/{kernel}", "q6_k") for i in (2, 3)
        for kernel in ("self_attn/value", "ffn/wo"))
    want = forward(float_model)(floats, batch)  # XLA may fuse the dequantization: rounding
    np.testing.assert_allclose(forward(model)(params, batch), want, rtol=0,
                               atol=1e-5 * float(jnp.abs(want).max()))
    assert param_bytes(params) < 0.2 * param_bytes(floats)
    compiled = forward(model).lower(params, batch).compile()  # no float copy passed in
    assert compiled.memory_analysis().argument_size_in_bytes == param_bytes(params) + batch.nbytes


def check_against_llama_cpp(logits, prompts, want):
    got = rows(logits, prompts)
    relative = np.abs(got - want).max(-1) / np.abs(want).max(-1)
    assert relative.max() < LARGEST and np.median(relative) < MEDIAN, relative
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


def test_kept_logits_are_llama_cpps_within_its_activation_rounding(files):
    (model, params), _, batch, prompts, want = files
    check_against_llama_cpp(forward(model)(params, batch), prompts, want)


def test_the_tuned_cpu_kernel_gives_the_same_logits(files, monkeypatch):
    """The opt-in kernel (kernels/kquant.cc) reads the kept Q4_K and Q6_K kernels: the
    untuned logits to float rounding, so llama.cpp's within the same bounds."""
    assert qmatmul.library() is not None, "the kernel did not build (g++ is on CI)"
    (model, params), _, batch, prompts, want = files
    plain = forward(model)(params, batch)
    monkeypatch.setattr(cpu, "process_tuned", lambda: True)
    tuned = forward(jf.DecoderOnlyLM(model.config))
    assert "jaxformer_qmatmul_q6_k" in tuned.trace(params, batch).lower().as_text()
    got = tuned(params, batch)
    np.testing.assert_allclose(got, plain, rtol=0, atol=2e-5 * float(jnp.abs(plain).max()))
    check_against_llama_cpp(got, prompts, want)


def test_greedy_tokens_of_the_kept_model_are_the_float_models(files):
    (model, params), (float_model, floats), batch, _, _ = files
    prompt = batch[:, :5]
    kept = jf.generate(model, params, prompt, max_new_tokens=8)
    plain = jf.generate(float_model, floats, prompt, max_new_tokens=8)
    np.testing.assert_array_equal(kept.tokens, plain.tokens)

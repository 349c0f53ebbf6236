"""SmolLM2-135M-Instruct's GGUF file (Q4_1 layers, a Q8_0 token table) kept quantized:
`load(path, quantize="keep")` holds the file's blocks, computes the float model's logits,
decodes as it does, and weighs under 0.3x the float32 tree."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.nn.quant_params import param_bytes
from tests.tolerances import is_near_tie

pytest.importorskip("gguf", reason="needs the `llm` extra: pip install 'jaxformer[llm]'")


@pytest.fixture(scope="module")
def kept(smollm2):
    from jaxformer.models import load  # noqa: PLC0415

    path = smollm2[3]
    model, params, _ = load(path, max_len=256, quantize="keep")
    return model, params


def test_the_file_is_kept_as_q4_1_layers_and_a_q8_0_table(kept, smollm2):
    from jaxformer.interop.gguf import read_gguf  # noqa: PLC0415

    model, params = kept
    assert (model.config.weight_quant, model.config.embed_quant) == ("int4", "int8_block")
    query = params["decoder"]["layers_0"]["self_attn"]["query"]
    assert query["kernel_q"].dtype == jnp.uint8 and query["kernel_q"].shape == (288, 9, 64)
    file = read_gguf(smollm2[3])
    float32_bytes = 4 * sum(math.prod(file.shape(n)) for n in file.tensors)
    ratio = param_bytes(params) / float32_bytes
    assert ratio <= 0.3, ratio  # 0.18: 96.6 MB of 538 MB
    assert param_bytes(smollm2[1]) == float32_bytes  # the float tree: 538 MB


def test_kept_model_computes_the_float_models_logits(kept, smollm2):
    model, params = kept
    float_model, floats, tokenizer, _ = smollm2
    ids = jnp.asarray([tokenizer.encode("The capital of France is").ids])
    got = jax.jit(lambda p, t: model.apply({"params": p}, t))(params, ids)
    want = jax.jit(lambda p, t: float_model.apply({"params": p}, t))(floats, ids)
    np.testing.assert_allclose(got, want, atol=1e-4 * float(jnp.abs(want).max()), rtol=0)


def test_the_tuned_cpu_kernel_computes_the_kept_models_logits(kept, smollm2, monkeypatch):
    """A tuned process (`cpu.tune_process()`; here its flag patched, JAX having started)
    calls `backends.qmatmul`'s C++ kernel for the Q4_1 layers and the tied Q8_0 table:
    the logits are the plain path's within float rounding and 32 greedy tokens the
    same; where the kernel takes integer dot products (AVX2: x rounded per block to
    int8, as llama.cpp does) each position's logits are within 8% of its largest, and
    5% at the median position (measured 5.6% / 3.7%; 12.2% / 5.2% when the offset term
    took x's float block sum, kernels/qdot.h; llama.cpp's own differ from the float
    path's by up to 5.6%, benchmarks/NOTES.md), and the 32 greedy tokens agree up to a
    near tie of the plain path's logits, if any (a pair within twice the 5% median of
    each other: on one Xeon none, on an AMD EPYC one at the 6th token, 1.4% apart;
    with the float block sum the tokens parted after 12, at no near tie)."""
    from jaxformer.backends import cpu, qmatmul  # noqa: PLC0415

    model, params = kept
    ids = jnp.asarray([smollm2[2].encode("The capital of France is").ids])

    def run():
        logits = jax.jit(lambda p, t: model.apply({"params": p}, t))(params, ids)
        return logits, jf.generate(model, params, ids, max_new_tokens=32).tokens

    want, want_tokens = run()
    forward = jax.jit(lambda p, t: model.apply({"params": p}, t))  # the plain path's logits
    forced = np.asarray(forward(params, jnp.concatenate([ids, want_tokens], axis=1)))[0]
    jax.clear_caches()  # the decode loop's programs would reuse the untuned traces
    monkeypatch.setattr(cpu, "process_tuned", lambda: True)
    assert qmatmul.enabled()
    tuned = jax.jit(lambda p, t: model.apply({"params": p}, t))
    text = tuned.trace(params, ids).lower().as_text()
    assert "@jaxformer_qmatmul_int4(" in text and "@jaxformer_qmatmul_int8_block(" in text
    got, tokens = run()
    integer = qmatmul.integer_dot("int4", False, 32)
    if integer:  # (T,) each position's largest difference over its largest logit
        relative = np.abs(got - want).max(-1)[0] / np.abs(want).max(-1)[0]
        assert relative.max() < 0.08 and np.median(relative) < 0.05, relative
    else:
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(jnp.abs(want).max()))
    agree = int(np.argmin(np.append(tokens[0] == want_tokens[0], False)))  # first parting
    if agree < tokens.shape[1]:
        assert is_near_tie(forced[ids.shape[1] - 1 + agree], int(want_tokens[0, agree]),
                           int(tokens[0, agree]), 2 * 0.05), (agree, tokens, want_tokens)


def test_cli_generate_quantize_keep(kept, smollm2, monkeypatch, capsys):
    """`jaxformer generate --model FILE --quantize keep`: the flag reaches `models.load`
    (patched to return the module's kept load) and the kept model's cached greedy decode
    continues as the float model does (docs/pretrained.md: " Paris.")."""
    import json

    import jaxformer.models
    from jaxformer.cli.main import main

    asked = []
    monkeypatch.setattr(jaxformer.models, "load", lambda p, quantize: asked.append(quantize)
                        or (kept[0], kept[1], smollm2[2]))
    assert main(["generate", "--model", smollm2[3], "--quantize", "keep", "--json",
                 "--max-new-tokens", "4", "The capital of France is"]) == 0
    assert asked == ["keep"]
    assert json.loads(capsys.readouterr().out)["text"].startswith(" Paris.")


def test_int8_kv_cache_keeps_the_greedy_tokens(kept, smollm2):
    """The kept model with an int8 KV cache (`kv_cache_quant`) decodes the float cache's 32
    greedy tokens for test_smollm2.py's prompts but its "def fibonacci(n):" one, which
    diverges at step 6 on a near tie (8 vs 7 spaces: the float top-2 gap is 0.012)."""
    import jaxformer as jf

    model, params = kept
    tokenizer = smollm2[2]
    prompts = ["The capital of France is",
               "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n",
               "Once upon a time, in a small village by the sea, there lived an old "
               "fisherman who", "JAX is"]
    ids = [tokenizer.encode(p).ids for p in prompts]
    lengths = np.array([len(i) for i in ids])
    batch = np.full((len(ids), lengths.max()), model.config.pad_id, np.int32)
    for row, i in enumerate(ids):
        batch[row, :len(i)] = i
    runs = [jf.generate(jf.DecoderOnlyLM(model.config.replace(kv_cache_quant=kv)), params,
                        jnp.asarray(batch), max_new_tokens=32, prompt_lengths=lengths)
            for kv in (None, "int8")]
    np.testing.assert_array_equal(runs[1].tokens, runs[0].tokens)

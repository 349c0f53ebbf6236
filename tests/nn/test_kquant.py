"""K-quant kernels in a model (`nn.kquant`'s q4_k / q5_k / q6_k, `config.quant_layouts`):
a Q4_K_M-like mix of layouts, one per kernel, computes the float model of its
dequantized kernels, initialises to its own tree, decodes from the cache, passes only
its integers to the compiled program and lowers for GPU and TPU without custom calls."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.decode import api as decoding
from jaxformer.nn.quant_params import dequantize_params, param_bytes, quantize_params

# Every kernel's input a whole number of 256-value super-blocks; an untied output.
CONFIG = jf.llama(d_model=256, num_heads=4, num_kv_heads=2, d_ff=512, tgt_vocab_size=64,
                  src_vocab_size=64, tie_output_embedding=False, max_len=32)
# As llama.cpp's Q4_K_M: most kernels Q4_K, some value and down projections Q6_K, a
# kernel whose input does not fit super-blocks Q5_0 / Q8_0 (here: chosen), output Q6_K.
LAYOUTS = (("decoder/layers_0/self_attn/value", "q6_k"), ("decoder/layers_1/ffn/wo", "q6_k"),
           ("decoder/layers_1/self_attn/key", "int8_block"), ("decoder/layers_0/ffn/wi", "q5_k"),
           ("decoder/out_proj", "q6_k"))


@pytest.fixture(scope="module")
def lm(make_lm):
    model, params = make_lm(CONFIG, seed=1)
    tokens = jnp.asarray(np.random.default_rng(2).integers(3, 64, (2, 10)), jnp.int32)
    config, qparams = quantize_params(CONFIG, params, "q4_k", embed_quant="q4_k",
                                      quant_layouts=LAYOUTS)
    return params, tokens, config, qparams


@functools.lru_cache(maxsize=None)
def forward(config):
    return jax.jit(lambda p, t: jf.DecoderOnlyLM(config).apply({"params": p}, t))


def test_each_kernel_holds_its_own_layout(lm):
    _, _, config, qparams = lm
    layer0, layer1 = qparams["decoder"]["layers_0"], qparams["decoder"]["layers_1"]
    assert set(layer0["self_attn"]["query"]) == {"kernel_q", "scale", "min", "sub_scale",
                                                 "sub_min"}
    assert set(layer0["self_attn"]["value"]) == {"kernel_q", "kernel_q_high", "scale",
                                                 "sub_scale"}
    assert set(layer0["ffn"]["wi"]) == {"kernel_q", "kernel_q_high", "scale", "min",
                                        "sub_scale", "sub_min"}
    assert set(layer1["self_attn"]["key"]) == {"kernel_q", "scale"}
    assert layer1["self_attn"]["key"]["kernel_q"].dtype == jnp.int8
    assert set(qparams["decoder"]["out_proj"]) == set(layer0["self_attn"]["value"])
    assert set(qparams["embed"]) == {"embedding_q", "scale", "min", "sub_scale", "sub_min"}
    # a K-quant's bytes: (4.5 + a little) bits of 32 a weight
    assert param_bytes(layer0["self_attn"]["query"]) < 0.15 * 256 * 4 * 64 * 4


def test_the_mix_computes_the_float_model_of_its_dequantized_kernels(lm):
    _, tokens, config, qparams = lm
    fconfig, fparams = dequantize_params(config, qparams)
    assert fconfig == CONFIG
    want = forward(fconfig)(fparams, tokens)
    np.testing.assert_allclose(forward(config)(qparams, tokens), want,
                               atol=1e-5 * float(jnp.abs(want).max()), rtol=0)


def test_init_gives_the_tree_of_its_config(lm):
    _, tokens, config, qparams = lm
    init = jax.jit(jf.DecoderOnlyLM(config).init)(jax.random.key(0), tokens[:1, :2])["params"]
    shapes = lambda t: jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), t)  # noqa: E731
    assert shapes(init) == shapes(qparams)
    kernel = dequantize_params(config, init)[1]["decoder"]["layers_1"]["ffn"]["wo"]["kernel"]
    assert 0.5 < float(jnp.std(kernel)) * np.sqrt(512 + 256) / np.sqrt(2) < 1.5  # xavier


def test_cached_decoding_equals_the_full_forward(lm):
    _, tokens, config, qparams = lm
    model = jf.DecoderOnlyLM(config)
    prompt = tokens[:, :4]
    out = decoding.generate(model, qparams, prompt, max_new_tokens=4)
    sequence = np.asarray(prompt)
    for step in range(4):
        buffer = np.zeros((2, 8), np.int32)
        buffer[:, :sequence.shape[1]] = sequence
        logits = forward(config)(qparams, jnp.asarray(buffer))
        picked = np.asarray(jnp.argmax(logits[:, sequence.shape[1] - 1], -1))
        np.testing.assert_array_equal(np.asarray(out.tokens)[:, step], picked)
        sequence = np.concatenate([sequence, picked[:, None]], axis=1)


def test_the_compiled_program_takes_the_kept_blocks_only(lm):
    _, tokens, config, qparams = lm
    compiled = forward(config).lower(qparams, tokens).compile()
    assert compiled.memory_analysis().argument_size_in_bytes == (
        param_bytes(qparams) + tokens.nbytes)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_default_path_lowers_without_custom_calls(lm, platform):
    _, tokens, config, qparams = lm
    text = forward(config).trace(qparams, tokens).lower(lowering_platforms=(platform,)).as_text()
    assert "custom_call" not in text and "ui8>" in text


def test_bad_layouts_are_refused_by_name():
    with pytest.raises(ValueError, match="quant_layouts"):
        CONFIG.replace(weight_quant="q4_k", quant_layouts=(("decoder/out_proj", "q3_k"),))
    with pytest.raises(ValueError, match="scanned stack"):
        CONFIG.replace(weight_quant="q4_k", scan_layers=True,
                       quant_layouts=(("decoder/layers_0/ffn/wo", "q6_k"),))
    with pytest.raises(ValueError, match="super-blocks of 256 values, which do not divide "
                                         "d_model=64"):
        CONFIG.replace(d_model=64, weight_quant="q4_k")
    # a layout list from JSON is the same hashable config
    assert CONFIG.replace(weight_quant="q4_k", quant_layouts=[list(p) for p in LAYOUTS]) == \
        CONFIG.replace(weight_quant="q4_k", quant_layouts=LAYOUTS)

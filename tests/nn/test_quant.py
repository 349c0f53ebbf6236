"""Weight-only quantized kernels (`config.weight_quant`, `nn.quant`, `nn.quant_dense`,
`nn.quant_params`): the layouts, the models that consume them, the conversions."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.decode import api as decoding
from jaxformer.nn import kquant, quant, stacking
from jaxformer.nn.quant_params import dequantize_params, param_bytes, quantize_params
from jaxformer.parallel import partitioning

# GQA, untied output with a bias, RoPE: every quantized Dense kind in one small LM.
# d_model 64, d_ff 128, heads x head_dim 64: blocks of 32 divide every input axis.
CONFIG = jf.llama(d_model=64, num_heads=4, num_kv_heads=2, d_ff=128, tgt_vocab_size=48,
                  src_vocab_size=48, tie_output_embedding=False, output_bias=True,
                  max_len=32)
# The K-quants need inputs of 256 values (their model: test_kquant.py).
FORMATS = tuple(fmt for fmt in quant.FORMATS if fmt not in kquant.FORMATS)


@pytest.fixture(scope="module")
def lm(make_lm):
    model, params = make_lm(CONFIG, seed=1)
    tokens = jnp.asarray(np.random.default_rng(2).integers(3, 48, (2, 12)), jnp.int32)
    return model, params, tokens


@functools.lru_cache(maxsize=None)
def forward(config):
    return jax.jit(lambda p, t: jf.DecoderOnlyLM(config).apply({"params": p}, t))


# ---------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_then_dequantize_is_within_half_a_step(fmt):
    w = np.random.default_rng(0).normal(size=(64, 3, 5)).astype(np.float32)
    parts = quant.quantize(w, fmt, 32, 0)
    back = np.asarray(quant.dequantize(parts, fmt, 32, 0))
    scale = np.asarray(parts["scale"], np.float32)
    step = (np.broadcast_to(scale, w.shape) if fmt == "int8"
            else np.repeat(np.abs(scale), 32, axis=0))
    # half a step of rounding, plus float16 rounding of the block scales (and offsets);
    # int4_sym's levels run -8..7 with -8 at the block's peak, so the opposite sign's
    # extreme may lose one step more (llama.cpp's Q4_0)
    steps = 1.0 if fmt == "int4_sym" else 0.5
    assert (np.abs(back - w) <= steps * step + 2e-3 * np.abs(w).max()).all()
    assert np.abs(back - w).max() > 0  # it did quantize


def test_int4_dequantizes_as_scale_times_q_plus_offset():
    """Guards the int4 (GGUF Q4_1) offset's sign: hand-made blocks of known q, scale and
    offset (of both signs) dequantize to scale * q + offset, along either axis."""
    rng = np.random.default_rng(4)
    q = rng.integers(0, 16, (3, 64)).astype(np.uint8)  # 3 rows of two 32-blocks
    scale = rng.uniform(0.1, 1.0, (3, 2)).astype(np.float16)
    offset = np.asarray([[-1.5, 0.75], [2.0, -0.25], [-3.0, 1.0]], np.float16)
    want = (np.repeat(scale.astype(np.float32), 32, axis=1) * q
            + np.repeat(offset.astype(np.float32), 32, axis=1))
    parts = {"q": np.asarray(quant.pack(q, 1, 32)), "scale": scale, "offset": offset}
    np.testing.assert_allclose(np.asarray(quant.dequantize(parts, "int4", 32, -1)), want,
                               rtol=1e-6, atol=1e-6)
    transposed = {"q": np.asarray(quant.pack(q.T, 0, 32)), "scale": scale.T,
                  "offset": offset.T}
    np.testing.assert_allclose(np.asarray(quant.dequantize(transposed, "int4", 32, 0)),
                               want.T, rtol=1e-6, atol=1e-6)


def test_pack_is_ggufs_nibble_order_and_unpack_inverts_it():
    q = np.arange(64, dtype=np.uint8) % 16  # two blocks of 32
    packed = np.asarray(quant.pack(q, 0, 32))
    assert packed.shape == (32,)
    assert packed[0] == (q[0] | (q[16] << 4)) and packed[17] == (q[33] | (q[49] << 4))
    np.testing.assert_array_equal(quant.unpack(packed, 0, 32), q)


def test_an_unknown_layout_is_refused_by_name(lm):
    model, params, _ = lm
    with pytest.raises(ValueError, match="'int3' is not a quantized layout"):
        quantize_params(CONFIG, params, "int3")
    with pytest.raises(ValueError, match="weight_quant 'int3' is not a quantized layout"):
        CONFIG.replace(weight_quant="int3")
    with pytest.raises(ValueError, match="quant_block 48 does not divide d_model=64"):
        CONFIG.replace(weight_quant="int4", quant_block=48)


def test_quantizing_a_quantized_tree_is_refused(lm):
    _, params, _ = lm
    config, qparams = quantize_params(CONFIG, params, "int8")
    with pytest.raises(ValueError, match="already quantized"):
        quantize_params(config, qparams, "int4")
    with pytest.raises(ValueError, match="already quantized"):  # the tree alone says so
        quantize_params(CONFIG, qparams, "int4")


# ---------------------------------------------------------------------------- models


@pytest.fixture(scope="module")
def quantized(lm):
    """{fmt: (config, params)} of the LM's parameters quantized in each layout."""
    _, params, _ = lm
    return {fmt: quantize_params(CONFIG, params, fmt) for fmt in FORMATS}


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_model_equals_the_float_model_of_its_dequantized_kernels(lm, quantized, fmt):
    """Same math: the float model with the kernels the quantized one multiplies by."""
    _, _, tokens = lm
    config, qparams = quantized[fmt]
    assert config.weight_quant == fmt and config.quant_format("embed") == fmt
    fconfig, fparams = dequantize_params(config, qparams)
    assert jax.tree_util.tree_structure(fparams) == jax.tree_util.tree_structure(lm[1])
    got = forward(config)(qparams, tokens)
    want = forward(fconfig)(fparams, tokens)
    np.testing.assert_allclose(got, want, atol=2e-5 * float(jnp.abs(want).max()), rtol=0)


def test_int8_model_is_close_to_the_float_model(lm, quantized):
    """Per-channel int8 on random weights: the logits move by 2.5 % of their spread (root
    mean square; 10 % at most), the greedy picks not at all."""
    _, params, tokens = lm
    config, qparams = quantized["int8"]
    got = np.asarray(forward(config)(qparams, tokens))
    want = np.asarray(forward(CONFIG)(params, tokens))
    assert np.sqrt(np.mean((got - want) ** 2)) < 0.05 * want.std()
    assert np.abs(got - want).max() < 0.2 * want.std()
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
    assert np.abs(got - want).max() > 0  # it is not the float model


def test_parameter_tree_holds_integers_and_the_bytes_shrink(lm, quantized):
    _, params, _ = lm
    config, qparams = quantized["int4"]
    query = qparams["decoder"]["layers_0"]["self_attn"]["query"]
    assert set(query) == {"kernel_q", "scale", "offset"}
    assert query["kernel_q"].dtype == jnp.uint8 and query["kernel_q"].shape == (32, 4, 16)
    out = qparams["decoder"]["layers_0"]["self_attn"]["out"]
    assert out["kernel_q"].shape == (32, 64)  # (heads * head_dim / 2, D)
    assert set(qparams["embed"]) == {"embedding_q", "scale", "offset"}
    ratios = {fmt: param_bytes(quantized[fmt][1]) / param_bytes(params) for fmt in FORMATS}
    assert ratios["int4"] <= 0.3 and ratios["int4_sym"] < ratios["int4"]
    assert ratios["int8"] <= 0.3 and ratios["int8_block"] <= 0.3, ratios


def test_model_init_gives_the_quantized_tree_of_its_config(lm, quantized):
    """`init` of a quantized config: the same leaves, shapes and dtypes as quantize_params,
    each quantized Dense consistent (a dequantized init draw, not zeros)."""
    _, _, tokens = lm
    for fmt in ("int8", "int4"):
        config, qparams = quantized[fmt]
        init = jax.jit(jf.DecoderOnlyLM(config).init)(jax.random.key(0), tokens[:1, :2])["params"]
        shapes = lambda t: jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), t)  # noqa: E731
        assert shapes(init) == shapes(qparams)
        kernel = dequantize_params(config, init)[1]["decoder"]["layers_0"]["ffn"]["wi"]["kernel"]
        assert 0.5 < float(jnp.std(kernel)) * np.sqrt(64 + 128) / np.sqrt(2) < 1.5  # xavier


def test_scanned_stack_equals_unrolled(lm, quantized):
    """quantize_params on the stacked tree == stacking the quantized per-layer tree, and
    the scanned quantized model computes the unrolled one's logits."""
    model, params, tokens = lm
    config, qparams = quantized["int4"]
    scanned = config.replace(scan_layers=True)
    _, stacked = quantize_params(CONFIG.replace(scan_layers=True),
                                 stacking.stack_layers(params), "int4")
    jax.tree_util.tree_map(np.testing.assert_array_equal, stacked,
                           stacking.stack_layers(qparams))
    np.testing.assert_allclose(forward(scanned)(stacked, tokens), forward(config)(qparams, tokens),
                               atol=1e-5, rtol=1e-5)


def test_cached_decoding_and_chunked_prefill_take_quantized_kernels(lm, quantized):
    """Greedy tokens of the cached decode == the full forward's argmax at each step; chunked
    prefill gives the same tokens."""
    _, _, tokens = lm
    config, qparams = quantized["int4"]
    model = jf.DecoderOnlyLM(config)
    prompt = tokens[:, :5]
    out = decoding.generate(model, qparams, prompt, max_new_tokens=6)
    chunked = decoding.generate(model, qparams, prompt, max_new_tokens=6, prefill_chunk=2)
    np.testing.assert_array_equal(chunked.tokens, out.tokens)
    sequence = np.asarray(prompt)
    for step in range(6):  # a fixed-width buffer: one compile; causal mask hides the rest
        buffer = np.zeros((2, 11), np.int32)
        buffer[:, :sequence.shape[1]] = sequence
        logits = forward(config)(qparams, jnp.asarray(buffer))
        picked = np.asarray(jnp.argmax(logits[:, sequence.shape[1] - 1], -1))
        live = step < np.asarray(out.lengths)
        np.testing.assert_array_equal(np.asarray(out.tokens)[live, step], picked[live])
        sequence = np.concatenate([sequence, picked[:, None]], axis=1)


def test_the_compiled_program_takes_the_integers_only(lm, quantized):
    """No float copy of the weights is passed in: the compiled program's arguments are the
    quantized tree and the tokens, byte for byte."""
    _, _, tokens = lm
    for fmt in ("int8", "int4"):
        config, qparams = quantized[fmt]
        compiled = forward(config).lower(qparams, tokens).compile()
        assert compiled.memory_analysis().argument_size_in_bytes == (
            param_bytes(qparams) + tokens.nbytes)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_default_path_lowers_without_custom_calls(lm, quantized, platform):
    _, _, tokens = lm
    for fmt in ("int8", "int4"):
        config, qparams = quantized[fmt]
        text = forward(config).trace(qparams, tokens).lower(
            lowering_platforms=(platform,)).as_text()
        assert "custom_call" not in text
        assert "i8>" in text or "ui8>" in text  # the integers are what it takes


def test_scales_shard_like_their_kernels():
    """Logical axes: a block layout's leaves carry the kernel's names (the flattened
    input axes the outer one's), int8's per-channel scale the output names."""
    for fmt, scale_q, scale_out in (("int4", ("embed", "heads", "kv"), ("heads", "embed")),
                                    ("int8", ("heads", "kv"), ("embed",))):
        model = jf.DecoderOnlyLM(CONFIG.replace(weight_quant=fmt))
        specs = partitioning.logical_specs(model, jax.ShapeDtypeStruct((1, 1), jnp.int32))
        attn = specs["decoder"]["layers_0"]["self_attn"]
        assert tuple(attn["query"]["kernel_q"]) == ("embed", "heads", "kv")
        assert tuple(attn["query"]["scale"]) == scale_q
        assert tuple(attn["out"]["kernel_q"]) == ("heads", "embed")
        assert tuple(attn["out"]["scale"]) == scale_out
        assert tuple(specs["decoder"]["out_proj"]["scale"]) == (
            ("embed", "vocab") if fmt == "int4" else ("vocab",))


def test_encoder_decoder_takes_quantized_kernels(make_transformer, tokens):
    """Cross-attention, shared-free source and target tables, biases: int8 == dequantized."""
    config = jf.tiny()
    model, params = make_transformer(config, seed=4)
    src, tgt = tokens(0, (2, 6)), tokens(1, (2, 5))
    qconfig, qparams = quantize_params(config, params, "int8")
    fconfig, fparams = dequantize_params(qconfig, qparams)
    got = jax.jit(jf.Transformer(qconfig).apply)({"params": qparams}, src, tgt)
    want = jax.jit(jf.Transformer(fconfig).apply)({"params": fparams}, src, tgt)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


# Run in a child with 4 CPU devices: the int4 LM placed on fsdp=2 x tensor=2, then run.
SHARDED = """
import json, jax, jax.numpy as jnp, numpy as np
import jaxformer as jf
from jaxformer.nn.quant_params import quantize_params
from jaxformer.parallel import partitioning
config = jf.llama(d_model=64, num_heads=4, num_kv_heads=2, d_ff=128, tgt_vocab_size=48,
                  src_vocab_size=48, tie_output_embedding=False, max_len=32)
model = jf.DecoderOnlyLM(config)
tokens = jnp.asarray(np.arange(3, 15).reshape(2, 6), jnp.int32)
params = model.init(jax.random.key(0), tokens)["params"]
qconfig, qparams = quantize_params(config, params, "int4")
qmodel = jf.DecoderOnlyLM(qconfig)
mesh = partitioning.make_mesh("fsdp=2,tensor=2")
placed = partitioning.place_params(qmodel, qparams, mesh)
layer = placed["decoder"]["layers_0"]
spec = lambda x: [list(e) if isinstance(e, tuple) else e for e in x.sharding.spec]
run = jax.jit(lambda p, t: qmodel.apply({"params": p}, t))
print(json.dumps({"specs": {name: [spec(leaf) for leaf in module.values()] for name, module in
                            [("query", layer["self_attn"]["query"]), ("wo", layer["ffn"]["wo"])]},
                  "diff": float(jnp.abs(run(placed, tokens) - run(qparams, tokens)).max())}))
"""


def test_scales_are_placed_with_their_kernels_on_a_four_device_mesh():
    """fsdp=2 x tensor=2: every leaf of a quantized projection (kernel_q, scale, offset)
    split over the same mesh axes as its kernel; the sharded model computes the same."""
    import json
    import os
    import subprocess
    import sys

    from conftest import REPO

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, "-c", SHARDED], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["specs"]["query"] == [["fsdp", "tensor"]] * 3  # (D, H, K): embed, heads
    assert out["specs"]["wo"] == [["tensor", "fsdp"]] * 3     # (F, D): mlp, embed
    assert out["diff"] < 1e-5


def test_training_a_quantized_model_is_refused_in_one_line():
    from jaxformer.train import train_functions, TrainConfig

    with pytest.raises(ValueError, match="quantized kernels are frozen integers"):
        train_functions(jf.tiny(weight_quant="int8"), TrainConfig())

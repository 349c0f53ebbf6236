"""GGUF block types beyond the kept three (`jaxformer.interop.gguf_blocks`): Q5_0 decoded
exactly into the Q8_0 layout, Q4_K into Q4_1's with float16 sub-block scales, Q6_K (and
files mixing layouts) requantized to int8_block, each checked against the `gguf`
package's own dequantization (llama.cpp's reference); the conversion's error stated
in a warning; the model of a K-quant file against the float model of the same file."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf

gguf = pytest.importorskip("gguf", reason="GGUF import needs the `llm` extra: "
                                          "pip install 'jaxformer[llm]'")
from jaxformer.interop import gguf_blocks  # noqa: E402
from jaxformer.models import llama  # noqa: E402
from jaxformer.nn import quant  # noqa: E402
from jaxformer.nn.quant_params import dequantize_params, param_bytes  # noqa: E402

from conftest import numpy_params  # noqa: E402
from test_gguf import gguf_tensors, write_gguf  # noqa: E402

Q = gguf.GGMLQuantizationType
# Every kernel's input a whole number of 256-value super-blocks.
KCONFIG = jf.llama(d_model=256, num_heads=4, num_kv_heads=2, d_ff=256, num_decoder_layers=2,
                   tgt_vocab_size=16, src_vocab_size=16, max_len=32, rope_theta=500.0,
                   layer_norm_epsilon=1e-6)


def k_blocks(rng, rows: int, n: int, kind) -> np.ndarray:
    """Random valid K-quant bytes (rows, n / 256 * block bytes): random values, scales and
    mins, finite float16 super-block scales of a realistic size."""
    size = gguf.GGML_QUANT_SIZES[kind][1]
    raw = rng.integers(0, 256, (rows, n // 256, size), dtype=np.uint8)
    d = rng.uniform(2e-5, 1e-4, (rows, n // 256, 2)).astype(np.float16).view(np.uint8)
    if kind == Q.Q4_K:  # d, dmin first
        raw[..., 0:4] = d.reshape(rows, n // 256, 4)
    else:  # Q6_K: d last
        raw[..., size - 2:] = d[..., :2]
    return raw.reshape(rows, -1)


def reference(raw, kind, n):
    return np.asarray(gguf.quants.dequantize(raw, kind), np.float32).reshape(-1, n)


def dequantized(parts, fmt):
    return np.asarray(quant.dequantize(parts, fmt, 32, -1))


def test_q5_0_is_int8_block_bit_for_bit():
    w = np.random.default_rng(0).normal(size=(8, 96)).astype(np.float32)
    raw = gguf.quants.quantize(w, Q.Q5_0)
    parts, exact = gguf_blocks.decode(raw, Q.Q5_0, 96)
    assert exact and gguf_blocks.target_layout(Q.Q5_0) == "int8_block"
    assert parts["q"].dtype == np.int8 and parts["q"].min() >= -16 and parts["q"].max() <= 15
    np.testing.assert_array_equal(dequantized(parts, "int8_block"), reference(raw, Q.Q5_0, 96))


def test_q4_k_keeps_its_4_bit_values_with_float16_sub_block_scales():
    raw = k_blocks(np.random.default_rng(1), 6, 512, Q.Q4_K)
    want = reference(raw, Q.Q4_K, 512)
    parts, exact = gguf_blocks.decode(raw, Q.Q4_K, 512)
    assert not exact and gguf_blocks.target_layout(Q.Q4_K) == "int4"
    assert parts["q"].shape == (6, 256) and parts["scale"].shape == (6, 16)
    got = dequantized(parts, "int4")
    # only the float16 rounding of d * sc and dmin * m: at most 2^-11 of each term
    scale = np.repeat(parts["scale"].astype(np.float32), 32, axis=-1)
    offset = np.repeat(parts["offset"].astype(np.float32), 32, axis=-1)
    bound = 2.0 ** -11 * (15 * np.abs(scale) + np.abs(offset)) * 1.01 + 1e-12
    assert np.all(np.abs(got - want) <= bound)
    assert gguf_blocks.relative_error(parts, "int4", want) < 2e-3


def test_q6_k_is_requantized_to_int8_block_within_half_a_step():
    raw = k_blocks(np.random.default_rng(2), 5, 256, Q.Q6_K)
    want = reference(raw, Q.Q6_K, 256)
    parts, exact = gguf_blocks.decode(raw, Q.Q6_K, 256)
    assert not exact and gguf_blocks.target_layout(Q.Q6_K) == "int8_block"
    got = dequantized(parts, "int8_block")
    step = np.repeat(parts["scale"].astype(np.float32), 32, axis=-1)
    assert np.all(np.abs(got - want) <= 0.5 * step * 1.01 + 1e-9)
    error = gguf_blocks.relative_error(parts, "int8_block", want)
    assert error == pytest.approx(np.abs(got - want).max() / np.abs(want).max())


def k_file(path, params, layers, table, override=None):
    """A GGUF file of KCONFIG: layer kernels of type `layers`, token table `table`; K-quant
    tensors random valid bytes, the others quantized from `params` by gguf."""
    tensors = gguf_tensors(params, KCONFIG)
    kinds = {name: layers for name in tensors if name.startswith("blk.")
             and not name.endswith("norm.weight")}
    kinds["token_embd.weight"] = table
    kinds.update(override or {})
    rng = np.random.default_rng(7)
    raw = {}
    for name, kind in kinds.items():
        value = tensors.pop(name)
        raw[name] = (k_blocks(rng, value.shape[0], value.shape[1], kind)
                     if kind in (Q.Q4_K, Q.Q6_K) else gguf.quants.quantize(value, kind), kind)
    return write_gguf(path, tensors, KCONFIG, raw=raw)


@pytest.fixture(scope="module")
def kparams():
    model = jf.DecoderOnlyLM(KCONFIG)
    return numpy_params(model, jax.ShapeDtypeStruct((1, 1), jnp.int32), seed=5)


@pytest.mark.parametrize("layers, table, override, fmt, embed, stated", [
    (Q.Q4_K, Q.Q6_K, None, "int4", "int8_block", ("Q4_K", "Q6_K")),
    (Q.Q5_0, Q.Q8_0, None, "int8_block", "int8_block", ()),
    (Q.Q4_K, Q.Q6_K, {"blk.1.ffn_down.weight": Q.Q6_K}, "int8_block", "int8_block",
     ("Q4_K", "Q6_K")),
], ids=["Q4_K_layers_Q6_K_table", "Q5_0_exact", "Q4_K_M_like_mix"])
def test_a_file_loads_kept_with_its_conversion_error_stated(tmp_path, kparams, layers, table,
                                                            override, fmt, embed, stated):
    path = k_file(tmp_path / "k.gguf", kparams, layers, table, override)
    float_model, floats, _ = llama.load_gguf(path)
    if stated:
        with pytest.warns(llama.QuantConversionWarning) as record:
            model, kept, _ = llama.load_gguf(path, quantize="keep")
        message = str(record[0].message)
        for kind in stated:
            assert f"{kind} converted to" in message, message
    else:
        import warnings  # noqa: PLC0415

        with warnings.catch_warnings():
            warnings.simplefilter("error")  # an exact file warns of nothing
            model, kept, _ = llama.load_gguf(path, quantize="keep")
    assert (model.config.weight_quant, model.config.embed_quant) == (fmt, embed)
    config, back = dequantize_params(model.config, kept)
    assert config == float_model.config
    errors = []
    for got, want in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(floats)):
        got, want = np.asarray(got), np.asarray(want)
        errors.append(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
    if not stated:
        assert max(errors) == 0.0  # Q5_0 and Q8_0: bit for bit
    else:  # the warning's figure is the largest error of any tensor
        largest = max(float(x) for x in re.findall(r"largest error (\S+)", message))
        assert max(errors) == pytest.approx(largest, rel=0.02)
        assert max(errors) < 5e-3
    assert param_bytes(kept) < 0.45 * param_bytes(floats)
    tokens = jnp.array([[3, 4, 5, 6, 7, 8]])
    want = float_model.apply({"params": floats}, tokens)
    got = model.apply({"params": kept}, tokens)
    np.testing.assert_allclose(got, want, atol=1e-2 * float(jnp.abs(want).max()))

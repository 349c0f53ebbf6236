"""GGUF block types beyond Q8_0 / Q4_0 / Q4_1 (`jaxformer.interop.gguf_blocks`): the
K-quants (Q4_K, Q5_K, Q6_K) kept as they are in `nn.kquant`'s layouts, Q5_0 decoded
exactly into the Q8_0 layout, Q3_K requantized to int8_block, each checked against the
`gguf` package's own dequantization (llama.cpp's reference); files mixing block types
(as every Q4_K_M file does) keep each tensor in its own layout (`quant_layouts`); the
model of a K-quant file against the float model of the same file."""

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
    if kind in (Q.Q4_K, Q.Q5_K):  # d, dmin first
        raw[..., 0:4] = d.reshape(rows, n // 256, 4)
    else:  # Q6_K, Q3_K: d last
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


K_KINDS = {Q.Q4_K: "q4_k", Q.Q5_K: "q5_k", Q.Q6_K: "q6_k"}
BITS = {Q.Q4_K: 4.5, Q.Q5_K: 5.5, Q.Q6_K: 6.5625}  # llama.cpp's bits per weight


@pytest.mark.parametrize("kind", K_KINDS, ids=lambda k: k.name)
def test_k_quants_are_kept_bit_for_bit(kind):
    """Every byte of the file is kept (encode gives the file's bytes back), the blocks
    dequantize to exactly the reference's values along either axis, and the layout
    takes the file's bits per weight (Q4_K's packed 6-bit scales unpacked to bytes)."""
    raw = k_blocks(np.random.default_rng(1), 6, 512, kind)
    want = reference(raw, kind, 512)
    parts, exact = gguf_blocks.decode(raw, kind, 512)
    fmt = K_KINDS[kind]
    assert exact and gguf_blocks.target_layout(kind) == fmt
    assert set(parts) == set(quant.parts_of(fmt))
    np.testing.assert_array_equal(gguf_blocks.encode(parts, kind), raw)
    np.testing.assert_array_equal(dequantized(parts, fmt), want)
    transposed = {k: v.T for k, v in parts.items()}  # a kernel's (N, out) layout
    np.testing.assert_array_equal(np.asarray(quant.dequantize(transposed, fmt, 32, 0)), want.T)
    bits = 8 * sum(v.nbytes for v in parts.values()) / want.size
    assert BITS[kind] <= bits <= BITS[kind] + 0.125


@pytest.mark.parametrize("kind", K_KINDS, ids=lambda k: k.name)
def test_a_float_array_quantizes_to_valid_k_blocks(kind):
    """`quant.quantize` (a fresh model's init, `quantize_params`) writes blocks that the
    reference reads as this layout's values, as close to the floats as its bits allow:
    Q4_K about Q4_1's error (4 bits a value, 6-bit scales), each more bit half that."""
    w = np.random.default_rng(3).normal(size=(4, 512)).astype(np.float32)
    fmt = K_KINDS[kind]
    parts = jax.tree_util.tree_map(np.asarray, quant.quantize(w, fmt, 32, -1))
    got = dequantized(parts, fmt)
    np.testing.assert_array_equal(reference(gguf_blocks.encode(parts, kind), kind, 512), got)
    q4_1 = np.abs(dequantized(quant.quantize(w, "int4", 32, -1), "int4") - w).mean()
    ratio = np.abs(got - w).mean() / q4_1
    assert ratio < {"q4_k": 1.1, "q5_k": 0.55, "q6_k": 0.3}[fmt]


def test_q3_k_is_requantized_to_int8_block_within_half_a_step():
    raw = k_blocks(np.random.default_rng(2), 5, 256, Q.Q3_K)
    want = reference(raw, Q.Q3_K, 256)
    parts, exact = gguf_blocks.decode(raw, Q.Q3_K, 256)
    assert not exact and gguf_blocks.target_layout(Q.Q3_K) == "int8_block"
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
                     if kind in (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q3_K)
                     else gguf.quants.quantize(value, kind), kind)
    return write_gguf(path, tensors, KCONFIG, raw=raw)


@pytest.fixture(scope="module")
def kparams():
    model = jf.DecoderOnlyLM(KCONFIG)
    return numpy_params(model, jax.ShapeDtypeStruct((1, 1), jnp.int32), seed=5)


Q4_K_M_LIKE = {"blk.0.attn_v.weight": Q.Q6_K, "blk.1.ffn_down.weight": Q.Q6_K,
               "blk.1.attn_k.weight": Q.Q5_0, "blk.0.ffn_up.weight": Q.Q8_0}


@pytest.mark.parametrize("layers, table, override, fmt, embed, layouts, stated", [
    (Q.Q4_K, Q.Q6_K, None, "q4_k", "q6_k", (), ()),
    (Q.Q5_K, Q.Q8_0, None, "q5_k", "int8_block", (), ()),
    (Q.Q5_0, Q.Q8_0, None, "int8_block", "int8_block", (), ()),
    (Q.Q4_K, Q.Q6_K, Q4_K_M_LIKE, "q4_k", "q6_k",
     (("decoder/layers_0/self_attn/value", "q6_k"), ("decoder/layers_0/ffn/wi", "int8_block"),
      ("decoder/layers_1/self_attn/key", "int8_block"), ("decoder/layers_1/ffn/wo", "q6_k")),
     ()),
    (Q.Q4_K, Q.Q6_K, {"blk.1.ffn_gate.weight": Q.Q3_K}, "q4_k", "q6_k",
     (("decoder/layers_1/ffn/gate", "int8_block"),), ("Q3_K",)),
], ids=["Q4_K_layers_Q6_K_table", "Q5_K", "Q5_0_exact", "Q4_K_M_like_mix", "Q3_K_converted"])
def test_a_file_loads_kept_with_its_conversion_error_stated(tmp_path, kparams, layers, table,
                                                            override, fmt, embed, layouts,
                                                            stated):
    """Each tensor keeps its own type's layout; the kept model's logits are the float
    model's of the same file (the file's dequantized weights) to float rounding."""
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
    config = model.config
    assert (config.weight_quant, config.embed_quant) == (fmt, embed)
    assert sorted(config.quant_layouts) == sorted(layouts)
    plain, back = dequantize_params(config, kept)
    assert plain == float_model.config
    errors = []
    for got, want in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(floats)):
        got, want = np.asarray(got), np.asarray(want)
        errors.append(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
    if not stated:
        assert max(errors) == 0.0  # kept and exactly decoded types: bit for bit
    else:  # the warning's figure is the largest error of any tensor
        largest = max(float(x) for x in re.findall(r"largest error (\S+)", message))
        assert max(errors) == pytest.approx(largest, rel=0.02)
        assert max(errors) < 5e-3
    assert param_bytes(kept) < 0.45 * param_bytes(floats)
    tokens = jnp.array([[3, 4, 5, 6, 7, 8]])
    want = float_model.apply({"params": floats}, tokens)
    got = model.apply({"params": kept}, tokens)
    tolerance = 1e-2 if stated else 1e-5
    np.testing.assert_allclose(got, want, atol=tolerance * float(jnp.abs(want).max()))

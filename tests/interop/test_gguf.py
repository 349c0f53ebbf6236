"""GGUF import (interop/gguf.py + models/llama.py) on small files written here.

A random jaxformer llama LM is written as a GGUF file the way llama.cpp's
converter writes one (query/key rows permuted to the interleaved RoPE order,
weights as (out, in) rows), read back with either RoPE layout, and must give
the original logits. Bad files (another architecture, wrong tensor shapes, an
unsupported quantization type) are refused with a ValueError naming the
problem, before any tensor is decoded. The real SmolLM2 file: test_smollm2.py.
"""

import os
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf

gguf = pytest.importorskip("gguf", reason="GGUF import needs the `llm` extra: "
                                          "pip install 'jaxformer[llm]'")
from jaxformer.interop.flat import CheckpointMismatch  # noqa: E402
from jaxformer.interop.gguf import read_gguf  # noqa: E402
from jaxformer.models import llama  # noqa: E402
from jaxformer.nn.rope import half_to_interleaved_rows  # noqa: E402

from conftest import numpy_params  # noqa: E402

CONFIG = jf.llama(d_model=32, num_heads=4, num_kv_heads=2, d_ff=24, num_decoder_layers=2,
                  tgt_vocab_size=16, src_vocab_size=16, max_len=32, rope_theta=500.0,
                  layer_norm_epsilon=1e-6)
Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def lm():
    model = jf.DecoderOnlyLM(CONFIG)
    return model, numpy_params(model, jax.ShapeDtypeStruct((1, 1), jnp.int32), seed=3)


def gguf_tensors(params, config):
    """{GGUF name: numpy array (out, in)} as llama.cpp stores a llama model."""
    p = jax.tree_util.tree_map(np.asarray, params)
    H, G, K, D = config.num_heads, config.kv_heads, config.head_dim, config.d_model
    perm = half_to_interleaved_rows(K)

    def qk_rows(kernel_DHK, heads):  # (D, heads, K) -> interleaved rows (heads*K, D)
        return kernel_DHK.transpose(1, 2, 0)[:, perm, :].reshape(heads * K, D)

    out = {"token_embd.weight": p["embed"]["embedding"],
           "output_norm.weight": p["decoder"]["final_norm"]["scale"]}
    for i in range(config.num_decoder_layers):
        layer = p["decoder"][f"layers_{i}"]
        attn, ffn = layer["self_attn"], layer["ffn"]
        out.update({
            f"blk.{i}.attn_norm.weight": layer["self_attn_norm"]["scale"],
            f"blk.{i}.attn_q.weight": qk_rows(attn["query"]["kernel"], H),
            f"blk.{i}.attn_k.weight": qk_rows(attn["key"]["kernel"], G),
            f"blk.{i}.attn_v.weight": attn["value"]["kernel"].transpose(1, 2, 0).reshape(G * K, D),
            f"blk.{i}.attn_output.weight": attn["out"]["kernel"].reshape(H * K, D).T,
            f"blk.{i}.ffn_norm.weight": layer["ffn_norm"]["scale"],
            f"blk.{i}.ffn_gate.weight": ffn["gate"]["kernel"].T,
            f"blk.{i}.ffn_up.weight": ffn["wi"]["kernel"].T,
            f"blk.{i}.ffn_down.weight": ffn["wo"]["kernel"].T})
    return out


def write_gguf(path, tensors, config=CONFIG, arch="llama", raw=None):
    """A llama GGUF file; `raw` = {name: (bytes array, quant type)} for pre-quantized tensors."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_decoder_layers)
    writer.add_context_length(config.max_len)
    writer.add_embedding_length(config.d_model)
    writer.add_feed_forward_length(config.d_ff)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.kv_heads)
    writer.add_layer_norm_rms_eps(config.layer_norm_epsilon)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_tokenizer_model("gpt2")
    tokens = ["<unk>", "<s>", "</s>"] + [chr(ord("a") + i) for i in range(12)] + ["ab"]
    writer.add_token_list(tokens)
    writer.add_token_types([int(gguf.TokenType.CONTROL)] * 3 + [int(gguf.TokenType.NORMAL)] * 13)
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, array in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(array, np.float32))
    for name, (data, kind) in (raw or {}).items():
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("rope", ["half", "interleaved"])
def test_a_written_file_loads_back_to_the_same_model(tmp_path, lm, rope):
    model, params = lm
    path = write_gguf(tmp_path / "tiny.gguf", gguf_tensors(params, CONFIG))
    loaded, loaded_params, tokenizer = llama.load_gguf(path, rope=rope)
    assert loaded.config == CONFIG.replace(  # GGUF stores the epsilon as float32
        rope=rope, pad_id=0, bos_id=1, eos_id=2, layer_norm_epsilon=float(np.float32(1e-6)))
    tokens = jnp.array([[3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    np.testing.assert_allclose(loaded.apply({"params": loaded_params}, tokens),
                               model.apply({"params": params}, tokens), atol=1e-5)
    assert tokenizer.encode("<s>abc").ids == [1, 15, 5]  # control token whole, merge "a b"
    assert tokenizer.decode([15, 5, 6]) == "abcd"


def test_the_rope_layout_must_match_the_rows(tmp_path, lm):
    """Interleaved rows rotated as half-split pairs: a different model."""
    model, params = lm
    file = read_gguf(write_gguf(tmp_path / "tiny.gguf", gguf_tensors(params, CONFIG)))
    right = llama.params_from_gguf(file, CONFIG.replace(rope="interleaved"))
    tokens = jnp.array([[3, 4, 5, 6, 7, 8]])
    wrong = jf.DecoderOnlyLM(CONFIG.replace(rope="half")).apply({"params": right}, tokens)
    assert np.abs(wrong - model.apply({"params": params}, tokens)).max() > 1e-2


def test_another_architecture_is_refused(tmp_path, lm):
    path = write_gguf(tmp_path / "gpt2.gguf", gguf_tensors(lm[1], CONFIG), arch="gpt2")
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        llama.load_gguf(path)


def test_tensor_shapes_must_match_the_metadata(tmp_path, lm):
    tensors = gguf_tensors(lm[1], CONFIG)
    tensors["blk.1.attn_k.weight"] = np.zeros((32, 32), np.float32)  # MHA-sized, metadata says G=2
    with pytest.raises(CheckpointMismatch, match=r"wrong shape: blk.1.attn_k.weight \(32, 32\), "
                                                 r"expected \(16, 32\)"):
        llama.load_gguf(write_gguf(tmp_path / "bad.gguf", tensors))
    del tensors["blk.1.ffn_up.weight"]
    with pytest.raises(CheckpointMismatch, match="missing: +blk.1.ffn_up.weight"):
        llama.load_gguf(write_gguf(tmp_path / "missing.gguf", tensors))


def test_unsupported_quantization_is_refused_before_decoding(tmp_path, lm, monkeypatch):
    tensors = gguf_tensors(lm[1], CONFIG)
    del tensors["blk.0.ffn_gate.weight"]  # (24, 32): one 32-wide IQ4_NL block (18 bytes) a row
    raw = {"blk.0.ffn_gate.weight": (np.zeros((24, 18), np.uint8), Q.IQ4_NL)}
    path = write_gguf(tmp_path / "iq4.gguf", tensors, raw=raw)
    decoded = []
    monkeypatch.setattr(gguf.quants, "dequantize", lambda *a: decoded.append(a))
    with pytest.raises(ValueError, match="'blk.0.ffn_gate.weight' has quantization type IQ4_NL"):
        llama.load_gguf(path)
    assert decoded == []


# -- damaged and foreign files: one FileFormatError naming the file ----------------------

def _bad_files(tmp_path, lm):
    model, params = lm
    good = write_gguf(tmp_path / "good.gguf", gguf_tensors(params, CONFIG)).read_bytes()
    rng = np.random.default_rng(0)
    header_claiming_2_40_tensors = (b"GGUF" + (3).to_bytes(4, "little")
                                    + (2 ** 40).to_bytes(8, "little") + (0).to_bytes(8, "little"))
    files = {"truncated": good[: len(good) // 3],
             "random_after_magic": b"GGUF" + rng.bytes(4096),
             "claims_2_40_tensors": header_claiming_2_40_tensors,
             "text": b"this is not a model\n" * 10}
    paths = {}
    for name, data in files.items():
        paths[name] = tmp_path / f"{name}.gguf"
        paths[name].write_bytes(data)
    paths["missing"] = tmp_path / "missing.gguf"
    paths["a_directory"] = tmp_path
    return paths


@pytest.mark.parametrize("case", ["truncated", "random_after_magic", "claims_2_40_tensors",
                                  "text", "missing", "a_directory"])
def test_a_bad_file_is_one_error_naming_it(tmp_path, lm, case):
    from jaxformer.errors import FileFormatError
    path = _bad_files(tmp_path, lm)[case]
    with pytest.raises(FileFormatError) as info:
        llama.load_gguf(path)
    message = str(info.value)
    assert str(path) in message and "\n" not in message
    assert info.value.path == str(path)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["nan", "+inf", "-inf"])
def test_a_tensor_of_nan_or_infinity_is_refused_unless_asked(tmp_path, lm, value):
    from jaxformer.errors import FileFormatError
    model, params = lm
    tensors = gguf_tensors(params, CONFIG)
    up = tensors["blk.1.ffn_up.weight"].copy()
    up[3, 5] = value  # one element: a check of the first or of the mean would miss it
    tensors["blk.1.ffn_up.weight"] = up
    path = write_gguf(tmp_path / "bad.gguf", tensors)
    with pytest.raises(FileFormatError, match="blk.1.ffn_up.weight.*NaN or infinite"):
        llama.load_gguf(path)
    np.testing.assert_array_equal(read_gguf(path).array("blk.1.ffn_up.weight",
                                                        check_finite=False), up)


@pytest.mark.parametrize("progress", [True, False])
def test_a_bar_counts_the_tensors_read_unless_off(tmp_path, lm, capsys, progress):
    """The bar is forced on or off (by default: on only when stderr is a terminal)."""
    path = write_gguf(tmp_path / "tiny.gguf", gguf_tensors(lm[1], CONFIG))
    capsys.readouterr()
    llama.load_gguf(path, progress=progress)
    err = capsys.readouterr().err
    n = len(read_gguf(path).tensors)
    assert (f"0/{n} " in err and "reading tiny.gguf" in err) if progress else err == ""


# -- quantized blocks kept as they are (load_gguf(..., quantize="keep")) ----------------

QCONFIG = CONFIG.replace(d_ff=32)  # every kernel's input a whole number of 32-blocks


@pytest.fixture(scope="module")
def qlm():
    model = jf.DecoderOnlyLM(QCONFIG)
    return model, numpy_params(model, jax.ShapeDtypeStruct((1, 1), jnp.int32), seed=5)


def quantized_file(path, params, kernels, table=Q.Q8_0, override=None):
    """A GGUF file of `params` with every layer kernel in block type `kernels`, the token
    table in `table` (gguf's reference quantizer); `override` {name: type}."""
    tensors = gguf_tensors(params, QCONFIG)
    kinds = {name: kernels for name in tensors if name.startswith("blk.")
             and not name.endswith("norm.weight")}
    kinds["token_embd.weight"] = table
    kinds.update(override or {})
    raw = {name: (gguf.quants.quantize(tensors.pop(name), kind), kind)
           for name, kind in kinds.items() if kind != Q.F32}
    return write_gguf(path, tensors, QCONFIG, raw=raw)


@pytest.mark.parametrize("kind, fmt", [(Q.Q4_1, "int4"), (Q.Q4_0, "int4_sym"),
                                       (Q.Q8_0, "int8_block")], ids=["Q4_1", "Q4_0", "Q8_0"])
def test_kept_blocks_are_the_files_values_and_compute_its_logits(tmp_path, qlm, kind, fmt):
    """The kept tree dequantizes to exactly what llama.cpp's reference dequantizes
    (rows permuted, transposed, never rounded), and the model computes the float
    model's logits."""
    from jaxformer.nn.quant_params import dequantize_params, param_bytes  # noqa: PLC0415

    path = quantized_file(tmp_path / "q.gguf", qlm[1], kind)
    model, kept, _ = llama.load_gguf(path, quantize="keep")
    assert (model.config.weight_quant, model.config.embed_quant) == (fmt, "int8_block")
    float_model, floats, _ = llama.load_gguf(path)
    config, back = dequantize_params(model.config, kept)
    assert config == float_model.config
    jax.tree_util.tree_map(np.testing.assert_array_equal, back, floats)
    assert param_bytes(kept) < 0.4 * param_bytes(floats)  # norms are a large part here
    tokens = jnp.array([[3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    np.testing.assert_allclose(model.apply({"params": kept}, tokens),
                               float_model.apply({"params": floats}, tokens), atol=1e-5)


def test_keeping_refuses_what_it_cannot_keep_by_name(tmp_path, qlm):
    params = qlm[1]
    tensors = gguf_tensors(params, QCONFIG)
    del tensors["blk.0.ffn_gate.weight"]  # (32, 32): one 32-wide IQ4_NL block (18 bytes) a row
    raw = {"blk.0.ffn_gate.weight": (np.zeros((32, 18), np.uint8), Q.IQ4_NL)}
    iq4 = write_gguf(tmp_path / "iq4.gguf", tensors, QCONFIG, raw=raw)
    with pytest.raises(ValueError, match="'blk.0.ffn_gate.weight' has quantization type IQ4_NL"):
        llama.load_gguf(iq4, quantize="keep")
    partly = quantized_file(tmp_path / "partly.gguf", params, Q.Q4_1,
                            override={"blk.0.attn_v.weight": Q.F32})
    with pytest.raises(ValueError, match="needs every layer kernel quantized, the file mixes "
                                         "F32, Q4_1"):
        llama.load_gguf(partly, quantize="keep")
    floats = write_gguf(tmp_path / "f32.gguf", gguf_tensors(params, QCONFIG), QCONFIG)
    with pytest.raises(ValueError, match="the layer kernels are F32: load it with "
                                         "quantize='int8' or 'int4'"):
        llama.load_gguf(floats, quantize="keep")
    with pytest.raises(ValueError, match="quantize='int3' is not a quantized layout"):
        llama.load_gguf(floats, quantize="int3")
    q41 = quantized_file(tmp_path / "q41.gguf", params, Q.Q4_1)
    with pytest.raises(ValueError, match=r"quantize='int8', but the file's layer kernels are "
                                         r"already quantized \(int4\): load it with "
                                         r"quantize='keep'"):
        llama.load_gguf(q41, quantize="int8")
    from jaxformer.models import load  # noqa: PLC0415

    with pytest.raises(ValueError, match="a Hugging Face directory holds float weights"):
        load(tmp_path, quantize="keep")  # refused before anything is read
    with pytest.raises(ValueError, match="quantize='int3' is not a quantized layout"):
        load(tmp_path, quantize="int3")


def test_a_float_file_quantizes_at_load(tmp_path, qlm):
    from jaxformer.nn.quant_params import quantize_params  # noqa: PLC0415

    path = write_gguf(tmp_path / "f32.gguf", gguf_tensors(qlm[1], QCONFIG), QCONFIG)
    model, params, _ = llama.load_gguf(path, quantize="int8")
    float_model, floats, _ = llama.load_gguf(path)
    config, want = quantize_params(float_model.config, floats, "int8")
    assert model.config == config
    jax.tree_util.tree_map(np.testing.assert_array_equal, params, want)


def test_tensors_leave_host_memory_one_at_a_time(tmp_path, make_lm):
    """Each tensor becomes a JAX array as it is read: the host never holds every tensor
    (numpy's allocations, traced by tracemalloc) at once, so the C heap is not left
    holding a freed copy of the whole model (an idle server's RSS)."""
    import tracemalloc

    config = CONFIG.replace(d_model=64, d_ff=128, num_decoder_layers=8)
    model, params = make_lm(config, seed=1)
    path = write_gguf(tmp_path / "eight.gguf", gguf_tensors(params, config), config=config)
    file = read_gguf(path)
    cfg = llama.config_from_gguf(file)
    tracemalloc.start()
    try:
        loaded = llama.params_from_gguf(file, cfg, progress=False)
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    total = jf.nn.param_bytes(loaded)  # (a CPU array may keep its numpy buffer: `held`)
    assert peak - held < total / 10, (peak, held, total)  # before: all at once, 0.26


def mapped_bytes(path) -> int:
    """Resident bytes of this process's memory maps of `path` (/proc/self/smaps)."""
    total, current = 0, False
    with open("/proc/self/smaps") as maps:
        for line in maps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                current = len(fields) > 5 and fields[5] == str(path)
            elif current and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc")
def test_a_loaded_model_keeps_nothing_of_the_files_memory_map(tmp_path, qlm):
    """jax.device_put aliases a float32 view of the mapped file on a CPU: one such norm
    weight kept every page of the file resident after loading (copied now)."""
    import gc  # noqa: PLC0415

    path = quantized_file(tmp_path / "q.gguf", qlm[1], Q.Q8_0)
    for quantize in (None, "keep"):
        loaded = llama.load_gguf(path, quantize=quantize)
        gc.collect()
        assert mapped_bytes(path) == 0, quantize
        del loaded


def test_the_plain_array_reader_reads_what_gguf_reads(tmp_path, qlm):
    from jaxformer.interop.gguf import PlainArrayReader  # noqa: PLC0415

    path = quantized_file(tmp_path / "q.gguf", qlm[1], Q.Q4_1)
    want, got = gguf.GGUFReader(path), PlainArrayReader(path)
    assert not isinstance(got.data, np.memmap)  # what makes it fast
    assert list(got.fields) == list(want.fields)
    for key, field in want.fields.items():
        assert got.fields[key].contents() == field.contents(), key
    assert [t.name for t in got.tensors] == [t.name for t in want.tensors]
    for mine, theirs in zip(got.tensors, want.tensors):
        assert (mine.tensor_type, mine.data_offset) == (theirs.tensor_type, theirs.data_offset)
        np.testing.assert_array_equal(mine.data, theirs.data)


@pytest.mark.parametrize("kind, fmt", [(Q.Q4_1, "int4"), (Q.Q4_0, "int4_sym"),
                                       (Q.Q8_0, "int8_block")], ids=["Q4_1", "Q4_0", "Q8_0"])
def test_kept_blocks_dequantize_to_the_gguf_references_values(kind, fmt):
    """Guards the kept Q4_1 offset's sign (its "min", w = d * q + m): the blocks kept
    as they are dequantize to exactly what the `gguf` package (llama.cpp's reference)
    dequantizes, on weights whose blocks have negative and positive minimums. (The
    load test compares against the file's own float load, which reads the same kept
    blocks.)"""
    from jaxformer.interop import gguf_blocks  # noqa: PLC0415
    from jaxformer.nn import quant  # noqa: PLC0415

    rng = np.random.default_rng(7)
    w = (rng.normal(size=(6, 96)) + rng.uniform(-2, 2, (6, 1))).astype(np.float32)
    raw = gguf.quants.quantize(w, kind)
    parts, exact = gguf_blocks.decode(raw, kind, 96)
    assert exact and set(parts) == set(quant.parts_of(fmt))
    want = np.asarray(gguf.quants.dequantize(raw, kind), np.float32).reshape(6, 96)
    np.testing.assert_array_equal(np.asarray(quant.dequantize(parts, fmt, 32, -1)), want)
    np.testing.assert_array_equal(gguf_blocks.encode(parts, kind), raw)
    if kind == Q.Q4_1:  # the offset is llama.cpp's "min": each block's smallest value
        offsets = np.asarray(parts["offset"], np.float32)
        np.testing.assert_array_equal(offsets, want.reshape(6, 3, 32).min(-1))
        assert (offsets < 0).any() and (offsets > 0).any()


def test_auto_keeps_quantized_blocks_and_loads_the_rest_as_float(tmp_path, qlm):
    """quantize="auto" (the commands' default): "keep" where the layer kernels are
    quantized, float for a float file and a directory; a file it cannot keep loads as
    float with a warning saying why. The library's own default stays float."""
    from jaxformer.models import load  # noqa: PLC0415

    q41 = quantized_file(tmp_path / "q41.gguf", qlm[1], Q.Q4_1)
    assert load(q41, quantize="auto")[0].config == load(q41, quantize="keep")[0].config
    assert load(q41)[0].config.weight_quant is None
    floats = write_gguf(tmp_path / "f32.gguf", gguf_tensors(qlm[1], QCONFIG), QCONFIG)
    assert load(floats, quantize="auto")[0].config == load(floats)[0].config
    partly = quantized_file(tmp_path / "partly.gguf", qlm[1], Q.Q4_1,
                            override={"blk.0.attn_v.weight": Q.F32})
    with pytest.warns(UserWarning, match="the file mixes F32, Q4_1; loaded as float"):
        assert load(partly, quantize="auto")[0].config.weight_quant is None

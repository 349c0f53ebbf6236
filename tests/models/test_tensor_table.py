"""`jaxformer.models.tensor_table` and the Llama family's table: each transform against
an index-by-index reference and its inverse, the table against the parameters every
family config builds, and the table as the one place naming the family's tensors."""

import pathlib

import jax
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.interop.flat import CheckpointMismatch, abstract_params, flatten
from jaxformer.models import encdec_tensors, hf_encdec
from jaxformer.models import tensor_table as tt
from jaxformer.models.llama_tensors import LLAMA

DIMS = dict(D=6, H=3, G=1, K=4, F=5, V=7)
ORDER = np.array([2, 0, 3, 1])  # a per-head feature permutation (not its own inverse)


def row(kind, heads="", rope_rows=False):
    return tt.Tensor("x", "x", "x", "D", kind, heads, rope_rows)


def test_heads_in_moves_each_element_where_the_index_formula_says():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(3 * 4, 6)).astype(np.float32)  # (H*K, D), torch Linear
    got = tt.to_params(row(tt.HEADS_IN, "H", rope_rows=True), w, DIMS, ORDER)
    want = np.empty((6, 3, 4), np.float32)
    for d in range(6):
        for h in range(3):
            for k in range(4):
                want[d, h, k] = w[h * 4 + ORDER[k], d]
    np.testing.assert_array_equal(got, want)
    plain = tt.to_params(row(tt.HEADS_IN, "H"), w, DIMS, ORDER)  # no rope rows: no order
    np.testing.assert_array_equal(plain, w.T.reshape(6, 3, 4))


def test_heads_out_and_head_bias_by_index():
    rng = np.random.default_rng(1)
    w = rng.normal(size=(6, 3 * 4)).astype(np.float32)  # (D, H*K)
    got = tt.to_params(row(tt.HEADS_OUT, "H"), w, DIMS)
    assert got.shape == (3, 4, 6) and got[2, 1, 5] == w[5, 2 * 4 + 1]
    assert tt.to_params(row(tt.HEADS_OUT, "H"), w, DIMS, blocks=True).shape == (12, 6)
    b = np.arange(3 * 4, dtype=np.float32)
    got = tt.to_params(row(tt.HEAD_BIAS, "H", rope_rows=True), b, DIMS, ORDER)
    assert got[1].tolist() == [4 + i for i in ORDER]


def test_conv_and_row_by_index():
    """torch Conv1d (out, in, width) -> flax Conv (width, in, out); a (1, V) row -> (V,)."""
    w = np.random.default_rng(3).normal(size=(6, 5, 3)).astype(np.float32)
    got = tt.to_params(row(tt.CONV), w, DIMS)
    assert got.shape == (3, 5, 6) and got[2, 1, 4] == w[4, 1, 2] and got[0, 3, 1] == w[1, 3, 0]
    assert tt.to_params(row(tt.ROW), np.arange(7.0)[None], DIMS).tolist() == list(range(7))


@pytest.mark.parametrize("kind,heads,shape", [
    (tt.VECTOR, "", (6,)), (tt.NORM, "", (6,)), (tt.HEAD_NORM, "", (4,)),
    (tt.EMBEDDING, "", (7, 6)), (tt.LINEAR, "", (5, 6)), (tt.HEADS_IN, "G", (4, 6)),
    (tt.HEADS_IN, "H", (12, 6)), (tt.HEADS_OUT, "H", (6, 12)), (tt.HEAD_BIAS, "G", (4,)),
    (tt.CONV, "", (6, 5, 3)), (tt.ROW, "", (1, 7))])
def test_to_file_inverts_to_params(kind, heads, shape):
    """With the inverse order back: the file tensor exactly; with the same order: not
    (where the order applies), so the order is really used both ways."""
    value = np.random.default_rng(2).normal(size=shape).astype(np.float32)
    spec = row(kind, heads, rope_rows=True)
    params = tt.to_params(spec, value, DIMS, ORDER)
    np.testing.assert_array_equal(tt.to_file(spec, params, DIMS, np.argsort(ORDER)), value)
    if kind in (tt.HEAD_NORM, tt.HEADS_IN, tt.HEAD_BIAS):
        assert not np.array_equal(tt.to_file(spec, params, DIMS, ORDER), value)


FAMILIES = {
    "llama": dict(),
    "llama_untied_biased": dict(tie_output_embedding=False, attention_biases="qkvo",
                                ffn_bias=True),
    "qwen2": dict(attention_biases="qkv"),
    "qwen3": dict(qk_norm=True),
    "gemma3": dict(qk_norm=True, norm="sandwich", norm_scale_plus_one=True,
                   scale_embeddings=True),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_table_is_every_parameter_of_the_model_with_its_shape(family):
    config = jf.llama(src_vocab_size=7, tgt_vocab_size=7, d_model=8, num_heads=2,
                      num_kv_heads=1, head_dim=4, d_ff=12, num_decoder_layers=2, max_len=16,
                      **FAMILIES[family])
    model = jf.DecoderOnlyLM(config)
    abstract = flatten(jax.eval_shape(model.init, jax.random.PRNGKey(0),
                                      jax.ShapeDtypeStruct((1, 4), np.int32))["params"])
    entries = tt.entries(LLAMA, config)
    assert sorted(e.ours for e in entries) == sorted(abstract)
    dims = LLAMA.dims(config)
    for e in entries:  # the file shape, moved to jaxformer's layout, is the parameter's
        moved = tt.to_params(e.row, np.zeros(e.shape, np.float32), dims)
        assert moved.shape == abstract[e.ours].shape, e.ours
    for fmt in tt.FORMATS:  # no two tensors share a file name
        assert len(tt.file_shapes(LLAMA, config, fmt)) == len(entries)


ENCDEC = {  # tiny config.json values, one per family
    encdec_tensors.WHISPER: dict(max_source_positions=6, max_target_positions=5,
                                 eos_token_id=10, pad_token_id=10, decoder_start_token_id=9),
    encdec_tensors.MARIAN: dict(max_position_embeddings=16, pad_token_id=10, eos_token_id=0,
                                activation_function="swish"),
}


@pytest.mark.parametrize("arch", sorted(ENCDEC))
def test_the_encdec_tables_are_every_parameter_of_the_model_with_its_shape(arch):
    values = dict(architectures=[arch], d_model=8, vocab_size=11, encoder_layers=2,
                  decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                  encoder_ffn_dim=12, decoder_ffn_dim=12, **ENCDEC[arch])
    config = hf_encdec.config_from_hf_encdec(values)
    mel = 3 if arch == encdec_tensors.WHISPER else 0
    ids = jax.ShapeDtypeStruct((1, 1), np.int32)
    src = jax.ShapeDtypeStruct((1, 12, mel), np.float32) if mel else ids
    abstract = flatten(abstract_params(hf_encdec.build(config, arch), src, ids))
    entries = hf_encdec.tensor_entries(config, arch, mel)
    computed = ({"encoder/positions/embedding", "decoder/positions/embedding"}
                if arch == encdec_tensors.MARIAN else set())  # Marian's sinusoids
    assert sorted(e.ours for e in entries) == sorted(set(abstract) - computed)
    dims = encdec_tensors.tables(arch, mel)[0].dims(config)
    for e in entries:
        moved = tt.to_params(e.row, np.zeros(e.shape, np.float32), dims)
        assert moved.shape == abstract[e.ours].shape, e.ours
    assert len({e.hf for e in entries}) == len(entries)


def test_shape_check_lists_every_problem_in_one_error():
    want = {"a": (2, 3), "b": (4,), "c": (1,)}
    with pytest.raises(CheckpointMismatch) as error:
        tt.check_shapes(want, {"a": (3, 2), "b": (4,), "d": (1,)})
    assert (error.value.missing, error.value.unexpected) == (["c"], ["d"])
    assert error.value.wrong_shape == {"a": ((3, 2), (2, 3))}
    tt.check_shapes(want, dict(want))


def test_the_family_s_tensor_names_are_spelled_in_its_table_alone():
    """The readers (jaxformer/interop) name tensors in their docstrings' examples only;
    likewise the encoder-decoder families' (Hugging Face names) in theirs."""
    package = pathlib.Path(jf.__file__).parent
    names = ("q_proj", "o_proj", "gate_proj", "attn_q", "attn_output", "ffn_gate.",
             "input_layernorm", "post_attention_layernorm", "token_embd")
    spelled = {str(p.relative_to(package)) for p in package.rglob("*.py")
               if p.parent.name != "interop" and any(n in p.read_text() for n in names)}
    assert spelled == {"models/llama_tensors.py"}
    encdec = ("encoder_attn", "fc1", "self_attn_layer_norm", "embed_positions", "model.shared",
              "conv1.weight", '"final_logits_bias"')
    spelled = {str(p.relative_to(package)) for p in package.rglob("*.py")
               if p.parent.name != "interop" and any(n in p.read_text() for n in encdec)}
    assert spelled == {"models/encdec_tensors.py"}

"""GGUF SentencePiece vocabularies (`tokenizer.ggml.model == "llama"`) against sentencepiece.

The `sentencepiece` package trains a tiny BPE model here (Llama's settings:
identity normalization, spaces kept as they are, byte fallback); its
vocabulary is written into a GGUF file as llama.cpp's converter writes one
(pieces, scores, token types, BOS/EOS/UNK ids, add_space_prefix from the
model's add_dummy_prefix). jaxformer's tokenizer from that file must give
sentencepiece's own ids on varied text and decode them back, and a tiny
llama model with that vocabulary loads end to end through
`jaxformer.models.load`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="GGUF import needs the `llm` extra")
pytest.importorskip("tokenizers", reason="needs the `llm` extra")
spm = pytest.importorskip("sentencepiece", reason="the reference needs the `test` extra")

from jaxformer.interop.gguf import read_gguf  # noqa: E402
from jaxformer.text.gguf_vocab import tokenizer_from_gguf  # noqa: E402
from jaxformer.models import load  # noqa: E402

CORPUS = """The quick brown fox jumps over the lazy dog.
A functional transformer library in JAX: encoders, decoders, caches and training.
Numbers like 12, 345 and 2026 appear in text; so do tabs\tand  double  spaces.
Llamas and foxes are animals. The dog sleeps; the fox runs; the llama eats grass.
Tokenizers split text into pieces, and pieces into ids, then decode them again.
""" * 4
TEXTS = [
    "The quick brown fox",
    "  leading spaces and trailing ones   ",
    "line one\nline two\n\n  indented third",
    "unicode outside the vocabulary: héllo wörld 日本語 🦙!",
    "digits 0123456789 and 3.14159, 2026-11-25",
    "tabs\tbetween\twords and double  spaces",
    " ",
    "x",
]


@pytest.fixture(scope="module", params=[True, False], ids=["space_prefix", "no_prefix"])
def sp(request, tmp_path_factory):
    """A trained SentencePiece BPE model (with or without the dummy space prefix)."""
    directory = tmp_path_factory.mktemp("spm")
    corpus = directory / "corpus.txt"
    corpus.write_text(CORPUS, encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(directory / "m"), model_type="bpe",
        vocab_size=400, hard_vocab_limit=False, byte_fallback=True, character_coverage=1.0,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=request.param, split_digits=True, minloglevel=2)
    return spm.SentencePieceProcessor(model_file=str(directory / "m.model")), request.param


def converter_vocab(processor):
    """(tokens, scores, token types) as llama.cpp convert_hf_to_gguf.py's
    _create_vocab_sentencepiece reads them."""
    T = gguf.TokenType
    tokens, scores, types = [], [], []
    for i in range(processor.get_piece_size()):
        tokens.append(processor.id_to_piece(i))
        scores.append(processor.get_score(i))
        types.append(T.UNKNOWN if processor.is_unknown(i) else T.CONTROL
                     if processor.is_control(i) else T.UNUSED if processor.is_unused(i)
                     else T.BYTE if processor.is_byte(i) else T.NORMAL)
    return tokens, scores, [int(t) for t in types]


def write_llama_gguf(path, processor, space_prefix, *, d=8, layers=1, seed=0):
    """A tiny random llama model carrying the SentencePiece vocabulary."""
    tokens, scores, types = converter_vocab(processor)
    V, F = len(tokens), 16
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(64)
    writer.add_embedding_length(d)
    writer.add_feed_forward_length(F)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(d // 2)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_add_space_prefix(space_prefix)
    writer.add_bos_token_id(processor.bos_id())
    writer.add_eos_token_id(processor.eos_id())
    writer.add_unk_token_id(processor.unk_id())
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    r = np.random.default_rng(seed)
    shapes = {"token_embd.weight": (V, d), "output_norm.weight": (d,)}
    for i in range(layers):
        shapes.update({f"blk.{i}.{n}.weight": s for n, s in [
            ("attn_norm", (d,)), ("ffn_norm", (d,)), ("attn_q", (d, d)), ("attn_k", (d, d)),
            ("attn_v", (d, d)), ("attn_output", (d, d)), ("ffn_gate", (F, d)),
            ("ffn_up", (F, d)), ("ffn_down", (d, F))]})
    for name, shape in shapes.items():
        writer.add_tensor(name, r.normal(size=shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.fixture(scope="module")
def written(sp, tmp_path_factory):
    processor, prefix = sp
    path = write_llama_gguf(tmp_path_factory.mktemp("gguf") / "spm.gguf", processor, prefix)
    return processor, prefix, path, tokenizer_from_gguf(read_gguf(path))


def test_ids_equal_sentencepiece(written):
    processor, _, _, tokenizer = written
    assert any(p.startswith("<0x") for p in map(processor.id_to_piece,
                                                 processor.encode(TEXTS[3])))  # byte fallback
    for text in TEXTS:
        want = processor.encode(text)
        assert tokenizer.encode(text, add_special_tokens=False).ids == want, text
        assert tokenizer.encode(text).ids == [processor.bos_id()] + want, text  # add_bos_token


def test_decode_round_trips(written):
    processor, _, _, tokenizer = written
    for text in TEXTS:
        ids = tokenizer.encode(text).ids
        assert tokenizer.decode(ids) == processor.decode(ids[1:]) == text


def test_the_space_prefix_is_the_files(written):
    """With and without add_space_prefix the ids differ (sentencepiece agrees with both)."""
    processor, prefix, _, tokenizer = written
    ids = tokenizer.encode("fox", add_special_tokens=False).ids
    assert processor.id_to_piece(ids[0]).startswith("\u2581") == prefix


def test_control_tokens_are_matched_whole(written):
    processor, _, _, tokenizer = written
    ids = tokenizer.encode("the fox</s>", add_special_tokens=False).ids
    assert ids[-1] == processor.eos_id() and ids[:-1] == processor.encode("the fox")


def test_a_llama_gguf_with_it_loads_end_to_end(written):
    processor, _, path, _ = written
    model, params, tokenizer = load(path)
    assert (model.config.tgt_vocab_size, model.config.bos_id, model.config.eos_id) == (
        processor.get_piece_size(), processor.bos_id(), processor.eos_id())
    ids = tokenizer.encode(TEXTS[0]).ids
    assert ids == [processor.bos_id()] + processor.encode(TEXTS[0])
    logits = jax.jit(model.apply)({"params": params}, jnp.asarray([ids]))
    assert logits.shape == (1, len(ids), processor.get_piece_size())
    assert np.isfinite(np.asarray(logits)).all()

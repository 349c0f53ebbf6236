"""Chat templates (`jaxformer.text.chat`, `jaxformer generate --chat`) against
transformers' `apply_chat_template` on SmolLM2-135M-Instruct's own template."""

import json

import numpy as np
import pytest

from jaxformer.text import chat_template, render_chat

CONVERSATIONS = [
    [{"role": "user", "content": "What is 12 times 7?"}],
    [{"role": "system", "content": "Answer in French."},
     {"role": "user", "content": "Hello!"},
     {"role": "assistant", "content": "Bonjour !"},
     {"role": "user", "content": "Ça va ?\n  Tabs\tand spaces "}],
]


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2):
    transformers = pytest.importorskip("transformers", reason="the reference needs transformers")
    _, _, tokenizer, path = smollm2
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|im_start|>", eos_token="<|im_end|>",
        chat_template=chat_template(path))


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_the_gguf_template_renders_as_transformers(smollm2, hf_tokenizer, messages,
                                                   add_generation_prompt):
    template = chat_template(smollm2[3])
    assert template and "<|im_start|>" in template  # SmolLM2-Instruct ships ChatML
    got = render_chat(template, messages, add_generation_prompt=add_generation_prompt,
                      bos_token="<|im_start|>", eos_token="<|im_end|>")
    want = hf_tokenizer.apply_chat_template(messages, tokenize=False,
                                            add_generation_prompt=add_generation_prompt)
    assert got == want
    assert got.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_a_directory_template_is_read_from_either_file(tmp_path):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    assert chat_template(tmp_path) == template
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}")  # newer files win
    assert chat_template(tmp_path) == "{{ bos_token }}"
    refusing = "{{ raise_exception('only user messages') }}"
    with pytest.raises(ValueError, match="refuses these messages: only user messages"):
        render_chat(refusing, CONVERSATIONS[0])


def test_cli_chat_sends_the_templated_ids(smollm2, hf_tokenizer, monkeypatch, capsys):
    """`generate --chat --system`: the decoded batch is the tokenizer's ids of transformers'
    rendering (specials written by the template, none added); the reply alone is printed."""
    import jaxformer.decode.api
    import jaxformer.decode.stream
    import jaxformer.models
    from jaxformer.cli.main import main
    from jaxformer.decode.loop import DecodeResult

    model, params, tokenizer, path = smollm2
    monkeypatch.setattr(jaxformer.models, "load", lambda p: (model, params, tokenizer))
    seen = {}
    reply = tokenizer.encode(" Eighty-four.").ids + [model.config.eos_id]

    def fake_generate(model, params, batch, *, prompt_lengths, **kwargs):
        seen["batch"], seen["lengths"] = np.asarray(batch), np.asarray(prompt_lengths)
        return DecodeResult(tokens=np.array([reply]), lengths=np.array([len(reply)]))

    def fake_stream(*args, **kwargs):  # one prompt streams: the reply in two chunks
        tokens = fake_generate(*args, **kwargs).tokens
        return iter([tokens[:, :1], tokens[:, 1:]])

    monkeypatch.setattr(jaxformer.decode.api, "generate", fake_generate)
    monkeypatch.setattr(jaxformer.decode.stream, "generate_stream", fake_stream)
    capsys.readouterr()
    assert main(["generate", "--model", path, "--chat", "--system", "Be brief.",
                 "What is 12 times 7?", "--max-new-tokens", "8", "--dequantize"]) == 0
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is 12 times 7?"}]
    want = hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert seen["batch"][0, :seen["lengths"][0]].tolist() == list(want)
    assert capsys.readouterr().out == " Eighty-four.\n"


def test_cli_chat_refusals_are_one_line(smollm2, tmp_path, capsys):
    from jaxformer.cli.main import main

    cases = [(["generate", "--model", smollm2[3], "--system", "x", "hi"], "--system needs --chat"),
             (["generate", "--run", str(tmp_path), "--chat", "hi"], "has no chat template"),
             (["generate", "--model", str(tmp_path), "--chat", "hi"], "has no chat template")]
    for argv, message in cases:
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err


def test_encode_chat_is_the_template_text_encoded_with_no_specials_added():
    """`encode_chat` (the CLI's and the server's one encoder): the template writes BOS from
    the tokenizer's own token text, the tokenizer adds none (no doubled BOS); a tokenizer
    without token names (bytes) gives the template "" for each special."""
    from jaxformer.text import ByteTokenizer, encode_chat

    template = ("{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]

    class Named(ByteTokenizer):
        def token_text(self, token_id):
            return {self.bos_id: "<s>", self.eos_id: "</s>", self.pad_id: "<pad>"}[token_id]

    ids = encode_chat(template, Named(), messages)
    assert ids == Named().encode("<s><system>Be brief.<user>Hi<assistant>").tolist()
    assert all(type(i) is int for i in ids)
    assert encode_chat(template, ByteTokenizer(), iter(messages), add_generation_prompt=False
                       ) == ByteTokenizer().encode("<system>Be brief.<user>Hi").tolist()

"""Chat templates: the Jinja text a chat model's checkpoint ships to format conversations.

    template = chat_template("SmolLM2-135M-Instruct.gguf")   # or a Hugging Face directory
    text = render_chat(template, [{"role": "user", "content": "Hi"}], bos_token="<s>")
    ids = encode_chat(template, tokenizer, [{"role": "user", "content": "Hi"}])

The template comes from `chat_template.jinja` or `tokenizer_config.json` in a
directory, or the GGUF key `tokenizer.chat_template`. It is rendered as
`transformers`' `apply_chat_template` renders it (a sandboxed Jinja environment
with `trim_blocks`/`lstrip_blocks` and the same helper functions); the text
then goes to the tokenizer without added specials, since the template writes them
(`encode_chat`: messages to ids, the one encoder of the CLI and the server).
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Optional

from jaxformer.errors import FileFormatError


def chat_template(path) -> Optional[str]:
    """The chat template of a checkpoint (a Hugging Face directory or a GGUF file), or None."""
    path = os.fspath(path)
    if os.path.isfile(path):
        from jaxformer.interop.gguf import read_string_value  # noqa: PLC0415 - optional reader

        return read_string_value(path, "tokenizer.chat_template")
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    config_file = os.path.join(path, "tokenizer_config.json")
    if not os.path.isfile(config_file):
        return None
    try:
        with open(config_file, encoding="utf-8") as f:
            template = json.load(f).get("chat_template")
    except (OSError, ValueError) as error:
        raise FileFormatError(config_file, f"is not readable JSON ({error})") from error
    if isinstance(template, list):  # named templates: the default one
        template = {t.get("name"): t.get("template") for t in template}.get("default")
    return template if isinstance(template, str) else None


def render_chat(template: str, messages: list[dict], *, add_generation_prompt: bool = True,
                **special_tokens: str) -> str:
    """The conversation `messages` ([{"role", "content"}, ...]) as the template writes it;
    `special_tokens` (bos_token="<s>", eos_token=...) are the template's variables.
    Raises ValueError with the template's own message when it refuses the messages."""
    try:
        import jinja2  # noqa: PLC0415 - optional (the `llm` extra)
        import jinja2.ext  # noqa: PLC0415
        from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415
    except ImportError as error:
        raise ImportError("chat templates need jinja2 (pip install 'jaxformer[llm]')"
                          ) from error

    def raise_exception(message):
        raise ValueError(f"the chat template refuses these messages: {message}")

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        compiled = env.from_string(template)
    except jinja2.TemplateError as error:
        raise ValueError(f"the chat template is not valid Jinja: {error}") from error
    return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                           **special_tokens)


def encode_chat(template: str, tokenizer, messages, *,
                add_generation_prompt: bool = True) -> list[int]:
    """The ids of the conversation `messages` as `template` writes it, ready for the
    assistant's reply (`jaxformer generate --chat` and the server's /v1/chat/completions).

    BOS and the other specials are the template's: it is given the tokenizer's
    bos/eos/pad token texts (`token_text`; "" for a tokenizer without names, as bytes)
    and writes them where the model expects them, and the text is encoded with no
    specials added, so a template's BOS is never doubled (transformers'
    `apply_chat_template(tokenize=True)`). Raises ValueError (the template refuses the
    messages or is not valid Jinja) or ImportError (no jinja2), as `render_chat`.
    """
    name = getattr(tokenizer, "token_text", None) or (lambda i: "")
    specials = {f"{role}_token": name(getattr(tokenizer, f"{role}_id"))
                for role in ("bos", "eos", "pad")}
    rendered = render_chat(template, list(messages),
                           add_generation_prompt=add_generation_prompt, **specials)
    return [int(i) for i in tokenizer.encode(rendered)]

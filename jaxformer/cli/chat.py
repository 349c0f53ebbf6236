"""`jaxformer generate --chat`: each prompt as a user message in the model's chat template."""

from __future__ import annotations

from typing import Optional

from jaxformer.cli.usage import UsageError


def read_template(model_path: Optional[str], run_dir: Optional[str] = None) -> str:
    """The chat template of `--model`, or of a `--run` fine-tuned from a chat model
    (its chat_template.jinja); read before the weights, so a refusal is immediate."""
    from jaxformer.text import chat_template  # noqa: PLC0415
    from jaxformer.train.run import saved_chat_template  # noqa: PLC0415

    source = model_path if model_path is not None else run_dir
    try:
        template = (chat_template(source) if model_path is not None
                    else saved_chat_template(run_dir))
    except ValueError as error:
        raise UsageError(str(error)) from error
    if template is None:
        raise UsageError(f"--chat: {source} has no chat template (tokenizer.chat_template "
                         "in a GGUF file, chat_template.jinja or chat_template in "
                         "tokenizer_config.json in a directory; a run has one when it was "
                         "fine-tuned from a chat model)")
    return template


def chat_prompts(template: str, tokenizer, texts: list[str],
                 system: Optional[str] = None) -> list[list[int]]:
    """The ids of each text as a one-turn conversation ready for the assistant's reply,
    the template writing the special tokens (`text.encode_chat`, the server's encoder)."""
    from jaxformer.text import encode_chat  # noqa: PLC0415

    prompts = []
    for text in texts:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": text}]
        try:
            prompts.append(encode_chat(template, tokenizer, messages))
        except (ValueError, ImportError) as error:
            raise UsageError(f"--chat: {error}") from error
    return prompts

"""The tokenizer a pretrained checkpoint ships: `tokenizer.json` in a Hugging Face
directory, or the vocabulary of a GGUF file, as a `tokenizers.Tokenizer`."""

from __future__ import annotations

import os

from jaxformer.errors import FileFormatError


def tokenizer_from_dir(directory):
    """The directory's `tokenizer.json` as a `tokenizers.Tokenizer`, or None without one."""
    path = os.path.join(os.fspath(directory), "tokenizer.json")
    if not os.path.exists(path):
        return None
    import tokenizers  # noqa: PLC0415 - optional

    try:
        return tokenizers.Tokenizer.from_file(path)
    except Exception as error:  # tokenizers raises its own Exception type
        raise FileFormatError(path, f"cannot be read as a tokenizers JSON file ({error})",
                              "it is damaged, or not a Hugging Face tokenizer.json") from error


def checkpoint_tokenizer(path):
    """The `tokenizers.Tokenizer` of a checkpoint directory or .gguf file (None if it has
    none), without reading the weights."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return tokenizer_from_dir(path)
    from jaxformer.interop.gguf import read_gguf  # noqa: PLC0415 - optional reader
    from jaxformer.text.gguf_vocab import tokenizer_from_gguf  # noqa: PLC0415

    return tokenizer_from_gguf(read_gguf(path))

"""One entry point for pretrained language models: `load(path)`.

    from jaxformer.models import load
    model, params, tokenizer = load("path/to/Qwen3-0.6B")       # a Hugging Face directory
    model, params, tokenizer = load("SmolLM2-135M.Q4_1.gguf")   # a GGUF file

A directory is read as a Hugging Face checkpoint (`config.json` + safetensors,
`jaxformer.models.hf`); a file as GGUF (`jaxformer.models.llama`). The readers
are imported on first use, so `import jaxformer.models` stays light.
"""

from __future__ import annotations

import os
from typing import Optional

from jaxformer.errors import FileFormatError


def load(path, *, dtype: str = "float32", max_len: Optional[int] = None,
         progress: Optional[bool] = None):
    """(DecoderOnlyLM, params, tokenizer) from a checkpoint directory or a .gguf file.

    `max_len` caps the context (default: the checkpoint's). The tokenizer is a
    `tokenizers.Tokenizer` (None for a directory without `tokenizer.json`).
    `progress`: a tqdm bar on stderr, one step per tensor read (None: only if
    stderr is a terminal; True / False force it on / off).
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        from jaxformer.models.hf import load_hf  # noqa: PLC0415 - optional readers

        return load_hf(path, dtype=dtype, max_len=max_len, progress=progress)
    if os.path.isfile(path):
        from jaxformer.models.llama import load_gguf  # noqa: PLC0415 - optional readers

        return load_gguf(path, dtype=dtype, max_len=max_len, progress=progress)
    raise FileFormatError(path, "no such checkpoint directory or GGUF file",
                          "pass a Hugging Face directory (config.json + *.safetensors) "
                          "or a .gguf file")

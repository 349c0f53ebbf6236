"""Per-model configurations and weight mappings built from jaxformer's blocks (no new layers).

`load(path)`: a Hugging Face checkpoint directory (decoder-only, Whisper or Marian)
or a GGUF file -> (model, params, tokenizer).
"""

from jaxformer.models.gguf_export import save_gguf
from jaxformer.models.hf_export import save_hf
from jaxformer.models.loader import load
from jaxformer.models.torch_modules import from_torch_decoder_only, from_torch_transformer


def __getattr__(name: str):
    """`load_gguf` on first use: its module needs the optional `gguf` package (the `llm`
    extra), and `import jaxformer.models` must work without it."""
    if name == "load_gguf":
        from jaxformer.models.llama import load_gguf  # noqa: PLC0415

        return load_gguf
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["gguf_export", "hf", "hf_encdec", "hf_export", "llama", "torch_modules",
           "whisper", "load", "load_gguf", "save_gguf", "save_hf", "from_torch_decoder_only",
           "from_torch_transformer"]

"""Per-model configurations and weight mappings built from jaxformer's blocks (no new layers).

`load(path)`: a Hugging Face checkpoint directory (decoder-only, Whisper or Marian)
or a GGUF file -> (model, params, tokenizer).
"""

from jaxformer.models.load import load, load_tokenizer

__all__ = ["audio", "chat", "hf", "hf_encdec", "hf_export", "llama", "load", "load_tokenizer",
           "transcribe", "whisper"]

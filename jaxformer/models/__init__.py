"""Per-model configurations and weight mappings built from jaxformer's blocks (no new layers).

`load(path)`: a Hugging Face checkpoint directory or a GGUF file -> (model, params,
tokenizer).
"""

from jaxformer.models.load import load

__all__ = ["audio", "hf", "llama", "load", "transcribe", "whisper"]

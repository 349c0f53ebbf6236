"""Per-model configurations and weight mappings built from jaxformer's blocks (no new layers).

`load(path)`: a Hugging Face checkpoint directory (decoder-only, Whisper or Marian)
or a GGUF file -> (model, params, tokenizer).
"""

from jaxformer.models.hf_export import save_hf
from jaxformer.models.llama import load_gguf
from jaxformer.models.loader import load
from jaxformer.models.torch_modules import from_torch_decoder_only, from_torch_transformer

__all__ = ["audio", "hf", "hf_encdec", "hf_export", "llama", "torch_modules", "transcribe",
           "whisper", "load", "load_gguf", "save_hf", "from_torch_decoder_only",
           "from_torch_transformer"]

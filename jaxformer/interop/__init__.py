"""Weight import from other frameworks into (TransformerConfig, params).

`from_torch_transformer` reads a `torch.nn.Transformer` plus its embeddings and
output projection; `from_torch_decoder_only` reads a `torch.nn.TransformerEncoder`
run with a causal mask (a decoder-only LM: self-attention + FFN per layer).
PyTorch is imported only when one of them is called: `pip install 'jaxformer[torch]'`.

`jaxformer.interop.flat.load_flat` builds params from a flat `{name: array}`
mapping in jaxformer's names and checks it against the model, listing every
missing, unexpected, wrong-shape or wrong-dtype tensor in one error.

`jaxformer.interop.gguf` reads GGUF files (llama.cpp's format): import it
directly; it needs `pip install 'jaxformer[llm]'`. Per-model mappings of its
tensors are in `jaxformer.models` (`models/llama.py`).
"""

from jaxformer.interop.flat import CheckpointMismatch, flatten, load_flat
from jaxformer.interop.pytorch import from_torch_decoder_only, from_torch_transformer

__all__ = ["CheckpointMismatch", "from_torch_transformer", "from_torch_decoder_only",
           "flatten", "load_flat"]

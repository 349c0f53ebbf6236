"""File-format readers: one module per format, arrays and metadata out, no model knowledge.

`gguf` (llama.cpp's GGUF; `gguf_blocks`: its block types as `nn.quant` layouts),
`safetensors` (one file or a sharded index), `ct2` (CTranslate2 `model.bin`),
`progress` (a bar over the tensors being read).
The per-model name tables that turn their tensors into parameters are in
`jaxformer.models`.

`jaxformer.interop.flat.load_flat` builds params from a flat `{name: array}`
mapping in jaxformer's names and checks it against the model, listing every
missing, unexpected, wrong-shape or wrong-dtype tensor in one error.

`jaxformer.interop.gguf` reads GGUF files (llama.cpp's format): import it
directly; it needs `pip install 'jaxformer[llm]'`. Per-model mappings of its
tensors are in `jaxformer.models` (`models/llama.py`).
"""

from jaxformer.interop.flat import CheckpointMismatch, flatten, load_flat

__all__ = ["CheckpointMismatch", "flatten", "load_flat"]

"""Text to token ids and back: every tokenizer jaxformer uses, and chat templates.

Modules: `byte` (`ByteTokenizer`, bytes as ids; `byte_tokenizer`, the same as a
`tokenizers.Tokenizer`), `tokenizer_file` (`JSONTokenizer`: a tokenizer.json for
training; `training_tokenizer(path or None)`), `gguf_vocab` (a GGUF file's
vocabulary, tokenized as llama.cpp does), `pretrained` (`checkpoint_tokenizer`: the
tokenizer a Hugging Face directory or GGUF file ships), `chat` (chat templates,
rendered as `transformers` renders them), `detokenize` (`Detokenizer`: the text each
streamed token adds, a partial UTF-8 character held back). Hugging Face's `tokenizers` and `jinja2`
are imported only when a function needs them (the `llm` / `text` extras).
"""

from jaxformer.text.byte import ByteTokenizer, byte_tokenizer, with_bos
from jaxformer.text.chat import chat_template, encode_chat, render_chat
from jaxformer.text.pretrained import checkpoint_tokenizer, tokenizer_from_dir
from jaxformer.text.tokenizer_file import JSONTokenizer, training_tokenizer

__all__ = ["ByteTokenizer", "byte_tokenizer", "with_bos", "chat_template", "encode_chat", "render_chat",
           "checkpoint_tokenizer", "tokenizer_from_dir", "JSONTokenizer", "training_tokenizer"]

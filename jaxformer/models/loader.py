"""One entry point for pretrained models: `load(path)`.

    from jaxformer.models import load
    model, params, tokenizer = load("path/to/Qwen3-0.6B")       # a Hugging Face directory
    model, params, tokenizer = load("SmolLM2-135M.Q4_1.gguf")   # a GGUF file
    model, params, tokenizer = load("path/to/whisper-tiny")     # an encoder-decoder

A directory is read as a Hugging Face checkpoint (`config.json` + safetensors),
dispatched by `architectures[0]`: the decoder-only LMs (`jaxformer.models.hf`)
and the encoder-decoders Whisper and Marian (`jaxformer.models.hf_encdec`);
a file as GGUF (`jaxformer.models.llama`). The readers are imported on first
use, so `import jaxformer.models` stays light.
"""

from __future__ import annotations

import os
from typing import Optional

from jaxformer.errors import FileFormatError

ENCODER_DECODER = ("WhisperForConditionalGeneration", "MarianMTModel")


def load(path, *, dtype: str = "float32", max_len: Optional[int] = None,
         progress: Optional[bool] = None, quantize: Optional[str] = None):
    """(model, params, tokenizer) from a checkpoint directory or a .gguf file.

    The model is a `DecoderOnlyLM`, or a `Transformer` for an encoder-decoder
    directory. `max_len` caps a decoder-only LM's context (default: the
    checkpoint's; encoder-decoders keep their position tables' lengths). The
    tokenizer is a `tokenizers.Tokenizer` (None for a directory without
    `tokenizer.json`, e.g. Marian's SentencePiece files). `progress`: a tqdm bar
    on stderr, one step per tensor read (None: only if stderr is a terminal;
    True / False force it on / off).

    `quantize`: None (float kernels); a layout of `jaxformer.nn.quant` ("int8",
    "int4", "int4_sym", "int8_block"): weight-only post-training quantization of
    the loaded float kernels (`nn.quant_params.quantize_params`); "keep": a GGUF
    file's quantized blocks kept as they are (`models.llama.kept_formats`; a block
    type jaxformer does not decode is refused by name); "auto": "keep" for a GGUF file
    whose layer kernels are quantized, else float (a directory, a float GGUF file), as
    llama.cpp runs a file (`models.llama.auto_quantize`; the command line's default).
    Anything else is refused before reading.
    """
    from jaxformer.nn.quant import check_format  # noqa: PLC0415

    if quantize not in (None, "keep", "auto"):
        check_format(quantize)
    path = os.fspath(path)
    if os.path.isdir(path) and quantize == "auto":
        quantize = None  # a Hugging Face directory holds float weights
    if os.path.isdir(path) and quantize is not None:
        if quantize == "keep":
            raise ValueError(f"{path}: quantize='keep' keeps a GGUF file's quantized blocks; "
                             "a Hugging Face directory holds float weights: use "
                             "quantize='int8' or 'int4'")
        from jaxformer.nn.quant_params import quantize_params  # noqa: PLC0415

        model, params, tokenizer = load(path, dtype=dtype, max_len=max_len, progress=progress)
        config, params = quantize_params(model.config, params, quantize)
        return model.clone(config=config), params, tokenizer
    if os.path.isdir(path):
        from jaxformer.models import hf  # noqa: PLC0415 - optional readers

        values = hf.read_config(path)
        arch = (values.get("architectures") or ["<missing>"])[0]
        if arch in ENCODER_DECODER:
            from jaxformer.models.hf_encdec import load_hf_encdec  # noqa: PLC0415

            return load_hf_encdec(path, dtype=dtype, values=values)
        if arch not in hf.ARCHITECTURES:
            supported = ", ".join(hf.ARCHITECTURES + ENCODER_DECODER)
            raise ValueError(f"config.json architectures[0]={arch!r} is not supported by "
                             f"jaxformer (supported: {supported})")
        return hf.load_hf(path, dtype=dtype, max_len=max_len, progress=progress)
    if os.path.isfile(path):
        from jaxformer.models.llama import load_gguf  # noqa: PLC0415 - optional readers

        return load_gguf(path, dtype=dtype, max_len=max_len, progress=progress,
                         quantize=quantize)
    raise FileFormatError(path, "no such checkpoint directory or GGUF file",
                          "pass a Hugging Face directory (config.json + *.safetensors) "
                          "or a .gguf file")

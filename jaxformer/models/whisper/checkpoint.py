"""A Whisper checkpoint and its decoding conventions, from a CTranslate2 folder or a
Hugging Face directory.

    w = load(model_dir)        # `Whisper`: model, params, vocabulary, suppressed tokens
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

from jaxformer.models.whisper import config as config_lib
from jaxformer.models.whisper.tokens import tokens_of
from jaxformer.nn.model import Transformer



@dataclasses.dataclass(frozen=True)
class Whisper:
    """A loaded Whisper checkpoint and its decoding conventions (`load`)."""

    model: Transformer
    params: Any
    vocab: tuple[str, ...]
    suppress_ids: tuple[int, ...]
    suppress_ids_begin: tuple[int, ...]
    multilingual: bool  # False: an English-only (".en") model, which neither detects nor translates
    tokenizer_file: Optional[str] = None  # the folder's tokenizer.json: text to ids (prompts)
    model_dir: Optional[str] = None  # where it was read (alignment heads for word timestamps)

    @property
    def n_mels(self) -> int:
        """The log-mel bins the encoder reads: 80, or 128 (large-v3 and its family)."""
        return config_lib.mel_bins(self.params)


def load(model_dir: str, dtype: str = "float32", cpu_tuning: bool = False) -> Whisper:
    """A CTranslate2 Whisper folder (`model.bin`, `vocabulary.txt`, `config.json`), or a
    Hugging Face WhisperForConditionalGeneration directory (`config.json`,
    safetensors, `tokenizer.json`; the suppressed tokens of `generation_config.json`).
    `cpu_tuning`: the config's opt-in CPU tricks (`TransformerConfig.cpu_tuning`; at
    inference the encoder's attention is formed a block of queries at a time)."""
    w = read(model_dir, dtype)
    if cpu_tuning:
        w = dataclasses.replace(w, model=w.model.clone(
            config=w.model.config.replace(cpu_tuning=True)))
    return w


def read(model_dir: str, dtype: str) -> Whisper:
    """`load`'s model as the files state it."""
    if not os.path.exists(os.path.join(model_dir, "model.bin")) and os.path.exists(
            os.path.join(model_dir, "config.json")) and "architectures" in config_lib.special_ids(
                model_dir):
        return load_hf(model_dir, dtype)
    model, params, vocab = config_lib.load_ct2(model_dir, dtype)
    special = config_lib.special_ids(model_dir)
    return Whisper(model, params, tuple(vocab), tuple(special.get("suppress_ids") or ()),
                   tuple(special.get("suppress_ids_begin") or ()), tokens_of(vocab).multilingual,
                   tokenizer_json(model_dir), model_dir)


def load_hf(model_dir: str, dtype: str = "float32") -> Whisper:
    """A Hugging Face WhisperForConditionalGeneration directory (`hf_encdec`)."""
    from jaxformer.errors import FileFormatError  # noqa: PLC0415
    from jaxformer.models import hf_encdec  # noqa: PLC0415 - optional readers

    values = hf_encdec.read_config(model_dir)
    if values.get("architectures", [None])[0] != hf_encdec.WHISPER:
        raise ValueError(f"{model_dir}: config.json architectures={values.get('architectures')}"
                         f", not {hf_encdec.WHISPER}")
    if int(values.get("num_mel_bins", 80)) not in config_lib.MEL_BINS or int(
            values.get("max_source_positions", 1500)) * 2 != config_lib.N_FRAMES:
        raise ValueError(f"{model_dir}: transcription reads 80 or 128 mel bins over "
                         f"{config_lib.N_FRAMES} frames; config.json has num_mel_bins="
                         f"{values.get('num_mel_bins')}, max_source_positions="
                         f"{values.get('max_source_positions')}")
    model, params, tokenizer = hf_encdec.load_hf_encdec(model_dir, dtype=dtype, values=values)
    if tokenizer is None:
        raise FileFormatError(os.path.join(model_dir, "tokenizer.json"), "is missing",
                              "transcription needs the Whisper vocabulary")
    vocab = hf_encdec.vocabulary(tokenizer)
    suppress, begin = hf_encdec.suppress_ids(model_dir)
    return Whisper(model, params, tuple(vocab), suppress, begin,
                   tokens_of(vocab).multilingual, tokenizer_json(model_dir), model_dir)


def tokenizer_json(model_dir: str) -> Optional[str]:
    """The folder's tokenizer.json (CTranslate2 conversions usually ship it), or None."""
    path = os.path.join(model_dir, "tokenizer.json")
    return path if os.path.isfile(path) else None

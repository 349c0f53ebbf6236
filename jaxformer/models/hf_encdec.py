"""Hugging Face encoder-decoder directories (`config.json` + safetensors) as a `Transformer`.

    model, params, tokenizer = load_hf_encdec("path/to/whisper-tiny")
    model, params, tokenizer = load_hf_encdec("path/to/opus-mt-en-de")

Two architectures, both BART-style layers and both config choices of the
encoder-decoder `Transformer` (no new layers):

    WhisperForConditionalGeneration   Pre-LN with final norms, GELU, the conv stem
                                      (`stems.ConvStem`) over num_mel_bins features,
                                      fixed position tables from the file, no key
                                      bias, tied output; the model `whisper.load_ct2`
                                      builds from CTranslate2 files
    MarianMTModel                     Post-LN, swish (silu), one shared embedding
                                      table times sqrt(d_model), sinusoids with the
                                      sines in the first half and the cosines in the
                                      second (a fixed table computed here), tied output
                                      plus final_logits_bias (`tied_output_bias`),
                                      decoding starts with PAD (`mask_decoder_pad=False`)

As for the decoder-only directories (`jaxformer.models.hf`), the config is
mapped, and an unsupported value refused by name, before any tensor file is
opened; then every missing, unexpected or wrong-shaped tensor is listed in one
`CheckpointMismatch` from the files' headers.

The tensor names, shapes and layouts are the tables of
`jaxformer.models.encdec_tensors`; checking and reading loop over them.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.config import TransformerConfig
from jaxformer.interop.flat import load_flat
from jaxformer.models.whisper.config import whisper_config
from jaxformer.models.hf import ACTIVATIONS, read_config
from jaxformer.models import encdec_tensors, tensor_table
from jaxformer.models.encdec_tensors import MARIAN, WHISPER
from jaxformer.text.pretrained import tokenizer_from_dir
from jaxformer.nn.model import Transformer
from jaxformer.nn.stems import ConvStem

ARCHITECTURES = (WHISPER, MARIAN)
# Keys whose non-default value changes the function in a way jaxformer does not implement.
_REFUSED = {
    WHISPER: {"scale_embedding": (None, False)},
    # Marian-NMT's pre-norm and embedding-norm options (transformers' Marian has neither).
    MARIAN: {"normalize_before": (None, False), "normalize_embedding": (None, False),
             "share_encoder_decoder_embeddings": (None, True)},
}


def _unsupported(arch: str, key: str, value, why: str = "") -> ValueError:
    return ValueError(f"{arch}: config.json {key}={value!r} is not supported by jaxformer"
                      + (f" ({why})" if why else ""))


def _one_per_model(arch: str, values: dict, key: str) -> int:
    """encoder_{key} == decoder_{key} (jaxformer has one value for both stacks)."""
    encoder, decoder = values.get(f"encoder_{key}"), values.get(f"decoder_{key}")
    if encoder is None or decoder is None:
        raise ValueError(f"{arch}: config.json needs encoder_{key} and decoder_{key}")
    if encoder != decoder:
        raise _unsupported(arch, f"decoder_{key}", decoder,
                           f"jaxformer needs it equal to encoder_{key}={encoder}")
    return int(encoder)


def config_from_hf_encdec(values: dict, *, dtype: str = "float32") -> TransformerConfig:
    """The `TransformerConfig` of a Whisper or Marian `config.json` dict; ValueError
    naming an unknown architecture or an unsupported value."""
    arch = (values.get("architectures") or ["<missing>"])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(f"config.json architectures[0]={arch!r} is not an encoder-decoder "
                         f"jaxformer supports ({', '.join(ARCHITECTURES)})")
    for key, allowed in _REFUSED[arch].items():
        if values.get(key) not in allowed:
            raise _unsupported(arch, key, values[key])
    act = values.get("activation_function", "gelu")
    if act not in ACTIVATIONS:
        raise _unsupported(arch, "activation_function", act,
                           f"implemented: {', '.join(ACTIVATIONS)}")
    for key in ("d_model", "vocab_size", "encoder_layers", "decoder_layers"):
        if values.get(key) is None:
            raise ValueError(f"{arch}: config.json has no {key!r}")
    vocab, d_model = int(values["vocab_size"]), int(values["d_model"])
    heads, d_ff = (_one_per_model(arch, values, "attention_heads"),
                   _one_per_model(arch, values, "ffn_dim"))
    layers = int(values["encoder_layers"]), int(values["decoder_layers"])
    start = values.get("decoder_start_token_id")
    if arch == WHISPER:
        if act != "gelu":
            raise _unsupported(arch, "activation_function", act, "Whisper's stem uses gelu")
        eos = int(values.get("eos_token_id", 50256))
        return whisper_config(
            vocab_size=vocab, d_model=d_model, num_heads=heads, d_ff=d_ff,
            encoder_layers=layers[0], decoder_layers=layers[1],
            encoder_len=int(values.get("max_source_positions", 1500)),
            decoder_len=int(values.get("max_target_positions", 448)),
            pad_id=int(values.get("pad_token_id", eos)), eos_id=eos,
            bos_id=int(start if start is not None else values.get("bos_token_id", 50257)),
            dtype=dtype)
    decoder_vocab = values.get("decoder_vocab_size")
    if decoder_vocab is not None and int(decoder_vocab) != vocab:
        raise _unsupported(arch, "decoder_vocab_size", decoder_vocab,
                           f"jaxformer shares one table: needs vocab_size={vocab}")
    pad = int(values.get("pad_token_id", vocab - 1))
    return TransformerConfig(
        src_vocab_size=vocab, tgt_vocab_size=vocab, d_model=d_model, num_heads=heads,
        d_ff=d_ff, num_encoder_layers=layers[0], num_decoder_layers=layers[1],
        max_len=int(values.get("max_position_embeddings", 1024)), norm="post",
        activation=ACTIVATIONS[act], encoder_positions="fixed", decoder_positions="fixed",
        scale_embeddings=bool(values.get("scale_embedding", False)), share_embeddings=True,
        tie_output_embedding=True, tied_output_bias=True, mask_decoder_pad=False,
        pad_id=pad, eos_id=int(values.get("eos_token_id", 0)),
        bos_id=int(start if start is not None else pad), dtype=dtype)


def marian_positions(length: int, d_model: int) -> np.ndarray:
    """(length, D): Marian's sinusoids, sin(p * w_i) in the first ceil(D/2) columns and
    cos(p * w_i) after them, w_i = 10000^(-2i/D) (computed in float64, as
    transformers does)."""
    position = np.arange(length, dtype=np.float64)[:, None]
    angle = position / np.power(10000.0, 2 * (np.arange(d_model) // 2) / d_model)
    return np.concatenate([np.sin(angle[:, 0::2]), np.cos(angle[:, 1::2])],
                          axis=1).astype(np.float32)


def tensor_entries(config: TransformerConfig, arch: str, mel_bins: int = 0
                   ) -> list[tensor_table.Entry]:
    """Every tensor of `config`'s `arch` checkpoint, both stacks (`encdec_tensors.tables`)."""
    return [entry for table in encdec_tensors.tables(arch, mel_bins)
            for entry in tensor_table.entries(table, config)]


def expected_tensors(config: TransformerConfig, arch: str, mel_bins: int = 0
                     ) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> shape that `config` implies for `arch`."""
    return {e.hf: e.shape for e in tensor_entries(config, arch, mel_bins)}


def _ignored(name: str, arch: str) -> bool:
    """Tensors a checkpoint may carry that change nothing (`encdec_tensors.IGNORED`)."""
    return name in encdec_tensors.IGNORED[arch]


def check_tensors(checkpoint, config: TransformerConfig, arch: str, mel_bins: int = 0) -> None:
    """CheckpointMismatch listing every missing, unexpected and wrong-shaped tensor,
    from the files' headers (no tensor is read)."""
    tensor_table.check_shapes(expected_tensors(config, arch, mel_bins),
                              {n: s for n, s in checkpoint.shapes.items() if not _ignored(n, arch)})


def flat_from_hf(checkpoint, config: TransformerConfig, arch: str) -> dict[str, np.ndarray]:
    """The checkpoint's tensors in jaxformer's flat names and layouts (float32)."""
    dims = encdec_tensors.tables(arch)[0].dims(config)
    flat: dict[str, np.ndarray] = {}
    for entry in tensor_entries(config, arch):
        value = checkpoint.array(entry.hf).astype(np.float32)
        flat[entry.ours] = np.ascontiguousarray(tensor_table.to_params(entry.row, value, dims))
    if arch == MARIAN:
        table = marian_positions(config.max_len, config.d_model)
        flat["encoder/positions/embedding"] = flat["decoder/positions/embedding"] = table
    return flat


def build(config: TransformerConfig, arch: str) -> Transformer:
    """The `Transformer` of `config` (with Whisper's conv stem)."""
    return Transformer(config, stem=ConvStem(config) if arch == WHISPER else None)


def load_hf_encdec(directory, *, dtype: str = "float32", values: Optional[dict] = None):
    """(Transformer, params, tokenizers.Tokenizer or None) from a Whisper or Marian
    checkpoint directory (`values`: its config.json, if already read).

    Whisper's source is log-mel features (B, 2 * max_source_positions, num_mel_bins)
    through the conv stem; Marian's is token ids. The tokenizer is the directory's
    `tokenizer.json`; Marian directories carry SentencePiece files (`source.spm`,
    `target.spm`, read by transformers' MarianTokenizer) and no tokenizer.json, so
    their tokenizer is None: encode with MarianTokenizer and pass the ids.
    """
    from jaxformer.interop.safetensors import read_safetensors  # noqa: PLC0415 - optional

    values = read_config(directory) if values is None else values
    config = config_from_hf_encdec(values, dtype=dtype)
    arch = values["architectures"][0]
    mel_bins = int(values.get("num_mel_bins", 80)) if arch == WHISPER else 0
    checkpoint = read_safetensors(directory)
    check_tensors(checkpoint, config, arch, mel_bins)
    model = build(config, arch)
    ids = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    src = (jax.ShapeDtypeStruct((1, 2 * config.encoder_len, mel_bins), jnp.float32)
           if arch == WHISPER else ids)
    params = load_flat(model, flat_from_hf(checkpoint, config, arch), src, ids)
    return model, params, tokenizer_from_dir(directory)


# -- Whisper's decoding conventions from a directory ------------------------------------


def vocabulary(tokenizer) -> list[str]:
    """Token strings by id (added special tokens included) of a Whisper `tokenizer.json`,
    the form `whisper.tokens_of` and CTranslate2's vocabulary.txt have."""
    by_id = {i: token for token, i in tokenizer.get_vocab(with_added_tokens=True).items()}
    missing = [i for i in range(len(by_id)) if i not in by_id]
    if missing:
        raise ValueError(f"tokenizer.json: ids {missing[:5]} have no token (ids must be 0..N-1)")
    return [by_id[i] for i in range(len(by_id))]


def suppress_ids(directory) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(suppress_tokens, begin_suppress_tokens) of `generation_config.json` (where
    transformers keeps them), else of `config.json`; empty where neither has them."""
    found: dict = {}
    for name in ("config.json", "generation_config.json"):  # the latter wins
        path = os.path.join(os.fspath(directory), name)
        if os.path.exists(path):
            with open(path) as f:
                values = json.load(f)
            found.update({k: v for k, v in values.items() if v is not None and k in (
                "suppress_tokens", "begin_suppress_tokens")})
    return (tuple(int(i) for i in found.get("suppress_tokens", ())),
            tuple(int(i) for i in found.get("begin_suppress_tokens", ())))

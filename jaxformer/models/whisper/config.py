"""Whisper's `TransformerConfig` and the CTranslate2 weight mapping.

Whisper is a Pre-LN encoder-decoder Transformer: the encoder reads a log-mel
spectrogram (80 or 128 bins, 3000 frames) through two 1-D convolutions (width 3,
strides 1 and 2, GELU: `stems.ConvStem`) and adds a fixed sinusoidal table
(1500 rows); the decoder has a learned table (448 rows) and a tied output.
Attention has query, value and out biases but no key bias. Everything here is
a choice of `TransformerConfig` fields and a renaming of the file's tensors;
no layer is Whisper-specific.

    model, params, vocab = load_ct2(model_dir)       # CTranslate2 model.bin folder
"""

from __future__ import annotations

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.config import TransformerConfig
from jaxformer.errors import FileFormatError, require_file
from jaxformer.interop import ct2
from jaxformer.interop.flat import load_flat
from jaxformer.nn.model import Transformer
from jaxformer.nn.stems import ConvStem

N_MELS = 80  # the original models; large-v3 and its family (turbo, distilled) have 128
MEL_BINS = (80, 128)
N_FRAMES = 3000  # 30 s at a 10 ms hop


def whisper_config(*, vocab_size: int, d_model: int, num_heads: int, d_ff: int, encoder_layers: int,
                   decoder_layers: int, encoder_len: int, decoder_len: int, pad_id: int,
                   bos_id: int, eos_id: int, dtype: str = "float32") -> TransformerConfig:
    """Whisper's `TransformerConfig` of the given sizes (both file formats build it)."""
    return TransformerConfig(
        src_vocab_size=vocab_size, tgt_vocab_size=vocab_size, d_model=d_model,
        num_heads=num_heads, d_ff=d_ff, num_encoder_layers=encoder_layers,
        num_decoder_layers=decoder_layers, max_len=decoder_len,
        encoder_max_len=encoder_len, decoder_max_len=decoder_len,
        norm="pre", activation="gelu", encoder_positions="fixed", decoder_positions="fixed",
        attention_biases="qvo", scale_embeddings=False, tie_output_embedding=True,
        encoder_input="embedded", pad_id=pad_id, eos_id=eos_id, bos_id=bos_id,
        dtype=dtype, param_dtype="float32")


def config_from_ct2(model: ct2.Ct2Model, vocab: list[str], dtype: str = "float32"
                    ) -> TransformerConfig:
    """The config a CTranslate2 WhisperSpec file describes."""
    v = model.variables
    if model.spec != "WhisperSpec":
        raise ValueError(f"not a Whisper file: spec {model.spec!r}")
    layers = {stack: len({n.split("/")[1] for n in v
                          if re.fullmatch(rf"{stack}/layer_\d+/.*", n)})
              for stack in ("encoder", "decoder")}
    ids = {token: i for i, token in enumerate(vocab)}
    eos = ids["<|endoftext|>"]
    return whisper_config(
        vocab_size=len(vocab), d_model=v["encoder/conv1/weight"].shape[0],
        num_heads=int(v["encoder/num_heads"]),
        d_ff=v["encoder/layer_0/ffn/linear_0/weight"].shape[0],
        encoder_layers=layers["encoder"], decoder_layers=layers["decoder"],
        encoder_len=v["encoder/position_encodings/encodings"].shape[0],
        decoder_len=v["decoder/position_encodings/encodings"].shape[0],
        pad_id=eos, eos_id=eos, bos_id=ids["<|startoftranscript|>"], dtype=dtype)


def _norm(v, name):
    return {"scale": v[f"{name}/gamma"], "bias": v[f"{name}/beta"]}


def _linear(v, name):
    return v[f"{name}/weight"], v[f"{name}/bias"]


def map_ct2(model: ct2.Ct2Model, config: TransformerConfig) -> dict[str, np.ndarray]:
    """The file's tensors in jaxformer's flat names and layouts (float16 kept).

    torch layouts: Linear weight (out, in), Conv1d weight (out, in, width). The
    fused projections are split: self-attention linear_0 = [q; k; v], cross
    attention linear_1 = [k; v]. The key bias (zeros in these files, and
    without effect anyway: it shifts every logit of a query equally) is dropped.
    """
    v = model.variables
    D, H, K = config.d_model, config.num_heads, config.head_dim
    flat = {}

    def put(prefix, tree):
        for key, value in tree.items():
            flat[f"{prefix}/{key}"] = value

    def heads(w, b, part):
        out = {"kernel": w.T.reshape(D, H, K)}
        if part != "key":
            out["bias"] = b.reshape(H, K)
        return out

    def attention(prefix, name, fused_qkv: bool):
        if fused_qkv:
            w, b = _linear(v, f"{name}/linear_0")
            parts = {p: (w[i * D:(i + 1) * D], b[i * D:(i + 1) * D])
                     for i, p in enumerate(("query", "key", "value"))}
            out_w, out_b = _linear(v, f"{name}/linear_1")
        else:
            parts = {"query": _linear(v, f"{name}/linear_0")}
            w, b = _linear(v, f"{name}/linear_1")
            parts.update(key=(w[:D], b[:D]), value=(w[D:], b[D:]))
            out_w, out_b = _linear(v, f"{name}/linear_2")
        for part, (w, b) in parts.items():
            for key, value in heads(w, b, part).items():
                flat[f"{prefix}/{part}/{key}"] = value
        put(f"{prefix}/out", {"kernel": out_w.T.reshape(H, K, D), "bias": out_b})

    def ffn(prefix, name):
        for ours, theirs in (("wi", "linear_0"), ("wo", "linear_1")):
            w, b = _linear(v, f"{name}/{theirs}")
            put(f"{prefix}/{ours}", {"kernel": w.T, "bias": b})

    for i, stride in enumerate((1, 2)):
        w, b = _linear(v, f"encoder/conv{i + 1}")
        put(f"stem/conv_{i}", {"kernel": w.transpose(2, 1, 0), "bias": b})
    flat["encoder/positions/embedding"] = v["encoder/position_encodings/encodings"]
    for i in range(config.num_encoder_layers):
        ours, theirs = f"encoder/layers_{i}", f"encoder/layer_{i}"
        attention(f"{ours}/self_attn", f"{theirs}/self_attention", True)
        put(f"{ours}/self_attn_norm", _norm(v, f"{theirs}/self_attention/layer_norm"))
        ffn(f"{ours}/ffn", f"{theirs}/ffn")
        put(f"{ours}/ffn_norm", _norm(v, f"{theirs}/ffn/layer_norm"))
    put("encoder/final_norm", _norm(v, "encoder/layer_norm"))
    flat["tgt_embed/embedding"] = v["decoder/embeddings/weight"]
    flat["decoder/positions/embedding"] = v["decoder/position_encodings/encodings"]
    for i in range(config.num_decoder_layers):
        ours, theirs = f"decoder/layers_{i}", f"decoder/layer_{i}"
        attention(f"{ours}/self_attn", f"{theirs}/self_attention", True)
        put(f"{ours}/self_attn_norm", _norm(v, f"{theirs}/self_attention/layer_norm"))
        attention(f"{ours}/cross_attn", f"{theirs}/attention", False)
        put(f"{ours}/cross_attn_norm", _norm(v, f"{theirs}/attention/layer_norm"))
        ffn(f"{ours}/ffn", f"{theirs}/ffn")
        put(f"{ours}/ffn_norm", _norm(v, f"{theirs}/ffn/layer_norm"))
    put("decoder/final_norm", _norm(v, "decoder/layer_norm"))
    return flat


def load_ct2(model_dir: str, dtype: str = "float32"):
    """(model, params, vocabulary) from a CTranslate2 Whisper folder
    (`model.bin`, `vocabulary.txt` or `vocabulary.json`); float16 weights are cast to
    float32. The mel bins (80, or 128 for large-v3) are those of the file's first
    convolution."""
    vocab_path, vocab = read_vocabulary(model_dir)
    missing = [t for t in ("<|endoftext|>", "<|startoftranscript|>", "<|transcribe|>",
                           "<|notimestamps|>") if t not in vocab]
    if missing:
        raise FileFormatError(vocab_path, f"{len(vocab)} tokens without {', '.join(missing)}",
                              "it is cut short or not a Whisper vocabulary")
    file = ct2.read_ct2(os.path.join(model_dir, "model.bin"))
    for flag, want in (("decoder/scale_embeddings", 0), ("decoder/pre_norm", 1)):
        if flag in file.variables and int(file.variables[flag]) != want:
            raise ValueError(f"{model_dir}: {flag}={int(file.variables[flag])}, this mapping "
                             f"expects {want}")
    config = config_from_ct2(file, vocab, dtype)
    model = Transformer(config, stem=ConvStem(config))
    mels = int(file.variables["encoder/conv1/weight"].shape[1])
    if mels not in MEL_BINS:
        raise ValueError(f"{model_dir}: the encoder reads {mels} mel bins; Whisper "
                         f"checkpoints have {' or '.join(map(str, MEL_BINS))}")
    features = jax.ShapeDtypeStruct((1, 2 * config.encoder_len, mels), jnp.float32)
    params = load_flat(model, map_ct2(file, config), features,
                       jax.ShapeDtypeStruct((1, 1), jnp.int32))
    return model, params, vocab


def read_vocabulary(model_dir: str) -> tuple[str, list[str]]:
    """(path, tokens) of a CTranslate2 folder's `vocabulary.txt` (one token a line) or
    `vocabulary.json` (a list, as newer converters write it)."""
    json_path = os.path.join(model_dir, "vocabulary.json")
    if not os.path.exists(os.path.join(model_dir, "vocabulary.txt")) and os.path.exists(
            json_path):
        with open(json_path, encoding="utf-8") as f:
            vocab = json.load(f)
        if not isinstance(vocab, list) or not all(isinstance(t, str) for t in vocab):
            raise FileFormatError(json_path, "is not a list of tokens",
                                  "convert the model again")
        return json_path, vocab
    path = require_file(os.path.join(model_dir, "vocabulary.txt"), "vocabulary file")
    with open(path, encoding="utf-8") as f:
        return path, f.read().rstrip("\n").split("\n")


def mel_bins(params) -> int:
    """The mel bins the encoder's first convolution reads (80, or 128 for large-v3)."""
    return int(params["stem"]["conv_0"]["kernel"].shape[1])


def special_ids(model_dir: str) -> dict:
    """suppress_ids and suppress_ids_begin of the folder's config.json."""
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        return json.load(f)

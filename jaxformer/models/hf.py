"""Hugging Face checkpoint directories (`config.json` + safetensors) as a `DecoderOnlyLM`.

    model, params, tokenizer = load_hf("path/to/Qwen3-0.6B")
    ids = tokenizer.encode("The capital of France is").ids

`config.json`'s `architectures[0]` picks the mapping; every family is a config
choice of the same decoder-only LM (pre-RMSNorm, RoPE in Hugging Face's
half-split layout, gated FFN, grouped-query attention):

    LlamaForCausalLM     biases iff attention_bias / mlp_bias; rope_type llama3 / linear
    MistralForCausalLM   every layer local when sliding_window is set
    Qwen2ForCausalLM     query/key/value biases; local layers per layer_types
    Qwen3ForCausalLM     per-head q/k RMSNorm (qk_norm), explicit head_dim
    Gemma2ForCausalLM    sandwich norms, (1 + w) RMSNorm, embeddings * sqrt(D),
                         query_pre_attn_scalar, soft caps, local/global alternating
    Gemma3ForCausalLM    Gemma 2's blocks + q/k norm, 5 local : 1 global with a local
                         RoPE base, linear RoPE scaling of the global layers

Everything is checked before any tensor is read: an unknown architecture or a
config value jaxformer does not implement raises ValueError naming it
(`config_from_hf`); then the safetensors headers are compared with the shapes
the config implies, and every missing, unexpected or wrong-shaped tensor is
listed in one `CheckpointMismatch`.

The tensors' names, shapes and layouts are the family's table
(`jaxformer.models.llama_tensors.LLAMA`); `params_from_hf` loops over it.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

import jax.numpy as jnp
import numpy as np

from jaxformer.config import TransformerConfig, llama
from jaxformer.errors import FileFormatError, require_file
from jaxformer.interop.flat import unflatten
from jaxformer.interop.progress import tensor_bar
from jaxformer.models import tensor_table
from jaxformer.models.llama_tensors import LLAMA
from jaxformer.nn.model import DecoderOnlyLM
from jaxformer.text.pretrained import tokenizer_from_dir

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                 "Qwen3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh",
               "gelu_new": "gelu_tanh", "gelu": "gelu"}
# Per-family defaults of Hugging Face's config classes, for keys a config.json omits.
_DEFAULTS = {
    "LlamaForCausalLM": dict(tie_word_embeddings=False),
    "MistralForCausalLM": dict(tie_word_embeddings=False, sliding_window=4096),
    "Qwen2ForCausalLM": dict(tie_word_embeddings=False, sliding_window=4096,
                             max_window_layers=28),
    "Qwen3ForCausalLM": dict(tie_word_embeddings=False, head_dim=128, sliding_window=4096,
                             max_window_layers=28),
    "Gemma2ForCausalLM": dict(tie_word_embeddings=True, head_dim=256, query_pre_attn_scalar=256,
                              attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                              sliding_window=4096),
    "Gemma3ForCausalLM": dict(tie_word_embeddings=True, head_dim=256, query_pre_attn_scalar=256,
                              sliding_window=4096),
}
# Keys whose non-default value changes the function in a way jaxformer does not implement.
_REFUSED = {"use_bidirectional_attention": (None, False), "partial_rotary_factor": (None, 1.0),
            "pretraining_tp": (None, 1), "num_experts": (None, 0),
            "attention_chunk_size": (None,), "no_rope_layers": (None,)}


def read_config(directory) -> dict:
    """`config.json` of a checkpoint directory as a dict (FileFormatError if unreadable)."""
    path = require_file(os.path.join(os.fspath(directory), "config.json"), "config.json")
    try:
        with open(path) as f:
            values = json.load(f)
    except (OSError, ValueError) as error:
        raise FileFormatError(path, f"is not valid JSON ({error})") from error
    if not isinstance(values, dict):
        raise FileFormatError(path, "is not a JSON object")
    return values


def _unsupported(arch: str, key: str, value, why: str = "") -> ValueError:
    return ValueError(f"{arch}: config.json {key}={value!r} is not supported by jaxformer"
                      + (f" ({why})" if why else ""))


def _rope(arch: str, params: Optional[dict], key: str) -> tuple[float, dict]:
    """(theta, scaling fields of TransformerConfig) of one rope parameter dict."""
    params = dict(params or {})
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", 10000.0))
    if kind == "default":
        return theta, {}
    if kind == "linear":
        return theta, dict(rope_scaling="linear", rope_scaling_factor=float(params["factor"]))
    if kind == "llama3":
        return theta, dict(rope_scaling="llama3", rope_scaling_factor=float(params["factor"]),
                           rope_low_freq_factor=float(params["low_freq_factor"]),
                           rope_high_freq_factor=float(params["high_freq_factor"]),
                           rope_original_max_len=int(params["original_max_position_embeddings"]))
    raise _unsupported(arch, f"{key}.rope_type", kind, "implemented: default, linear, llama3")


def _rope_fields(arch: str, values: dict) -> dict:
    """RoPE fields from `rope_parameters` (transformers 5) or rope_theta/rope_scaling (4)."""
    params = values.get("rope_parameters")
    if params is None:  # the older layout: top-level theta and an optional scaling dict
        params = dict(values.get("rope_scaling") or {})
        params.setdefault("rope_theta", values.get("rope_theta", 10000.0))
        local = {"rope_theta": values.get("rope_local_base_freq", 10000.0)}
        params = ({"full_attention": params, "sliding_attention": local}
                  if arch == "Gemma3ForCausalLM" else params)
    if "full_attention" in params or "sliding_attention" in params:  # per layer kind
        theta, fields = _rope(arch, params.get("full_attention"), "rope_parameters.full_attention")
        local_theta, local_fields = _rope(arch, params.get("sliding_attention"),
                                          "rope_parameters.sliding_attention")
        if local_fields:
            raise _unsupported(arch, "rope_parameters.sliding_attention.rope_type",
                               local_fields["rope_scaling"], "local layers are not scaled")
        return dict(rope_theta=theta, rope_local_theta=local_theta, **fields)
    theta, fields = _rope(arch, params, "rope_parameters")
    return dict(rope_theta=theta, **fields)


def _pattern(arch: str, values: dict, num_layers: int) -> tuple[Optional[int], Optional[str]]:
    """(sliding_window, attention_pattern) of the config's local/global layers."""
    window = values.get("sliding_window", _DEFAULTS[arch].get("sliding_window"))
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not values.get("use_sliding_window"):
        window = None
    if window is None:
        return None, None
    types = values.get("layer_types")
    if types is None:
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            first = int(values.get("max_window_layers", _DEFAULTS[arch]["max_window_layers"]))
            types = ["full_attention" if i < first else "sliding_attention"
                     for i in range(num_layers)]
        elif arch in GEMMA:
            period = 2 if arch == "Gemma2ForCausalLM" else int(
                values.get("sliding_window_pattern", values.get("_sliding_window_pattern", 6)))
            types = ["sliding_attention" if (i + 1) % period else "full_attention"
                     for i in range(num_layers)]
        else:
            types = ["sliding_attention"] * num_layers
    if len(types) != num_layers:
        raise _unsupported(arch, "layer_types", types, f"needs {num_layers} entries")
    letters = {"sliding_attention": "L", "full_attention": "G"}
    for kind in types:
        if kind not in letters:
            raise _unsupported(arch, "layer_types", kind,
                               "implemented: sliding_attention, full_attention")
    pattern = "".join(letters[k] for k in types)
    if "L" not in pattern:
        return None, None
    return int(window), pattern


def _special_ids(values: dict, vocab: int) -> tuple[int, int, int]:
    """(pad, bos, eos): jaxformer needs BOS distinct from PAD and EOS; a missing PAD (or
    BOS equal to EOS) falls back to the first small id that is neither."""
    def one(key):
        value = values.get(key)
        return int(value[0] if isinstance(value, list) else value) if value is not None \
            else None

    eos = one("eos_token_id")
    eos = 2 if eos is None else eos
    bos = one("bos_token_id")
    pad = one("pad_token_id")
    spare = [i for i in range(min(vocab, 4)) if i != eos]
    if bos is None or bos == eos:
        bos = next(i for i in spare if i != pad)
    if pad is None or pad == bos:
        pad = next(i for i in spare if i != bos)
    return pad, bos, eos


def config_from_hf(values: dict, *, dtype: str = "float32",
                   max_len: Optional[int] = None) -> TransformerConfig:
    """The `TransformerConfig` of a `config.json` dict; ValueError naming an unknown
    architecture or an unsupported value."""
    architectures = values.get("architectures") or ["<missing>"]
    arch = architectures[0]
    if arch not in ARCHITECTURES:
        raise ValueError(f"config.json architectures[0]={arch!r} is not supported by "
                         f"jaxformer (supported: {', '.join(ARCHITECTURES)})")
    defaults = _DEFAULTS[arch]

    def get(key, default=None):
        value = values.get(key, defaults.get(key, default))
        if value is None and default is None and key not in defaults:
            raise ValueError(f"{arch}: config.json has no {key!r}")
        return value

    for key, allowed in _REFUSED.items():
        if values.get(key) not in allowed:
            raise _unsupported(arch, key, values[key])
    act_key = "hidden_activation" if arch in GEMMA else "hidden_act"
    act = values.get(act_key) or values.get("hidden_act") or "silu"
    if act not in ACTIVATIONS:
        raise _unsupported(arch, act_key, act, f"implemented: {', '.join(ACTIVATIONS)}")
    d_model, heads = int(get("hidden_size")), int(get("num_attention_heads"))
    layers, vocab = int(get("num_hidden_layers")), int(get("vocab_size"))
    head_dim = values.get("head_dim") or defaults.get("head_dim") or d_model // heads
    window, pattern = _pattern(arch, values, layers)
    pad, bos, eos = _special_ids(values, vocab)
    attention_bias = bool(values.get("attention_bias", False))
    fields: dict[str, Any] = dict(
        src_vocab_size=vocab, tgt_vocab_size=vocab, d_model=d_model, num_heads=heads,
        num_kv_heads=int(values.get("num_key_value_heads") or heads), head_dim=int(head_dim),
        d_ff=int(get("intermediate_size")), num_decoder_layers=layers,
        max_len=int(values.get("max_position_embeddings", 4096)) if max_len is None else max_len,
        layer_norm_epsilon=float(values.get("rms_norm_eps", 1e-6)),
        activation=ACTIVATIONS[act],
        attention_biases="qkv" if arch == "Qwen2ForCausalLM" else (
            "qkvo" if attention_bias and arch != "MistralForCausalLM" else ""),
        ffn_bias=bool(values.get("mlp_bias", False)) and arch == "LlamaForCausalLM",
        tie_output_embedding=bool(values.get("tie_word_embeddings",
                                             defaults["tie_word_embeddings"])),
        sliding_window=window, attention_pattern=pattern, pad_id=pad, bos_id=bos, eos_id=eos,
        dtype=dtype, **_rope_fields(arch, values))
    if arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"):
        fields["qk_norm"] = True
    if arch in GEMMA:
        caps = {k: values.get(k, defaults.get(k)) for k in ("attn_logit_softcapping",
                                                            "final_logit_softcapping")}
        fields.update(norm="sandwich", norm_scale_plus_one=True, scale_embeddings=True,
                      embedding_scale_dtype="compute",
                      query_scale=float(get("query_pre_attn_scalar")) ** -0.5,
                      **{k: (None if v is None else float(v)) for k, v in caps.items()})
    return llama(**fields)


def expected_tensors(config: TransformerConfig, arch: str) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> shape that `config` implies (`LLAMA`'s rows; `arch`'s
    blocks are the config's: `config_from_hf`)."""
    return tensor_table.file_shapes(LLAMA, config, "hf")


def _ignored(name: str, config: TransformerConfig) -> bool:
    """Tensors a checkpoint may carry that change nothing: RoPE buffers, a tied head."""
    return name.endswith("rotary_emb.inv_freq") or (
        name == LLAMA.row("decoder/out_proj/kernel").hf and config.tie_output_embedding)


def check_tensors(checkpoint, config: TransformerConfig, arch: str) -> None:
    """CheckpointMismatch listing every missing, unexpected and wrong-shaped tensor,
    from the files' headers (no tensor is read)."""
    tensor_table.check_shapes(expected_tensors(config, arch),
                 {n: s for n, s in checkpoint.shapes.items() if not _ignored(n, config)})


def params_from_hf(checkpoint, config: TransformerConfig, arch: str, *,
                   progress: Optional[bool] = None) -> dict:
    """jaxformer `DecoderOnlyLM` parameters from an opened safetensors checkpoint.

    `progress`: a bar on stderr per tensor read (None: if stderr is a terminal)."""
    check_tensors(checkpoint, config, arch)
    dims, dtype = LLAMA.dims(config), config.params_dtype
    entries = tensor_table.entries(LLAMA, config)
    bar = tensor_bar(len(entries),
                     f"reading {os.path.basename(os.path.normpath(checkpoint.path))}", progress)
    flat: dict[str, np.ndarray] = {}
    for entry in entries:  # Hugging Face's RoPE layout is the config's ("half")
        value = checkpoint.array(entry.hf).astype(np.float32)
        flat[entry.ours] = jnp.asarray(np.ascontiguousarray(
            tensor_table.to_params(entry.row, value, dims)), dtype)
        bar.update(1)
    bar.close()
    return unflatten(flat)


def load_hf(directory, *, dtype: str = "float32", max_len: Optional[int] = None,
            progress: Optional[bool] = None):
    """(DecoderOnlyLM, params, tokenizers.Tokenizer or None) from a checkpoint directory.

    `max_len` caps the context (default: the config's max_position_embeddings).
    The config is mapped (and refused by name) before any tensor file is opened.
    `progress`: a bar on stderr while tensors are read (None: if stderr is a
    terminal; True / False force it on / off).
    """
    from jaxformer.interop.safetensors import read_safetensors  # noqa: PLC0415 - optional

    values = read_config(directory)
    config = config_from_hf(values, dtype=dtype, max_len=max_len)
    arch = values["architectures"][0]
    checkpoint = read_safetensors(directory)
    params = params_from_hf(checkpoint, config, arch, progress=progress)
    return DecoderOnlyLM(config), params, tokenizer_from_dir(directory)

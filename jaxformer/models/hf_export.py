"""A `DecoderOnlyLM` written as a Hugging Face checkpoint directory: `save_hf`.

    save_hf(model.config, params, "out/my-model", tokenizer=tokenizer)
    # transformers.AutoModelForCausalLM.from_pretrained("out/my-model")

The inverse of `jaxformer.models.hf`: `config.json` (transformers 5 layout),
`model.safetensors`, `generation_config.json` and, with a tokenizer,
`tokenizer.json` + `tokenizer_config.json`. The architecture is the one the
config's blocks name (`architecture_of`): sandwich norms -> Gemma 2 (Gemma 3
with q/k norm), q/k norm -> Qwen 3, query/key/value biases -> Qwen 2, a window
on every layer -> Mistral, else Llama. A config that architecture cannot
express (LayerNorm, absolute positions, Post-LN, ...) raises ValueError naming
the field before anything is written; the directory is built beside `out_dir`
and renamed into place at the end, and an existing non-empty `out_dir` is
refused, so nothing a user saved is overwritten or left half-written.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from typing import Optional

import numpy as np

from jaxformer.config import TransformerConfig
from jaxformer.interop.flat import flatten
from jaxformer.models import tensor_table
from jaxformer.models.hf import ARCHITECTURES, GEMMA
from jaxformer.models.llama_tensors import LLAMA
from jaxformer.nn.rope import half_to_interleaved_rows
from jaxformer.nn.stacking import unstack_layers

MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
               "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
               "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text"}
HF_ACTIVATIONS = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}
WINDOWED = ("Qwen2ForCausalLM", "Qwen3ForCausalLM") + GEMMA  # per-layer layer_types


def architecture_of(config: TransformerConfig) -> str:
    """The Hugging Face architecture whose blocks `config` uses (checked by `check_exportable`)."""
    if config.norm == "sandwich":
        return "Gemma3ForCausalLM" if config.qk_norm else "Gemma2ForCausalLM"
    if config.qk_norm:
        return "Qwen3ForCausalLM"
    if "".join(p for p in "qkvo" if config.has_attention_bias(p)) == "qkv":
        return "Qwen2ForCausalLM"
    if config.sliding_window is not None and all(config.local_layers(
            config.num_decoder_layers)):
        return "MistralForCausalLM"
    return "LlamaForCausalLM"


def _refuse(arch: str, field: str, value, why: str) -> ValueError:
    return ValueError(f"cannot export as {arch}: TransformerConfig.{field}={value!r} ({why})")


def check_exportable(config: TransformerConfig, arch: str) -> None:
    """ValueError naming the first field of `config` that `arch` cannot express."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"architecture {arch!r} is not supported for export "
                         f"(supported: {', '.join(ARCHITECTURES)})")
    gemma = arch in GEMMA
    c = config
    required = [  # (field, wanted value, why)
        ("num_encoder_layers", 0, "only decoder-only LMs have a Hugging Face causal-LM form"),
        ("norm", "sandwich" if gemma else "pre",
         f"{arch} has {'sandwich' if gemma else 'pre'}-norm blocks"),
        ("norm_type", "rmsnorm", f"{arch} uses RMSNorm"),
        ("norm_scale_plus_one", gemma, f"{arch}'s RMSNorm is x * {'(1 + w)' if gemma else 'w'}"),
        ("gated_ffn", True, f"{arch}'s FFN is gated"),
        ("decoder_positions", "none", f"{arch} has no absolute positions, only RoPE"),
        ("qk_norm", arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
         f"q/k norm is fixed by the architecture in {arch}"),
        ("scale_embeddings", gemma, "embeddings are scaled by sqrt(D) in Gemma only"),
    ]
    for field, want, why in required:
        if getattr(c, field) != want:
            raise _refuse(arch, field, getattr(c, field), why)
    if not c.use_final_norm:
        raise _refuse(arch, "final_norm", c.final_norm, f"{arch} ends with a final norm")
    if c.rope not in ("half", "interleaved"):
        raise _refuse(arch, "rope", c.rope, f"{arch} uses rotary position embeddings")
    if c.activation not in HF_ACTIVATIONS:
        raise _refuse(arch, "activation", c.activation,
                      f"exportable: {', '.join(HF_ACTIVATIONS)}")
    biases = "".join(p for p in "qkvo" if c.has_attention_bias(p))
    allowed = {"Qwen2ForCausalLM": ("qkv",), "MistralForCausalLM": ("",)}.get(arch, ("", "qkvo"))
    if biases not in allowed:
        raise _refuse(arch, "attention_biases", c.attention_biases if c.attention_biases
                      is not None else biases, f"{arch} has attention biases on: "
                      f"{' or '.join(repr(a) for a in allowed)}")
    if c.ffn_bias and arch != "LlamaForCausalLM":
        raise _refuse(arch, "ffn_bias", True, "only Llama has FFN biases (mlp_bias)")
    if c.output_bias and not c.tie_output_embedding:
        raise _refuse(arch, "output_bias", True, "lm_head has no bias")
    if not gemma:
        if c.query_scale is not None and not np.isclose(c.query_scale, c.head_dim ** -0.5,
                                                        rtol=1e-9):
            raise _refuse(arch, "query_scale", c.query_scale,
                          f"{arch} scales queries by 1/sqrt(head_dim)")
        for field in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(c, field) is not None:
                raise _refuse(arch, field, getattr(c, field), "soft caps are Gemma's")
    elif c.embedding_scale_dtype != "compute" and c.compute_dtype != np.dtype("float32"):
        raise _refuse(arch, "embedding_scale_dtype", c.embedding_scale_dtype,
                      "Gemma scales the embeddings in the compute dtype")
    local = c.local_layers(c.num_decoder_layers)
    if any(local):
        if arch == "LlamaForCausalLM":
            raise _refuse(arch, "sliding_window", c.sliding_window,
                          "Llama has no local layers (Mistral: all local; Qwen 2/3, Gemma: "
                          "any pattern)")
        if arch == "MistralForCausalLM" and not all(local):
            raise _refuse(arch, "attention_pattern", c.attention_pattern,
                          "Mistral's window applies to every layer")
        separate = c.rope_local_theta is not None and c.rope_local_theta != c.rope_theta
        if separate and arch != "Gemma3ForCausalLM":
            raise _refuse(arch, "rope_local_theta", c.rope_local_theta,
                          "only Gemma 3 has a RoPE base of its own for local layers")
        if arch == "Gemma3ForCausalLM" and c.rope_scaling and c.rope_local_theta is None:
            raise _refuse(arch, "rope_scaling", c.rope_scaling, "Gemma 3 scales the global "
                          "layers only: set rope_local_theta for the local ones")


def _rope_parameters(config: TransformerConfig, arch: str) -> dict:
    c = config
    rope = {"rope_type": "default", "rope_theta": float(c.rope_theta)}
    if c.rope_scaling == "linear":
        rope.update(rope_type="linear", factor=float(c.rope_scaling_factor))
    elif c.rope_scaling == "llama3":
        rope.update(rope_type="llama3", factor=float(c.rope_scaling_factor),
                    low_freq_factor=float(c.rope_low_freq_factor),
                    high_freq_factor=float(c.rope_high_freq_factor),
                    original_max_position_embeddings=int(c.rope_original_max_len))
    if arch != "Gemma3ForCausalLM":
        return rope
    local = c.rope_theta if c.rope_local_theta is None else c.rope_local_theta
    return {"full_attention": rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": float(local)}}


def config_to_hf(config: TransformerConfig, arch: str, dtype: str = "float32") -> dict:
    """The `config.json` dict of `config` as `arch` (checked: `check_exportable`)."""
    check_exportable(config, arch)
    c = config
    values = {
        "architectures": [arch], "model_type": MODEL_TYPES[arch],
        "vocab_size": c.tgt_vocab_size, "hidden_size": c.d_model,
        "intermediate_size": c.d_ff, "num_hidden_layers": c.num_decoder_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.kv_heads,
        "head_dim": c.head_dim, "max_position_embeddings": c.decoder_len,
        "rms_norm_eps": float(c.layer_norm_epsilon),
        "hidden_activation" if arch in GEMMA else "hidden_act": HF_ACTIVATIONS[c.activation],
        "tie_word_embeddings": bool(c.tie_output_embedding),
        "rope_parameters": _rope_parameters(c, arch),
        "pad_token_id": c.pad_id, "bos_token_id": c.bos_id, "eos_token_id": c.eos_id,
        "dtype": dtype, "torch_dtype": dtype,  # transformers 5 / 4
    }
    if arch != "Qwen2ForCausalLM":
        values["attention_bias"] = c.has_attention_bias("q")
    if arch == "LlamaForCausalLM":
        values["mlp_bias"] = bool(c.ffn_bias)
    local = c.local_layers(c.num_decoder_layers)
    if arch == "MistralForCausalLM":
        values["sliding_window"] = c.sliding_window if any(local) else None
    elif arch in WINDOWED:
        values["sliding_window"] = c.sliding_window if any(local) else None
        values["layer_types"] = ["sliding_attention" if x else "full_attention" for x in local]
        if arch.startswith("Qwen"):
            values["use_sliding_window"] = any(local)
            values["max_window_layers"] = c.num_decoder_layers if not any(local) else 0
    if arch in GEMMA:
        scale = c.head_dim ** -0.5 if c.query_scale is None else c.query_scale
        scalar = float(scale) ** -2
        values.update(query_pre_attn_scalar=int(round(scalar)) if np.isclose(
            scalar, round(scalar), rtol=1e-9) else scalar,
            attn_logit_softcapping=c.attn_logit_softcapping,
            final_logit_softcapping=c.final_logit_softcapping)
    return values


def tensors_to_hf(config: TransformerConfig, params, arch: str, dtype=np.float32) -> dict:
    """Hugging Face tensor name -> numpy array (torch Linear layout) of `params` (either
    layer layout), a loop over the family's table (`llama_tensors.LLAMA`); ValueError if
    a parameter has no place in `arch` or the params are of another config."""
    check_exportable(config, arch)
    flat = flatten(unstack_layers(params))
    dims = LLAMA.dims(config)
    # Interleaved RoPE rows -> Hugging Face's half-split rows (the inverse permutation).
    to_half = (np.argsort(half_to_interleaved_rows(config.head_dim))
               if config.rope == "interleaved" else None)
    entries = tensor_table.entries(LLAMA, config)
    out: dict[str, np.ndarray] = {}
    for entry in entries:
        if entry.ours not in flat:
            raise ValueError(f"params have no {entry.ours!r}, which {arch}'s {entry.hf} needs "
                             "(params of another config?)")
        value = tensor_table.to_file(entry.row, np.asarray(flat[entry.ours], np.float32),
                                     dims, to_half)
        out[entry.hf] = np.ascontiguousarray(value).astype(dtype)
    unused = sorted(set(flat) - {e.ours for e in entries})
    if unused:
        raise ValueError(f"cannot export as {arch}: parameters with no Hugging Face "
                         f"tensor: {', '.join(unused)}")
    try:
        tensor_table.check_shapes({e.hf: e.shape for e in entries},
                                  {n: v.shape for n, v in out.items()})
    except ValueError as error:
        raise ValueError(f"parameters do not match the config: {error}") from error
    return out


def _tokenizer_config(tokenizer, config: TransformerConfig, chat_template=None) -> dict:
    names = {}
    for role, i in (("pad_token", config.pad_id), ("bos_token", config.bos_id),
                    ("eos_token", config.eos_id)):
        token = tokenizer.id_to_token(i)
        if token is None:
            raise ValueError(f"the tokenizer has no token for {role} id {i} "
                             f"(TransformerConfig.{role[:3]}_id)")
        names[role] = token
    # Text spelling a special token stays text where the tokenizer says so (runs trained
    # here: jaxformer.text.JSONTokenizer); transformers reads that from here.
    values = {"tokenizer_class": "PreTrainedTokenizerFast",
              "model_max_length": config.decoder_len,
              "split_special_tokens": bool(tokenizer.encode_special_tokens), **names}
    if chat_template is not None:
        values["chat_template"] = chat_template
    return values


def save_hf(model_config: TransformerConfig, params, out_dir, *, tokenizer=None,
            architecture: Optional[str] = None, dtype: Optional[str] = None,
            chat_template: Optional[str] = None) -> str:
    """Write `params` of a `DecoderOnlyLM(model_config)` as a Hugging Face directory.

    `tokenizer`: a `tokenizers.Tokenizer` (written as tokenizer.json) or None; its
    `encode_special_tokens` is kept as `split_special_tokens` in tokenizer_config.json.
    `architecture`: e.g. "Qwen2ForCausalLM" (default: `architecture_of(model_config)`).
    `dtype`: "float32", "bfloat16" or "float16" for the tensors (default: the params').
    `chat_template`: a Jinja chat template for tokenizer_config.json (`apply_chat_template`).
    Returns `out_dir`. ValueError (nothing written) for a config the architecture
    cannot express, params of another config, or an `out_dir` that is not empty.
    """
    out_dir = os.path.abspath(os.fspath(out_dir))
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise ValueError(f"{out_dir} already exists and is not empty: choose a new directory "
                         "(nothing is overwritten)")
    arch = architecture or architecture_of(model_config)
    if dtype is None:  # the embedding table's (no array is copied to find it)
        table = flatten(params).get("embed/embedding")
        dtype = "float32" if table is None else np.dtype(table.dtype).name
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype {dtype!r}: exportable float32, bfloat16, float16")
    import ml_dtypes  # noqa: PLC0415 - numpy's bfloat16 (a JAX dependency)
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    values = config_to_hf(model_config, arch, dtype)
    tensors = tensors_to_hf(model_config, params, arch, np_dtype)
    files = {"config.json": values,
             "generation_config.json": {"bos_token_id": model_config.bos_id,
                                        "eos_token_id": model_config.eos_id,
                                        "pad_token_id": model_config.pad_id}}
    if tokenizer is not None:
        files["tokenizer_config.json"] = _tokenizer_config(tokenizer, model_config,
                                                           chat_template)
    from safetensors.numpy import save_file  # noqa: PLC0415 - optional

    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    # Named before it is made, so a Ctrl-C that comes just after `mkdir` (before a
    # `mkdtemp` would have returned its name) still finds it to remove.
    staging = os.path.join(parent, f".{os.path.basename(out_dir)}.{secrets.token_hex(6)}")
    try:
        os.mkdir(staging, 0o700)
        for name, content in files.items():
            with open(os.path.join(staging, name), "w") as f:
                json.dump(content, f, indent=2)
                f.write("\n")
        if tokenizer is not None:
            tokenizer.save(os.path.join(staging, "tokenizer.json"))
        save_file(tensors, os.path.join(staging, "model.safetensors"),
                  metadata={"format": "pt"})
        umask = os.umask(0)
        os.umask(umask)
        for name in os.listdir(staging):  # the user's default permissions, not 0600
            os.chmod(os.path.join(staging, name), 0o666 & ~umask)
        os.chmod(staging, 0o777 & ~umask)  # (mkdtemp's is 0700)
        os.rename(staging, out_dir)  # fails if out_dir was filled meanwhile
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir

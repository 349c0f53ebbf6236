"""`TransformerConfig`'s validation: every field checked once, as the config is built
(`check_config`), each problem one ValueError naming the field; the choices and
layouts the fields may take."""

from __future__ import annotations

import math
import numbers

# RoPE frequency scaling kinds, as checkpoints name them (Hugging Face's `rope_type`).
ROPE_SCALINGS = ("linear", "llama3")

CHOICES = {  # field -> the values it may take
    "norm": ("post", "pre", "sandwich", "post_sublayer"),
    "embedding_scale_dtype": ("param", "compute"),
    "activation": ("relu", "gelu", "gelu_tanh", "silu"),
    "encoder_positions": ("sinusoidal", "learned", "fixed", "none"),
    "decoder_positions": ("sinusoidal", "learned", "fixed", "none"),
    "norm_type": ("layernorm", "rmsnorm"),
    "rope": ("none", "half", "interleaved"),
    "dtype": ("float32", "bfloat16", "float16"),
    "param_dtype": ("float32", "bfloat16", "float16"),
    "attention_impl": ("einsum", "jax", "blockwise", "auto"),
    "encoder_input": ("tokens", "embedded"),
    "remat": ("none", "full", "save_proj", "save_dots"),
    "precision": ("default", "mixed"),
}

# LoRA adapters (`jaxformer.nn.lora`): the projections `lora_targets` may name.
# q/k/v/o: attention; gate/up/down: the FFN's gate, wi and wo (gate needs gated_ffn).
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


# Weight-only quantization (`jaxformer.nn.quant`): the layouts a quantized kernel may have.
# "int8": int8, one float32 scale per output channel (symmetric). The block layouts run
# along the kernel's input axis in blocks of `quant_block` with float16 block scales, as
# GGUF's: "int4" four bits, two per uint8, w = scale * q + offset (GGUF Q4_1); "int4_sym"
# four bits, w = scale * (q - 8) (GGUF Q4_0); "int8_block" int8, w = scale * q (GGUF Q8_0).
# "q4_k", "q5_k", "q6_k": GGUF's K-quants, super-blocks of 256 values whatever
# `quant_block` (`jaxformer.nn.kquant`).
WEIGHT_QUANT = ("int8", "int4", "int4_sym", "int8_block", "q4_k", "q5_k", "q6_k")
K_QUANT = ("q4_k", "q5_k", "q6_k")


def is_finite_number(value) -> bool:
    """A real number (int or float, numpy's too; not a bool), neither NaN nor infinite:
    what every numeric setting of the library takes."""
    return (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and math.isfinite(value))


def is_positive_number(value) -> bool:
    return is_finite_number(value) and value > 0


def require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"TransformerConfig.{field} {message}")


def check_config(c, derived_head_dim: bool) -> None:
    """ValueError naming the first field of TransformerConfig `c` that is not valid
    (`derived_head_dim`: head_dim was derived from d_model / num_heads)."""
    for name in ("src_vocab_size", "tgt_vocab_size", "d_model", "num_heads",
                 "d_ff", "max_len"):
        require(isinstance(getattr(c, name), int) and getattr(c, name) > 0,
                name, f"must be a positive int, got {getattr(c, name)!r}")
    for name in ("encoder_max_len", "decoder_max_len"):
        value = getattr(c, name)
        require(value is None or (isinstance(value, int) and value > 0), name,
                f"must be None or a positive int, got {value!r}")
    for name in ("num_encoder_layers", "num_decoder_layers"):
        value = getattr(c, name)
        require(isinstance(value, int) and value >= 0, name,
                f"must be a non-negative int, got {value!r}")
    require(c.num_decoder_layers > 0, "num_decoder_layers",
            "must be positive: every model here ends in a decoder")
    require(not derived_head_dim or c.d_model % c.num_heads == 0, "d_model",
            f"{c.d_model} is not divisible by num_heads={c.num_heads} "
            "(or set head_dim)")
    for name in ("attention_dropout", "residual_dropout", "embedding_dropout",
                 "ffn_dropout"):
        value = getattr(c, name)
        require(is_finite_number(value) and 0.0 <= value < 1.0, name,
                f"must be in [0, 1), got {value!r}")
    for name, choices in CHOICES.items():
        require(getattr(c, name) in choices, name,
                f"must be one of {choices}, got {getattr(c, name)!r}")
    for name in ("scan_layers", "cpu_tuning", "tied_output_bias", "mask_decoder_pad"):
        require(isinstance(getattr(c, name), bool), name,
                f"must be a bool, got {getattr(c, name)!r}")
    require(c.precision != "mixed" or (c.dtype, c.param_dtype)
            == ("float32", "float32"), "precision",
            '"mixed" sets bfloat16 compute and float32 params itself: leave dtype and '
            f"param_dtype at float32 (got {c.dtype}/{c.param_dtype})")
    require(c.attention_impl == "einsum" or c.attention_dropout == 0.0,
            "attention_impl", f'"{c.attention_impl}" has no attention dropout: set '
            'attention_dropout=0 (or attention_impl="einsum")')
    require(c.num_kv_heads is None or (
        isinstance(c.num_kv_heads, int) and c.num_kv_heads > 0
        and c.num_heads % c.num_kv_heads == 0), "num_kv_heads",
        f"must be a positive int dividing num_heads={c.num_heads}, "
        f"got {c.num_kv_heads!r}")
    require(c.rope == "none" or c.head_dim % 2 == 0, "rope",
            f"needs an even head dim (rotated in pairs), got head_dim={c.head_dim}")
    require(is_positive_number(c.rope_theta), "rope_theta",
            f"must be a positive finite number, got {c.rope_theta!r}")
    _check_blocks(c)
    _check_lora(c)
    _check_quant(c)
    require(is_positive_number(c.layer_norm_epsilon), "layer_norm_epsilon",
            f"must be a positive finite number, got {c.layer_norm_epsilon!r}")
    for name in ("pad_id", "bos_id", "eos_id"):
        value = getattr(c, name)
        require(0 <= value < min(c.src_vocab_size, c.tgt_vocab_size), name,
                f"{value} is outside the vocabularies "
                f"(src {c.src_vocab_size}, tgt {c.tgt_vocab_size})")
    # PAD may be EOS (many tokenizers reuse it): decoding never reads a token
    # after EOS. BOS must differ from both: it starts every decode (it may be PAD
    # when the decoder's mask does not hide PAD keys: mask_decoder_pad=False).
    require(c.bos_id != c.eos_id and (c.bos_id != c.pad_id
                                            or not c.mask_decoder_pad), "pad_id",
            f"pad/bos/eos ids: BOS must differ from PAD and EOS (PAD may equal EOS; BOS "
            f"may equal PAD with mask_decoder_pad=False), "
            f"got {c.pad_id}/{c.bos_id}/{c.eos_id}")
    require(c.attention_biases is None or (
        isinstance(c.attention_biases, str)
        and set(c.attention_biases) <= set("qkvo")
        and len(set(c.attention_biases)) == len(c.attention_biases)),
        "attention_biases", f'must be None or distinct letters of "qkvo", '
        f"got {c.attention_biases!r}")
    require(not c.share_embeddings or c.encoder_input == "tokens",
            "share_embeddings", 'needs encoder_input="tokens" (a source token table)')
    require(not c.share_embeddings or c.src_vocab_size == c.tgt_vocab_size,
            "share_embeddings",
            f"needs src_vocab_size == tgt_vocab_size, got "
            f"{c.src_vocab_size} and {c.tgt_vocab_size}")


def _check_blocks(c) -> None:
    """The choices of today's open models (Gemma, Qwen, Mistral, Llama 3)."""
    for name in ("query_scale", "attn_logit_softcapping", "final_logit_softcapping",
                 "rope_local_theta"):
        value = getattr(c, name)
        require(value is None or is_positive_number(value), name,
                f"must be None or a positive finite number, got {value!r}")
    for name in ("qk_norm", "norm_scale_plus_one"):
        require(isinstance(getattr(c, name), bool), name,
                f"must be a bool, got {getattr(c, name)!r}")
    require(not c.norm_scale_plus_one or c.norm_type == "rmsnorm",
            "norm_scale_plus_one", 'is an RMSNorm parameterisation: needs norm_type="rmsnorm"')
    require(c.sliding_window is None or (isinstance(c.sliding_window, int)
                                            and c.sliding_window > 0),
            "sliding_window", f"must be None or a positive int, got {c.sliding_window!r}")
    pattern = c.attention_pattern
    require(pattern is None or (isinstance(pattern, str) and pattern
                                and set(pattern) <= set("LG")), "attention_pattern",
            f'must be None or a non-empty string of "L" (local) and "G" (global), '
            f"got {pattern!r}")
    require(pattern is None or "L" not in pattern or c.sliding_window is not None,
            "attention_pattern", 'has local layers ("L"): set sliding_window')
    require(c.attention_impl != "jax" or c.attn_logit_softcapping is None,
            "attn_logit_softcapping", 'needs attention_impl="einsum", "blockwise" or "auto" '
            "(jax.nn.dot_product_attention has no soft cap)")
    require(c.rope_scaling is None or c.rope_scaling in ROPE_SCALINGS,
            "rope_scaling", f"{c.rope_scaling!r} is not implemented "
            f"(implemented: None, {', '.join(map(repr, ROPE_SCALINGS))})")
    require(is_positive_number(c.rope_scaling_factor), "rope_scaling_factor",
            f"must be a positive finite number, got {c.rope_scaling_factor!r}")
    require(c.rope_scaling != "llama3" or (
        is_finite_number(c.rope_high_freq_factor)
        and 0 < c.rope_low_freq_factor < c.rope_high_freq_factor
        and isinstance(c.rope_original_max_len, int) and c.rope_original_max_len > 0),
        "rope_low_freq_factor", "llama3 scaling needs 0 < rope_low_freq_factor < "
        "rope_high_freq_factor and a positive rope_original_max_len, got "
        f"{c.rope_low_freq_factor}, {c.rope_high_freq_factor}, "
        f"{c.rope_original_max_len}")

def _check_lora(c) -> None:
    require(isinstance(c.lora_rank, int) and not isinstance(c.lora_rank, bool)
            and c.lora_rank >= 0, "lora_rank",
            f"must be a non-negative int (0: no adapters), got {c.lora_rank!r}")
    require(c.lora_alpha is None or is_positive_number(c.lora_alpha), "lora_alpha",
            f"must be None or a positive finite number, got {c.lora_alpha!r}")
    valid = LORA_TARGETS if c.gated_ffn else tuple(t for t in LORA_TARGETS
                                                      if t != "gate")
    for target in c.lora_targets:
        require(target in valid, "lora_targets",
                f"{target!r} is not a projection of this model; valid: {', '.join(valid)}")
    require(len(set(c.lora_targets)) == len(c.lora_targets) and
            (c.lora_targets or not c.lora_rank), "lora_targets",
            f"must name distinct projections (at least one with lora_rank > 0), "
            f"got {c.lora_targets!r}")

def _quantized_inputs(c, formats: tuple) -> dict:
    """{name: size} of the kernel input axes that a layout among `formats` splits."""
    inputs = {}
    if c.quant_format("embed") in formats:
        inputs["d_model"] = c.d_model
    if c.weight_quant in formats:
        inputs.update({"d_model": c.d_model, "d_ff": c.d_ff,
                       "num_heads * head_dim": c.num_heads * c.head_dim})
    return inputs


def _check_quant(c) -> None:
    for name, extra in (("weight_quant", (None,)), ("embed_quant", (None, "float"))):
        require(getattr(c, name) in extra + WEIGHT_QUANT, name,
                f"{getattr(c, name)!r} is not a quantized layout; valid: "
                f"{', '.join(map(repr, extra + WEIGHT_QUANT))}")
    require(c.kv_cache_quant in (None, "int8"), "kv_cache_quant",
            f"must be None or 'int8', got {c.kv_cache_quant!r}")
    block = c.quant_block
    require(isinstance(block, int) and not isinstance(block, bool) and block > 0
            and block % 2 == 0, "quant_block",
            f"must be a positive even int (GGUF: 32), got {block!r}")
    layouts = c.quant_layouts
    require(isinstance(layouts, tuple) and all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and p[1] in WEIGHT_QUANT
        for p in layouts), "quant_layouts",
        f"must be ((module path, layout), ...) with layouts among "
        f"{', '.join(map(repr, WEIGHT_QUANT))}, got {layouts!r}")
    require(not (c.scan_layers and any("layers_" in path for path, _ in layouts)),
            "quant_layouts", "names per-layer kernels, which a scanned stack cannot hold "
            "(each layer's arrays must have one shape): set scan_layers=False")
    require(not layouts or (c.weight_quant is not None or c.quant_format("embed")),
            "quant_layouts", "needs weight_quant or embed_quant set (the roles' layouts)")
    for formats, size, field, what in (
            (("int4", "int4_sym", "int8_block"), block, "quant_block",
             f"{block} does not divide {{}} (a kernel's input axis, split into blocks)"),
            (K_QUANT, 256, "weight_quant", "K-quant layouts take super-blocks of 256 values, "
             "which do not divide {} (a kernel's input axis): use a block layout there")):
        for name, value in _quantized_inputs(c, formats).items():
            require(value % size == 0, field, what.format(f"{name}={value}"))

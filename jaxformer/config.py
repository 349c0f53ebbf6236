"""The one configuration object: every architecture choice, validated once.

A `TransformerConfig` is a frozen dataclass, so it is hashable and can be a
static argument to `jax.jit`. Strings (not dtype objects) keep it JSON-friendly
for run directories and checkpoints: `TransformerConfig(**json.load(f))`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Literal, Optional

import jax.numpy as jnp

Norm = Literal["post", "pre", "sandwich", "post_sublayer"]
Activation = Literal["relu", "gelu", "gelu_tanh", "silu"]
Positions = Literal["sinusoidal", "learned", "fixed", "none"]
NormType = Literal["layernorm", "rmsnorm"]
Rope = Literal["none", "half", "interleaved"]
AttentionImpl = Literal["einsum", "jax", "blockwise", "auto"]
Remat = Literal["none", "full", "save_proj", "save_dots"]
Precision = Literal["default", "mixed"]
# RoPE frequency scaling kinds, as checkpoints name them (Hugging Face's `rope_type`).
ROPE_SCALINGS = ("linear", "llama3")

_CHOICES = {
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
WEIGHT_QUANT = ("int8", "int4", "int4_sym", "int8_block")


# Fields of earlier versions, read and ignored (they changed no result): run
# directories and checkpoints saved with them still load.
LEGACY_FIELDS = ("kernel_grad",)


class ConfigMixin:
    """replace / to_dict / from_dict for the frozen config dataclasses (JSON round trip)."""

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict):
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in values.items() if k not in LEGACY_FIELDS}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown field(s) {unknown}")
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class TransformerConfig(ConfigMixin):
    """Architecture of an encoder-decoder Transformer or a decoder-only LM.

    The decoder-only LM (`DecoderOnlyLM`) reads only the `tgt_*`/decoder fields;
    build one with `num_encoder_layers=0`.
    """

    src_vocab_size: int = 16
    tgt_vocab_size: int = 16
    d_model: int = 64
    num_heads: int = 4
    d_ff: int = 128
    num_encoder_layers: int = 2
    num_decoder_layers: int = 2
    max_len: int = 64
    # Dropout on the attention weights, on each sublayer output before the
    # residual add, on (token + position) embeddings, and after the FFN
    # activation. torch.nn.Transformer uses one `dropout` for all four.
    attention_dropout: float = 0.0
    residual_dropout: float = 0.0
    embedding_dropout: float = 0.0
    ffn_dropout: float = 0.0
    # Where each sublayer f's norm sits:
    # "post": x = LN(x + f(x)) (the original paper, seed 001);
    # "pre":  x = x + f(LN(x)), followed by a final LN per stack (seed 002);
    # "sandwich": x = x + LN'(f(LN(x))), a norm before and after (Gemma 2/3;
    #   the second is `*_post_norm`);
    # "post_sublayer": x = x + LN(f(x)), the norm on the sublayer's output (OLMo 2).
    norm: Norm = "post"
    # A final LayerNorm after each stack. None: for every placement but "post".
    # torch.nn.Transformer always has one, so weights imported from it set this to True.
    final_norm: Optional[bool] = None
    # "gelu" is the exact erf form (torch.nn.GELU()); "gelu_tanh" the approximation;
    # "silu" = x * sigmoid(x) (with gated_ffn: SwiGLU).
    activation: Activation = "relu"
    # Gated FFN, W_down (act(W_gate x) * W_up x): SwiGLU with "silu", GeGLU with
    # "gelu"/"gelu_tanh" (Shazeer 2020). Parameters ffn/gate, ffn/wi (up), ffn/wo (down).
    gated_ffn: bool = False
    # Absolute positions added to the embeddings; "none" for RoPE-only models.
    # "fixed": a (length, D) table held in the parameters (a checkpoint supplies
    # it, e.g. Whisper's encoder sinusoids of another formula) and not trained
    # (stop_gradient); initialised to the sinusoidal table.
    encoder_positions: Positions = "sinusoidal"
    decoder_positions: Positions = "sinusoidal"
    # Rotary position embeddings on the queries and keys of self-attention
    # (not cross-attention: its queries and keys are different sequences).
    # "half" rotates pairs (i, i + K/2) (GPT-NeoX, Hugging Face Llama);
    # "interleaved" pairs (2i, 2i + 1) (RoFormer, Meta's Llama, GGUF files).
    rope: Rope = "none"
    rope_theta: float = 10000.0
    # RoPE base of the local (sliding-window) layers; None = rope_theta. Gemma 3:
    # 10000 local, 1e6 global.
    rope_local_theta: Optional[float] = None
    # RoPE frequency scaling as a checkpoint states it: None, "linear" (every
    # frequency / factor) or "llama3" (Llama 3.1's smooth low-frequency scaling with
    # rope_low_freq_factor, rope_high_freq_factor, rope_original_max_len). It
    # applies to the layers that use rope_theta (not to local layers with their own
    # rope_local_theta: Gemma 3 scales its global layers only).
    rope_scaling: Optional[str] = None
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    # "layernorm": (x - mean) / std * scale + bias; "rmsnorm": x / rms(x) * scale.
    norm_type: NormType = "layernorm"
    layer_norm_epsilon: float = 1e-5  # the epsilon of either norm
    # RMSNorm as x / rms(x) * (1 + scale), scale initialised to 0 (Gemma), in float32.
    norm_scale_plus_one: bool = False
    # Per-head norm (the configured norm over K) of the queries and keys of every
    # attention, before RoPE (Qwen 3, Gemma 3). Parameters query_norm, key_norm (K,).
    qk_norm: bool = False
    # Features K per head; None = d_model // num_heads (Gemma: 256 with d_model 640).
    # Always an int once built (None is resolved; `replace` re-derives it).
    head_dim: Optional[int] = None
    # Attention logits = q.k * query_scale; None = 1 / sqrt(head_dim). Gemma:
    # query_pre_attn_scalar ** -0.5.
    query_scale: Optional[float] = None
    # Soft caps: logits -> cap * tanh(logits / cap), on attention logits (after the
    # scale, before the mask) and on the output logits (Gemma 2). None = off.
    attn_logit_softcapping: Optional[float] = None
    final_logit_softcapping: Optional[float] = None
    # Local attention: a local layer's query at slot t sees keys at slots
    # t - sliding_window < s <= t (Mistral, Gemma 2/3, Qwen 2). Which layers are
    # local: `attention_pattern`, letters "L" (local) and "G" (global) repeated
    # over the layers ("LG": Gemma 2; "LLLLLG": Gemma 3; one letter per layer for
    # an explicit list); None = every layer local when sliding_window is set.
    sliding_window: Optional[int] = None
    attention_pattern: Optional[str] = None
    # Key/value heads G (grouped-query attention; 1 = multi-query). None = num_heads.
    # Each group of num_heads / G query heads shares one key/value head, so the
    # KV cache holds G heads.
    num_kv_heads: Optional[int] = None
    attention_bias: bool = True
    # Which attention projections have a bias, as letters of "qkvo" (query, key,
    # value, out); None = all four iff attention_bias. Whisper: "qvo" (no key bias).
    attention_biases: Optional[str] = None
    ffn_bias: bool = True
    output_bias: bool = True  # bias of decoder/out_proj (when not tied)
    # With tie_output_embedding: a bias (V,) added to the tied logits,
    # decoder/logits_bias (Marian's final_logits_bias).
    tied_output_bias: bool = False
    # Multiply token embeddings by sqrt(d_model) (paper, seeds 000/002).
    scale_embeddings: bool = True
    # "param": the table's rows times sqrt(d_model), then cast to the compute dtype;
    # "compute": cast first, then times sqrt(d_model) rounded to the compute dtype
    # (Gemma's normaliser in Hugging Face). Equal in float32.
    embedding_scale_dtype: str = "param"
    # Output projection = target embedding transposed (no separate matrix).
    tie_output_embedding: bool = False
    # What the encoder reads: "tokens" (ids through src_embed) or "embedded"
    # ((B, S, D) vectors, or features through the Transformer's `stem`): then
    # there is no source token table in the parameters.
    encoder_input: str = "tokens"
    # One embedding table for source and target (needs equal vocab sizes).
    share_embeddings: bool = False
    # Positions per stack (the table length and the longest input): None = max_len.
    # Whisper: encoder 1500 frames, decoder 448 tokens.
    encoder_max_len: Optional[int] = None
    decoder_max_len: Optional[int] = None
    # The encoder-decoder's default target mask: causal and PAD keys hidden (True),
    # or causal only (False: Hugging Face's seq2seq models, whose decoding may start
    # with PAD: Marian's decoder_start_token_id is its pad_token_id, bos_id == pad_id).
    mask_decoder_pad: bool = True
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"
    # "einsum": jaxformer's own attention (dropout on weights, weights sown for
    # inspection). "jax": jax.nn.dot_product_attention, which picks a fused
    # kernel (cuDNN flash attention on GPU) where one exists; no attention
    # dropout and no sown weights. "blockwise": online softmax over key blocks
    # (jaxformer.nn.blockwise), memory linear in length, masks as structure
    # (MaskSpec); no attention dropout, no sown weights. "auto": picked per call
    # at trace time by `jaxformer.nn.attention_select.resolved_attention_impl`
    # (cuDNN on GPU where it applies, blockwise for long sequences, einsum else).
    attention_impl: AttentionImpl = "einsum"
    # Deep stacks (see layer_stack.py). scan_layers: each stack is one
    # `nn.scan`ned layer with stacked (L, ...) parameters `layers/...` instead
    # of `layers_0..layers_{L-1}` (convert with jaxformer.nn.stacking).
    scan_layers: bool = False
    # Rematerialisation of each layer on the backward pass: "none", "full",
    # "save_proj" (keep the projection matmuls) or "save_dots" (keep all matmuls).
    remat: Remat = "none"
    # "default": `dtype` / `param_dtype` as given. "mixed": bfloat16 compute
    # with float32 parameters (so float32 gradients and optimizer state), and
    # norms, softmax, logits and loss in float32; leave dtype/param_dtype at
    # float32 (it sets them).
    precision: Precision = "default"
    # XLA:CPU fusion steering (jaxformer.backends.cpu): Dense kernel gradients in
    # the kernel's layout (a custom VJP: no jax.jvp / jax.jacfwd through the
    # model) and dropout masks drawn once. Same values up to rounding; gated by
    # lax.platform_dependent, so GPU and TPU programs never contain them.
    cpu_tuning: bool = False
    # LoRA (jaxformer.nn.lora): lora_rank > 0 adds low-rank adapters (A random, B zero,
    # so an untrained adapter changes nothing) to the projections named in
    # lora_targets (LORA_TARGETS; default q and v, PEFT's default for Llama-style
    # models); their output is scaled by lora_alpha / lora_rank (None: alpha = rank).
    # Training such a model trains only the adapters (jaxformer.train.state, jaxformer.train.step).
    lora_rank: int = 0
    lora_alpha: Optional[float] = None
    lora_targets: tuple = ("q", "v")
    # Weight-only quantization (jaxformer.nn.quant; layouts: WEIGHT_QUANT): the attention
    # and FFN kernels are held as integers with scales (params `kernel_q`, `scale`,
    # `offset` instead of `kernel`) and dequantized inside the compiled matmul.
    # `embed_quant`: the token tables and the output projection (tied or not); None: as
    # weight_quant, "float": not quantized. `quant_block`: the block length of the block
    # layouts along a kernel's input axis (GGUF: 32). Convert float parameters with
    # `jaxformer.nn.quant_params.quantize_params`.
    weight_quant: Optional[str] = None
    embed_quant: Optional[str] = None
    quant_block: int = 32
    # The decode cache's self-attention keys and values (jaxformer.nn.kv_quant): None
    # (the compute dtype) or "int8" (int8 with one float32 scale per head and token,
    # quantized when written, dequantized when read).
    kv_cache_quant: Optional[str] = None

    def __post_init__(self):
        targets = self.lora_targets  # "q,v" (CLI) or a list (JSON): a hashable tuple
        if isinstance(targets, str):
            targets = tuple(t.strip() for t in targets.split(",") if t.strip())
        object.__setattr__(self, "lora_targets", tuple(targets))
        _require(self.head_dim is None or (isinstance(self.head_dim, int)
                                           and self.head_dim > 0), "head_dim",
                 f"must be None or a positive int, got {self.head_dim!r}")
        # head_dim None is resolved to d_model // num_heads; `replace` re-derives it.
        object.__setattr__(self, "_derived_head_dim", self.head_dim is None)
        if self.head_dim is None and isinstance(self.num_heads, int) and self.num_heads > 0 \
                and isinstance(self.d_model, int):
            object.__setattr__(self, "head_dim", self.d_model // self.num_heads)
        for name in ("src_vocab_size", "tgt_vocab_size", "d_model", "num_heads",
                     "d_ff", "max_len"):
            _require(isinstance(getattr(self, name), int) and getattr(self, name) > 0,
                     name, f"must be a positive int, got {getattr(self, name)!r}")
        for name in ("encoder_max_len", "decoder_max_len"):
            value = getattr(self, name)
            _require(value is None or (isinstance(value, int) and value > 0), name,
                     f"must be None or a positive int, got {value!r}")
        for name in ("num_encoder_layers", "num_decoder_layers"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value >= 0, name,
                     f"must be a non-negative int, got {value!r}")
        _require(self.num_decoder_layers > 0, "num_decoder_layers",
                 "must be positive: every model here ends in a decoder")
        _require(not self._derived_head_dim or self.d_model % self.num_heads == 0, "d_model",
                 f"{self.d_model} is not divisible by num_heads={self.num_heads} "
                 "(or set head_dim)")
        for name in ("attention_dropout", "residual_dropout", "embedding_dropout",
                     "ffn_dropout"):
            value = getattr(self, name)
            _require(is_finite_number(value) and 0.0 <= value < 1.0, name,
                     f"must be in [0, 1), got {value!r}")
        for name, choices in _CHOICES.items():
            _require(getattr(self, name) in choices, name,
                     f"must be one of {choices}, got {getattr(self, name)!r}")
        for name in ("scan_layers", "cpu_tuning", "tied_output_bias", "mask_decoder_pad"):
            _require(isinstance(getattr(self, name), bool), name,
                     f"must be a bool, got {getattr(self, name)!r}")
        _require(self.precision != "mixed" or (self.dtype, self.param_dtype)
                 == ("float32", "float32"), "precision",
                 '"mixed" sets bfloat16 compute and float32 params itself: leave dtype and '
                 f"param_dtype at float32 (got {self.dtype}/{self.param_dtype})")
        _require(self.attention_impl == "einsum" or self.attention_dropout == 0.0,
                 "attention_impl", f'"{self.attention_impl}" has no attention dropout: set '
                 'attention_dropout=0 (or attention_impl="einsum")')
        _require(self.num_kv_heads is None or (
            isinstance(self.num_kv_heads, int) and self.num_kv_heads > 0
            and self.num_heads % self.num_kv_heads == 0), "num_kv_heads",
            f"must be a positive int dividing num_heads={self.num_heads}, "
            f"got {self.num_kv_heads!r}")
        _require(self.rope == "none" or self.head_dim % 2 == 0, "rope",
                 f"needs an even head dim (rotated in pairs), got head_dim={self.head_dim}")
        _require(is_positive_number(self.rope_theta), "rope_theta",
                 f"must be a positive finite number, got {self.rope_theta!r}")
        self._check_blocks()
        self._check_lora()
        self._check_quant()
        _require(is_positive_number(self.layer_norm_epsilon), "layer_norm_epsilon",
                 f"must be a positive finite number, got {self.layer_norm_epsilon!r}")
        for name in ("pad_id", "bos_id", "eos_id"):
            value = getattr(self, name)
            _require(0 <= value < min(self.src_vocab_size, self.tgt_vocab_size), name,
                     f"{value} is outside the vocabularies "
                     f"(src {self.src_vocab_size}, tgt {self.tgt_vocab_size})")
        # PAD may be EOS (many tokenizers reuse it): decoding never reads a token
        # after EOS. BOS must differ from both: it starts every decode (it may be PAD
        # when the decoder's mask does not hide PAD keys: mask_decoder_pad=False).
        _require(self.bos_id != self.eos_id and (self.bos_id != self.pad_id
                                                 or not self.mask_decoder_pad), "pad_id",
                 f"pad/bos/eos ids: BOS must differ from PAD and EOS (PAD may equal EOS; BOS "
                 f"may equal PAD with mask_decoder_pad=False), "
                 f"got {self.pad_id}/{self.bos_id}/{self.eos_id}")
        _require(self.attention_biases is None or (
            isinstance(self.attention_biases, str)
            and set(self.attention_biases) <= set("qkvo")
            and len(set(self.attention_biases)) == len(self.attention_biases)),
            "attention_biases", f'must be None or distinct letters of "qkvo", '
            f"got {self.attention_biases!r}")
        _require(not self.share_embeddings or self.encoder_input == "tokens",
                 "share_embeddings", 'needs encoder_input="tokens" (a source token table)')
        _require(not self.share_embeddings or self.src_vocab_size == self.tgt_vocab_size,
                 "share_embeddings",
                 f"needs src_vocab_size == tgt_vocab_size, got "
                 f"{self.src_vocab_size} and {self.tgt_vocab_size}")

    def _check_blocks(self) -> None:
        """The choices of today's open models (Gemma, Qwen, Mistral, Llama 3)."""
        for name in ("query_scale", "attn_logit_softcapping", "final_logit_softcapping",
                     "rope_local_theta"):
            value = getattr(self, name)
            _require(value is None or is_positive_number(value), name,
                     f"must be None or a positive finite number, got {value!r}")
        for name in ("qk_norm", "norm_scale_plus_one"):
            _require(isinstance(getattr(self, name), bool), name,
                     f"must be a bool, got {getattr(self, name)!r}")
        _require(not self.norm_scale_plus_one or self.norm_type == "rmsnorm",
                 "norm_scale_plus_one", 'is an RMSNorm parameterisation: needs norm_type="rmsnorm"')
        _require(self.sliding_window is None or (isinstance(self.sliding_window, int)
                                                 and self.sliding_window > 0),
                 "sliding_window", f"must be None or a positive int, got {self.sliding_window!r}")
        pattern = self.attention_pattern
        _require(pattern is None or (isinstance(pattern, str) and pattern
                                     and set(pattern) <= set("LG")), "attention_pattern",
                 f'must be None or a non-empty string of "L" (local) and "G" (global), '
                 f"got {pattern!r}")
        _require(pattern is None or "L" not in pattern or self.sliding_window is not None,
                 "attention_pattern", 'has local layers ("L"): set sliding_window')
        _require(self.attention_impl != "jax" or self.attn_logit_softcapping is None,
                 "attn_logit_softcapping", 'needs attention_impl="einsum", "blockwise" or "auto" '
                 "(jax.nn.dot_product_attention has no soft cap)")
        _require(self.rope_scaling is None or self.rope_scaling in ROPE_SCALINGS,
                 "rope_scaling", f"{self.rope_scaling!r} is not implemented "
                 f"(implemented: None, {', '.join(map(repr, ROPE_SCALINGS))})")
        _require(is_positive_number(self.rope_scaling_factor), "rope_scaling_factor",
                 f"must be a positive finite number, got {self.rope_scaling_factor!r}")
        _require(self.rope_scaling != "llama3" or (
            is_finite_number(self.rope_high_freq_factor)
            and 0 < self.rope_low_freq_factor < self.rope_high_freq_factor
            and isinstance(self.rope_original_max_len, int) and self.rope_original_max_len > 0),
            "rope_low_freq_factor", "llama3 scaling needs 0 < rope_low_freq_factor < "
            "rope_high_freq_factor and a positive rope_original_max_len, got "
            f"{self.rope_low_freq_factor}, {self.rope_high_freq_factor}, "
            f"{self.rope_original_max_len}")

    def _check_lora(self) -> None:
        _require(isinstance(self.lora_rank, int) and not isinstance(self.lora_rank, bool)
                 and self.lora_rank >= 0, "lora_rank",
                 f"must be a non-negative int (0: no adapters), got {self.lora_rank!r}")
        _require(self.lora_alpha is None or is_positive_number(self.lora_alpha), "lora_alpha",
                 f"must be None or a positive finite number, got {self.lora_alpha!r}")
        valid = LORA_TARGETS if self.gated_ffn else tuple(t for t in LORA_TARGETS
                                                          if t != "gate")
        for target in self.lora_targets:
            _require(target in valid, "lora_targets",
                     f"{target!r} is not a projection of this model; valid: {', '.join(valid)}")
        _require(len(set(self.lora_targets)) == len(self.lora_targets) and
                 (self.lora_targets or not self.lora_rank), "lora_targets",
                 f"must name distinct projections (at least one with lora_rank > 0), "
                 f"got {self.lora_targets!r}")

    def _check_quant(self) -> None:
        for name, extra in (("weight_quant", (None,)), ("embed_quant", (None, "float"))):
            _require(getattr(self, name) in extra + WEIGHT_QUANT, name,
                     f"{getattr(self, name)!r} is not a quantized layout; valid: "
                     f"{', '.join(map(repr, extra + WEIGHT_QUANT))}")
        _require(self.kv_cache_quant in (None, "int8"), "kv_cache_quant",
                 f"must be None or 'int8', got {self.kv_cache_quant!r}")
        block = self.quant_block
        _require(isinstance(block, int) and not isinstance(block, bool) and block > 0
                 and block % 2 == 0, "quant_block",
                 f"must be a positive even int (GGUF: 32), got {block!r}")
        blocks = ("int4", "int4_sym", "int8_block")
        inputs = {}
        if self.quant_format("embed") in blocks:
            inputs["d_model"] = self.d_model
        if self.weight_quant in blocks:
            inputs.update({"d_model": self.d_model, "d_ff": self.d_ff,
                           "num_heads * head_dim": self.num_heads * self.head_dim})
        for name, size in inputs.items():
            _require(size % block == 0, "quant_block",
                     f"{block} does not divide {name}={size} (a kernel's input axis, "
                     "split into blocks)")

    def quant_format(self, role: str) -> Optional[str]:
        """The quantized layout of the "layers" (attention, FFN) or "embed" (token tables,
        output projection) kernels; None for float."""
        if role == "layers":
            return self.weight_quant
        if self.embed_quant is None:
            return self.weight_quant
        return None if self.embed_quant == "float" else self.embed_quant

    @property
    def lora_scale(self) -> float:
        """The factor of the adapters' output: lora_alpha / lora_rank."""
        alpha = self.lora_rank if self.lora_alpha is None else self.lora_alpha
        return alpha / self.lora_rank if self.lora_rank else 0.0

    def replace(self, **changes):
        if self._derived_head_dim and "head_dim" not in changes:
            changes["head_dim"] = None  # derived from the (maybe new) d_model / num_heads
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        values = dataclasses.asdict(self)
        if self._derived_head_dim:
            values["head_dim"] = None  # stays derived after a round trip
        return values

    # Derived values: properties, so there is one source of truth.
    def layer_is_local(self, layer: int) -> bool:
        """Whether self-attention layer `layer` (of either stack) is a sliding-window one."""
        if self.sliding_window is None:
            return False
        if self.attention_pattern is None:
            return True
        return self.attention_pattern[layer % len(self.attention_pattern)] == "L"

    def local_layers(self, num_layers: int) -> tuple[bool, ...]:
        return tuple(self.layer_is_local(i) for i in range(num_layers))

    @property
    def encoder_len(self) -> int:
        """Positions of the encoder: encoder_max_len, or max_len."""
        return self.max_len if self.encoder_max_len is None else self.encoder_max_len

    @property
    def decoder_len(self) -> int:
        """Positions of the decoder (and a decode cache's slots): decoder_max_len, or max_len."""
        return self.max_len if self.decoder_max_len is None else self.decoder_max_len

    def has_attention_bias(self, projection: str) -> bool:
        """Whether attention projection "q", "k", "v" or "o" has a bias."""
        if self.attention_biases is None:
            return self.attention_bias
        return projection in self.attention_biases

    @property
    def kv_heads(self) -> int:
        """G: key/value heads (num_kv_heads, or num_heads when unset)."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def use_final_norm(self) -> bool:
        return self.norm != "post" if self.final_norm is None else self.final_norm

    @property
    def compute_dtype(self) -> jnp.dtype:
        """Dtype of the matmuls' operands (and of the residual stream)."""
        return jnp.dtype("bfloat16" if self.precision == "mixed" else self.dtype)

    @property
    def norm_dtype(self) -> jnp.dtype:
        """Dtype of the norms' and the output projection's arithmetic ("mixed": float32)."""
        return jnp.dtype("float32") if self.precision == "mixed" else self.compute_dtype

    @property
    def params_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.param_dtype)


def is_finite_number(value) -> bool:
    """A real number (int or float, numpy's too; not a bool), neither NaN nor infinite:
    what every numeric setting of the library takes."""
    return (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and math.isfinite(value))


def is_positive_number(value) -> bool:
    return is_finite_number(value) and value > 0


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"TransformerConfig.{field} {message}")


# Presets. `tiny` is what tests share; `copy_task` is the default of
# `jaxformer train`; `bench` is the "bench" workload of shared/DESIGN.md.
def tiny(**overrides) -> TransformerConfig:
    """A 2+2-layer, d_model 32 model: initialises and runs in milliseconds."""
    return TransformerConfig(src_vocab_size=16, tgt_vocab_size=16, d_model=32,
                             num_heads=4, d_ff=64, num_encoder_layers=2,
                             num_decoder_layers=2, max_len=32).replace(**overrides)


def copy_task(**overrides) -> TransformerConfig:
    """The default model of `jaxformer train`: learns the copy task in minutes on CPU.

    No dropout: the task streams fresh examples, so there is nothing to
    overfit, and on CPU dropout costs time (random bits) and converges slower
    (exact match 0.986 after 1000 steps with 0.1, 0.999 after 800 without).
    """
    return TransformerConfig(src_vocab_size=32, tgt_vocab_size=32, d_model=128,
                             num_heads=4, d_ff=256, num_encoder_layers=2,
                             num_decoder_layers=2, max_len=64, attention_dropout=0.0,
                             residual_dropout=0.0, embedding_dropout=0.0,
                             ffn_dropout=0.0).replace(**overrides)


def bench(**overrides) -> TransformerConfig:
    """The shared "bench" workload: vocab 100, d 256, 8 heads, d_ff 1024, 4+4 layers."""
    return TransformerConfig(src_vocab_size=100, tgt_vocab_size=100, d_model=256,
                             num_heads=8, d_ff=1024, num_encoder_layers=4,
                             num_decoder_layers=4, max_len=256, attention_dropout=0.1,
                             residual_dropout=0.1, embedding_dropout=0.1,
                             ffn_dropout=0.1).replace(**overrides)


def lm(**overrides) -> TransformerConfig:
    """The decoder-only LM of `jaxformer train --task lm`: 4 Pre-LN layers of width 192
    (1.9 M parameters), bytes (259 ids: PAD, BOS, EOS, then the 256 byte values).

    Small on purpose: ten CPU minutes are about 1e13 FLOPs, for which a model of
    one or two million parameters trained on more tokens beats a larger one
    trained on fewer (the compute-optimal trade-off of Hoffmann et al. 2022).
    """
    return TransformerConfig(src_vocab_size=259, tgt_vocab_size=259, d_model=192, num_heads=6,
                             d_ff=768, num_encoder_layers=0, num_decoder_layers=4,
                             max_len=128, norm="pre").replace(**overrides)


def llama(**overrides) -> TransformerConfig:
    """A Llama-style decoder-only LM in one place (Llama, Mistral, Qwen, SmolLM).

    Pre-RMSNorm with a final norm, RoPE (half-split layout) and no absolute
    positions, SwiGLU FFN, no biases, no embedding scaling, tied output
    embedding; grouped-query attention via `num_kv_heads`. The sizes are
    tiny's: a real model sets them (see `jaxformer.models.llama`).
    """
    return tiny(num_encoder_layers=0, norm="pre", norm_type="rmsnorm",
                layer_norm_epsilon=1e-5, activation="silu", gated_ffn=True,
                encoder_positions="none", decoder_positions="none", rope="half",
                attention_bias=False, ffn_bias=False, output_bias=False,
                scale_embeddings=False, tie_output_embedding=True).replace(**overrides)


__all__ = ["TransformerConfig", "PRESETS", "tiny", "copy_task", "bench", "lm", "llama"]

PRESETS = {"tiny": tiny, "copy_task": copy_task, "bench": bench, "lm": lm}

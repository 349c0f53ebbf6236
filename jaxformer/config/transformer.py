"""`TransformerConfig`: the fields, their derived values, the JSON round trip.

A `TransformerConfig` is a frozen dataclass, so it is hashable and can be a
static argument to `jax.jit`. Strings (not dtype objects) keep it JSON-friendly
for run directories and checkpoints: `TransformerConfig(**json.load(f))`. Its
validation is `jaxformer.config.checks`'.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

import jax.numpy as jnp

from jaxformer.config.checks import check_config, require

Norm = Literal["post", "pre", "sandwich", "post_sublayer"]
Activation = Literal["relu", "gelu", "gelu_tanh", "silu"]
Positions = Literal["sinusoidal", "learned", "fixed", "none"]
NormType = Literal["layernorm", "rmsnorm"]
Rope = Literal["none", "half", "interleaved"]
AttentionImpl = Literal["einsum", "jax", "blockwise", "auto"]
Remat = Literal["none", "full", "save_proj", "save_dots"]
Precision = Literal["default", "mixed"]

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
    # Per-kernel layouts where a model's kernels differ (a GGUF file mixing block types,
    # as every Q4_K_M file does): ((module path, layout), ...), e.g.
    # (("decoder/layers_3/ffn/wo", "q6_k"),); a path named here takes its layout over
    # its role's (`quant_format`). Needs `scan_layers=False` for per-layer paths.
    quant_layouts: tuple = ()
    # The decode cache's self-attention keys and values (jaxformer.nn.kv_quant): None
    # (the compute dtype) or "int8" (int8 with one float32 scale per head and token,
    # quantized when written, dequantized when read).
    kv_cache_quant: Optional[str] = None

    def __post_init__(self):
        targets = self.lora_targets  # "q,v" (CLI) or a list (JSON): a hashable tuple
        if isinstance(targets, str):
            targets = tuple(t.strip() for t in targets.split(",") if t.strip())
        object.__setattr__(self, "lora_targets", tuple(targets))
        if isinstance(self.quant_layouts, (list, tuple)):  # JSON: lists; hashable: tuples
            object.__setattr__(self, "quant_layouts", tuple(
                tuple(pair) if isinstance(pair, (list, tuple)) else pair
                for pair in self.quant_layouts))
        require(self.head_dim is None or (isinstance(self.head_dim, int)
                                          and self.head_dim > 0), "head_dim",
                f"must be None or a positive int, got {self.head_dim!r}")
        # head_dim None is resolved to d_model // num_heads; `replace` re-derives it.
        object.__setattr__(self, "_derived_head_dim", self.head_dim is None)
        if self.head_dim is None and isinstance(self.num_heads, int) and self.num_heads > 0 \
                and isinstance(self.d_model, int):
            object.__setattr__(self, "head_dim", self.d_model // self.num_heads)
        check_config(self, derived_head_dim=self._derived_head_dim)

    def quant_format(self, role: str, path: Optional[str] = None) -> Optional[str]:
        """The quantized layout of the "layers" (attention, FFN) or "embed" (token tables,
        output projection) kernels; None for float. `path`: the kernel's module path
        ("decoder/layers_3/ffn/wo"), whose `quant_layouts` entry comes first."""
        if path is not None and self.quant_layouts:
            found = dict(self.quant_layouts).get(path)
            if found is not None:
                return found
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

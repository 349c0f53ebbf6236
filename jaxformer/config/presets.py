"""Presets: `tiny` is what tests share; `copy_task` is the default of `jaxformer
train`; `bench` is the "bench" workload of shared/DESIGN.md; `lm` the LM of `train
--task lm`; `llama` the Llama-style decoder the pretrained families start from."""

from __future__ import annotations

from jaxformer.config.transformer import TransformerConfig


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


PRESETS = {"tiny": tiny, "copy_task": copy_task, "bench": bench, "lm": lm}

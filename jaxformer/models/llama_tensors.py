"""The Llama family's tensor table (llama, mistral, qwen2, qwen3, gemma2, gemma3):
the one place that names its tensors. `jaxformer.models.hf` (Hugging Face import),
`jaxformer.models.hf_export` (export) and `jaxformer.models.llama` (GGUF import)
loop over it (`jaxformer.models.tensor_table`).

Dimension letters: D model width, H query heads, G key/value heads, K head dim,
F feed-forward width, V vocabulary. Shapes are the files' (torch Linear (out, in),
GGUF numpy order). Per layer i the names are behind "decoder/layers_{i}/",
"model.layers.{i}." and "blk.{i}.".

RoPE layout (`rope_rows`): Hugging Face stores each query/key head's features in
the half-split order; llama.cpp's converter permutes them to interleaved pairs for
llama and mistral (`jaxformer.models.llama`), and the readers permute them to the
config's `rope` layout. Gemma's GGUF norms hold 1 + w (`NORMS`: 1 is subtracted on
reading).
"""

from __future__ import annotations

from jaxformer.models.tensor_table import (EMBEDDING, HEAD_BIAS, HEAD_NORM, HEADS_IN,
                                           HEADS_OUT, LINEAR, NORM, VECTOR, Table, Tensor)


def _untied(c) -> bool:
    return not c.tie_output_embedding


def _bias(letter: str):
    def when(c) -> bool:
        return c.has_attention_bias(letter)
    return when


def _ffn_bias(c) -> bool:
    return bool(c.ffn_bias)


def _qk_norm(c) -> bool:
    return bool(c.qk_norm)


def _sandwich(c) -> bool:  # Gemma: a norm after attention and after the FFN as well
    return c.norm == "sandwich"


def _pre(c) -> bool:
    return c.norm != "sandwich"


def _dims(c) -> dict:
    return dict(D=c.d_model, H=c.num_heads, G=c.kv_heads, K=c.head_dim, F=c.d_ff,
                V=c.tgt_vocab_size)


T = Tensor
LLAMA = Table(
    top=(  # jaxformer path, Hugging Face name, GGUF name, file shape, kind
        T("embed/embedding", "model.embed_tokens.weight", "token_embd.weight", "V,D", EMBEDDING),
        T("decoder/final_norm/scale", "model.norm.weight", "output_norm.weight", "D", NORM),
        T("decoder/out_proj/kernel", "lm_head.weight", "output.weight", "V,D", LINEAR,
          when=_untied),
    ),
    layer=(
        T("self_attn_norm/scale", "input_layernorm.weight", "attn_norm.weight", "D", NORM),
        T("self_attn_post_norm/scale", "post_attention_layernorm.weight",
          "post_attention_norm.weight", "D", NORM, when=_sandwich),
        T("ffn_norm/scale", "post_attention_layernorm.weight", "ffn_norm.weight", "D", NORM,
          when=_pre),
        T("ffn_norm/scale", "pre_feedforward_layernorm.weight", "ffn_norm.weight", "D", NORM,
          when=_sandwich),
        T("ffn_post_norm/scale", "post_feedforward_layernorm.weight", "post_ffw_norm.weight",
          "D", NORM, when=_sandwich),
        T("self_attn/query/kernel", "self_attn.q_proj.weight", "attn_q.weight", "HK,D",
          HEADS_IN, "H", rope_rows=True),
        T("self_attn/key/kernel", "self_attn.k_proj.weight", "attn_k.weight", "GK,D",
          HEADS_IN, "G", rope_rows=True),
        T("self_attn/value/kernel", "self_attn.v_proj.weight", "attn_v.weight", "GK,D",
          HEADS_IN, "G"),
        T("self_attn/out/kernel", "self_attn.o_proj.weight", "attn_output.weight", "D,HK",
          HEADS_OUT, "H"),
        T("self_attn/query/bias", "self_attn.q_proj.bias", "attn_q.bias", "HK", HEAD_BIAS, "H",
          rope_rows=True, when=_bias("q")),
        T("self_attn/key/bias", "self_attn.k_proj.bias", "attn_k.bias", "GK", HEAD_BIAS, "G",
          rope_rows=True, when=_bias("k")),
        T("self_attn/value/bias", "self_attn.v_proj.bias", "attn_v.bias", "GK", HEAD_BIAS, "G",
          when=_bias("v")),
        T("self_attn/out/bias", "self_attn.o_proj.bias", "attn_output.bias", "D", VECTOR,
          when=_bias("o")),
        T("self_attn/query_norm/scale", "self_attn.q_norm.weight", "attn_q_norm.weight", "K",
          HEAD_NORM, rope_rows=True, when=_qk_norm),
        T("self_attn/key_norm/scale", "self_attn.k_norm.weight", "attn_k_norm.weight", "K",
          HEAD_NORM, rope_rows=True, when=_qk_norm),
        T("ffn/gate/kernel", "mlp.gate_proj.weight", "ffn_gate.weight", "F,D", LINEAR),
        T("ffn/wi/kernel", "mlp.up_proj.weight", "ffn_up.weight", "F,D", LINEAR),
        T("ffn/wo/kernel", "mlp.down_proj.weight", "ffn_down.weight", "D,F", LINEAR),
        T("ffn/gate/bias", "mlp.gate_proj.bias", "ffn_gate.bias", "F", VECTOR, when=_ffn_bias),
        T("ffn/wi/bias", "mlp.up_proj.bias", "ffn_up.bias", "F", VECTOR, when=_ffn_bias),
        T("ffn/wo/bias", "mlp.down_proj.bias", "ffn_down.bias", "D", VECTOR, when=_ffn_bias),
    ),
    prefixes={"ours": "decoder/layers_{i}/", "hf": "model.layers.{i}.", "gguf": "blk.{i}."},
    dims=_dims,
    layers=lambda c: c.num_decoder_layers,
)

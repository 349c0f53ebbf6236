"""Llama-architecture GGUF files (Llama, SmolLM2, ...) as a jaxformer `DecoderOnlyLM`.

    model, params, tokenizer = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    ids = tokenizer.encode("The capital of France is").ids
    out = jaxformer.generate(model, params, jnp.asarray([ids]), max_new_tokens=16)

The config is `jaxformer.config.llama` with the file's sizes: pre-RMSNorm
(the file's epsilon), RoPE (the file's base), SwiGLU, grouped-query attention,
no biases, tied embeddings unless the file has `output.weight`.

GGUF name -> jaxformer parameter (numpy order of the GGUF tensor on the left):

    token_embd.weight     (V, D)    embed/embedding
    output.weight         (V, D)    decoder/out_proj/kernel (D, V)   if untied
    output_norm.weight    (D,)      decoder/final_norm/scale
    blk.i.attn_norm       (D,)      decoder/layers_i/self_attn_norm/scale
    blk.i.attn_q          (H*K, D)  .../self_attn/query/kernel (D, H, K)   rows permuted, below
    blk.i.attn_k          (G*K, D)  .../self_attn/key/kernel   (D, G, K)   rows permuted, below
    blk.i.attn_v          (G*K, D)  .../self_attn/value/kernel (D, G, K)
    blk.i.attn_output     (D, H*K)  .../self_attn/out/kernel   (H, K, D)
    blk.i.ffn_norm        (D,)      decoder/layers_i/ffn_norm/scale
    blk.i.ffn_gate / ffn_up (F, D)  .../ffn/gate/kernel, ffn/wi/kernel (D, F)
    blk.i.ffn_down        (D, F)    .../ffn/wo/kernel (F, D)

RoPE layout: llama.cpp's converter permutes each head's query/key rows from
Hugging Face's half-split order to the interleaved pair order, which its RoPE
kernel uses. `rope="half"` (default) undoes that permutation, giving exactly
the Hugging Face checkpoint's weights; `rope="interleaved"` keeps the file's
rows and rotates interleaved pairs. Both compute the same function; mixing
them (interleaved rows, half rotation) does not (tested).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.config import TransformerConfig, llama
from jaxformer.interop.gguf import GGUFFile, read_gguf, tokenizer_from_gguf
from jaxformer.nn.model import DecoderOnlyLM
from jaxformer.nn.rope import half_to_interleaved_rows

ARCHITECTURE = "llama"
# Metadata that would change the function but that jaxformer does not implement.
_UNSUPPORTED_KEYS = ("llama.rope.scaling.type", "llama.attention.layer_norm_epsilon",
                     "llama.expert_count")


def _meta(file: GGUFFile, key: str, default=None):
    if key in file.metadata:
        return file.metadata[key]
    if default is None:
        raise ValueError(f"{file.path}: metadata key {key!r} is missing")
    return default


def _special_ids(file: GGUFFile) -> tuple[int, int, int]:
    """(pad, bos, eos). jaxformer needs three distinct ids; SmolLM2 pads with EOS,
    so PAD falls back to the unknown token (or the first other id)."""
    bos = int(_meta(file, "tokenizer.ggml.bos_token_id", 1))
    eos = int(_meta(file, "tokenizer.ggml.eos_token_id", 2))
    candidates = [file.metadata.get("tokenizer.ggml.padding_token_id"),
                  file.metadata.get("tokenizer.ggml.unknown_token_id"), 0, 1, 2, 3]
    pad = next(int(c) for c in candidates if c is not None and int(c) not in (bos, eos))
    return pad, bos, eos


def config_from_gguf(file: GGUFFile, *, rope: str = "half", dtype: str = "float32",
                     max_len: int | None = None) -> TransformerConfig:
    """The `TransformerConfig` a llama-architecture GGUF file describes.

    Raises ValueError naming the problem for another architecture, metadata
    jaxformer does not implement (rope scaling, partial rotary, MoE) or a
    tensor of an unsupported quantization type: before any tensor is decoded.
    """
    if file.architecture != ARCHITECTURE:
        raise ValueError(f"{file.path}: GGUF architecture {file.architecture!r} is not "
                         f"supported here; expected {ARCHITECTURE!r}")
    for key in _UNSUPPORTED_KEYS:
        if key in file.metadata:
            raise ValueError(f"{file.path}: metadata {key!r} is not supported by jaxformer")
    file.check_types()
    a = ARCHITECTURE
    d_model = int(_meta(file, f"{a}.embedding_length"))
    heads = int(_meta(file, f"{a}.attention.head_count"))
    head_dim = d_model // heads if d_model % heads == 0 else -1
    rot = int(file.metadata.get(f"{a}.rope.dimension_count", head_dim))
    if rot != head_dim:
        raise ValueError(f"{file.path}: rope.dimension_count={rot} differs from the head "
                         f"dim {head_dim} (partial rotary or odd head dims are not supported)")
    vocab = len(file.metadata.get("tokenizer.ggml.tokens", ())) or int(
        _meta(file, f"{a}.vocab_size"))
    pad, bos, eos = _special_ids(file)
    context = int(_meta(file, f"{a}.context_length"))
    return llama(
        src_vocab_size=vocab, tgt_vocab_size=vocab, d_model=d_model, num_heads=heads,
        num_kv_heads=int(_meta(file, f"{a}.attention.head_count_kv", heads)),
        d_ff=int(_meta(file, f"{a}.feed_forward_length")),
        num_decoder_layers=int(_meta(file, f"{a}.block_count")),
        max_len=context if max_len is None else max_len,
        layer_norm_epsilon=float(_meta(file, f"{a}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(file.metadata.get(f"{a}.rope.freq_base", 10000.0)), rope=rope,
        tie_output_embedding="output.weight" not in file.tensors,
        pad_id=pad, bos_id=bos, eos_id=eos, dtype=dtype)


def expected_shapes(config: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> numpy shape that `config` implies (the file must match exactly)."""
    D, H, G, K, F, V = (config.d_model, config.num_heads, config.kv_heads, config.head_dim,
                        config.d_ff, config.tgt_vocab_size)
    shapes = {"token_embd.weight": (V, D), "output_norm.weight": (D,)}
    if not config.tie_output_embedding:
        shapes["output.weight"] = (V, D)
    for i in range(config.num_decoder_layers):
        shapes.update({
            f"blk.{i}.attn_norm.weight": (D,), f"blk.{i}.ffn_norm.weight": (D,),
            f"blk.{i}.attn_q.weight": (H * K, D), f"blk.{i}.attn_k.weight": (G * K, D),
            f"blk.{i}.attn_v.weight": (G * K, D), f"blk.{i}.attn_output.weight": (D, H * K),
            f"blk.{i}.ffn_gate.weight": (F, D), f"blk.{i}.ffn_up.weight": (F, D),
            f"blk.{i}.ffn_down.weight": (D, F)})
    return shapes


def check_shapes(file: GGUFFile, config: TransformerConfig) -> None:
    """Every tensor present with the shape `config` implies, and no other tensor."""
    want = expected_shapes(config)
    missing = sorted(set(want) - set(file.tensors))
    extra = sorted(set(file.tensors) - set(want))
    if missing or extra:
        raise ValueError(f"{file.path}: tensors do not match a llama model with "
                         f"{config.num_decoder_layers} layers: missing {missing[:5]}, "
                         f"unexpected {extra[:5]}")
    for name, shape in want.items():
        if file.shape(name) != shape:
            raise ValueError(f"{file.path}: tensor {name!r} has shape {file.shape(name)}, "
                             f"expected {shape} from the metadata")


def _heads_rows(w_RD: np.ndarray, heads: int, head_dim: int, rope: str) -> np.ndarray:
    """(heads*K, D) projection rows -> kernel (D, heads, K), rows in `rope`'s pair order."""
    w_HKD = w_RD.reshape(heads, head_dim, -1)
    if rope == "half":  # undo llama.cpp's permutation: half[p[j]] = interleaved[j]
        w_HKD = w_HKD[:, np.argsort(half_to_interleaved_rows(head_dim)), :]
    return np.ascontiguousarray(w_HKD.transpose(2, 0, 1))


def params_from_gguf(file: GGUFFile, config: TransformerConfig) -> dict:
    """jaxformer `DecoderOnlyLM` parameters (float32 numpy -> `config.param_dtype`).

    Checks every tensor's shape against `config` first (`check_shapes`).
    """
    check_shapes(file, config)
    H, G, K, D = config.num_heads, config.kv_heads, config.head_dim, config.d_model
    dtype = config.params_dtype

    def get(name):
        return file.array(name)

    decoder = {"final_norm": {"scale": get("output_norm.weight")}}
    if not config.tie_output_embedding:
        decoder["out_proj"] = {"kernel": get("output.weight").T}
    for i in range(config.num_decoder_layers):
        b = f"blk.{i}."
        decoder[f"layers_{i}"] = {
            "self_attn_norm": {"scale": get(b + "attn_norm.weight")},
            "self_attn": {
                "query": {"kernel": _heads_rows(get(b + "attn_q.weight"), H, K, config.rope)},
                "key": {"kernel": _heads_rows(get(b + "attn_k.weight"), G, K, config.rope)},
                "value": {"kernel": get(b + "attn_v.weight").reshape(G, K, D).transpose(2, 0, 1)},
                "out": {"kernel": get(b + "attn_output.weight").T.reshape(H, K, D)},
            },
            "ffn_norm": {"scale": get(b + "ffn_norm.weight")},
            "ffn": {"gate": {"kernel": get(b + "ffn_gate.weight").T},
                    "wi": {"kernel": get(b + "ffn_up.weight").T},
                    "wo": {"kernel": get(b + "ffn_down.weight").T}},
        }
    params = {"embed": {"embedding": get("token_embd.weight")}, "decoder": decoder}
    return jax.tree_util.tree_map(lambda x: jnp.asarray(np.ascontiguousarray(x), dtype), params)


def load_gguf(path, *, rope: str = "half", dtype: str = "float32", max_len: int | None = None):
    """(DecoderOnlyLM, params, tokenizers.Tokenizer) from a llama GGUF file.

    `max_len` caps the context (default: the file's context length).
    """
    file = read_gguf(path)
    config = config_from_gguf(file, rope=rope, dtype=dtype, max_len=max_len)
    return DecoderOnlyLM(config), params_from_gguf(file, config), tokenizer_from_gguf(file)

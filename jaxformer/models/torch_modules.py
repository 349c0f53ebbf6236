"""PyTorch -> jaxformer: read torch modules into (TransformerConfig, params).

Supported, exactly (logits equal to PyTorch's to float32 precision, see
tests/models/test_torch_modules.py):

* `from_torch_transformer`: `torch.nn.Transformer` (post or pre norm, `relu`,
  exact `gelu` or `GELU(approximate="tanh")`, any `layer_norm_eps`, `bias`
  on or off, `batch_first` either way) together with the source and target
  `nn.Embedding` and the output `nn.Linear`. The torch model this mirrors is::

      x = src_embedding(src) * sqrt(d_model) + PE      # PE: seed 001's sinusoids
      y = tgt_embedding(tgt) * sqrt(d_model) + PE
      logits = output_projection(transformer(x, y, masks...))

* `from_torch_decoder_only`: a `torch.nn.TransformerEncoder` run with a causal
  mask (self-attention + FFN per layer: the decoder-only LM of seed 004),
  with its `nn.Embedding` and output `nn.Linear`, into a `DecoderOnlyLM`.

Mapping (torch weights are (out, in); kernels here are (in, out))::

    self_attn.in_proj_weight (3D, D) -> self_attn/{query,key,value}/kernel (D, H, K)
    self_attn.in_proj_bias (3D,)     -> self_attn/{query,key,value}/bias (H, K)
    self_attn.out_proj.weight (D, D) -> self_attn/out/kernel (H, K, D)
    multihead_attn                   -> cross_attn
    linear1 / linear2                -> ffn/wi (D, F) / ffn/wo (F, D)
    norm1 / norm2 / norm3            -> self_attn_norm / cross_attn_norm / ffn_norm
                                        (encoder layers: norm1 / norm2 -> self_attn_norm / ffn_norm)
    encoder.norm / decoder.norm      -> encoder/final_norm / decoder/final_norm
    output_projection (V, D)         -> decoder/out_proj/kernel (D, V)

Details:

* Tied weights are detected: if `output_projection.weight` is the target
  embedding's weight (the same tensor), the config gets
  `tie_output_embedding=True`; if the source and target embeddings share their
  weight, `share_embeddings=True`. A tied output projection must have no bias
  (or an all-zero one): jaxformer's tied output has none.
* `bias=False` in torch removes every bias, including LayerNorm's and the
  FFN's; jaxformer only makes the attention biases optional, so the config
  gets `attention_bias=False` and the other biases are imported as zeros,
  which computes the same function.
* Dropout rates are carried over from the torch layers (attention, residual,
  FFN); `embedding_dropout` is 0 (it lives in the user's positional module:
  set it with `config.replace(embedding_dropout=...)`).
* Positions are not part of `nn.Transformer`: say which the torch model used.
  `positions="sinusoidal"` is seed 001's table (`jaxformer.sinusoidal_table`);
  `positions="learned"` reads `src_position_embedding`/`tgt_position_embedding`
  (an `nn.Embedding` or a tensor with at least `max_len` rows; the first
  `max_len` rows are kept).
* Anything that would not compute the same function raises instead of being
  approximated: custom encoders/decoders or layer subclasses (their `forward`
  may differ), other activations, `add_bias_kv`/`add_zero_attn`, different
  key/value dims, layers that disagree with each other, a tensor of an
  unexpected shape.
* Parameters are float32 (`param_dtype="float32"`), whatever the torch dtype.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxformer.nn import stacking
from jaxformer.config import TransformerConfig
from jaxformer.models.torch_reader import TorchReader, verify_structure

_INSTALL_HINT = "jaxformer.interop needs PyTorch: pip install 'jaxformer[torch]'"


def _config(arch: dict, **fields) -> TransformerConfig:
    """The config: what `_read_architecture` read from the torch layers, plus `fields`.

    `embedding_dropout` is 0: it lives in the user's positional module, not in torch's layers.
    """
    return TransformerConfig(
        num_heads=arch["num_heads"], d_ff=arch["d_ff"], norm=arch["norm"],
        final_norm=arch["final_norm"], activation=arch["activation"],
        layer_norm_epsilon=arch["eps"], attention_bias=arch["attention_bias"],
        attention_dropout=arch["attention_dropout"], residual_dropout=arch["residual_dropout"],
        ffn_dropout=arch["ffn_dropout"], embedding_dropout=0.0, **fields)


def _import_torch():
    try:
        import torch
    except ImportError as err:  # torch is an optional dependency
        raise ImportError(_INSTALL_HINT) from err
    return torch


# ----------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------


def from_torch_transformer(
    transformer: Any,
    src_embedding: Any,
    tgt_embedding: Any,
    output_projection: Any,
    *,
    max_len: int,
    positions: str = "sinusoidal",
    src_position_embedding: Any = None,
    tgt_position_embedding: Any = None,
    scale_embeddings: bool = True,
    pad_id: int = 0,
    bos_id: int = 1,
    eos_id: int = 2,
    scan_layers: bool = False,
) -> tuple[TransformerConfig, dict]:
    """Convert a `torch.nn.Transformer` and its embeddings/output into jaxformer.

    `scan_layers=True` returns a scanned config with stacked layers (`stacking`).

    Args:
      transformer: `torch.nn.Transformer` (no custom encoder/decoder).
      src_embedding, tgt_embedding: `torch.nn.Embedding`s (V_src, D), (V_tgt, D).
      output_projection: `torch.nn.Linear` D -> V_tgt.
      max_len: longest sequence the jaxformer model will accept.
      positions: "sinusoidal" (seed 001's table) or "learned" (then pass
        `src_position_embedding` and `tgt_position_embedding`).
      scale_embeddings: whether the torch model multiplies token embeddings
        by sqrt(d_model) before adding positions.
      pad_id, bos_id, eos_id: special ids of the vocabularies.

    Returns:
      (config, params) such that
      `Transformer(config).apply({"params": params}, src, tgt)` equals the
      torch model's logits (batch-first).
    """
    torch = _import_torch()
    nn = torch.nn
    _require_type(transformer, nn.Transformer, "transformer")
    _require_type(transformer.encoder, nn.TransformerEncoder, "transformer.encoder",
                  "a custom encoder cannot be read")
    _require_type(transformer.decoder, nn.TransformerDecoder, "transformer.decoder",
                  "a custom decoder cannot be read")
    enc_layers = list(transformer.encoder.layers)
    dec_layers = list(transformer.decoder.layers)
    for i, layer in enumerate(enc_layers):
        _require_type(layer, nn.TransformerEncoderLayer, f"transformer.encoder.layers[{i}]")
    for i, layer in enumerate(dec_layers):
        _require_type(layer, nn.TransformerDecoderLayer, f"transformer.decoder.layers[{i}]")
    if not dec_layers:
        raise ValueError("transformer.decoder has no layers")

    d_model = int(transformer.d_model)
    arch = _read_architecture(
        torch, d_model,
        {f"transformer.encoder.layers[{i}]": l for i, l in enumerate(enc_layers)}
        | {f"transformer.decoder.layers[{i}]": l for i, l in enumerate(dec_layers)},
        {"transformer.encoder.norm": transformer.encoder.norm,
         "transformer.decoder.norm": transformer.decoder.norm})

    src_V = _embedding_rows(src_embedding, d_model, "src_embedding")
    tgt_V = _embedding_rows(tgt_embedding, d_model, "tgt_embedding")
    share = _same_tensor(src_embedding.weight, tgt_embedding.weight)
    tie = _same_tensor(output_projection.weight, tgt_embedding.weight)
    _check_output_projection(output_projection, d_model, tgt_V, tie)
    _check_positions(positions, {"src_position_embedding": src_position_embedding,
                                 "tgt_position_embedding": tgt_position_embedding})

    config = _config(
        arch, d_model=d_model, src_vocab_size=src_V, tgt_vocab_size=tgt_V,
        num_encoder_layers=len(enc_layers), num_decoder_layers=len(dec_layers),
        max_len=max_len, encoder_positions=positions, decoder_positions=positions,
        scale_embeddings=scale_embeddings, tie_output_embedding=tie, share_embeddings=share,
        pad_id=pad_id, bos_id=bos_id, eos_id=eos_id)

    reader = TorchReader(config)
    encoder = {f"layers_{i}": reader.encoder_layer(layer, f"transformer.encoder.layers[{i}]")
               for i, layer in enumerate(enc_layers)}
    decoder = {f"layers_{i}": reader.decoder_layer(layer, f"transformer.decoder.layers[{i}]")
               for i, layer in enumerate(dec_layers)}
    if config.use_final_norm:
        encoder["final_norm"] = reader.layer_norm(transformer.encoder.norm,
                                                  "transformer.encoder.norm")
        decoder["final_norm"] = reader.layer_norm(transformer.decoder.norm,
                                                  "transformer.decoder.norm")
    if positions == "learned":
        encoder["positions"] = reader.positions(src_position_embedding, "src_position_embedding")
        decoder["positions"] = reader.positions(tgt_position_embedding, "tgt_position_embedding")
    if not tie:
        decoder["out_proj"] = reader.dense(output_projection, d_model, tgt_V,
                                           "output_projection")
    params = {"src_embed": reader.embedding(src_embedding, src_V, "src_embedding"),
              "encoder": encoder, "decoder": decoder}
    if not share:
        params["tgt_embed"] = reader.embedding(tgt_embedding, tgt_V, "tgt_embedding")
    params = jax.tree_util.tree_map(jnp.asarray, params)
    config, params = _layout(config, params, scan_layers)

    from jaxformer.nn.model import Transformer  # late: keeps `import jaxformer.models` light
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    verify_structure(params, Transformer(config), tokens, tokens)
    return config, params


def from_torch_decoder_only(
    encoder: Any,
    embedding: Any,
    output_projection: Any,
    *,
    max_len: int,
    positions: str = "sinusoidal",
    position_embedding: Any = None,
    scale_embeddings: bool = True,
    pad_id: int = 0,
    bos_id: int = 1,
    eos_id: int = 2,
    scan_layers: bool = False,
) -> tuple[TransformerConfig, dict]:
    """Convert a causal `torch.nn.TransformerEncoder` LM into a `DecoderOnlyLM`.

    `scan_layers=True` returns a scanned config with stacked layers (`stacking`).

    The torch model this mirrors::

        x = embedding(tokens) * sqrt(d_model) + PE
        h = encoder(x, mask=causal)        # TransformerEncoder with a causal mask
        logits = output_projection(h)

    Each `TransformerEncoderLayer` (self-attention + FFN) becomes a decoder
    layer without cross-attention; `encoder.norm` (optional here) becomes
    `decoder/final_norm`. Arguments as in `from_torch_transformer`, with one
    `embedding` and one `position_embedding`.

    Returns:
      (config with num_encoder_layers=0, params of `DecoderOnlyLM(config)`).
    """
    torch = _import_torch()
    nn = torch.nn
    _require_type(encoder, nn.TransformerEncoder, "encoder",
                  "a custom encoder cannot be read")
    layers = list(encoder.layers)
    if not layers:
        raise ValueError("encoder has no layers")
    for i, layer in enumerate(layers):
        _require_type(layer, nn.TransformerEncoderLayer, f"encoder.layers[{i}]")
    d_model = int(layers[0].self_attn.embed_dim)
    arch = _read_architecture(torch, d_model,
                              {f"encoder.layers[{i}]": l for i, l in enumerate(layers)},
                              {"encoder.norm": encoder.norm})
    vocab = _embedding_rows(embedding, d_model, "embedding")
    tie = _same_tensor(output_projection.weight, embedding.weight)
    _check_output_projection(output_projection, d_model, vocab, tie)
    _check_positions(positions, {"position_embedding": position_embedding})

    config = _config(
        arch, d_model=d_model, src_vocab_size=vocab, tgt_vocab_size=vocab,
        num_encoder_layers=0, num_decoder_layers=len(layers), max_len=max_len,
        encoder_positions=positions, decoder_positions=positions,
        scale_embeddings=scale_embeddings, tie_output_embedding=tie,
        pad_id=pad_id, bos_id=bos_id, eos_id=eos_id)

    reader = TorchReader(config)
    decoder = {f"layers_{i}": reader.encoder_layer(layer, f"encoder.layers[{i}]")
               for i, layer in enumerate(layers)}
    if config.use_final_norm:
        decoder["final_norm"] = reader.layer_norm(encoder.norm, "encoder.norm")
    if positions == "learned":
        decoder["positions"] = reader.positions(position_embedding, "position_embedding")
    if not tie:
        decoder["out_proj"] = reader.dense(output_projection, d_model, vocab, "output_projection")
    params = {"embed": reader.embedding(embedding, vocab, "embedding"), "decoder": decoder}
    params = jax.tree_util.tree_map(jnp.asarray, params)
    config, params = _layout(config, params, scan_layers)

    from jaxformer.nn.model import DecoderOnlyLM
    verify_structure(params, DecoderOnlyLM(config), jax.ShapeDtypeStruct((1, 1), jnp.int32))
    return config, params


# ----------------------------------------------------------------------------
# Reading the architecture
# ----------------------------------------------------------------------------


def _layout(config: TransformerConfig, params: dict, scan_layers: bool):
    """The imported (per-layer) params, stacked for a scanned config if asked."""
    if not scan_layers:
        return config, params
    return config.replace(scan_layers=True), stacking.stack_layers(params)


def _require_type(module, cls, name: str, why: str = "") -> None:
    # Exact type, not isinstance: a subclass may override `forward`, and then
    # the same weights would not compute the same function here.
    if type(module) is not cls:
        raise TypeError(f"{name} must be a torch.nn.{cls.__name__}, got "
                        f"{type(module).__name__}" + (f" ({why})" if why else "")
                        + ": jaxformer.interop only reads the stock torch modules")


def _activation_name(torch, layer, name: str) -> str:
    F = torch.nn.functional
    act = layer.activation
    if act is F.relu or isinstance(act, torch.nn.ReLU):
        return "relu"
    if act is F.gelu:
        return "gelu"
    if isinstance(act, torch.nn.GELU):
        return {"none": "gelu", "tanh": "gelu_tanh"}[act.approximate]
    raise ValueError(f"{name}.activation is {act!r}; jaxformer.interop reads only "
                     "relu and gelu (exact or tanh)")


def _one(values: dict[str, Any], what: str):
    """The single value all layers agree on, or a ValueError naming the outlier."""
    distinct = set(values.values())
    if len(distinct) != 1:
        raise ValueError(f"layers disagree on {what}: {values}; jaxformer uses one "
                         f"{what} for the whole model")
    return distinct.pop()


def _read_architecture(torch, d_model: int, layers: dict[str, Any],
                       final_norms: dict[str, Any]) -> dict:
    """Read the config fields every layer must agree on."""
    attns = {}
    for name, layer in layers.items():
        attns[f"{name}.self_attn"] = layer.self_attn
        if hasattr(layer, "multihead_attn"):
            attns[f"{name}.multihead_attn"] = layer.multihead_attn
    for name, mha in attns.items():
        if not mha._qkv_same_embed_dim:
            raise ValueError(f"{name} has kdim/vdim different from embed_dim; not supported")
        if mha.bias_k is not None or mha.add_zero_attn:
            raise ValueError(f"{name} uses add_bias_kv/add_zero_attn; not supported")
        if mha.embed_dim != d_model:
            raise ValueError(f"{name}.embed_dim is {mha.embed_dim}, expected d_model={d_model}")
    norms = {f"{name}.{n}": getattr(layer, n) for name, layer in layers.items()
             for n in ("norm1", "norm2", "norm3") if hasattr(layer, n)}
    present_final = {k: v for k, v in final_norms.items() if v is not None}
    if present_final and len(present_final) != len(final_norms):
        raise ValueError(f"only some stacks have a final norm ({sorted(present_final)}); "
                         "jaxformer's final_norm applies to every stack")
    for name, norm in {**norms, **present_final}.items():
        if type(norm) is not torch.nn.LayerNorm:
            raise TypeError(f"{name} must be a torch.nn.LayerNorm, got {type(norm).__name__}")
    return {
        "num_heads": _one({n: m.num_heads for n, m in attns.items()}, "num_heads"),
        "d_ff": _one({n: l.linear1.out_features for n, l in layers.items()}, "dim_feedforward"),
        "norm": "pre" if _one({n: bool(l.norm_first) for n, l in layers.items()},
                              "norm_first") else "post",
        "activation": _one({n: _activation_name(torch, l, n) for n, l in layers.items()},
                           "activation"),
        "eps": float(_one({n: float(m.eps) for n, m in {**norms, **present_final}.items()},
                          "layer_norm_eps")),
        "attention_bias": any(m.in_proj_bias is not None or m.out_proj.bias is not None
                              for m in attns.values()),
        "final_norm": bool(present_final),
        "attention_dropout": _one({n: float(m.dropout) for n, m in attns.items()},
                                  "attention dropout"),
        "residual_dropout": _one({n: float(l.dropout1.p) for n, l in layers.items()},
                                 "residual dropout"),
        "ffn_dropout": _one({n: float(l.dropout.p) for n, l in layers.items()}, "FFN dropout"),
    }


def _same_tensor(a, b) -> bool:
    """True if `a` and `b` are the same storage viewed the same way (tied weights)."""
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape
                      and a.stride() == b.stride() and a.dtype == b.dtype)


def _embedding_rows(embedding, d_model: int, name: str) -> int:
    weight = getattr(embedding, "weight", None)
    if weight is None or weight.ndim != 2:
        raise TypeError(f"{name} must be a torch.nn.Embedding, got {type(embedding).__name__}")
    if weight.shape[1] != d_model:
        raise ValueError(f"{name} has embedding_dim {weight.shape[1]}, expected "
                         f"d_model={d_model}")
    return int(weight.shape[0])


def _check_output_projection(linear, d_model: int, vocab: int, tied: bool) -> None:
    weight = getattr(linear, "weight", None)
    if weight is None or tuple(weight.shape) != (vocab, d_model):
        got = None if weight is None else tuple(weight.shape)
        raise ValueError(f"output_projection.weight must be ({vocab}, {d_model}) "
                         f"(target vocabulary x d_model), got {got}")
    if tied and linear.bias is not None and bool((linear.bias != 0).any()):
        raise ValueError("output_projection is tied to the target embedding but has a "
                         "non-zero bias; jaxformer's tied output projection has no bias")


def _check_positions(positions: str, embeddings: dict[str, Any]) -> None:
    if positions not in ("sinusoidal", "learned"):
        raise ValueError(f"positions must be 'sinusoidal' or 'learned', got {positions!r}")
    for name, value in embeddings.items():
        if positions == "learned" and value is None:
            raise ValueError(f"positions='learned' needs {name}")
        if positions == "sinusoidal" and value is not None:
            raise ValueError(f"{name} is only read with positions='learned'")

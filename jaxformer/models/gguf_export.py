"""Float GGUF files of the decoder-only families: `save_gguf`, the inverse of
`models.llama.load_gguf` for float32 weights, laid out as llama.cpp's converter writes
them, so llama.cpp reads the file (and `llama-quantize` turns it into any block type).

    save_gguf(config, params, "model.gguf", arch="gemma3", vocab_from=source_gguf)

The tensors are the family's table (`llama_tensors.LLAMA`, GGUF names and numpy order,
`tensor_table.to_file`): query/key rows permuted to the interleaved RoPE order for
llama and mistral, Gemma's norm weights stored as 1 + w. The metadata are the keys
`config_from_gguf` reads (sizes, epsilon, RoPE bases, Gemma's window, soft caps and
query scale). The vocabulary is copied from another GGUF file (`vocab_from`: every
`tokenizer.*` key), as a model's tokenizer does not change with its weights.

Gemma 3's local:global pattern is written as one flag per layer; llama.cpp reads
Gemma 3 as every sixth layer global with local RoPE base 10000 whatever the file says,
so a file for llama.cpp should have that shape (`check_llama_cpp_shape`).
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np

from jaxformer.config import TransformerConfig
from jaxformer.interop.flat import flatten
from jaxformer.models import tensor_table
from jaxformer.models.llama_tensors import LLAMA
from jaxformer.nn.rope import half_to_interleaved_rows
from jaxformer.nn.stacking import unstack_layers

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3")
PERMUTED = ("llama", "mistral")  # as models.llama: the converter's query/key permutation
GEMMA = ("gemma2", "gemma3")


def file_order(arch: str, config: TransformerConfig) -> np.ndarray:
    """Index along a head's K query/key features taking jaxformer's RoPE layout to the
    file's (interleaved for llama/mistral, half-split otherwise)."""
    p = half_to_interleaved_rows(config.head_dim)  # interleaved[j] = half[p[j]]
    file_interleaved = arch in PERMUTED
    if file_interleaved == (config.rope == "interleaved"):
        return np.arange(config.head_dim)
    return p if file_interleaved else np.argsort(p)


def gguf_tensors(config: TransformerConfig, params, arch: str) -> dict[str, np.ndarray]:
    """GGUF tensor name -> float32 numpy array in llama.cpp's layout."""
    flat = flatten(unstack_layers(params))
    dims, order = LLAMA.dims(config), file_order(arch, config)
    out = {}
    for entry in tensor_table.entries(LLAMA, config):
        if entry.ours not in flat:
            raise ValueError(f"params have no {entry.ours!r} ({entry.gguf}): params of "
                             "another config, or quantized (dequantize_params first)")
        value = tensor_table.to_file(entry.row, np.asarray(flat[entry.ours], np.float32),
                                     dims, order)
        if arch in GEMMA and entry.row.kind in tensor_table.NORMS:
            value = value + 1.0  # the converter stores 1 + w
        out[entry.gguf] = np.ascontiguousarray(value, np.float32)
    return out


def check_llama_cpp_shape(config: TransformerConfig, arch: str) -> None:
    """ValueError where llama.cpp would read the file as another model than `config`."""
    if arch == "gemma3":
        want = "".join("G" if (i + 1) % 6 == 0 else "L" for i in range(config.num_decoder_layers))
        if (config.attention_pattern or "G" * config.num_decoder_layers) != want or \
                config.rope_local_theta != 10000.0:
            raise ValueError(f"llama.cpp reads gemma3 as every sixth layer global with local "
                             f"RoPE base 10000; this config has attention_pattern="
                             f"{config.attention_pattern!r}, rope_local_theta="
                             f"{config.rope_local_theta}")


def _metadata(writer, config: TransformerConfig, arch: str) -> None:
    import gguf  # noqa: PLC0415

    a = arch
    writer.add_vocab_size(config.tgt_vocab_size)
    writer.add_block_count(config.num_decoder_layers)
    writer.add_context_length(config.decoder_len)
    writer.add_embedding_length(config.d_model)
    writer.add_feed_forward_length(config.d_ff)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_layer_norm_rms_eps(config.layer_norm_epsilon)
    writer.add_rope_freq_base(config.rope_theta)
    if config.rope_scaling == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(config.rope_scaling_factor)
    if arch in GEMMA:
        if config.sliding_window is not None:
            writer.add_sliding_window(config.sliding_window)
            writer.add_array(f"{a}.attention.sliding_window_pattern",
                             [config.layer_is_local(i) for i in range(config.num_decoder_layers)])
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(config, key) is not None:
                writer.add_float32(f"{a}.{key}", float(getattr(config, key)))
        if config.query_scale is not None:
            writer.add_float32(f"{a}.attention.scale", float(config.query_scale))
        if arch == "gemma3":
            writer.add_float32(f"{a}.rope.freq_base_swa", float(config.rope_local_theta))


def _copy_vocab(writer, source: str, vocab_size: int) -> None:
    import gguf  # noqa: PLC0415

    reader = gguf.GGUFReader(source)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None and len(tokens.data) != vocab_size:
        raise ValueError(f"{source} has {len(tokens.data)} tokens, the model's vocabulary "
                         f"{vocab_size}")
    for field in reader.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(field.name, field.contents(), kind, sub_type=field.types[-1])
        else:
            writer.add_key_value(field.name, field.contents(), kind)


def save_gguf(config: TransformerConfig, params, path, *, arch: str,
              vocab_from: Optional[str] = None) -> str:
    """Write `params` (float, either layer layout) of a decoder-only `config` as a float32
    GGUF file of architecture `arch` at `path` (refused if it exists: nothing a user
    saved is overwritten); the vocabulary copied from the GGUF file `vocab_from`."""
    import gguf  # noqa: PLC0415

    if arch not in ARCHITECTURES:
        raise ValueError(f"arch={arch!r}: one of {', '.join(ARCHITECTURES)}")
    if config.num_encoder_layers or config.weight_quant or config.quant_format("embed"):
        raise ValueError("save_gguf writes float decoder-only models: dequantize_params "
                         "first (and an encoder-decoder has no GGUF family here)")
    path = os.fspath(path)
    if os.path.exists(path):
        raise FileExistsError(f"{path} exists: save_gguf never overwrites a file")
    tensors = gguf_tensors(config, params, arch)
    writer = gguf.GGUFWriter(path + ".part", arch)
    _metadata(writer, config, arch)
    if vocab_from is not None:
        _copy_vocab(writer, vocab_from, config.tgt_vocab_size)
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(path + ".part", path)
    return path

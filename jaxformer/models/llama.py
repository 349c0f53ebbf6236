"""GGUF files by architecture (llama, mistral, qwen2, qwen3, gemma2, gemma3) as a
jaxformer `DecoderOnlyLM`.

    model, params, tokenizer = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    ids = tokenizer.encode("The capital of France is").ids
    out = jaxformer.generate(model, params, jnp.asarray([ids]), max_new_tokens=16)

`general.architecture` picks the mapping, as llama.cpp reads each one; every
family is a config choice of `jaxformer.config.llama` (pre-RMSNorm, RoPE,
gated FFN, grouped-query attention) with the file's sizes:

    llama, mistral   no biases; query/key rows permuted by the converter (below)
    qwen2            query/key/value biases
    qwen3            per-head q/k RMSNorm, head dim `{arch}.attention.key_length`
    gemma2           sandwich norms, (1 + w) RMSNorm, embeddings * sqrt(D), GELU,
                     soft caps, local/global alternating (window
                     `{arch}.attention.sliding_window`)
    gemma3           gemma2's blocks + q/k norm (no soft caps), 5 local : 1 global,
                     local RoPE base `{arch}.rope.freq_base_swa` (llama.cpp: 10000),
                     linear RoPE scaling of the global layers (`{arch}.rope.scaling.*`)

Gemma: llama.cpp's converter stores every norm weight with the 1 of the (1 + w)
parameterisation already added; it is subtracted here, so the parameters are
the Hugging Face checkpoint's. The query scale is `{arch}.attention.scale` if the
file has it, else llama.cpp's: 1/sqrt(head dim), 1/sqrt(D / heads) for the 27B
models. The local/global pattern is `{arch}.attention.sliding_window_pattern`
if present (a period or one flag per layer), else llama.cpp's (2 resp. 6).
llama.cpp implements no sliding window for the other families; neither does
this reader.

An unknown architecture is refused by name from the first metadata entries,
before the rest of the file is parsed.

`load_gguf(path, quantize="keep")` keeps the file's Q8_0 / Q4_0 / Q4_1 and K-quant
(Q4_K, Q5_K, Q6_K) blocks as they are, each tensor in its own type's layout
(`kept_formats`: the config's weight_quant / embed_quant from the tensors' types,
quant_layouts for the kernels of a mixed file's other types; `params_from_gguf`
moves each block array the way the float kernel moves, never dequantizing it);
Q5_0 decodes exactly into int8_block, the other types (Q5_1, Q2_K, Q3_K) convert to
int8_block (`interop.gguf_blocks`), with a `QuantConversionWarning` stating each
inexact conversion's error; a type jaxformer does not decode is refused by name.

The tensors' names, shapes and layouts are the family's table
(`jaxformer.models.llama_tensors.LLAMA`, GGUF names in numpy order);
`params_from_gguf` loops over it.

RoPE layout: for llama/mistral, llama.cpp's converter permutes each head's
query/key rows from Hugging Face's half-split order to the interleaved pair
order, which its RoPE kernel uses (the other families keep Hugging Face's
order). `rope="half"` (default) gives exactly the Hugging Face checkpoint's
weights; `rope="interleaved"` keeps (or makes) interleaved rows and rotates
interleaved pairs. Both compute the same function; mixing them (interleaved
rows, half rotation) does not (tested).
"""

from __future__ import annotations

import collections
import os
import warnings
from typing import Optional

import jax.numpy as jnp
import numpy as np

from jaxformer.config import TransformerConfig, llama
from jaxformer.interop.gguf import (BLOCK, FLOAT_TYPES, GGUFFile, read_architecture,
                                    read_gguf)
from jaxformer.interop.gguf_blocks import target_layout
from jaxformer.interop.flat import unflatten
from jaxformer.interop.progress import tensor_bar
from jaxformer.models import tensor_table
from jaxformer.models.llama_tensors import LLAMA
from jaxformer.nn.model import DecoderOnlyLM
from jaxformer.nn.quant import check_format
from jaxformer.nn.quant_dense import leaf_names
from jaxformer.nn.quant_params import quantize_params
from jaxformer.nn.rope import half_to_interleaved_rows
from jaxformer.text.gguf_vocab import tokenizer_from_gguf

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3")
PERMUTED = ("llama", "mistral")  # query/key rows in interleaved order (the converter's permute)
GEMMA = ("gemma2", "gemma3")
# llama.cpp's local:global period when the file states none, and its 27B layer counts.
_SWA_PERIOD = {"gemma2": 2, "gemma3": 6}
_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# Metadata that would change the function but that jaxformer does not implement.
_UNSUPPORTED_KEYS = ("{a}.attention.layer_norm_epsilon", "{a}.expert_count",
                     "{a}.rope.scaling.attn_factor", "{a}.attention.key_length_swa")


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


def check_architecture(path, arch: str) -> None:
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (supported: "
                         f"{', '.join(ARCHITECTURES)})")


def _rope_scaling(file: GGUFFile, a: str) -> dict:
    kind = file.metadata.get(f"{a}.rope.scaling.type", "none")
    if kind == "none":
        return {}
    if kind == "linear":
        return dict(rope_scaling="linear",
                    rope_scaling_factor=float(_meta(file, f"{a}.rope.scaling.factor")))
    raise ValueError(f"{file.path}: metadata {a}.rope.scaling.type={kind!r} is not supported "
                     "by jaxformer (implemented: none, linear)")


def _window(file: GGUFFile, a: str, layers: int) -> tuple[Optional[int], Optional[str]]:
    """(sliding_window, attention_pattern): Gemma's local/global layers as llama.cpp
    reads them (the other families: full attention everywhere)."""
    if a not in GEMMA:
        return None, None
    window = int(_meta(file, f"{a}.attention.sliding_window"))
    period = file.metadata.get(f"{a}.attention.sliding_window_pattern", _SWA_PERIOD[a])
    if isinstance(period, (list, tuple)):  # one flag per layer: True = local
        if len(period) != layers:
            raise ValueError(f"{file.path}: {a}.attention.sliding_window_pattern has "
                             f"{len(period)} entries for {layers} layers")
        pattern = "".join("L" if local else "G" for local in period)
    else:  # llama.cpp's set_swa_pattern(n): every n-th layer global (n = 0: all local)
        n = int(period)
        pattern = "".join("L" if n == 0 or (i + 1) % n else "G" for i in range(layers))
    return (window, pattern) if "L" in pattern else (None, None)


def config_from_gguf(file: GGUFFile, *, rope: str = "half", dtype: str = "float32",
                     max_len: int | None = None) -> TransformerConfig:
    """The `TransformerConfig` a GGUF file describes (see the module docstring).

    Raises ValueError naming the problem for another architecture, metadata
    jaxformer does not implement (rope scaling other than linear, Llama 3's
    rope_freqs, partial rotary, MoE) or a tensor of an unsupported quantization
    type: before any tensor is decoded.
    """
    a = file.architecture
    check_architecture(file.path, a)
    for key in _UNSUPPORTED_KEYS:
        if key.format(a=a) in file.metadata:
            raise ValueError(f"{file.path}: metadata {key.format(a=a)!r} is not supported by "
                             "jaxformer")
    if "rope_freqs.weight" in file.tensors:
        raise ValueError(f"{file.path}: tensor 'rope_freqs.weight' (RoPE frequency factors, "
                         "e.g. Llama 3.1's rope scaling) is not supported by jaxformer")
    file.check_types()
    d_model = int(_meta(file, f"{a}.embedding_length"))
    heads = int(_meta(file, f"{a}.attention.head_count"))
    layers = int(_meta(file, f"{a}.block_count"))
    head_dim = int(file.metadata.get(f"{a}.attention.key_length",
                                     d_model // heads if d_model % heads == 0 else -1))
    value_dim = int(file.metadata.get(f"{a}.attention.value_length", head_dim))
    rot = int(file.metadata.get(f"{a}.rope.dimension_count", head_dim))
    if head_dim <= 0 or rot != head_dim or value_dim != head_dim:
        raise ValueError(f"{file.path}: rope.dimension_count={rot}, attention.value_length="
                         f"{value_dim} and the head dim {head_dim} differ (partial rotary or "
                         "odd head dims are not supported)")
    vocab = len(file.metadata.get("tokenizer.ggml.tokens", ())) or int(
        _meta(file, f"{a}.vocab_size"))
    pad, bos, eos = _special_ids(file)
    context = int(_meta(file, f"{a}.context_length"))
    window, pattern = _window(file, a, layers)
    fields = dict(
        src_vocab_size=vocab, tgt_vocab_size=vocab, d_model=d_model, num_heads=heads,
        num_kv_heads=int(_meta(file, f"{a}.attention.head_count_kv", heads)),
        head_dim=head_dim, d_ff=int(_meta(file, f"{a}.feed_forward_length")),
        num_decoder_layers=layers, max_len=context if max_len is None else max_len,
        layer_norm_epsilon=float(_meta(file, f"{a}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(file.metadata.get(f"{a}.rope.freq_base", 10000.0)), rope=rope,
        tie_output_embedding=LLAMA.row("decoder/out_proj/kernel").gguf not in file.tensors,
        sliding_window=window, attention_pattern=pattern,
        pad_id=pad, bos_id=bos, eos_id=eos, dtype=dtype, **_rope_scaling(file, a))
    if a == "qwen2":
        fields["attention_biases"] = "qkv"
    if a in ("qwen3", "gemma3"):
        fields["qk_norm"] = True
    if a in GEMMA:
        default_scale = (d_model / heads if layers == _27B_LAYERS[a] else head_dim) ** -0.5
        caps = {k: file.metadata.get(f"{a}.{k}") for k in ("attn_logit_softcapping",
                                                           "final_logit_softcapping")}
        fields.update(norm="sandwich", norm_scale_plus_one=True, scale_embeddings=True,
                      embedding_scale_dtype="compute", activation="gelu_tanh",
                      query_scale=float(file.metadata.get(f"{a}.attention.scale",
                                                          default_scale)),
                      **{k: (None if v is None else float(v)) for k, v in caps.items()})
        if a == "gemma3":
            fields["rope_local_theta"] = float(file.metadata.get(f"{a}.rope.freq_base_swa",
                                                                 10000.0))
    return llama(**fields)


class QuantConversionWarning(UserWarning):
    """`load_gguf(..., quantize="keep")` converted block types that do not map exactly
    onto a layout; the message states each conversion's largest relative error."""


def kept_formats(file: GGUFFile, config: TransformerConfig) -> dict:
    """The config fields that keep the file's blocks (`load(..., quantize="keep")`), each
    kernel in its block type's layout (`gguf_blocks.target_layout`): weight_quant the
    layer kernels' most common layout, embed_quant the token table's (float if it and
    the untied output are float), and quant_layouts every kernel of another layout than
    its role's (a Q4_K_M file's Q6_K and Q5_0 tensors).

    Raises ValueError naming the tensor and its type for a type jaxformer does not
    decode, for layer kernels partly float, and for a file whose layer kernels are float
    (nothing to keep)."""
    def kind(name):
        return file.tensors[name].tensor_type

    kernel_entries = [e for e in tensor_table.entries(LLAMA, config)
                      if e.row.kind in tensor_table.KERNELS]
    kernels = [e.gguf for e in kernel_entries if e.layer is not None]
    embeddings = [e.gguf for e in kernel_entries if e.layer is None]  # table, untied output
    file.check_types()  # a type jaxformer does not decode, by name
    types = {kind(n) for n in kernels}
    if types <= FLOAT_TYPES:
        raise ValueError(f"{file.path}: quantize='keep' keeps quantized blocks, but the layer "
                         f"kernels are {'/'.join(sorted(t.name for t in types))}: load it with "
                         "quantize='int8' or 'int4' (or without quantize)")
    if types & FLOAT_TYPES:
        raise ValueError(f"{file.path}: quantize='keep' needs every layer kernel quantized, "
                         f"the file mixes {', '.join(sorted(t.name for t in types))}: "
                         "load it with quantize='int8' or 'int4' (or without quantize)")
    tables = {kind(n) for n in embeddings}
    if tables & FLOAT_TYPES and tables - FLOAT_TYPES:
        raise ValueError(f"{file.path}: quantize='keep' needs {' and '.join(embeddings)} "
                         f"both quantized or both float, got "
                         f"{' and '.join(kind(n).name for n in embeddings)}")
    layer_layouts = collections.Counter(target_layout(kind(n)) for n in kernels)
    layers = max(sorted(layer_layouts), key=layer_layouts.__getitem__)
    embed = "float" if tables <= FLOAT_TYPES else target_layout(kind(embeddings[0]))
    overrides = []
    for entry in kernel_entries:
        role_layout = layers if entry.layer is not None else embed
        layout = role_layout if embed == "float" and entry.layer is None \
            else target_layout(kind(entry.gguf))
        if layout != role_layout:
            overrides.append((entry.ours.rsplit("/", 1)[0], layout))
    return dict(weight_quant=layers, quant_block=BLOCK, embed_quant=embed,
                quant_layouts=tuple(overrides))


def auto_quantize(file: GGUFFile, config: TransformerConfig) -> Optional[str]:
    """What `quantize="auto"` loads `file` as: "keep" if its layer kernels are quantized
    (llama.cpp runs a file's blocks as they are), None (float) if they are float. A file
    whose blocks `kept_formats` cannot keep (layer kernels partly float, one embedding
    table quantized and the other not) loads as float with a `UserWarning` naming why;
    a tensor type jaxformer does not decode is refused by name (ValueError)."""
    file.check_types()
    try:
        kept_formats(file, config)
    except ValueError as error:
        if _layer_kernel_types(file, config) - FLOAT_TYPES:
            why = str(error).partition(": load it with")[0]  # not its advice to the caller
            warnings.warn(f"{why}; loaded as float (dequantized) instead", UserWarning,
                          stacklevel=3)
        return None
    return "keep"


def _layer_kernel_types(file: GGUFFile, config: TransformerConfig) -> set:
    return {file.tensors[e.gguf].tensor_type for e in tensor_table.entries(LLAMA, config)
            if e.row.kind in tensor_table.KERNELS and e.layer is not None}


def quantized_layout(file: GGUFFile, config: TransformerConfig) -> Optional[str]:
    """The layout `kept_formats` gives the layer kernels, or None if they are float."""
    try:
        return kept_formats(file, config)["weight_quant"]
    except ValueError:
        return None


def expected_shapes(config: TransformerConfig, arch: str = "llama") -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> numpy shape that `config` implies (`LLAMA`'s rows; `arch`'s
    blocks are the config's: `config_from_gguf`). The file must match exactly."""
    return tensor_table.file_shapes(LLAMA, config, "gguf")


def check_shapes(file: GGUFFile, config: TransformerConfig) -> None:
    """Every tensor present with the shape `config` implies, and no other tensor:
    else one `CheckpointMismatch` listing every difference (from the header)."""
    tensor_table.check_shapes(expected_shapes(config, file.architecture),
                              {name: file.shape(name) for name in file.tensors})


def _feature_order(arch: str, head_dim: int, rope: str) -> np.ndarray:
    """Index along a head's K query/key features taking the file's order to `rope`'s."""
    p = half_to_interleaved_rows(head_dim)  # interleaved[j] = half[p[j]]
    if arch in PERMUTED:  # file rows are interleaved
        return np.argsort(p) if rope == "half" else np.arange(head_dim)
    return p if rope == "interleaved" else np.arange(head_dim)


def params_from_gguf(file: GGUFFile, config: TransformerConfig, *,
                     progress: Optional[bool] = None) -> dict:
    """jaxformer `DecoderOnlyLM` parameters (float32 numpy -> `config.param_dtype`).

    With a quantized `config` (`kept_formats`) the kernels of its quantized roles are
    the file's blocks as they are (`GGUFFile.blocks`, rearranged to the kernel layout
    of `nn.quant_dense`, never dequantized); the rest is dequantized as before.
    Checks every tensor's shape against `config` first (`check_shapes`).
    `progress`: a bar on stderr per tensor read (None: if stderr is a terminal).
    """
    check_shapes(file, config)
    gemma = file.architecture in GEMMA
    order = _feature_order(file.architecture, config.head_dim, config.rope)
    bar = tensor_bar(len(file.tensors), f"reading {os.path.basename(file.path)}", progress)
    dims = LLAMA.dims(config)

    def get(entry):
        value = file.array(entry.gguf)
        bar.update(1)
        if gemma and entry.row.kind in tensor_table.NORMS:
            value = value - 1.0  # the converter stored 1 + w
        return value

    def weight(entry, role):
        """{leaf: float} or the kept blocks {leaf_q, scale, ...} of a kernel, in the
        parameter layout (the blocks' rows moved as the float kernel's rows move)."""
        module, leaf = entry.ours.rsplit("/", 1)
        fmt = config.quant_format(role, module)
        if fmt is None:
            return {leaf: tensor_table.to_params(entry.row, get(entry), dims, order)}
        _, parts = file.blocks(entry.gguf, fmt)
        bar.update(1)
        return {leaf_names(leaf, fmt)[part]: tensor_table.to_params(
            entry.row, value, dims, order, blocks=True) for part, value in parts.items()}

    def device(x):
        return jnp.asarray(np.ascontiguousarray(x), config.params_dtype
                           if np.issubdtype(x.dtype, np.float32) else x.dtype)

    # Each tensor becomes a JAX array as soon as it is read, so its host copy is freed
    # before the next one is dequantized (into the same heap space): the process never
    # holds every tensor twice, and the C heap is not left with the whole model's worth
    # of freed, never returned memory (an idle server's RSS: ~440 MB less on SmolLM2).
    flat = {}
    for entry in tensor_table.entries(LLAMA, config):
        if entry.row.kind in tensor_table.KERNELS:  # kept blocks or float, by role
            module = entry.ours.rsplit("/", 1)[0]
            for leaf, value in weight(entry, "embed" if entry.layer is None
                                      else "layers").items():
                flat[f"{module}/{leaf}"] = device(value)
        else:
            flat[entry.ours] = device(tensor_table.to_params(entry.row, get(entry), dims,
                                                             order))
    bar.close()
    return unflatten(flat)


def load_gguf(path, *, rope: str = "half", dtype: str = "float32", max_len: int | None = None,
              progress: Optional[bool] = None, quantize: Optional[str] = None):
    """(DecoderOnlyLM, params, tokenizers.Tokenizer or None) from a GGUF file.

    `max_len` caps the context (default: the file's context length). An
    unsupported architecture is refused from the first metadata entries.
    `progress`: a bar on stderr while tensors are dequantized (None: if stderr
    is a terminal; True / False force it on / off). `quantize`: None (float32
    kernels), "keep" (the file's quantized blocks kept as they are: `kept_formats`),
    "auto" ("keep" if the layer kernels are quantized, else float: `auto_quantize`;
    the command line's default) or a layout of `nn.quant` ("int8", "int4", ...: the
    dequantized kernels quantized again, `nn.quant_params.quantize_params`).
    """
    if quantize not in (None, "keep", "auto"):
        check_format(quantize)
    arch = read_architecture(path)
    if arch is not None:  # else the full parse below finds it (or its absence)
        check_architecture(path, arch)
    file = read_gguf(path)
    config = config_from_gguf(file, rope=rope, dtype=dtype, max_len=max_len)
    if quantize == "auto":
        quantize = auto_quantize(file, config)
    if quantize not in (None, "keep"):
        held = quantized_layout(file, config)
        if held == quantize:
            quantize = "keep"
        elif held is not None:
            raise ValueError(f"{path}: quantize={quantize!r}, but the file's layer kernels are "
                             f"already quantized ({held}): load it with quantize='keep' (or "
                             "without quantize, as float)")
    if quantize == "keep":
        config = config.replace(**kept_formats(file, config))
    params = params_from_gguf(file, config, progress=progress)
    if file.conversions:
        warnings.warn(f"{path}: " + "; ".join(
            f"{kind} converted to {fmt}, largest error {error:.2e} of a tensor's largest "
            f"weight" for (kind, fmt), error in sorted(file.conversions.items())),
            QuantConversionWarning, stacklevel=2)
    if quantize not in (None, "keep"):
        config, params = quantize_params(config, params, quantize)
    return DecoderOnlyLM(config), params, tokenizer_from_gguf(file)

"""Which attention implementation to run: cuDNN's fused kernel, blockwise, or dense.

`choose_attention_impl` is the rule behind `attention_impl="auto"`; it only
looks at static facts (platform, head dim, dtype, the mask's structure, the
length), so the choice is made at trace time, is visible (log it, print it) and
can be overridden by naming an implementation.

  "cudnn"      `jax.nn.dot_product_attention(implementation="cudnn")`: NVIDIA GPUs,
               float16 / bfloat16, head dim a multiple of 8 and <= 128 (<= 256 on
               Hopper and later; 128 is what holds everywhere), and a mask cuDNN
               takes as structure: causal, a causal sliding window, key / query
               lengths (`jax_nn_mask_arguments`); segment ids (packed documents)
               as a boolean (B, 1, T, S) mask, which cuDNN reads as a constant bias,
               up to `SEGMENT_MASK_MAX_ELEMENTS` = T x S. Prefixes, explicit
               positions and query offsets have no cuDNN form through `jax.nn`.
  "splash"     Pallas splash attention (`splash.splash_attention`): TPUs, float32 /
               bfloat16, head dim a multiple of 128, T and S multiples of 128 (its
               blocks), and a mask of causal / window / segment-id structure only
               (`splash_supports`).
  "blockwise"  `blockwise.blockwise_attention`: memory linear in length, any MaskSpec;
               from `BLOCKWISE_MIN_LENGTH` on (`GPU_BLOCKWISE_MIN_LENGTH` on GPUs).
  "dense"      `attention.dot_product_attention`: short sequences, and masks given as
               dense boolean arrays (arbitrary patterns).

Forward-mode AD: dense and blockwise support `jax.jvp`; cuDNN's and splash's
kernels have a custom VJP only, so forward mode needs "blockwise" or "einsum" there.

The platform is the default backend's, or, while tracing inside
`target_platform(p)`, `p`: a program lowered for another platform
(`.lower(lowering_platforms=("tpu",))` on a CPU host) then picks that platform's kernel.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, Optional

import jax
import jax.numpy as jnp

from jaxformer.nn.mask_structure import MaskSpec

# Blockwise is no slower than dense on CPU from here on for causal masks
# (benchmarks/long.py), and its temporaries grow linearly instead of quadratically.
BLOCKWISE_MIN_LENGTH = 1024
# On a GPU XLA runs blockwise's scan over key blocks as many small kernels: a 125M
# train step at 8 x 2048 took 0.26 s blockwise against 0.095 s dense (0.060 s cuDNN)
# on an H100 (benchmarks/gpu.py, NOTES.md), so dense keeps masks cuDNN cannot take
# up to here.
GPU_BLOCKWISE_MIN_LENGTH = 4096
# Segment ids reach `jax.nn` as a dense boolean mask (cuDNN: a (B, 1, T, S) bias in the
# query dtype) up to this T x S; longer calls go blockwise.
SEGMENT_MASK_MAX_ELEMENTS = GPU_BLOCKWISE_MIN_LENGTH ** 2
GPU_PLATFORMS = ("gpu", "cuda", "rocm")
CUDNN_MAX_HEAD_DIM = 128
CUDNN_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
SPLASH_BLOCK = 128  # the splash kernel's default blocks and its lane width
SPLASH_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))

_TARGET_PLATFORM: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar(
    "jaxformer_target_platform", default=None)


@contextlib.contextmanager
def target_platform(platform: str) -> Iterator[None]:
    """Trace "auto" attention for `platform` ("cpu", "cuda", "tpu") instead of the
    default backend: for programs lowered for another platform than this host's.
    The platform is not part of `jax.jit`'s cache key: trace a fresh jit inside."""
    token = _TARGET_PLATFORM.set(platform)
    try:
        yield
    finally:
        _TARGET_PLATFORM.reset(token)


def splash_supports(head_dim: int, dtype: Any, mask: Optional[MaskSpec], num_queries: int,
                    num_keys: int) -> bool:
    """Whether Pallas splash attention takes this call: float32 / bfloat16, head dim and
    lengths multiples of `SPLASH_BLOCK`, and a mask it expresses (causal, window, segment
    ids; not lengths, prefixes, explicit positions or a query offset)."""
    if mask is not None and (mask.has_positions or mask.prefix_length is not None
                             or mask.kv_lengths is not None or mask.q_lengths is not None
                             or not (isinstance(mask.q_offset, int) and mask.q_offset == 0)):
        return False
    return (jnp.dtype(dtype) in SPLASH_DTYPES and head_dim % SPLASH_BLOCK == 0
            and num_queries % SPLASH_BLOCK == 0 and num_keys % SPLASH_BLOCK == 0)


def jax_nn_mask_arguments(mask: Optional[MaskSpec]) -> Optional[dict[str, Any]]:
    """`jax.nn.dot_product_attention` keyword arguments (`is_causal`, `local_window_size`,
    `query_seq_lengths`, `key_value_seq_lengths`, and `mask` for segment ids) expressing
    `mask`, or None if the mask has parts they cannot express (a prefix, explicit
    positions, a query offset, a window without causality, segment ids over more than
    `SEGMENT_MASK_MAX_ELEMENTS` query x key pairs)."""
    if mask is None:
        return {}
    if (mask.prefix_length is not None or mask.has_positions
            or not (isinstance(mask.q_offset, int) and mask.q_offset == 0)
            or (mask.window is not None and not mask.causal)):
        return None
    args: dict[str, Any] = {"is_causal": mask.causal}
    if mask.q_segment_ids is not None:
        if mask.q_segment_ids.shape[-1] * mask.kv_segment_ids.shape[-1] > \
                SEGMENT_MASK_MAX_ELEMENTS:
            return None
        args["mask"] = (mask.q_segment_ids[:, None, :, None]
                        == mask.kv_segment_ids[:, None, None, :])  # (B, 1, T, S)
    if mask.window is not None:  # keys (q - w, q]: w - 1 to the left, none to the right
        args["local_window_size"] = (mask.window - 1, 0)
    if mask.q_lengths is not None:
        args["query_seq_lengths"] = jnp.asarray(mask.q_lengths, jnp.int32)
    if mask.kv_lengths is not None:
        args["key_value_seq_lengths"] = jnp.asarray(mask.kv_lengths, jnp.int32)
    return args


def cudnn_supports(head_dim: int, dtype: Any, mask: Optional[MaskSpec]) -> bool:
    """Whether cuDNN's fused attention (through `jax.nn`) takes this head dim, dtype and
    mask (the checks of jax's `fused_attention_stablehlo`, for any NVIDIA GPU)."""
    return (jnp.dtype(dtype) in CUDNN_DTYPES and head_dim % 8 == 0
            and head_dim <= CUDNN_MAX_HEAD_DIM and jax_nn_mask_arguments(mask) is not None)


def choose_attention_impl(platform: str, head_dim: int, dtype: Any,
                          mask: Optional[MaskSpec | jnp.ndarray], seq_len: int,
                          shape: Optional[tuple[int, int]] = None) -> str:
    """"cudnn", "splash", "blockwise" or "dense" for this call (module docstring).

    Args:
      platform: `jax.devices()[0].platform` or a lowering platform: "cpu", "gpu",
        "cuda", "rocm", "tpu".
      head_dim, dtype: of the queries.
      mask: a MaskSpec, a dense boolean mask (arbitrary pattern: "dense"), or None.
      seq_len: the longer of the query and key lengths.
      shape: (T, S), the query and key lengths (default both `seq_len`).
    """
    if mask is not None and not isinstance(mask, MaskSpec):
        return "dense"  # an arbitrary pattern only the dense path takes
    if platform in ("gpu", "cuda") and cudnn_supports(head_dim, dtype, mask):
        return "cudnn"
    if platform == "tpu" and splash_supports(head_dim, dtype, mask,
                                             *(shape or (seq_len, seq_len))):
        return "splash"
    return "blockwise" if seq_len >= blockwise_min_length(platform) else "dense"


def blockwise_min_length(platform: str) -> int:
    """The length from which "auto" runs blockwise rather than dense attention (when no
    fused kernel takes the call) on `platform`."""
    return GPU_BLOCKWISE_MIN_LENGTH if platform in GPU_PLATFORMS else BLOCKWISE_MIN_LENGTH


def resolved_attention_impl(config, length: int, mask: Optional[MaskSpec | jnp.ndarray] = None,
                            platform: Optional[str] = None,
                            shape: Optional[tuple[int, int]] = None) -> str:
    """The implementation a self-attention call of `config` runs at `length` tokens:
    "einsum" (dense), "blockwise", "cudnn" (`jax.nn.dot_product_attention`'s fused
    kernel) or "splash" (Pallas, TPU); "jax" when the config names it.

    An explicit `config.attention_impl` is returned as is; "auto" applies
    `choose_attention_impl` to this backend (`platform`, default the
    `target_platform` being traced for, else the default backend's), the config's
    head dim and compute dtype and `mask` (default the LM's causal mask), at trace
    time; `shape` (T, S) when queries and keys differ in length. A soft cap rules
    cuDNN out (it has none). Call it to see what a model will run; set
    `attention_impl` to override.
    """
    if config.attention_impl != "auto":
        return config.attention_impl
    if platform is None:
        platform = _TARGET_PLATFORM.get() or jax.default_backend()
    mask = MaskSpec(causal=True) if mask is None else mask
    choice = choose_attention_impl(platform, config.head_dim, config.compute_dtype, mask, length,
                                   shape)
    if choice == "cudnn" and config.attn_logit_softcapping is not None:
        choice = "blockwise" if length >= blockwise_min_length(platform) else "dense"
    return {"dense": "einsum"}.get(choice, choice)


def uses_mask_spec(config) -> bool:
    """Whether models of `config` describe their masks as a MaskSpec (never a dense
    (B, 1, T, T) array): the implementations that can take one without densifying."""
    return config.attention_impl in ("blockwise", "auto")

"""What `config.cpu_tuning` switches in the layers: Flax and JAX as they are, or the
CPU-tuned equivalents of `jaxformer.backends.cpu` (same values, gated to the CPU)."""

from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from jaxformer.backends import cpu
from jaxformer.config import TransformerConfig


def dot_general(config: TransformerConfig) -> Callable:
    """The `dot_general` of every Dense. The layout VJP only where no checkpoint policy
    must see the matmuls (it sees a custom VJP as one opaque call): unrolled stacks
    without remat."""
    if config.cpu_tuning and config.remat == "none" and not config.scan_layers:
        return cpu.dot_general
    return lax.dot_general


def dropout(config: TransformerConfig, rate: float) -> nn.Module:
    """`flax.linen.Dropout(rate)`, or its CPU-tuned subclass (same names, same bits)."""
    return (cpu.Dropout if config.cpu_tuning else nn.Dropout)(rate)


def dropout_mask(config: TransformerConfig) -> Callable:
    """`(rng, keep_prob, shape) -> bool mask`: `jax.random.bernoulli` or its CPU-tuned
    equivalent (same bits)."""
    return cpu.keep_mask if config.cpu_tuning else jax.random.bernoulli


def query_blocks(config: TransformerConfig) -> bool:
    """Whether inference attention forms its weights a block of queries at a time on a
    CPU (`attention.query_block_length`): a whole row's weights are a fresh allocation
    each call there, faulted in page by page (Whisper's encoder, NOTES.md)."""
    return config.cpu_tuning


def apply_dropout(x: jnp.ndarray, rate: float, rng: jax.Array,
                  mask_fn: Callable = jax.random.bernoulli) -> jnp.ndarray:
    """Zero each element of `x` with probability `rate` and scale the rest by
    1 / (1 - rate), as `flax.linen.Dropout` does with the same key."""
    keep_prob = 1.0 - rate
    mask = mask_fn(rng, keep_prob, x.shape)
    return lax.select(mask, x / keep_prob, jnp.zeros_like(x))

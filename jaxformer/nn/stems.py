"""Input stems: Flax modules that turn raw encoder inputs into (B, S, D) vectors.

A stem is the `stem` slot of a `Transformer`: its parameters live in the
model's tree (under "stem") and train with it. Layout (B, S, C), channels last.
"""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax.numpy as jnp

from jaxformer.config import TransformerConfig
from jaxformer.nn.layers import activation_fn
from jaxformer.nn.axes import logical


class ConvStem(nn.Module):
    """1-D convolutions with an activation after each: (B, S_in, C) -> (B, S, D).

    Parameters `conv_{i}/kernel` (width, C_in, D) and `conv_{i}/bias` (D,);
    padding (width - 1) // 2 on both sides, so S = ceil(S_in / prod(strides)).
    Whisper: two convolutions of width 3, strides (1, 2), GELU, over 80 mel bins.
    """

    config: TransformerConfig
    strides: Sequence[int] = (1, 2)
    width: int = 3

    @nn.compact
    def __call__(self, x_BSC: jnp.ndarray) -> jnp.ndarray:
        c = self.config
        act = activation_fn(c.activation)
        x = x_BSC.astype(c.compute_dtype)
        pad = (self.width - 1) // 2
        for i, stride in enumerate(self.strides):
            x = act(nn.Conv(c.d_model, (self.width,), strides=(stride,), padding=[(pad, pad)],
                            dtype=c.compute_dtype, param_dtype=c.params_dtype,
                            kernel_init=logical(nn.initializers.lecun_normal(),
                                                ("conv_width", "conv_in", "embed")),
                            bias_init=logical(nn.initializers.zeros, ("embed",)),
                            name=f"conv_{i}")(x))
        return x

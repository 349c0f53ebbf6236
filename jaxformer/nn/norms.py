"""The configured norm: LayerNorm, RMSNorm, or Gemma's RMSNorm with scale (1 + w).

One constructor, `layer_norm(config)`, so every sublayer norm, final norm and
per-head query/key norm (`config.qk_norm`) follows the same choice and has the
same parameter names (`scale`, plus `bias` for LayerNorm).
"""

from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer.config import TransformerConfig
from jaxformer.nn.axes import logical


class OffsetRMSNorm(nn.Module):
    """x / rms(x) * (1 + scale) over the last axis, computed in float32 (Gemma's RMSNorm).

    `scale` (features,) starts at 0, so a fresh norm is the plain RMS normalisation.
    """

    epsilon: float
    dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        scale = self.param("scale", logical(nn.initializers.zeros, ("norm",)),
                           (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.epsilon)
        return (normed * (1.0 + scale.astype(jnp.float32))).astype(self.dtype)


def layer_norm(config: TransformerConfig, name: Optional[str] = None) -> nn.Module:
    """The configured norm: LayerNorm (scale, bias) or RMSNorm (scale only)."""
    # norm_dtype: float32 under precision="mixed" (statistics and output).
    if config.norm_scale_plus_one:
        return OffsetRMSNorm(config.layer_norm_epsilon, config.norm_dtype,
                             config.params_dtype, name=name)
    common = dict(epsilon=config.layer_norm_epsilon, dtype=config.norm_dtype,
                  param_dtype=config.params_dtype, name=name,
                  scale_init=logical(nn.initializers.ones, ("norm",)))
    if config.norm_type == "rmsnorm":
        return nn.RMSNorm(**common)
    return nn.LayerNorm(bias_init=logical(nn.initializers.zeros, ("norm",)), **common)

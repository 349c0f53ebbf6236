"""precision="mixed": which backends can run it.

What stays float32 under "mixed" and why (see README, "Deep models"):
parameters, so gradients and AdamW's moments are float32 and small updates are
not rounded away (bf16 keeps 8 significant bits: an update below 2**-8 of a
weight would vanish); LayerNorm/RMSNorm (mean and variance of D values
cancel badly in bf16); the attention softmax (exp of large logits); the
output projection, logits and the loss (log-probabilities of a large vocabulary
need the resolution). The matmuls of attention and the FFN take bfloat16
operands: that is where the time and the activation memory go.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax

from jaxformer.config import TransformerConfig


def supports_bfloat16(device) -> bool:
    """TPUs and CPUs do; GPUs from compute capability 8.0 (Ampere) on."""
    if device.platform == "gpu" or device.platform == "cuda":
        capability = getattr(device, "compute_capability", None)
        return capability is not None and float(capability) >= 8.0
    return device.platform in ("tpu", "cpu")


def check_backend(config: TransformerConfig, devices: Optional[Sequence] = None) -> None:
    """ValueError naming the fix when `config.precision == "mixed"` cannot run here."""
    if config.precision != "mixed":
        return
    for device in jax.devices() if devices is None else devices:
        if not supports_bfloat16(device):
            raise ValueError(
                f'precision="mixed" needs bfloat16 matmuls, which {device.device_kind} '
                f"({device.platform}) does not support: use precision=\"default\" "
                "(float32) on this backend")

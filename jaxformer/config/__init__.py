"""The one configuration object: every architecture choice, validated once.

    transformer   `TransformerConfig`: the fields, derived values, JSON round trip
    checks        its validation, and the choices and layouts fields may take
    presets       `tiny`, `copy_task`, `bench`, `lm`, `llama`, `PRESETS`

A `TransformerConfig` is a frozen dataclass, so it is hashable and can be a
static argument to `jax.jit`. Strings (not dtype objects) keep it JSON-friendly
for run directories and checkpoints: `TransformerConfig(**json.load(f))`.
"""

from jaxformer.config.checks import (LORA_TARGETS, ROPE_SCALINGS, WEIGHT_QUANT,
                                     is_finite_number, is_positive_number)
from jaxformer.config.presets import PRESETS, bench, copy_task, llama, lm, tiny
from jaxformer.config.transformer import LEGACY_FIELDS, ConfigMixin, TransformerConfig

__all__ = ["TransformerConfig", "PRESETS", "tiny", "copy_task", "bench", "lm", "llama",
           "ConfigMixin", "LEGACY_FIELDS", "LORA_TARGETS", "ROPE_SCALINGS", "WEIGHT_QUANT",
           "is_finite_number", "is_positive_number"]

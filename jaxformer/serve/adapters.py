"""Fine-tuned runs of one base model as the engine's adapters (`Engine(adapters=...)`).

    tree = adapter_params(base_model, run_config, run_params)   # LoRA merged in

A LoRA run's adapters are folded into its weights (`nn.lora.merge_lora`: the
plain model then gives the adapted model's outputs, as `generate --run` does),
put in the base model's layer layout and, for a quantized base, quantized the
same way. A run of another model (other shapes) is refused with a ValueError
naming the first parameter that differs.
"""

from __future__ import annotations

import jax

from jaxformer.nn import stacking
from jaxformer.nn.lora import merge_lora


def adapter_params(base_model, run_config, run_params):
    """The parameters `run_params` (of `run_config`, LoRA or full fine-tune) in the
    structure of `base_model`'s (see the module docstring)."""
    config, params = merge_lora(run_config, run_params)
    params = stacking.to_layout(params, base_model.config.scan_layers)
    base = base_model.config
    if base.weight_quant is not None and config.weight_quant is None:
        from jaxformer.nn.quant_params import quantize_params  # noqa: PLC0415

        config, params = quantize_params(config, params, base.weight_quant,
                                         embed_quant=base.embed_quant,
                                         quant_layouts=base.quant_layouts)
    return params


def check_same_structure(base_params, params, name: str) -> None:
    """ValueError unless `params` has `base_params`' leaves with their shapes and dtypes."""
    def shapes(tree):
        return {jax.tree_util.keystr(path): (tuple(leaf.shape), str(leaf.dtype))
                for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}

    base, mine = shapes(base_params), shapes(params)
    for key in sorted(set(base) | set(mine)):
        if base.get(key) != mine.get(key):
            raise ValueError(f"{name} is not a fine-tune of the served model: parameter "
                             f"{key} is {mine.get(key, 'missing')} there, "
                             f"{base.get(key, 'missing')} in the base")

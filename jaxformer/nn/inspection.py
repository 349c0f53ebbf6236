"""Looking inside a model: treescope renderings, captured activations and attention weights.

    print(render(params))                       # the parameter tree, shapes and values
    logits, acts = capture(model, params, tokens_BT)
    acts["decoder/layers_0/__call__"]           # that layer's output
    acts["decoder/layers_0/self_attn/attention_weights"]   # (B, H, T, S)

`capture` is Flax's own machinery: `apply(..., capture_intermediates=...,
mutable="intermediates")` records each chosen module's output (its
`__call__`, or any method), next to what the layers `sow` (the attention
weights of the "einsum" implementation; fused kernels compute none). Keys are
module paths joined by "/", the last part the method or the sown name.
Shapes, in the package's dimension key:

    embed/__call__, encoder/positions/__call__     (B, T, D) / (B, S, D)
    decoder/layers_{i}/__call__                    ((B, T, D), cache or None): decoder layers
    encoder/layers_{i}/__call__                    (B, S, D)
    .../self_attn/__call__, .../ffn/__call__       (B, T, D)
    .../self_attn/attention_weights                (B, H, T, S); cross_attn: S = memory
    decoder/__call__                               ((B, T, V) logits, caches or None)

A scanned stack (`config.scan_layers`) records `layers/...` once with a leading
(L, ...) axis. The cached decode step: `decode.capture.capture_step`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import jax
from flax import linen as nn

Filter = Union[bool, Callable[[nn.Module, str], bool]]


def modules_named(*parts: str) -> Callable[[nn.Module, str], bool]:
    """A capture filter: the `__call__` outputs of modules whose path contains every
    one of `parts` (e.g. `modules_named("layers_1", "ffn")`)."""
    def keep(module: nn.Module, method: str) -> bool:
        path = "/".join(module.path)
        return method == "__call__" and all(p in path for p in parts)
    return keep


def flatten_intermediates(intermediates) -> dict[str, Any]:
    """Flax's nested "intermediates" collection as {"a/b/__call__": value}; a value
    recorded once is itself, several calls give the tuple of them."""
    flat = {}
    for path, value in jax.tree_util.tree_flatten_with_path(
            intermediates, is_leaf=lambda x: isinstance(x, tuple))[0]:
        keys = [str(p.key) for p in path if hasattr(p, "key")]
        flat["/".join(keys)] = value[0] if isinstance(value, tuple) and len(value) == 1 \
            else value
    return flat


def capture(model: nn.Module, params, *args, modules: Filter = True,
            method: Optional[Union[str, Callable]] = None, **kwargs) -> tuple[Any, dict]:
    """(the model's output, {path: captured value}) of `model.apply({"params": params},
    *args, **kwargs)`.

    `modules`: which module outputs to record: True (every module), False (only
    what is sown: attention weights), or a filter `f(module, method_name) -> bool`
    (`modules_named`). `method`: a method of the model to run instead of
    `__call__` (e.g. "encode").
    """
    apply_kwargs = {} if method is None else {"method": method}
    out, state = model.apply({"params": params}, *args, capture_intermediates=modules,
                             mutable="intermediates", **apply_kwargs, **kwargs)
    return out, flatten_intermediates(state.get("intermediates", {}))


def render(obj, *, html: bool = False) -> str:
    """`obj` (a parameter tree, a config, captured activations, a decode cache) as
    treescope renders it: text (default) or an HTML page for notebooks and files.
    In a notebook, `treescope.display(obj)` shows the same interactively."""
    try:
        import treescope  # noqa: PLC0415 - optional: the `inspect` extra
    except ImportError as error:
        raise ImportError("rendering needs treescope: pip install 'jaxformer[inspect]'"
                          ) from error
    if html:
        return treescope.render_to_html(obj)
    return treescope.render_to_text(obj)

"""Parameters from a flat `{name: array}` checkpoint, validated against the model.

A reader of any format (GGUF, CTranslate2, safetensors, a torch state dict)
yields names and arrays; a per-model mapping (`jaxformer.models`) renames and
reshapes them to jaxformer's names, "/"-joined paths of the parameter tree:

    encoder/layers_0/self_attn/query/kernel   (D, H, K)

`load_flat(model, flat)` checks the mapping against the tree that `model.init`
would build (shapes only: `jax.eval_shape`, nothing is computed) and returns
the nested params. Every problem is collected first and reported together in
one `CheckpointMismatch` (a ValueError): missing names, unexpected names,
wrong shapes, non-floating dtypes. `flatten(params)` is the inverse.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

SEP = "/"


class CheckpointMismatch(ValueError):
    """A checkpoint that does not fit the model; all problems at once.

    Attributes: missing, unexpected (lists of names), wrong_shape (name ->
    (got, expected)), wrong_dtype (name -> dtype), not_finite (names of tensors
    holding NaN or infinity).
    """

    def __init__(self, missing=(), unexpected=(), wrong_shape=(), wrong_dtype=(),
                 not_finite=()):
        self.missing, self.unexpected = list(missing), list(unexpected)
        self.wrong_shape, self.wrong_dtype = dict(wrong_shape), dict(wrong_dtype)
        self.not_finite = list(not_finite)
        lines = [f"checkpoint does not match the model: {len(self.missing)} missing, "
                 f"{len(self.unexpected)} unexpected, {len(self.wrong_shape)} wrong shape, "
                 f"{len(self.wrong_dtype)} wrong dtype"
                 + (f", {len(self.not_finite)} tensor(s) with NaN or infinite values"
                    if self.not_finite else "")]
        lines += [f"  missing:     {n}" for n in self.missing]
        lines += [f"  unexpected:  {n}" for n in self.unexpected]
        lines += [f"  wrong shape: {n} {got}, expected {want}"
                  for n, (got, want) in self.wrong_shape.items()]
        lines += [f"  wrong dtype: {n} {d} (a floating dtype is needed)"
                  for n, d in self.wrong_dtype.items()]
        lines += [f"  not finite:  {n}" for n in self.not_finite]
        super().__init__("\n".join(lines))


def flatten(params) -> dict[str, Any]:
    """Nested params -> {"a/b/kernel": leaf}."""
    return {SEP.join(str(getattr(k, "key", k)) for k in path): leaf
            for path, leaf in jax.tree_util.tree_leaves_with_path(params)}


def unflatten(flat: Mapping[str, Any]) -> dict:
    """{"a/b/kernel": leaf} -> nested dicts."""
    tree: dict = {}
    for name, leaf in flat.items():
        node = tree
        *parents, last = name.split(SEP)
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = leaf
    return tree


def abstract_params(model, *init_args) -> dict:
    """The shapes/dtypes `model.init(rng, *init_args)["params"]` would have, computed for free."""
    return jax.eval_shape(model.init, jax.random.PRNGKey(0), *init_args)["params"]


def check_flat(expected: Mapping[str, Any], flat: Mapping[str, Any]) -> None:
    """Raise `CheckpointMismatch` listing every difference between `flat` and `expected`
    (name -> something with `.shape`); return None if they match."""
    missing = sorted(set(expected) - set(flat))
    unexpected = sorted(set(flat) - set(expected))
    wrong_shape, wrong_dtype = {}, {}
    for name in sorted(set(expected) & set(flat)):
        got, want = tuple(np.shape(flat[name])), tuple(expected[name].shape)
        if got != want:
            wrong_shape[name] = (got, want)
        dtype = getattr(flat[name], "dtype", None) or np.asarray(flat[name]).dtype
        if not jnp.issubdtype(dtype, jnp.floating):
            wrong_dtype[name] = str(dtype)
    if missing or unexpected or wrong_shape or wrong_dtype:
        raise CheckpointMismatch(missing, unexpected, wrong_shape, wrong_dtype)


def load_flat(model, flat: Mapping[str, Any], *init_args, dtype=None,
              check_finite: bool = True) -> dict:
    """Validate a flat checkpoint against `model` and return its nested params.

    Args:
      model: the Flax module (e.g. `Transformer(config)`).
      flat: {"encoder/layers_0/...": array} in jaxformer's names and layouts.
      init_args: example inputs for `model.init` (shapes only); default: (1, 1)
        int32 token ids for each positional input of `__call__` (a `Transformer`
        takes src and tgt, a `DecoderOnlyLM` tokens).
      dtype: cast every array to it; default: `model.config.param_dtype`.
      check_finite: refuse NaN or infinite weights (False skips the check).
    Raises:
      CheckpointMismatch (ValueError) with all missing / unexpected / wrong-shape /
      wrong-dtype names together, before any array is converted; or naming every
      tensor that holds NaN or infinity.
    """
    if not init_args:
        ids = jax.ShapeDtypeStruct((1, 1), jnp.int32)
        init_args = (ids,) if type(model).__name__ == "DecoderOnlyLM" else (ids, ids)
    expected = flatten(abstract_params(model, *init_args))
    check_flat(expected, flat)
    if check_finite:
        bad = sorted(name for name in expected if not np.isfinite(np.asarray(flat[name])).all())
        if bad:
            raise CheckpointMismatch(not_finite=bad)
    dtype = jnp.dtype(model.config.param_dtype if dtype is None else dtype)
    return unflatten({name: jnp.asarray(flat[name], dtype) for name in expected})

"""The flat name->array loader: round trip, and one report listing every mismatch."""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.interop import flat as flat_lib


def test_round_trip_gives_the_same_model(make_transformer, tokens):
    model, params = make_transformer(jf.tiny(attention_biases="qvo"))
    flat = {k: np.asarray(v, np.float16).astype(np.float32)
            for k, v in flat_lib.flatten(params).items()}
    loaded = flat_lib.load_flat(model, flat)
    src, tgt = tokens(0, (2, 5)), tokens(1, (2, 3))
    want = model.apply({"params": flat_lib.unflatten({k: jnp.asarray(v)
                                                      for k, v in flat.items()})}, src, tgt)
    np.testing.assert_array_equal(model.apply({"params": loaded}, src, tgt), want)
    assert set(flat_lib.flatten(loaded)) == set(flat_lib.flatten(params))


def test_float16_arrays_are_cast_to_the_param_dtype(make_lm):
    model, params = make_lm(jf.tiny(num_encoder_layers=0))
    flat = {k: np.asarray(v, np.float16) for k, v in flat_lib.flatten(params).items()}
    loaded = flat_lib.load_flat(model, flat)
    assert {x.dtype for x in flat_lib.flatten(loaded).values()} == {jnp.dtype("float32")}


def test_every_mismatch_is_reported_together(make_transformer):
    model, params = make_transformer(jf.tiny())
    flat = {k: np.asarray(v) for k, v in flat_lib.flatten(params).items()}
    del flat["decoder/out_proj/bias"]
    del flat["encoder/layers_1/ffn/wi/kernel"]
    flat["encoder/layers_0/self_attn/query/kernel"] = np.zeros((32, 4, 7), np.float32)
    flat["decoder/layers_0/ffn/wo/bias"] = np.zeros((32,), np.int32)
    flat["encoder/extra/kernel"] = np.zeros((2,), np.float32)
    with pytest.raises(flat_lib.CheckpointMismatch) as info:
        flat_lib.load_flat(model, flat)
    err = info.value
    assert err.missing == ["decoder/out_proj/bias", "encoder/layers_1/ffn/wi/kernel"]
    assert err.unexpected == ["encoder/extra/kernel"]
    assert err.wrong_shape == {"encoder/layers_0/self_attn/query/kernel": ((32, 4, 7),
                                                                            (32, 4, 8))}
    assert err.wrong_dtype == {"decoder/layers_0/ffn/wo/bias": "int32"}
    text = str(err)
    for name in ("decoder/out_proj/bias", "encoder/extra/kernel", "(32, 4, 7)", "int32"):
        assert name in text
    assert isinstance(err, ValueError)


def test_nan_or_infinite_weights_are_refused_by_name_unless_asked():
    model = jf.Transformer(jf.tiny())
    flat = {name: np.ones(s.shape, np.float32)
            for name, s in flat_lib.flatten(flat_lib.abstract_params(
                model, jnp.ones((1, 1), jnp.int32), jnp.ones((1, 1), jnp.int32))).items()}
    names = sorted(flat)
    flat[names[0]] = np.full_like(flat[names[0]], np.nan)
    flat[names[1]] = np.full_like(flat[names[1]], np.inf)
    flat[names[2]] = flat[names[2]].copy()
    flat[names[2]].flat[-1] = -np.inf  # one element of -inf
    with pytest.raises(flat_lib.CheckpointMismatch, match="3 tensor") as info:
        flat_lib.load_flat(model, flat)
    assert all(name in str(info.value) for name in names[:3])
    params = flat_lib.load_flat(model, flat, check_finite=False)
    assert np.isnan(np.asarray(flat_lib.flatten(params)[names[0]])).all()

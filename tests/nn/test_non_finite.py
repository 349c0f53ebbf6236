"""The non-finite checks let neither NaN nor +inf nor -inf through: parameters before
decoding (`checks.check_finite_params`) and safetensors tensors as they are read.
(GGUF and flat checkpoints: tests/interop; the learning rate: tests/train.)"""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.nn.checks import check_finite_params

BAD = {"nan": np.nan, "+inf": np.inf, "-inf": -np.inf}


def tree(**bad):
    """A small params tree; `bad` = {leaf name: value put at one element}."""
    leaves = {"a": np.ones((2, 3), np.float32), "b": np.ones((4,), np.float32),
              "c": jnp.ones((3,), jnp.bfloat16), "steps": np.arange(3)}
    for name, value in bad.items():
        leaves[name] = jnp.asarray(leaves[name]).at[(1,) * leaves[name].ndim].set(value)
    return {"layer": leaves}


@pytest.mark.parametrize("value", list(BAD), ids=list(BAD))
@pytest.mark.parametrize("leaf", ["a", "c"], ids=["float32", "bfloat16"])
def test_each_non_finite_value_is_refused_naming_the_leaf(value, leaf):
    with pytest.raises(ValueError, match=rf"NaN or inf values in \['layer'\]\['{leaf}'\]"):
        check_finite_params(tree(**{leaf: BAD[value]}))


def test_all_three_are_named_and_finite_params_pass():
    with pytest.raises(ValueError) as info:
        check_finite_params(tree(a=np.inf, b=-np.inf, c=np.nan))
    assert all(f"['{name}']" in str(info.value) for name in "abc")
    check_finite_params(tree())  # large but finite values are fine
    check_finite_params({"x": np.full((2,), np.finfo(np.float32).max)})


@pytest.mark.parametrize("value", list(BAD), ids=list(BAD))
def test_a_safetensors_tensor_holding_it_is_refused_unless_asked(tmp_path, value):
    safetensors_numpy = pytest.importorskip("safetensors.numpy", reason="needs the `llm` extra")
    from jaxformer.errors import FileFormatError
    from jaxformer.interop.safetensors import read_safetensors

    good = np.ones((2, 3), np.float32)
    bad = good.copy()
    bad[1, 2] = BAD[value]
    path = str(tmp_path / "model.safetensors")
    safetensors_numpy.save_file({"good": good, "bad": bad}, path)
    checkpoint = read_safetensors(path)
    with pytest.raises(FileFormatError, match="'bad' holds NaN or infinite"):
        checkpoint.array("bad")
    np.testing.assert_array_equal(checkpoint.array("good"), good)
    np.testing.assert_array_equal(checkpoint.array("bad", check_finite=False), bad)


def test_jax_arrays_that_passed_are_not_checked_again_but_new_ones_are(monkeypatch):
    """`generate` checks its params on every call: jax arrays are immutable, so ones that
    passed once skip the device pass (nothing is fetched to the host); a new NaN array
    beside them, or a numpy array written in place, is still refused."""
    import jax  # noqa: PLC0415

    params = {"w": jnp.ones((3,)), "q": jnp.ones((2,), jnp.int8), "n": np.ones(2, np.float32)}
    check_finite_params({k: params[k] for k in "wq"})
    fetch = jax.device_get
    with monkeypatch.context() as m:
        m.setattr(jax, "device_get", lambda *_: pytest.fail("checked again"))
        check_finite_params({k: params[k] for k in "wq"})  # known: no pass at all
    assert jax.device_get is fetch
    with pytest.raises(ValueError, match=r"\['bad'\]"):
        check_finite_params({**params, "bad": jnp.asarray([1.0, np.nan])})
    check_finite_params(params)
    params["n"][1] = np.inf  # numpy: written in place after passing
    with pytest.raises(ValueError, match=r"\['n'\]"):
        check_finite_params(params)

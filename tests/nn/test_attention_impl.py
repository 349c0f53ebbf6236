"""attention_impl="jax" (jax.nn.dot_product_attention) is a drop-in for "einsum"."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_jax_attention_matches_einsum(norm):
    config = jf.tiny(norm=norm)
    src = jnp.array([[5, 6, 7, 0], [0, 0, 0, 0]])  # second row: all PAD
    tgt = jnp.array([[1, 5, 6], [1, 3, 4]])
    params = jf.Transformer(config).init(jax.random.key(0), src, tgt)
    einsum = jf.Transformer(config).apply(params, src, tgt)
    fused, state = jf.Transformer(config.replace(attention_impl="jax")).apply(
        params, src, tgt, mutable="intermediates")
    assert jf.attention_weights(state.get("intermediates", {})) == {}  # the fused path ran
    assert np.isfinite(np.asarray(fused)).all()
    np.testing.assert_allclose(fused, einsum, atol=1e-5)


def test_jax_attention_refuses_attention_dropout():
    with pytest.raises(ValueError, match="attention_impl"):
        jf.tiny(attention_impl="jax", attention_dropout=0.1)

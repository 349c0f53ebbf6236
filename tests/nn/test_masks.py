"""Masks: golden boolean arrays, written out by hand (True = may attend)."""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf

T, F = True, False


def check(mask, expected):
    assert mask.dtype == jnp.bool_
    np.testing.assert_array_equal(np.asarray(mask), np.array(expected, dtype=bool))


def test_padding_mask():
    src = jnp.array([[5, 6, 7, 0], [0, 4, 0, 9]])
    check(jf.padding_mask(src), [[[[T, T, T, F]]], [[[F, T, F, T]]]])


def test_padding_mask_other_pad_id():
    check(jf.padding_mask(jnp.array([[3, 0, 3, 1]]), pad_id=3), [[[[F, T, F, T]]]])


def test_causal_mask():
    check(jf.causal_mask(3), [[[[T, F, F],
                                [T, T, F],
                                [T, T, T]]]])
    check(jf.causal_mask(1), [[[[T]]]])


def test_cross_mask():
    tgt = jnp.array([[1, 5, 6], [1, 4, 0]])  # target PAD does not hide source keys
    src = jnp.array([[5, 6, 7, 0], [8, 0, 0, 0]])
    check(jf.cross_mask(tgt, src), [[[[T, T, T, F],
                                      [T, T, T, F],
                                      [T, T, T, F]]],
                                    [[[T, F, F, F],
                                      [T, F, F, F],
                                      [T, F, F, F]]]])


def test_decoder_self_mask():
    tgt = jnp.array([[1, 5, 0, 0], [1, 4, 6, 7]])
    check(jf.decoder_self_mask(tgt), [[[[T, F, F, F],
                                        [T, T, F, F],
                                        [T, T, F, F],
                                        [T, T, F, F]]],
                                      [[[T, F, F, F],
                                        [T, T, F, F],
                                        [T, T, T, F],
                                        [T, T, T, T]]]])


def test_combine_masks():
    pad = jf.padding_mask(jnp.array([[4, 0, 5]]))
    combined = jf.combine_masks(pad, None, jf.causal_mask(3))
    check(combined, [[[[T, F, F],
                       [T, F, F],
                       [T, F, T]]]])
    check(jf.combine_masks(pad), [[[[T, F, T]]]])


@pytest.mark.parametrize("masks", [(), (None,), (None, None)], ids=["none", "one_none",
                                                                      "two_none"])
def test_combine_nothing_is_none(masks):
    assert jf.combine_masks(*masks) is None


def test_docstring_worked_example():
    src = jnp.array([[5, 6, 7, 0]])
    tgt = jnp.array([[1, 5, 6]])
    check(jf.cross_mask(tgt, src), [[[[T, T, T, F]] * 3]])
    assert jf.padding_mask(src).shape == (1, 1, 1, 4)
    assert jf.causal_mask(3).shape == (1, 1, 3, 3)

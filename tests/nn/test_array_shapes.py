"""Public functions of `jaxformer.nn` that take arrays check their shapes against
each other before tracing: one ValueError naming the argument and the expected
shape (issue 47), also under `jax.jit` (shapes are static)."""

import jax
import jax.numpy as jnp
import pytest

from jaxformer.nn import attention, masks
from jaxformer.nn.blockwise import blockwise_attention
from jaxformer.nn.mask_structure import MaskSpec, dense_mask

B, H, G, T, S, K = 2, 4, 2, 8, 12, 16
Q = jnp.zeros((B, H, T, K))
KV_ = jnp.zeros((B, G, S, K))
SEG_T, SEG_S = jnp.ones((B, T), jnp.int32), jnp.ones((B, S), jnp.int32)


def _spec(**fields):
    return MaskSpec(**({"q_segment_ids": SEG_T, "kv_segment_ids": SEG_S} | fields))


def _blockwise(query=Q, key=KV_, value=KV_, mask=None):
    return lambda: blockwise_attention(query, key, value, mask, block_q=4, block_k=4)


CASES = {
    # blockwise_attention: segment ids, positions, lengths, the tensors
    "segments-shorter": (_blockwise(mask=_spec(kv_segment_ids=SEG_S[:, :-3])),
                         r"mask\.kv_segment_ids must have shape \(1\|2, 12\)"),
    "segments-longer": (_blockwise(mask=_spec(q_segment_ids=jnp.ones((B, T + 5), jnp.int32))),
                        r"mask\.q_segment_ids must have shape \(1\|2, 8\)"),
    "segments-batch": (_blockwise(mask=_spec(kv_segment_ids=jnp.ones((3, S), jnp.int32))),
                       r"mask\.kv_segment_ids .* got \(3, 12\)"),
    "segments-1d": (_blockwise(mask=_spec(q_segment_ids=jnp.ones((T,), jnp.int32))),
                    r"mask\.q_segment_ids must have shape \(1\|2, 8\)"),
    "positions": (_blockwise(mask=MaskSpec(q_positions=jnp.zeros((B, T), jnp.int32),
                                           kv_positions=jnp.zeros((B, T), jnp.int32))),
                  r"mask\.kv_positions must have shape \(1\|2, 12\)"),
    "kv-lengths": (_blockwise(mask=MaskSpec(kv_lengths=jnp.full((3,), S))),
                   r"mask\.kv_lengths must have shape \(1\|2,\)"),
    "q-lengths-2d": (_blockwise(mask=MaskSpec(q_lengths=jnp.full((B, 1), T))),
                     r"mask\.q_lengths must have shape \(1\|2,\)"),
    "prefix": (_blockwise(mask=MaskSpec(causal=True, prefix_length=jnp.zeros((5,), jnp.int32))),
               r"mask\.prefix_length must have shape \(1\|2,\)"),
    "q-offset": (_blockwise(mask=MaskSpec(q_offset=jnp.zeros((B,), jnp.int32))),
                 r"mask\.q_offset must have shape \(\)"),
    "query-3d": (_blockwise(query=Q[0]), r"query_BHTK must have shape \(\*, \*, \*, \*\)"),
    "key-batch": (_blockwise(key=KV_[:1], value=KV_[:1]),
                  r"key_BGSK must have shape \(2, \*, \*, 16\)"),
    "key-depth": (_blockwise(key=KV_[..., :8], value=KV_[..., :8]),
                  r"key_BGSK must have shape \(2, \*, \*, 16\)"),
    "value-length": (_blockwise(value=KV_[:, :, :5]), r"value_BGSK must have shape \(2, 2, 12, 16\)"),
    # dense_mask
    "dense-mask": (lambda: dense_mask(_spec(), T, S + 1),
                   r"spec\.kv_segment_ids must have shape \(1\|2, 13\)"),
    # dot_product_attention
    "dense-key-depth": (lambda: attention.dot_product_attention(Q, KV_[..., :8], KV_[..., :8]),
                        r"key_BHSK must have shape \(2, 2, \*, 16\)"),
    "dense-value": (lambda: attention.dot_product_attention(Q, KV_, KV_[:, :, :3]),
                    r"value_BHSK must have shape \(2, 2, 12, 16\)"),
    "dense-part": (lambda: attention.dot_product_attention(Q, (KV_, KV_[:1]), (KV_, KV_[:1])),
                   r"key_BHSK\[1\] must have shape \(2, 2, \*, 16\)"),
    "dense-mask-keys": (lambda: attention.dot_product_attention(Q, KV_, KV_,
                                                                jnp.ones((B, 1, T, S - 1), bool)),
                        r"mask must have shape \(1\|2, 1\|4, 1\|8, 1\|12\)"),
    "dense-mask-3d": (lambda: attention.dot_product_attention(Q, KV_, KV_, jnp.ones((B, T, S), bool)),
                      r"mask must have shape"),
    # masks
    "padding-1d": (lambda: masks.padding_mask(jnp.ones((S,), jnp.int32)),
                   r"tokens_BS must have shape \(\*, \*\)"),
    "cross-batch": (lambda: masks.cross_mask(SEG_T, jnp.ones((3, S), jnp.int32)),
                    r"src_BS must have shape \(2, \*\)"),
    "decoder-self-3d": (lambda: masks.decoder_self_mask(jnp.ones((B, T, 1), jnp.int32)),
                        r"tgt_BT must have shape \(\*, \*\)"),
    "combine-rank": (lambda: masks.combine_masks(masks.causal_mask(T), jnp.ones((T, T), bool)),
                     r"masks\[1\] must have shape \(\*, \*, \*, \*\)"),
    "combine-broadcast": (lambda: masks.combine_masks(masks.causal_mask(T), masks.causal_mask(S)),
                          r"masks do not broadcast together"),
}


@pytest.mark.parametrize("call, message", CASES.values(), ids=CASES.keys())
def test_a_bad_shape_is_one_value_error_naming_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_a_dense_mask_is_not_a_mask_spec():
    with pytest.raises(TypeError, match="mask must be a MaskSpec or None, got"):
        _blockwise(mask=jnp.ones((B, 1, T, S), bool))()


def test_the_checks_run_when_tracing_under_jit():
    bad = _spec(kv_segment_ids=SEG_S[:, :-3])
    attend = jax.jit(lambda q, k, v, m: blockwise_attention(q, k, v, m, block_q=4, block_k=4))
    with pytest.raises(ValueError, match=r"mask\.kv_segment_ids must have shape \(1\|2, 12\)"):
        attend(Q, KV_, KV_, bad)
    good = attend(Q, KV_, KV_, _spec())  # and a good spec still runs
    assert good.shape == (B, H, T, K)


def test_good_shapes_pass_broadcast_rows_included():
    spec = MaskSpec(causal=True, q_segment_ids=SEG_T[:1], kv_segment_ids=SEG_S[:1],
                    kv_lengths=jnp.full((1,), S), q_lengths=jnp.asarray(T), prefix_length=2,
                    q_offset=jnp.asarray(S - T))
    out = blockwise_attention(Q, KV_, KV_, spec, block_q=4, block_k=4)
    dense, _ = attention.dot_product_attention(Q, KV_, KV_, dense_mask(spec, T, S))
    assert jnp.allclose(out, dense, atol=1e-6)


def test_slots_and_ring_writes_name_the_argument():
    from jaxformer.nn.layers import ring_write  # noqa: PLC0415

    with pytest.raises(ValueError, match=r"key_slots_S must have shape \(\*,\)"):
        masks.sliding_window_mask(jnp.arange(T), jnp.arange(S)[None], 4)
    ring = jnp.zeros((B, G, 4, K))
    with pytest.raises(ValueError, match=r"new must have shape \(2, 2, \*, 16\)"):
        ring_write(ring, jnp.zeros((B, G, 1, 8)), jnp.asarray(0), axis=2)
    assert ring_write(ring, jnp.ones((B, G, 1, K)), jnp.asarray(5), axis=2)[:, :, 1].all()


def test_splash_and_rope_name_the_argument():
    from jaxformer.nn.rope import apply_rope  # noqa: PLC0415
    from jaxformer.nn.splash import splash_attention  # noqa: PLC0415

    # Checked before the TPU kernels load, so on any backend.
    with pytest.raises(ValueError, match=r"value_BGSK must have shape \(2, 2, 12, 16\)"):
        splash_attention(Q, KV_, KV_[:, :, :4])
    with pytest.raises(ValueError, match=r"mask\.kv_segment_ids must have shape \(1\|2, 12\)"):
        splash_attention(Q, KV_, KV_, _spec(kv_segment_ids=SEG_S[:, :4]))
    x = jnp.ones((B, T, H, K))
    with pytest.raises(ValueError, match=r"positions_BT must have shape \(1\|2, 8\)"):
        apply_rope(x, jnp.arange(T), 1e4, "half")
    with pytest.raises(ValueError, match=r"positions_BT must have shape \(1\|2, 8\)"):
        apply_rope(x, jnp.zeros((B, T + 1), jnp.int32), 1e4, "half")
    with pytest.raises(ValueError, match=r"inv_freq must have shape \(8,\)"):
        apply_rope(x, jnp.arange(T)[None], None, "half", inv_freq=jnp.ones(4))
    assert apply_rope(x, jnp.arange(T)[None], 1e4, "half").shape == x.shape

"""LoRA's scale stated by hand: an adapted projection is x W + (alpha / rank) x A B
(`jaxformer.nn.lora`), with rank != alpha so that alpha / rank and rank / alpha differ.
(Inert untrained adapters, merging and training: tests/train/test_finetune.py.)"""

import jax
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.nn import lora
from jaxformer.nn.layers import FeedForward


@pytest.mark.parametrize("rank,alpha", [(2, 6.0), (4, 1.0), (3, None)],
                         ids=["alpha_over_rank_3", "alpha_over_rank_quarter", "alpha_none"])
def test_adapted_projection_is_base_plus_alpha_over_rank_times_x_a_b(rank, alpha):
    config = jf.tiny(d_model=8, d_ff=12, lora_rank=rank, lora_alpha=alpha,
                     lora_targets=("up",))
    scale = (rank if alpha is None else alpha) / rank
    assert config.lora_scale == scale
    ffn = FeedForward(config)
    x = np.random.default_rng(0).normal(size=(1, 5, 8)).astype(np.float32)
    params = jax.tree_util.tree_map(np.asarray, ffn.init(jax.random.PRNGKey(0), x)["params"])
    r = np.random.default_rng(1)
    a, b = r.normal(size=(8, rank)), r.normal(size=(rank, 12))  # B non-zero: a trained adapter
    params["wi_lora"] = {"a": a.astype(np.float32), "b": b.astype(np.float32)}
    got = np.asarray(ffn.apply({"params": params}, x))

    x64 = x.astype(np.float64)
    wi, wo = params["wi"], params["wo"]
    up = x64 @ wi["kernel"] + wi["bias"] + scale * (x64 @ a @ b)
    want = np.maximum(up, 0.0) @ wo["kernel"] + wo["bias"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # merge_lora folds the same scale into the kernel
    plain, merged = lora.merge_lora(config, {"ffn": params})
    np.testing.assert_allclose(merged["ffn"]["wi"]["kernel"], wi["kernel"] + scale * (a @ b),
                               rtol=1e-5, atol=1e-5)
    assert plain.lora_rank == 0 and "wi_lora" not in merged["ffn"]

"""QLoRA: LoRA adapters trained on a quantized, frozen base (`config.weight_quant` with
`config.lora_rank > 0`). The reference is LoRA on the float model whose kernels are
the dequantized base (`dequantize_params`): the same function, so the same losses
step by step within float rounding; the integer leaves never change; `merge_lora`
gives the float model of the adapted function."""

import os
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.nn import lora
from jaxformer.nn.quant_params import dequantize_params, quantize_params
from jaxformer.text import ByteTokenizer
from jaxformer.train import TrainConfig, evaluate_lm, fit
from jaxformer.train.data import TextData

CONFIG = jf.llama(d_model=64, num_heads=4, num_kv_heads=2, d_ff=128, tgt_vocab_size=259,
                  src_vocab_size=259, max_len=32, scan_layers=True)
JSON = os.path.join(sysconfig.get_paths()["stdlib"], "json")
TRAIN = TrainConfig(task="lm", data=(os.path.join(JSON, "[ds]*.py"),),
                    seq_len=32, steps=8, batch_size=4, warmup_steps=0, learning_rate=3e-2)
LORA = dict(lora_rank=4, lora_alpha=8.0, lora_targets=("q", "v", "o", "down"))


@pytest.fixture(scope="module")
def base(make_lm):
    return make_lm(CONFIG, seed=3)


def held_out(config, params, data):
    return evaluate_lm(jf.DecoderOnlyLM(config), params, data, batch_size=8)["loss"]


def run(config, params):
    """(trained params, training losses, held-out loss before and after)."""
    data = TextData(TRAIN.data, ByteTokenizer(), TRAIN.seq_len, seed=0,
                    eval_patterns=[os.path.join(JSON, "tool.py")])
    adapted = config.replace(**LORA)
    result = fit(adapted, TRAIN, data=data, init_params=params, progress=False, log_every=1)
    trained = result.state.params
    return (trained, [float(h["loss"]) for h in result.history],
            (held_out(config, jf.stack_layers(params), data), held_out(adapted, trained, data)))


@pytest.fixture(scope="module", params=["int8", "int4"])
def trained(request, base):
    _, params = base
    qconfig, qparams = quantize_params(CONFIG, params, request.param)
    fconfig, fparams = dequantize_params(qconfig, qparams)
    return qconfig, qparams, run(qconfig, qparams), run(fconfig, fparams)


def test_qlora_losses_fall_and_equal_lora_on_the_dequantized_base(trained):
    _, _, (_, q_losses, (before, after)), (_, f_losses, f_held_out) = trained
    assert len(q_losses) == TRAIN.steps
    assert after < before - 0.1, (before, after)
    # The first steps agree to float rounding; Adam's normalised updates let the
    # rounding of int8's (x q) s against x (q s) grow a little over the steps.
    np.testing.assert_allclose(q_losses[:3], f_losses[:3], rtol=2e-6)
    np.testing.assert_allclose(q_losses, f_losses, rtol=1e-4)
    np.testing.assert_allclose((before, after), f_held_out, rtol=1e-4)


def test_only_the_adapters_train_and_the_integers_stay(trained):
    qconfig, qparams, (params, _, _), _ = trained
    adapters, frozen = lora.split_adapters(params)
    flat_q = jax.tree_util.tree_leaves_with_path(qparams)
    flat_frozen = dict(jax.tree_util.tree_leaves_with_path(frozen))
    assert len(flat_frozen) == len(flat_q)
    for path, value in flat_q:
        assert flat_frozen[path].dtype == value.dtype
        np.testing.assert_array_equal(np.asarray(flat_frozen[path]), np.asarray(value))
    assert any(np.any(np.asarray(b) != 0) for b in
               jax.tree_util.tree_leaves({k: v for k, v in adapters.items()}))  # B moved


def test_merge_lora_gives_the_float_model_of_the_adapted_function(trained):
    qconfig, _, (params, _, _), _ = trained
    adapted = qconfig.replace(**LORA)
    tokens = jnp.asarray(np.random.default_rng(4).integers(3, 259, (2, 16)), jnp.int32)
    want = jf.DecoderOnlyLM(adapted).apply({"params": params}, tokens)
    plain, merged = lora.merge_lora(adapted, params)
    assert plain.weight_quant is None and plain.embed_quant is None and plain.lora_rank == 0
    assert all(np.asarray(x).dtype == np.float32 for x in jax.tree_util.tree_leaves(merged))
    got = jf.DecoderOnlyLM(plain).apply({"params": merged}, tokens)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)

"""TransformerConfig: validation names the field; presets build; JSON round trip."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest

import jaxformer as jf
from jaxformer import TransformerConfig

# name -> (overrides of tiny(), the field the error must name)
INVALID = {
    "d_model_not_divisible_by_heads": (dict(d_model=30, num_heads=4), "d_model"),
    "zero_d_model": (dict(d_model=0), "d_model"),
    "float_d_model": (dict(d_model=32.0), "d_model"),
    "negative_src_vocab": (dict(src_vocab_size=-3), "src_vocab_size"),
    "zero_tgt_vocab": (dict(tgt_vocab_size=0), "tgt_vocab_size"),
    "zero_heads": (dict(num_heads=0), "num_heads"),
    "zero_d_ff": (dict(d_ff=0), "d_ff"),
    "zero_max_len": (dict(max_len=0), "max_len"),
    "negative_encoder_layers": (dict(num_encoder_layers=-1), "num_encoder_layers"),
    "zero_decoder_layers": (dict(num_decoder_layers=0), "num_decoder_layers"),
    "unknown_norm": (dict(norm="middle"), "norm"),
    "unknown_activation": (dict(activation="swish"), "activation"),
    "unknown_encoder_positions": (dict(encoder_positions="rotary"), "encoder_positions"),
    "unknown_decoder_positions": (dict(decoder_positions="alibi"), "decoder_positions"),
    "unknown_dtype": (dict(dtype="float64"), "dtype"),
    "unknown_param_dtype": (dict(param_dtype="int8"), "param_dtype"),
    "attention_dropout_one": (dict(attention_dropout=1.0), "attention_dropout"),
    "residual_dropout_negative": (dict(residual_dropout=-0.1), "residual_dropout"),
    "embedding_dropout_above_one": (dict(embedding_dropout=1.5), "embedding_dropout"),
    "ffn_dropout_one": (dict(ffn_dropout=1.0), "ffn_dropout"),
    "zero_layer_norm_epsilon": (dict(layer_norm_epsilon=0.0), "layer_norm_epsilon"),
    "share_with_different_vocabs": (dict(share_embeddings=True, tgt_vocab_size=20),
                                    "share_embeddings"),
    "pad_equals_bos": (dict(pad_id=1, bos_id=1), "pad_id"),
    "bos_equals_eos": (dict(bos_id=2, eos_id=2), "pad_id"),  # the message names all three
    "negative_pad": (dict(pad_id=-1), "pad_id"),
    "attention_biases_unknown_letter": (dict(attention_biases="qx"), "attention_biases"),
    "attention_biases_repeated": (dict(attention_biases="qq"), "attention_biases"),
    "eos_outside_vocab": (dict(eos_id=16), "eos_id"),
    "bos_outside_smaller_tgt_vocab": (dict(src_vocab_size=50, tgt_vocab_size=5, bos_id=7),
                                      "bos_id"),
    "kv_heads_not_dividing_heads": (dict(num_heads=4, num_kv_heads=3), "num_kv_heads"),
    "zero_kv_heads": (dict(num_kv_heads=0), "num_kv_heads"),
    "kv_heads_above_heads": (dict(num_heads=4, num_kv_heads=8), "num_kv_heads"),
    "odd_head_dim_with_rope": (dict(d_model=28, num_heads=4, rope="half"), "rope"),
    "unknown_rope_layout": (dict(rope="neox"), "rope"),
    "zero_rope_theta": (dict(rope="half", rope_theta=0.0), "rope_theta"),
    # non-finite numbers (issue 47): NaN fails every comparison, infinity passes "> 0"
    "infinite_rope_theta": (dict(rope="half", rope_theta=float("inf")), "rope_theta"),
    "nan_rope_theta": (dict(rope="half", rope_theta=float("nan")), "rope_theta"),
    "infinite_layer_norm_epsilon": (dict(layer_norm_epsilon=float("inf")),
                                    "layer_norm_epsilon"),
    "infinite_query_scale": (dict(query_scale=float("inf")), "query_scale"),
    "infinite_softcap": (dict(final_logit_softcapping=float("inf")),
                         "final_logit_softcapping"),
    "infinite_rope_scaling_factor": (dict(rope_scaling="linear",
                                          rope_scaling_factor=float("inf")),
                                     "rope_scaling_factor"),
    "infinite_llama3_high_freq": (dict(rope_scaling="llama3", rope_original_max_len=8,
                                       rope_high_freq_factor=float("inf")),
                                  "rope_low_freq_factor"),
    "infinite_lora_alpha": (dict(lora_rank=2, lora_alpha=float("inf")), "lora_alpha"),
    "nan_dropout": (dict(residual_dropout=float("nan")), "residual_dropout"),
    "bool_rope_theta": (dict(rope="half", rope_theta=True), "rope_theta"),
    "unknown_norm_type": (dict(norm_type="batchnorm"), "norm_type"),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_config_raises_naming_the_field(case):
    overrides, field = INVALID[case]
    with pytest.raises(ValueError, match=rf"TransformerConfig\.{field}\b"):
        jf.tiny(**overrides)


@pytest.mark.parametrize("overrides", [
    dict(attention_dropout=0.0, residual_dropout=0.99),
    dict(num_encoder_layers=0),
    dict(d_model=30, num_heads=6),
    dict(d_model=7, num_heads=7),
    dict(pad_id=15, bos_id=0, eos_id=14),
    dict(share_embeddings=True, tie_output_embedding=True),
    dict(d_model=28, num_heads=4),  # odd head dim is fine without RoPE
    dict(num_kv_heads=1, rope="interleaved", decoder_positions="none"),
], ids=["dropout_bounds", "no_encoder", "d30_h6", "d7_h7", "ids_at_vocab_edges",
        "share_and_tie", "odd_head_dim_without_rope", "multi_query_rope_only"])
def test_valid_edge_cases_are_accepted(overrides):
    config = jf.tiny(**overrides)
    for name, value in overrides.items():
        assert getattr(config, name) == value


def test_from_dict_refuses_unknown_keys_by_name():
    values = jf.tiny().to_dict() | {"d_modle": 64, "heads": 2}
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['d_modle', 'heads'\]"):
        TransformerConfig.from_dict(values)


def test_json_round_trip_is_exact():
    config = jf.copy_task(norm="pre", activation="gelu", tie_output_embedding=True,
                          dtype="bfloat16")
    assert TransformerConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_frozen_and_hashable_so_it_can_be_a_static_jit_argument():
    config = jf.tiny()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.d_model = 8
    assert hash(config) == hash(jf.tiny()) and config == jf.tiny()
    assert config != jf.tiny(d_model=64)
    f = jax.jit(lambda x, c: x * c.d_model, static_argnums=1)
    assert float(f(jnp.float32(1.0), config)) == 32.0


def test_replace_validates_too():
    with pytest.raises(ValueError, match="num_heads"):
        jf.tiny().replace(num_heads=-2)


@pytest.mark.parametrize("norm,final_norm,expected", [
    ("post", None, False), ("pre", None, True), ("post", True, True), ("pre", False, False)])
def test_use_final_norm(norm, final_norm, expected):
    assert jf.tiny(norm=norm, final_norm=final_norm).use_final_norm is expected


def test_derived_values():
    config = jf.tiny(d_model=48, num_heads=6, dtype="bfloat16")
    assert config.head_dim == 8
    assert config.compute_dtype == jnp.bfloat16 and config.params_dtype == jnp.float32


@pytest.mark.parametrize("name", sorted(jf.PRESETS))
def test_every_preset_builds_and_initialises_abstractly(name):
    config = jf.PRESETS[name]()
    assert isinstance(config, TransformerConfig)
    src = jax.ShapeDtypeStruct((2, config.max_len), jnp.int32)
    tgt = jax.ShapeDtypeStruct((2, config.max_len), jnp.int32)
    params = jax.eval_shape(jf.Transformer(config).init, jax.random.PRNGKey(0), src, tgt)
    params = params["params"]
    assert params["src_embed"]["embedding"].shape == (config.src_vocab_size, config.d_model)
    assert len([k for k in params["encoder"] if k.startswith("layers_")]) == \
        config.num_encoder_layers
    assert params["decoder"]["layers_0"]["ffn"]["wi"]["kernel"].shape == (
        config.d_model, config.d_ff)
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(params))
    logits = jax.eval_shape(jf.Transformer(config).apply, {"params": params}, src, tgt)
    assert logits.shape == (2, config.max_len, config.tgt_vocab_size)
    # The same preset as a decoder-only LM.
    lm = jf.DecoderOnlyLM(config.replace(num_encoder_layers=0))
    lm_params = jax.eval_shape(lm.init, jax.random.PRNGKey(0), tgt)["params"]
    assert set(lm_params) == {"embed", "decoder"}


def test_presets_take_overrides():
    assert jf.bench(num_heads=4).num_heads == 4
    with pytest.raises(ValueError, match="d_model"):
        jf.bench(num_heads=7)


def test_run_directories_saved_with_the_old_kernel_grad_field_still_load():
    saved = {**jf.tiny().to_dict(), "kernel_grad": "layout"}
    del saved["cpu_tuning"]
    assert jf.TransformerConfig.from_dict(saved) == jf.tiny()
    with pytest.raises(ValueError, match="unknown field"):
        jf.TransformerConfig.from_dict({**jf.tiny().to_dict(), "kernel_grads": "layout"})


def test_cpu_tuning_is_a_bool():
    assert not jf.tiny().cpu_tuning  # off unless asked for
    with pytest.raises(ValueError, match="cpu_tuning"):
        jf.tiny(cpu_tuning="yes")


@pytest.mark.parametrize("seed", [-1, 2 ** 32, 1.5, True])
def test_a_train_seed_outside_prngkey_range_is_refused(seed):
    from jaxformer.train import TrainConfig
    with pytest.raises(ValueError, match="TrainConfig.seed"):
        TrainConfig(seed=seed)

"""scan_layers: the scanned stack computes what the unrolled one does on the same
weights (moved with the `stacking` converters), and the converters are exact."""

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.nn import stacking
from jaxformer.decode.beam import beam_search
from jaxformer.train.checkpoint import CheckpointError, Checkpoints
from jaxformer.decode.api import generate, greedy_decode
from jaxformer.nn.model import attention_weights
from jaxformer.train.tasks import Batch
from jaxformer.train import make_optimizer, make_train_step, TrainConfig, TrainState

from conftest import numpy_params, random_tokens, tree_equal

CASES = {f"{kind}-{norm}": (kind, norm) for kind in ("encdec", "lm") for norm in ("post", "pre")}


def relative_error(got, want) -> float:
    got, want = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    num = sum(float(jnp.sum((a - b) ** 2)) for a, b in zip(got, want))
    return (num / sum(float(jnp.sum(b ** 2)) for b in want)) ** 0.5


def setup(kind, norm, **overrides):
    """(unrolled model, scanned model, per-layer params, inputs) of a tiny 3-layer model."""
    config = jf.config.tiny(norm=norm, num_encoder_layers=0 if kind == "lm" else 3,
                            num_decoder_layers=3, **overrides)
    cls = jf.DecoderOnlyLM if kind == "lm" else jf.Transformer
    src = random_tokens(0, (2, 7), config.src_vocab_size).at[1, 5:].set(0)
    tgt = random_tokens(1, (2, 6), config.tgt_vocab_size).at[:, 0].set(1)
    inputs = (tgt,) if kind == "lm" else (src, tgt)
    model = cls(config)
    return model, cls(config.replace(scan_layers=True)), numpy_params(model, *inputs), inputs


@pytest.mark.parametrize("case", list(CASES))
def test_scanned_logits_and_gradients_equal_unrolled(case):
    model, scanned, params, inputs = setup(*CASES[case])
    stacked = stacking.stack_layers(params)
    # The scanned model's own init has exactly the converted tree (names, shapes).
    init = jax.eval_shape(scanned.init, jax.random.PRNGKey(0), *inputs)["params"]
    assert (jax.tree_util.tree_structure(init) == jax.tree_util.tree_structure(stacked))
    assert jax.tree_util.tree_map(jnp.shape, init) == jax.tree_util.tree_map(jnp.shape, stacked)

    def loss(m, p):
        return jnp.sum(jnp.sin(m.apply({"params": p}, *inputs)))  # all logits matter

    value_and_grad = jax.jit(jax.value_and_grad(loss, argnums=1), static_argnums=0)
    want, want_grads = value_and_grad(model, params)
    got, got_grads = value_and_grad(scanned, stacked)
    assert relative_error(got, want) <= 1e-6
    assert relative_error(stacking.unstack_layers(got_grads), want_grads) <= 1e-6
    with pytest.raises(Exception):  # the layouts really differ
        scanned.apply({"params": params}, *inputs)


@pytest.mark.parametrize("case", list(CASES))
def test_scanned_decoding_gives_the_same_tokens(case):
    kind, norm = CASES[case]
    model, scanned, params, inputs = setup(kind, norm)
    stacked = stacking.stack_layers(params)
    if kind == "lm":
        prompt = inputs[0][:, :3]
        want = generate(model, params, prompt, max_new_tokens=5)
        got = generate(scanned, stacked, prompt, max_new_tokens=5)
    else:
        want = greedy_decode(model, params, inputs[0], max_new_tokens=6)
        got = greedy_decode(scanned, stacked, inputs[0], max_new_tokens=6)
        beam_want = beam_search(model, params, inputs[0], max_new_tokens=6, beam_size=3)
        beam_got = beam_search(scanned, stacked, inputs[0], max_new_tokens=6, beam_size=3)
        np.testing.assert_array_equal(beam_got.tokens, beam_want.tokens)
        np.testing.assert_allclose(beam_got.scores, beam_want.scores, rtol=1e-6)
    np.testing.assert_array_equal(got.tokens, want.tokens)


def test_decoding_refuses_the_wrong_layout():
    model, scanned, params, inputs = setup("encdec", "pre")
    with pytest.raises(ValueError, match="stacking.stack_layers"):
        greedy_decode(scanned, params, inputs[0], max_new_tokens=2)
    with pytest.raises(ValueError, match="stacking.unstack_layers"):
        greedy_decode(model, stacking.stack_layers(params), inputs[0], max_new_tokens=2)


@pytest.mark.parametrize("kind", ["encdec", "lm"])
def test_apply_refuses_the_wrong_layout_in_one_line(kind):
    """Flax's own error here is a 34-46 line scope trace."""
    model, scanned, params, inputs = setup(kind, "pre")
    with pytest.raises(ValueError, match="stacking.stack_layers") as wrong:
        scanned.apply({"params": params}, *inputs)
    assert len(str(wrong.value).splitlines()) == 1
    with pytest.raises(ValueError, match="stacking.unstack_layers"):
        model.apply(flax.core.freeze({"params": stacking.stack_layers(params)}), *inputs)
    model.apply({"params": params}, *inputs)  # the matching layouts apply
    scanned.apply({"params": stacking.stack_layers(params)}, *inputs)


def test_attention_weights_come_out_per_layer_in_both_layouts():
    model, scanned, params, inputs = setup("encdec", "post")
    _, want = model.apply({"params": params}, *inputs, mutable="intermediates")
    _, got = scanned.apply({"params": stacking.stack_layers(params)}, *inputs,
                           mutable="intermediates")
    want, got = attention_weights(want["intermediates"]), attention_weights(got["intermediates"])
    assert sorted(got) == sorted(want) and "decoder/layers_2/cross_attn" in got
    for name in want:
        np.testing.assert_allclose(got[name], want[name], atol=1e-6)


def _train_state(model, params, inputs, steps=1):
    tx = make_optimizer(TrainConfig(weight_decay=0.1, warmup_steps=1))
    params = jax.tree_util.tree_map(jnp.array, params)  # a copy: the step donates its state
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params,
                       opt_state=tx.init(params), rng=jax.random.PRNGKey(3))
    src, tgt = inputs
    batch = Batch(src=src, tgt_in=tgt, labels=jnp.roll(tgt, -1, axis=1))
    return make_train_step(model, tx)(state, batch)[0] if steps else state


def test_train_step_equal_and_train_states_round_trip_exactly():
    """One AdamW step (weight decay on matrices only, moments and all): the scanned
    state is the stacked unrolled state; converters invert each other bitwise."""
    model, scanned, params, inputs = setup("encdec", "pre")
    want = _train_state(model, params, inputs)
    got = _train_state(scanned, stacking.stack_layers(params), inputs)
    assert relative_error(stacking.unstack_layers(got.params), want.params) <= 1e-6
    assert relative_error(stacking.unstack_layers(got.opt_state), want.opt_state) <= 1e-6
    assert stacking.layout(want) == "per-layer" and stacking.layout(got) == "stacked"
    assert tree_equal(stacking.unstack_layers(stacking.stack_layers(want)), want)
    assert tree_equal(stacking.stack_layers(stacking.unstack_layers(got)), got)


def test_checkpoints_restore_across_layouts_only_when_asked(tmp_path):
    model, scanned, params, inputs = setup("encdec", "post")
    unrolled_state = _train_state(model, params, inputs, steps=0)
    scanned_state = stacking.stack_layers(unrolled_state)
    with Checkpoints(tmp_path / "scanned") as checkpoints:
        checkpoints.save(1, scanned_state)
        with pytest.raises(CheckpointError, match="convert_layout=True.*unstack_layers"):
            checkpoints.restore(unrolled_state)
        restored = checkpoints.restore(unrolled_state, convert_layout=True)
    assert tree_equal(restored, unrolled_state)
    with Checkpoints(tmp_path / "unrolled") as checkpoints:
        checkpoints.save(1, unrolled_state)
        with pytest.raises(CheckpointError, match="stack_layers"):
            checkpoints.restore(scanned_state)
        assert tree_equal(checkpoints.restore(scanned_state, convert_layout=True), scanned_state)


def test_converters_refuse_mixed_or_gapped_layouts():
    with pytest.raises(ValueError, match="0..L-1"):
        stacking.stack_layers({"layers_0": {"w": jnp.ones(2)}, "layers_2": {"w": jnp.ones(2)}})
    assert stacking.layout({"embed": jnp.ones(2)}) is None

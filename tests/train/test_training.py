"""Training: loss against a numpy reference, PAD carries no loss, decay only on
matrices, a few steps learn, determinism (dropout too), donation, non-finite stop,
and 4-device data parallelism (subprocess) equal to 1 device."""

import json
import os
import subprocess
import sys
import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxformer as jf
from conftest import tree_equal
from jaxformer.train.checkpoint import Checkpoints
from jaxformer.train import (evaluate, fit, loss_and_metrics, make_optimizer, train_functions,
                             TrainConfig)
from jaxformer.train.loop import NonFiniteLossError
from jaxformer.train.task import training_task
from jaxformer.train.optimizer import clip_by_global_norm, decay_mask, learning_rate_schedule
from jaxformer.train.state import create_train_state

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = jf.tiny(num_encoder_layers=1, num_decoder_layers=1)  # compiles fast
DROPOUT = MODEL.replace(attention_dropout=0.1, residual_dropout=0.1, embedding_dropout=0.1,
                        ffn_dropout=0.1)
TRAIN = TrainConfig(max_len=6, steps=12, batch_size=8, warmup_steps=2, learning_rate=1e-2)


def numpy_loss(logits, labels, pad=0, smoothing=0.0):
    logits = np.asarray(logits, np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    V = logits.shape[-1]
    target = np.eye(V)[labels] * (1 - smoothing) + smoothing / V
    xent = -(target * logp).sum(-1)
    w = labels != pad
    return (xent * w).sum() / w.sum(), ((logits.argmax(-1) == labels) * w).sum() / w.sum()


@pytest.mark.parametrize("smoothing", [0.0, 0.1], ids=["plain", "label-smoothing"])
def test_loss_matches_numpy_reference(smoothing):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 5, 7)).astype(np.float32)
    labels = np.array([[3, 4, 2, 0, 0], [5, 6, 6, 2, 0], [2, 0, 0, 0, 0]])
    loss, metrics = loss_and_metrics(jnp.asarray(logits), jnp.asarray(labels), 0, smoothing)
    want_loss, want_acc = numpy_loss(logits, labels, 0, smoothing)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(metrics["token_accuracy"], want_acc, rtol=1e-6)
    assert metrics["tokens"] == 8


def test_pad_positions_carry_no_loss():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(2, 4, 6)), jnp.float32)
    labels = jnp.array([[3, 2, 0, 0], [4, 5, 2, 0]])
    pad = labels == 0
    changed = jnp.where(pad[..., None], 100.0 * jnp.asarray(rng.normal(size=(2, 4, 6))), logits)
    base, base_metrics = loss_and_metrics(logits, labels)
    other, other_metrics = loss_and_metrics(changed, labels)
    assert base == other and base_metrics == other_metrics
    grads = jax.grad(lambda x: loss_and_metrics(x, labels)[0])(logits)
    assert not np.asarray(grads)[np.asarray(pad)].any()
    assert np.asarray(grads)[~np.asarray(pad)].any()


def test_decoder_tokens_at_pad_positions_change_nothing(one_device_run):
    model = jf.Transformer(MODEL)
    task = training_task(MODEL, TRAIN).task
    batch = jax.device_get(task.sample(jax.random.PRNGKey(0), 8))
    params = one_device_run.state.params
    # Positions labelled PAD (after EOS): put real tokens into the decoder input there.
    noise = np.random.default_rng(2).integers(3, 16, batch.tgt_in.shape)
    tgt_in = np.where(batch.labels == 0, noise, batch.tgt_in)
    assert (tgt_in != batch.tgt_in).any()

    apply = jax.jit(model.apply)

    def loss(tgt):
        return loss_and_metrics(apply({"params": params}, batch.src, tgt), batch.labels)

    (a, ma), (b, mb) = loss(jnp.asarray(batch.tgt_in)), loss(jnp.asarray(tgt_in))
    np.testing.assert_allclose(a, b, rtol=1e-6)
    assert ma["token_accuracy"] == mb["token_accuracy"]


def test_weight_decay_only_on_matrices():
    params = {"dense": {"kernel": jnp.full((3, 4), 2.0), "bias": jnp.full((4,), 2.0)},
              "attn": {"kernel": jnp.full((3, 2, 2), 2.0)},
              "embed": {"embedding": jnp.full((5, 3), 2.0)},
              "norm": {"scale": jnp.full((3,), 2.0)}}
    assert decay_mask(params) == {"dense": {"kernel": True, "bias": False},
                                  "attn": {"kernel": True}, "embed": {"embedding": True},
                                  "norm": {"scale": False}}
    tc = TRAIN.replace(warmup_steps=0, weight_decay=0.1)
    tx = make_optimizer(tc)
    # Zero gradients: Adam's step is exactly 0, so only decoupled decay moves parameters.
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    updates, _ = jax.jit(tx.update)(zeros, tx.init(params), params)
    new = optax.apply_updates(params, updates)
    decayed = 2.0 * (1 - tc.learning_rate * 0.1)
    for path in (("dense", "kernel"), ("attn", "kernel"), ("embed", "embedding")):
        np.testing.assert_allclose(new[path[0]][path[1]], decayed, rtol=1e-6)
    for path in (("dense", "bias"), ("norm", "scale")):
        np.testing.assert_array_equal(new[path[0]][path[1]], 2.0)


def test_schedule_warms_up_linearly_then_decays():
    tc = TrainConfig(steps=100, warmup_steps=10, learning_rate=1e-3, end_lr_fraction=0.1)
    lr = learning_rate_schedule(tc)
    assert lr(0) == 0.0
    np.testing.assert_allclose(lr(5), 5e-4, rtol=1e-6)
    np.testing.assert_allclose(lr(10), 1e-3, rtol=1e-6)
    assert lr(10) > lr(50) > lr(99) >= 1e-4 - 1e-9
    np.testing.assert_allclose(lr(100), 1e-4, rtol=1e-5)


@pytest.fixture(scope="module")
def one_device_run():
    return fit(MODEL, TRAIN, progress=False)


def test_a_few_steps_lower_the_loss(one_device_run):
    losses = [r["loss"] for r in one_device_run.history]
    assert len(losses) == TRAIN.steps and int(one_device_run.state.step) == TRAIN.steps
    assert np.mean(losses[-3:]) < 0.8 * np.mean(losses[:3])


def test_same_seed_gives_identical_parameters(one_device_run):
    again = fit(MODEL, TRAIN, progress=False)
    same = jax.tree_util.tree_map(np.array_equal, one_device_run.state.params, again.state.params)
    assert all(jax.tree_util.tree_leaves(same))
    assert again.history == one_device_run.history
    model, tx = jf.Transformer(MODEL), make_optimizer(TRAIN)
    seed0, seed1 = (create_train_state(model, tx, seed, 6, 7).params for seed in (0, 1))
    diff = jax.tree_util.tree_map(np.array_equal, seed0, seed1)
    assert not all(jax.tree_util.tree_leaves(diff))


@pytest.fixture(scope="module")
def dropout_run():
    return fit(DROPOUT, TRAIN, progress=False)


def test_same_seed_gives_identical_parameters_with_dropout(dropout_run, one_device_run):
    again = fit(DROPOUT, TRAIN, progress=False)
    assert tree_equal(again.state.params, dropout_run.state.params)
    assert tree_equal(again.state.opt_state, dropout_run.state.opt_state)
    assert again.history == dropout_run.history
    # Dropout is really on (the run differs from the dropout-free one) and seeded.
    assert not tree_equal(dropout_run.state.params, one_device_run.state.params)
    other = fit(DROPOUT, TRAIN.replace(seed=1), progress=False)
    assert not tree_equal(other.state.params, dropout_run.state.params)




def test_train_step_donates_the_state(one_device_run):
    fns = train_functions(MODEL, TRAIN)  # cached: the run's own compiled functions
    state = fns.init(0)
    step, seconds = fns.compiled_step(state, fns.batch(0, 0))
    assert seconds == 0.0  # already compiled by the run
    new, metrics = step(state, fns.batch(0, 0))
    assert int(new.step) == 1 and np.isfinite(metrics["loss"])
    np.testing.assert_allclose(metrics["loss"], one_device_run.history[0]["loss"], rtol=0)
    assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(state.params))


def test_clipping_equals_optax_and_stores_no_clipped_gradients():
    rng = np.random.default_rng(0)
    grads = {"w": jnp.asarray(rng.normal(size=(64, 48)), jnp.float32),
             "b": jnp.asarray(rng.normal(size=(48,)), jnp.float32)}
    norm = float(optax.global_norm(grads))
    for max_norm in (2 * norm, norm / 3):  # unclipped: bit-identical; clipped: rounding
        got = clip_by_global_norm(max_norm).update(grads, optax.EmptyState())[0]
        want = optax.clip_by_global_norm(max_norm).update(grads, optax.EmptyState())[0]
        chex.assert_trees_all_close(got, want, rtol=0 if max_norm > norm else 3e-7, atol=0)  # 2 roundings
    nan = {"w": grads["w"].at[0, 0].set(jnp.nan), "b": grads["b"]}
    assert np.isnan(clip_by_global_norm(1.0).update(nan, optax.EmptyState())[0]["b"]).all()
    # Clipping then AdamW, compiled with the state donated: no temporaries at all (optax's
    # clipping stored the clipped gradients: a temporary the size of the parameters).
    tx = make_optimizer(TRAIN)
    params = {"w": jax.ShapeDtypeStruct((256, 1024), jnp.float32)}

    def update(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    compiled = jax.jit(update, donate_argnums=(0, 1)).lower(
        params, jax.eval_shape(tx.init, params), params).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < 256 * 1024 * 4 / 4


def test_init_from_with_donation_takes_the_buffers_and_equals_the_copy():
    fns = train_functions(MODEL, TRAIN)
    start = fns.init(3).params

    def fresh():  # new buffers holding `start`
        return jax.tree_util.tree_map(lambda x: x + 0, start)

    copied = fns.init_from(0, fresh())
    given = fresh()
    pointers = [x.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves(given)]
    donated = fns.init_from(0, given, donate=True)
    chex.assert_trees_all_equal(donated, copied)
    assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(given))
    assert [x.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves(donated.params)] \
        == pointers  # the state holds the very buffers passed: no second copy
    kept = fresh()
    fns.init_from(0, kept)  # without donation the caller's arrays stay usable
    assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves(kept))


@pytest.mark.parametrize("kwargs", [dict(save_every=float("nan")), dict(log_every=0),
                                    dict(eval_every=-1), dict(save_every=2.5)],
                         ids=["nan-save-every", "zero-log-every", "negative-eval-every",
                              "fractional-save-every"])
def test_bad_intervals_are_refused_before_compiling(kwargs):
    with pytest.raises(ValueError, match=f"{next(iter(kwargs))} must be an int"):
        fit(MODEL, TRAIN, progress=False, **kwargs)


def test_non_finite_loss_stops_naming_the_step(tmp_path):
    tc = TRAIN.replace(learning_rate=1e30, steps=10, warmup_steps=0)
    with pytest.raises(NonFiniteLossError, match=r"at step \d+") as info:
        fit(MODEL, tc, checkpoint_dir=str(tmp_path), save_every=1, log_every=1,
            progress=False)
    bad = info.value.step
    with Checkpoints(tmp_path) as checkpoints:
        steps = checkpoints.steps()
    assert steps and max(steps) == bad - 1  # the last good state is kept, the bad not saved
    assert f"step {bad - 1}" in str(info.value)


def test_an_infinite_loss_stops_like_a_nan_one():
    """+inf, not only NaN: output biases of -inf on half the vocabulary make the first
    step's cross-entropy +inf (its gradients, and so the next loss, NaN)."""
    params = jax.tree_util.tree_map(np.asarray, train_functions(MODEL, TRAIN).init(0).params)
    bias = params["decoder"]["out_proj"]["bias"].copy()
    bias[3::2] = -np.inf
    params["decoder"]["out_proj"]["bias"] = bias
    with pytest.raises(NonFiniteLossError, match=r"loss is inf at step 1\b"):
        fit(MODEL, TRAIN, init_params=params, log_every=1, progress=False)


@pytest.mark.parametrize("model, train, match", [
    (MODEL, TRAIN.replace(max_len=40), "longer than the model's max_len=32"),
    (MODEL.replace(tgt_vocab_size=20), TRAIN, "src_vocab_size == tgt_vocab_size"),
], ids=["length-beyond-model", "vocab-mismatch"])
def test_bad_runs_are_refused_before_compiling(model, train, match):
    with pytest.raises(ValueError, match=match):
        fit(model, train, progress=False)


@pytest.mark.parametrize("changes, field", [
    (dict(steps=0), "steps"), (dict(batch_size=-1), "batch_size"),
    (dict(warmup_steps=12), "warmup_steps"), (dict(learning_rate=-1.0), "learning_rate"),
    (dict(learning_rate=float("inf")), "learning_rate"),
    (dict(learning_rate=float("nan")), "learning_rate"),
    (dict(task="shuffle"), "task"), (dict(label_smoothing=1.5), "label_smoothing"),
    (dict(clip_norm=float("inf")), "clip_norm"), (dict(clip_norm=float("nan")), "clip_norm"),
    (dict(b1=float("nan")), "b1"), (dict(b2=1.0), "b2"),
    (dict(weight_decay=float("nan")), "weight_decay"),
    (dict(end_lr_fraction=float("inf")), "end_lr_fraction"),
], ids=["steps", "batch", "warmup-ge-steps", "negative-lr", "infinite-lr", "nan-lr",
        "unknown-task", "smoothing", "infinite-clip", "nan-clip", "nan-b1", "b2-one",
        "nan-decay", "infinite-end-lr"])
def test_bad_train_config_is_refused(changes, field):
    with pytest.raises(ValueError, match=field):
        TRAIN.replace(**changes)


def test_exact_match_counts_whole_sequences(one_device_run):
    model = jf.Transformer(MODEL)
    batch = jax.device_get(train_functions(MODEL, TRAIN).batch(0, 0))  # 8 rows
    params = one_device_run.state.params

    answers = {src.tobytes(): labels for src, labels in zip(batch.src, batch.labels)}

    def perfect(p, src):  # a fake decoder that knows the answers, chunk by chunk
        return jnp.asarray(np.stack([answers[r.tobytes()] for r in np.asarray(src)]))

    def three_wrong(p, src):
        return perfect(p, src).at[:3, 0].add(1)  # one token off in 3 rows

    result = evaluate(model, params, batch, predict=perfect)
    assert result["exact_match"] == 1.0 and result["examples"] == 8
    assert evaluate(model, params, batch, predict=three_wrong)["exact_match"] == 5 / 8
    # Chunking changes nothing: teacher-forced sums add up across chunks.
    chunked = evaluate(model, params, batch, predict=perfect, chunk=3)
    np.testing.assert_allclose(chunked["loss"], result["loss"], rtol=1e-6)
    assert chunked["token_accuracy"] == result["token_accuracy"]


DATA_PARALLEL = textwrap.dedent("""
    import json
    import jax, numpy as np
    import jaxformer as jf
    from jaxformer.parallel.partitioning import make_mesh
    from jaxformer.parallel.sharding import shard_batch
    from jaxformer.train import evaluate, fit, TrainConfig
    from jaxformer.train.task import training_task

    MODEL = jf.tiny(num_encoder_layers=1, num_decoder_layers=1)
    DROPOUT = MODEL.replace(attention_dropout=0.1, residual_dropout=0.1,
                            embedding_dropout=0.1, ffn_dropout=0.1)
    TRAIN = TrainConfig(max_len=6, steps=12, batch_size=8, warmup_steps=2, learning_rate=1e-2)
    dropout = fit(DROPOUT, TRAIN, progress=False)  # the harder case; one compilation
    task = training_task(MODEL, TRAIN).task
    shards = shard_batch(task.train_batch(jax.random.PRNGKey(0), 8), dropout.mesh).src
    try:
        fit(MODEL, TRAIN.replace(batch_size=6), progress=False)
        error = None
    except ValueError as e:
        error = str(e)
    heldout = task.heldout_set(10)  # 10 rows: the last chunk is padded to 12 on 4 devices
    model = jf.Transformer(MODEL)
    four = evaluate(model, dropout.state.params, heldout, chunk=4)
    one = evaluate(model, dropout.state.params, heldout, mesh=make_mesh(devices=jax.devices()[:1]))
    print(json.dumps({
        "devices": len(jax.devices()), "mesh": dropout.mesh.devices.size,
        "shard_rows": sorted({s.data.shape[0] for s in shards.addressable_shards}),
        "n_shards": len(shards.addressable_shards),
        "replicated": all(x.sharding.is_fully_replicated
                          for x in jax.tree_util.tree_leaves(dropout.state.params)),
        "error": error,
        "dropout_losses": [r["loss"] for r in dropout.history],
        "dropout_params": {jax.tree_util.keystr(path): np.asarray(x).ravel().tolist()
                           for path, x in jax.tree_util.tree_leaves_with_path(
                               dropout.state.params)},
        "eval4": four, "eval1": one}))
""")


def test_four_devices_match_one_device(dropout_run):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, "-c", DATA_PARALLEL], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["devices"] == 4 and out["mesh"] == 4
    assert out["n_shards"] == 4 and out["shard_rows"] == [2]   # the batch is really split
    assert out["replicated"]
    # Dropout draws the same random bits whatever the sharding (each element's bits are
    # a function of its global index, see jaxformer.backends.threefry): same losses and parameters.
    np.testing.assert_allclose(out["dropout_losses"],
                               [r["loss"] for r in dropout_run.history], rtol=1e-5, atol=1e-5)
    # Attention key biases excepted: softmax ignores them, so their true gradient is 0
    # and Adam turns the rounding noise of each reduction order into lr-sized steps.
    one = {jax.tree_util.keystr(path): np.asarray(x).ravel()
           for path, x in jax.tree_util.tree_leaves_with_path(dropout_run.state.params)}
    compared = [name for name in one if "['key']['bias']" not in name]
    assert sorted(out["dropout_params"]) == sorted(one) and len(compared) == len(one) - 3
    for name in compared:
        np.testing.assert_allclose(out["dropout_params"][name], one[name], rtol=1e-5,
                                   atol=1e-6, err_msg=name)
    assert out["error"] and "batch_size=6" in out["error"] and "4 devices" in out["error"]
    for name in ("loss", "token_accuracy", "exact_match"):
        np.testing.assert_allclose(out["eval4"][name], out["eval1"][name], rtol=1e-5)
    assert out["eval4"]["examples"] == 10

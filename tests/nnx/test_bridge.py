"""jaxformer.nnx: the NNX module holds the given parameters and runs the Linen model
exactly; gradients, a sharded optimizer step, cached decoding and the way back."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxformer as jf
from conftest import REPO, numpy_params, random_tokens
from jaxformer import nnx as jnnx
from jaxformer.parallel import partitioning


def model_of(config):
    return jf.DecoderOnlyLM(config) if config.num_encoder_layers == 0 else jf.Transformer(config)


def inputs_of(model, seed=0, batch=2, length=5):
    c = model.config
    tgt = random_tokens(seed, (batch, length), c.tgt_vocab_size).at[1, -2:].set(c.pad_id)
    if isinstance(model, jf.DecoderOnlyLM):
        return (tgt,)
    return random_tokens(seed + 1, (batch, length + 1), c.src_vocab_size), tgt


CONFIGS = {**{name: make() for name, make in jf.PRESETS.items()},
           "tiny_lm": jf.tiny(num_encoder_layers=0), "llama_gqa": jf.llama(num_kv_heads=2),
           "llama_scanned": jf.llama(scan_layers=True)}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_nnx_logits_equal_linen_exactly_on_every_preset(name):
    model = model_of(CONFIGS[name])
    xs = inputs_of(model)
    params = numpy_params(model, *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in xs))
    module = jnnx.to_nnx(model, params)
    assert isinstance(module, nnx.Module)
    want = model.apply({"params": params}, *xs)
    np.testing.assert_array_equal(np.asarray(module(*xs)), np.asarray(want))
    # The way back is the same arrays: bitwise, and the same tree.
    back = jnnx.to_params(module)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(params)
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(params)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The logical names are Flax's own metadata, equal to the rules module's reading.
    assert jnnx.logical_specs(module) == partitioning.logical_specs(
        model, *(jax.ShapeDtypeStruct((1, 1), jnp.int32) for _ in xs))


def test_the_given_parameters_are_used_not_fresh_ones(make_lm):
    """Another set of parameters gives other logits; a tree of another model is refused."""
    model, params = make_lm(jf.tiny(num_encoder_layers=0), seed=0)
    _, other = make_lm(jf.tiny(num_encoder_layers=0), seed=1)
    tokens = random_tokens(0, (1, 4), 16)
    a, b = jnnx.to_nnx(model, params)(tokens), jnnx.to_nnx(model, other)(tokens)
    assert np.abs(np.asarray(a) - np.asarray(b)).max() > 1e-2
    np.testing.assert_array_equal(np.asarray(b), np.asarray(model.apply({"params": other},
                                                                         tokens)))
    with pytest.raises(ValueError, match="missing .*embed"):
        jnnx.to_nnx(model, {"decoder": params["decoder"]})
    bad = jax.tree_util.tree_map(lambda x: x, params)
    bad["embed"]["embedding"] = bad["embed"]["embedding"][:, :8]
    with pytest.raises(ValueError, match=r"params\['embed/embedding'\] is float32\[16, 8\]"):
        jnnx.to_nnx(model, bad)


@pytest.mark.parametrize("kind", ["lm", "seq2seq"])
def test_gradients_equal_linens(kind, make_lm, make_transformer):
    model, params = (make_lm(jf.llama(num_kv_heads=2)) if kind == "lm"
                     else make_transformer(jf.tiny()))
    xs = inputs_of(model)

    def linen_loss(p):
        return jnp.sum(jnp.sin(model.apply({"params": p}, *xs)))

    def nnx_loss(m):
        return jnp.sum(jnp.sin(m(*xs)))

    want = jax.grad(linen_loss)(params)
    got = jnnx.to_params(nnx.grad(nnx_loss)(jnnx.to_nnx(model, params)))
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got),
                            jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                      err_msg=jax.tree_util.keystr(path))


def test_cached_greedy_decoding_through_the_module_gives_generates_tokens(make_lm):
    model, params = make_lm(jf.llama(num_kv_heads=2))
    module = jnnx.to_nnx(model, params)
    prompt = random_tokens(3, (2, 4), 16)
    want = jf.generate(*jnnx.linen(module), prompt, max_new_tokens=6)
    step = nnx.jit(jnnx.decode_step)
    cache = jf.init_cache(model.config, batch=2, max_len=10)
    logits, cache = step(module, cache, prompt)
    picked = []
    for _ in range(6):
        token = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
        picked.append(token)
        logits, cache = step(module, cache, token[:, None])
    np.testing.assert_array_equal(np.stack(picked, 1), np.asarray(want.tokens))
    ref = jf.generate(model, params, prompt, max_new_tokens=6)
    np.testing.assert_array_equal(np.asarray(ref.tokens), np.asarray(want.tokens))


def test_an_optimizer_step_equals_the_same_step_on_the_linen_tree(make_lm):
    from jaxformer.train.data import LMBatch
    from jaxformer.train.loss import loss_and_metrics, model_logits

    model, params = make_lm(jf.llama(num_kv_heads=2))
    tokens = np.asarray(random_tokens(5, (2, 7), 16))
    batch = LMBatch(inputs=tokens[:, :-1], labels=tokens[:, 1:],
                    weights=np.ones((2, 6), np.float32),
                    positions=np.tile(np.arange(6, dtype=np.int32), (2, 1)),
                    segments=np.ones((2, 6), np.int32))
    tx = optax.sgd(0.5, momentum=0.9)  # (Adam would turn rounding noise into lr steps)
    module = jnnx.to_nnx(model, params)
    optimizer = nnx.Optimizer(module, tx, wrt=nnx.Param)
    metrics = [jnnx.train_step(module, optimizer, batch) for _ in range(2)]

    @jax.jit
    def linen_step(p, opt_state):
        def loss(p):
            logits, labels, weights = model_logits(model, p, batch)
            return loss_and_metrics(logits, labels, model.config.pad_id, 0.0, weights)[0]
        value, grads = jax.value_and_grad(loss)(p)
        updates, opt_state = tx.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, value

    p, opt_state = params, tx.init(params)
    for m in metrics:
        p, opt_state, value = linen_step(p, opt_state)
        np.testing.assert_allclose(float(m["loss"]), float(value), rtol=1e-6)
    got = jnnx.to_params(module)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got),
                            jax.tree_util.tree_leaves(p)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6,
                                   err_msg=jax.tree_util.keystr(path))
    assert np.abs(np.asarray(got["embed"]["embedding"]) -
                  np.asarray(params["embed"]["embedding"])).max() > 1e-3  # it trained


def test_the_nnx_loss_drops_out_only_with_a_dropout_key(make_lm):
    """Guards the NNX loss never turning dropout on: with dropout 0.3, two dropout keys
    give two losses, each other than the deterministic one; without a key it is the
    deterministic loss, which is the loss of the same parameters with dropout 0 (key
    or no key) and the Linen model's eval-mode loss."""
    from jaxformer.train.data import LMBatch
    from jaxformer.train.loss import loss_and_metrics, model_logits

    rates = dict(attention_dropout=0.3, residual_dropout=0.3, embedding_dropout=0.3,
                 ffn_dropout=0.3)
    model, params = make_lm(jf.llama(num_kv_heads=2, **rates))
    plain = jf.DecoderOnlyLM(model.config.replace(**dict.fromkeys(rates, 0.0)))
    tokens = np.asarray(random_tokens(5, (2, 7), 16))
    batch = LMBatch(inputs=tokens[:, :-1], labels=tokens[:, 1:],
                    weights=np.ones((2, 6), np.float32),
                    positions=np.tile(np.arange(6, dtype=np.int32), (2, 1)),
                    segments=np.ones((2, 6), np.int32))
    module = jnnx.to_nnx(model, params)
    plain_module = jnnx.to_nnx(plain, params)

    def loss(m, key=None):
        return float(jnnx.loss_fn(m, batch, dropout_key=key)[0])

    deterministic = loss(module)
    first, second = loss(module, jax.random.key(1)), loss(module, jax.random.key(2))
    assert first != second
    assert abs(first - deterministic) > 1e-4 and abs(second - deterministic) > 1e-4
    assert loss(module, jax.random.key(1)) == first  # a key is one draw
    assert loss(plain_module) == deterministic
    assert loss(plain_module, jax.random.key(1)) == deterministic
    logits, labels, weights = model_logits(model, params, batch)
    eval_loss = loss_and_metrics(logits, labels, model.config.pad_id, 0.0, weights)[0]
    np.testing.assert_allclose(deterministic, float(eval_loss), rtol=1e-6)


SHARDED = textwrap.dedent("""
    import json
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    from flax import nnx
    from jax.sharding import PartitionSpec as P
    import jaxformer as jf
    from jaxformer import nnx as jnnx
    from jaxformer.parallel import partitioning
    from jaxformer.train import TrainConfig, make_optimizer, train_functions
    from jaxformer.train.data import LMBatch

    LM = jf.llama(num_decoder_layers=2, num_kv_heads=4)
    TRAIN = TrainConfig(task="lm", data=("unused",), seq_len=8, steps=12, batch_size=8,
                        warmup_steps=2, learning_rate=1e-2)
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 16, (8, 9)).astype(np.int32)
    BATCH = LMBatch(inputs=tokens[:, :-1], labels=tokens[:, 1:],
                    weights=np.ones((8, 8), np.float32),
                    positions=np.tile(np.arange(8, dtype=np.int32), (8, 1)),
                    segments=np.ones((8, 8), np.int32))
    mesh = partitioning.make_mesh("fsdp=2,tensor=4")
    batch = jax.device_put(BATCH, partitioning.shardings(P(partitioning.batch_axes(mesh)), mesh))
    fns = train_functions(LM, TRAIN, mesh)
    state = fns.init(0)
    start = jax.tree_util.tree_map(np.asarray, state.params)  # (the Linen step donates)
    module = jnnx.shard(jnnx.to_nnx(jf.DecoderOnlyLM(LM), start), mesh)
    optimizer = nnx.Optimizer(module, make_optimizer(TRAIN), wrt=nnx.Param)
    want = jax.tree_util.tree_leaves(fns.shardings.params)
    placed = all(x.sharding == s for x, s in zip(jax.tree_util.tree_leaves(
        jnnx.to_params(module)), want))
    linen, nnx_losses = [], []
    for _ in range(3):
        state, metrics = fns.step(state, batch)
        linen.append(float(metrics["loss"]))
        nnx_losses.append(float(jnnx.train_step(module, optimizer, batch, mesh=mesh)["loss"]))
    got = jnnx.to_params(module)
    kept = all(x.sharding == s for x, s in zip(jax.tree_util.tree_leaves(got), want))
    query = got["decoder"]["layers_0"]["self_attn"]["query"]["kernel"]
    diff = {jax.tree_util.keystr(p): float(np.abs(np.asarray(a) - np.asarray(b)).max())
            for (p, a), b in zip(jax.tree_util.tree_leaves_with_path(got),
                                 jax.tree_util.tree_leaves(state.params))}
    print(json.dumps({"devices": len(jax.devices()), "placed": placed, "kept": kept,
                      "block": list(query.addressable_shards[0].data.shape),
                      "linen": linen, "nnx": nnx_losses, "diff": diff}))
""")


def test_a_sharded_nnx_train_step_equals_the_linen_step_on_8_devices():
    """fsdp=2 x tensor=4: the NNX module placed by the rules table holds each parameter
    as jaxformer's own train state does, and three `train_step`s of it with the run's
    optimizer give the losses and parameters of three `train_functions` steps."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-c", SHARDED], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["devices"] == 8 and out["placed"] and out["kept"]
    assert out["block"] == [16, 1, 8]  # query (D=32, H=4, K=8): embed/fsdp, heads/tensor
    np.testing.assert_allclose(out["nnx"], out["linen"], rtol=1e-5)
    assert out["linen"][2] < out["linen"][0] - 1  # it trained (step 0 has learning rate 0)
    worst = max(out["diff"].items(), key=lambda kv: kv[1])
    assert worst[1] < 1e-5, worst


def test_smollm2_through_nnx_gives_the_loaded_models_logits_exactly(smollm2):
    """The pretrained parameters as loaded (not re-initialised): the same logits, bitwise."""
    model, params, tokenizer, _ = smollm2
    ids = jnp.asarray([tokenizer.encode("JAX is a library for").ids], jnp.int32)
    module = jnnx.to_nnx(model, params)
    forward = jax.jit(lambda p, x: model.apply({"params": p}, x))
    want = np.asarray(forward(params, ids))
    got = np.asarray(nnx.jit(lambda m, x: m(x))(module, ids))
    np.testing.assert_array_equal(got, want)
    spec = jnnx.logical_specs(module)["embed"]["embedding"]
    assert tuple(spec) == ("vocab", "embed")

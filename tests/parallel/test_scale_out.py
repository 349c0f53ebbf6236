"""Scale-out: checkpoints that reshard, and decoding with parameters split by the rules.

On 8 CPU devices (one subprocess, see `SCRIPT`): a state trained and saved on
fsdp=8 restores onto data=2,fsdp=2,tensor=2, onto 1 device and into the scanned
layout, from abstract targets, bitwise and in the requested shardings; greedy,
sampled and beam decoding, `evaluate` and the LM's `generate` with parameters
split over tensor (and fsdp) give the tokens of 1 device. In-process: the errors
of `place_params`.

The subprocess compiles 1 train step and 13 small decode / eval functions: about
65-80 s of CPU time, 80-215 s of wall time on the shared 2-core machine under load.
"""

import json
import os
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh

import jaxformer as jf
from jaxformer.parallel import partitioning
from jaxformer.train.checkpoint import CheckpointError, Checkpoints

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent("""
    import json, tempfile
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    import jaxformer as jf
    from jaxformer.parallel import partitioning
    from jaxformer.nn import stacking
    from jaxformer.train.checkpoint import Checkpoints
    from jaxformer.train import evaluate, train_functions, TrainConfig

    MODEL = jf.tiny(num_encoder_layers=1, num_decoder_layers=1)
    TRAIN = TrainConfig(max_len=6, steps=4, batch_size=8, warmup_steps=1, learning_rate=1e-2)
    mesh = partitioning.make_mesh
    one = mesh(devices=jax.devices()[:1])
    out = {"devices": len(jax.devices())}

    def leaves(tree):
        return jax.tree_util.tree_leaves(tree)

    def shard_shape(x):
        return list(x.addressable_shards[0].data.shape)

    # -- checkpoints: save on fsdp=8, restore elsewhere from abstract targets
    fns = train_functions(MODEL, TRAIN, mesh("fsdp=8"))
    state, _ = fns.step(fns.init(0), fns.batch(0, 0))  # moments non-zero
    saved = [np.asarray(x) for x in leaves(state)]
    out["restore"] = {}
    with tempfile.TemporaryDirectory() as directory:
        with Checkpoints(directory) as checkpoints:
            checkpoints.save(1, state)
            scanned = MODEL.replace(scan_layers=True)
            for name, config, spec in (("2x2x2", MODEL, "data=2,fsdp=2,tensor=2"),
                                       ("one", MODEL, None),
                                       ("scanned", scanned, "fsdp=4,tensor=2")):
                target = jax.eval_shape(train_functions(
                    config, TRAIN, one if spec is None else mesh(spec)).init, 0)
                got = checkpoints.restore(target, convert_layout=name == "scanned")
                want = saved if name != "scanned" else [np.asarray(x) for x in leaves(
                    stacking.stack_layers(jax.tree_util.tree_unflatten(
                        jax.tree_util.tree_structure(state), saved)))]
                out["restore"][name] = {
                    "equal": len(leaves(got)) == len(want) and all(
                        np.array_equal(np.asarray(x), w) for x, w in zip(leaves(got), want)),
                    "in_target_shardings": all(x.sharding == t.sharding for x, t in
                                               zip(leaves(got), leaves(target))),
                    "embedding_shard": shard_shape(got.params["tgt_embed"]["embedding"])}
            params = checkpoints.restore(jax.eval_shape(
                train_functions(MODEL, TRAIN, one).init, 0)).params

    # -- decoding with parameters split by the rules
    model = jf.Transformer(MODEL)
    batch = fns.task.task.train_batch(jax.random.PRNGKey(5), 8)
    src, n = np.asarray(batch.src), batch.labels.shape[1]  # as `evaluate` decodes
    key = jax.random.PRNGKey(3)

    def decode(p):
        return {"greedy": jf.greedy_decode(model, p, src, max_new_tokens=n).tokens,
                "sample": jf.sample(model, p, src, max_new_tokens=n, rng=key).tokens,
                "beam": jf.beam_search(model, p, src, max_new_tokens=n, beam_size=3).tokens}

    tensor4 = mesh("tensor=4", devices=jax.devices()[:4])
    placed = partitioning.place_params(model, params, tensor4)
    out["query_shard"] = shard_shape(placed["decoder"]["layers_0"]["self_attn"]["query"]["kernel"])
    base, split = decode(params), decode(placed)
    out["decode"] = {k: np.array_equal(np.asarray(split[k]), np.asarray(base[k]))
                     for k in base}
    out["decode_varied"] = len({np.asarray(base["greedy"]).tobytes(),
                                np.asarray(base["sample"]).tobytes()}) == 2

    # evaluate: parameters stay split over fsdp x tensor (greedy decode inside)
    big = mesh("fsdp=2,tensor=4")
    out["evaluate"] = {"one": evaluate(model, params, batch, mesh=one),
                       "fsdp2_tensor4": evaluate(model, params, batch, mesh=big)}

    # the decoder-only LM's generate on tensor=4
    lm = jf.DecoderOnlyLM(jf.llama(num_decoder_layers=1))
    lm_params = jax.jit(lm.init)(jax.random.PRNGKey(1), np.zeros((1, 4), np.int32))["params"]
    prompt = np.random.default_rng(0).integers(3, 16, (2, 5)).astype(np.int32)
    prompt[1, 3:] = 0
    def gen(p):
        return np.asarray(jf.generate(lm, p, prompt, max_new_tokens=8,
                                      prompt_lengths=np.array([5, 3])).tokens)
    lm_placed = partitioning.place_params(lm, lm_params, tensor4)
    out["lm_mlp_shard"] = shard_shape(lm_placed["decoder"]["layers_0"]["ffn"]["wi"]["kernel"])
    out["generate"] = bool(np.array_equal(gen(lm_params), gen(lm_placed)))
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def scaled():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    env.pop("XLA_FLAGS", None)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(f"scale-out subprocess: {time.perf_counter() - start:.1f} s")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name, shard", [
    ("2x2x2", [8, 16]),   # tgt embedding (V=16, D=32): vocab over tensor=2, embed over fsdp=2
    ("one", [16, 32]),
    ("scanned", [8, 8]),  # vocab over tensor=2, embed over fsdp=4
])
def test_checkpoint_restores_onto_another_mesh_bitwise(scaled, name, shard):
    """Saved on fsdp=8, restored from an abstract target straight into its shardings."""
    assert scaled["devices"] == 8
    got = scaled["restore"][name]
    assert got["equal"] and got["in_target_shardings"]
    assert got["embedding_shard"] == shard


@pytest.mark.parametrize("kind", ["greedy", "sample", "beam"])
def test_tensor_parallel_decoding_gives_the_tokens_of_one_device(scaled, kind):
    assert scaled["query_shard"] == [32, 1, 8]  # (D, H=4, K) with heads over tensor=4
    assert scaled["decode"][kind]
    assert scaled["decode_varied"]  # greedy and sampled tokens differ: not vacuous


def test_evaluate_with_split_parameters_matches_one_device(scaled):
    one, split = scaled["evaluate"]["one"], scaled["evaluate"]["fsdp2_tensor4"]
    assert split["exact_match"] == one["exact_match"]
    assert split["token_accuracy"] == one["token_accuracy"]
    assert split["loss"] == pytest.approx(one["loss"], rel=1e-5)


def test_lm_generate_with_split_parameters(scaled):
    assert scaled["lm_mlp_shard"] == [32, 16]  # (D, F=64) with F over tensor=4
    assert scaled["generate"]


# -- in-process: the errors come before anything is placed

TOKENS = jax.ShapeDtypeStruct((1, 1), jnp.int32)


def test_place_params_refuses_indivisible_heads_and_foreign_trees():
    lm = jf.DecoderOnlyLM(jf.llama(num_decoder_layers=1))
    params = jax.eval_shape(lm.init, jax.random.PRNGKey(0), TOKENS)["params"]
    tensor8 = AbstractMesh((1, 1, 8), ("data", "fsdp", "tensor"))  # no devices needed
    with pytest.raises(ValueError, match=r"decoder/layers_0/self_attn/query/kernel "
                       r"\(32, 4, 8\): dimension 1 of size 4 does not divide over tensor=8"):
        partitioning.param_shardings(lm, params, tensor8)
    scanned = jf.DecoderOnlyLM(jf.llama(num_decoder_layers=1, scan_layers=True))
    with pytest.raises(ValueError, match=r"do not have the tree of this DecoderOnlyLM.*"
                       r"decoder/layers/"):
        partitioning.param_shardings(scanned, params, tensor8)


def test_abstract_target_without_sharding_is_refused(tmp_path):
    with Checkpoints(tmp_path) as checkpoints:
        checkpoints.save(1, {"w": jnp.ones((2, 3))})
        with pytest.raises(ValueError, match=r"needs a sharding on every leaf.*\['w'\]"):
            checkpoints.restore({"w": jax.ShapeDtypeStruct((2, 3), jnp.float32)})
        with pytest.raises(CheckpointError, match="does not match"):
            checkpoints.restore({"v": jax.ShapeDtypeStruct(
                (2, 3), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(
                    jax.devices()[0]))})

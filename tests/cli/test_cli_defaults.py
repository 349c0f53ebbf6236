"""The defaults of the commands that run a language model (generate, eval, serve;
issue 65): a quantized GGUF file's blocks are kept (--dequantize: float32), a float
one loads as float, CPU tuning is asked for on a CPU (--no-cpu-tuning: not), and the
server's ready line names the weights and the tuning.

The files are tiny GGUF files written by tests/interop/test_gguf.py's helpers (every
layer kernel Q4_1, the token table Q8_0; or all float32). Tuning is process state that
must precede JAX's start: in-process the test stops at the request (`tune_process`
replaced); the served line comes from a real `jaxformer serve` subprocess.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import jaxformer as jf
from jaxformer.backends import cpu
from jaxformer.cli import runs
from jaxformer.cli.main import main

from conftest import numpy_params

pytest.importorskip("gguf", reason="GGUF import needs the `llm` extra")
from tests.interop.test_gguf import Q, QCONFIG, gguf_tensors, quantized_file, write_gguf  # noqa: E402
from tests.serve.server_fixture import free_port  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEPT = ("int4", "int8_block")  # (weight_quant, embed_quant) of the Q4_1 file's blocks
FLOAT = (None, None)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{"q4_1": a Q4_1 file, "f32": the same model in float32, "data": a text file}."""
    params = numpy_params(jf.DecoderOnlyLM(QCONFIG), jax.ShapeDtypeStruct((1, 1), jnp.int32),
                          seed=5)
    folder = tmp_path_factory.mktemp("defaults")
    (folder / "text.txt").write_text("abcab abc " * 8)
    return {"q4_1": str(quantized_file(folder / "q41.gguf", params, Q.Q4_1)),
            "f32": str(write_gguf(folder / "f32.gguf", gguf_tensors(params, QCONFIG),
                                  QCONFIG)),
            "data": str(folder / "text.txt")}


@pytest.fixture
def loaded(monkeypatch):
    """The configs of the models a command loads (`cli.runs.load_pretrained`'s)."""
    configs, real = [], runs.load_pretrained

    def load(*args, **kwargs):
        model, params, tokenizer = real(*args, **kwargs)
        configs.append(model.config)
        return model, params, tokenizer

    monkeypatch.setattr(runs, "load_pretrained", load)
    return configs


def command(name, files):
    return {"generate": ["generate", "ab", "--max-new-tokens", "2"],
            "eval": ["eval", "--data", files["data"], "--seq-len", "8", "--batch", "2",
                     "--no-progress"]}[name]


@pytest.mark.parametrize("name, file, flags, weights", [
    ("generate", "q4_1", [], KEPT),
    ("generate", "q4_1", ["--dequantize"], FLOAT),
    ("generate", "q4_1", ["--quantize", "keep"], KEPT),
    ("generate", "f32", [], FLOAT),
    ("generate", "f32", ["--quantize", "int8"], ("int8", None)),
    ("eval", "q4_1", [], KEPT),
    ("eval", "q4_1", ["--dequantize"], FLOAT),
], ids=["generate-kept", "generate-dequantize", "generate-keep", "generate-float-file",
        "generate-int8", "eval-kept", "eval-dequantize"])
def test_a_quantized_gguf_file_runs_its_kept_blocks_unless_dequantized(
        files, loaded, name, file, flags, weights, capsys):
    assert main(command(name, files) + ["--model", files[file], *flags]) == 0, \
        capsys.readouterr().err
    [config] = loaded
    assert (config.weight_quant, config.embed_quant) == weights


def test_dequantize_and_quantize_are_one_choice(files, capsys):
    assert main(["generate", "ab", "--model", files["q4_1"], "--dequantize",
                 "--quantize", "int8"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err


class Tuned(Exception):
    """Raised by the stand-in of `cpu.tune_process`: the command asked for the tuning."""


@pytest.mark.parametrize("name", ["generate", "eval", "serve"])
@pytest.mark.parametrize("flags, asked", [([], True), (["--cpu-tuning"], True),
                                          (["--no-cpu-tuning"], False)],
                         ids=["default", "cpu-tuning", "no-cpu-tuning"])
def test_cpu_tuning_is_asked_for_on_a_cpu_unless_turned_off(name, flags, asked, tmp_path,
                                                            monkeypatch, capsys):
    def tune_process():
        raise Tuned

    monkeypatch.setattr(cpu, "cpu_is_the_backend", lambda: True)
    monkeypatch.setattr(cpu, "tune_process", tune_process)
    argv = {"generate": ["generate", "hi"], "eval": ["eval", "--data", "x.txt"],
            "serve": ["serve"]}[name] + ["--model", str(tmp_path / "missing.gguf"), *flags]
    if asked:
        with pytest.raises(Tuned):  # first of all, before JAX starts
            main(argv)
    else:
        assert main(argv) == 2  # on to the missing files, never asking
        assert "Traceback" not in capsys.readouterr().err


def test_no_tuning_off_a_cpu(monkeypatch):
    monkeypatch.setattr(cpu, "cpu_is_the_backend", lambda: False)
    monkeypatch.setattr(cpu, "tune_process", lambda: pytest.fail("tuned off a CPU"))
    assert runs.cpu_tuning(True) is False


@pytest.mark.parametrize("file, flags, weights, tuning", [
    ("q4_1", [], "kept GGUF blocks (int4, int8_block)", "on"),
    ("q4_1", ["--dequantize", "--no-cpu-tuning"], "float32", "off"),
], ids=["default", "dequantize-untuned"])
def test_the_ready_line_names_the_weights_and_the_tuning(files, file, flags, weights, tuning):
    pytest.importorskip("uvicorn", reason="needs the `serve` extra")
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "jaxformer", "serve", "--model", files[file], "--port",
         str(port), "--slots", "1", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"})
    try:
        line = process.stdout.readline().rstrip()
    finally:  # stopped before its stderr is read (that reads to the end)
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    assert line == (f"serving q41.gguf on http://127.0.0.1:{port} (weights: {weights}; "
                    f"CPU tuning {tuning})"), line + process.stderr.read()

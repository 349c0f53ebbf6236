"""benchmarks/gpu.py end to end in its smoke mode (tiny sizes, this CPU): every key of
its JSON line, the MFU and bandwidth fractions as its docstring defines them."""

import importlib.util
import os

import pytest

from conftest import REPO


@pytest.fixture(scope="module")
def gpu_benchmark():
    spec = importlib.util.spec_from_file_location(
        "gpu_benchmark", os.path.join(REPO, "benchmarks", "gpu.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_run_reports_every_key_with_the_documented_fractions(gpu_benchmark, monkeypatch,
                                                                  capsys):
    peak_flops, peak_bandwidth = 1e12, 1e11
    monkeypatch.setattr(gpu_benchmark, "peaks", lambda device: (peak_flops, peak_bandwidth))
    result = gpu_benchmark.main(["--smoke"])
    for key in ("train_mfu_auto", "train_mfu_blockwise", "train_step_s_auto",
                "train_compile_s_blockwise", "decode_tokens_per_s_b1",
                "decode_tokens_per_s_b64", "decode_bandwidth_fraction_b1",
                "decode_bandwidth_fraction_b64", "decode_compile_s_b64", "params", "device"):
        assert result[key] is not None, key
    config = gpu_benchmark.model_config("smoke", 64)
    tokens = result["train_batch"] * result["seq_len"]
    flops = (6 * result["params"] + 12 * config.num_decoder_layers * config.d_model * 64) * tokens
    for impl in ("auto", "blockwise"):
        want = flops / result[f"train_step_s_{impl}"] / peak_flops
        assert result[f"train_mfu_{impl}"] == pytest.approx(want, rel=1e-9)
    assert result["decode_bandwidth_fraction_b1"] > 0 and result["decode_tokens_per_s_b1"] > 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith('{"device"')


def test_unknown_device_kinds_have_no_peak(gpu_benchmark):
    class Device:
        device_kind = "a CPU"

    class H100:
        device_kind = "NVIDIA H100 80GB HBM3"

    assert gpu_benchmark.peaks(Device()) == (None, None)
    assert gpu_benchmark.peaks(H100()) == (989e12, 3.35e12)

"""`jaxformer train --task lm --seq-len 16384 --attention-impl blockwise` trains a tiny
model (1 layer, d_model 32, 2 heads) 2 steps of one 16k window on this CPU: the packed
mask is a MaskSpec, so nothing (T, T) is built (dense would need 1 GiB per (T, T) f32)."""

import json
import sysconfig
from pathlib import Path

import numpy as np

from jaxformer.cli.main import main

SEQ = 16384


def test_train_lm_at_seq_len_16384_with_blockwise_attention(tmp_path):
    stdlib_json = Path(sysconfig.get_paths()["stdlib"]) / "json"
    text = "".join(p.read_text() for p in sorted(stdlib_json.glob("*.py")))
    data = tmp_path / "text.txt"
    data.write_text(text * 2)  # ~97 kB: 5 windows of 16k after the held-out part
    out = tmp_path / "run"
    assert main(["train", "--task", "lm", "--data", str(data), "--preset", "tiny",
                 "--layers", "1", "--d-model", "32", "--heads", "2", "--d-ff", "64",
                 "--norm", "pre", "--seq-len", str(SEQ), "--batch", "1", "--steps", "2",
                 "--warmup", "1", "--attention-impl", "blockwise", "--samples", "0",
                 "--no-progress", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and np.isfinite(summary["eval_loss"])
    config = json.loads((out / "config.json").read_text())
    assert config["model"]["attention_impl"] == "blockwise"
    assert config["model"]["max_len"] >= SEQ
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert len(losses) == 2 and all(np.isfinite(losses))

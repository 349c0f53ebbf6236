"""Every command's flags are checked before anything loads or prints (issue 47).

Each bad value: exit status 2, one line on stderr naming the flag, nothing on
stdout, and no model, checkpoint or audio model loaded (the loaders are replaced
by ones that fail the test), so each case is fast.
"""

import argparse
import os
import re

import pytest

import jaxformer.models
import jaxformer.models.whisper
import jaxformer.train.checkpoint
import jaxformer.train.loop
from jaxformer.cli import args as cli_args
from jaxformer.cli.main import main

HERE = os.path.abspath(__file__)

# (command line with {dir} for an existing directory, the flag the message must name)
TRAIN = ["train", "--preset", "tiny", "--out", "{dir}/run", "--no-progress"]
LM = ["train", "--task", "lm", "--data", HERE, "--out", "{dir}/run", "--no-progress"]
GENERATE = ["generate", "--model", "{dir}", "hello"]
DECODE = ["decode", "--run", "{dir}"]
EVAL = ["eval", "--model", "{dir}", "--data", HERE]
CASES = [
    *[(TRAIN + [flag, value], flag) for flag, value in [
        ("--d-model", "0"), ("--heads", "-1"), ("--d-ff", "x"), ("--layers", "0"),
        ("--dropout", "nan"), ("--dropout", "1.5"), ("--vocab", "0"), ("--min-len", "0"),
        ("--max-len", "-2"), ("--steps", "0"), ("--batch", "0"), ("--batch", "2.5"),
        ("--lr", "nan"), ("--lr", "inf"), ("--lr", "-1"), ("--lr", "0"), ("--warmup", "-1"),
        ("--weight-decay", "nan"), ("--label-smoothing", "1"), ("--seed", "-1"),
        ("--seed", str(2 ** 32)), ("--save-every", "0"), ("--log-every", "0"),
        ("--eval-examples", "0"), ("--show", "-1"), ("--cpu-devices", "0"),
        ("--num-processes", "0"), ("--process-id", "-1"), ("--coordinator-timeout", "inf"),
        ("--coordinator-timeout", "0")]],
    *[(LM + [flag, value], flag) for flag, value in [
        ("--seq-len", "1"), ("--eval-every", "-1"), ("--samples", "-1"),
        ("--sample-tokens", "0"), ("--lora", "0"), ("--lora", "-3"),
        ("--lora-alpha", "nan"), ("--lora-alpha", "0")]],
    (LM + ["--data", "{dir}/missing/*.txt"], "--data"),
    (LM + ["--eval-data", "{dir}/missing.txt"], "--eval-data"),
    # --init: the model would load; the bad --data is refused first
    (LM + ["--init", "{dir}", "--data", "{dir}/missing.txt"], "--data"),
    (LM + ["--init", "{dir}/missing.gguf"], "--init"),
    (LM + ["--init", "{dir}", "--lora", "0"], "--lora"),  # not a full fine-tune
    (LM + ["--init", "{dir}", "--mesh", "pipe=1"], "--mesh"),  # the mesh before --init loads
    *[(GENERATE + [flag, value], flag) for flag, value in [
        ("--max-new-tokens", "0"), ("--max-new-tokens", "-5"), ("--temperature", "-1"),
        ("--temperature", "nan"), ("--temperature", "inf"), ("--top-p", "2"),
        ("--top-p", "0"), ("--top-p", "nan"), ("--top-k", "0"), ("--seed", "-1"),
        ("--prefill-chunk", "0")]],
    (["generate", "--run", "{dir}", "--temperature", "nan", "hi"], "--temperature"),
    *[(DECODE + [flag, value], flag) for flag, value in [
        ("--max-new-tokens", "0"), ("--temperature", "nan"), ("--top-p", "1.5"),
        ("--top-k", "-1"), ("--examples", "0")]],
    (DECODE + ["5 x"], "token ids"),  # a source: before the checkpoint is read
    *[(EVAL + [flag, value], flag) for flag, value in [
        ("--seq-len", "1"), ("--batch", "0"), ("--batch", "nan")]],
    (EVAL[:-1] + ["{dir}/missing.txt"], "--data"),
    (["eval", "--run", "{dir}", "--data", HERE, "--batch", "-1"], "--batch"),
    (["transcribe", "--model", "{dir}", HERE, "--batch", "0"], "--batch"),
    (["export", "--model", "{dir}", "--out", HERE], "--out"),
]


def _case_id(case):
    argv, flag = case
    value = (argv[len(argv) - argv[::-1].index(flag)] if flag in argv  # its last value
             else argv[-1])
    return f"{argv[0]}{flag}={os.path.basename(value)}"


@pytest.fixture
def no_loading(monkeypatch):
    """Every loader of a model, a checkpoint or a Whisper model fails the test."""
    def loaded(*args, **kwargs):
        raise AssertionError("a model or checkpoint was loaded before the flags were checked")

    monkeypatch.setattr(jaxformer.models, "load", loaded)
    monkeypatch.setattr(jaxformer.models.whisper, "load", loaded)
    monkeypatch.setattr(jaxformer.train.checkpoint.Checkpoints, "restore", loaded)
    monkeypatch.setattr(jaxformer.train.loop, "fit", loaded)


@pytest.mark.parametrize("case", CASES, ids=map(_case_id, CASES))
def test_a_bad_flag_is_one_line_and_exit_2_before_anything_loads(case, tmp_path, capsys,
                                                                  no_loading):
    argv, flag = case
    argv = [a.replace("{dir}", str(tmp_path)) for a in argv]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.splitlines()) == 1 and flag in err, err
    assert err.startswith(f"jaxformer {argv[0]}: error: ") and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_every_numeric_flag_has_a_checking_type():
    """No command parses a plain int or float: each number goes through a type of
    `jaxformer.cli.args`, so a new flag cannot skip the checks."""
    folder = os.path.dirname(cli_args.__file__)
    plain = [name for name in sorted(os.listdir(folder)) if name.endswith(".py")
             and re.search(r"type=(int|float)\b", open(os.path.join(folder, name)).read())]
    assert plain == []


@pytest.mark.parametrize("parse, good, bad", [
    (cli_args.positive_int, {"1": 1, "7": 7}, ["0", "-1", "1.5", "x", "nan"]),
    (cli_args.non_negative_int, {"0": 0}, ["-1", "1e3"]),
    (cli_args.seed, {"0": 0, str(2 ** 32 - 1): 2 ** 32 - 1}, ["-1", str(2 ** 32)]),
    (cli_args.positive_float, {"1e-3": 1e-3}, ["0", "-1", "nan", "inf", "-inf"]),
    (cli_args.non_negative_float, {"0": 0.0, "0.8": 0.8}, ["-0.1", "nan", "inf"]),
    (cli_args.probability, {"1": 1.0, "0.9": 0.9}, ["0", "1.01", "nan"]),
    (cli_args.fraction, {"0": 0.0, "0.5": 0.5}, ["1", "-0.1", "nan"]),
    (cli_args.at_least(2), {"2": 2}, ["1"]),
    (cli_args.finite_float, {"-0.5": -0.5, "0": 0.0}, ["nan", "inf", "x"]),
], ids=["positive_int", "non_negative_int", "seed", "positive_float", "non_negative_float",
        "probability", "fraction", "at_least", "finite_float"])
def test_argument_types(parse, good, bad):
    for text, value in good.items():
        assert parse(text) == value
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError, match="must be"):
            parse(text)

"""`--quantize` on the commands that load a language model (generate, eval): a layout
that does not exist, or "keep" on a run's float weights, is one line and exit 2."""

import pytest

from jaxformer.cli.main import main


@pytest.mark.parametrize("command", [["generate", "hi"], ["eval", "--data", "x.txt"]])
def test_an_unknown_layout_is_refused_by_name(command, capsys):
    assert main(command + ["--model", "m.gguf", "--quantize", "int3"]) == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'int3'" in err and len(err.strip().splitlines()) == 1


def test_keep_needs_a_gguf_file(tmp_path, capsys):
    assert main(["generate", "--run", str(tmp_path), "--quantize", "keep", "hi"]) == 2
    err = capsys.readouterr().err
    assert "--quantize keep keeps a GGUF file's blocks" in err and "Traceback" not in err

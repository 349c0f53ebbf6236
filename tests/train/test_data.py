"""jaxformer.train.data: tokenizers, reading files, packing, grain batches, the held-out split."""

import math
import os

import jax
import numpy as np
import pytest

from jaxformer import text as jt
from jaxformer.text import byte as text_byte
from jaxformer.train import data as jd

FIELDS = ("inputs", "labels", "weights", "positions", "segments")


def write(directory, name, content) -> str:
    path = os.path.join(directory, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(content.encode() if isinstance(content, str) else content)
    return path


def rows(batch):
    """Rows of an LMBatch as hashable tuples of all five fields."""
    return [tuple(getattr(batch, f)[i].tobytes() for f in FIELDS)
            for i in range(batch.inputs.shape[0])]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """40 documents of random bytes (~1300 windows of 4 tokens, all distinct)."""
    d = tmp_path_factory.mktemp("corpus")
    r = np.random.default_rng(0)
    for i in range(40):
        write(d, f"doc{i:02d}.bin", r.integers(0, 256, r.integers(60, 200), np.uint8).tobytes())
    return str(d)


@pytest.fixture(scope="module")
def text_data(corpus):
    return jd.TextData([os.path.join(corpus, "*.bin")], jt.ByteTokenizer(), 4, seed=0)


def window_ids(td):
    """{row: window id} of every training window, from the in-order packing."""
    reference = rows(jd.pack_windows(*td._train_stream, np.arange(td.num_train_windows),
                                     td.seq_len))
    assert len(set(reference)) == len(reference)  # windows are identifiable
    return {row: i for i, row in enumerate(reference)}


# -- tokenizers -------------------------------------------------------------------

def test_byte_tokenizer_round_trip():
    t = jt.ByteTokenizer()
    text = "héllo, wörld — 日本語 🎉"
    ids = t.encode(text)
    assert ids.dtype == np.int32 and ids.min() >= 3 and ids.max() < t.vocab_size == 259
    assert list(ids) == [b + 3 for b in text.encode()]
    assert t.decode(ids) == text and t.byte_count(ids) == len(text.encode()) == 33
    everything = bytes(range(256))
    ids = t.encode(everything)
    assert list(ids) == list(range(3, 259)) and t.byte_count(ids) == 256
    with_specials = np.concatenate([[t.bos_id], t.encode("ok"), [t.eos_id, t.pad_id]])
    assert t.decode(with_specials) == "ok" and t.byte_count(with_specials) == 2
    assert t.decode(t.encode(b"a\xffb")) == "a\ufffdb"   # invalid UTF-8 is replaced
    assert (t.pad_id, t.bos_id, t.eos_id) == (text_byte.PAD_ID, text_byte.BOS_ID, text_byte.EOS_ID) == (0, 1, 2)
    assert isinstance(jt.training_tokenizer(None), jt.ByteTokenizer)


def _train_hf_tokenizer(path, specials):
    tokenizers = pytest.importorskip("tokenizers", reason="the `tokenizers` package is absent")
    from tokenizers import decoders, models, pre_tokenizers, trainers
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the cat sat on the mat", "the dog ate the hat"] * 20, trainer)
    tok.save(str(path))
    return tok


def test_json_tokenizer(tmp_path):
    path = tmp_path / "tok.json"
    hf = _train_hf_tokenizer(path, ["<pad>", "<s>", "</s>"])
    t = jt.training_tokenizer(str(path))
    assert isinstance(t, jt.JSONTokenizer)
    assert (t.pad_id, t.bos_id, t.eos_id) == (hf.token_to_id("<pad>"), hf.token_to_id("<s>"),
                                              hf.token_to_id("</s>")) == (0, 1, 2)
    assert t.vocab_size == hf.get_vocab_size() > 256
    text = "the cat ate the hat, café ü"
    ids = t.encode(text)
    assert ids.dtype == np.int32 and len(ids) < len(text.encode())   # merges were learned
    assert set(ids.tolist()).isdisjoint({0, 1, 2}) and ids.max() < t.vocab_size
    assert t.decode(ids) == text and t.byte_count(ids) == len(text.encode())
    assert t.decode(np.concatenate([[t.bos_id], ids, [t.eos_id, t.pad_id]])) == text
    # Text spelling a special token stays text: no stray EOS inside a document.
    assert t.eos_id not in t.encode("a </s> b").tolist()


def test_json_tokenizer_errors(tmp_path):
    broken = write(tmp_path, "broken.json", "{not json")
    with pytest.raises(ValueError, match="broken.json"):
        jt.JSONTokenizer(broken)
    with pytest.raises(ValueError, match="nothere.json"):
        jt.training_tokenizer(str(tmp_path / "nothere.json"))
    path = tmp_path / "nospecials.json"
    _train_hf_tokenizer(path, ["</s>"])
    with pytest.raises(ValueError, match=r"nospecials\.json.*pad \(tried <pad>.*bos \(tried <s>") as e:
        jt.JSONTokenizer(str(path))
    assert "eos" not in str(e.value).split("lacks special tokens:")[1]   # eos was found


# -- reading files ----------------------------------------------------------------

def test_read_documents(tmp_path):
    b = write(tmp_path, "b.txt", "bee")
    a = write(tmp_path, "a.txt", "ay")
    c = write(tmp_path, "sub/c.md", b"\xff\x00")
    docs = jd.read_documents([str(tmp_path / "*.txt"), c, a])   # a.txt twice: read once
    assert docs == [(a, b"ay"), (b, b"bee"), (c, b"\xff\x00")]
    assert jd.read_documents([str(tmp_path / "**" / "*.md")]) == [(c, b"\xff\x00")]
    assert jd.read_documents(b) == [(b, b"bee")]                 # a single path


@pytest.mark.parametrize("case", ["no match", "missing", "directory", "empty", "unreadable"])
def test_read_documents_errors(tmp_path, case):
    write(tmp_path, "good.txt", "fine")
    bad = {"no match": str(tmp_path / "*.nothing"), "missing": str(tmp_path / "gone.txt"),
           "directory": str(tmp_path / "subdir"), "empty": write(tmp_path, "empty.txt", ""),
           "unreadable": write(tmp_path, "secret.txt", "x")}[case]
    os.makedirs(tmp_path / "subdir", exist_ok=True)
    if case == "unreadable":
        os.chmod(bad, 0)
        if os.access(bad, os.R_OK):
            pytest.skip("running as root: chmod 0 does not stop reading")
    with pytest.raises(ValueError, match=os.path.basename(bad).replace("*", r"\*")):
        jd.read_documents([str(tmp_path / "good.txt"), bad])


# -- packing ----------------------------------------------------------------------

# Documents "ab", "c", "defgh" -> [B a b E] [B c E] [B d e f g h E], bytes + 3 as ids.
B, E, P = 1, 2, 0
a, b_, c, d, e, f, g, h = (ord(x) + 3 for x in "abcdefgh")
EXPECTED = dict(  # seq_len 5: windows start at 0, 5, 10 of the 14-token stream
    inputs=[[B, a, b_, E, B], [c, E, B, d, e], [f, g, h, E, P]],
    labels=[[a, b_, E, B, c], [E, B, d, e, f], [g, h, E, P, P]],
    weights=[[1, 1, 1, 0, 1], [1, 0, 1, 1, 1], [1, 1, 1, 0, 0]],
    positions=[[0, 1, 2, 3, 0], [0, 1, 0, 1, 2], [0, 1, 2, 3, 0]],
    segments=[[1, 1, 1, 1, 2], [1, 1, 2, 2, 2], [1, 1, 1, 1, 0]],
)
T, F_ = True, False
EXPECTED_MASK_ROW1 = [[T, F_, F_, F_, F_],  # segments [1, 1, 2, 2, 2]
                      [T, T, F_, F_, F_],
                      [F_, F_, T, F_, F_],
                      [F_, F_, T, T, F_],
                      [F_, F_, T, T, T]]
EXPECTED_MASK_ROW2 = [[T, F_, F_, F_, F_],  # segments [1, 1, 1, 1, 0]
                      [T, T, F_, F_, F_],
                      [T, T, T, F_, F_],
                      [T, T, T, T, F_],
                      [F_, F_, F_, F_, F_]]


@pytest.fixture
def small_corpus(tmp_path):
    paths = [write(tmp_path, n, s) for n, s in [("1.txt", "ab"), ("2.txt", "c"),
                                                  ("3.txt", "defgh")]]
    other = write(tmp_path, "other.txt", "xyzxyzxyz")
    return paths, other


def test_packing_hand_computed(small_corpus):
    paths, other = small_corpus
    # The three documents held out: eval_batches gives the windows in order.
    td = jd.TextData([other], jt.ByteTokenizer(), 5, eval_patterns=paths)
    assert td.num_eval_windows == 3
    (batch,) = list(td.eval_batches(4))
    for name, expected in EXPECTED.items():
        got = getattr(batch, name)
        assert got.shape == (4, 5) and got.dtype == (np.float32 if name == "weights" else np.int32)
        np.testing.assert_array_equal(got[:3], expected, err_msg=name)
        np.testing.assert_array_equal(got[3], 0, err_msg=name)     # the padding row
    # The same documents as training data: one batch holds the same windows, shuffled.
    td = jd.TextData(paths, jt.ByteTokenizer(), 5, eval_patterns=[other])
    assert td.num_train_windows == 3 and td.train_bytes_count == 8
    train = td.train_batch(0, 3, seed=0)
    assert sorted(rows(train)) == sorted(rows(batch)[:3])


def test_segment_mask():
    segments = np.array(EXPECTED["segments"], np.int32)
    mask = np.asarray(jd.segment_mask(segments))
    assert mask.shape == (3, 1, 5, 5) and mask.dtype == bool
    np.testing.assert_array_equal(mask[1, 0], EXPECTED_MASK_ROW1)
    np.testing.assert_array_equal(mask[2, 0], EXPECTED_MASK_ROW2)
    np.testing.assert_array_equal(mask[0, 0], [[T, F_, F_, F_, F_],   # segments [1, 1, 1, 1, 2]
                                               [T, T, F_, F_, F_],
                                               [T, T, T, F_, F_],
                                               [T, T, T, T, F_],
                                               [F_, F_, F_, F_, T]])
    np.testing.assert_array_equal(np.asarray(jax.jit(jd.segment_mask)(segments)), mask)


def test_long_document_positions_stay_below_seq_len(tmp_path):
    """A document of 3 windows: its pieces are segments whose positions restart at 0."""
    other = write(tmp_path, "x.txt", "x")
    td = jd.TextData([write(tmp_path, "long.txt", "0123456789")], jt.ByteTokenizer(), 4,
                     eval_patterns=[other])
    assert td.num_train_windows == 3          # 12 tokens, 11 labels, 4 per window
    batch = jd.pack_windows(*td._train_stream, [0, 1, 2], 4)
    np.testing.assert_array_equal(batch.positions, [[0, 1, 2, 3]] * 3)
    np.testing.assert_array_equal(batch.segments, 1)
    np.testing.assert_array_equal(batch.weights, [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]])
    np.testing.assert_array_equal(batch.inputs[1:, 0], batch.labels[:-1, -1])   # overlap 1


# -- grain batches ----------------------------------------------------------------

def test_determinism_and_seed(corpus, text_data):
    fresh = jd.TextData([os.path.join(corpus, "*.bin")], jt.ByteTokenizer(), 4, seed=0)
    for step in (0, 1, 57):
        one, two = text_data.train_batch(step, 8, seed=3), fresh.train_batch(step, 8, seed=3)
        for name in FIELDS:
            np.testing.assert_array_equal(getattr(one, name), getattr(two, name))
    other = text_data.train_batch(0, 8, seed=4)
    assert rows(other) != rows(text_data.train_batch(0, 8, seed=3))


def test_exact_resume(corpus, text_data):
    steps = 30
    uninterrupted = iter(text_data.train_dataset(8, seed=5))
    seen = [next(uninterrupted) for _ in range(steps)]
    resumed = jd.TextData([os.path.join(corpus, "*.bin")], jt.ByteTokenizer(), 4, seed=0)
    for step in (0, 17, steps - 1):
        assert rows(resumed.train_batch(step, 8, seed=5)) == rows(seen[step])
    batch = seen[0]
    assert isinstance(batch, jd.LMBatch)
    assert len(jax.tree_util.tree_leaves(batch)) == 5      # a pytree: device_put-able
    assert jax.device_put(batch).inputs.shape == (8, 4)


@pytest.mark.parametrize("process_count", [1, 2, 4])
def test_processes_cover_each_epoch_once(text_data, process_count):
    ids = window_ids(text_data)
    n, batch_size = text_data.num_train_windows, 12
    assert n % batch_size  # the epoch boundary falls inside a global batch
    steps = math.ceil(2 * n / batch_size)
    global_rows, owner = [], []   # window id and process of each row, in global order
    for step in range(steps):
        for p in range(process_count):
            batch = text_data.train_batch(step, batch_size, seed=7, process_index=p,
                                          process_count=process_count)
            assert batch.inputs.shape == (batch_size // process_count, 4)
            global_rows += [ids[r] for r in rows(batch)]
            owner += [p] * len(batch.inputs)
    for epoch in (0, 1):
        window, proc = global_rows[epoch * n:(epoch + 1) * n], owner[epoch * n:(epoch + 1) * n]
        assert sorted(window) == list(range(n))          # every window exactly once
        shares = [{w for w, o in zip(window, proc) if o == p} for p in range(process_count)]
        assert sum(map(len, shares)) == n                # so the shares are disjoint
        assert all(len(share) >= n // process_count - batch_size for share in shares)
    first, second = global_rows[:n], global_rows[n:2 * n]
    assert first != second                               # epochs are different shuffles
    assert first != sorted(first)                        # shuffled at all
    # The global order does not depend on the process count.
    single = [ids[r] for s in range(steps) for r in rows(text_data.train_batch(s, batch_size, 7))]
    assert global_rows == single


def test_batch_size_errors(text_data, tmp_path):
    n = text_data.num_train_windows
    text_data.check_batch_size(n)
    with pytest.raises(ValueError, match="too small for one batch"):
        text_data.check_batch_size(n + 1)
    with pytest.raises(ValueError, match="too small for one batch"):
        text_data.train_dataset(2 * (n // 2 + 1), seed=0, process_index=0, process_count=2)
    with pytest.raises(ValueError, match="multiple of the process count"):
        text_data.train_dataset(6, seed=0, process_index=0, process_count=4)
    with pytest.raises(ValueError, match="process_index"):
        text_data.train_dataset(8, seed=0, process_index=2, process_count=2)
    tiny = jd.TextData([write(tmp_path, "t.txt", "tiny text")], jt.ByteTokenizer(), 8)
    with pytest.raises(ValueError, match="too small"):
        tiny.train_batch(0, 4, seed=0)


# -- held-out split ---------------------------------------------------------------

def test_held_out_documents(corpus, text_data):
    files = sorted(os.listdir(corpus))
    assert len(text_data.eval_names) == math.ceil(0.05 * 40) == 2
    assert set(text_data.eval_names).isdisjoint(text_data.train_names)
    assert sorted(map(os.path.basename, text_data.eval_names + text_data.train_names)) == files
    raw = {n: open(n, "rb").read() for n in text_data.eval_names + text_data.train_names}
    assert text_data.eval_bytes == b"".join(raw[n] for n in text_data.eval_names)
    assert text_data.train_bytes_count == sum(len(raw[n]) for n in text_data.train_names)
    # The held-out windows in order rebuild the held-out documents' token stream.
    t = text_data.tokenizer
    expected = np.concatenate([np.concatenate([[1], t.encode(raw[n]), [2]])
                               for n in text_data.eval_names])
    batches = list(text_data.eval_batches(7))
    inputs = np.concatenate([x.inputs for x in batches])
    weights = np.concatenate([x.weights for x in batches])
    real = text_data.num_eval_windows
    assert len(inputs) == 7 * math.ceil(real / 7) > real        # the last batch is padded
    assert (inputs[real:] == 0).all() and (weights[real:] == 0).all()
    stream = np.concatenate([inputs[:real].reshape(-1), batches[-1].labels[(real - 1) % 7, -1:]])
    np.testing.assert_array_equal(stream[:len(expected)], expected)
    assert (stream[len(expected):] == 0).all()
    assert weights.sum() == len(expected) - 2        # every in-document pair counted once
    # Another seed holds out other documents; the same seed the same ones.
    pattern = [os.path.join(corpus, "*.bin")]
    assert jd.TextData(pattern, t, 4, seed=0).eval_names == text_data.eval_names
    assert jd.TextData(pattern, t, 4, seed=1).eval_names != text_data.eval_names
    prompts = text_data.eval_prompts(3, 5)
    assert len(prompts) == 2
    for prompt, name in zip(prompts, text_data.eval_names):
        np.testing.assert_array_equal(prompt, np.concatenate([[1], t.encode(raw[name][:4])]))


def test_eval_patterns_and_fraction(corpus):
    pattern = os.path.join(corpus, "*.bin")
    held = [os.path.join(corpus, "doc03.bin"), os.path.join(corpus, "doc1*.bin")]
    td = jd.TextData([pattern], jt.ByteTokenizer(), 4, eval_patterns=held)
    assert [os.path.basename(n) for n in td.eval_names] == ["doc03.bin"] + [
        f"doc1{i}.bin" for i in range(10)]
    assert len(td.train_names) == 29 and set(td.train_names).isdisjoint(td.eval_names)
    td = jd.TextData([pattern], jt.ByteTokenizer(), 4, eval_fraction=0.26)
    assert len(td.eval_names) == math.ceil(0.26 * 40) == 11
    td = jd.TextData([pattern], jt.ByteTokenizer(), 4, eval_fraction=0.999)
    assert len(td.train_names) == 1                  # at least one document trains
    with pytest.raises(ValueError, match="nothing left to train"):
        jd.TextData([held[0]], jt.ByteTokenizer(), 4, eval_patterns=held)


def test_single_document_is_split_inside(tmp_path):
    text = "é" * 10 + "abcdefghij"                      # 30 bytes; the cut lands in "é"
    path = write(tmp_path, "one.txt", text)
    td = jd.TextData([path], jt.ByteTokenizer(), 4, eval_fraction=0.5)
    raw = text.encode()
    assert td.eval_bytes == raw[16:] and td.train_bytes_count == 16   # moved to a char boundary
    assert td.eval_names == td.train_names == [path]
    (prompt,) = td.eval_prompts(5, 3)
    np.testing.assert_array_equal(prompt, np.array(list(raw[16:19])) + 3)
    (batch,) = list(td.eval_batches(8))              # held-out: tokens + [EOS], no BOS
    assert batch.inputs[0, 0] == raw[16] + 3 and batch.weights.sum() == len(raw) - 16
    # At least one byte, one whole character, on each side.
    td = jd.TextData([write(tmp_path, "two.txt", "ab")], jt.ByteTokenizer(), 4)
    assert (td.train_bytes_count, td.eval_bytes) == (1, b"b")
    td = jd.TextData([write(tmp_path, "kanji.txt", "a日")], jt.ByteTokenizer(), 4)
    assert (td.train_bytes_count, td.eval_bytes) == (1, "日".encode())
    for name, content in [("b.txt", "b"), ("e.txt", "é")]:
        with pytest.raises(ValueError, match=name + ".*too short"):
            jd.TextData([write(tmp_path, name, content)], jt.ByteTokenizer(), 4)


def test_json_tokenizer_corpus(tmp_path):
    tok_path = tmp_path / "tok.json"
    _train_hf_tokenizer(tok_path, ["<pad>", "<s>", "</s>"])
    t = jt.JSONTokenizer(str(tok_path))
    train = write(tmp_path, "train.txt", "the cat sat on the mat " * 5)
    held = write(tmp_path, "held.txt", "the dog ate the hat")
    td = jd.TextData([train], t, 6, eval_patterns=[held])
    assert td.vocab_size == t.vocab_size
    (batch,) = list(td.eval_batches(4))
    ids = np.concatenate([[t.bos_id], t.encode("the dog ate the hat"), [t.eos_id]])
    np.testing.assert_array_equal(batch.inputs.reshape(-1)[:len(ids) - 1], ids[:-1])
    bad = write(tmp_path, "latin1.txt", "caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.txt.*not UTF-8"):
        jd.TextData([train, bad], t, 6, eval_patterns=[held])
    # The byte tokenizer reads the same file.
    assert jd.TextData([bad], jt.ByteTokenizer(), 2, eval_patterns=[held]).num_train_windows == 3

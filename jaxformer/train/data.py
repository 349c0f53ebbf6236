"""Text data for language modelling: files -> tokens -> packed windows -> batches.

Pipeline::

    read_documents(patterns)   each file is one document (name, raw bytes)
    tokenizer.encode           [BOS] + tokens + [EOS] per document
    TextData                   train / held-out split; the train documents are
                               concatenated into one stream, cut into windows
    train_dataset (grain)      window ids -> shuffle per epoch -> repeat ->
                               batch -> this process's share -> LMBatch

Packing, with L = seq_len: window r is the L + 1 stream tokens starting at
r * L (consecutive windows overlap by one token, so every next-token pair of
the stream is a label exactly once); inputs = window[:-1], labels = window[1:].
The stream's tail is padded with PAD. Each maximal run of one document within
a window is a *segment* (numbered 1, 2, ... in the window, 0 = PAD), and its
positions count from 0 at the start of the run. A document longer than a
window thus continues in the next window as a new segment whose positions
restart at 0: the model cannot attend to the previous window anyway, and
positions stay < L <= max_len (the size of the position table). A label
counts (weight 1) only if it is in the same segment as its input, so the
model never predicts the next document's BOS from the previous EOS, nor PAD.

Example, L = 4, documents [B a b E] and [B c E] (B = BOS, E = EOS, _ = PAD)::

    stream     B a b E B c E
    window 0   B a b E B     inputs B a b E  labels a b E B  weights 1 1 1 0
                             segments 1 1 1 1  positions 0 1 2 3
    window 1   B c E _ _     inputs B c E _  labels c E _ _  weights 1 1 0 0
                             segments 1 1 1 0  positions 0 1 2 0
"""

from __future__ import annotations

import glob
import math
import os
from typing import TYPE_CHECKING, Iterator, Sequence

import flax
import jax.numpy as jnp
import numpy as np

from jaxformer.nn.mask_structure import MaskSpec

if TYPE_CHECKING:
    import grain


def document_paths(patterns: Sequence[str]) -> list[str]:
    """The files the patterns name, each once, checked without reading them.

    A pattern is a path or a glob (matches sorted; `**` recursive). A pattern
    matching nothing, a missing file, a directory or an empty file is a
    ValueError naming it.
    """
    if isinstance(patterns, (str, os.PathLike)):
        patterns = [patterns]
    paths, seen = [], set()
    for pattern in map(os.fspath, patterns):
        if glob.has_magic(pattern):
            matches = sorted(glob.glob(pattern, recursive=True))
            if not matches:
                raise ValueError(f"data pattern {pattern!r} matches no file")
        else:
            matches = [pattern]
        for path in matches:
            if not os.path.exists(path):
                raise ValueError(f"data file {path!r} does not exist")
            if os.path.isdir(path):
                raise ValueError(f"data path {path!r} is a directory, not a file")
            if os.path.getsize(path) == 0:
                raise ValueError(f"data file {path!r} is empty")
            if os.path.realpath(path) not in seen:
                seen.add(os.path.realpath(path))
                paths.append(path)
    return paths


def read_documents(patterns: Sequence[str]) -> list[tuple[str, bytes]]:
    """[(path, bytes)] of every file the patterns name, each file one document.

    Every path is checked (`document_paths`) before any is read. The same file
    named twice is read once.
    """
    documents = []
    for path in document_paths(patterns):
        try:
            with open(path, "rb") as f:
                documents.append((path, f.read()))
        except OSError as e:
            raise ValueError(f"data file {path!r} cannot be read: {e}") from e
    return documents


@flax.struct.dataclass
class LMBatch:
    """A batch of packed windows, all (B, L) numpy arrays; a pytree."""

    inputs: np.ndarray     # int32 token ids fed to the model, PAD after the stream's end
    labels: np.ndarray     # int32 next-token targets
    weights: np.ndarray    # float32 1.0 where the label counts in the loss
    positions: np.ndarray  # int32 position within the segment, from 0
    segments: np.ndarray   # int32 segment (document run) in the row, 1, 2, ...; 0 = PAD


def segment_mask(segments_BL) -> jnp.ndarray:
    """(B, L) segments -> (B, 1, L, L) bool, True = may attend.

    Query t sees key s iff s <= t, both are in the same segment, and it is not
    PAD (0). Works on numpy input and on traced jnp arrays under jit.
    """
    seg = jnp.asarray(segments_BL)
    length = seg.shape[-1]
    same = (seg[:, :, None] == seg[:, None, :]) & (seg != 0)[:, None, :]
    return (same & jnp.tril(jnp.ones((length, length), bool)))[:, None]


def segment_mask_spec(segments_BL) -> MaskSpec:
    """`segment_mask` as structure (a MaskSpec, nothing (L, L) built): causal, same
    segment, and PAD keys (segment 0) hidden: they get segment -1, which no query has."""
    seg = jnp.asarray(segments_BL, jnp.int32)
    return MaskSpec(causal=True, q_segment_ids=seg, kv_segment_ids=jnp.where(seg == 0, -1, seg))


def pack_windows(tokens: np.ndarray, docs: np.ndarray, window_ids, seq_len: int) -> LMBatch:
    """LMBatch of the windows `window_ids` (see the module docstring) of a stream.

    `tokens` (N,) ids and `docs` (N,) document numbers must already be padded
    to at least (max window id + 1) * seq_len + 1 (PAD with document -1).
    """
    starts = np.asarray(window_ids, np.int64).reshape(-1, 1) * seq_len
    idx = starts + np.arange(seq_len + 1)                       # (B, L+1)
    tok, doc = tokens[idx], docs[idx]
    cols = np.broadcast_to(np.arange(seq_len + 1), idx.shape)
    new_run = np.ones(idx.shape, bool)
    new_run[:, 1:] = doc[:, 1:] != doc[:, :-1]
    segments = np.where(doc >= 0, np.cumsum(new_run, axis=1), 0).astype(np.int32)
    run_start = np.maximum.accumulate(np.where(new_run, cols, 0), axis=1)
    positions = np.where(doc >= 0, cols - run_start, 0).astype(np.int32)
    weights = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] != 0)
    return LMBatch(inputs=tok[:, :-1].astype(np.int32), labels=tok[:, 1:].astype(np.int32),
                   weights=weights.astype(np.float32), positions=positions[:, :-1],
                   segments=segments[:, :-1])


def _utf8_cut(data: bytes, cut: int) -> int:
    """`cut` in [1, len - 1] moved off UTF-8 continuation bytes (0b10xxxxxx):
    forward, else backward; 0 if the data is a single character (no cut)."""
    cut = min(max(cut, 1), len(data) - 1)
    forward = cut
    while 0 < forward < len(data) and (data[forward] & 0xC0) == 0x80:
        forward += 1
    if forward < len(data):
        return forward
    while cut > 0 and (data[cut] & 0xC0) == 0x80:
        cut -= 1
    return cut


class TextData:
    """The corpus of a run: documents tokenized, split into train / held-out, packed.

    Held-out split: with `eval_patterns`, those files (removed from the training
    files if the patterns also name them). Otherwise the last
    ceil(eval_fraction * n) documents of a shuffle seeded by `seed` (at least 1,
    and at least 1 left to train on). A single-document corpus is split inside:
    its first (1 - eval_fraction) of the bytes (at least 1 byte each side, moved
    to a UTF-8 character boundary) train as [BOS] + tokens, the rest is held out
    as tokens + [EOS]. `patterns=None` with `eval_patterns`: held-out data only
    (evaluation; no training windows).
    """

    def __init__(self, patterns, tokenizer, seq_len: int, *, eval_patterns=None,
                 eval_fraction: float = 0.05, seed: int = 0):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if not 0.0 < eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
        self.tokenizer, self.seq_len = tokenizer, seq_len
        self.vocab_size = tokenizer.vocab_size
        if patterns is None and eval_patterns is None:
            raise ValueError("no data: give training patterns, eval_patterns, or both")
        train_docs = read_documents(patterns) if patterns is not None else []
        if eval_patterns is not None:
            eval_docs = read_documents(eval_patterns)
            held = {os.path.realpath(name) for name, _ in eval_docs}
            train_docs = [d for d in train_docs if os.path.realpath(d[0]) not in held]
            if not train_docs and patterns is not None:
                raise ValueError("every training file is also a held-out file "
                                 "(eval_patterns): nothing left to train on")
            train, held_out = self._encode_all(train_docs), self._encode_all(eval_docs)
        elif len(train_docs) == 1:
            train, held_out = self._split_document(*train_docs[0], eval_fraction)
        else:
            order = np.random.default_rng(seed).permutation(len(train_docs))
            n_eval = min(max(math.ceil(eval_fraction * len(train_docs)), 1), len(train_docs) - 1)
            eval_set = set(order[len(order) - n_eval:].tolist())
            encoded = self._encode_all(train_docs)
            held_out = [encoded[i] for i in sorted(eval_set)]
            train = [d for i, d in enumerate(encoded) if i not in eval_set]
        self.train_names = [name for name, _, _ in train]
        self.eval_names = [name for name, _, _ in held_out]
        self.eval_bytes = b"".join(raw for _, raw, _ in held_out)
        self.train_bytes_count = sum(len(raw) for _, raw, _ in train)
        self._eval_docs = [ids for _, _, ids in held_out]
        self._train_stream, self.num_train_windows = (
            self._stream([ids for _, _, ids in train]) if train else (None, 0))
        self._eval_stream, self.num_eval_windows = self._stream(self._eval_docs)
        if self.num_eval_windows == 0:
            raise ValueError(f"the held-out split ({', '.join(self.eval_names)}) has no "
                             "token to predict")
        self._datasets = {}

    # -- building -------------------------------------------------------------

    def _encode(self, name: str, raw: bytes) -> np.ndarray:
        if getattr(self.tokenizer, "accepts_bytes", False):
            return self.tokenizer.encode(raw)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"data file {name!r} is not UTF-8 text ({e}); the byte "
                             "tokenizer (no --tokenizer) reads any bytes") from e
        return self.tokenizer.encode(text)

    def _encode_all(self, docs):
        """[(name, raw, [BOS] + ids + [EOS])]."""
        t = self.tokenizer
        return [(name, raw, np.concatenate([[t.bos_id], self._encode(name, raw), [t.eos_id]])
                 .astype(np.int32)) for name, raw in docs]

    def _split_document(self, name, raw, eval_fraction):
        cut = _utf8_cut(raw, round((1.0 - eval_fraction) * len(raw)))
        if cut == 0:
            raise ValueError(f"data file {name!r} is the only document and too short "
                             "to split into train and held-out parts")
        t = self.tokenizer
        head, tail = self._encode(name, raw[:cut]), self._encode(name, raw[cut:])
        return ([(name, raw[:cut], np.concatenate([[t.bos_id], head]).astype(np.int32))],
                [(name, raw[cut:], np.concatenate([tail, [t.eos_id]]).astype(np.int32))])

    def _stream(self, docs):
        """(tokens, document numbers) padded to whole windows, and the window count."""
        tokens = np.concatenate(docs).astype(np.int32)
        doc = np.repeat(np.arange(len(docs), dtype=np.int32), [len(d) for d in docs])
        n_windows = -(-(len(tokens) - 1) // self.seq_len)  # ceil; every label once
        pad = n_windows * self.seq_len + 1 - len(tokens)
        tokens = np.concatenate([tokens, np.full(pad, self.tokenizer.pad_id, np.int32)])
        return (tokens, np.concatenate([doc, np.full(pad, -1, np.int32)])), n_windows

    # -- training batches -----------------------------------------------------

    def check_batch_size(self, batch_size: int, process_count: int = 1) -> None:
        """ValueError unless `batch_size` splits over the processes and fits the corpus."""
        if batch_size < 1 or process_count < 1 or batch_size % process_count:
            raise ValueError(f"batch size {batch_size} must be a positive multiple of the "
                             f"process count {process_count}")
        if self.num_train_windows < batch_size:
            raise ValueError(
                f"the training data ({self.train_bytes_count} bytes, "
                f"{self.num_train_windows} windows of {self.seq_len} tokens) is too small "
                f"for one batch of {batch_size}: add data or lower the batch size / seq_len")

    def train_dataset(self, batch_size: int, seed: int, *, process_index: int = 0,
                      process_count: int = 1) -> grain.MapDataset:
        """dataset[step] = this process's LMBatch (batch_size // process_count, L) of a step.

        The global window order is an endless concatenation of epochs, each a
        fresh permutation of all windows (grain reseeds the shuffle per epoch);
        global batch s is windows [s * B, (s + 1) * B) of that order and process
        p takes rows [p * B / P, (p + 1) * B / P) of it. Random access: resuming
        at step s is exact with no iterator state.
        """
        self.check_batch_size(batch_size, process_count)
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index {process_index} not in [0, {process_count})")
        if not 0 <= seed < 2 ** 32:
            raise ValueError(f"seed must be in [0, 2**32), got {seed}")
        key = (batch_size, seed, process_index, process_count)
        if key not in self._datasets:
            # Imported here: only the training loop reads batches, and `jaxformer.train`
            # (its step functions: benchmarks, an accelerator image without grain)
            # should not pay grain's 0.7 s import.
            import grain

            stream, seq_len = self._train_stream, self.seq_len
            dataset = (
                grain.MapDataset.range(self.num_train_windows)
                .shuffle(seed=seed)
                .repeat()                                  # epoch e reshuffles with seed + e
                .batch(batch_size // process_count,
                       batch_fn=lambda ids: pack_windows(*stream, ids, seq_len)))
            # One process takes every batch (and grain cannot slice the endless
            # dataset of batch size 1: its length overflows an index).
            self._datasets[key] = dataset if process_count == 1 else dataset.slice(
                slice(process_index, None, process_count))
        return self._datasets[key]

    def train_batch(self, step: int, batch_size: int, seed: int, *, process_index: int = 0,
                    process_count: int = 1) -> LMBatch:
        """`train_dataset(...)[step]` (the dataset is cached)."""
        return self.train_dataset(batch_size, seed, process_index=process_index,
                                  process_count=process_count)[step]

    # -- held-out -------------------------------------------------------------

    def eval_batches(self, batch_size: int) -> Iterator[LMBatch]:
        """Every held-out window once, in order, in (batch_size, L) batches.

        The last batch is filled with all-PAD rows (weights 0, segments 0).
        """
        if batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {batch_size}")
        for start in range(0, self.num_eval_windows, batch_size):
            ids = np.arange(start, min(start + batch_size, self.num_eval_windows))
            batch = pack_windows(*self._eval_stream, ids, self.seq_len)
            missing = batch_size - len(ids)
            if missing:
                batch = LMBatch(**{
                    f: np.concatenate([getattr(batch, f), np.full(
                        (missing, self.seq_len), self.tokenizer.pad_id if f in ("inputs", "labels")
                        else 0, getattr(batch, f).dtype)])
                    for f in ("inputs", "labels", "weights", "positions", "segments")})
            yield batch

    def eval_prompts(self, count: int, length: int) -> list[np.ndarray]:
        """The first `length` tokens (BOS included) of the first `count` held-out documents.

        Fewer prompts if there are fewer documents; a prompt is shorter if its
        document is (the final EOS is never part of a prompt).
        """
        return [doc[:-1][:length].copy() for doc in self._eval_docs[:count]]

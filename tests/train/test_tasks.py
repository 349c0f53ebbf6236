"""Synthetic tasks: targets against plain-Python references, per-example lengths,
the held-out split (a pure-Python hash reference, disjointness from the stream)."""

import jax
import numpy as np
import pytest

from jaxformer.train import tasks
from jaxformer.train.tasks import Batch, is_heldout, make_task, sequence_hash

KEY = jax.random.PRNGKey(0)


def reference_target(name, seq):
    return {"copy": list(seq), "reverse": list(seq)[::-1], "sort": sorted(seq)}[name]


def unpad(row, pad=0):
    row = [int(t) for t in row]
    return row[:row.index(pad)] if pad in row else row


@pytest.mark.parametrize("name", ["copy", "reverse", "sort"])
def test_batch_layout_matches_reference(name):
    task = make_task(name, vocab_size=12, min_len=1, max_len=7)
    batch = jax.device_get(task.sample(KEY, 64))
    assert batch.src.shape == (64, 7) and batch.tgt_in.shape == batch.labels.shape == (64, 8)
    for src, tgt_in, labels in zip(*batch):
        seq = unpad(src)
        assert 1 <= len(seq) <= 7 and all(3 <= t < 12 for t in seq)
        assert all(t == 0 for t in src[len(seq):])  # PAD only after the sequence
        target = reference_target(name, seq)
        assert tgt_in.tolist() == [1] + target + [0] * (7 - len(seq))
        assert labels.tolist() == target + [2] + [0] * (7 - len(seq))


def test_lengths_vary_per_example_and_cover_the_range():
    task = make_task("copy", min_len=2, max_len=6)
    lengths = (np.asarray(task.sample(KEY, 512).src) != 0).sum(1)
    assert set(lengths.tolist()) == {2, 3, 4, 5, 6}


def test_sort_keeps_duplicates():
    task = make_task("sort", vocab_size=5, min_len=6, max_len=6)  # 2 content ids: repeats
    batch = jax.device_get(task.sample(KEY, 16))
    for src, labels in zip(batch.src, batch.labels):
        assert labels[:6].tolist() == sorted(src.tolist())


def test_batches_are_a_pure_function_of_the_key():
    task = make_task("copy")
    first = jax.device_get(task.train_batch(jax.random.PRNGKey(3), 32))
    again = jax.device_get(task.train_batch(jax.random.PRNGKey(3), 32))
    other = jax.device_get(task.train_batch(jax.random.PRNGKey(4), 32))
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(first.src, other.src)


def python_hash(row):
    """FNV-1a over the ids, murmur3 fmix32: an independent pure-Python reference."""
    h = 2166136261
    for t in row:
        h = ((h ^ int(t)) * 16777619) & 0xFFFFFFFF
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def test_hash_matches_python_reference_and_splits_about_one_in_sixteen():
    src = np.asarray(make_task("copy").sample(KEY, 4000).src)
    hashes = np.asarray(sequence_hash(src))
    assert [python_hash(r) for r in src[:50]] == hashes[:50].tolist()
    held = np.asarray(is_heldout(src))
    np.testing.assert_array_equal(held, hashes % 16 == 0)
    assert 0.04 < held.mean() < 0.09


def test_training_stream_and_heldout_set_are_disjoint():
    task = make_task("copy")
    heldout = task.heldout_set(300)
    held_rows = {r.tobytes() for r in heldout.src}
    assert len(held_rows) == 300  # distinct
    assert np.asarray(is_heldout(heldout.src)).all()
    seen = set()
    for step in range(20):
        src = np.asarray(task.train_batch(jax.random.fold_in(KEY, step), 256).src)
        assert not np.asarray(is_heldout(src)).any()
        seen |= {r.tobytes() for r in src}
    assert not seen & held_rows
    # The split is a property of the sequence: the raw distribution does reach
    # the held-out sequences, so removing them is what keeps the stream clean.
    raw = np.asarray(task.sample(KEY, 4096).src)
    assert np.asarray(is_heldout(raw)).any()


def test_heldout_set_is_reproducible():
    task = make_task("reverse", max_len=8)
    a, b = task.heldout_set(50), task.heldout_set(50)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    for src, labels in zip(a.src, a.labels):
        seq = unpad(src)
        assert labels[:len(seq) + 1].tolist() == seq[::-1] + [2]


def test_train_batch_falls_back_to_empty_rows_if_all_candidates_are_held_out(monkeypatch):
    monkeypatch.setattr(tasks, "HELDOUT_BUCKETS", 1)  # every sequence is held out
    # A task used nowhere else: its jitted train_batch is traced under the patch.
    batch = jax.device_get(make_task("copy", max_len=9).train_batch(KEY, 8))
    assert (batch.src == 0).all() and (batch.labels == 0).all()
    assert (batch.tgt_in[:, 0] == 1).all() and (batch.tgt_in[:, 1:] == 0).all()


def test_heldout_set_of_a_tiny_task_gives_a_clear_error():
    task = make_task("copy", vocab_size=5, min_len=1, max_len=1)  # 2 sequences in all
    with pytest.raises(ValueError, match="too few distinct"):
        task.heldout_set(10)


@pytest.mark.parametrize("kwargs, match", [
    (dict(name="shuffle"), "task must be one of"),
    (dict(vocab_size=4), "vocab_size"),
    (dict(min_len=0), "min_len"),
    (dict(min_len=5, max_len=3), "max_len"),
    (dict(pad_id=1), "distinct"),
], ids=["unknown-task", "vocab-too-small", "min-len-zero", "max-below-min", "special-ids"])
def test_bad_task_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_task(**kwargs)


def test_batch_is_a_pytree():
    batch = make_task("copy").sample(KEY, 2)
    assert isinstance(batch, Batch) and len(jax.tree_util.tree_leaves(batch)) == 3


def test_fit_trains_on_the_task_object_it_is_given():
    """`fit(task=...)` trains on the object, not on the name in the TrainConfig: a
    "reverse" task given under a config that says "copy" trains exactly as the run
    named "reverse" (copy's batches would give other losses)."""
    import jaxformer as jf
    from jaxformer.train import TrainConfig, fit, training_task

    model = jf.tiny(num_encoder_layers=1, num_decoder_layers=1)
    copy = TrainConfig(task="copy", steps=3, batch_size=8, warmup_steps=1, max_len=6)
    reverse = copy.replace(task="reverse")
    named = fit(model, reverse, progress=False, log_every=1)
    given = fit(model, copy, task=training_task(model, reverse), progress=False, log_every=1)
    assert given.task.name == "reverse"
    assert [r["loss"] for r in given.history] == [r["loss"] for r in named.history]


def test_a_task_name_maps_to_one_task_type():
    from jaxformer.nn.model import DecoderOnlyLM, Transformer
    from jaxformer.train.task import SyntheticTask, TextTask, task_type, trains_language_model

    assert task_type("lm") is TextTask and trains_language_model("lm")
    assert task_type("reverse") is SyntheticTask and not trains_language_model("sort")
    assert TextTask.model_class is DecoderOnlyLM and SyntheticTask.model_class is Transformer
    with pytest.raises(ValueError, match="unknown task 'copyy' .*copy, reverse, sort, lm"):
        task_type("copyy")


def test_successive_training_batches_differ_and_a_seed_repeats_its_stream():
    """Guards a synthetic task that draws the same batch at every step (the loss still
    falls, so nothing else notices): the batches of steps 0, 1, 2 of one seed all differ,
    the same seed gives the same stream, and another seed another stream."""
    import jaxformer as jf
    from jaxformer.train import TrainConfig, training_task

    model = jf.tiny(num_encoder_layers=1, num_decoder_layers=1)
    task = training_task(model, TrainConfig(task="copy", batch_size=8, max_len=6))

    def stream(seed):
        return [jax.device_get(task.device_batch(seed, step)).src for step in range(3)]

    first = stream(0)
    for earlier in range(3):
        for later in range(earlier + 1, 3):
            assert not np.array_equal(first[earlier], first[later]), (earlier, later)
    for again, original in zip(stream(0), first):
        np.testing.assert_array_equal(again, original)
    assert not any(np.array_equal(a, b) for a, b in zip(stream(1), first))


def test_fit_trains_step_s_on_the_batch_of_step_s():
    """Guards the training loop asking for one step's batch at every step: the steps
    `fit` trains on are 0, 1, 2, in order (step 0's batch is drawn once more before, to
    compile the step)."""
    import dataclasses

    import jaxformer as jf
    from jaxformer.train import TrainConfig, fit, training_task
    from jaxformer.train.task import SyntheticTask

    drawn_steps = []

    @dataclasses.dataclass(frozen=True)
    class RecordingTask(SyntheticTask):
        def device_batch(self, seed, step):
            jax.debug.callback(lambda s: drawn_steps.append(int(s)), step, ordered=True)
            return super().device_batch(seed, step)

    model = jf.tiny(num_encoder_layers=1, num_decoder_layers=1)
    tc = TrainConfig(task="copy", steps=3, batch_size=8, warmup_steps=1, max_len=6)
    base = training_task(model, tc)
    fit(model, tc, task=RecordingTask(base.task, base.batch_size), progress=False,
        log_every=1)
    jax.effects_barrier()
    assert drawn_steps[-3:] == [0, 1, 2] and set(drawn_steps) == {0, 1, 2}

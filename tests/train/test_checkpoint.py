"""Checkpoints: Ctrl-C saves, resume == uninterrupted (bitwise), and missing,
corrupt or mismatched checkpoints give a clear error and change nothing."""

import gc
import os
import shutil
import signal
import time

import jax
import pytest

import jaxformer as jf
from conftest import snapshot, tree_equal
from jaxformer.train.checkpoint import (UNFINISHED_MARK, CheckpointDamaged, CheckpointError,
                                        Checkpoints)
from jaxformer.train import fit, train_functions, TrainConfig

# Dropout on at every site: resuming must also replay the dropout masks bit for bit.
MODEL = jf.tiny(num_encoder_layers=1, num_decoder_layers=1, attention_dropout=0.1,
                residual_dropout=0.1, embedding_dropout=0.1, ffn_dropout=0.1)
TRAIN = TrainConfig(max_len=6, steps=12, batch_size=8, warmup_steps=2, learning_rate=1e-2)




@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    directory = tmp_path_factory.mktemp("uninterrupted")
    return fit(MODEL, TRAIN, checkpoint_dir=str(directory), save_every=4, progress=False), \
        directory


def test_ctrl_c_saves_and_resume_equals_uninterrupted_bitwise(uninterrupted, tmp_path):
    full, _ = uninterrupted

    def press_ctrl_c(step):
        if step == 5:
            signal.raise_signal(signal.SIGINT)  # what the terminal sends on Ctrl-C

    first = fit(MODEL, TRAIN, checkpoint_dir=str(tmp_path), save_every=4, progress=False,
                on_step=press_ctrl_c)
    assert first.interrupted and int(first.state.step) == 5
    with Checkpoints(tmp_path) as checkpoints:
        assert checkpoints.steps() == [4, 5]  # periodic + the one Ctrl-C wrote
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored

    resumed = fit(MODEL, TRAIN, checkpoint_dir=str(tmp_path), resume=True, save_every=4,
                  progress=False)
    assert resumed.start_step == 5 and not resumed.interrupted
    assert int(resumed.state.step) == TRAIN.steps
    assert tree_equal(resumed.state.params, full.state.params)
    assert tree_equal(resumed.state.opt_state, full.state.opt_state)
    assert resumed.history == full.history[5:]  # same losses, step by step
    # A run with another seed, or without dropout, would differ: the equality above
    # is not vacuous.
    other = fit(MODEL, TRAIN.replace(seed=1), progress=False)
    assert not tree_equal(other.state.params, full.state.params)
    no_dropout = MODEL.replace(attention_dropout=0.0, residual_dropout=0.0,
                               embedding_dropout=0.0, ffn_dropout=0.0)
    assert not tree_equal(fit(no_dropout, TRAIN, progress=False).state.params,
                          full.state.params)


def test_restore_roundtrip_is_bitwise(uninterrupted):
    full, directory = uninterrupted
    fns = train_functions(MODEL, TRAIN)
    with Checkpoints(directory) as checkpoints:
        assert checkpoints.latest_step() == TRAIN.steps
        restored = checkpoints.restore(fns.init(7))  # the target only gives structure
    assert tree_equal(restored.params, full.state.params)
    assert int(restored.step) == TRAIN.steps
    assert all(x.sharding.is_fully_replicated for x in jax.tree_util.tree_leaves(restored))


def test_resume_without_checkpoint_is_refused_and_creates_nothing(tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(CheckpointError, match="no checkpoint directory"):
        fit(MODEL, TRAIN, checkpoint_dir=str(missing), resume=True, progress=False)
    assert not missing.exists()
    with pytest.raises(CheckpointError, match="no checkpoint found"):
        fit(MODEL, TRAIN, checkpoint_dir=str(tmp_path), resume=True, progress=False)
    assert os.listdir(tmp_path) == []


# A read left in flight (its late callback into Orbax's closed event loop, its
# coroutine collected) is an "unraisable" exception: pytest reports it as this
# warning, made an error here.
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_corrupt_checkpoint_is_refused_and_left_untouched(uninterrupted, tmp_path, capfd):
    """Refused quietly: the corrupt index is read alone, before Orbax's concurrent
    reads (whose late failures printed hundreds of "Event loop is closed" lines)."""
    _, directory = uninterrupted
    corrupt = tmp_path / "run"
    os.makedirs(corrupt)
    step_dir = directory / str(TRAIN.steps)
    # Copy the last checkpoint, then overwrite its array data with garbage.
    for relative, data in snapshot(step_dir).items():
        target = corrupt / str(TRAIN.steps) / relative
        os.makedirs(target.parent, exist_ok=True)
        garbage = "metadata" not in relative.lower()
        target.write_bytes(b"\x00garbage" * 8 if garbage else data)
    before = snapshot(corrupt)
    capfd.readouterr()
    with pytest.raises(CheckpointError, match=f"{corrupt}.*array index cannot be read"):
        fit(MODEL, TRAIN, checkpoint_dir=str(corrupt), resume=True, progress=False)
    gc.collect()
    time.sleep(0.2)  # time for late callbacks, had any read been left running
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Event loop is closed" not in err
    assert len(err.splitlines()) < 5, err
    assert snapshot(corrupt) == before


def _damage(step_dir):
    """Overwrite the array data of a saved step with garbage (its metadata kept)."""
    for root, _, files in os.walk(step_dir):
        for name in files:
            if "metadata" not in name.lower():
                with open(os.path.join(root, name), "wb") as f:
                    f.write(b"\x00garbage" * 8)


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_damaged_latest_step_names_the_one_that_restores_and_fallback_resumes_it(
        uninterrupted, tmp_path, capfd):
    full, directory = uninterrupted
    run = tmp_path / "run"
    shutil.copytree(directory, run)
    _damage(run / str(TRAIN.steps))
    before = snapshot(run)
    capfd.readouterr()
    with pytest.raises(CheckpointDamaged) as refused:
        fit(MODEL, TRAIN, checkpoint_dir=str(run), resume=True, progress=False)
    message = str(refused.value)
    assert f"{run}/{TRAIN.steps} is corrupt" in message and "step 8 restores" in message
    assert len(message.splitlines()) == 1 and len(message) < 400, message
    assert snapshot(run) == before  # refusing changes nothing
    # --resume --fallback: continues from step 8, replays steps 9-12 exactly, keeps the
    # damaged step aside.
    resumed = fit(MODEL, TRAIN, checkpoint_dir=str(run), resume=True, progress=False,
                  fallback=True)
    assert resumed.start_step == 8
    assert tree_equal(resumed.state.params, full.state.params)
    assert (run / f"{TRAIN.steps}.damaged").is_dir()
    with Checkpoints(run) as checkpoints:
        assert checkpoints.latest_step() == TRAIN.steps  # saved anew
    assert "Traceback" not in capfd.readouterr().err


def test_unfinished_saves_of_a_killed_run_are_removed_on_the_next_start(uninterrupted,
                                                                       tmp_path, capfd):
    full, directory = uninterrupted
    run = tmp_path / "run"
    shutil.copytree(directory, run)
    stale = run / f"16{UNFINISHED_MARK}-1764000000"  # what a save killed midway leaves
    os.makedirs(stale / "default")
    (stale / "default" / "data").write_bytes(b"partial")
    kept = run / "notes.txt"  # anything else a user put there stays
    kept.write_text("mine")
    fit(MODEL, TRAIN, checkpoint_dir=str(run), resume=True, progress=False)
    assert not stale.exists() and kept.read_text() == "mine"
    assert f"removed {stale}" in capfd.readouterr().err
    with Checkpoints(run) as checkpoints:
        assert TRAIN.steps in checkpoints.steps()


def test_checkpoint_of_another_model_is_refused(uninterrupted, capfd):
    """Refused before any array is read, naming each differing entry by its path
    (missing, unexpected, mis-shaped), with no traceback from the storage library."""
    _, directory = uninterrupted
    before = snapshot(directory)
    wider = MODEL.replace(d_model=2 * MODEL.d_model)
    deeper = MODEL.replace(num_decoder_layers=MODEL.num_decoder_layers + 1)
    last = f"layers_{MODEL.num_decoder_layers}"
    with Checkpoints(directory) as checkpoints:
        with pytest.raises(CheckpointError, match="does not match") as wide:
            checkpoints.restore(train_functions(wider, TRAIN).init(0))
        with pytest.raises(CheckpointError, match="does not match") as deep:
            checkpoints.restore(train_functions(deeper, TRAIN).init(0))
    d, h = MODEL.d_model, MODEL.num_heads
    assert (f"params/decoder/layers_0/cross_attn/key/kernel: saved ({d}, {h}, {d // h}) float32, "
            f"the train state has ({2 * d}, {h}, {2 * d // h}) float32") in str(wide.value)
    assert f"missing from the checkpoint: params/decoder/{last}/cross_attn/key/bias" in str(
        deep.value)
    assert "not in the train state" not in str(deep.value)
    assert "Traceback" not in capfd.readouterr().err
    assert snapshot(directory) == before


def test_bad_max_to_keep_is_refused(tmp_path):
    with pytest.raises(ValueError, match="max_to_keep"):
        Checkpoints(tmp_path, max_to_keep=0)

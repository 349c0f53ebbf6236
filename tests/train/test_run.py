"""`jaxformer.train.run.Run`: a run directory as a library object. Its config round-trips,
its latest parameters restore without a model or an optimizer, bad directories are one
RunError naming the file."""

import json
import os

import jax
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.text import ByteTokenizer
from jaxformer.train import TrainConfig, fit
from jaxformer.train.run import CHAT_TEMPLATE, CONFIG, Run, RunError

MODEL = jf.tiny(num_encoder_layers=1, num_decoder_layers=1)
TRAIN = TrainConfig(task="copy", steps=3, batch_size=8, warmup_steps=1, max_len=6)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(run, the FitResult whose checkpoints it holds)."""
    out = str(tmp_path_factory.mktemp("run"))
    run = Run.create(out, MODEL, TRAIN, preset="tiny", mesh="data=1")
    result = fit(MODEL, TRAIN, checkpoint_dir=run.checkpoint_dir, progress=False)
    return run, result


def test_create_then_open_round_trips_the_configs(trained):
    run, _ = trained
    opened = Run.open(run.directory)
    assert (opened.model_config, opened.train_config) == (MODEL, TRAIN)
    assert opened.saved["preset"] == "tiny" and opened.init is None
    assert not opened.trains_language_model and opened.has_checkpoint()


def test_latest_params_equal_the_trained_ones_without_model_or_optimizer(trained,
                                                                        monkeypatch):
    import jaxformer.train.loop as loop  # noqa: PLC0415
    import jaxformer.train.optimizer as optimizer  # noqa: PLC0415

    def forbidden(*args, **kwargs):
        raise AssertionError("latest_params built training code")

    monkeypatch.setattr(optimizer, "make_optimizer", forbidden)
    monkeypatch.setattr(loop, "train_functions", forbidden)
    run, result = trained
    params = Run.open(run.directory).latest_params()
    want = jax.device_get(result.state.params)
    got = jax.device_get(params)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(got),
                                                    jax.tree_util.tree_leaves(want)))


def test_the_run_s_tokenizer_and_chat_template(trained, tmp_path):
    run, _ = trained
    assert isinstance(run.tokenizer(), ByteTokenizer) and run.chat_template() is None
    copy = Run.create(str(tmp_path), MODEL, TRAIN)
    (tmp_path / CHAT_TEMPLATE).write_text("{{ bos_token }}")
    assert copy.chat_template() == "{{ bos_token }}"


def test_bad_directories_are_one_run_error_naming_the_file(tmp_path):
    with pytest.raises(RunError, match=f"{CONFIG} does not exist"):
        Run.open(str(tmp_path))
    (tmp_path / CONFIG).write_text("{not json")
    with pytest.raises(RunError, match="is not a valid run config"):
        Run.open(str(tmp_path))
    (tmp_path / CONFIG).write_text(json.dumps({"model": MODEL.to_dict()}))
    with pytest.raises(RunError, match="is not a valid run config"):
        Run.open(str(tmp_path))
    run = Run.create(str(tmp_path), MODEL, TRAIN)
    checkpoints = os.path.join(str(tmp_path), "checkpoints")
    with pytest.raises(RunError, match=f"no checkpoint in {checkpoints}"):
        run.latest_params()
    fine_tuned = Run(str(tmp_path), MODEL, TRAIN, {"init": {"path": "x", "tokenizer": "t.json"}})
    with pytest.raises(RunError, match="cannot load the run's tokenizer: .*t.json is missing"):
        fine_tuned.tokenizer()

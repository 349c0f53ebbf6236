"""`jaxformer.train.run.Run`: a run directory as a library object. Its config round-trips,
its latest parameters restore without a model or an optimizer, bad directories are one
RunError naming the file."""

import json
import os

import jax
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.text import ByteTokenizer, byte_tokenizer
from jaxformer.train import TrainConfig, fit
from jaxformer.train.run import CHAT_TEMPLATE, CONFIG, TOKENIZER, Conflict, Run, RunError

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


def test_resume_conflicts_name_each_value_that_differs_and_nothing_else(trained):
    run = Run.open(trained[0].directory)
    assert run.resume_conflicts(preset="tiny", model={"d_model": MODEL.d_model, "norm": None},
                                train={"steps": TRAIN.steps, "max_len": TRAIN.max_len}) == []
    # max_len is a field of both configs: each is compared with its own section
    got = run.resume_conflicts(preset="copy_task", init="x",
                               model={"d_model": 2 * MODEL.d_model, "max_len": MODEL.max_len},
                               train={"steps": 4, "max_len": TRAIN.max_len + 1})
    assert got == [Conflict("run", "preset", "copy_task", "tiny"),
                   Conflict("model", "d_model", 2 * MODEL.d_model, MODEL.d_model),
                   Conflict("train", "steps", 4, TRAIN.steps),
                   Conflict("train", "max_len", TRAIN.max_len + 1, TRAIN.max_len),
                   Conflict("run", "init", "x", None)]


def test_a_fine_tuning_run_holds_its_copies_and_stands_alone(tmp_path, monkeypatch):
    pytest.importorskip("tokenizers")
    lm = jf.tiny(num_encoder_layers=0, num_decoder_layers=1, src_vocab_size=259,
                 tgt_vocab_size=259)
    train = TrainConfig(task="lm", steps=3, batch_size=8, warmup_steps=1, data=("x.txt",))
    pretrained = tmp_path / "pretrained"
    run = Run.create(str(tmp_path / "run"), lm, train, init=str(pretrained),
                     init_tokenizer=byte_tokenizer(), chat_template="{{ bos_token }}hi")
    assert sorted(os.listdir(run.directory)) == [CHAT_TEMPLATE, CONFIG, TOKENIZER]
    opened = Run.open(run.directory)
    assert opened.init == {"path": str(pretrained), "tokenizer": TOKENIZER}
    assert opened.chat_template() == "{{ bos_token }}hi"
    assert opened.hf_tokenizer().to_str() == byte_tokenizer().to_str()  # as it was given
    assert opened.tokenizer().encode("hi").tolist() == ByteTokenizer().encode("hi").tolist()
    monkeypatch.chdir(tmp_path)  # the same checkpoint named relatively: no conflict
    assert opened.resume_conflicts(init="pretrained") == []
    assert opened.resume_conflicts(init="other")[0].saved == str(pretrained)
    with pytest.raises(ValueError, match="needs the pretrained tokenizer"):
        Run.create(str(tmp_path / "bad"), lm, train, init=str(pretrained))


def test_hf_tokenizer_of_a_trained_run_starts_texts_with_bos(trained):
    pytest.importorskip("tokenizers")
    ids = Run.open(trained[0].directory).hf_tokenizer().encode("ab").ids
    assert ids == [MODEL.bos_id] + ByteTokenizer().encode("ab").tolist()

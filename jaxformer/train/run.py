"""A run directory of `jaxformer train`, as a library object: `Run`.

A run directory holds::

    config.json          {"model": TransformerConfig, "train": TrainConfig, "preset",
                          "mesh", "processes"; fine-tuning runs: "init": {"path",
                          "tokenizer"}}: what `--resume` and every reader start from
    checkpoints/<step>/  Orbax checkpoints of the TrainState (`Checkpoints`)
    tokenizer.json       fine-tuning runs: the pretrained model's tokenizer
    chat_template.jinja  fine-tuning runs: its chat template, if it has one
    metrics.jsonl, summary.json, loss.png, attention.png, train.lock (while training)

`Run.create` writes the config (and a fine-tuning run's copies of the pretrained
tokenizer and chat template); `Run.open` reads and checks it; `resume_conflicts`
says what a request to continue the run asks differently; `latest_params()`
restores the newest checkpoint's parameters from the checkpoint's own structure
(neither the model nor the optimizer is built); `tokenizer()`, `hf_tokenizer()` and
`chat_template()` are what the run trained with. Every problem is a `RunError`
naming the file (damaged checkpoints: `CheckpointError`, as `Checkpoints` raises).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional

from jaxformer.config import TransformerConfig
from jaxformer.train.checkpoint import Checkpoints
from jaxformer.train.task import trains_language_model
from jaxformer.train.train_config import TrainConfig

CONFIG = "config.json"
CHECKPOINTS = "checkpoints"
TOKENIZER = "tokenizer.json"
CHAT_TEMPLATE = "chat_template.jinja"


class RunError(ValueError):
    """A run directory is missing, its config.json is not valid, or it has no checkpoint."""


@dataclasses.dataclass(frozen=True)
class Conflict:
    """One value a request to continue a run gives differently from its config.json.

    `section`: "model" (a TransformerConfig field), "train" (a TrainConfig field) or
    "run" ("preset", "init": the pretrained checkpoint's path)."""

    section: str
    field: str
    given: Any
    saved: Any


@dataclasses.dataclass(frozen=True)
class Run:
    """One run directory: its path and the configs of its config.json (`saved`: the
    whole file as read)."""

    directory: str
    model_config: TransformerConfig
    train_config: TrainConfig
    saved: dict

    @classmethod
    def create(cls, directory: str, model_config: TransformerConfig,
               train_config: TrainConfig, *, init: Optional[str] = None,
               init_tokenizer=None, chat_template: Optional[str] = None, **extra) -> "Run":
        """Write `directory`/config.json ({"model", "train"} and `extra`, e.g. preset,
        mesh, processes) and return the run.

        A fine-tuning run (`init`: the pretrained checkpoint's path) stands alone: its
        `init_tokenizer` (a `tokenizers.Tokenizer`) is copied to tokenizer.json and its
        `chat_template`, if any, to chat_template.jinja, before config.json names them.
        """
        saved = {"model": model_config.to_dict(), "train": train_config.to_dict(), **extra}
        os.makedirs(directory, exist_ok=True)
        if init is not None:
            if init_tokenizer is None:
                raise ValueError("a fine-tuning run (init) needs the pretrained tokenizer")
            init_tokenizer.save(os.path.join(directory, TOKENIZER))
            if chat_template is not None:
                with open(os.path.join(directory, CHAT_TEMPLATE), "w") as f:
                    f.write(chat_template)
            saved["init"] = {"path": os.path.abspath(init), "tokenizer": TOKENIZER}
        with open(os.path.join(directory, CONFIG), "w") as f:
            json.dump(saved, f, indent=2)
        return cls(os.fspath(directory), model_config, train_config, saved)

    @classmethod
    def open(cls, directory: str) -> "Run":
        """The run of `directory`; RunError if config.json is missing or not valid."""
        path = os.path.join(directory, CONFIG)
        if not os.path.isfile(path):
            raise RunError(f"{path} does not exist (not a run directory)")
        try:
            with open(path) as f:
                saved = json.load(f)
            return cls(os.fspath(directory), TransformerConfig.from_dict(saved["model"]),
                       TrainConfig.from_dict(saved["train"]), saved)
        except (ValueError, KeyError, TypeError) as error:
            raise RunError(f"{path} is not a valid run config: {error}") from error

    @property
    def checkpoint_dir(self) -> str:
        return os.path.join(self.directory, CHECKPOINTS)

    @property
    def trains_language_model(self) -> bool:
        """A decoder-only LM run (what generate, eval and export take)."""
        return trains_language_model(self.train_config.task)

    @property
    def init(self) -> Optional[dict]:
        """A fine-tuning run's {"path": the pretrained checkpoint, "tokenizer": file}."""
        return self.saved.get("init")

    @property
    def config_path(self) -> str:
        return os.path.join(self.directory, CONFIG)

    def resume_conflicts(self, *, preset: Optional[str] = None, init: Optional[str] = None,
                         model: Optional[dict] = None,
                         train: Optional[dict] = None) -> list[Conflict]:
        """What continuing this run with these values would change, in the order given:
        `preset`, `model` (TransformerConfig field -> value), `train` (TrainConfig field
        -> value), `init` (a path, compared absolute). A value not given (None, or a
        field left out) is the saved one; an empty list: the run continues as saved."""
        conflicts = []
        if preset is not None and preset != self.saved.get("preset"):
            conflicts.append(Conflict("run", "preset", preset, self.saved.get("preset")))
        for section, config, given in (("model", self.model_config, model or {}),
                                       ("train", self.train_config, train or {})):
            conflicts += [Conflict(section, field, value, getattr(config, field))
                          for field, value in given.items()
                          if value is not None and getattr(config, field) != value]
        saved_init = (self.init or {}).get("path")
        if init is not None and os.path.abspath(init) != saved_init:
            conflicts.append(Conflict("run", "init", init, saved_init))
        return conflicts

    def has_checkpoint(self) -> bool:
        if not os.path.isdir(self.checkpoint_dir):
            return False
        with Checkpoints(self.checkpoint_dir, create=False) as checkpoints:
            return bool(checkpoints.steps())

    def latest_params(self) -> Any:
        """The parameters of the newest checkpoint that restores, on the first device.

        Restored into the checkpoint's own structure: no model is initialised and no
        optimizer built. RunError without a checkpoint; CheckpointError if damaged.
        """
        if not self.has_checkpoint():
            raise RunError(f"no checkpoint in {self.checkpoint_dir}")
        with Checkpoints(self.checkpoint_dir, create=False) as checkpoints:
            return checkpoints.restore(checkpoints.saved_structure())["params"]

    def tokenizer(self):
        """The tokenizer the run trained with (`jaxformer.text`): a fine-tuning run's copy
        of the pretrained tokenizer.json, with the model's special ids; else the train
        config's (`--tokenizer` file, or bytes). RunError if it cannot be loaded."""
        from jaxformer.text import JSONTokenizer, training_tokenizer  # noqa: PLC0415

        try:
            if self.init is None:
                return training_tokenizer(self.train_config.tokenizer)
            from tokenizers import Tokenizer  # noqa: PLC0415 - optional

            path = os.path.join(self.directory, self.init["tokenizer"])
            if not os.path.isfile(path):
                raise ValueError(f"{path} is missing (the fine-tuned model's tokenizer)")
            c = self.model_config
            return JSONTokenizer.wrap(Tokenizer.from_file(path), pad_id=c.pad_id,
                                      bos_id=c.bos_id, eos_id=c.eos_id,
                                      vocab_size=c.tgt_vocab_size, name=path)
        except Exception as error:  # noqa: BLE001 (tokenizers raises plain Exceptions)
            raise RunError(f"{self.directory}: cannot load the run's tokenizer: "
                           f"{error}") from error

    def hf_tokenizer(self):
        """The run's tokenizer as a `tokenizers.Tokenizer` (what a Hugging Face directory
        holds): a fine-tuning run's copy as the pretrained model had it; else one that
        starts every text with BOS, as the run saw its documents: bytes, or the
        `--tokenizer` file. RunError if it cannot be loaded."""
        try:
            import tokenizers  # noqa: PLC0415 - optional

            from jaxformer.text import JSONTokenizer, byte_tokenizer, with_bos  # noqa: PLC0415

            if self.init is not None:
                return tokenizers.Tokenizer.from_file(
                    os.path.join(self.directory, self.init["tokenizer"]))
            if self.train_config.tokenizer is None:
                tokenizer = byte_tokenizer()
            else:  # the same checks as training: the file is there and has pad/bos/eos
                JSONTokenizer(self.train_config.tokenizer)
                tokenizer = tokenizers.Tokenizer.from_file(self.train_config.tokenizer)
            tokenizer = with_bos(tokenizer, self.model_config.bos_id)
            tokenizer.encode_special_tokens = True  # text spelling "<pad>" is text
            return tokenizer
        except ImportError:
            raise
        except Exception as error:  # noqa: BLE001 (tokenizers raises plain Exceptions)
            raise RunError(f"{self.directory}: cannot load the run's tokenizer: "
                           f"{error}") from error

    def chat_template(self) -> Optional[str]:
        """A fine-tuning run's copy of its checkpoint's chat template, or None."""
        return saved_chat_template(self.directory)


def saved_chat_template(directory: str) -> Optional[str]:
    """The chat template a fine-tuning run in `directory` copied, or None (also when
    `directory` is not a run: what `--chat` reads before the run is opened)."""
    path = os.path.join(directory, CHAT_TEMPLATE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read()

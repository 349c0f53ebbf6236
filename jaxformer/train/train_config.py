"""`TrainConfig`: everything about a training run that is not the architecture."""

from __future__ import annotations

import dataclasses
from typing import Optional

from jaxformer.config import ConfigMixin, is_finite_number, is_positive_number
from jaxformer.train.rounding import UPDATE_ROUNDINGS
from jaxformer.train.task import check_task_fields


@dataclasses.dataclass(frozen=True)
class TrainConfig(ConfigMixin):
    """Everything about a training run that is not the architecture.

    Defaults are those of `jaxformer train` (copy task on the `copy_task`
    model preset), tuned to reach exact match >= 0.99 in a few CPU minutes.
    """

    task: str = "copy"
    min_len: int = 1
    max_len: int = 10          # source lengths are drawn per example in [min_len, max_len]
    steps: int = 800
    batch_size: int = 64
    learning_rate: float = 1e-3   # peak, after warmup
    warmup_steps: int = 100       # linear from 0; Post-LN needs it (module docstring)
    end_lr_fraction: float = 0.05  # cosine decay to this fraction of the peak
    weight_decay: float = 0.01    # matrices only, see `decay_mask`
    clip_norm: float = 1.0        # global gradient norm
    b1: float = 0.9
    b2: float = 0.98
    label_smoothing: float = 0.0
    seed: int = 0
    # task="lm": the decoder-only LM on text files (jaxformer.train.data), in windows of
    # seq_len tokens. `data` / `eval_data` are file paths or globs; no eval_data =
    # the held-out split is `eval_fraction` of the documents.
    seq_len: int = 128
    data: tuple = ()
    eval_data: tuple = ()
    tokenizer: Optional[str] = None   # a `tokenizers` JSON file; None = bytes
    eval_fraction: float = 0.05
    # The LM loss over chunks of about this many tokens (`chunked_loss`: the batch's
    # (B, T, V) logits never exist): None = where the float32 logits would pass 64 MiB
    # (a pretrained model's vocabulary), 0 = never.
    loss_chunk_tokens: Optional[int] = None
    # How updates reach low-precision (bfloat16) parameters (`jaxformer.train.rounding`):
    # "nearest" (plain p + u), "kahan" (a compensation buffer) or "stochastic".
    update_rounding: str = "nearest"

    def __post_init__(self):
        for name in ("data", "eval_data"):  # JSON gives lists; keep the config hashable
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in ("steps", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"TrainConfig.{name} must be a positive int, got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or \
                not 0 <= self.seed < 2 ** 32:
            raise ValueError(f"TrainConfig.seed must be an int in [0, 2**32), got {self.seed!r}")
        if not isinstance(self.warmup_steps, int) or not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"TrainConfig.warmup_steps must be an int in [0, steps={self.steps})"
                             f", got {self.warmup_steps!r}")
        for name in ("learning_rate", "clip_norm"):
            if not is_positive_number(getattr(self, name)):
                raise ValueError(f"TrainConfig.{name} must be a positive finite number, got "
                                 f"{getattr(self, name)!r}")
        for name, high in (("weight_decay", 1.0), ("label_smoothing", 1.0), ("b1", 1.0),
                           ("b2", 1.0), ("end_lr_fraction", 1.0 + 1e-12)):  # may be 1
            value = getattr(self, name)
            if not (is_finite_number(value) and 0.0 <= value < high):
                raise ValueError(f"TrainConfig.{name} must be in [0, "
                                 f"{'1]' if high > 1 else '1)'}, got {value!r}")
        chunk = self.loss_chunk_tokens
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int)
                                  or chunk < 0):
            raise ValueError(f"TrainConfig.loss_chunk_tokens must be None (auto), 0 (off) or a "
                             f"positive int, got {chunk!r}")
        if self.update_rounding not in UPDATE_ROUNDINGS:
            raise ValueError(f"TrainConfig.update_rounding must be one of {UPDATE_ROUNDINGS}, "
                             f"got {self.update_rounding!r}")
        check_task_fields(self)

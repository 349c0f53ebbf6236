"""Batched log-likelihoods and generations of a `DecoderOnlyLM`, in a few compiled shapes.

    scorer = Scorer(model, params, batch_size=8)
    scorer.loglikelihoods([(context_ids, continuation_ids), ...])  # [(logprob, is_greedy)]
    scorer.generate([prompt_ids, ...], max_new_tokens=32)          # [new ids, EOS cut]

What an evaluation harness asks of a model, on token ids (the text side is
`lm_eval_model`'s). Requests are sorted by length (longest first, as
lm-evaluation-harness's `hf` model does), cut into batches of `batch_size` rows
(a short last batch is filled with dummy rows) and right-padded to a length
bucket (powers of two from `min_length`, and `max_length` itself), so a whole
task compiles one program per bucket, never one per request.

A row scores its continuation exactly as the `hf` model does: the input is
`(context + continuation)[-(max_length + 1):][:-1]` (left-truncated to the
window), the log-probabilities (log-softmax in float32) of the continuation's
tokens at its last positions are summed, and `is_greedy` says whether every
continuation token is the argmax there.
"""

from __future__ import annotations

import functools
from typing import Iterable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.decode.api import generate as lm_generate
from jaxformer.nn.masks import causal_mask
from jaxformer.nn.model import DecoderOnlyLM


def bucket(length: int, max_length: int, min_length: int = 16) -> int:
    """The smallest power of two >= `length` (at least `min_length`), capped at `max_length`."""
    size = min_length
    while size < length:
        size *= 2
    return min(size, max_length)


def _score(model: DecoderOnlyLM, params, tokens_BT, targets_BT, weights_BT):
    """(sum of weighted target log-probabilities (B,), all weighted targets greedy (B,))."""
    logits_BTV = model.apply({"params": params}, tokens_BT, causal_mask(tokens_BT.shape[1]))
    logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    picked_BT = jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
    greedy_BT = (logits_BTV.argmax(-1) == targets_BT) | (weights_BT == 0)
    return (picked_BT * weights_BT).sum(-1), greedy_BT.all(-1)


class Scorer:
    """A model, its parameters and the compiled scoring program, reused across calls.

    `batch_size`: rows per call (the compiled batch); `max_length`: the window
    (default the model's `decoder_len`); `min_length`: the smallest length bucket.
    """

    def __init__(self, model: DecoderOnlyLM, params, *, batch_size: int = 8,
                 max_length: Optional[int] = None, min_length: int = 16):
        if not isinstance(model, DecoderOnlyLM):
            raise ValueError(f"the harness scores decoder-only LMs; got a "
                             f"{type(model).__name__}")
        for name, value in (("batch_size", batch_size), ("min_length", min_length)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        window = model.config.decoder_len
        max_length = window if max_length is None else max_length
        if isinstance(max_length, bool) or not isinstance(max_length, int) or not (
                2 <= max_length <= window):
            raise ValueError(f"max_length must be an int in 2..{window} (the model's "
                             f"decoder_len), got {max_length!r}")
        self.model, self.params = model, params
        self.batch_size, self.max_length, self.min_length = batch_size, max_length, min_length
        self._score = jax.jit(functools.partial(_score, model))
        self.shapes: set = set()  # the (batch, length) shapes compiled so far

    def loglikelihoods(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]
                       ) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), is_greedy) per (context, continuation)
        pair of token-id lists (the context non-empty, the continuation at most
        `max_length` tokens)."""
        rows = []
        for i, (context, continuation) in enumerate(pairs):
            if not context or not continuation:
                raise ValueError(f"request {i}: the context and the continuation must both "
                                 "have tokens")
            if len(continuation) > self.max_length:
                raise ValueError(f"request {i}: a continuation of {len(continuation)} tokens "
                                 f"does not fit the window of {self.max_length}")
            whole = (list(context) + list(continuation))[-(self.max_length + 1):]
            rows.append((whole[:-1], whole[1:], len(continuation)))
        out: list = [None] * len(rows)
        for batch in self._batches(range(len(rows)), key=lambda i: len(rows[i][0])):
            length = bucket(max(len(rows[i][0]) for i in batch), self.max_length,
                            self.min_length)
            tokens = np.full((self.batch_size, length), self.model.config.pad_id, np.int32)
            targets = np.zeros_like(tokens)
            weights = np.zeros(tokens.shape, np.float32)
            for r, i in enumerate(batch):
                inputs, labels, count = rows[i]
                tokens[r, :len(inputs)] = inputs
                targets[r, :len(labels)] = labels
                weights[r, len(labels) - count:len(labels)] = 1.0
            self.shapes.add(("score",) + tokens.shape)
            total, greedy = jax.device_get(self._score(self.params, tokens, targets, weights))
            for r, i in enumerate(batch):
                out[i] = (float(total[r]), bool(greedy[r]))
        return out

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                 temperature: float = 0.0, top_k: Optional[int] = None,
                 top_p: Optional[float] = None, seed: int = 0) -> list[list[int]]:
        """New token ids per prompt (greedy by default), cut before the first EOS.

        Prompts longer than `max_length - max_new_tokens` keep their last tokens.
        """
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or not (
                1 <= max_new_tokens < self.max_length):
            raise ValueError(f"max_new_tokens must be an int in 1..{self.max_length - 1} (the "
                             f"window is {self.max_length}), got {max_new_tokens!r}")
        room = self.max_length - max_new_tokens
        cut = [list(p)[-room:] for p in prompts]
        if any(not p for p in cut):
            raise ValueError("every prompt needs at least one token")
        c = self.model.config
        out: list = [None] * len(cut)
        rng = jax.random.key(seed)
        for n, batch in enumerate(self._batches(range(len(cut)), key=lambda i: len(cut[i]))):
            # prefill + N - 1 steps must fit the window: P + N - 1 <= decoder_len
            width = min(bucket(max(len(cut[i]) for i in batch), self.max_length,
                               self.min_length), c.decoder_len - max_new_tokens + 1)
            prompt = np.full((self.batch_size, width), c.pad_id, np.int32)
            lengths = np.ones(self.batch_size, np.int32)
            for r, i in enumerate(batch):
                prompt[r, :len(cut[i])] = cut[i]
                lengths[r] = len(cut[i])
            self.shapes.add(("generate",) + prompt.shape + (max_new_tokens,))
            result = lm_generate(self.model, self.params, prompt, prompt_lengths=lengths,
                                 max_new_tokens=max_new_tokens, temperature=temperature,
                                 top_k=top_k, top_p=top_p,
                                 rng=jax.random.fold_in(rng, n) if temperature > 0 else None)
            tokens, counts = jax.device_get((result.tokens, result.lengths))
            for r, i in enumerate(batch):
                row = [int(t) for t in tokens[r, :int(counts[r])]]
                out[i] = row[:-1] if row and row[-1] == c.eos_id else row
        return out

    def _batches(self, indices: Iterable[int], key) -> list[list[int]]:
        """Indices longest first (ties keep their order), in runs of `batch_size`."""
        ordered = sorted(indices, key=lambda i: -key(i))
        return [ordered[i:i + self.batch_size] for i in range(0, len(ordered), self.batch_size)]

"""Batched log-likelihoods and generations of a `DecoderOnlyLM`, in a few compiled shapes.

    scorer = Scorer(model, params, batch_size=8)
    scorer.loglikelihoods([(context_ids, continuation_ids), ...])  # [(logprob, is_greedy)]
    scorer.generate([prompt_ids, ...], max_new_tokens=32)          # [new ids, EOS cut]

What an evaluation harness asks of a model, on token ids (the text side is
`lm_eval_model`'s). Log-likelihood requests with the same context share a row
(`packing`: the context once, then each continuation as a segment that sees the
context and itself), and only the scored positions go through the output
projection and the log-softmax. Rows (and generation prompts) are sorted by
length, longest first, as lm-evaluation-harness's `hf` model sorts them, cut into
batches of `batch_size` rows (a short last batch is filled with dummy rows) and
right-padded to a length bucket (`bucket`: 16, 24, 32, 48, 64, ... up to
`max_length`), so a whole task compiles one program per bucket, never one per
request (`traces` counts them).

A request scores its continuation exactly as the `hf` model does: the input is
`(context + continuation)[-(max_length + 1):][:-1]` (left-truncated to the
window), the log-probabilities (log-softmax in float32) of the continuation's
tokens at its last positions are summed, and `is_greedy` says whether every
continuation token is the argmax there.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.decode.api import generate as lm_generate
from jaxformer.harness.packing import Row, layout, pack, segment_mask
from jaxformer.nn.model import DecoderOnlyLM


def bucket(length: int, max_length: int, min_length: int = 16) -> int:
    """The smallest of min_length * (1, 1.5, 2, 3, 4, 6, ...) >= `length`, capped at
    `max_length`: at most a third of a row is padding, and a window of W tokens has
    about 2 log2(W / min_length) buckets."""
    size = min_length
    while size < length:
        if size + size // 2 >= length:
            size += size // 2
            break
        size *= 2
    return min(size, max_length)


def _score(model: DecoderOnlyLM, params, tokens_BT, positions_BT, segments_BT, gather_BK,
           targets_BK):
    """Log-probabilities (B, K) of the targets at the gathered positions, and whether
    each target is the argmax there (B, K)."""
    hidden_BTD = model.apply({"params": params}, tokens_BT, segment_mask(segments_BT),
                             positions_BT=positions_BT, hidden=True)
    hidden_BKD = jnp.take_along_axis(hidden_BTD, gather_BK[..., None], axis=1)
    logits_BKV = model.apply({"params": params}, hidden_BKD, method=DecoderOnlyLM.output_logits)
    logp_BKV = jax.nn.log_softmax(logits_BKV.astype(jnp.float32), axis=-1)
    picked_BK = jnp.take_along_axis(logp_BKV, targets_BK[..., None], axis=-1)[..., 0]
    return picked_BK, logits_BKV.argmax(-1) == targets_BK


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
        self._score = jax.jit(self._traced_score)
        self.shapes: set = set()  # the shapes run so far: ("score", B, T, K), ("generate", ...)
        self.traces = 0  # times the scoring program was traced (= compiled)

    def loglikelihoods(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]
                       ) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), is_greedy) per (context, continuation)
        pair of token-id lists (the context non-empty, the continuation at most
        `max_length` tokens)."""
        for i, (context, continuation) in enumerate(pairs):
            if not context or not continuation:
                raise ValueError(f"request {i}: the context and the continuation must both "
                                 "have tokens")
            if len(continuation) > self.max_length:
                raise ValueError(f"request {i}: a continuation of {len(continuation)} tokens "
                                 f"does not fit the window of {self.max_length}")
        rows = pack(pairs, self.max_length)
        out: list = [None] * len(pairs)
        for batch in self._batches(range(len(rows)), key=lambda i: rows[i].length):
            self._score_rows([rows[i] for i in batch], out)
        return out

    def _score_rows(self, rows: Sequence[Row], out: list) -> None:
        """Score one batch of rows; each request's (sum, is_greedy) into out[request]."""
        length = bucket(max(row.length for row in rows), self.max_length, self.min_length)
        predictions = bucket(max(row.predictions for row in rows), 1 << 30, 8)
        arrays = layout(rows, self.batch_size, length, predictions, self.model.config.pad_id)
        self.shapes.add(("score", self.batch_size, length, predictions))
        picked, greedy = jax.device_get(self._score(
            self.params, arrays.tokens, arrays.positions, arrays.segments, arrays.gather,
            arrays.targets))
        for r, row in enumerate(rows):
            k = 0
            for i, continuation in zip(row.requests, row.continuations):
                n = len(continuation)
                out[i] = (math.fsum(picked[r, k:k + n].tolist()), bool(greedy[r, k:k + n].all()))
                k += n

    def _traced_score(self, *args):
        self.traces += 1  # runs once per trace, not per call
        return _score(self.model, *args)

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

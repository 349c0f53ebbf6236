"""Whisper's logits processors: token suppression and the timestamp rules."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxformer.decode import processors
from jaxformer.decode.processors import NEG
from jaxformer.models.whisper.tokens import tokens_of

@dataclasses.dataclass(frozen=True)
class TimestampRules:
    """Whisper's timestamp rules as a logits processor (ctranslate2's
    `ApplyTimestampRules`), for prompts without <|notimestamps|>.

    From step `sample_begin` (the first token after the prompt) on:
    <|notimestamps|> is never picked; the first token is a timestamp of at most
    `max_initial` (index into the timestamps: 50 = 1.00 s); timestamps come in
    pairs (after a pair the next token is text or EOS, after a single timestamp
    it is a timestamp or EOS) and never decrease (a segment's closing timestamp
    is above its opening one); and where the timestamps
    together are more probable than any single text token, a timestamp is
    picked. Rows are handled independently; the other processors (token
    suppression) must run before this one, as in ctranslate2.
    """

    eot_id: int
    no_timestamps_id: int
    timestamp_begin: int
    sample_begin: int
    max_initial: int = 50

    def check(self, vocab_size: int) -> None:
        if not 0 <= self.eot_id < self.no_timestamps_id < self.timestamp_begin < vocab_size:
            raise ValueError(f"TimestampRules: ids eot {self.eot_id} < no_timestamps "
                             f"{self.no_timestamps_id} < timestamp_begin "
                             f"{self.timestamp_begin} < vocab_size {vocab_size} expected")

    def __call__(self, logits_BV, step, tokens_BN):
        processors.check_inputs("TimestampRules", logits_BV, step, tokens_BN)
        ids_V = jnp.arange(logits_BV.shape[-1])
        is_time_V = ids_V >= self.timestamp_begin
        col_N = jnp.arange(tokens_BN.shape[1])
        last_B = jnp.take(tokens_BN, jnp.maximum(step - 1, 0), axis=1)
        before_B = jnp.where(step - 1 > self.sample_begin,
                             jnp.take(tokens_BN, jnp.maximum(step - 2, 0), axis=1), last_B)
        first, after = step == self.sample_begin, step > self.sample_begin
        last_time_B = after & (last_B >= self.timestamp_begin)
        pair_B = last_time_B & (before_B >= self.timestamp_begin)
        # The latest timestamp generated so far: later ones may not be smaller.
        seen_BN = ((col_N >= self.sample_begin) & (col_N < step))[None] & (
            tokens_BN >= self.timestamp_begin)
        latest_B = jnp.take_along_axis(
            tokens_BN, jnp.argmax(jnp.where(seen_BN, col_N, -1), axis=1)[:, None], axis=1)[:, 0]
        ban_BV = jnp.broadcast_to(ids_V == self.no_timestamps_id, logits_BV.shape)
        ban_BV |= first & (~is_time_V | (ids_V > self.timestamp_begin + self.max_initial))
        ban_BV |= pair_B[:, None] & is_time_V
        ban_BV |= (last_time_B & ~pair_B)[:, None] & (ids_V < self.eot_id)
        # Never below the latest timestamp, and above it unless the last token is a
        # segment's closing timestamp (the next segment may open where this one
        # closed): every segment has a nonzero length (openai-whisper, ctranslate2).
        strict_B = ~(last_time_B & ~pair_B)
        ban_BV |= (after & seen_BN.any(axis=1))[:, None] & is_time_V & (
            ids_V < latest_B[:, None] + strict_B[:, None])
        logits_BV = jnp.where(ban_BV, NEG, logits_BV)
        # Timestamps as a whole more probable than the best text token: take one.
        logp_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1)
        time_B = jax.nn.logsumexp(jnp.where(is_time_V, logp_BV, -jnp.inf), axis=-1)
        text_B = jnp.max(jnp.where(is_time_V, -jnp.inf, logp_BV), axis=-1)
        force_B = after & ~pair_B & (time_B > text_B)
        return jnp.where(force_B[:, None] & ~is_time_V, NEG, logits_BV)


def whisper_processors(vocab: list[str], prompt: list[int], suppress_ids, suppress_ids_begin,
                       *, max_initial_timestamp_index: int = 50) -> tuple:
    """The logits processors Whisper decodes with after `prompt`: `suppress_ids` at
    every step, `suppress_ids_begin` (blank, EOS) at the first step after the
    prompt (either may be empty), and the `TimestampRules` unless the prompt ends with <|notimestamps|>."""
    t = tokens_of(vocab)
    begin = len(prompt) - 1  # the prompt after BOS is forced: steps 0 .. begin - 1
    out = ((processors.suppress_tokens(suppress_ids),) if len(suppress_ids) else ()) + (
        (processors.suppress_at_step(suppress_ids_begin, at=begin),)
        if len(suppress_ids_begin) else ())
    if prompt[-1] != t.no_timestamps:
        out += (TimestampRules(t.eot, t.no_timestamps, t.timestamp_begin, begin,
                               int(max_initial_timestamp_index)),)
    return out

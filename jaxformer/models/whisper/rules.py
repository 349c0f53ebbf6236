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

    With `sot_id` set (>= 0), each row's prompt may have its own length (a
    previous-text prompt `<|startofprev|> ... <|startoftranscript|> ...`):
    row b's first free step is `prompt_end_B` (its <|startoftranscript|> plus
    `sample_begin` tokens after it), and the prompt's own tokens (previous
    text with its timestamps) are ignored by the rules, as openai-whisper's
    `sample_begin` makes them.
    """

    eot_id: int
    no_timestamps_id: int
    timestamp_begin: int
    sample_begin: int
    max_initial: int = 50
    sot_id: int = -1

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
        begin_B = prompt_end_B(tokens_BN, step, self.sot_id, self.sample_begin)
        last_B = jnp.take(tokens_BN, jnp.maximum(step - 1, 0), axis=1)
        before_B = jnp.where(step - 1 > begin_B,
                             jnp.take(tokens_BN, jnp.maximum(step - 2, 0), axis=1), last_B)
        first, after = (step == begin_B)[:, None], step > begin_B
        last_time_B = after & (last_B >= self.timestamp_begin)
        pair_B = last_time_B & (before_B >= self.timestamp_begin)
        # The latest timestamp generated so far: later ones may not be smaller.
        seen_BN = ((col_N[None] >= begin_B[:, None]) & (col_N < step)[None]) & (
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


def prompt_end_B(tokens_BN, step, sot_id: int, after_sot: int):
    """(B,) each row's first free step: `after_sot` when `sot_id` < 0 (every prompt
    of one length; BOS is <|startoftranscript|>), else the column after the first
    <|startoftranscript|> among the picks before `step` (0 where BOS is it) plus
    `after_sot` (the language, task and <|notimestamps|> tokens that follow it).
    Tokens exclude BOS: pick i sits in column i."""
    batch = tokens_BN.shape[0]
    if sot_id < 0:
        return jnp.full((batch,), after_sot, jnp.int32)
    col_N = jnp.arange(tokens_BN.shape[1])
    is_sot_BN = (tokens_BN == sot_id) & (col_N < step)[None]
    return jnp.where(is_sot_BN.any(axis=1), jnp.argmax(is_sot_BN, axis=1) + 1,
                     0).astype(jnp.int32) + after_sot


@dataclasses.dataclass(frozen=True)
class SuppressAtPromptEnd:
    """Never pick `ids` at each row's first free step (`prompt_end_B`): Whisper's
    begin_suppress_tokens (blank, EOS) after prompts of different lengths."""

    ids: tuple[int, ...]
    sot_id: int
    after_sot: int

    def __call__(self, logits_BV, step, tokens_BN):
        processors.check_inputs("SuppressAtPromptEnd", logits_BV, step, tokens_BN)
        at_B = step == prompt_end_B(tokens_BN, step, self.sot_id, self.after_sot)
        banned_V = jnp.zeros(logits_BV.shape[-1], bool).at[jnp.asarray(self.ids)].set(True)
        return jnp.where(at_B[:, None] & banned_V, NEG, logits_BV)


@dataclasses.dataclass(frozen=True)
class EndAfter:
    """EOS is the only choice once a row has `max_text` free picks (`prompt_end_B`):
    rows whose prompts differ in length each get `max_text` tokens, as a length
    limit would give them (the forced EOS adds log(1) = 0 to the row's score)."""

    eos_id: int
    sot_id: int
    after_sot: int
    max_text: int

    def __call__(self, logits_BV, step, tokens_BN):
        processors.check_inputs("EndAfter", logits_BV, step, tokens_BN)
        end_B = step >= prompt_end_B(tokens_BN, step, self.sot_id, self.after_sot) + \
            self.max_text
        others_V = jnp.arange(logits_BV.shape[-1]) != self.eos_id
        return jnp.where(end_B[:, None] & others_V, NEG, logits_BV)


def whisper_processors(vocab: list[str], prompt: list[int], suppress_ids, suppress_ids_begin,
                       *, max_initial_timestamp_index: int = 50,
                       ragged: bool = False, max_text: int = 224) -> tuple:
    """The logits processors Whisper decodes with after `prompt`: `suppress_ids` at
    every step, `suppress_ids_begin` (blank, EOS) at the first step after the
    prompt (either may be empty), and the `TimestampRules` unless the prompt ends
    with <|notimestamps|>.

    `ragged`: the rows' prompts differ in length before <|startoftranscript|>
    (previous text): each row's first free step is found after its
    <|startoftranscript|> (`prompt_end_B`); the tokens after it are those of `prompt`,
    and each row ends after `max_text` free picks (`EndAfter`)."""
    t = tokens_of(vocab)
    begin = len(prompt) - 1  # the prompt after BOS is forced: steps 0 .. begin - 1
    sot_id = -1
    if ragged:
        sot_id, begin = t.sot, len(prompt) - 1 - prompt.index(t.sot)
    out = (processors.suppress_tokens(suppress_ids),) if len(suppress_ids) else ()
    if len(suppress_ids_begin):
        out += ((SuppressAtPromptEnd(tuple(int(i) for i in suppress_ids_begin), sot_id, begin),)
                if ragged else (processors.suppress_at_step(suppress_ids_begin, at=begin),))
    if prompt[-1] != t.no_timestamps:
        out += (TimestampRules(t.eot, t.no_timestamps, t.timestamp_begin, begin,
                               int(max_initial_timestamp_index), sot_id),)
    if ragged:
        out += (EndAfter(t.eot, sot_id, begin, int(max_text)),)
    return out

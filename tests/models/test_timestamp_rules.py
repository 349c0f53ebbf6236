"""Whisper's timestamp rules (`whisper.TimestampRules`) as golden sets of allowed ids,
against openai-whisper's `ApplyTimestampRules` (and ctranslate2's): the first token is a
timestamp of at most <|max_initial * 0.02|>, the bound inclusive (openai-whisper:
`last_allowed = timestamp_begin + max_initial_timestamp_index`, ids above it -inf);
after the initial timestamp comes text; after text and one timestamp, a timestamp not
below it or EOT. No model file needed."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.models.whisper import TimestampRules

EOT, NO_TIMESTAMPS, BEGIN, TIMES = 10, 11, 12, 61  # text ids 0..9, <|0.00|>..<|1.20|>
VOCAB, SAMPLE_BEGIN, WIDTH = BEGIN + TIMES, 2, 8
TEXT = set(range(EOT))


def allowed(rules, generated):
    """Ids left selectable at the step after the prompt and `generated` (a set)."""
    step = SAMPLE_BEGIN + len(generated)
    tokens = np.full((1, WIDTH), EOT, np.int32)
    tokens[0, :SAMPLE_BEGIN] = (3, 4)  # the prompt (forced)
    tokens[0, SAMPLE_BEGIN:step] = generated
    # Text more probable than all timestamps together, so the "timestamps win" rule
    # forces nothing: what is banned is the structure alone.
    logits = np.where(np.arange(VOCAB) < BEGIN, 5.0, 0.0).astype(np.float32)[None]
    out = np.asarray(rules(jnp.asarray(logits), jnp.int32(step), jnp.asarray(tokens)))
    assert np.isfinite(out).all()
    return {int(i) for i in np.flatnonzero(out[0] == logits[0])}


@pytest.mark.parametrize("max_initial", [50, 3, 0])
def test_the_first_token_is_a_timestamp_up_to_the_bound_inclusive(max_initial):
    rules = TimestampRules(EOT, NO_TIMESTAMPS, BEGIN, SAMPLE_BEGIN, max_initial)
    got = allowed(rules, [])
    assert got == set(range(BEGIN, BEGIN + max_initial + 1))
    assert BEGIN + max_initial in got and BEGIN + max_initial + 1 not in got


def test_the_default_bound_is_one_second():
    got = allowed(TimestampRules(EOT, NO_TIMESTAMPS, BEGIN, SAMPLE_BEGIN), [])
    assert max(got) == BEGIN + 50  # <|1.00|>


def test_pairs_and_order_of_later_timestamps():
    rules = TimestampRules(EOT, NO_TIMESTAMPS, BEGIN, SAMPLE_BEGIN)
    # After the initial timestamp (a pair with the prompt's end): text or EOT.
    assert allowed(rules, [BEGIN + 5]) == TEXT | {EOT}
    assert allowed(rules, [BEGIN]) == TEXT | {EOT}  # <|0.00|> is a timestamp too
    # Text then one timestamp: its closing timestamp (not below it) or EOT.
    assert allowed(rules, [BEGIN + 5, 7, BEGIN + 20]) == {EOT} | set(range(BEGIN + 20, VOCAB))
    # After a closed pair: text or EOT again.
    assert allowed(rules, [BEGIN + 5, 7, BEGIN + 20, BEGIN + 20]) == TEXT | {EOT}
    # Text after a timestamp: anything but earlier timestamps (and <|notimestamps|>). The
    # equal one is left out: ctranslate2 allows it, openai-whisper's later versions do not.
    assert allowed(rules, [BEGIN + 5, 7]) - {BEGIN + 5} == TEXT | {EOT} | set(
        range(BEGIN + 6, VOCAB))

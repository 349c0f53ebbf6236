"""generate_stream: the same tokens as `generate`, handed out chunk by chunk by
host-free programs (so the compilation cache can keep them)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.decode import api as decoding
from jaxformer.decode.loop import TRACE_COUNTS
from jaxformer.decode.stream import generate_stream, start_program, steps_program

CONFIG = jf.tiny(num_encoder_layers=0)
PROMPT = np.array([[5, 6, 7, 9], [8, 4, 0, 0]], np.int32)  # ragged: right-padded


@pytest.fixture(scope="module")
def lm():
    model = jf.DecoderOnlyLM(CONFIG)
    params = model.init(jax.random.PRNGKey(1), jnp.asarray(PROMPT))["params"]
    return model, jax.tree.map(lambda x: 4 * x, params)  # larger weights: varied picks


@pytest.mark.parametrize("sampling", [
    pytest.param({}, id="greedy"),
    pytest.param(dict(temperature=1.0, top_p=0.9, rng=jax.random.PRNGKey(3)), id="sampled"),
])
def test_the_chunks_concatenated_equal_generate(lm, sampling):
    model, params = lm
    want = decoding.generate(model, params, PROMPT, max_new_tokens=11, **sampling).tokens
    chunks = list(generate_stream(model, params, PROMPT, max_new_tokens=11, chunk=4,
                                  **sampling))
    # the first pick alone after the prefill, then 4, 4 and the remainder 2 (fewer
    # if every row has sampled EOS: then `generate` holds only PAD after the cut)
    widths = [c.shape[1] for c in chunks]
    assert widths == [1, 4, 4, 2][:len(widths)] and all(c.shape[0] == 2 for c in chunks)
    got, want = np.concatenate(chunks, axis=1), np.asarray(want)
    np.testing.assert_array_equal(got, want[:, :got.shape[1]])
    assert got.shape[1] == 11 or ((want[:, got.shape[1]:] == CONFIG.pad_id).all()
                                  and (got == CONFIG.eos_id).any(axis=1).all())
    assert len(set(want[0].tolist())) > 1  # not a constant stream


def test_it_stops_once_every_row_has_finished(lm):
    model, params = lm
    prompt = PROMPT[:1]
    greedy = np.asarray(decoding.generate(model, params, prompt, max_new_tokens=4).tokens)[0]
    # Make the second pick EOS: the stream ends with the chunk holding it.
    eos = jf.DecoderOnlyLM(CONFIG.replace(eos_id=int(greedy[1])))
    chunks = list(generate_stream(eos, params, prompt, max_new_tokens=20, chunk=3))
    cut = 1 if greedy[0] == greedy[1] else 4  # the first pick alone, or one chunk of 3 more
    assert sum(c.shape[1] for c in chunks) == cut  # not 20
    want = decoding.generate(eos, params, prompt, max_new_tokens=20).tokens
    np.testing.assert_array_equal(np.concatenate(chunks, axis=1), np.asarray(want)[:, :cut])


def test_two_step_programs_at_most_and_bad_chunks_refused_before_any_work(lm):
    model, params = lm
    before = TRACE_COUNTS["stream_steps"]
    for _ in range(2):
        list(generate_stream(model, params, PROMPT, max_new_tokens=12, chunk=5))  # 5, 5, 1
    assert TRACE_COUNTS["stream_steps"] - before <= 2
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="chunk"):
            generate_stream(model, params, PROMPT, max_new_tokens=4, chunk=bad)
    with pytest.raises(ValueError, match="max_len"):  # checked at the call, not at next()
        generate_stream(model, params, PROMPT, max_new_tokens=10_000)


def test_the_programs_hold_no_host_callback(lm):
    """What lets JAX's persistent compilation cache keep them (it skips programs with
    host callbacks, which `generate(on_token=...)` has)."""
    model, params = lm
    state = start_program(model, params, PROMPT, np.array([4, 2], np.int32),
                          jax.random.PRNGKey(0), max_new_tokens=6,
                          select=jf.decode.greedy, processors=(), prefill_chunk=None)
    texts = [start_program.lower(model, params, PROMPT, np.array([4, 2], np.int32),
                                 jax.random.PRNGKey(0), max_new_tokens=6,
                                 select=jf.decode.greedy, processors=(),
                                 prefill_chunk=None).as_text(),
             steps_program.lower(model, params, state, steps=3, select=jf.decode.greedy,
                                 processors=()).as_text()]
    for text in texts:
        assert "callback" not in text
    streaming = decoding.lm_program.lower(
        model, params, PROMPT, np.array([4, 2], np.int32), jax.random.PRNGKey(0),
        max_new_tokens=6, select=jf.decode.greedy, loop="scan", return_logits=False,
        on_token=lambda step, token_B: None).as_text()
    assert "callback" in streaming  # the check can see one

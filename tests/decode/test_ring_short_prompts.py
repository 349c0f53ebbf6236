"""A sliding-window layer's ring cache with prompts SHORTER than the window: the ring starts
part empty (unwritten slots must stay invisible), and when decoding runs in segments it
starts as short as the prompt and must grow at each fold until it holds a whole window.
Greedy tokens generated well past the window equal full recomputation. (Prompts longer than
the window: tests/nn/test_blocks_33.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.decode import api as decoding
from jaxformer.decode import cache as cache_lib

WINDOW, LENGTHS, N_NEW = 8, (2, 1), 15  # 17 slots: past two windows
CONFIG = jf.llama(num_decoder_layers=3, sliding_window=WINDOW, attention_pattern="LG",
                  d_model=32, num_heads=4, num_kv_heads=2, max_len=32)


def full_recompute_greedy(model, params, rows, n_new):
    """Each row alone, one full causal forward pass per new token (one width, one compile):
    (tokens (B, N), the logits (B, N, V) each token was picked from)."""
    width = max(len(r) for r in rows) + n_new
    forward = jax.jit(lambda p, t: model.apply({"params": p}, t, jf.causal_mask(width)))
    tokens, logits = [], []
    for row in rows:
        seq = np.full(width, 3, np.int32)
        seq[:len(row)] = row
        for step in range(n_new):
            last = np.asarray(forward(params, jnp.asarray(seq[None])))[0, len(row) + step - 1]
            seq[len(row) + step] = int(np.argmax(last))
        tokens.append(seq[len(row):len(row) + n_new])
        full = np.asarray(forward(params, jnp.asarray(seq[None])))[0]
        logits.append(full[len(row) - 1:len(row) - 1 + n_new])
    return np.asarray(tokens), np.asarray(logits)


@pytest.fixture(scope="module")
def case(make_lm):
    model, params = make_lm(CONFIG, seed=7)
    embedding = np.asarray(params["embed"]["embedding"]).copy()
    embedding[CONFIG.eos_id] *= 0.0  # tied output: EOS's logit is 0, below the best: 14 tokens
    params["embed"]["embedding"] = embedding
    rng = np.random.default_rng(3)
    rows = [rng.integers(3, 16, n).astype(np.int32) for n in LENGTHS]
    batch = np.zeros((len(rows), max(LENGTHS)), np.int32)
    for i, row in enumerate(rows):
        batch[i, :len(row)] = row
    return model, params, batch, full_recompute_greedy(model, params, rows, N_NEW)


@pytest.mark.parametrize("segments", [1, 4])
def test_short_prompts_decode_past_the_window_like_recomputation(case, segments):
    """segments=4: the 14 steps after the first run as 4, 4, 3, 3; the rings start at 2
    slots (the prompt) and grow to 6, then 8 = the window, at two folds (a ring of
    window - 1 slots would still serve one-token steps: 6 would not)."""
    model, params, batch, (want, want_logits) = case
    assert len(set(want[0])) > 2  # not a constant stream
    out = decoding.generate(model, params, jnp.asarray(batch), max_new_tokens=N_NEW,
                            prompt_lengths=np.asarray(LENGTHS), segments=segments,
                            return_logits=True)
    np.testing.assert_array_equal(np.asarray(out.tokens), want)
    # The logits too: a key dropped from the window need not change a greedy pick.
    np.testing.assert_allclose(np.asarray(out.logits), want_logits, rtol=1e-4, atol=1e-4)


def test_a_ring_grows_at_each_fold_until_it_holds_a_window():
    cache = cache_lib.init_cache(CONFIG, batch=1, max_len=2)
    sizes = []
    for chunk in (4, 4, 3):
        cache = cache_lib.fold(cache, chunk)
        sizes.append(cache.self_kv[0].key.shape[cache.length_axis])  # layer 0 is local
    assert sizes == [6, WINDOW, WINDOW]
    cache_lib.check_cache(cache, CONFIG)


def test_a_prompt_longer_than_every_layer_s_ring_decodes_like_recomputation(make_lm):
    """Every layer local (Mistral): the cache is rings only, of `window` slots, and a
    prompt longer than the window is prefilled in one pass (each ring keeps its last
    `window` keys): the shape checks must not refuse it, and the tokens equal
    recomputation."""
    config = CONFIG.replace(attention_pattern=None, sliding_window=4, num_decoder_layers=2)
    model, params = make_lm(config, seed=3)
    row = np.random.default_rng(5).integers(3, 16, 10).astype(np.int32)
    want, _ = full_recompute_greedy(model, params, [row], 4)
    out = decoding.generate(model, params, jnp.asarray(row[None]), max_new_tokens=4)
    assert all(config.local_layers(2))
    np.testing.assert_array_equal(np.asarray(out.tokens), want)

"""Public functions of `jaxformer.decode` that take arrays check their shapes
against each other before tracing: one ValueError naming the argument and the
expected shape (issue 47): the cache's entry points and the logits processors,
also under `jax.jit`; and `greedy_decode(return_scores=True)` sums the picks'
log-probabilities."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.decode import cache as cache_lib, processors
from jaxformer.decode.api import greedy_decode
from jaxformer.models.whisper import TimestampRules

B, V = 2, 16


@pytest.fixture(scope="module")
def tiny():
    model = jf.Transformer(jf.tiny())
    src, tgt = jnp.array([[5, 6, 7, 0], [4, 4, 0, 0]]), jnp.array([[1, 5, 6], [1, 4, 0]])
    params = model.init(jax.random.key(0), src, tgt)["params"]
    return model, params, src


def _cache_cases(model, params):
    c = model.config
    cache = cache_lib.init_cache(c, B, 6)
    memory = jnp.zeros((B, 4, c.d_model))
    return {
        "tokens-batch": (lambda: cache_lib.cached_forward(model, params, cache,
                                                          jnp.ones((3, 1), jnp.int32)),
                         r"tokens_BT must have shape \(2, \*\)"),
        "tokens-1d": (lambda: cache_lib.cached_forward(model, params, cache,
                                                       jnp.ones((B,), jnp.int32)),
                      r"tokens_BT must have shape \(2, \*\)"),
        "tokens-too-many": (lambda: cache_lib.cached_forward(model, params, cache,
                                                             jnp.ones((B, 7), jnp.int32)),
                            r"tokens_BT feeds 7 tokens, more than the cache's 6 slots"),
        "prefill-batch": (lambda: cache_lib.prefill(model, params, cache,
                                                    jnp.ones((1, 3), jnp.int32)),
                          r"tokens_BP must have shape \(2, \*\)"),
        "cache-of-another-batch": (
            lambda: cache_lib.cached_forward(model, params, cache.replace(
                self_kv=tuple(cache_lib.KV(k[:1], v[:1]) for k, v in cache.self_kv)),
                jnp.ones((B, 1), jnp.int32)),
            r"shape"),
        "memory-batch": (lambda: cache_lib.with_memory(model, params, cache, memory[:1], None),
                         r"memory_BSD must have shape \(2, \*, 32\)"),
        "memory-width": (lambda: cache_lib.with_memory(model, params, cache, memory[..., :8],
                                                       None),
                         r"memory_BSD must have shape \(2, \*, 32\)"),
        "memory-mask": (lambda: cache_lib.with_memory(model, params, cache, memory,
                                                      jnp.ones((B, 1, 1, 5), bool)),
                        r"src_mask must have shape \(2, 1, 1, 4\)"),
    }


def test_cache_entry_points_name_the_argument(tiny):
    model, params, _ = tiny
    for name, (call, message) in _cache_cases(model, params).items():
        with pytest.raises((ValueError, AssertionError), match=message):
            call()
    # ... and the named ones are ValueErrors (AssertionError only from chex's cache checks)
    for name, (call, message) in _cache_cases(model, params).items():
        if name != "cache-of-another-batch":
            with pytest.raises(ValueError, match=message):
                call()


LOGITS = jnp.zeros((B, V))
TOKENS = jnp.zeros((B, 5), jnp.int32)
STEP = jnp.asarray(1)
PROCESSORS = {
    "suppress": processors.suppress_tokens([3]),
    "suppress_at": processors.suppress_at_step([3], at=0),
    "force": processors.force_token(3, at=0),
    "min_length": processors.min_length(2, eos_id=2),
    "timestamps": TimestampRules(eot_id=2, no_timestamps_id=10, timestamp_begin=11,
                                 sample_begin=0),
}
BAD = {
    "logits-1d": ((LOGITS[0], STEP, TOKENS), r"logits_BV must have shape \(\*, \*\)"),
    "tokens-batch": ((LOGITS, STEP, TOKENS[:1]), r"tokens_BN must have shape \(2, \*\)"),
    "tokens-1d": ((LOGITS, STEP, TOKENS[0]), r"tokens_BN must have shape \(2, \*\)"),
    "step-vector": ((LOGITS, jnp.zeros((B,), jnp.int32), TOKENS), r"step must have shape \(\)"),
}


@pytest.mark.parametrize("bad", BAD, ids=BAD.keys())
@pytest.mark.parametrize("name", PROCESSORS, ids=PROCESSORS.keys())
def test_processors_name_the_argument(name, bad):
    args, message = BAD[bad]
    with pytest.raises(ValueError, match=message):
        PROCESSORS[name](*args)
    with pytest.raises(ValueError, match=message):
        processors.apply((PROCESSORS[name],), *args)
    with pytest.raises(ValueError, match=message):  # at trace time under jit
        jax.jit(PROCESSORS[name])(*args)
    assert PROCESSORS[name](LOGITS, STEP, TOKENS).shape == (B, V)  # good shapes pass


def test_greedy_scores_are_the_summed_log_probabilities_after_the_prefix(tiny):
    model, params, src = tiny
    out = greedy_decode(model, params, src, max_new_tokens=5, return_logits=True,
                        return_scores=True, prefix=np.array([[3, 4], [5, 5]]),
                        prefix_lengths=np.array([2, 1]))
    logp = jax.nn.log_softmax(out.logits, axis=-1)
    picked = np.take_along_axis(np.asarray(logp), np.asarray(out.tokens)[..., None], -1)[..., 0]
    for row, (forced, length) in enumerate(zip((2, 1), np.asarray(out.lengths))):
        want = picked[row, forced:int(length)].sum()  # free picks, EOS included
        np.testing.assert_allclose(out.scores[row], want, rtol=1e-5, atol=1e-5)
    assert greedy_decode(model, params, src, max_new_tokens=5).scores is None


def test_fold_takes_a_positive_chunk_length(tiny):
    model, _, _ = tiny
    cache = cache_lib.init_cache(model.config, B, 4)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="chunk_len must be a positive int"):
            cache_lib.fold(cache, bad)
    assert cache_lib.fold(cache, np.int64(3)).max_len == 7

"""Shared fixtures: a tiny config, initialised models, token batches.

Tokens drawn here avoid the special ids (pad 0, bos 1, eos 2) unless a test
puts them in on purpose, so "PAD" in a test always means a deliberate PAD.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf

FIRST_REAL_ID = 3  # ids 0, 1, 2 are pad, bos, eos in every config here


def random_tokens(seed: int, shape: tuple[int, ...], vocab: int) -> jnp.ndarray:
    """Non-special token ids in [3, vocab), int32."""
    return jnp.asarray(np.random.default_rng(seed).integers(FIRST_REAL_ID, vocab, shape),
                       jnp.int32)


@pytest.fixture
def tiny():
    return jf.tiny()


@pytest.fixture
def tokens():
    """`tokens(seed, shape, vocab=16)`: non-special random ids."""
    return lambda seed, shape, vocab=16: random_tokens(seed, shape, vocab)


@pytest.fixture
def init_transformer():
    """`init_transformer(config, B=2, S=5, T=4)` -> (model, params)."""

    def make(config, B=2, S=5, T=4, seed=0):
        model = jf.Transformer(config)
        src = random_tokens(seed, (B, S), config.src_vocab_size)
        tgt = random_tokens(seed + 1, (B, T), config.tgt_vocab_size)
        return model, model.init(jax.random.PRNGKey(seed), src, tgt)["params"]

    return make


@pytest.fixture
def init_lm():
    """`init_lm(config, B=2, T=6)` -> (DecoderOnlyLM, params)."""

    def make(config, B=2, T=6, seed=0):
        model = jf.DecoderOnlyLM(config)
        tokens = random_tokens(seed, (B, T), config.tgt_vocab_size)
        return model, model.init(jax.random.PRNGKey(seed), tokens)["params"]

    return make

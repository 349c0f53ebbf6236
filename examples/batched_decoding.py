"""Batched decoding by jax.vmap: write the decode for ONE example, vmap it over a batch.

    python examples/batched_decoding.py

Runs in about 10 seconds on CPU (mostly compilation) with an untrained tiny
model, so the tokens themselves are arbitrary. It prints each source with its
vmapped decode, then checks three ways of decoding the same batch agree
exactly -- `jax.vmap` of the single-example function, the batched
`greedy_decode`, and one example at a time -- and ends with a line like

    vmap == batched: True   vmap == one-by-one: True   (5 examples, 12 new tokens)

The single-example function is pure (no host checks, no hidden state), so
`jax.vmap` turns it into batched decoding and `jax.jit` compiles the result
once; a source row of PAD ids on the right is simply a shorter source.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxformer as jf
from jaxformer.decode import greedy_decode, greedy_decode_one

NEW_TOKENS = 12


def main():
    config = jf.tiny()
    model = jf.Transformer(config)
    rng = np.random.default_rng(0)
    src_BS = rng.integers(3, config.src_vocab_size, (5, 8)).astype(np.int32)
    src_BS[1, 5:] = config.pad_id  # ragged sources: PAD on the right
    src_BS[3, 3:] = config.pad_id
    src_BS = jnp.asarray(src_BS)
    params = model.init(jax.random.PRNGKey(0), src_BS, src_BS[:, :4])["params"]

    def decode_one(src_S):
        """(S,) source ids -> DecodeResult(tokens (N,), lengths ())."""
        return greedy_decode_one(model, params, src_S, max_new_tokens=NEW_TOKENS)

    vmapped = jax.jit(jax.vmap(decode_one))(src_BS)
    batched = greedy_decode(model, params, src_BS, max_new_tokens=NEW_TOKENS)
    one_by_one = [jax.jit(decode_one)(row) for row in src_BS]

    for src_S, tokens_N, length in zip(np.asarray(src_BS), np.asarray(vmapped.tokens),
                                       np.asarray(vmapped.lengths)):
        print(f"src {src_S.tolist()} -> {tokens_N[:length].tolist()}")
    same_batched = bool(np.array_equal(vmapped.tokens, batched.tokens)
                        and np.array_equal(vmapped.lengths, batched.lengths))
    same_single = all(np.array_equal(vmapped.tokens[i], r.tokens)
                      for i, r in enumerate(one_by_one))
    print(f"vmap == batched: {same_batched}   vmap == one-by-one: {same_single}   "
          f"({src_BS.shape[0]} examples, {NEW_TOKENS} new tokens)")
    return same_batched and same_single


if __name__ == "__main__":
    sys.exit(0 if main() else 1)

"""Cached decoding: the KV cache, the model-agnostic loop, logits processing, entry points.

Modules: `cache` (the cache pytree and the cached model step), `sampling` and
`processors` (what turns logits into the next token), `loop` (state, step,
scan/while loop), `inputs` (host-side input checks), `api` (`greedy_decode`,
`sample`, `generate`), `beam` (`beam_search`).
"""

from jaxformer.decode.api import (DecodeResult, DecodeState, generate, greedy_decode,
                                  greedy_decode_one, sample)
from jaxformer.decode.beam import beam_search
from jaxformer.decode.cache import DecodeCache, init_cache
from jaxformer.decode.processors import force_token, min_length, suppress_at_step, suppress_tokens
from jaxformer.decode.sampling import make_sampler

__all__ = ["DecodeResult", "DecodeState", "generate", "greedy_decode", "greedy_decode_one",
           "sample", "beam_search", "DecodeCache", "init_cache", "force_token", "min_length",
           "suppress_at_step", "suppress_tokens", "make_sampler"]

"""Cached decoding: the KV cache, the model-agnostic loop, logits processing, entry points.

Modules: `cache` (the cache pytree and the cached model step), `sampling` and
`processors` (what turns logits into the next token), `loop` (state, step,
scan/while loop), `inputs` (host-side input checks), `api` (`greedy_decode`,
`sample`, `generate`), `stream` (`generate_stream`: tokens chunk by chunk),
`beam` (`beam_search`), `capture` (a cached step's activations).
"""

from jaxformer.decode.api import (DecodeResult, DecodeState, encdec_program, generate,
                                  greedy_decode, greedy_decode_one, greedy_decode_recompute,
                                  sample)
from jaxformer.decode.beam import beam_search
from jaxformer.decode.capture import capture_step
from jaxformer.decode.cache import DecodeCache, cache_bytes, cached_forward, init_cache, prefill
from jaxformer.decode.loop import segment_lengths, segments_for
from jaxformer.decode.processors import force_token, min_length, suppress_at_step, suppress_tokens
from jaxformer.decode.sampling import greedy, make_sampler
from jaxformer.decode.stream import generate_stream

__all__ = ["DecodeResult", "DecodeState", "encdec_program", "generate", "greedy_decode",
           "greedy_decode_one", "greedy_decode_recompute", "sample", "beam_search",
           "DecodeCache", "cache_bytes", "cached_forward", "init_cache", "prefill",
           "capture_step", "segment_lengths", "segments_for", "force_token", "min_length",
           "suppress_at_step",
           "suppress_tokens", "greedy", "make_sampler", "generate_stream"]

"""Serving what jaxformer loads: the engine (slots over a paged KV cache, continuous
batching, prefix caching, speculation) and the OpenAI-compatible HTTP server.

Modules: `request` (the types the engine and the server share), `speculative`
(prompt-lookup drafting, greedy and rejection-sampling verification: pure functions),
`spec_decode` (`speculative_generate`: `generate` with k drafts verified per pass).
"""

from jaxformer.serve.request import (FinishReason, Request, SamplingParams, TokenConstraint,
                                     TokenEvent)

from jaxformer.serve.spec_decode import SpecResult, speculative_generate
from jaxformer.serve.speculative import greedy_verify, ngram_draft, rejection_verify, target_probs

__all__ = ["FinishReason", "Request", "SamplingParams", "TokenConstraint", "TokenEvent",
           "SpecResult", "speculative_generate", "greedy_verify", "ngram_draft",
           "rejection_verify", "target_probs"]

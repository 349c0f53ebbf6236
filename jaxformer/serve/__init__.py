"""Serving what jaxformer loads: the engine (slots over a paged KV cache, continuous
batching, prefix caching, speculation) and the OpenAI-compatible HTTP server.

Modules: `request` (the types the engine and the server share).
"""

from jaxformer.serve.request import (FinishReason, Request, SamplingParams, TokenConstraint,
                                     TokenEvent)

__all__ = ["FinishReason", "Request", "SamplingParams", "TokenConstraint", "TokenEvent"]

"""Serving what jaxformer loads: the engine (slots over a paged KV cache, continuous
batching, prefix caching, speculation) and the OpenAI-compatible HTTP server.

Modules: `request` (the types the engine and the server share), `speculative`
(prompt-lookup drafting, greedy and rejection-sampling verification: pure functions),
`spec_decode` (`speculative_generate`: `generate` with k drafts verified per pass);
the HTTP server: `schemas` (request bodies checked, `ApiError`), `detokenize` (streamed text, stop
strings), `generation` (one request through the engine), `responses` (OpenAI
bodies, SSE), `metrics` (Prometheus text), `http` (the Starlette app:
`create_app`, `ServedModel`), `server` (uvicorn, drain on SIGTERM: `run_server`).
Starlette and uvicorn (the `serve` extra) load only with `create_app`/`run_server`.
"""

from jaxformer.serve.request import (FinishReason, Request, SamplingParams, TokenConstraint,
                                     TokenEvent)
from jaxformer.serve.spec_decode import SpecResult, speculative_generate
from jaxformer.serve.speculative import greedy_verify, ngram_draft, rejection_verify, target_probs

__all__ = ["FinishReason", "Request", "SamplingParams", "TokenConstraint", "TokenEvent",
           "SpecResult", "speculative_generate", "greedy_verify", "ngram_draft",
           "rejection_verify", "target_probs", "create_app", "ServedModel", "run_server"]

_HTTP = {"create_app": "http", "ServedModel": "http", "run_server": "server"}


def __getattr__(name: str):
    """The HTTP server's names on first use (`import jaxformer.serve` needs no Starlette)."""
    if name in _HTTP:
        import importlib  # noqa: PLC0415

        module = importlib.import_module(f"jaxformer.serve.{_HTTP[name]}")
        return getattr(module, "run" if name == "run_server" else name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


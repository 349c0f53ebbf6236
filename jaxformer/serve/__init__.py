"""Serving what jaxformer loads: the engine (slots over a paged KV cache, continuous
batching, prefix caching, speculation) and the OpenAI-compatible HTTP server.

Modules. The engine: `request` (the types the engine and the server share), `pages`
(the page pool and prefix cache, pure Python), `paged` (paged keys/values read through
page tables, in JAX), `select` (per-slot sampling), `handle` (a request's event stream),
`slots` (a running request's host state and streamed text), `checks` (input checks),
`programs` (the engine's compiled decode and prefill programs; `time_programs` times
them alone), `engine` (`Engine`: the
step loop), `speculative` (prompt-lookup drafting, greedy and rejection-sampling
verification: pure functions), `spec_decode` (`speculative_generate`: `generate` with k
drafts verified per pass), `constraint` (`Grammars`: JSON-schema and regex constraints
as token masks; outlines-core, imported when a `Grammars` is built), `adapters`
(fine-tuned runs as the engine's adapters).
The HTTP server: `schemas` (request bodies checked, `ApiError`), `generation` (one request through the engine), `responses` (OpenAI
bodies, SSE), `metrics` (Prometheus text), `http` (the Starlette app: `create_app`,
`ServedModel`), `server` (uvicorn, drain on SIGTERM: `run_server`). Starlette and
uvicorn (the `serve` extra) load only with `create_app`/`run_server`.
"""

from jaxformer.serve.constraint import GrammarConstraint, Grammars, token_bytes
from jaxformer.serve.engine import Engine
from jaxformer.serve.handle import Handle
from jaxformer.serve.pages import OutOfPages, PagePool, PageTable
from jaxformer.serve.programs import time_programs
from jaxformer.serve.request import (FinishReason, QueueFull, Request, SamplingParams,
                                     TokenConstraint, TokenEvent)
from jaxformer.serve.spec_decode import SpecResult, speculative_generate
from jaxformer.serve.speculative import greedy_verify, ngram_draft, rejection_verify, target_probs

__all__ = ["Engine", "FinishReason", "Handle", "OutOfPages", "PagePool", "PageTable",
           "QueueFull", "Request", "SamplingParams", "TokenConstraint", "TokenEvent",
           "SpecResult", "speculative_generate", "greedy_verify", "ngram_draft",
           "rejection_verify", "target_probs", "GrammarConstraint", "Grammars", "token_bytes",
           "create_app", "ServedModel", "run_server", "time_programs"]

_HTTP = {"create_app": "http", "ServedModel": "http", "run_server": "server"}


def __getattr__(name: str):
    """The HTTP server's names on first use (`import jaxformer.serve` needs no Starlette)."""
    if name in _HTTP:
        import importlib  # noqa: PLC0415

        module = importlib.import_module(f"jaxformer.serve.{_HTTP[name]}")
        return getattr(module, "run" if name == "run_server" else name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


"""The engine's input checks: one ValueError (or TypeError) naming the problem, before any work."""

from __future__ import annotations

import math
import os
from typing import Any, Optional

import numpy as np

from jaxformer.config import TransformerConfig, is_finite_number
from jaxformer.serve.request import MIN_TEMPERATURE, Request, SamplingParams
from jaxformer.serve.select import MAX_LOGPROBS


def positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_engine_args(config: TransformerConfig, *, slots, max_len, page_size, num_pages,
                      prefill_chunk, max_queue) -> None:
    for name, value in (("slots", slots), ("max_len", max_len), ("page_size", page_size),
                        ("prefill_chunk", prefill_chunk), ("max_queue", max_queue)):
        positive_int(name, value)
    if num_pages is not None:
        positive_int("num_pages", num_pages)
    if max_len > config.decoder_len:
        raise ValueError(f"max_len={max_len} exceeds the model's context "
                         f"{config.decoder_len} (config.decoder_max_len or max_len)")


def pool_bytes_needed(config: TransformerConfig, num_pages: int, page_size: int) -> int:
    """Bytes of the engine's page pools: keys and values of every layer for the pages
    and the null page (`serve.paged.init_pools`), int8 with float32 scales or the
    compute dtype."""
    slots = (num_pages + 1) * page_size
    per_slot = config.kv_heads * config.head_dim
    if config.kv_cache_quant == "int8":
        per_layer = slots * (per_slot + 4 * config.kv_heads)
    else:
        per_layer = slots * per_slot * np.dtype(config.compute_dtype).itemsize
    return 2 * config.num_decoder_layers * per_layer


def memory_bytes() -> Optional[int]:
    """The memory the pools would live in: the first device's limit where JAX reports
    one (GPU, TPU), else the host's physical memory (a CPU); None if neither is known."""
    import jax  # noqa: PLC0415

    stats = jax.devices()[0].memory_stats() or {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_pool_fits(config: TransformerConfig, num_pages: int, page_size: int) -> None:
    """ValueError in one line where the page pools exceed the memory they would live in,
    before anything is allocated (XLA's own error is a page of RESOURCE_EXHAUSTED)."""
    need, have = pool_bytes_needed(config, num_pages, page_size), memory_bytes()
    if have is not None and need > have:
        raise ValueError(f"the KV page pools need {need / 2 ** 30:,.1f} GiB ({num_pages} pages "
                         f"of {page_size} tokens, {config.num_decoder_layers} layers), more "
                         f"than the {have / 2 ** 30:,.1f} GiB of memory here: lower "
                         "page_size, num_pages, slots or max_len")


def scan_refusal(config: TransformerConfig) -> Optional[str]:
    """Why the engine cannot run `config`'s layers as one scan (`Engine(scan_layers=True)`),
    or None: a scan runs one layer kind over arrays of one shape a layer."""
    if len(set(config.local_layers(config.num_decoder_layers))) > 1:
        return (f"scan_layers=True runs one layer kind, but attention_pattern="
                f"{config.attention_pattern!r} mixes local and global layers: serve it "
                "unrolled (scan_layers=False)")
    if any("layers_" in path for path, _ in config.quant_layouts):
        return ("scan_layers=True stacks the layers, whose kernels here have layouts of their "
                "own (config.quant_layouts, a GGUF file mixing block types): serve it "
                "unrolled (scan_layers=False)")
    return None


def check_params(p: SamplingParams, *, vocab_size: int, tokenizer) -> None:
    if not isinstance(p, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(p).__name__}")
    positive_int("max_tokens", p.max_tokens)
    if not (is_finite_number(p.temperature)
            and (p.temperature == 0 or p.temperature >= MIN_TEMPERATURE)):
        raise ValueError(f"temperature must be 0 (greedy) or a finite number >= "
                         f"{MIN_TEMPERATURE}, got {p.temperature!r}")
    if p.top_k is not None and (isinstance(p.top_k, bool) or not isinstance(p.top_k, int)
                                or not 1 <= p.top_k <= vocab_size):
        # the bound also keeps it in the int32 the compiled step takes
        raise ValueError(f"top_k must be an int in 1..{vocab_size} (the vocabulary), "
                         f"got {p.top_k!r}")
    if p.top_p is not None and not (is_finite_number(p.top_p) and 0 < p.top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {p.top_p!r}")
    if not (is_finite_number(p.min_p) and 0 <= p.min_p <= 1):
        raise ValueError(f"min_p must be in [0, 1], got {p.min_p!r}")
    if isinstance(p.seed, bool) or not isinstance(p.seed, int) or not 0 <= p.seed < 2 ** 32:
        raise ValueError(f"seed must be an int in [0, 2**32), got {p.seed!r}")
    if p.logprobs is not None and (isinstance(p.logprobs, bool) or not isinstance(p.logprobs, int)
                                   or not 0 <= p.logprobs <= MAX_LOGPROBS):
        raise ValueError(f"logprobs must be an int in 0..{MAX_LOGPROBS}, got {p.logprobs!r}")
    if isinstance(p.stop, str) or not all(isinstance(s, str) and s for s in p.stop):
        raise ValueError(f"stop must be a tuple of non-empty strings, got {p.stop!r}")
    if p.stop and tokenizer is None:
        raise ValueError("stop strings need the engine's tokenizer (Engine(..., tokenizer))")
    for token in p.stop_ids:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise ValueError(f"stop_ids must be token ids in 0..{vocab_size - 1}, got {token!r}")


def check_request(request: Request, *, vocab_size: int, max_len: int, page_size: int,
                  num_pages: int, tokenizer, adapters: dict[Optional[str], Any]) -> None:
    """Everything `Engine.submit` refuses: a ValueError/TypeError naming the field."""
    if not isinstance(request, Request):
        raise TypeError(f"submit takes a Request, got {type(request).__name__}")
    ids = request.prompt_ids
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__"):
        raise TypeError(f"prompt_ids must be a sequence of token ids, got {type(ids).__name__}")
    if len(ids) == 0:
        raise ValueError("prompt_ids is empty: a prompt needs at least one token")
    if len(ids) > max_len:
        raise ValueError(f"the prompt has {len(ids)} tokens, more than the context "
                         f"max_len={max_len}")
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, (int, np.integer))
           or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt_ids must be ints in 0..{vocab_size - 1}, got {bad[0]!r}")
    check_params(request.params, vocab_size=vocab_size, tokenizer=tokenizer)
    context = min(len(ids) + request.params.max_tokens - 1, max_len)
    if math.ceil(context / page_size) > num_pages:
        raise ValueError(f"the request needs {math.ceil(context / page_size)} pages of "
                         f"{page_size} tokens, the pool has {num_pages} (num_pages)")
    if request.adapter not in adapters:
        known = sorted(a for a in adapters if a is not None)
        raise ValueError(f"unknown adapter {request.adapter!r}; the engine serves {known}")
    if request.request_id is not None and not isinstance(request.request_id, str):
        raise TypeError(f"request_id must be a str or None, got {request.request_id!r}")

"""The engine's `metrics()` as Prometheus text (exposition format 0.0.4; no JAX here).

    prometheus_text(engine.metrics(), http_counts, disconnects)   # the body of GET /metrics

Every metric is prefixed `jaxformer_`; a value the engine does not report (an
engine without speculation has no acceptance rate) is left out rather than
written as 0, so a dashboard never mistakes "not measured" for "zero".
"""

from __future__ import annotations

import math
from typing import Mapping

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# engine.metrics() key -> (metric name, type, help)
ENGINE_METRICS = {
    "queued": ("queued_requests", "gauge", "Requests waiting for a slot."),
    "running": ("running_requests", "gauge", "Requests holding a slot."),
    "free_pages": ("kv_free_pages", "gauge", "KV-cache pages free in the pool."),
    "total_pages": ("kv_total_pages", "gauge", "KV-cache pages in the pool."),
    "tokens_per_s": ("generation_tokens_per_second", "gauge",
                     "Tokens generated per second, recent average."),
    "prefix_hit_rate": ("prefix_cache_hit_rate", "gauge",
                        "Fraction of prompt tokens served from the prefix cache."),
    "acceptance_rate": ("spec_decode_acceptance_rate", "gauge",
                        "Fraction of drafted tokens accepted by speculative decoding."),
    "generated_tokens": ("generation_tokens_total", "counter", "Tokens generated."),
}


def _number(value) -> str:
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(int(value)) if value.is_integer() and abs(value) < 2 ** 53 else repr(value)


def prometheus_text(engine_metrics: Mapping, http_requests: Mapping[tuple[str, int], int],
                    client_disconnects: Mapping[str, int]) -> str:
    """Prometheus text of the engine's metrics and the server's request counts
    (`http_requests`: (route, status code) -> count; `client_disconnects`: route ->
    requests whose client went before the whole answer)."""
    lines = []
    for key, (name, kind, help_text) in ENGINE_METRICS.items():
        value = engine_metrics.get(key)
        if value is None:
            continue
        lines += [f"# HELP jaxformer_{name} {help_text}", f"# TYPE jaxformer_{name} {kind}",
                  f"jaxformer_{name} {_number(value)}"]
    lines += ["# HELP jaxformer_http_requests_total HTTP requests answered, by route and status.",
              "# TYPE jaxformer_http_requests_total counter"]
    for (route, code), count in sorted(http_requests.items()):
        lines.append(f'jaxformer_http_requests_total{{route="{route}",code="{code}"}} {count}')
    lines += ["# HELP jaxformer_client_disconnects_total Requests whose client disconnected "
              "before the whole answer, by route.",
              "# TYPE jaxformer_client_disconnects_total counter"]
    for route, count in sorted(client_disconnects.items()):
        lines.append(f'jaxformer_client_disconnects_total{{route="{route}"}} {count}')
    return "\n".join(lines) + "\n"

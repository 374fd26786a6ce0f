"""Prometheus metrics: every response by route and status (an ASGI middleware, so 4xx and 5xx made
anywhere count too), TTFT as the engine measured it and as the client waited (queue included), and
store, tier and queue figures read at scrape time."""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

log = logging.getLogger(__name__)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ARRIVED = "kvfuse.arrived"  # the ASGI scope key: perf_counter() when the request reached the server


class _StoreCollector:
    def __init__(self, store: Any) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        s = self.store.stats
        yield CounterMetricFamily("kvfuse_store_hits", "KV store lookups that hit", value=s.hits)
        yield CounterMetricFamily("kvfuse_store_misses", "KV store lookups that missed", value=s.misses)
        per_tier = {
            "kvfuse_store_evictions": ("entries evicted from each tier", lambda t: t.stats.evictions, "counter"),
            "kvfuse_store_corrupt": ("entries found corrupt and dropped by each tier (at start or on a read)",
                                     lambda t: t.corrupt, "counter"),
            "kvfuse_store_write_failures": ("writes a tier refused or failed (a full disk, say)",
                                            lambda t: t.stats.write_failures, "counter"),
            "kvfuse_store_errors": ("calls a tier answered as misses because they failed (a Redis timeout or "
                                    "refusal; the tier then backs off)", lambda t: t.stats.errors, "counter"),
            "kvfuse_store_bytes": ("bytes held by each KV store tier", lambda t: t.used_bytes, "gauge"),
            "kvfuse_store_capacity_bytes": ("each tier's byte budget", lambda t: t.capacity_bytes, "gauge"),
            "kvfuse_store_tier_up": ("1 while a tier's last write (Redis: its last call) succeeded, else 0",
                                     lambda t: float(t.stats.last_write_ok), "gauge"),
        }
        for name, (doc, read, kind) in per_tier.items():
            fam = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, doc, labels=["tier"])
            for t in self.store.tiers:
                fam.add_metric([t.name], read(t))
            yield fam


class Metrics:
    def __init__(self, store: Any, queue_depth: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("kvfuse_ttft_seconds", "time to first token as the engine measured it (its prefill, "
                              "and a cold knowledge-base build before it)", buckets=TTFT_BUCKETS, registry=r)
        self.client_ttft = Histogram("kvfuse_client_ttft_seconds", "time to first token as the client waited: "
                                     "from the request's arrival, queue included", buckets=TTFT_BUCKETS, registry=r)
        self.prompt_tokens = Counter("kvfuse_prompt_tokens", "prompt tokens", registry=r)
        self.cached_tokens = Counter("kvfuse_cached_tokens", "prompt tokens read from the KV store", registry=r)
        self.recomputed_tokens = Counter("kvfuse_recomputed_tokens", "reused tokens recomputed by blend", registry=r)
        self.completion_tokens = Counter("kvfuse_completion_tokens", "generated tokens", registry=r)
        self.requests = Counter("kvfuse_requests", "responses by route and HTTP status", ["endpoint", "status"],
                                registry=r)
        self.stream_errors = Counter("kvfuse_stream_errors", "streams that ended with an error event after their "
                                     "200", ["endpoint"], registry=r)
        depth = Gauge("kvfuse_queue_depth", "requests waiting or running", registry=r)
        depth.set_function(lambda: float(queue_depth()))
        r.register(_StoreCollector(store))  # type: ignore[arg-type]

    def observe(self, ttft_s: float, client_ttft_s: float, prompt: int, cached: int, recomputed: int,
                completion: int) -> None:
        self.ttft.observe(ttft_s)
        self.client_ttft.observe(client_ttft_s)
        self.prompt_tokens.inc(prompt)
        self.cached_tokens.inc(cached)
        self.recomputed_tokens.inc(recomputed)
        self.completion_tokens.inc(completion)


class CountResponses:
    """ASGI middleware: stamps each request's arrival (scope[ARRIVED]) and counts its response by the
    matched route's template and status. A request that raised past every handler (a bug) is answered
    here with a 500 in OpenAI's error shape, and its keep-alive connection goes on serving.
    `templates` gives the app's path templates, for requests answered before routing (a 413)."""

    def __init__(self, app: Any, metrics: Metrics, templates: Callable[[], Iterable[str]] = tuple) -> None:
        self.app, self.metrics, self.templates = app, metrics, templates
        self._patterns: list[tuple[re.Pattern[str], str]] | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope[ARRIVED] = time.perf_counter()
        status = 0

        async def sending(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as e:  # a bug: answered here, so the connection lives (Starlette's would close it)
            log.exception("internal error")
            if status == 0:
                body = json.dumps({"error": {"message": f"internal error: {type(e).__name__}: {e}",
                                             "type": "server_error", "param": None, "code": None}}).encode()
                await sending({"type": "http.response.start", "status": 500,
                               "headers": [(b"content-type", b"application/json"),
                                           (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
        finally:
            self.metrics.requests.labels(self._route(scope), str(status or 500)).inc()

    def _route(self, scope: dict[str, Any]) -> str:
        """The matched route's template (never the raw path: labels must stay few)."""
        route = getattr(scope.get("route"), "path", None)
        if route is not None:
            return str(route)
        if self._patterns is None:
            self._patterns = [(re.compile("^" + re.sub(r"\\{[^}]+\\}", "[^/]+", re.escape(t)) + "$"), t)
                              for t in self.templates()]
        return next((t for p, t in self._patterns if p.match(scope.get("path", ""))), "unmatched")

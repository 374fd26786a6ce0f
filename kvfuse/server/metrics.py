"""Prometheus metrics: request counters and TTFT here, store and queue figures read at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _StoreCollector:
    def __init__(self, store: Any) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        s = self.store.stats
        yield CounterMetricFamily("kvfuse_store_hits", "KV store lookups that hit", value=s.hits)
        yield CounterMetricFamily("kvfuse_store_misses", "KV store lookups that missed", value=s.misses)
        evictions = sum(t.stats.evictions for t in self.store.tiers)
        yield CounterMetricFamily("kvfuse_store_evictions", "entries evicted from any tier", value=evictions)
        g = GaugeMetricFamily("kvfuse_store_bytes", "bytes held by each KV store tier", labels=["tier"])
        for t in self.store.tiers:
            g.add_metric([t.name], t.used_bytes)
        yield g


class Metrics:
    def __init__(self, store: Any, queue_depth: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("kvfuse_ttft_seconds", "time to first token", buckets=TTFT_BUCKETS, registry=r)
        self.prompt_tokens = Counter("kvfuse_prompt_tokens", "prompt tokens", registry=r)
        self.cached_tokens = Counter("kvfuse_cached_tokens", "prompt tokens read from the KV store", registry=r)
        self.recomputed_tokens = Counter("kvfuse_recomputed_tokens", "reused tokens recomputed by blend", registry=r)
        self.completion_tokens = Counter("kvfuse_completion_tokens", "generated tokens", registry=r)
        self.requests = Counter("kvfuse_requests", "requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        depth = Gauge("kvfuse_queue_depth", "requests waiting or running", registry=r)
        depth.set_function(lambda: float(queue_depth()))
        r.register(_StoreCollector(store))  # type: ignore[arg-type]

    def observe(self, ttft_s: float, prompt: int, cached: int, recomputed: int, completion: int) -> None:
        self.ttft.observe(ttft_s)
        self.prompt_tokens.inc(prompt)
        self.cached_tokens.inc(cached)
        self.recomputed_tokens.inc(recomputed)
        self.completion_tokens.inc(completion)

"""Prometheus exposition, and the collectors that read the latency store's state at scrape time
(the request path pays nothing for them)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
Registry = CollectorRegistry

LATENCY_STORE_UP = "tailguard_latency_store_up"
LATENCY_STORE_FLUSH_FAILURES = "tailguard_latency_store_flush_failures"
LATENCY_STORE_REFRESH_FAILURES = "tailguard_latency_store_refresh_failures"
LATENCY_STORE_DROPPED_SAMPLES = "tailguard_latency_store_dropped_samples"
LATENCY_STORE_PENDING = "tailguard_latency_store_pending_writes"
LATENCY_SNAPSHOT_AGE = "tailguard_latency_snapshot_age_seconds"
INFLIGHT = "tailguard_upstream_inflight"


class LatencyStoreCollector(Collector):
    """Reads the latency store's health and in-flight counts at scrape time."""

    def __init__(
        self,
        health: Callable[[], Mapping[str, Any]],
        inflight: Callable[[], Mapping[str, int]],
    ) -> None:
        self._health = health
        self._inflight = inflight

    def collect(self) -> Iterator[Metric]:
        health = self._health()
        store = str(health.get("type", "memory"))
        up = GaugeMetricFamily(
            LATENCY_STORE_UP,
            "1 when the latency store works as configured, 0 when it runs degraded (local-only).",
            labels=["store"],
        )
        up.add_metric([store], 1.0 if health.get("state") == "ok" else 0.0)
        yield up
        for name, key, text in (
            (LATENCY_STORE_FLUSH_FAILURES, "flush_failures", "Failed flushes to Redis."),
            (LATENCY_STORE_REFRESH_FAILURES, "refresh_failures", "Failed reads from Redis."),
            (
                LATENCY_STORE_DROPPED_SAMPLES,
                "dropped_samples",
                "Samples never shared: their slice left the window while Redis was unreachable.",
            ),
        ):
            counter = CounterMetricFamily(name, text, labels=["store"])
            counter.add_metric([store], float(health.get(key, 0) or 0))
            yield counter
        pending = GaugeMetricFamily(
            LATENCY_STORE_PENDING, "Hashes waiting for the next flush.", labels=["store"]
        )
        pending.add_metric([store], float(health.get("pending_fields", 0) or 0))
        yield pending
        age = GaugeMetricFamily(
            LATENCY_SNAPSHOT_AGE, "Age of the latency snapshot routing reads.", labels=["store"]
        )
        age.add_metric([store], float(health.get("snapshot_age_s", 0) or 0))
        yield age
        inflight = GaugeMetricFamily(
            INFLIGHT, "Upstream attempts in flight, per deployment.", labels=["deployment"]
        )
        for deployment, count in sorted(self._inflight().items()):
            inflight.add_metric([deployment], float(count))
        yield inflight


def make_registry(*collectors: Collector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    for collector in collectors:
        registry.register(collector)
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)

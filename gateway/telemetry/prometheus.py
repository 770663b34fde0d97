"""Prometheus exposition, and the collectors that read the latency store's state, the vLLM
servers' own figures, the process and the event loop at scrape time (the request path pays
nothing for them)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
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
RESPONSES_STORE_UP = "tailguard_responses_store_up"
RESPONSES_STORE_WRITES = "tailguard_responses_store_writes"  # counter: result
RESPONSES_STORE_PENDING = "tailguard_responses_store_pending_writes"
RESPONSES_STORE_ERRORS = "tailguard_responses_store_errors"
INFLIGHT = "tailguard_upstream_inflight"
EVENT_LOOP_TASKS = "tailguard_event_loop_tasks"
BULK_PREEMPTIONS = "tailguard_bulk_preemptions"  # counter: deployment
BULK_SERVER_PREEMPTS = "tailguard_bulk_server_preempts"  # gauge: deployment
AFFINITY_DECISIONS = "tailguard_affinity_decisions"  # counter: model, outcome
VLLM_UP = "tailguard_vllm_metrics_up"
VLLM_RUNNING = "tailguard_vllm_requests_running"
VLLM_WAITING = "tailguard_vllm_requests_waiting"
VLLM_KV_USAGE = "tailguard_vllm_kv_cache_usage_ratio"
VLLM_PREFIX_HIT = "tailguard_vllm_prefix_cache_hit_ratio"
VLLM_TPOT = "tailguard_vllm_inter_token_latency_seconds"
VLLM_SPEC_ACCEPTANCE = "tailguard_vllm_spec_decode_acceptance_ratio"
VLLM_SPEC_TOKENS = "tailguard_vllm_spec_decode_tokens_per_step"
VLLM_SPEC_POSITION = "tailguard_vllm_spec_decode_position_acceptance_ratio"


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


class AffinityCollector(Collector):
    """`tailguard_affinity_decisions_total{model, outcome}`."""

    def __init__(self, counts: Callable[[], Mapping[tuple[str, str], int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            AFFINITY_DECISIONS,
            "Requests cache-aware routing decided, by the model asked for and the outcome: hit "
            "(the server holding the longest prefix of the prompt leads), bounded (a server "
            "holding a longer one than the lead was over the load bound), queue (the lead's "
            "shorter queue outweighed the prefill a longer prefix saves), miss (no server holds "
            "a prefix of it).",
            labels=["model", "outcome"],
        )
        for (model, outcome), count in sorted(self._counts().items()):
            family.add_metric([model, outcome], float(count))
        yield family


class BulkPreemptionsCollector(Collector):
    """`tailguard_bulk_preemptions_total{deployment}`, from the bulk gate's counts, and
    `tailguard_bulk_server_preempts{deployment}`, what it believes of each priority server."""

    def __init__(
        self,
        counts: Callable[[], Mapping[str, int]],
        beliefs: Callable[[], Mapping[str, bool]] = dict,
    ) -> None:
        self._counts = counts
        self._beliefs = beliefs

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            BULK_PREEMPTIONS,
            "Bulk work preempted on a first-come-first-served vLLM server for an interactive "
            "request that would have queued there (aborted upstream, sent again later).",
            labels=["deployment"],
        )
        for deployment, count in sorted(self._counts().items()):
            family.add_metric([deployment], float(count))
        yield family
        belief = GaugeMetricFamily(
            BULK_SERVER_PREEMPTS,
            "On a vLLM provider with bulk_priority: 1 while the bulk gate believes the server "
            "preempts bulk for interactive requests when every batch slot is taken (it relies "
            "on the server), 0 once it saw interactive first tokens wait behind bulk there (it "
            "then holds bulk back and preempts bulk itself, as on a first-come-first-served "
            "server), until the server is seen preempting.",
            labels=["deployment"],
        )
        for deployment, preempts in sorted(self._beliefs().items()):
            belief.add_metric([deployment], 1.0 if preempts else 0.0)
        yield belief


class StoreView(Protocol):
    """What the response-store collector reads (`gateway.responses.store.ResponseStore`)."""

    def health(self) -> Mapping[str, Any]: ...
    def stats(self) -> Mapping[str, int]: ...


class ResponsesStoreCollector(Collector):
    """Reads the stored responses' health and write counters at scrape time (those of the
    current config's store: a reload that changes `responses` starts them again)."""

    def __init__(self, store: Callable[[], StoreView]) -> None:
        self._store = store

    def collect(self) -> Iterator[Metric]:
        store_now = self._store()
        health, stats = store_now.health(), store_now.stats()
        store = str(health.get("store", "memory"))
        up = GaugeMetricFamily(
            RESPONSES_STORE_UP,
            "1 when the response store works as configured, 0 while its Redis fails (reads "
            "memory cannot answer get 503, writes wait to be tried again).",
            labels=["store"],
        )
        up.add_metric([store], 1.0 if health.get("state") == "ok" else 0.0)
        yield up
        writes = CounterMetricFamily(
            RESPONSES_STORE_WRITES,
            "Stored-response writes to Redis by result: written, retried (failed and queued "
            "again) or dropped (queue full, or still failing after the retry window); "
            "too_large: responses over max_bytes_per_response, not stored.",
            labels=["store", "result"],
        )
        for result, key in (
            ("written", "writes"),
            ("retried", "retried_writes"),
            ("dropped", "dropped_writes"),
            ("too_large", "too_large"),
        ):
            writes.add_metric([store, result], float(stats.get(key, 0)))
        yield writes
        pending = GaugeMetricFamily(
            RESPONSES_STORE_PENDING,
            "Stored responses queued or being written to Redis (readable only on this replica "
            "meanwhile).",
            labels=["store"],
        )
        pending.add_metric([store], float(stats.get("pending_writes", 0)))
        yield pending
        errors = CounterMetricFamily(
            RESPONSES_STORE_ERRORS, "Failed Redis calls of the response store.", labels=["store"]
        )
        errors.add_metric([store], float(stats.get("store_errors", 0)))
        yield errors


class EventLoopCollector(Collector):
    """Counts the event loop's unfinished tasks at scrape time. Under a steady load the count
    follows the requests in flight; one that keeps growing is a task that never ends (a leak)."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop  # None: the loop running the scrape

    def collect(self) -> Iterator[Metric]:
        loop = self._loop
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return  # scraped outside any loop: nothing to count
        tasks = GaugeMetricFamily(
            EVENT_LOOP_TASKS, "Unfinished asyncio tasks on the gateway's event loop."
        )
        tasks.add_metric([], float(len(asyncio.all_tasks(loop))))
        yield tasks


VllmFigures = Mapping[str, Mapping[str, Any]]  # per provider, as `latency.vllm.snapshot` gives
# The plain gauges: name, help, where the figure sits in a provider's figures, its scale.
_VLLM_GAUGES = (
    (VLLM_RUNNING, "Requests the server runs in its batch.", ("running",), 1.0),
    (VLLM_WAITING, "Requests queued at the server.", ("waiting",), 1.0),
    (VLLM_KV_USAGE, "Share of the server's KV cache in use.", ("kv_cache_usage",), 1.0),
    (
        VLLM_PREFIX_HIT,
        "Share of prompt tokens found in the server's prefix cache, over the latest scrape "
        "interval that looked any up.",
        ("prefix_cache_hit_rate",),
        1.0,
    ),
    (
        VLLM_TPOT,
        "Mean time between output tokens the server measured, over the latest scrape interval "
        "that saw enough of them (since its start before).",
        ("tpot_ms",),
        0.001,
    ),
    (
        VLLM_SPEC_ACCEPTANCE,
        "Speculative decoding: accepted over proposed draft tokens, over the latest scrape "
        "interval that drafted.",
        ("spec_decode", "acceptance_rate"),
        1.0,
    ),
    (
        VLLM_SPEC_TOKENS,
        "Speculative decoding: tokens one target step yields (1 + accepted draft tokens per "
        "draft), over the latest scrape interval that drafted.",
        ("spec_decode", "tokens_per_step"),
        1.0,
    ),
)


class VllmCollector(Collector):
    """What each vLLM server's own `/metrics` last said (the `vllm` section of
    `/admin/latency`), by provider, read at scrape time. A figure that is unknown (a server not
    read, stale, or not exporting it) has no series rather than a zero."""

    def __init__(self, figures: Callable[[], VllmFigures]) -> None:
        self._figures = figures

    def collect(self) -> Iterator[Metric]:
        figures = self._figures()
        up = GaugeMetricFamily(
            VLLM_UP, "1 while the server's /metrics is read and fresh, else 0.", labels=["provider"]
        )
        gauges = [
            (GaugeMetricFamily(name, text, labels=["provider"]), path, scale)
            for name, text, path, scale in _VLLM_GAUGES
        ]
        position = GaugeMetricFamily(
            VLLM_SPEC_POSITION,
            "Speculative decoding: share of drafts accepted up to each draft position.",
            labels=["provider", "position"],
        )
        for provider in sorted(figures):
            shown = figures[provider]
            up.add_metric([provider], 1.0 if shown.get("state") == "ok" else 0.0)
            for family, path, scale in gauges:
                value = _number_at(shown, path)
                if value is not None:
                    family.add_metric([provider], value * scale)
            spec = shown.get("spec_decode")
            shares = spec.get("per_position") if isinstance(spec, Mapping) else None
            for i, share in enumerate(shares if isinstance(shares, list) else ()):
                if isinstance(share, int | float) and not isinstance(share, bool):
                    position.add_metric([provider, str(i)], float(share))
        yield up
        for family, _, _ in gauges:
            yield family
        yield position


def _number_at(figures: Mapping[str, Any], path: tuple[str, ...]) -> float | None:
    """The number at `path`; None when a step is missing or it is no number."""
    value: Any = figures
    for key in path:
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def make_registry(*collectors: Collector) -> CollectorRegistry:
    """A registry of `collectors`, plus the process's (`process_resident_memory_bytes`,
    `process_open_fds`, CPU, ...) and the event loop's task count, all read at scrape time."""
    registry = CollectorRegistry(auto_describe=False)
    try:
        loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    # registry=None: the collector would otherwise also join prometheus_client's global registry.
    process = ProcessCollector(registry=None)
    for collector in (*collectors, process, EventLoopCollector(loop)):
        registry.register(collector)
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)

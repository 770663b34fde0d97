"""The catalogue of every metric family `GET /metrics` exposes, for the generated metrics
reference and the test that keeps it honest."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from gateway.latency import Snapshot
from gateway.telemetry import prometheus
from gateway.telemetry.meters import (
    BatchingCollector,
    BatchingState,
    ExtraLoadCollector,
    GuardsCollector,
    LimitsCollector,
    LimitsState,
    Meters,
    PromptTokensCollector,
)
from gateway.telemetry.prometheus import (
    EventLoopCollector,
    LatencyStoreCollector,
    ResponsesStoreCollector,
    VllmCollector,
)

__all__ = ["MetricInfo", "catalogue"]


@dataclass(frozen=True, slots=True)
class MetricInfo:
    """One metric family as `GET /metrics` exposes it."""

    name: str  # as exposed: a counter with its `_total`
    type: str  # counter | gauge | histogram
    labels: tuple[str, ...]
    help: str


class _NoStore:
    def health(self) -> dict[str, str]:
        return {"store": "memory", "state": "ok"}

    def stats(self) -> dict[str, int]:
        return {}


def catalogue() -> list[MetricInfo]:
    """Every metric family `GET /metrics` exposes, sorted by name (what the metrics reference is
    generated from). The meters and collectors are built here with empty state; the app builds
    the same set around its live state."""
    loop = asyncio.new_event_loop()  # the event-loop collector counts this loop's (no) tasks
    try:
        meters = Meters(CollectorRegistry(auto_describe=False), {})
        snapshot = Snapshot(window_s=60, taken_at=0.0, source="memory")
        collectors: list[Collector] = [
            *(m for m in vars(meters).values() if isinstance(m, MetricWrapperBase)),
            meters.fallbacks.counter,
            meters.fallback_served.counter,
            PromptTokensCollector(meters.prompt_tokens),
            LatencyStoreCollector(lambda: {"type": "memory", "state": "ok"}, dict),
            ResponsesStoreCollector(lambda: _NoStore()),
            GuardsCollector(dict, dict, int, int, dict),
            BatchingCollector(lambda: BatchingState({}, {}, {}, {}, 0)),
            LimitsCollector(lambda: LimitsState({}, 0, {}, 0)),
            ExtraLoadCollector(lambda: snapshot, list),
            VllmCollector(dict),
            prometheus.AffinityCollector(dict),
            prometheus.BulkPreemptionsCollector(dict),
            ProcessCollector(registry=None),
            EventLoopCollector(loop),
        ]
        found: dict[str, MetricInfo] = {}
        for collector in collectors:
            # Label names show only in samples, and a meter with no traffic has none: read the
            # names each metric was declared with.
            declared = getattr(collector, "_labelnames", None)
            for family in collector.collect():
                labels = declared if declared is not None else getattr(family, "_labelnames", ())
                name = family.name + ("_total" if family.type == "counter" else "")
                shown = tuple(label for label in labels if label != "le")
                found[name] = MetricInfo(name, family.type, shown, family.documentation)
    finally:
        loop.close()
    return [found[name] for name in sorted(found)]

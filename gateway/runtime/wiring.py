"""Metrics wiring: the collectors that read a running gateway's state at scrape time, through
the current `Services` (so a reload is seen at the next scrape)."""

from __future__ import annotations

from collections.abc import Callable

from gateway.admission.ratelimit import Admission, RateLimiter
from gateway.latency import LatencyStore
from gateway.runtime.compose import Services
from gateway.telemetry import (
    BatchingCollector,
    BatchingState,
    ExtraLoadCollector,
    GuardsCollector,
    LatencyStoreCollector,
    LimitsCollector,
    LimitsState,
    Registry,
    Tracing,
    make_registry,
)
from gateway.telemetry.prometheus import (
    AffinityCollector,
    BulkPreemptionsCollector,
    ResponsesStoreCollector,
)


def metrics_registry(
    current: Callable[[], Services],
    latency: LatencyStore,
    limiter: RateLimiter,
    admission: Admission,
    tracing: Tracing,
) -> Registry:
    """What `GET /metrics` exposes: the request path's meters join it, the rest is read here."""
    return make_registry(
        LatencyStoreCollector(
            latency.health,
            lambda: {d: s.inflight for d, s in latency.snapshot.deployments.items()},
        ),
        GuardsCollector(
            lambda: _cooldowns_opened(current()),
            lambda: current().guards.hedges.counts,
            lambda: current().guards.retries.denied,
            lambda: tracing.dropped,
            lambda: tracing.decisions,
        ),
        BatchingCollector(lambda: _batching_state(current())),
        LimitsCollector(lambda: _limits_state(limiter, admission)),
        ExtraLoadCollector(
            lambda: latency.snapshot,
            lambda: (m.name for m in current().settings.models),
        ),
        AffinityCollector(lambda: current().affinity.counts),
        BulkPreemptionsCollector(
            lambda: _preemptions(current()), lambda: _server_preempts(current())
        ),
        ResponsesStoreCollector(lambda: current().responses),
    )


def _preemptions(services: Services) -> dict[str, int]:
    return dict(services.gate.preemptions) if services.gate is not None else {}


def _server_preempts(services: Services) -> dict[str, bool]:
    return services.gate.server_preempts() if services.gate is not None else {}


def _batching_state(services: Services) -> BatchingState:
    gate = services.gate
    return BatchingState(
        waiting={d: b.waiting for d, b in services.batchers.items()},
        rejected={d: b.rejected for d, b in services.batchers.items()},
        bulk_limits=gate.limits() if gate is not None else {},
        bulk_waiting=gate.waiting() if gate is not None else {},
        bulk_rejected=gate.rejected if gate is not None else 0,
    )


def _limits_state(limiter: RateLimiter, admission: Admission) -> LimitsState:
    return LimitsState(
        rate_limited=limiter.refused,
        store_errors=limiter.store_errors,
        store_outages=limiter.outages,
        store_degraded=limiter.degraded,
        concurrency_refused=admission.refused,
        in_flight=admission.active,
    )


def _cooldowns_opened(services: Services) -> dict[str, int]:
    """Times each configured deployment's breaker opened, 0 for those that never did: a series
    from the start, so that `increase()` sees the first opening too."""
    opened = dict.fromkeys((d.id for m in services.settings.models for d in m.deployments), 0)
    return opened | services.guards.cooldowns.opened

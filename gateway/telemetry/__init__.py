"""Telemetry: Prometheus metrics, OpenTelemetry traces and the access log.

Names live in `gateway.telemetry.semconv`. The request path only increments counters and, when
tracing is configured, starts and ends spans; everything else happens at scrape or export time,
off the request path. Each app owns its registry and tracer provider, so apps never mix their
numbers.
"""

from gateway.telemetry.access import AccessLog, configure_logging
from gateway.telemetry.meters import (
    BatchingCollector,
    BatchingState,
    ExtraLoadCollector,
    GuardsCollector,
    LimitsCollector,
    LimitsState,
    Meters,
)
from gateway.telemetry.prometheus import (
    CONTENT_TYPE,
    LatencyStoreCollector,
    Registry,
    exposition,
    make_registry,
)
from gateway.telemetry.tracing import RequestTrace, Tracing, tracing_from_env

__all__ = [
    "CONTENT_TYPE",
    "AccessLog",
    "BatchingCollector",
    "BatchingState",
    "ExtraLoadCollector",
    "GuardsCollector",
    "LatencyStoreCollector",
    "LimitsCollector",
    "LimitsState",
    "Meters",
    "Registry",
    "RequestTrace",
    "Tracing",
    "configure_logging",
    "exposition",
    "make_registry",
    "tracing_from_env",
]

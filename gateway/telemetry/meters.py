"""The gateway's Prometheus metrics: GenAI client metrics per upstream attempt, the server metric
and counters per client request, and the routing guards' counters read at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway import semconv as sc
from gateway.latency import CANCELLED, HEDGE_LOST, TTFT_DEADLINE, Sample

disable_created_metrics()  # type: ignore[no-untyped-call]  # `*_created` series double the exposition and no dashboard reads them
_ABANDONED = (TTFT_DEADLINE, HEDGE_LOST, CANCELLED)  # attempts cut short: no duration of their own


class Meters:
    """Metrics the request path updates. Also a `Recorder`: every finished upstream attempt is
    handed here as a `Sample`, like to the latency store.

    `deployments` maps a deployment id to its (gen_ai.provider.name, upstream model) pair.
    Label children are cached: the request path does a dict lookup, not a label validation.
    """

    def __init__(
        self, registry: CollectorRegistry, deployments: Mapping[str, tuple[str, str]]
    ) -> None:
        self._deployments = dict(deployments)
        self._children: dict[tuple[object, tuple[str, ...]], Any] = {}
        # (model, route or "error") -> requests since start: what the dashboard reads.
        self.routes: dict[tuple[str, str], int] = {}
        ops = [sc.L_OPERATION, sc.L_PROVIDER, sc.L_REQUEST_MODEL]
        self.requests = Counter(
            sc.REQUESTS,
            "Client requests, by the model asked for, the deployment that served (empty when "
            "none did), the route and the HTTP status.",
            ["model", "deployment", "route", "status"],
            registry=registry,
        )
        self.attempts = Counter(
            sc.ATTEMPTS,
            "Upstream attempts by how they ended: won, error, ttft_deadline, hedge_lost, "
            "cancelled.",
            ["deployment", "outcome"],
            registry=registry,
        )
        self.fallbacks = Counter(
            sc.FALLBACKS,
            "Requests served by a candidate other than the first, by why: budget, "
            "budget_unattainable, ttft_failover, error_fallback.",
            ["model", "reason"],
            registry=registry,
        )
        self.client_duration = Histogram(
            sc.CLIENT_OPERATION_DURATION,
            "GenAI operation duration per upstream attempt that completed or failed.",
            [*ops, sc.L_ERROR_TYPE],
            buckets=sc.DURATION_BUCKETS,
            registry=registry,
        )
        self.tokens = Histogram(
            sc.CLIENT_TOKEN_USAGE,
            "Tokens per successful upstream attempt, input and output.",
            [*ops, sc.L_TOKEN_TYPE],
            buckets=sc.TOKEN_BUCKETS,
            registry=registry,
        )
        self.first_chunk = Histogram(
            sc.CLIENT_TIME_TO_FIRST_CHUNK,
            "Time from an upstream attempt's start to its first content chunk (streams).",
            ops,
            buckets=sc.DURATION_BUCKETS,
            registry=registry,
        )
        self.per_chunk = Histogram(
            sc.CLIENT_TIME_PER_OUTPUT_CHUNK,
            "Mean time per output chunk after the first, per streamed attempt.",
            ops,
            buckets=sc.DURATION_BUCKETS,
            registry=registry,
        )
        self.server_duration = Histogram(
            sc.SERVER_REQUEST_DURATION,
            "Client request duration at the gateway, by the model asked for.",
            [sc.L_OPERATION, sc.L_REQUEST_MODEL, sc.L_ERROR_TYPE],
            buckets=sc.DURATION_BUCKETS,
            registry=registry,
        )
        self.batch_size = Histogram(
            sc.BATCH_SIZE,
            "Inputs per micro-batch sent upstream.",
            ["deployment", "endpoint"],
            buckets=sc.BATCH_SIZE_BUCKETS,
            registry=registry,
        )
        self.batch_wait = Histogram(
            sc.BATCH_WAIT,
            "How long a request waited in its micro-batch queue.",
            ["deployment", "endpoint"],
            buckets=sc.OVERHEAD_BUCKETS,
            registry=registry,
        )
        self.overhead = Histogram(
            sc.OVERHEAD,
            "Gateway time on a request outside the upstream: before the first attempt, and "
            "relaying the committing event.",
            ["model"],
            buckets=sc.OVERHEAD_BUCKETS,
            registry=registry,
        )

    def describe(self, deployments: Mapping[str, tuple[str, str]]) -> None:
        """Learn the (provider name, upstream model) of deployments (a reload may add some)."""
        self._deployments.update(deployments)

    def batch(self, deployment: str, endpoint: str, inputs: int, waits: list[float]) -> None:
        """A micro-batch left for `deployment`."""
        self._child(self.batch_size, deployment, endpoint).observe(inputs)
        wait = self._child(self.batch_wait, deployment, endpoint)
        for seconds in waits:
            wait.observe(seconds)

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def record(self, sample: Sample) -> None:
        """One finished upstream attempt."""
        error = sample.error
        outcome = "won" if sample.ok else (error if error in _ABANDONED else "error")
        self._child(self.attempts, sample.deployment, outcome or "error").inc()
        if outcome in _ABANDONED:
            return
        system, model = self._deployments.get(sample.deployment, ("", sample.deployment))
        operation = sc.OPERATIONS.get(sample.endpoint, sample.endpoint)
        self._child(
            self.client_duration, operation, system, model, "" if sample.ok else error or "error"
        ).observe(sample.total_s)
        if not sample.ok:
            return
        if sample.ttft_s is not None:
            self._child(self.first_chunk, operation, system, model).observe(sample.ttft_s)
        if sample.tpot_s is not None:
            self._child(self.per_chunk, operation, system, model).observe(sample.tpot_s)
        if sample.input_tokens is not None:
            self._child(self.tokens, operation, system, model, "input").observe(sample.input_tokens)
        if sample.output_tokens is not None:
            self._child(self.tokens, operation, system, model, "output").observe(
                sample.output_tokens
            )

    def request(
        self,
        *,
        model: str,
        endpoint: str,
        deployment: str,
        route: str,
        status: int,
        duration_s: float,
        overhead_s: float | None,
        error_type: str | None,
    ) -> None:
        """One client request, answered (or failed) as `status`."""
        self._child(self.requests, model, deployment, route, str(status)).inc()
        key = (model, route if status < 400 else "error")
        self.routes[key] = self.routes.get(key, 0) + 1
        operation = sc.OPERATIONS.get(endpoint, endpoint)
        self._child(self.server_duration, operation, model, error_type or "").observe(duration_s)
        if overhead_s is not None:
            self._child(self.overhead, model).observe(overhead_s)
        if route not in ("", "primary", "hedge"):
            self._child(self.fallbacks, model, route).inc()


class GuardsCollector(Collector):
    """Counters kept elsewhere, read at scrape time: breaker openings per deployment, hedges
    started/won/denied per model, failovers refused by the retry budget, spans dropped."""

    def __init__(
        self,
        cooldowns: Callable[[], Mapping[str, int]],
        hedges: Callable[[], Mapping[tuple[str, str], int]],
        retries_denied: Callable[[], int],
        spans_dropped: Callable[[], int],
    ) -> None:
        self._cooldowns = cooldowns
        self._hedges = hedges
        self._retries_denied = retries_denied
        self._spans_dropped = spans_dropped

    def collect(self) -> Iterator[Metric]:
        opened = CounterMetricFamily(
            sc.COOLDOWNS, "Times a deployment's circuit breaker opened.", labels=["deployment"]
        )
        for deployment, count in sorted(self._cooldowns().items()):
            opened.add_metric([deployment], float(count))
        yield opened
        hedges = CounterMetricFamily(
            sc.HEDGES,
            "Hedges by result: started, won (served the request), denied (over the cap).",
            labels=["model", "result"],
        )
        for (model, result), count in sorted(self._hedges().items()):
            hedges.add_metric([model, result], float(count))
        yield hedges
        denied = CounterMetricFamily(
            sc.RETRY_BUDGET_EXHAUSTED, "Failovers not made because the retry budget was spent."
        )
        denied.add_metric([], float(self._retries_denied()))
        yield denied
        dropped = CounterMetricFamily(
            sc.SPANS_DROPPED, "Trace spans dropped because the export queue was full."
        )
        dropped.add_metric([], float(self._spans_dropped()))
        yield dropped


@dataclass(frozen=True, slots=True)
class LimitsState:
    rate_limited: Mapping[tuple[str, str], int]  # refusals by (key, requests | tokens)
    store_errors: int  # the rate-limit store's failures
    concurrency_refused: Mapping[str, int]  # refusals by cap: gateway | key
    in_flight: int  # LLM requests admitted and not yet finished


class LimitsCollector(Collector):
    """The admission limits' counters, read at scrape time."""

    def __init__(self, state: Callable[[], LimitsState]) -> None:
        self._state = state

    def collect(self) -> Iterator[Metric]:
        state = self._state()
        limited = CounterMetricFamily(
            sc.RATE_LIMITED, "Requests refused by a key's rpm or tpm.", labels=["key", "limit"]
        )
        for (key, kind), count in sorted(state.rate_limited.items()):
            limited.add_metric([key, kind], float(count))
        yield limited
        errors = CounterMetricFamily(
            sc.RATE_LIMIT_STORE_ERRORS, "Rate-limit checks the shared store failed to answer."
        )
        errors.add_metric([], float(state.store_errors))
        yield errors
        refused = CounterMetricFamily(
            sc.CONCURRENCY_REFUSED,
            "Requests refused because the gateway's or the key's requests in flight were at "
            "their cap.",
            labels=["cap"],
        )
        for cap, count in sorted(state.concurrency_refused.items()):
            refused.add_metric([cap], float(count))
        yield refused
        in_flight = GaugeMetricFamily(sc.REQUESTS_IN_FLIGHT, "LLM requests being served.")
        in_flight.add_metric([], float(state.in_flight))
        yield in_flight


@dataclass(frozen=True, slots=True)
class BatchingState:
    waiting: Mapping[str, int]  # inputs queued per deployment
    rejected: Mapping[str, int]  # requests refused because their queue was full
    bulk_limits: Mapping[str, int]  # bulk chat concurrency limit per deployment
    bulk_waiting: Mapping[str, int]
    bulk_rejected: int


class BatchingCollector(Collector):
    """Micro-batch queues and the bulk admission gate, read at scrape time."""

    def __init__(self, state: Callable[[], BatchingState]) -> None:
        self._state = state

    def collect(self) -> Iterator[Metric]:
        state = self._state()
        for name, text, values, kind in (
            (sc.BATCH_QUEUE, "Inputs waiting in micro-batch queues.", state.waiting, "gauge"),
            (
                sc.BATCH_REJECTED,
                "Requests refused because their micro-batch queue was full.",
                state.rejected,
                "counter",
            ),
            (
                sc.BULK_LIMIT,
                "Bulk chat requests allowed at once, as steered by interactive TTFT.",
                state.bulk_limits,
                "gauge",
            ),
            (
                sc.BULK_WAITING,
                "Bulk chat requests waiting for a slot.",
                state.bulk_waiting,
                "gauge",
            ),
        ):
            family: GaugeMetricFamily | CounterMetricFamily = (
                GaugeMetricFamily(name, text, labels=["deployment"])
                if kind == "gauge"
                else CounterMetricFamily(name, text, labels=["deployment"])
            )
            for deployment, value in sorted(values.items()):
                family.add_metric([deployment], float(value))
            yield family
        rejected = CounterMetricFamily(
            sc.BULK_REJECTED, "Bulk chat requests refused because too many were waiting."
        )
        rejected.add_metric([], float(state.bulk_rejected))
        yield rejected

"""The gateway's Prometheus metrics: GenAI client metrics per upstream attempt, the server metric
and counters per client request, and the routing guards' counters read at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.latency import BYTES_PER_TOKEN, CANCELLED, HEDGE_LOST, TTFT_DEADLINE, Sample, Snapshot
from gateway.telemetry import semconv as sc
from gateway.telemetry.fallbacks import Fallbacks, FallbackServed
from gateway.telemetry.usage import PromptTokens

disable_created_metrics()  # type: ignore[no-untyped-call]  # `*_created` series double the exposition and no dashboard reads them
_ABANDONED = (TTFT_DEADLINE, HEDGE_LOST, CANCELLED)  # attempts cut short: no duration of their own

# --- label vocabularies --------------------------------------------------------------------------
# A label value that could come from outside (an upstream's error code, status or type) is mapped
# onto these fixed sets, so that no upstream or client can grow the number of series.

GATEWAY_ERRORS: Final = frozenset(
    {
        # error codes the gateway answers with (gateway/errors.py and the request checks)
        *("admin_key_not_allowed", "admin_key_required", "all_candidates_failed"),
        *("budget_exceeded", "context_length_exceeded", "deployments_cooling_down"),
        *("empty_array", "headers_too_large", "integer_below_min_value", "invalid_api_key"),
        *("invalid_header", "invalid_json", "invalid_request", "invalid_type", "invalid_value"),
        *("key_limit_exceeded", "missing_api_key", "missing_required_parameter"),
        *("model_not_allowed", "model_not_found", "overloaded", "permission_denied"),
        *("rate_limit_exceeded", "request_timeout", "request_too_large", "upstream_error"),
        *("upstream_overloaded", "upstream_rejected", "upstream_stream_error"),
        *("upstream_timeout", "not_found", "method_not_allowed", "http_error", "internal_error"),
        *("duplicate_key", "invalid_http_request", "json_too_deep"),
        *("store_unavailable", "previous_response_not_found", "response_not_found"),
        *("unsupported_parameter", "invalid", "array_above_max_length"),
        *("conversation_not_found", "conversation_too_large", "conversations_disabled"),
        *("item_not_found", "mutually_exclusive_parameters"),
        # error types, for an error without a code
        *("server_error", "invalid_request_error", "rate_limit_error", "requests", "tokens"),
        # how a request ended without an error response
        *("client_disconnected", "shutdown", "internal"),
        # why an upstream attempt failed
        *("connection_error", "invalid_response", "timeout", "truncated", "total_deadline"),
        *("inband_error", "stream_idle", "precommit_limit", "error"),
        # a content filter refused; a token file unreadable; no token from an OAuth endpoint
        *("content_filter", "credentials", "auth"),
        *("ProviderError", "ProviderTimeoutError", "RateLimitedError"),
        *("ProviderUnavailableError", "ProviderRejectedError", "ContentFilteredError"),
    }
)
# Upstream statuses kept as they are; any other becomes its class (`4xx`, `5xx`).
UPSTREAM_STATUSES: Final = frozenset(
    str(status) for status in (400, 401, 403, 404, 408, 409, 413, 422, 429, 500, 502, 503, 504, 529)
)
UPSTREAM_OTHER: Final = "upstream_other"
ERROR_TYPES: Final = (
    GATEWAY_ERRORS | UPSTREAM_STATUSES | {"1xx", "2xx", "3xx", "4xx", "5xx"} | {UPSTREAM_OTHER}
)


def error_label(value: str | None) -> str:
    """The `error_type` label for an error code, type or attempt outcome: itself when it is in
    `ERROR_TYPES`, an HTTP status's class for a status not in `UPSTREAM_STATUSES`, else
    `upstream_other` (e.g. an upstream's own error code). "" for no error."""
    if not value:
        return ""
    if value in ERROR_TYPES:
        return value
    if len(value) == 3 and value.isascii() and value.isdigit() and "1" <= value[0] <= "5":
        return value[0] + "xx"
    return UPSTREAM_OTHER


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
        self.fallbacks = Fallbacks(registry)
        self.fallback_served = FallbackServed(registry)
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
        self.stage_duration = Histogram(
            sc.STAGE_DURATION,
            "Time in each stage of a committed client request, by the model asked for: "
            "overhead (the gateway's own), queue (bulk admission), connect (to the winning "
            "attempt's response headers), ttft (arrival to first token, streams), decode (first "
            "to last token, streams), total.",
            ["model", "stage"],
            buckets=sc.STAGE_BUCKETS,
            registry=registry,
        )
        self._stages: dict[str, tuple[Any, ...]] = {}  # model -> one child per stage
        self.slo_requests = Counter(
            sc.SLO_REQUESTS,
            "Client requests judged against a budget they had, by the model asked for, the "
            "deployment that served (empty when none did), the budget (ttft, total, tpot) and "
            "whether it was met or missed.",
            ["model", "deployment", "slo", "result"],
            registry=registry,
        )
        self.wasted_attempts = Counter(
            sc.WASTED_ATTEMPTS,
            "Upstream attempts started and thrown away for another attempt of the same request "
            "(cut at a deadline, or beaten by a hedge).",
            ["model", "deployment"],
            registry=registry,
        )
        self.wasted_prompt_tokens = Counter(
            sc.WASTED_PROMPT_TOKENS,
            "Prompt tokens of the wasted attempts (estimated from the body size: prefill work "
            "started and thrown away).",
            ["model", "deployment"],
            registry=registry,
        )
        # Prompt tokens and the part the upstream's prompt cache served, exposed at scrape time.
        self.prompt_tokens = PromptTokens()
        registry.register(PromptTokensCollector(self.prompt_tokens))

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
        if sample.wasted:
            self._child(self.wasted_attempts, sample.model, sample.deployment).inc()
            tokens = (sample.prompt_bytes or 0) // BYTES_PER_TOKEN
            self._child(self.wasted_prompt_tokens, sample.model, sample.deployment).inc(tokens)
        error = sample.error
        outcome = "won" if sample.ok else (error if error in _ABANDONED else "error")
        self._child(self.attempts, sample.deployment, outcome or "error").inc()
        if outcome in _ABANDONED:
            return
        system, model = self._deployments.get(sample.deployment, ("", sample.deployment))
        operation = sc.OPERATIONS.get(sample.endpoint, sample.endpoint)
        self._child(
            self.client_duration,
            operation,
            system,
            model,
            "" if sample.ok else error_label(error or "error"),
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
        first: bool = True,
    ) -> None:
        """One client request, answered (or failed) as `status`. `first`: whether the candidate
        that served it (if any) is the first one its plan was made from; an answer from any
        other, reached by any route but a hedge, is a fallback."""
        self._child(self.requests, model, deployment, route, str(status)).inc()
        key = (model, route if status < 400 else "error")
        self.routes[key] = self.routes.get(key, 0) + 1
        operation = sc.OPERATIONS.get(endpoint, endpoint)
        self._child(self.server_duration, operation, model, error_label(error_type)).observe(
            duration_s
        )
        if overhead_s is not None:
            self._child(self.overhead, model).observe(overhead_s)
        if not first and status < 400 and route and route != "hedge":
            self.fallbacks.count(model, route)

    def judged(self, model: str, deployment: str, verdicts: Mapping[str, bool]) -> None:
        """One client request's verdicts: {"ttft" | "total" | "tpot": met}, for each budget it
        was judged on ("" deployment: none served)."""
        for slo, met in verdicts.items():
            self._child(self.slo_requests, model, deployment, slo, "met" if met else "missed").inc()

    def stages(
        self,
        model: str,
        *,
        arrived: float,
        ended: float,
        started: float,
        connected: float | None,
        first_token: float | None,
        last_token: float | None,
        overhead_s: float | None,
        queue_s: float | None,
    ) -> None:
        """The stages of one committed request, from its clock readings (perf_counter s):
        `started`/`connected` of the winning attempt, and `first_token`/`last_token` for a
        stream (None otherwise). A stage that did not happen is not observed."""
        children = self._stages.get(model)
        if children is None:
            children = tuple(self.stage_duration.labels(model, stage) for stage in sc.STAGES)
            self._stages[model] = children
        overhead, queue, connect, ttft, decode, total = children
        if overhead_s is not None:
            overhead.observe(overhead_s)
        queue.observe(queue_s or 0.0)  # no bulk gate: no wait
        if connected:
            connect.observe(connected - started)
        if first_token is not None:
            ttft.observe(first_token - arrived)
            if last_token is not None:
                decode.observe(last_token - first_token)
        total.observe(ended - arrived)


class GuardsCollector(Collector):
    """Counters kept elsewhere, read at scrape time: breaker openings per deployment, hedges
    started/won/denied per model, failovers refused by the retry budget, dropped spans, traces."""

    def __init__(
        self,
        cooldowns: Callable[[], Mapping[str, int]],
        hedges: Callable[[], Mapping[tuple[str, str], int]],
        retries_denied: Callable[[], int],
        spans_dropped: Callable[[], int],
        traces: Callable[[], Mapping[tuple[str, str], int]],
    ) -> None:
        self._cooldowns = cooldowns
        self._hedges = hedges
        self._retries_denied = retries_denied
        self._spans_dropped = spans_dropped
        self._traces = traces

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
        traces = CounterMetricFamily(
            sc.TRACES,
            "Traces the tail sampler exported or dropped, by reason.",
            labels=["decision", "reason"],
        )
        for (decision, reason), count in sorted(self._traces().items()):
            traces.add_metric([decision, reason], float(count))
        yield traces


class PromptTokensCollector(Collector):
    """The prompt tokens of committed requests, and those the upstream read from and wrote to
    its prompt cache, per model and deployment, read from `PromptTokens` at scrape time. A cache
    count has a series only once its upstream reported one."""

    def __init__(self, tokens: PromptTokens) -> None:
        self._tokens = tokens

    def collect(self) -> Iterator[Metric]:
        labels = ["model", "deployment"]
        families = (
            CounterMetricFamily(
                sc.INPUT_TOKENS,
                "Prompt tokens of committed client requests, as the upstream reported them (cache "
                "reads and writes included), by the model asked for and the deployment that "
                "served.",
                labels=labels,
            ),
            CounterMetricFamily(
                sc.CACHED_INPUT_TOKENS,
                "Prompt tokens of committed client requests that the upstream read from its "
                "prompt cache (part of tailguard_input_tokens_total).",
                labels=labels,
            ),
            CounterMetricFamily(
                sc.CACHE_WRITE_INPUT_TOKENS,
                "Prompt tokens of committed client requests that the upstream wrote to its "
                "prompt cache (part of tailguard_input_tokens_total; Anthropic's "
                "cache_creation_input_tokens).",
                labels=labels,
            ),
        )
        for key, counts in sorted(self._tokens.counts.items()):
            for family, value in zip(families, counts, strict=True):
                if value is not None:
                    family.add_metric(list(key), float(value))
        yield from families


class ExtraLoadCollector(Collector):
    """Each model's extra load over the latency window, read from the snapshot at scrape time:
    latency rescues (hedges and deadline failovers) per client request, all replicas counted."""

    def __init__(
        self, snapshot: Callable[[], Snapshot], models: Callable[[], Iterable[str]]
    ) -> None:
        self._snapshot = snapshot
        self._models = models  # the configured model names: one series each, traffic or not

    def collect(self) -> Iterator[Metric]:
        extra = GaugeMetricFamily(
            sc.EXTRA_LOAD,
            "Latency rescues (hedges and deadline failovers) per client request of the model, "
            "over the latency window.",
            labels=["model"],
        )
        known = self._snapshot().models
        for model in sorted(self._models()):
            stats = known.get(model)
            clients = stats.clients if stats is not None else 0
            extra.add_metric([model], stats.hedges / clients if stats and clients else 0.0)
        yield extra


@dataclass(frozen=True, slots=True)
class LimitsState:
    rate_limited: Mapping[tuple[str, str], int]  # refusals by (key, requests | tokens)
    store_errors: int  # the rate-limit store's failures
    concurrency_refused: Mapping[str, int]  # refusals by cap: gateway | key
    in_flight: int  # LLM requests admitted and not yet finished
    store_outages: int = 0  # times the rate-limit store's breaker opened
    store_degraded: bool = False  # limits decided without the shared store now


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
        outages = CounterMetricFamily(
            sc.RATE_LIMIT_STORE_OUTAGES,
            "Times the rate-limit store's breaker opened: one per outage, however many checks "
            "failed in it.",
        )
        outages.add_metric([], float(state.store_outages))
        yield outages
        degraded = GaugeMetricFamily(
            sc.RATE_LIMIT_DEGRADED,
            "1 while rate limits are decided without the shared store (per replica, or "
            "refused), else 0.",
        )
        degraded.add_metric([], float(state.store_degraded))
        yield degraded
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


# --- the catalogue -------------------------------------------------------------------------------

"""How one LLM request ended, recorded once: meters, its trace, its access line, its key's charge
settled and its budgets judged.

A request refused at admission and one that was routed and relayed both end in one
`RequestOutcome` and one call to `record`; a routed request's span is started here too
(`start_trace`), so a span is begun and ended in one place.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.api.admit import TRACEPARENT, Admitted
from gateway.models import Endpoint
from gateway.routing import Decision, Opened
from gateway.runtime import Services
from gateway.telemetry import RequestTrace
from gateway.telemetry import semconv as sc

if TYPE_CHECKING:  # the context is made by the edge, which records through this module
    from gateway.api.edge import RequestContext

_SLO_ATTRIBUTES = {
    "ttft": sc.TG_SLO_TTFT_MET,
    "total": sc.TG_SLO_TOTAL_MET,
    "tpot": sc.TG_SLO_TPOT_MET,
}


@dataclass(slots=True, eq=False)
class RequestOutcome:
    """How one LLM request ended. Filled in as it goes; `record` reads it once, at the end."""

    services: Services  # the services it was admitted under (or refused by)
    ctx: RequestContext
    endpoint: Endpoint
    ticket: Admitted | None = None  # its key's charge, settled by `record`
    decision: Decision | None = None  # None: refused before it was routed
    status: int = 499  # until something is sent: a client that leaves first
    error_type: str | None = "client_disconnected"
    headers: Sequence[tuple[bytes, bytes]] = ()  # a refused request's own (for its traceparent)
    trace: RequestTrace | None = None
    opened: Opened | None = None  # the committed attempt
    overhead_s: float | None = None  # what the gateway added (`x-tailguard-overhead-ms`)
    queue_s: float | None = None  # how long a bulk request waited for its slot


def start_trace(outcome: RequestOutcome) -> None:
    """Start the span of a routed request (tracing on); `record` ends it."""
    ctx, decision = outcome.ctx, outcome.decision
    assert decision is not None
    call, budget = decision.call, decision.budget
    attributes: dict[str, Any] = {
        sc.HTTP_REQUEST_METHOD: "POST",
        sc.HTTP_ROUTE: ctx.path,
        sc.GEN_AI_OPERATION_NAME: sc.OPERATIONS[call.endpoint],
        sc.GEN_AI_REQUEST_MODEL: call.model,
        sc.TG_REQUEST_ID: ctx.request_id,
    }
    if call.max_tokens is not None:
        attributes[sc.GEN_AI_REQUEST_MAX_TOKENS] = call.max_tokens
    if budget.ttft_s is not None:
        attributes[sc.TG_BUDGET_TTFT_MS] = round(budget.ttft_s * 1000)
    if budget.total_s is not None:
        attributes[sc.TG_BUDGET_TOTAL_MS] = round(budget.total_s * 1000)
    if decision.plan.affinity is not None:
        attributes[sc.TG_AFFINITY] = decision.plan.affinity
    outcome.trace = outcome.services.tracing.request(
        f"POST {ctx.path}",
        traceparent=decision.headers.get("traceparent"),
        arrived=ctx.arrived,
        attributes=attributes,
    )


def record(outcome: RequestOutcome) -> None:
    """Count the request, end its span, write its access log line, settle its key's charge."""
    if outcome.decision is None:
        _refused(outcome)
    else:
        _served(outcome, outcome.decision)
    key = outcome.ticket
    if key is not None and key.principal.tpm is not None:
        # Charge what the upstream reported instead of the estimate; nothing when no upstream
        # answered (a refusal, an error, or a client that left first).
        used = 0
        if outcome.opened is not None:
            tally = outcome.opened.tally
            prompt = tally.usage.input_tokens
            used = (key.prompt_estimate if prompt is None else prompt) + tally.output_tokens
        key.limiter.settle(key.principal, used - key.charged)


def _refused(outcome: RequestOutcome) -> None:
    """A request answered before any upstream was tried."""
    services, ctx, endpoint = outcome.services, outcome.ctx, outcome.endpoint
    status, error_type = outcome.status, outcome.error_type
    model = ctx.model  # set once the name is known to be configured
    duration = time.perf_counter() - ctx.arrived
    services.meters.request(
        model=model,
        endpoint=endpoint,
        deployment="",
        route="",
        status=status,
        duration_s=duration,
        overhead_s=None,
        error_type=error_type,
    )
    trace_id = None
    if services.tracing.enabled:
        traceparent = None
        for name, value in outcome.headers:
            if name == b"traceparent" and TRACEPARENT.match(value.decode("latin-1")):
                traceparent = value.decode("latin-1")
        attributes: dict[str, Any] = {
            sc.HTTP_REQUEST_METHOD: "POST",
            sc.HTTP_ROUTE: ctx.path,
            sc.GEN_AI_OPERATION_NAME: sc.OPERATIONS[endpoint],
            sc.TG_REQUEST_ID: ctx.request_id,
        }
        if model:
            attributes[sc.GEN_AI_REQUEST_MODEL] = model
        trace = services.tracing.request(
            f"POST {ctx.path}", traceparent=traceparent, arrived=ctx.arrived, attributes=attributes
        )
        if trace is not None:
            trace_id = trace.trace_id
            trace.end(status=status, attributes={}, error_type=error_type)
    if services.access.enabled:
        services.access.write(
            {
                "time": round(time.time(), 3),
                "request_id": ctx.request_id,
                "trace_id": trace_id,
                "path": ctx.path,
                "model": model,
                "requested_model": ctx.requested or None,
                "key": ctx.principal.name if ctx.principal is not None else None,
                "status": status,
                "error": error_type,
                "total_ms": round(duration * 1000, 3),
            }
        )


def _served(outcome: RequestOutcome, decision: Decision) -> None:
    """A request that was routed: what served it, its stages, its budgets judged."""
    services, ctx, opened = outcome.services, outcome.ctx, outcome.opened
    call, model = decision.call, ctx.model
    arrived = ctx.arrived
    now = time.perf_counter()
    deployment = route = ""
    attempts = 0
    tally = None
    if opened is not None:
        deployment, route, tally = opened.candidate.id, opened.route, opened.tally
        attempts = len(opened.attempts)
    services.meters.request(
        model=model,
        endpoint=call.endpoint,
        deployment=deployment,
        route=route,
        status=outcome.status,
        duration_s=now - arrived,
        overhead_s=outcome.overhead_s,
        error_type=outcome.error_type,
        first=opened is None or opened.candidate.id == decision.first,
    )
    if opened is not None:
        services.meters.prompt_tokens.count(model, deployment, opened.tally.usage)
        if opened.candidate.model != model and outcome.status < 400:
            services.meters.fallback_served.count(model, opened.candidate.model, route)
        # The stages of `server-timing`, for `tailguard report`.
        services.meters.stages(
            model,
            arrived=arrived,
            ended=now,
            started=opened.started,
            connected=opened.connected,
            first_token=opened.tally.first_token_at if call.stream else None,
            last_token=opened.tally.last_token_at,
            overhead_s=outcome.overhead_s,
            queue_s=outcome.queue_s,
        )
    slo = _judge(outcome, decision, now)
    ttft_ms = None
    if tally is not None and tally.first_token_at is not None:
        ttft_ms = round((tally.first_token_at - arrived) * 1000, 3)
    key = outcome.ticket.principal.name if outcome.ticket is not None else None
    trace = outcome.trace
    if trace is not None:
        attributes: dict[str, Any] = {sc.TG_MODEL: model, sc.TG_ROUTE: route}
        if key is not None:
            attributes[sc.TG_KEY] = key
        if opened is not None:
            attributes[sc.TG_DEPLOYMENT] = deployment
            attributes[sc.TG_ATTEMPTS] = attempts
        if ttft_ms is not None:
            attributes[sc.TG_TTFT_MS] = ttft_ms
        if outcome.overhead_s is not None:
            attributes[sc.TG_OVERHEAD_MS] = round(outcome.overhead_s * 1000, 3)
        attributes.update({_SLO_ATTRIBUTES[name]: met for name, met in slo.items()})
        slow = _slow(services, deployment, ttft_ms, (now - arrived) * 1000)
        if slow is not None:
            attributes[sc.TG_SLOW] = slow
        trace.end(status=outcome.status, attributes=attributes, error_type=outcome.error_type)
    if services.access.enabled:
        services.access.write(
            {
                "time": round(time.time(), 3),
                "request_id": ctx.request_id,
                "trace_id": trace.trace_id if trace is not None else None,
                "path": ctx.path,
                "model": model,
                "requested_model": ctx.requested or None,
                "stream": call.stream,
                "deployment": deployment or None,
                "route": route or None,
                "attempts": attempts,
                "status": outcome.status,
                "error": outcome.error_type,
                "ttft_ms": ttft_ms,
                "total_ms": round((now - arrived) * 1000, 3),
                "input_tokens": tally.usage.input_tokens if tally is not None else None,
                "output_tokens": tally.output_tokens if tally is not None else None,
                # Of the input tokens, read from and written to the upstream's prompt cache.
                "cached_tokens": tally.usage.cached_tokens if tally is not None else None,
                "cache_write_tokens": tally.usage.cache_write_tokens if tally is not None else None,
                "key": key,
                "ttft_met": slo.get("ttft"),
                "total_met": slo.get("total"),
                "tpot_met": slo.get("tpot"),
                # Responses tools a translated upstream went without (`unsupported_tools`).
                "dropped_tools": list(opened.prepared.dropped)
                if opened is not None and opened.prepared.dropped
                else None,
            }
        )


def _slow(
    services: Services, deployment: str, ttft_ms: float | None, total_ms: float
) -> bool | None:
    """Whether the request's TTFT or total (ms) exceeded its deployment's p99 in the current
    snapshot (for tail sampling); None without a trusted p99 to compare with."""
    stats = services.latency.snapshot.deployments.get(deployment) if deployment else None
    if stats is None:
        return None
    judged = False
    for value, metric in ((ttft_ms, stats.ttft), (total_ms, stats.total)):
        p99 = metric.p99
        if value is None or not metric.trusted or p99 is None:
            continue
        if value > p99:  # a p99 beyond every cut (inf) is never exceeded
            return True
        judged = True
    return False if judged else None


def _judge(outcome: RequestOutcome, decision: Decision, now: float) -> dict[str, bool]:
    """Whether the request met each budget it had, counted for the model asked for and the
    deployment that served (see docs/routing.md, "SLO attainment"); the verdicts, for the span and
    the access log.

    TTFT (streams): the first content token, from arrival, within the budget. Total: a
    complete answer (200, no in-band failure) within the budget. TPOT (streams): the mean
    time per output token after the first within the target. An error misses every budget
    it had. Not judged: a request the upstream refused as invalid (a 4xx other than 408 and
    429: it says nothing about latency), and a budget that had not run out when the client
    left (what had already happened, a first token in time, still counts)."""
    budget, status, error = decision.budget, outcome.status, outcome.error_type
    ttft_s, total_s = budget.ttft_s, budget.total_s
    tpot_s = budget.tpot_s if decision.call.stream else None
    if ttft_s is None and total_s is None and tpot_s is None:
        return {}
    gone = error == "client_disconnected"
    if not gone and 400 <= status < 500 and status not in (408, 429):
        return {}
    ok = status == 200 and error is None
    arrived = outcome.ctx.arrived
    elapsed = now - arrived
    opened = outcome.opened
    tally = opened.tally if opened is not None else None
    first = tally.first_token_at if tally is not None else None
    verdicts: dict[str, bool] = {}
    if ttft_s is not None:
        if first is not None and (ok or gone):
            verdicts["ttft"] = first - arrived <= ttft_s
        elif ok:  # a complete stream without content: its end was its first token
            verdicts["ttft"] = elapsed <= ttft_s
        elif not gone or elapsed > ttft_s:
            verdicts["ttft"] = False
    if total_s is not None and (not gone or elapsed > total_s):
        verdicts["total"] = ok and elapsed <= total_s
    if tpot_s is not None and not gone:
        if not ok:
            verdicts["tpot"] = False
        elif tally is not None and (tpot := tally.tpot_s) is not None:
            verdicts["tpot"] = tpot <= tpot_s
    if verdicts:
        deployment = opened.candidate.id if opened is not None else None
        met = {f"{name}_met": verdicts.get(name) for name in ("ttft", "total", "tpot")}
        model = outcome.ctx.model
        outcome.services.latency.judged(model, deployment, **met)
        outcome.services.meters.judged(model, deployment or "", verdicts)
    return verdicts

"""The HTTP edge: the app factory, its lifespan, the routes, error responses and the SSE relay.

Only this module imports FastAPI/Starlette. Everything with a lifetime (provider clients, stores,
background tasks) belongs to the `Runtime` the lifespan opens; a request reads its `Services`
once, when admitted, so a config reload never changes what a request in flight uses.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import orjson
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway import semconv as sc
from gateway.auth import Principal
from gateway.batching import BATCHED_ENDPOINTS
from gateway.config import LOG_LEVEL_ENV, Settings, config_path, load_settings
from gateway.errors import (
    BodyTooLargeError,
    BudgetExceededError,
    GatewayError,
    InvalidRequestError,
    OverloadedError,
    PermissionDeniedError,
    ProviderError,
    ProviderTimeoutError,
    RequestTimeoutError,
    StreamInterruptedError,
    UnknownModelError,
    quote,
    render,
    stream_error,
)
from gateway.latency import (
    CANCELLED,
    TOTAL_DEADLINE,
    Recorder,
    Sample,
    TargetStats,
)
from gateway.models import ENDPOINT_WIRE, Call, Endpoint, Wire
from gateway.openapi import build_openapi
from gateway.prompt_size import uncached_bytes
from gateway.providers.vllm import snapshot as vllm_snapshot
from gateway.ratelimit import Verdict
from gateway.routing import (
    Budget,
    Candidate,
    Opened,
    Plan,
    Policy,
    baseline_p50_ms,
    by_prediction,
    candidates,
    open_first,
    plan,
    prompt_band,
    with_exploration,
)
from gateway.routing.idle import IdleWatch
from gateway.runtime import Runtime, Services
from gateway.telemetry import CONTENT_TYPE as METRICS_CONTENT_TYPE
from gateway.telemetry import (
    RequestTrace,
    configure_logging,
    exposition,
)
from gateway.validate import OUTPUT_LENGTH_FIELDS, parse_call

log = logging.getLogger("tailguard")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_TRACEPARENT = re.compile(r"^00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}$")
_JSON = b"application/json"
_SLO_ATTRIBUTES = {
    "ttft": sc.TG_SLO_TTFT_MET,
    "total": sc.TG_SLO_TOTAL_MET,
    "tpot": sc.TG_SLO_TPOT_MET,
}
_SSE = b"text/event-stream; charset=utf-8"


# --- the edge middleware: request id and arrival time on every request ---------------------------


LLM_ROUTES: dict[str, Endpoint] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
    "/v1/messages": "messages",
}
_PATHS = {endpoint: path for path, endpoint in LLM_ROUTES.items()}
# With keys configured: /v1/* needs a client key, the rest of these an admin key.
_GUARDED_PREFIXES = ("/v1/", "/admin/", "/dashboard")


class EdgeMiddleware:
    """Stamps arrival time and a request id on every request, and `x-request-id` on every response.

    The LLM endpoints are served from here directly: they need none of the framework's routing,
    dependency injection or response models, and this is the hot path.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope["tailguard.t0"] = time.perf_counter()
        request_id = None
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                candidate = value.decode("latin-1")
                if _REQUEST_ID.match(candidate):
                    request_id = candidate
                break
        if request_id is None:
            request_id = "req_" + os.urandom(12).hex()
        scope["tailguard.request_id"] = request_id
        path = scope["path"]
        endpoint = LLM_ROUTES.get(path)
        if endpoint is not None and scope["method"] == "POST":
            # These responses carry the request id themselves: no wrapper on every streamed event.
            await serve_llm(scope, receive, send, endpoint)
            return
        if path.startswith(_GUARDED_PREFIXES) and "state" in scope:
            keyring = _services(scope).keyring
            if keyring.enabled:
                try:
                    if path.startswith("/v1/"):
                        scope["tailguard.principal"] = keyring.client(
                            scope["headers"], anthropic=False
                        )
                    else:
                        scope["tailguard.principal"] = keyring.admin(scope["headers"])
                except GatewayError as error:
                    await _send_error(send, error, "openai", request_id)
                    return
        header = (b"x-request-id", request_id.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                if not any(name == b"x-request-id" for name, _ in headers):
                    headers.append(header)
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, send_with_id)


# --- errors --------------------------------------------------------------------------------------


def _wire_of(path: str) -> Wire:
    return "anthropic" if path.startswith("/v1/messages") else "openai"


def error_response(error: GatewayError, wire: Wire) -> Response:
    return Response(
        render(error, wire),
        status_code=error.status,
        headers=error.headers,
        media_type="application/json",
    )


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    error = GatewayError(
        str(exc.detail),
        code={404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error"),
        headers=exc.headers,  # a 405's `allow`
    )
    error.status = exc.status_code
    error.type = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return error_response(error, _wire_of(request.url.path))


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path)
    error = GatewayError("The gateway failed to process the request.")
    return error_response(error, _wire_of(request.url.path))


# --- the proxy -----------------------------------------------------------------------------------


class ClientGoneError(Exception):
    """The client disconnected while its request was being read."""


async def read_body(scope: Scope, receive: Receive, limit: int, timeout_s: float) -> bytes:
    """The whole body, refusing it as soon as it is known to exceed `limit` bytes, or when it
    has not all arrived within `timeout_s` (a client trickling its body holds a slot)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            if value.isdigit() and (len(value) > 15 or int(value) > limit):
                raise BodyTooLargeError(f"The request body exceeds the limit of {limit} bytes.")
            break
    try:
        async with asyncio.timeout(timeout_s):
            return await _read_parts(receive, limit)
    except TimeoutError:
        raise RequestTimeoutError(
            f"The request body did not arrive within {timeout_s:g} s."
        ) from None


async def _read_parts(receive: Receive, limit: int) -> bytes:
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGoneError
        part = message.get("body", b"")
        if part:
            size += len(part)
            if size > limit:
                raise BodyTooLargeError(f"The request body exceeds the limit of {limit} bytes.")
            parts.append(part)
        if not message.get("more_body", False):
            break
    return parts[0] if len(parts) == 1 else b"".join(parts)


TTFT_BUDGET_HEADER = "x-tailguard-ttft-budget-ms"
TOTAL_BUDGET_HEADER = "x-tailguard-total-budget-ms"
# The Gateway API Inference Extension's (llm-d's) names: a TTFT budget, and a per-token target.
SLO_TTFT_HEADER = "x-slo-ttft-ms"
SLO_TPOT_HEADER = "x-slo-tpot-ms"
PRIORITY_HEADER = "x-tailguard-priority"
_MAX_BUDGET_MS = 3_600_000


@dataclass(slots=True)
class RequestHeaders:
    """What the gateway reads from a request's headers, in one pass."""

    forward: dict[str, str]  # sent upstream as-is
    ttft_budget_ms: int | None = None
    ttft_header: str = TTFT_BUDGET_HEADER  # the header the TTFT budget came from, for errors
    total_budget_ms: int | None = None
    tpot_budget_ms: int | None = None  # x-slo-tpot-ms: the mean time per token after the first
    client_retry: bool = False  # the client SDK says this is its own retry: do not hedge it
    priority: str | None = None  # x-tailguard-priority: interactive | bulk


def read_headers(scope: Scope, request_id: str) -> RequestHeaders:
    """Raises InvalidRequestError naming a budget header whose value is not a positive integer.
    `x-slo-ttft-ms` is read as the TTFT budget unless `x-tailguard-ttft-budget-ms` is sent too."""
    found = RequestHeaders({"x-request-id": request_id})
    slo_ttft_ms = None
    for name, value in scope["headers"]:
        if name == b"traceparent":
            traceparent = value.decode("latin-1")
            if _TRACEPARENT.match(traceparent):
                found.forward["traceparent"] = traceparent
        elif name == b"anthropic-beta":
            # Feature flags of Anthropic's API: only ever sent to Anthropic upstreams.
            found.forward["anthropic-beta"] = value.decode("latin-1")
        elif name == b"x-tailguard-ttft-budget-ms":
            found.ttft_budget_ms = _budget(TTFT_BUDGET_HEADER, value)
        elif name == b"x-tailguard-total-budget-ms":
            found.total_budget_ms = _budget(TOTAL_BUDGET_HEADER, value)
        elif name == b"x-slo-ttft-ms":
            slo_ttft_ms = _budget(SLO_TTFT_HEADER, value)
        elif name == b"x-slo-tpot-ms":
            found.tpot_budget_ms = _budget(SLO_TPOT_HEADER, value)
        elif name == b"x-stainless-retry-count":
            found.client_retry = value.strip() not in (b"", b"0")
        elif name == b"x-tailguard-priority":
            priority = value.decode("latin-1").strip().lower()
            if priority not in ("interactive", "bulk"):
                raise InvalidRequestError(
                    f"Invalid '{PRIORITY_HEADER}': expected 'interactive' or 'bulk', got "
                    f"{priority[:40]!r}.",
                    param=PRIORITY_HEADER,
                    code="invalid_header",
                )
            found.priority = priority
    if found.ttft_budget_ms is None and slo_ttft_ms is not None:
        found.ttft_budget_ms, found.ttft_header = slo_ttft_ms, SLO_TTFT_HEADER
    return found


def _budget(header: str, value: bytes) -> int:
    text = value.decode("latin-1").strip()
    if not (text.isascii() and text.isdigit() and len(text) <= 7) or not (
        0 < int(text) <= _MAX_BUDGET_MS
    ):
        raise InvalidRequestError(
            f"Invalid '{header}': expected a whole number of milliseconds between 1 and "
            f"{_MAX_BUDGET_MS}, got {text[:40]!r}.",
            param=header,
            code="invalid_header",
        )
    return int(text)


async def serve_llm(scope: Scope, receive: Receive, send: Send, endpoint: Endpoint) -> None:
    """One LLM request, from body to last byte; every failure is answered in the client's wire."""
    wire = ENDPOINT_WIRE[endpoint]
    runtime: Runtime = scope["state"]["runtime"]
    admission = runtime.admission
    principal: Principal | None = None
    admitted = False
    try:
        try:
            keyring = runtime.services.keyring
            if keyring.enabled:
                principal = keyring.client(scope["headers"], anthropic=endpoint == "messages")
                scope["tailguard.key"] = principal.name
            admission.enter(principal)
            admitted = True
            proxy = await _admit(scope, receive, endpoint, principal)
        except GatewayError as error:
            await _send_error(send, error, wire, scope["tailguard.request_id"])
            _refused(scope, endpoint, error.status, error.code or error.type)
            return
        except ClientGoneError:
            _refused(scope, endpoint, 499, "client_disconnected")
            return
        except Exception:
            log.exception("unhandled error while admitting a request to %s", scope["path"])
            failure = GatewayError("The gateway failed to process the request.")
            await _send_error(send, failure, wire, scope["tailguard.request_id"])
            _refused(scope, endpoint, 500, "internal")
            return
        await proxy(scope, receive, send)
    finally:
        if admitted:
            admission.leave(principal)


def _refused(scope: Scope, endpoint: Endpoint, status: int, error_type: str) -> None:
    """Metrics and the access log line of a request answered before any upstream was tried."""
    services = _services(scope)
    model = scope.get("tailguard.model", "")  # set once the name is known to be configured
    duration = time.perf_counter() - scope["tailguard.t0"]
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
        for name, value in scope["headers"]:
            if name == b"traceparent" and _TRACEPARENT.match(value.decode("latin-1")):
                traceparent = value.decode("latin-1")
        attributes: dict[str, Any] = {
            sc.HTTP_REQUEST_METHOD: "POST",
            sc.HTTP_ROUTE: scope["path"],
            sc.GEN_AI_OPERATION_NAME: sc.OPERATIONS[endpoint],
            sc.TG_REQUEST_ID: scope["tailguard.request_id"],
        }
        if model:
            attributes[sc.GEN_AI_REQUEST_MODEL] = model
        trace = services.tracing.request(
            f"POST {scope['path']}",
            traceparent=traceparent,
            arrived=scope["tailguard.t0"],
            attributes=attributes,
        )
        if trace is not None:
            trace_id = trace.trace_id
            trace.end(status=status, attributes={}, error_type=error_type)
    if services.access.enabled:
        services.access.write(
            {
                "time": round(time.time(), 3),
                "request_id": scope["tailguard.request_id"],
                "trace_id": trace_id,
                "path": scope["path"],
                "model": model,
                "key": scope.get("tailguard.key"),
                "status": status,
                "error": error_type,
                "total_ms": round(duration * 1000, 3),
            }
        )


def _services(scope: Scope) -> Services:
    runtime: Runtime = scope["state"]["runtime"]
    return runtime.services


async def _admit(
    scope: Scope, receive: Receive, endpoint: Endpoint, principal: Principal | None
) -> Proxy:
    server = _services(scope).settings.server
    raw = await read_body(scope, receive, server.max_body_bytes, server.read_timeout_s)
    call = parse_call(endpoint, raw)
    if principal is None:
        return _plan(scope, call, None)
    _check_key(principal, call, _services(scope).models)
    runtime: Runtime = scope["state"]["runtime"]
    verdict = None
    prompt = charged = 0
    if principal.rate_limited:
        prompt, charged = runtime.limiter.estimate(principal, call, runtime.services.latency)
        verdict = await runtime.limiter.take(principal, charged, call.wire)
    try:
        proxy = _plan(scope, call, principal)
    except BaseException:
        runtime.limiter.settle(principal, -charged)  # refused after all: no tokens used
        raise
    proxy.key = Admitted(principal, verdict, prompt, charged, runtime)
    return proxy


def _plan(scope: Scope, call: Call, principal: Principal | None) -> Proxy:
    """Route an admitted call: no await from here to the proxy's start, so the request keeps the
    services it reads now to its end."""
    services = _services(scope)
    spec = services.models.get(call.model)
    if spec is None:
        raise UnknownModelError(
            f"The model {quote(call.model)} does not exist. Available models: "
            f"{', '.join(_visible_models(services, principal))}.",
            param="model",
        )
    scope["tailguard.model"] = spec.name
    call.request_id = scope["tailguard.request_id"]
    headers = read_headers(scope, call.request_id)
    call.forward_headers = headers.forward
    # A budget header overrides the model's configured budget.
    ttft_ms = headers.ttft_budget_ms or spec.budget.ttft_ms
    total_ms = headers.total_budget_ms or spec.budget.total_ms
    asked_ttft, asked_total = headers.ttft_budget_ms, headers.total_budget_ms
    if asked_ttft and asked_total and asked_ttft > asked_total:
        raise InvalidRequestError(
            f"The TTFT budget ({asked_ttft} ms) exceeds the total budget ({asked_total} ms).",
            param=headers.ttft_header,
            code="invalid_header",
        )
    if ttft_ms is not None and total_ms is not None:
        ttft_ms = min(ttft_ms, total_ms)  # a tighter total budget also tightens the first token
    # A non-streaming answer's first token is its whole body: only the total budget applies.
    if not call.stream:
        ttft_ms = None
    # A per-token target means something for a stream only.
    tpot_s = headers.tpot_budget_ms / 1000 if headers.tpot_budget_ms and call.stream else None
    budget = Budget(
        ttft_s=ttft_ms / 1000 if ttft_ms else None,
        total_s=total_ms / 1000 if total_ms else None,
        tpot_s=tpot_s,
        on_ttft_miss=spec.on_ttft_miss,
        rescue_share=spec.hedge_max_fraction,  # hedges and deadline failovers share one cap
    )
    snapshot = services.latency.snapshot
    services.latency.arrived(spec.name)  # caps on extra load are a share of client requests
    explored = services.guards.explorer.latest()
    found = candidates(
        services.chains[spec.name], services.providers, call, services.rng, snapshot, explored
    )
    call.priority = headers.priority or spec.priority
    if call.priority == "bulk" and not call.stream and call.endpoint in BATCHED_ENDPOINTS:
        # Bulk embeddings and completions go through their deployment's micro-batch queue.
        batchers = services.batchers
        found = [replace(c, provider=batchers[c.id]) if c.id in batchers else c for c in found]
    if services.servers:
        found = by_prediction(found, _predictions(services, found, call))
    chosen = plan(found, call, budget, cooling=services.guards.cooldowns.cooling())
    if budget.ttft_s is not None and spec.on_ttft_miss != "none" and not headers.client_retry:
        # A deployment routed away is now and then tried again, raced by the one that serves.
        chosen = with_exploration(chosen, found, services.guards.explorer.due)
    policy = Policy(
        model=spec.name,
        arrived=scope["tailguard.t0"],
        ttft_s=budget.ttft_s,
        on_ttft_miss=spec.on_ttft_miss,
        hedge_fraction=spec.hedge_max_fraction,
        may_hedge=not headers.client_retry,
    )
    proxy = Proxy(services, call, chosen, policy, budget.total_s)
    proxy.tpot_budget_s = tpot_s
    return proxy


def _check_key(principal: Principal, call: Call, models: Mapping[str, Any]) -> None:
    """What a key may ask for: its models, and its caps on `n` and `max_tokens`."""
    allowed = principal.models
    if allowed is not None and call.model not in allowed:
        if call.model not in models:
            return  # unknown to everyone: the 404 says so, without listing others' models
        raise PermissionDeniedError(
            f"The key '{principal.name}' may not use the model '{call.model}'.",
            param="model",
            code="model_not_allowed",
        )
    if principal.max_n is not None:
        # `best_of` (completions) generates that many on the server, returned or not.
        for param in ("n", "best_of"):
            value = call.n if param == "n" else call.body.get(param)
            if isinstance(value, int) and value > principal.max_n:
                raise InvalidRequestError(
                    f"Invalid '{param}': {value} is over this key's limit of {principal.max_n}.",
                    param=param,
                    code="key_limit_exceeded",
                )
    cap = principal.max_tokens
    fields = OUTPUT_LENGTH_FIELDS[call.endpoint]
    if cap is None or not fields:
        return
    # Every field that sets the output length is held to the cap, whichever the upstream reads.
    for param in fields:
        value = call.body.get(param)
        if value is None:
            continue
        if value > cap or value < 1:  # 0: vLLM reads `max_completion_tokens or ...`: no limit
            raise InvalidRequestError(
                f"Invalid '{param}': {value} is outside this key's limit of 1 to {cap}.",
                param=param,
                code="key_limit_exceeded",
            )
    if call.max_tokens is None:
        # Without a cap of its own the request could run to the model's limit: it gets the key's.
        call.body[fields[0]] = cap
        call.raw = orjson.dumps(call.body)
        call.max_tokens = cap


def _visible_models(services: Services, principal: Principal | None) -> list[str]:
    allowed = principal.models if principal is not None else None
    return [name for name in services.models if allowed is None or name in allowed]


@dataclass(slots=True)
class Admitted:
    """The key a request was admitted under: its rate-limit state and token charge."""

    principal: Principal
    verdict: Verdict | None
    prompt_estimate: int  # prompt tokens, as estimated at admission
    charged: int  # all the tokens charged at admission: the prompt and every output token asked
    runtime: Runtime


def _predictions(
    services: Services, found: list[Candidate], call: Call
) -> dict[str, tuple[float, float]]:
    """Predicted TTFT (and the queue it assumes) of each vLLM candidate whose load is known."""
    out: dict[str, tuple[float, float]] = {}
    band = prompt_band(len(call.raw))
    for candidate in found:
        server = services.servers.get(candidate.deployment.provider)
        load = server.current() if server is not None else None
        if load is None:
            continue
        # Requests this replica sent since the scrape are not in it yet: while the server was
        # queueing, count them as queued too.
        queue = load.waiting
        if queue > 0:
            queue += max(0.0, services.latency.inflight(candidate.id) - load.running - queue)
        stats = candidate.stats
        # The unloaded baseline: the deployment's typical TTFT for a prompt of this size.
        ttft_p50 = _finite_s(baseline_p50_ms(stats, len(call.raw))) if stats else None
        if ttft_p50 is None and server is not None:
            ttft_p50 = server.recent_ttft_p50()
        total_p50 = _finite_s(stats.total.p50) if stats else None
        predicted = services.predictor.predict(
            candidate.id,
            band,
            waiting=queue,
            running=load.running,
            ttft_p50_s=ttft_p50,
            total_p50_s=total_p50,
        )
        if predicted is not None:
            out[candidate.id] = (predicted, queue)
    return out


def _finite_s(ms: float | None) -> float | None:
    """Milliseconds as seconds; None when unknown (no samples, or beyond every cut)."""
    return ms / 1000 if ms is not None and ms != float("inf") else None


class Proxy:
    """Runs the attempt loop and relays the answer, as an ASGI callable.

    A watcher cancels the work as soon as the client disconnects, streaming or not, so the
    upstream connection is closed at once (by the `finally` that owns it).
    """

    tpot_budget_s: float | None = None  # x-slo-tpot-ms (streams): judged when the request ends

    def __init__(
        self,
        services: Services,
        call: Call,
        plan: Plan,
        policy: Policy,
        total_budget_s: float | None,
    ) -> None:
        self._services = services
        self._call = call
        self._plan = plan
        self._policy = policy
        self._t0 = policy.arrived
        self._total_budget_s = total_budget_s
        self._client_gone = False
        self._started = False  # the status line went out: errors must now be in-band
        self._responded = False  # the last byte went out: a disconnect now is just the end
        # How it ended, for metrics, the trace and the access log.
        self._status = 499  # until something is sent: a client that leaves first
        self._error_type: str | None = "client_disconnected"
        self._opened: Opened | None = None
        self._recorded = False  # the committed stream's sample was handed to the store
        self._overhead_s: float | None = None
        self._trace: RequestTrace | None = None
        # Bulk chat waits for a slot on its first candidate (see gateway/batching/gate.py).
        self._gate_lane: str | None = None
        if call.priority == "bulk" and (call.stream or call.endpoint in ("chat", "messages")):
            self._gate_lane = plan.candidates[0].id
        self._gated = False
        self._queue_s: float | None = None
        self.key: Admitted | None = None  # with API keys on: who is asking, and their limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.create_task(self._watch(receive, task))
        services = self._services
        services.enter()
        retries = services.guards.retries
        retries.active += 1
        if services.tracing.enabled:
            self._trace = self._start_trace(scope)
        try:
            await self._serve(send)
        except asyncio.CancelledError:
            # The client left: nothing is wrong with the server, unless something else (a
            # shutdown) asked for cancellation too.
            if not (self._client_gone and task.uncancel() == 0):
                # The server is shutting down and its grace period is over: a stream that
                # began says it was cut, rather than just stopping.
                self._error_type = "shutdown"
                await self._fail(send, "The gateway is shutting down.")
                raise
            self._error_type = "client_disconnected"
            opened = self._opened
            if opened is not None and self._call.stream and not self._recorded:
                # The client left mid-stream: what the stream showed so far still counts.
                self._record_stream(opened, ok=False, error=CANCELLED, cut=True)
        except Exception:
            log.exception("request %s failed inside the gateway", self._call.request_id)
            self._status, self._error_type = 500, "internal"
            await self._fail(send)
        finally:
            if self._gated and self._gate_lane is not None and services.gate is not None:
                services.gate.release(self._gate_lane)
            retries.active -= 1
            watcher.cancel()
            self._finish()
            services.leave()

    def _start_trace(self, scope: Scope) -> RequestTrace | None:
        call, policy = self._call, self._policy
        attributes: dict[str, Any] = {
            sc.HTTP_REQUEST_METHOD: "POST",
            sc.HTTP_ROUTE: scope["path"],
            sc.GEN_AI_OPERATION_NAME: sc.OPERATIONS[call.endpoint],
            sc.GEN_AI_REQUEST_MODEL: call.model,
            sc.TG_REQUEST_ID: call.request_id,
        }
        if call.max_tokens is not None:
            attributes[sc.GEN_AI_REQUEST_MAX_TOKENS] = call.max_tokens
        if policy.ttft_s is not None:
            attributes[sc.TG_BUDGET_TTFT_MS] = round(policy.ttft_s * 1000)
        if self._total_budget_s is not None:
            attributes[sc.TG_BUDGET_TOTAL_MS] = round(self._total_budget_s * 1000)
        return self._services.tracing.request(
            f"POST {scope['path']}",
            traceparent=call.forward_headers.get("traceparent"),
            arrived=self._t0,
            attributes=attributes,
        )

    def _finish(self) -> None:
        """Count the request, end its spans and write its access log line."""
        services, call, opened = self._services, self._call, self._opened
        now = time.perf_counter()
        deployment = route = ""
        attempts = 0
        tally = None
        if opened is not None:
            deployment, route, tally = opened.candidate.id, opened.route, opened.tally
            attempts = len(opened.attempts)
        services.meters.request(
            model=self._policy.model,
            endpoint=call.endpoint,
            deployment=deployment,
            route=route,
            status=self._status,
            duration_s=now - self._t0,
            overhead_s=self._overhead_s,
            error_type=self._error_type,
        )
        if opened is not None:  # the stages of `server-timing`, for `tailguard report`
            services.meters.stages(
                self._policy.model,
                arrived=self._t0,
                ended=now,
                started=opened.started,
                connected=opened.connected,
                first_token=opened.tally.first_token_at if call.stream else None,
                last_token=opened.tally.last_token_at,
                overhead_s=self._overhead_s,
                queue_s=self._queue_s,
            )
        slo = self._judge(now)
        ttft_ms = None
        if tally is not None and tally.first_token_at is not None:
            ttft_ms = round((tally.first_token_at - self._t0) * 1000, 3)
        trace = self._trace
        if trace is not None:
            if opened is not None and opened.attempt is not None and opened.attempt.span:
                trace.end_attempt(
                    opened.attempt.span,
                    outcome="won" if self._error_type is None else f"won:{self._error_type}",
                    error_type=self._error_type,
                    ttft_s=(tally.first_token_at - opened.started)
                    if tally is not None and tally.first_token_at is not None
                    else None,
                    input_tokens=tally.usage.input_tokens if tally is not None else None,
                    output_tokens=tally.output_tokens if tally is not None else None,
                    finish_reasons=tally.finish_reasons if tally is not None else (),
                    response_model=opened.candidate.deployment.model,
                )
            attributes: dict[str, Any] = {sc.TG_MODEL: self._policy.model, sc.TG_ROUTE: route}
            if self.key is not None:
                attributes[sc.TG_KEY] = self.key.principal.name
            if opened is not None:
                attributes[sc.TG_DEPLOYMENT] = deployment
                attributes[sc.TG_ATTEMPTS] = attempts
            if ttft_ms is not None:
                attributes[sc.TG_TTFT_MS] = ttft_ms
            if self._overhead_s is not None:
                attributes[sc.TG_OVERHEAD_MS] = round(self._overhead_s * 1000, 3)
            attributes.update({_SLO_ATTRIBUTES[name]: met for name, met in slo.items()})
            trace.end(status=self._status, attributes=attributes, error_type=self._error_type)
        if services.access.enabled:
            services.access.write(
                {
                    "time": round(time.time(), 3),
                    "request_id": call.request_id,
                    "trace_id": trace.trace_id if trace is not None else None,
                    "path": _PATHS[call.endpoint],
                    "model": self._policy.model,
                    "stream": call.stream,
                    "deployment": deployment or None,
                    "route": route or None,
                    "attempts": attempts,
                    "status": self._status,
                    "error": self._error_type,
                    "ttft_ms": ttft_ms,
                    "total_ms": round((now - self._t0) * 1000, 3),
                    "input_tokens": tally.usage.input_tokens if tally is not None else None,
                    "output_tokens": tally.output_tokens if tally is not None else None,
                    "key": self.key.principal.name if self.key is not None else None,
                    "ttft_met": slo.get("ttft"),
                    "total_met": slo.get("total"),
                    "tpot_met": slo.get("tpot"),
                }
            )
        key = self.key
        if key is not None and key.principal.tpm is not None:
            # Charge what the upstream reported instead of the estimate; nothing when no upstream
            # answered (an error, or a client that left first).
            used = 0
            if tally is not None:
                prompt = tally.usage.input_tokens
                used = (key.prompt_estimate if prompt is None else prompt) + tally.output_tokens
            key.runtime.limiter.settle(key.principal, used - key.charged)

    def _judge(self, now: float) -> dict[str, bool]:
        """Whether the request met each budget it had, counted for the model asked for and the
        deployment that served (see README, "SLO attainment"); the verdicts, for the span and
        the access log.

        TTFT (streams): the first content token, from arrival, within the budget. Total: a
        complete answer (200, no in-band failure) within the budget. TPOT (streams): the mean
        time per output token after the first within the target. An error misses every budget
        it had. Not judged: a request the upstream refused as invalid (a 4xx other than 408 and
        429: it says nothing about latency), and a budget that had not run out when the client
        left (what had already happened, a first token in time, still counts)."""
        call, status, error = self._call, self._status, self._error_type
        ttft_s, total_s = self._policy.ttft_s, self._total_budget_s
        tpot_s = self.tpot_budget_s if call.stream else None
        if ttft_s is None and total_s is None and tpot_s is None:
            return {}
        gone = error == "client_disconnected"
        if not gone and 400 <= status < 500 and status not in (408, 429):
            return {}
        ok = status == 200 and error is None
        elapsed = now - self._t0
        tally = self._opened.tally if self._opened is not None else None
        first = tally.first_token_at if tally is not None else None
        verdicts: dict[str, bool] = {}
        if ttft_s is not None:
            if first is not None and (ok or gone):
                verdicts["ttft"] = first - self._t0 <= ttft_s
            elif ok:  # a complete stream without content: its end was its first token
                verdicts["ttft"] = elapsed <= ttft_s
            elif not gone or elapsed > ttft_s:
                verdicts["ttft"] = False
        if total_s is not None and (not gone or elapsed > total_s):
            verdicts["total"] = ok and elapsed <= total_s
        if tpot_s is not None and not gone:
            if not ok:
                verdicts["tpot"] = False
            elif tally is not None and first and tally.last_token_at and tally.output_tokens > 1:
                tpot = (tally.last_token_at - first) / (tally.output_tokens - 1)
                verdicts["tpot"] = tpot <= tpot_s
        if verdicts:
            deployment = self._opened.candidate.id if self._opened is not None else None
            met = {f"{name}_met": verdicts.get(name) for name in ("ttft", "total", "tpot")}
            self._services.latency.judged(self._policy.model, deployment, **met)
            self._services.meters.judged(self._policy.model, deployment or "", verdicts)
        return verdicts

    async def _fail(self, send: Send, why: str | None = None) -> None:
        """Answer a failure of the gateway itself in the client's wire: a 500 (503 when shutting
        down) before the status was sent, an error event after it (never a silently cut
        stream). Best effort: the connection may be gone already."""
        if self._responded:
            return
        self._responded = True
        try:
            if self._started:
                cut = StreamInterruptedError(
                    why or "The gateway failed while relaying the response."
                )
                body = stream_error(cut, self._call.wire)
                await send({"type": "http.response.body", "body": body, "more_body": False})
            elif why is not None:
                self._status = 503
                error: GatewayError = OverloadedError(why)
                await _send_error(send, error, self._call.wire, self._call.request_id)
            else:
                error = GatewayError("The gateway failed to process the request.")
                await _send_error(send, error, self._call.wire, self._call.request_id)
        except Exception:  # the client or the transport went away first
            log.debug("request %s: could not send the final error", self._call.request_id)

    async def _watch(self, receive: Receive, task: asyncio.Task[Any]) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not self._responded:
                    self._client_gone = True
                    task.cancel()
                return

    async def _serve(self, send: Send) -> None:
        call = self._call
        services = self._services
        # Before commit, the total budget bounds the whole attempt loop.
        remaining = None
        if self._total_budget_s is not None:
            remaining = max(0.0, self._total_budget_s - (time.perf_counter() - self._t0))
        try:
            try:
                async with asyncio.timeout(remaining):
                    if self._gate_lane is not None:
                        queued = time.perf_counter()
                        assert services.gate is not None
                        await services.gate.acquire(self._gate_lane)
                        self._gated = True
                        self._queue_s = time.perf_counter() - queued
                    opened = await open_first(
                        call,
                        self._plan,
                        self._policy,
                        headers=call.forward_headers,
                        recorder=services.recorder,
                        guards=services.guards,
                        snapshot=services.latency.snapshot,
                        inflight=services.latency,
                        trace=self._trace,
                    )
            except TimeoutError:
                budget_ms = round((self._total_budget_s or 0) * 1000)
                raise BudgetExceededError(
                    f"No answer within the total budget of {budget_ms} ms."
                ) from None
        except GatewayError as error:
            if isinstance(error, ProviderError) or error.status >= 500:
                log.warning("request %s failed: %s", call.request_id, error.message)
            self._status, self._error_type = error.status, error.code or error.type
            await _send_error(send, error, call.wire, call.request_id)
            self._responded = True
            return
        try:  # from here this request owns the committed attempt: closed on every path
            self._opened = opened
            self._status, self._error_type = 200, None
            self._observe(opened)
            if call.stream:
                await self._relay(opened, send)
            else:
                await self._respond(opened, send)
        finally:
            await opened.close()

    def _observe(self, opened: Opened) -> None:
        """What the committed first token teaches bulk admission and the queue predictor."""
        call, services = self._call, self._services
        first = opened.tally.first_token_at
        if first is None or not call.stream:
            return
        if call.priority == "interactive" and self._policy.ttft_s and services.gate is not None:
            # Bulk admission on this deployment follows how interactive first tokens fare.
            services.gate.observe(opened.candidate.id, first - self._t0, self._policy.ttft_s)
        if opened.candidate.queue is not None:
            services.predictor.observe(
                opened.candidate.id,
                prompt_band(len(call.raw)),
                opened.candidate.queue,
                first - opened.started,
            )

    def _response_headers(self, opened: Opened, content_type: bytes) -> list[tuple[bytes, bytes]]:
        now = time.perf_counter()
        first = opened.attempts[0].started
        committed = opened.tally.first_token_at or now
        route_ms = (first - self._t0) * 1000
        overhead_ms = route_ms + (now - committed) * 1000
        self._overhead_s = overhead_ms / 1000
        timing = [f"route;dur={route_ms:.2f}"]
        if self._queue_s is not None:
            timing.insert(0, f"queue;dur={self._queue_s * 1000:.1f}")
        for index, attempt in enumerate(opened.attempts):
            ended = attempt.ended or committed
            timing.append(
                f"attempt{index + 1};dur={(ended - attempt.started) * 1000:.1f};"
                f'desc="{attempt.deployment} {attempt.outcome}"'
            )
        if opened.connected:
            timing.append(f"connect;dur={(opened.connected - opened.started) * 1000:.1f}")
        stage = "ttft" if self._call.stream else "upstream"
        timing.append(f"{stage};dur={(committed - self._t0) * 1000:.1f}")
        headers = [
            (b"content-type", content_type),
            (b"x-request-id", self._call.request_id.encode()),
            (b"x-tailguard-model", opened.candidate.model.encode()),
            (b"x-tailguard-deployment", opened.candidate.id.encode()),
            (b"x-tailguard-route", opened.route.encode()),
            (b"x-tailguard-attempts", str(len(opened.attempts)).encode()),
            (b"x-tailguard-overhead-ms", f"{overhead_ms:.3f}".encode()),
            (b"server-timing", ", ".join(timing).encode()),
        ]
        upstream_id = opened.stream.upstream_request_id
        if upstream_id and _REQUEST_ID.match(upstream_id):  # never echo arbitrary bytes
            headers.append((b"x-upstream-request-id", upstream_id.encode()))
        if len(opened.attempts) > 1:
            headers.append((b"x-should-retry", b"false"))
        if self.key is not None and self.key.verdict is not None:
            headers += self.key.verdict.headers(self._call.wire)
        return headers

    async def _respond(self, opened: Opened, send: Send) -> None:
        body = b"".join(opened.head)
        headers = self._response_headers(opened, _JSON)
        headers.append((b"content-length", str(len(body)).encode()))
        self._started = True
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        self._responded = True
        ended = time.perf_counter()
        tally = opened.tally
        self._services.recorder.record(
            Sample(
                opened.candidate.id,
                opened.candidate.model,
                ok=True,
                total_s=ended - opened.started,
                input_tokens=tally.usage.input_tokens,
                output_tokens=tally.output_tokens,
                hedge_for=opened.hedge_for,
                endpoint=self._call.endpoint,
                prompt_bytes=uncached_bytes(
                    len(self._call.raw), tally.usage.input_tokens, tally.usage.cached_tokens
                ),
            )
        )

    async def _relay(self, opened: Opened, send: Send) -> None:
        call = self._call
        headers = self._response_headers(opened, _SSE)
        headers += [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
        self._started = True
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        tally = opened.tally
        translate = opened.prepared.stream.feed
        stream = opened.stream
        deadline = None
        if self._total_budget_s is not None:
            deadline = asyncio.get_running_loop().time() + max(
                0.0, self._total_budget_s - (time.perf_counter() - self._t0)
            )
        failure: GatewayError | None = None
        finished = opened.ended
        body = b"".join(opened.head)
        pending = opened.pending
        idle_s = opened.candidate.provider.limits.idle_s
        idle = IdleWatch(idle_s)  # no content for idle_s (keep-alives or not): the stream ends
        try:
            while True:
                out = [body] if body else []
                now = time.perf_counter()  # one clock read per network read, not per event
                tokens = tally.tokens
                for chunk in pending:
                    if chunk.error is not None:
                        failure = StreamInterruptedError(
                            f"{opened.candidate.id}: upstream error after the stream began: "
                            f"{chunk.error.message[:300]}"
                        )
                        break
                    tally.add(chunk, now)
                    out.append(translate(chunk))
                    if chunk.done:
                        finished = True
                        break
                if tally.tokens != tokens:
                    idle.progressed()
                data = b"".join(out)
                if data:
                    await send({"type": "http.response.body", "body": data, "more_body": True})
                if failure is not None or finished:
                    break
                body = b""
                try:
                    idle.reading()
                    if deadline is None:  # no budget: skip the timer on this per-event path
                        batch = await stream.read()
                    else:
                        async with asyncio.timeout_at(deadline):
                            batch = await stream.read()
                    idle.read()
                except asyncio.CancelledError:
                    if not idle.expired():
                        raise
                    failure = ProviderTimeoutError(  # its message names the deployment
                        f"no content from the upstream for {round(idle_s * 1000)} ms "
                        "(the stream idle timeout)",
                        deployment=opened.candidate.id,
                        kind="stream_idle",
                    )
                    break
                except TimeoutError:
                    failure = ProviderTimeoutError(
                        "the total budget of "
                        f"{round((self._total_budget_s or 0) * 1000)} ms ran out mid-stream",
                        deployment=opened.candidate.id,
                        kind="total_deadline",
                    )
                    break
                if batch is None:
                    failure = StreamInterruptedError(
                        f"{opened.candidate.id}: the upstream ended the stream before it was "
                        "complete"
                    )
                    break
                pending = batch
        except ProviderError as error:
            failure = StreamInterruptedError(error.message)
        finally:
            idle.close()
        if failure is not None:
            log.warning("request %s: stream cut: %s", call.request_id, failure.message)
            self._error_type = failure.code
            tally.finish_reasons.append("error")
            await send(
                {
                    "type": "http.response.body",
                    "body": stream_error(failure, call.wire),
                    "more_body": False,
                }
            )
        else:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        self._responded = True
        # Cut by its own total budget, a stream is slow, not broken: its total is censored and
        # what it observed (TTFT, the pace of its tokens) still counts.
        cut = isinstance(failure, ProviderTimeoutError) and failure.kind == TOTAL_DEADLINE
        why = TOTAL_DEADLINE if cut else failure.code if failure is not None else None
        self._record_stream(opened, ok=failure is None, error=why, cut=cut)

    def _record_stream(
        self, opened: Opened, *, ok: bool, error: str | None, cut: bool = False
    ) -> None:
        """The committed stream's sample. `cut`: it ended before the upstream finished for a
        reason not the upstream's (the total budget, the client leaving), so its total is
        censored ("more than this"); what it observed (TTFT, the pace of its tokens) counts."""
        self._recorded = True
        tally = opened.tally
        ended = time.perf_counter()
        total_over = ended - opened.started if cut else None
        ttft = tally.first_token_at - opened.started if tally.first_token_at else None
        tokens = tally.output_tokens
        tpot = None
        if tally.first_token_at and tally.last_token_at and tokens > 1:
            tpot = (tally.last_token_at - tally.first_token_at) / (tokens - 1)
        self._services.recorder.record(
            Sample(
                opened.candidate.id,
                opened.candidate.model,
                ok=ok,
                total_s=ended - opened.started,
                ttft_s=ttft,
                tpot_s=tpot,
                input_tokens=tally.usage.input_tokens,
                output_tokens=tokens,
                error=error,
                hedge_for=opened.hedge_for,
                endpoint=self._call.endpoint,
                prompt_bytes=uncached_bytes(
                    len(self._call.raw), tally.usage.input_tokens, tally.usage.cached_tokens
                ),
                total_over_s=total_over,
            )
        )


async def _send_error(send: Send, error: GatewayError, wire: Wire, request_id: str) -> None:
    body = render(error, wire)
    headers = [
        (b"content-type", _JSON),
        (b"content-length", str(len(body)).encode()),
        (b"x-request-id", request_id.encode()),
    ]
    headers += [(k.encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# --- the app -------------------------------------------------------------------------------------


def create_app(
    settings: Settings,
    *,
    recorder: Recorder | None = None,
    environ: Mapping[str, str] | None = None,
    config_path: Path | None = None,
) -> ASGIApp:
    """Build the gateway app for `settings`. Nothing is opened until its lifespan starts.

    `environ` holds the `OTEL_*` variables tracing is configured from (default: `os.environ`).
    With `config_path` (the file `settings` came from), the config is reloaded on SIGHUP and
    whenever the file changes.
    The edge middleware is the outermost layer: the LLM endpoints are served from it without
    passing through the framework's middleware stack at all; everything else goes on to FastAPI.
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        async with Runtime(
            settings,
            recorder=recorder,
            environ=os.environ if environ is None else environ,
            config_path=config_path,
        ) as runtime:
            yield {"runtime": runtime}

    app = FastAPI(
        title="Tailguard",
        summary="A latency-aware LLM API gateway.",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)
    _add_routes(app)
    # The LLM endpoints bypass the framework's routing, so their part is written by hand.
    app.openapi = partial(build_openapi, app.openapi, settings)  # type: ignore[method-assign]
    return EdgeMiddleware(app)


def _latency_view(services: Services) -> dict[str, Any]:
    """The body of `GET /admin/latency`: the snapshot, cooldowns, the store's health, the
    configured models and cumulative request counts (what the dashboard draws)."""
    body = services.latency.snapshot.as_dict()
    deployments = body["deployments"]
    for deployment, until in services.guards.cooldowns.until_wall().items():
        if deployment not in deployments:  # cooling since before the snapshot was taken
            deployments[deployment] = TargetStats.empty().as_dict()
        deployments[deployment]["cooldown_until"] = round(until, 3)
    body["store"] = services.latency.health()
    if services.servers:
        body["vllm"] = vllm_snapshot(services.servers)
        body["predictor"] = services.predictor.learned()
    body["config"] = {
        "models": [
            {
                "name": m.name,
                "deployments": [d.id for d in m.deployments],
                "fallbacks": list(m.fallbacks),
                "budget": {"ttft_ms": m.budget.ttft_ms, "total_ms": m.budget.total_ms},
                "on_ttft_miss": m.on_ttft_miss,
                "hedge_max_fraction": m.hedge_max_fraction,
            }
            for m in services.settings.models
        ]
    }
    routes: dict[str, dict[str, int]] = {}
    for (model, route), count in services.meters.routes.items():
        routes.setdefault(model, {})[route or "none"] = count
    hedges: dict[str, dict[str, int]] = {}
    for (model, result), count in services.guards.hedges.counts.items():
        hedges.setdefault(model, {})[result] = count
    body["counters"] = {
        "routes": routes,
        "hedges": hedges,
        "cooldowns": dict(services.guards.cooldowns.opened),
    }
    return body


def _add_routes(app: FastAPI) -> None:
    class WrongMethod:
        """POST to an LLM route is served by EdgeMiddleware; every other method lands here.
        A plain ASGI endpoint with no method list matches them all (HEAD and OPTIONS too), so
        none gets the router's own 405 with a list of the methods it was registered for."""

        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            raise StarletteHTTPException(405, "Method Not Allowed", headers={"allow": "POST"})

    for path in LLM_ROUTES:
        app.router.routes.append(Route(path, WrongMethod(), include_in_schema=False))

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        services = _services(request.scope)
        created = int(services.started_at)
        data = [
            {"id": name, "object": "model", "created": created, "owned_by": "tailguard"}
            for name in _visible_models(services, request.scope.get("tailguard.principal"))
        ]
        return Response(
            orjson.dumps({"object": "list", "data": data}), media_type="application/json"
        )

    @app.get("/admin/latency")
    async def admin_latency(request: Request) -> Response:
        services = _services(request.scope)
        return Response(orjson.dumps(_latency_view(services)), media_type="application/json")

    page = (Path(__file__).parent / "static" / "dashboard.html").read_bytes()

    @app.get("/dashboard")
    async def dashboard() -> Response:
        return Response(
            page,
            media_type="text/html; charset=utf-8",
            headers={
                "cache-control": "no-cache",
                # The page talks to its own origin only and loads nothing from elsewhere.
                "content-security-policy": "default-src 'self'; script-src 'self' "
                "'unsafe-inline'; style-src 'self' 'unsafe-inline'; img-src 'self' data:",
            },
        )

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        services = _services(request.scope)
        return Response(exposition(services.metrics), media_type=METRICS_CONTENT_TYPE)

    @app.get("/healthz")
    async def healthz() -> Response:
        return Response(b'{"status":"ok"}', media_type="application/json")

    @app.get("/readyz")
    async def readyz(request: Request) -> Response:
        runtime: Runtime = request.scope["state"]["runtime"]
        services = runtime.services
        # The status is open to any probe; what is configured and how, only to those allowed.
        detail = services.settings.server.readiness_detail
        if detail == "admin" and services.keyring.enabled:
            try:
                services.keyring.admin(request.scope["headers"])
            except GatewayError:
                detail = "none"
        if detail == "none":
            return Response(b'{"status":"ready"}', media_type="application/json")
        body = {
            "status": "ready",
            "providers": sorted(services.providers),
            "models": [m.name for m in services.settings.models],
            # Still ready when the store is degraded: requests do not depend on it.
            "latency_store": services.latency.health(),
            "rate_limits": runtime.limiter.health(),
            "config": runtime.health(),
        }
        return Response(orjson.dumps(body), media_type="application/json")


def create_app_from_env() -> ASGIApp:
    """App factory for `uvicorn --factory` and worker processes: loads `$TAILGUARD_CONFIG`."""
    configure_logging(os.environ.get(LOG_LEVEL_ENV, "info"))
    app = create_app(load_settings(), config_path=config_path())
    tune_gc()
    return app


def tune_gc() -> None:
    """Process-wide garbage-collector settings for a serving process (call once, after start-up
    imports). The request path makes no reference cycles, so the default thresholds only buy
    frequent full collections over the long-lived objects: 30-100 ms pauses under load. Freezing
    what exists at start-up and raising the first threshold removes them."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 50, 100)

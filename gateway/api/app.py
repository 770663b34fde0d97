"""The app: its factory, its lifespan, and the routes the framework serves (models, stored
responses and conversations, admin, dashboard, metrics, health).

Everything with a lifetime (provider clients, stores, background tasks) belongs to the `Runtime`
the lifespan opens; a request reads its `Services` once, when admitted, so a config reload never
changes what a request in flight uses.
"""

from __future__ import annotations

import gc
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import orjson
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.api.admit import visible_models
from gateway.api.conversation import delete_response, get_response, list_input_items, owner_of
from gateway.api.conversation_routes import add_conversation_routes
from gateway.api.count import count_routes
from gateway.api.edge import LLM_ROUTES, EdgeMiddleware, context_of
from gateway.api.landing import add_landing_routes
from gateway.api.openapi import build_openapi
from gateway.api.render import error_response, http_error, unexpected_error
from gateway.config import (
    ACCESS_LOG_ENV,
    HUMAN_LOG_ENV,
    LOG_LEVEL_ENV,
    Settings,
    config_path,
    load_settings,
)
from gateway.errors import GatewayError, InvalidRequestError, UnknownModelError, quote
from gateway.latency import Recorder, TargetStats
from gateway.latency.vllm import snapshot as vllm_snapshot
from gateway.responses.store import ResponseStore
from gateway.runtime import Runtime, Services
from gateway.telemetry import CONTENT_TYPE as METRICS_CONTENT_TYPE
from gateway.telemetry import configure_logging, exposition
from gateway.telemetry.prometheus import VllmCollector


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
            # The vLLM servers of whichever config is current, read at scrape time.
            runtime.registry.register(
                VllmCollector(lambda: vllm_snapshot(runtime.services.servers))
            )
            yield {"runtime": runtime}

    app = FastAPI(
        title="Tailguard",
        summary="A latency-aware LLM API gateway.",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected_error)
    _add_routes(app)
    # The LLM endpoints bypass the framework's routing, so their part is written by hand.
    app.openapi = partial(build_openapi, app.openapi, settings)  # type: ignore[method-assign]
    return EdgeMiddleware(app)


def _services(scope: Scope) -> Services:
    runtime: Runtime = scope["state"]["runtime"]
    return runtime.services


def _latency_view(services: Services) -> dict[str, Any]:
    """The body of `GET /admin/latency`: the snapshot, cooldowns, each deployment's prompt-cache
    counts, the store's health, the configured models and cumulative request counts (what the
    dashboard draws)."""
    body = services.latency.snapshot.as_dict()
    deployments = body["deployments"]
    for deployment, until in services.guards.cooldowns.until_wall().items():
        if deployment not in deployments:  # cooling since before the snapshot was taken
            deployments[deployment] = TargetStats.empty().as_dict()
        deployments[deployment]["cooldown_until"] = round(until, 3)
    for deployment, cache in services.meters.prompt_tokens.by_deployment().items():
        # Counted since start on this replica, not over the window like the rest of the entry.
        deployments.setdefault(deployment, TargetStats.empty().as_dict())["prompt_cache"] = cache
    body["store"] = services.latency.health()
    body["responses_store"] = services.responses.health() | services.responses.stats()
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
                "max_fallback_share": m.max_fallback_share,
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
    requests = dict.fromkeys((m.name for m in services.settings.models), 0)
    requests |= {model: sum(by_route.values()) for model, by_route in routes.items()}
    body["counters"] = {
        "routes": routes,
        "fallback": services.meters.fallback_served.by_model(requests),
        # Answers from a candidate other than the first planned, by why (fallbacks_total).
        "fallbacks": services.meters.fallbacks.by_model(),
        "hedges": hedges,
        "cooldowns": dict(services.guards.cooldowns.opened),
    }
    return body


def _model(services: Services, name: str) -> dict[str, Any]:
    """A model name as the OpenAI wire spells it (`GET /v1/models`, `/v1/models/{id}`)."""
    return {
        "id": name,
        "object": "model",
        "created": int(services.started_at),
        "owned_by": "tailguard",
    }


def _add_routes(app: FastAPI) -> None:
    class WrongMethod:
        """POST to an LLM route is served by EdgeMiddleware; every other method lands here.
        A plain ASGI endpoint with no method list matches them all (HEAD and OPTIONS too), so
        none gets the router's own 405 with a list of the methods it was registered for."""

        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            raise StarletteHTTPException(405, "Method Not Allowed", headers={"allow": "POST"})

    for path in LLM_ROUTES:
        app.router.routes.append(Route(path, WrongMethod(), include_in_schema=False))
    app.router.routes.extend(count_routes())  # POST /v1/messages/count_tokens, .../input_tokens
    add_conversation_routes(app)  # /v1/conversations and its items
    add_landing_routes(app)  # GET /, and /docs and /redoc lead there

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        services = _services(request.scope)
        principal = context_of(request.scope).principal
        data = [_model(services, name) for name in visible_models(services, principal)]
        return Response(
            orjson.dumps({"object": "list", "data": data}), media_type="application/json"
        )

    @app.get(
        "/v1/models/{model_id:path}",
        responses={404: {"description": "No model of that name for this key (`model_not_found`)."}},
        openapi_extra={"parameters": [_path_parameter("model_id", "A configured model name.")]},
    )
    async def retrieve_model(request: Request) -> Response:
        model_id: str = request.path_params["model_id"]
        services = _services(request.scope)
        # Scoped to the key: a model it may not use is as unknown to it as one not configured.
        visible = visible_models(services, context_of(request.scope).principal)
        if model_id not in visible:
            missing = UnknownModelError(
                f"The model {quote(model_id)} does not exist. Available models: "
                f"{', '.join(visible)}.",
                param="model",
            )
            return error_response(missing, "openai")
        return Response(orjson.dumps(_model(services, model_id)), media_type="application/json")

    @app.get("/v1/responses/{response_id}", responses=_NOT_STORED)
    async def retrieve_response(request: Request) -> Response:
        return await _stored(request, get_response)

    @app.delete("/v1/responses/{response_id}", responses=_NOT_STORED)
    async def delete_stored_response(request: Request) -> Response:
        return await _stored(request, delete_response)

    class NotServed:
        """A POST under /v1/responses/ (`/compact`, `/{id}/cancel`) names an endpoint the
        gateway does not serve: a 404 that says so, not a 405 as if a stored response were
        the resource (clients fall back on a 404)."""

        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            raise StarletteHTTPException(404, "Not Found")

    app.router.routes.append(
        Route("/v1/responses/{rest:path}", NotServed(), methods=["POST"], include_in_schema=False)
    )

    @app.get("/v1/responses/{response_id}/input_items", responses=_NOT_STORED)
    async def response_input_items(request: Request) -> Response:
        limit = request.query_params.get("limit", "20")
        order = request.query_params.get("order", "desc")

        async def listed(store: ResponseStore, rid: str, owner: str) -> Response:
            if not limit.isdigit() or not 1 <= int(limit) <= 100:
                raise InvalidRequestError(
                    "Invalid 'limit': expected an integer from 1 to 100.", param="limit"
                )
            if order not in ("asc", "desc"):
                raise InvalidRequestError(
                    "Invalid 'order': expected 'asc' or 'desc'.", param="order"
                )
            return await list_input_items(store, rid, owner, limit=int(limit), order=order)

        return await _stored(request, listed)

    @app.get("/admin/latency")
    async def admin_latency(request: Request) -> Response:
        services = _services(request.scope)
        return Response(orjson.dumps(_latency_view(services)), media_type="application/json")

    page = (Path(__file__).parent.parent / "static" / "dashboard.html").read_bytes()

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
            # Degraded or losing writes, still ready: only stored-response reads need it.
            "responses_store": services.responses.health(),
            "rate_limits": runtime.limiter.health(),
            "config": runtime.health(),
        }
        return Response(orjson.dumps(body), media_type="application/json")


def create_app_from_env() -> ASGIApp:
    """App factory for `uvicorn --factory` and worker processes: loads `$TAILGUARD_CONFIG`."""
    configure_logging(
        os.environ.get(LOG_LEVEL_ENV, "info"),
        access_file=os.environ.get(ACCESS_LOG_ENV) or None,
        human=os.environ.get(HUMAN_LOG_ENV) == "1",
    )
    app = create_app(load_settings(), config_path=config_path())
    tune_gc()
    return app


def tune_gc() -> None:
    """Process-wide garbage-collector settings for a serving process (call once, after start-up
    imports). The request path makes no reference cycles (tests/faults/test_pipelining.py checks
    it), so the default thresholds only buy frequent full collections over the long-lived
    objects: 30-100 ms pauses under load. Freezing what exists at start-up and raising the first
    threshold removes them."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 50, 100)


def _path_parameter(name: str, description: str) -> dict[str, Any]:
    """A path parameter as the document states it (handlers read it from the request)."""
    return {
        "name": name,
        "in": "path",
        "required": True,
        "description": description,
        "schema": {"type": "string"},
    }


_NOT_STORED: dict[int | str, dict[str, Any]] = {
    404: {"description": "No stored response with that id for this key (`response_not_found`)."}
}


async def _stored(
    request: Request,
    action: Callable[[ResponseStore, str, str], Awaitable[Response]],
) -> Response:
    """A stored-response route: its key's responses only, errors in the OpenAI shape. Route
    parameters are read from the request: declared ones would make the framework import its
    pydantic v1 shim, a stall on the event loop when an app is built."""
    response_id: str = request.path_params["response_id"]
    services = _services(request.scope)
    owner = owner_of(context_of(request.scope).principal)
    try:
        return await action(services.responses, response_id, owner)
    except GatewayError as error:
        return error_response(error, "openai")

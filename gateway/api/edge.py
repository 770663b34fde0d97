"""The ASGI entry: every request gets its `RequestContext` here, and the LLM endpoints are served
from here directly (`serve_llm`), outside the framework.

An LLM request goes: `serve_llm` → `admit.authenticate` and the admission cap → `admit.admit`
(body, key caps, stored conversation, rate-limit charge) → `admit.model_of` and
`admit.resolve` (headers, budget, `routing.decide`) → `proxy.Proxy` (the race, the response) →
`outcome.record`. A refusal on the way is answered by `render.send_error` and recorded by
`outcome.record` too.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.admission.auth import Principal
from gateway.api.admit import (
    REQUEST_ID,
    Admitted,
    ClientGoneError,
    admit,
    authenticate,
    model_of,
    resolve,
)
from gateway.api.outcome import RequestOutcome, record
from gateway.api.proxy import Proxy
from gateway.api.render import send_error, wire_of
from gateway.errors import GatewayError
from gateway.models import ENDPOINT_WIRE, Endpoint
from gateway.runtime import Runtime

log = logging.getLogger("tailguard")

LLM_ROUTES: dict[str, Endpoint] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
    "/v1/messages": "messages",
    "/v1/responses": "responses",
}
# With keys configured: /v1/* needs a client key, the rest of these an admin key.
_GUARDED_PREFIXES = ("/v1/", "/admin/", "/dashboard")
REQUESTED_CHARS = 256  # of a requested model name kept for the access log (a name may be huge)
_CONTEXT = "tailguard.context"  # the scope key of a framework-served request's context


@dataclass(slots=True, eq=False)
class RequestContext:
    """What travels with one request from the edge to its outcome. Admission fills in the
    key and the model as it learns them; nothing changes them after."""

    arrived: float  # perf_counter time at the edge: every budget and duration counts from here
    request_id: str  # honoured from `x-request-id`, else made here
    path: str
    principal: Principal | None = None  # the key it came with (when keys are configured)
    model: str = ""  # the configured model it names, once known
    # The name it asked for (`model`, one of its aliases, or a name no model has), cut.
    requested: str = ""


def context_of(scope: Scope) -> RequestContext:
    """The context of a request served by the framework (its routes read it from the scope)."""
    context: RequestContext = scope[_CONTEXT]
    return context


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
        arrived = time.perf_counter()
        request_id = None
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                candidate = value.decode("latin-1")
                if REQUEST_ID.match(candidate):
                    request_id = candidate
                break
        if request_id is None:
            request_id = "req_" + os.urandom(12).hex()
        path = scope["path"]
        ctx = RequestContext(arrived, request_id, path)
        endpoint = LLM_ROUTES.get(path)
        if endpoint is not None and scope["method"] == "POST":
            # These responses carry the request id themselves: no wrapper on every streamed event.
            await serve_llm(ctx, endpoint, scope, receive, send)
            return
        scope[_CONTEXT] = ctx
        if path.startswith(_GUARDED_PREFIXES) and "state" in scope:
            runtime: Runtime = scope["state"]["runtime"]
            keyring = runtime.services.keyring
            if keyring.enabled:
                wire = wire_of(path)  # /v1/messages/count_tokens: Anthropic's key header too
                try:
                    ctx.principal = authenticate(
                        keyring, path, scope["headers"], anthropic=wire == "anthropic"
                    )
                except GatewayError as error:
                    await send_error(send, error, wire, request_id)
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


async def serve_llm(
    ctx: RequestContext, endpoint: Endpoint, scope: Scope, receive: Receive, send: Send
) -> None:
    """One LLM request, from body to last byte; every failure is answered in the client's wire."""
    wire = ENDPOINT_WIRE[endpoint]
    runtime: Runtime = scope["state"]["runtime"]
    admission = runtime.admission
    ticket: Admitted | None = None
    entered = False
    try:
        try:
            keyring = runtime.services.keyring
            if keyring.enabled:
                anthropic = endpoint == "messages"
                ctx.principal = authenticate(
                    keyring, ctx.path, scope["headers"], anthropic=anthropic
                )
            admission.enter(ctx.principal)
            entered = True
            # The conversation so far (`previous_response_id`) is expanded there, before the
            # charge: the key pays for what is sent upstream.
            call, ticket = await admit(runtime, ctx.principal, scope, receive, endpoint)
            services = runtime.services  # after the last await: the request keeps these
            # Known before the name is looked up: a refusal's access line names it too.
            ctx.requested = call.model[:REQUESTED_CHARS]
            spec, call = model_of(services, call, ctx.principal)
            ctx.model = spec.name
            decision = resolve(
                services, call, spec, scope, request_id=ctx.request_id, arrived=ctx.arrived
            )
        except GatewayError as error:
            await send_error(send, error, wire, ctx.request_id)
            _refused(runtime, ctx, endpoint, ticket, error.status, error.code or error.type, scope)
            return
        except ClientGoneError:
            _refused(runtime, ctx, endpoint, ticket, 499, "client_disconnected", scope)
            return
        except Exception:
            log.exception("unhandled error while admitting a request to %s", ctx.path)
            failure = GatewayError("The gateway failed to process the request.")
            await send_error(send, failure, wire, ctx.request_id)
            _refused(runtime, ctx, endpoint, ticket, 500, "internal", scope)
            return
        outcome = RequestOutcome(services, ctx, endpoint, ticket, decision)
        await Proxy(services, decision, outcome)(scope, receive, send)
    finally:
        if entered:
            admission.leave(ctx.principal)


def _refused(
    runtime: Runtime,
    ctx: RequestContext,
    endpoint: Endpoint,
    ticket: Admitted | None,
    status: int,
    error_type: str,
    scope: Scope,
) -> None:
    """Record a request refused before it was routed."""
    headers = scope["headers"]
    record(
        RequestOutcome(
            runtime.services,
            ctx,
            endpoint,
            ticket,
            status=status,
            error_type=error_type,
            headers=headers,
        )
    )

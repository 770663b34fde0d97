"""The token-counting endpoints: `POST /v1/messages/count_tokens` (Anthropic's wire) and
`POST /v1/responses/input_tokens` (OpenAI's Responses wire).

The model is resolved as on the LLM endpoints, within the key's models; then its deployments
are asked in order (those cooling down last) for a count from their own counter
(`gateway.providers.count`), and the first that answers wins. When none can (no counter, or
every counter failed or timed out) the answer is an estimate, and says so: `"estimated": true`
in the body and `x-tailguard-token-count: estimate` (else `upstream`, with the deployment that
counted in `x-tailguard-deployment`). Nothing is generated, so nothing is recorded in the
latency statistics, and a count is charged to the key's rpm as one request but nothing to its
tpm; the gateway's and the key's caps on requests in flight apply. The work per call is
bounded: the body by `server.max_body_bytes`, its JSON values by `server.max_count_values`
(checked before parsing), and a large body is parsed, translated and estimated in a worker
thread, off the event loop.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Scope

from gateway.admission.validate import (
    check_json_values,
    check_messages,
    invalid_type,
    load_body,
    missing_param,
    off_loop,
    parse_call,
)
from gateway.api.admit import ClientGoneError, check_model, read_body, read_headers, visible_models
from gateway.api.conversation import continue_conversation, owner_of
from gateway.api.edge import RequestContext, context_of
from gateway.api.render import error_response
from gateway.config import ModelSpec
from gateway.errors import (
    GatewayError,
    InvalidRequestError,
    ProviderError,
    ProviderRejectedError,
    UnknownModelError,
    quote,
)
from gateway.models import Call, Wire
from gateway.providers.count import CountQuery, estimate_tokens
from gateway.providers.request import is_agent_header
from gateway.providers.translate import TranslationError
from gateway.runtime import Runtime, Services

log = logging.getLogger("tailguard")

COUNT_ROUTES: Final[dict[str, Wire]] = {
    "/v1/messages/count_tokens": "anthropic",
    "/v1/responses/input_tokens": "openai",
}
"""The counting endpoints, with the wire each speaks (its body and its errors)."""
TOKEN_COUNT_HEADER: Final = "x-tailguard-token-count"
"""`upstream` (a deployment's own counter answered) or `estimate`."""
DEPLOYMENT_HEADER: Final = "x-tailguard-deployment"
MODEL_HEADER: Final = "x-tailguard-model"


def count_routes() -> list[Route]:
    """The two counting routes, served by the framework (POST only: another method is a 405)."""
    return [
        Route(path, _endpoint(wire), methods=["POST"], include_in_schema=False)
        for path, wire in COUNT_ROUTES.items()
    ]


def _endpoint(wire: Wire) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        return await serve_count(request, wire)

    return endpoint


async def serve_count(request: Request, wire: Wire) -> Response:
    """One counting request: every refusal is answered in the client's wire."""
    scope = request.scope
    ctx = context_of(scope)  # authenticated by the edge already
    runtime: Runtime = scope["state"]["runtime"]
    admission = runtime.admission
    try:
        admission.enter(ctx.principal)
    except GatewayError as error:
        return error_response(error, wire, ctx.request_id)
    try:
        return await _count(runtime, ctx, request, wire)
    except GatewayError as error:
        return error_response(error, wire, ctx.request_id)
    except ClientGoneError:
        return Response(status_code=499)  # nobody reads it: the client left
    finally:
        admission.leave(ctx.principal)


async def _count(runtime: Runtime, ctx: RequestContext, request: Request, wire: Wire) -> Response:
    scope = request.scope
    server = runtime.services.settings.server
    principal = ctx.principal
    verdict = None
    if principal is not None and principal.rate_limited:
        # A count is a request against the key's rpm (it generates nothing: no tpm), charged
        # before its body is read or parsed, so a key at its limit costs no parse.
        verdict = await runtime.limiter.take(principal, 0, wire, tpm=False)
    raw = await read_body(scope, request.receive, server.max_body_bytes, server.read_timeout_s)
    model, query = await off_loop(len(raw), parse_count, wire, raw, server.max_count_values)
    services = runtime.services  # the request keeps these to its end, whatever reloads
    check_model(principal, model, services.names)
    spec = _model(services, model, ctx)
    ctx.model, ctx.requested = spec.name, model
    services.enter()  # a reload meanwhile keeps the providers' pools open until this ends
    try:
        if query.body.get("previous_response_id") or query.body.get("conversation"):
            query = await _continued(services, ctx, model, query)
        headers = _forwarded(scope, ctx.request_id)
        tokens, deployment = await count_upstream(services, spec, query, headers)
    finally:
        services.leave()
    body: dict[str, Any] = {"input_tokens": tokens}
    if wire == "openai":
        body = {"object": "response.input_tokens", **body}
    answer = {MODEL_HEADER: spec.name}
    if verdict is not None:
        answer.update((k.decode(), v.decode()) for k, v in verdict.headers(wire))
    if deployment is None:
        body["estimated"] = True
        answer[TOKEN_COUNT_HEADER] = "estimate"
    else:
        answer[TOKEN_COUNT_HEADER] = "upstream"
        answer[DEPLOYMENT_HEADER] = deployment
    return Response(orjson.dumps(body), headers=answer, media_type="application/json")


async def count_upstream(
    services: Services, spec: ModelSpec, query: CountQuery, headers: dict[str, str]
) -> tuple[int, str | None]:
    """The count of the first of `spec`'s deployments whose counter answers, with that
    deployment's id; else the estimate, with None. Raises InvalidRequestError when the request
    cannot be expressed for a deployment, or an upstream refused the request itself."""
    cooling = services.guards.cooldowns.cooling()
    deployments = sorted(spec.deployments, key=lambda d: d.id in cooling)  # demote, never drop
    for deployment in deployments:
        counter = services.providers[deployment.provider].counter(
            deployment.id, deployment.model, query, headers
        )
        if counter is None:
            continue
        try:
            return await counter(), deployment.id
        except TranslationError as exc:
            raise InvalidRequestError(f"{deployment.id}: {exc}", param=exc.param) from None
        except orjson.JSONEncodeError:  # only tool arguments parsed by translation nest deeper
            raise InvalidRequestError(
                f"{deployment.id}: the request is nested too deeply to be sent once translated.",
                code="json_too_deep",
            ) from None
        except ProviderRejectedError:
            raise  # the request itself is bad: another counter would say so too
        except ProviderError as error:
            log.info("token counter of %s failed: %s", deployment.id, error.message)
    return await off_loop(query.size, estimate_tokens, query), None


async def _continued(
    services: Services, ctx: RequestContext, model: str, query: CountQuery
) -> CountQuery:
    """The query with `previous_response_id` expanded from the gateway's store, as the
    Responses endpoint expands it: what is counted is the whole conversation."""
    call = Call("responses", model, query.body, b"", stream=False)
    call = await continue_conversation(services.responses, call, owner_of(ctx.principal))
    return CountQuery(query.wire, call.body, len(call.raw))


def _model(services: Services, name: str, ctx: RequestContext) -> ModelSpec:
    """The configured model `name` (or the model it is an alias of), within the key's models:
    another is as unknown to the key as one not configured (a 404, as `GET /v1/models/{id}`
    answers)."""
    visible = visible_models(services, ctx.principal)
    spec = services.names.lookup(name)
    if spec is None or spec.name not in visible:
        raise UnknownModelError(
            f"The model {quote(name)} does not exist. Available models: {', '.join(visible)}.",
            param="model",
        )
    return spec


def _forwarded(scope: Scope, request_id: str) -> dict[str, str]:
    """What goes upstream with a count, read as the LLM endpoints read it (`x-request-id`,
    `traceparent`, `anthropic-beta`); a coding agent's session headers mean nothing to a
    counter."""
    forward = read_headers(scope, request_id).forward
    return {name: value for name, value in forward.items() if not is_agent_header(name)}


# --- the body ------------------------------------------------------------------------------------


def parse_count(wire: Wire, raw: bytes, max_values: int) -> tuple[str, CountQuery]:
    """The model named and what to count, held to the LLM endpoints' checks (the JSON, its
    depth, repeated keys, the fields' types): a Responses body to those of `POST /v1/responses`,
    a Messages body to those of `POST /v1/messages` but `max_tokens` (nothing is generated).
    Raises BodyTooLargeError for a body of more than `max_values` JSON values (checked before
    it is parsed), and InvalidRequestError naming the offending param."""
    check_json_values(raw, max_values, "token-counting request")
    if wire == "openai":
        call = parse_call("responses", raw)
        body = {k: v for k, v in call.body.items() if k != "model"}
        return call.model, CountQuery(wire, body, len(raw))
    body = load_body(raw)
    if not isinstance(body, dict):
        raise InvalidRequestError("The request body must be a JSON object.", code="invalid_type")
    model = body.pop("model", None)
    if model is None:
        raise missing_param("model")
    if not isinstance(model, str):
        raise invalid_type("model", "a string", model)
    check_messages(body)
    for index, message in enumerate(body["messages"]):
        if message["role"] not in ("user", "assistant"):
            raise InvalidRequestError(
                f"Invalid 'messages[{index}].role': expected 'user' or 'assistant'.",
                param=f"messages[{index}].role",
                code="invalid_value",
            )
    system = body.get("system")
    if system is not None and not isinstance(system, str | list):
        raise invalid_type("system", "a string or an array", system)
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise invalid_type("tools", "an array", tools)
    return model, CountQuery(wire, body, len(raw))

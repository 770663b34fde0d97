"""The one error renderer: an error before commit, as a JSON response in the client's wire.

`error_response` is the framework's form (for its exception handlers), `send_error` the ASGI
form (for the LLM endpoints, served outside the framework); both spell the body with
`gateway.errors.render`. After commit an error can only be an event in the stream: see
`gateway.errors.stream_error` and the relay.
"""

from __future__ import annotations

import logging

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Send

from gateway.errors import GatewayError, answer_headers, quote, render
from gateway.models import Wire

log = logging.getLogger("tailguard")

_JSON = b"application/json"


def wire_of(path: str) -> Wire:
    """The wire a path's errors are spelled in: Anthropic's under `/v1/messages`."""
    return "anthropic" if path.startswith("/v1/messages") else "openai"


def error_response(error: GatewayError, wire: Wire, request_id: str | None = None) -> Response:
    return Response(
        render(error, wire, request_id),
        status_code=error.status,
        headers=answer_headers(error),
        media_type="application/json",
    )


async def send_error(send: Send, error: GatewayError, wire: Wire, request_id: str) -> None:
    """Answer with `error` (status, headers and body), carrying the request id."""
    body = render(error, wire, request_id)
    headers = [
        (b"content-type", _JSON),
        (b"content-length", str(len(body)).encode()),
        (b"x-request-id", request_id.encode()),
    ]
    headers += [(k.encode(), v.encode()) for k, v in answer_headers(error).items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def http_error(request: Request, exc: Exception) -> Response:
    """The framework's own refusals (an unknown path, a wrong method), in the gateway's shape."""
    assert isinstance(exc, StarletteHTTPException)
    message = str(exc.detail)
    path = request.url.path
    if exc.status_code == 404 and path.startswith("/v1/"):
        # "Not Found" alone reads as "model not found": name the endpoint and what is served.
        served = sorted(
            {
                p
                for route in request.app.routes
                if (p := getattr(route, "path_format", "")).startswith("/v1/")
            }
        )
        message = (
            f"There is no endpoint {request.method} {quote(path)}. "
            f"The endpoints under /v1/ are: {', '.join(served)}."
        )
    error = GatewayError(
        message,
        code={404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error"),
        headers=exc.headers,  # a 405's `allow`
    )
    error.status = exc.status_code
    error.type = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return error_response(error, wire_of(path))


async def unexpected_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path)
    error = GatewayError("The gateway failed to process the request.")
    return error_response(error, wire_of(request.url.path))

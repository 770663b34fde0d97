"""The OpenAI wire as the simulator speaks it: bodies parsed, replies, errors.

Every refusal is a `BadRequestError`, rendered once as OpenAI's error object; the request
bodies are read and checked in `gateway.sim.request`.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from typing import Any, Final

import orjson

__all__ = [
    "INBAND_ERROR",
    "JSON_HEADERS",
    "SSE_HEADERS",
    "BadRequestError",
    "SimConnectionReset",
    "SimReply",
    "error_body",
    "json_reply",
    "model_name",
    "parse_body",
    "rate_limited_reply",
    "server_error_reply",
]

JSON_HEADERS: Final = {"content-type": "application/json"}
SSE_HEADERS: Final = {"content-type": "text/event-stream", "cache-control": "no-cache"}


class SimConnectionReset(Exception):  # noqa: N818 - the name is the public contract
    """The simulated server drops the connection (before headers, or mid-stream)."""


@dataclass(slots=True)
class SimReply:
    """One response: a complete JSON `body`, or a `stream` of SSE frames (never both).

    `stream` is an async generator of complete SSE events. It may raise `SimConnectionReset` part
    way (a cut stream). Whoever abandons it early must `aclose()` it: that frees its batch slot
    and counts it as cancelled.
    """

    status: int
    headers: dict[str, str]
    body: bytes | None = None
    stream: AsyncGenerator[bytes, None] | None = None


class BadRequestError(ValueError):
    """A request refused before any work: rendered as an `invalid_request_error` at `status`."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        *,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}
    )


def json_reply(status: int, body: bytes, headers: Mapping[str, str] = JSON_HEADERS) -> SimReply:
    return SimReply(status, dict(headers), body)


def rate_limited_reply(retry_after_s: float) -> SimReply:
    """A simulated 429, with `retry-after` in whole seconds when it is whole."""
    body = error_body(
        "Rate limit reached (simulated).", "rate_limit_error", None, "rate_limit_exceeded"
    )
    whole = retry_after_s == int(retry_after_s)
    retry_text = str(int(retry_after_s)) if whole else str(retry_after_s)
    return json_reply(429, body, {**JSON_HEADERS, "retry-after": retry_text})


def server_error_reply() -> SimReply:
    """A simulated 500."""
    body = error_body(
        "The server had an error while processing your request (simulated).", "server_error"
    )
    return json_reply(500, body)


INBAND_ERROR: Final = error_body(
    "The model failed to generate a response (simulated in-band error).",
    "server_error",
    None,
    "inband_error",
)
"""The error object a 200 answers with (in the body, or as the stream's first event)."""


def parse_body(body: bytes) -> dict[str, Any]:
    try:
        request = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequestError(f"the body is not valid JSON: {exc}") from None
    if not isinstance(request, dict):
        raise BadRequestError("the body must be a JSON object")
    return request


def model_name(request: dict[str, Any]) -> str:
    model = request.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequestError("'model' must be a non-empty string", "model")
    return model

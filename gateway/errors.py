"""The whole error vocabulary, and how an error is spelled on each wire.

    GatewayError                      500 server_error
    ├── InvalidRequestError           400 invalid_request_error (param names the field)
    ├── AuthenticationError           401 invalid_request_error, code invalid_api_key
    ├── PermissionDeniedError         403 invalid_request_error (the key may not do this)
    ├── RequestTimeoutError           408 invalid_request_error (the request was read too slowly)
    ├── BodyTooLargeError             413 invalid_request_error
    ├── HeadersTooLargeError          431 invalid_request_error
    ├── KeyRateLimitedError           429 requests | tokens, code rate_limit_exceeded (retry-after)
    ├── UnknownModelError             404 invalid_request_error, code model_not_found
    ├── NotFoundError                 404 invalid_request_error (a stored response, for this key)
    ├── OverloadedError               503 (retry-after)
    │   └── CoolingDownError          503 every candidate deployment is in cooldown
    ├── StoreUnavailableError         503 the stored responses cannot be read right now
    ├── BudgetExceededError           504 the total budget ran out before commit
    ├── StreamInterruptedError        in-band only: the upstream failed after the first byte
    ├── ProviderError                 502 one upstream attempt failed before commit (retryable)
    │   ├── ProviderTimeoutError      504
    │   ├── RateLimitedError          429 (retry-after)
    │   ├── ProviderUnavailableError  503 (upstream 503 / Anthropic 529)
    │   └── ProviderRejectedError     400/413/422 from upstream: the request itself is bad (final)
    │       └── ContentFilteredError  400 content_filter: final, or tried elsewhere if configured
    └── AllCandidatesFailedError      504 if all timed out, 429 if all rate limited, else 502

Exceptions from libraries (aiohttp, redis) are translated where they are caught, never here. An
upstream's error status (or the error it put inside a 200) is mapped to this tree in one table,
`upstream_error`, whichever adapter read it. Messages made by the gateway name the deployment and
never carry a credential; what an upstream wrote reaches an error only through its provider's
`Scrubber` (gateway/scrubbing.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Final

import orjson

from gateway.models import InBandError, Wire
from gateway.numbers import retry_after_s, wait_or_none
from gateway.sse import frame


class GatewayError(Exception):
    status: int = 500
    type: str = "server_error"
    code: str | None = "internal_error"
    retryable: bool = False

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers: dict[str, str] = dict(headers or {})


class InvalidRequestError(GatewayError):
    status, type, code = 400, "invalid_request_error", "invalid_request"


class AuthenticationError(GatewayError):
    """No key, or not a key the gateway knows. The message never repeats what was sent."""

    status, type, code = 401, "invalid_request_error", "invalid_api_key"

    def __init__(self, message: str, *, code: str | None = None, realm: bool = False) -> None:
        # Basic lets a browser ask for the admin key on the dashboard (the key is the password).
        challenge = 'Basic realm="tailguard", charset="UTF-8"' if realm else "Bearer"
        super().__init__(message, code=code, headers={"www-authenticate": challenge})


class PermissionDeniedError(GatewayError):
    status, type, code = 403, "invalid_request_error", "permission_denied"


class RequestTimeoutError(GatewayError):
    status, type, code = 408, "invalid_request_error", "request_timeout"


class BodyTooLargeError(GatewayError):
    status, type, code = 413, "invalid_request_error", "request_too_large"


class HeadersTooLargeError(GatewayError):
    status, type, code = 431, "invalid_request_error", "headers_too_large"


class KeyRateLimitedError(GatewayError):
    """A key went over its requests or tokens per minute. `type` says which, as OpenAI's does."""

    status, type, code = 429, "requests", "rate_limit_exceeded"

    def __init__(self, message: str, *, kind: str, headers: Mapping[str, str]) -> None:
        super().__init__(message, headers=headers)
        self.type = kind


class UnknownModelError(GatewayError):
    status, type, code = 404, "invalid_request_error", "model_not_found"


class NotFoundError(GatewayError):
    """Something the request names (a stored response) does not exist for this caller."""

    status, type, code = 404, "invalid_request_error", "not_found"


class OverloadedError(GatewayError):
    status, type, code = 503, "server_error", "overloaded"

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        wait = wait_or_none(retry_after_s)  # an infinite or NaN wait cannot be rounded
        retry_after_s = 1.0 if wait is None else wait
        super().__init__(message, headers={"retry-after": str(max(1, math.ceil(retry_after_s)))})
        self.retry_after_s = retry_after_s


class CoolingDownError(OverloadedError):
    """Every deployment that could serve the request is in cooldown after failures."""

    code = "deployments_cooling_down"


class StoreUnavailableError(GatewayError):
    """The store of Responses API responses could not be read or written in time (Redis down
    or slow); the request was not sent upstream."""

    status, type, code = 503, "server_error", "store_unavailable"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message, param=param, headers={"retry-after": "1"})


class BudgetExceededError(GatewayError):
    """The request's total budget ran out before any answer was committed."""

    status, code = 504, "budget_exceeded"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"x-should-retry": "false"})


class ProviderError(GatewayError):
    """One upstream attempt failed before any byte reached the client."""

    status, type, code, retryable = 502, "server_error", "upstream_error", True
    faults_deployment = True  # a failure of the deployment: it counts towards its cooldown

    def __init__(
        self,
        message: str,
        *,
        deployment: str,
        upstream_status: int | None = None,
        kind: str | None = None,
    ) -> None:
        super().__init__(f"{deployment}: {message}")
        self.deployment = deployment
        self.upstream_status = upstream_status
        # Low-cardinality reason, used for `error.type` and why an attempt ended.
        self.kind = kind or (str(upstream_status) if upstream_status else type(self).__name__)


class ProviderTimeoutError(ProviderError):
    status, code = 504, "upstream_timeout"


class RateLimitedError(ProviderError):
    status, type, code = 429, "rate_limit_error", "rate_limit_exceeded"

    def __init__(
        self,
        message: str,
        *,
        deployment: str,
        upstream_status: int | None = 429,
        retry_after_s: float | None = None,
        kind: str | None = None,
    ) -> None:
        super().__init__(message, deployment=deployment, upstream_status=upstream_status, kind=kind)
        # Clamped here too: an infinite or NaN wait cannot be rounded into a header.
        self.retry_after_s = retry_after_s = wait_or_none(retry_after_s)
        if retry_after_s is not None:
            self.headers["retry-after"] = str(max(1, round(retry_after_s)))


class ProviderUnavailableError(ProviderError):
    status, code = 503, "upstream_overloaded"


class ProviderRejectedError(ProviderError):
    """The upstream refused the request itself (400/413/422): another deployment would too."""

    type, code, retryable = "invalid_request_error", "upstream_rejected", False

    def __init__(
        self,
        message: str,
        *,
        deployment: str,
        upstream_status: int,
        param: str | None = None,
        upstream_code: str | None = None,
    ) -> None:
        super().__init__(message, deployment=deployment, upstream_status=upstream_status)
        self.status = upstream_status
        self.param = param
        if upstream_code:
            self.code = upstream_code


class ContentFilteredError(ProviderRejectedError):
    """A content filter refused the request (Azure's 400, code `content_filter`). Final unless
    its provider allows trying the model's other deployments; either way it is the content's
    doing, not the deployment's, so it never cools a deployment down."""

    faults_deployment = False

    def __init__(
        self, message: str, *, deployment: str, failover: bool, param: str | None = None
    ) -> None:
        super().__init__(
            message,
            deployment=deployment,
            upstream_status=400,
            param=param,
            upstream_code="content_filter",
        )
        self.retryable = failover
        self.kind = "content_filter"


class AllCandidatesFailedError(GatewayError):
    code = "all_candidates_failed"

    def __init__(self, errors: list[ProviderError]) -> None:  # in try order
        super().__init__("; ".join(e.message for e in errors) or "no deployment could be tried")
        self.errors = errors
        kinds = {type(e) for e in errors}
        if kinds == {ProviderTimeoutError}:
            self.status, self.code = 504, "upstream_timeout"
        elif kinds == {RateLimitedError}:
            self.status, self.type, self.code = 429, "rate_limit_error", "rate_limit_exceeded"
            waits = [e.retry_after_s for e in errors if isinstance(e, RateLimitedError)]
            known = [w for w in waits if w is not None]
            if known:
                self.headers["retry-after"] = str(max(1, round(min(known))))
        elif kinds == {ProviderUnavailableError}:
            self.status, self.code = 503, "upstream_overloaded"
        else:
            self.status = 502
        if len(errors) > 1:
            # The gateway already tried several candidates; SDK retries would multiply that.
            self.headers["x-should-retry"] = "false"


# --- upstream statuses ---------------------------------------------------------------------------

MAX_CODE_CHARS = 64  # an upstream error code longer than this is cut


def parse_retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds to wait, from `retry-after-ms` or `retry-after` (seconds or an HTTP date), within
    [0, a day]; None when neither holds a usable value (`inf`, `nan`, `-1`, `soon`...)."""
    return retry_after_s(headers.get("retry-after"), headers.get("retry-after-ms"), time.time())


def _upstream_code(code: str | None) -> str | None:
    """An upstream's error code as the client sees it: not a bare number (vLLM puts the status
    there), and bounded, since it also lands in traces and the access log."""
    if not code or code.isdigit():
        return None
    return code[:MAX_CODE_CHARS]


def upstream_error(
    *,
    deployment: str,
    status: int,
    detail: str,
    headers: Mapping[str, str],
    param: str | None = None,
    upstream_code: str | None = None,
    inband: bool = False,
    credential: str = "api_key",
) -> ProviderError:
    """The error for an upstream's error status (`inband`: one it put inside a 200 response or
    stream, with the status it implies). `detail` is the upstream's message, already scrubbed;
    `credential` names what the provider authenticates with, for a 401 or 403."""
    where = "in-band error" if inband else f"upstream returned {status}"
    if status == 429:
        return RateLimitedError(
            f"{where}: {detail}",
            deployment=deployment,
            retry_after_s=parse_retry_after(headers),
            kind="inband_error" if inband else "429",
        )
    if status in (400, 413, 422):
        return ProviderRejectedError(
            detail,
            deployment=deployment,
            upstream_status=status,
            param=param,
            upstream_code=_upstream_code(upstream_code),
        )
    if status in (401, 403):
        return ProviderError(
            f"upstream rejected the gateway's credentials ({status}); check the provider's "
            f"{credential}",
            deployment=deployment,
            upstream_status=status,
        )
    if status == 404:
        return ProviderError(
            f"upstream returned 404 (unknown model or path): {detail}",
            deployment=deployment,
            upstream_status=status,
        )
    if status in (408, 504):
        return ProviderTimeoutError(
            f"{where}: {detail}", deployment=deployment, upstream_status=status
        )
    if status in (503, 529):
        return ProviderUnavailableError(
            f"{where}: {detail}",
            deployment=deployment,
            upstream_status=status,
            kind="inband_error" if inband else None,
        )
    return ProviderError(
        f"{where}: {detail}",
        deployment=deployment,
        upstream_status=status,
        kind="inband_error" if inband else None,
    )


def inband_error(deployment: str, error: InBandError) -> ProviderError:
    """An error the upstream put inside a 200 response or stream, before anything was sent
    (its strings were scrubbed where it was decoded)."""
    status = error.status if error.status and 400 <= error.status <= 599 else 500
    if error.type in ("overloaded_error",):
        status = 529
    elif error.type in ("rate_limit_error",):
        status = 429
    return upstream_error(
        deployment=deployment,
        status=status,
        detail=error.message[:500],
        headers={},
        upstream_code=error.code,
        inband=True,
    )


# --- rendering -----------------------------------------------------------------------------------

_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "invalid_request_error",  # the schema has no `request_too_large`; the status says it
    431: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


_RETRY_HELPS: Final = frozenset({408, 409, 429})  # and every 5xx
RETRY_AFTER_S: Final = 1  # when a retry helps and nothing says how long to wait


def should_retry(status: int) -> bool:
    """Whether sending the same request again may succeed: not when the request itself, its key
    or its target is wrong (400, 401, 403, 404, 413, ...), only when the refusal was about the
    moment (a timeout, a conflict, a rate limit, a failure on the way)."""
    return status in _RETRY_HELPS or status >= 500


def answer_headers(error: GatewayError) -> dict[str, str]:
    """The headers an error answers with: its own, plus the retry hints its status implies
    (`x-should-retry`, which the OpenAI and Anthropic SDKs obey, and `retry-after` when a retry
    helps), unless the error set them itself."""
    headers = dict(error.headers)
    retry = headers.setdefault("x-should-retry", "true" if should_retry(error.status) else "false")
    if retry == "true":
        headers.setdefault("retry-after", str(RETRY_AFTER_S))
    return headers


def openai_body(error: GatewayError) -> dict[str, object]:
    return {
        "error": {
            "message": error.message,
            "type": error.type,
            "param": error.param,
            "code": error.code,
        }
    }


def anthropic_body(error: GatewayError, request_id: str | None = None) -> dict[str, object]:
    kind = _ANTHROPIC_TYPES.get(error.status, "api_error")
    return {
        "type": "error",
        "error": {"type": kind, "message": error.message},
        "request_id": request_id,
    }


def render(error: GatewayError, wire: Wire, request_id: str | None = None) -> bytes:
    body = anthropic_body(error, request_id) if wire == "anthropic" else openai_body(error)
    return orjson.dumps(body)


def stream_error(error: GatewayError, wire: Wire) -> bytes:
    """The SSE event that ends a stream whose status was already sent (never followed by [DONE])."""
    if wire == "anthropic":
        return frame(orjson.dumps(anthropic_body(error)), event="error")
    return frame(orjson.dumps(openai_body(error)))


class StreamInterruptedError(GatewayError):
    """An upstream failed after the first byte reached the client."""

    status, type, code = 502, "server_error", "upstream_stream_error"


# --- quoting client input ------------------------------------------------------------------------

QUOTE_CHARS = 64
"""The most of a client-supplied value (a model name, a field's value) an error message quotes."""


def quote(value: object, limit: int = QUOTE_CHARS) -> str:
    """`value` as an error message may quote it: its repr, cut to `limit` characters (a client
    may send megabytes where a name is expected; the message would echo them all)."""
    if isinstance(value, str) and len(value) > limit:
        value = value[:limit]  # cut before repr: cheap on a huge string
        return f"{value!r}... ({limit} characters shown)"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({limit} characters shown)"

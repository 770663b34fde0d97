"""Gemini models behind the chat wire: the Gemini API (`type: gemini`) and, through the same
class with OAuth2 tokens, Vertex AI's Google publisher (`type: vertex`, see `vertex`).

The provider presents the OpenAI chat wire (`wire == "openai"`): the rest of the gateway sends it
a chat completions body and reads `chat.completion(.chunk)` bytes, exactly as an OpenAI server
would write them, so the commit point, idle timeout, pre-commit bounds and usage accounting work
unchanged. The body is translated to `generateContent` here (`translate.gemini`) and each
answer, whole or streamed (`:streamGenerateContent?alt=sse`), back (`translate.gemini_answers`).

Google's errors (`{"error": {"code", "message", "status", "details"}}`, sometimes inside a
one-element array) go through the gateway's one status table: 429 RESOURCE_EXHAUSTED and 503
UNAVAILABLE cool the deployment down and fail over (a `RetryInfo.retryDelay` is its
`retry-after`), 400 INVALID_ARGUMENT is the client's 400, 401/403 an authentication failure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import quote, urlsplit

import aiohttp
import orjson

from gateway.config import ProviderSpec
from gateway.config.cloud_google import google_base_url
from gateway.errors import ProviderError, ProviderRejectedError, upstream_error
from gateway.models import Endpoint, UpstreamRequest, Wire
from gateway.providers.base import (
    MAX_ERROR_BYTES,
    ChunkStream,
    NoCounter,
    read_whole,
    stream_limits,
)
from gateway.providers.decode import UpstreamProtocolError, parse_object
from gateway.providers.http import _Body, _read_up_to, translate_client_error
from gateway.providers.translate.gemini import chat_request_to_gemini
from gateway.providers.translate.gemini_answers import GeminiToChatStream, gemini_response_to_chat
from gateway.providers.translate.shapes import TranslationError
from gateway.scrubbing import Scrubber
from gateway.sse import SSEFramingError, SSEParser, frame

_CREDENTIAL_REASONS: Final = frozenset({"API_KEY_INVALID", "API_KEY_EXPIRED"})


@dataclass(frozen=True, slots=True)
class GoogleError:
    """A Google API error body's useful fields, scrubbed."""

    message: str
    status: str | None  # RESOURCE_EXHAUSTED, INVALID_ARGUMENT, ...
    retry_s: float | None  # what its RetryInfo asks for
    reasons: frozenset[str]  # its ErrorInfo reasons (API_KEY_INVALID, ...)


def google_error(body: bytes, scrub: Scrubber) -> GoogleError | None:
    """A Google API error body (`{"error": {...}}`, or that inside a one-element array, as
    streaming endpoints send it); None when the body is not one."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if isinstance(parsed, list) and parsed:
        parsed = parsed[0]
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if not isinstance(error, dict):
        return None
    status = error.get("status")
    delay = None
    reasons: set[str] = set()
    for detail in error.get("details") or ():
        if not isinstance(detail, dict):
            continue
        kind = str(detail.get("@type", ""))
        if kind.endswith("RetryInfo"):
            delay = _duration(detail.get("retryDelay"))
        elif kind.endswith("ErrorInfo") and isinstance(detail.get("reason"), str):
            reasons.add(detail["reason"])
    return GoogleError(
        scrub.bounded(str(error.get("message") or "no error message"), 500),
        scrub.bounded(status, 64) if isinstance(status, str) else None,
        delay,
        frozenset(reasons),
    )


def _duration(value: object) -> float | None:
    """A protobuf Duration as JSON ("30s", "1.5s") in seconds."""
    if not isinstance(value, str) or not value.endswith("s"):
        return None
    try:
        return float(value[:-1])
    except ValueError:
        return None


def google_status_error(
    deployment: str,
    status: int,
    headers: Mapping[str, str],
    body: bytes,
    scrub: Scrubber,
    credential: str = "api_key",
) -> ProviderError:
    """An error status from a Google endpoint, through the gateway's status table. The Gemini
    API answers a wrong key with a 400 (reason API_KEY_INVALID): that is a credential failure,
    not the client's bad request."""
    found = google_error(body, scrub)
    if found is None:
        text = scrub.bounded(body[:800].decode("utf-8", "replace"), 300)
        detail = " ".join(text.split()) or "no error body"
        return upstream_error(
            deployment=deployment,
            status=status,
            detail=detail,
            headers=headers,
            credential=credential,
        )
    if found.reasons & _CREDENTIAL_REASONS:
        status = 401
    if found.retry_s is not None and "retry-after" not in headers:
        headers = {**headers, "retry-after": str(max(1, round(found.retry_s)))}
    return upstream_error(
        deployment=deployment,
        status=status,
        detail=found.message,
        headers=headers,
        upstream_code=found.status,
        credential=credential,
    )


class _GeminiReader:
    """The bytes a chat client would read: the Gemini response read from `body`, translated."""

    __slots__ = ("_body", "_deployment", "_done", "_model", "_parser", "_scrub", "_stream")

    def __init__(
        self, body: _Body, stream: GeminiToChatStream, model: str, deployment: str, scrub: Scrubber
    ) -> None:
        self._body = body
        self._stream = stream
        self._model = model
        self._deployment = deployment
        self._scrub = scrub
        self._parser = SSEParser()
        self._done = False

    def _invalid(self, exc: Exception) -> ProviderError:
        return ProviderError(
            f"invalid response from upstream: {self._scrub.bounded(str(exc), 300)}",
            deployment=self._deployment,
            kind="invalid_response",
        )

    async def read_stream(self) -> bytes:
        while not self._done:
            data = await self._body.read_stream()
            if not data:
                self._done = True
                return self._stream.end()
            out = b""
            try:
                for event in self._parser.feed(data):
                    if event.data:
                        out += self._event(parse_object(event.data, "stream event"))
            except (SSEFramingError, UpstreamProtocolError) as exc:
                raise self._invalid(exc) from None
            if out:
                return out
        return b""

    def _event(self, data: dict[str, Any]) -> bytes:
        error = data.get("error")
        if isinstance(error, dict):  # an error inside the stream: OpenAI's error event
            return frame(orjson.dumps({"error": _chat_error(error)}))
        return self._stream.feed(data)

    async def close(self) -> None:
        await self._body.close()

    async def read_body(self) -> bytes:
        if self._done:
            return b""
        self._done = True
        body = await read_whole(self._body.read, self._deployment)
        try:
            data = parse_object(body, "response body")
        except UpstreamProtocolError as exc:
            raise self._invalid(exc) from None
        error = data.get("error")
        if isinstance(error, dict):
            return orjson.dumps({"error": _chat_error(error)})
        return orjson.dumps(gemini_response_to_chat(data, model=self._model))


def _chat_error(error: dict[str, Any]) -> dict[str, Any]:
    """A Google error object as an OpenAI one (its HTTP code as `status`, its status as `code`)."""
    code = error.get("code")
    return {
        "message": str(error.get("message") or "upstream error"),
        "type": "server_error",
        "code": error.get("status") if isinstance(error.get("status"), str) else None,
        "status": code if type(code) is int else 500,
    }


class GeminiProvider(NoCounter):
    """Gemini models over the Gemini API, presenting the chat wire. `VertexGemini` subclasses it:
    only the URL and the credential differ."""

    system = "gcp.gemini"
    credential = "api_key"  # what a 401 or 403 says to check

    def __init__(self, name: str, spec: ProviderSpec, session: aiohttp.ClientSession) -> None:
        self.name = name
        self.wire: Wire = "openai"
        self.bulk_priority: int | None = None
        self.limits = stream_limits(spec)
        self.session = session
        self.base = (spec.base_url or google_base_url(spec) or "").rstrip("/")
        self.address = urlsplit(self.base).hostname
        self._extra = {k.lower(): v.get_secret_value() for k, v in spec.headers.items()}
        self._key = spec.api_key.get_secret_value() if spec.api_key else None
        self._secrets = [*self._extra.values(), *([self._key] if self._key else [])]
        self.scrub = Scrubber.of(self._secrets)

    def url(self, model: str, stream: bool) -> str:
        method = "streamGenerateContent?alt=sse" if stream else "generateContent"
        return f"{self.base}/v1beta/models/{quote(model.removeprefix('models/'), safe='')}:{method}"

    async def auth_headers(self, deployment: str) -> dict[str, str]:
        return {"x-goog-api-key": self._key} if self._key else {}

    def auth_failed(self, sent: Mapping[str, str]) -> bool:
        """A 401 came back: whether a fresh credential is worth one more try."""
        return False

    def supports(self, endpoint: Endpoint) -> bool:
        return endpoint == "chat"

    async def open(self, deployment: str, request: UpstreamRequest) -> ChunkStream:
        try:
            chat = orjson.loads(request.body)
            model = str(chat.get("model") or "")
            body = orjson.dumps(chat_request_to_gemini(chat, model))
        except TranslationError as exc:
            raise ProviderRejectedError(
                exc.message, deployment=deployment, upstream_status=400, param=exc.param
            ) from None
        include_usage = bool((chat.get("stream_options") or {}).get("include_usage"))
        accept = "text/event-stream" if request.stream else "application/json"
        url = self.url(model, request.stream)
        response = await self.post(deployment, url, body, request, accept)
        reader = _GeminiReader(
            _Body(response),
            GeminiToChatStream(model=model, include_usage=include_usage),
            model,
            deployment,
            self.scrub,
        )
        return ChunkStream(
            deployment=deployment,
            wire="openai",
            streaming=request.stream,
            read=reader.read_stream if request.stream else reader.read_body,
            close=reader.close,
            translate=lambda exc: self.error(deployment, exc),
            scrub=self.scrub,
            status=response.status,
            lazy=request.passthrough,
            upstream_request_id=response.headers.get("x-request-id"),
        )

    async def post(
        self, deployment: str, url: str, body: bytes, request: UpstreamRequest, accept: str
    ) -> aiohttp.ClientResponse:
        """Send, and return a 2xx response whose body is what was asked for; else raise. A 401
        with a credential that may have just expired is tried once more with a fresh one."""
        for attempt in (0, 1):
            headers = {
                "content-type": "application/json",
                "accept": accept,
                "accept-encoding": "identity" if request.stream else "gzip, deflate",
                **self._extra,
                **request.headers,
                **(await self.auth_headers(deployment)),
            }
            try:
                response = await self.session.post(url, data=body, headers=headers)
            except Exception as exc:
                error = self.error(deployment, exc)
                if error is None:
                    raise
                raise error from None
            streaming = response.headers.get("content-type", "").startswith("text/event-stream")
            if response.status < 300 and streaming == request.stream:
                return response
            try:
                text = await _read_up_to(response, MAX_ERROR_BYTES)
            except (TimeoutError, aiohttp.ClientError, OSError):
                text = b""
            finally:
                response.close()
            if response.status == 401 and attempt == 0 and self.auth_failed(headers):
                continue
            status = response.status if response.status >= 300 else 500
            if response.status < 300 and google_error(text, self.scrub) is None:
                raise ProviderError(
                    "upstream answered a streaming request without a stream",
                    deployment=deployment,
                    kind="invalid_response",
                )
            raise google_status_error(
                deployment, status, response.headers, text, self.scrub, self.credential
            )
        raise AssertionError("unreachable")

    def error(self, deployment: str, exc: BaseException) -> ProviderError | None:
        if isinstance(exc, ProviderError):
            return exc
        return translate_client_error(deployment, exc)

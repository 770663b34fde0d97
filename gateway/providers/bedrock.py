"""AWS Bedrock through its Converse and ConverseStream APIs, presented as the Messages wire.

`POST {endpoint}/model/{modelId}/converse` answers JSON; `/converse-stream` answers AWS's binary
event stream (`application/vnd.amazon.eventstream`), decoded here incrementally with botocore's
parser and rewritten event by event into Messages SSE (`bedrock_wire`), then classified by the
Anthropic decoder like any Anthropic stream. Requests are signed with SigV4 (`bedrock_auth`) or
carry a Bedrock API key as a bearer token.

Bedrock's errors name themselves in `x-amzn-ErrorType` (a status alone is ambiguous: a 429 may be
throttling or a model not ready, a 403 bad credentials or a model not enabled); each maps to the
gateway's vocabulary here. Exceptions inside the stream become Messages `error` events.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable, Mapping
from typing import Any, Final, cast
from urllib.parse import quote, urlsplit

import aiohttp
import orjson
from botocore.eventstream import EventStreamBuffer, ParserError
from yarl import URL

from gateway.config import ProviderSpec
from gateway.config.cloud_bedrock import default_endpoint
from gateway.errors import (
    ProviderError,
    ProviderRejectedError,
    ProviderTimeoutError,
    ProviderUnavailableError,
    RateLimitedError,
    parse_retry_after,
    upstream_error,
)
from gateway.models import Chunk, Endpoint, SSEEvent, UpstreamRequest, Wire
from gateway.providers.base import MAX_ERROR_BYTES, NoCounter, read_whole, stream_limits
from gateway.providers.bedrock_auth import CredentialsError, SigV4Signer
from gateway.providers.bedrock_wire import (
    ConverseStreamTranslator,
    converse_to_message,
    exception_event,
    latency_ms,
    messages_to_converse,
)
from gateway.providers.decode import (
    AnthropicStreamDecoder,
    UpstreamProtocolError,
    decode_anthropic_body,
)
from gateway.providers.http import STREAM_PIECE_BYTES, translate_client_error
from gateway.providers.translate import TranslationError
from gateway.scrubbing import Scrubber

EVENT_STREAM: Final = "application/vnd.amazon.eventstream"
# Error types whose meaning the status does not carry.
_THROTTLED: Final = frozenset(
    {"ThrottlingException", "ServiceQuotaExceededException", "TooManyRequestsException"}
)
_UNAVAILABLE: Final = frozenset({"ModelNotReadyException", "ServiceUnavailableException"})
_AUTH: Final = frozenset(
    {
        "AccessDeniedException",
        "UnrecognizedClientException",
        "InvalidSignatureException",
        "IncompleteSignatureException",
        "ExpiredTokenException",
        "MissingAuthenticationTokenException",
        "InvalidClientTokenId",
        "SignatureDoesNotMatch",
    }
)
_FORWARDED_HEADERS: Final = ("x-request-id", "traceparent", "tracestate")


class BedrockProvider(NoCounter):
    """Bedrock's Converse API behind the Messages wire; signs with SigV4 or an API key."""

    wire: Wire = "anthropic"
    system = "aws.bedrock"  # gen_ai.provider.name
    bulk_priority: int | None = None

    def __init__(self, name: str, spec: ProviderSpec, session: aiohttp.ClientSession) -> None:
        assert spec.region is not None  # checked by the config
        self.name = name
        self.session = session
        self.limits = stream_limits(spec)
        self._base = (spec.base_url or default_endpoint(spec.region)).rstrip("/")
        self.address = urlsplit(self._base).hostname
        self._latency = spec.performance_latency
        self._key = spec.api_key.get_secret_value() if spec.api_key else None
        self._extra = {k.lower(): v.get_secret_value() for k, v in spec.headers.items()}
        configured = [*self._extra.values(), self._key or ""]
        # The configured secrets, and the AWS chain's credentials once resolved (see open).
        self.scrub = Scrubber.of(configured)
        self._signer = None if self._key else SigV4Signer(spec.region, spec.aws_profile, configured)

    def supports(self, endpoint: Endpoint) -> bool:
        return endpoint == "messages"

    async def open(self, deployment: str, request: UpstreamRequest) -> BedrockStream:
        body, model = self._converse_body(deployment, request)
        action = "converse-stream" if request.stream else "converse"
        url = f"{self._base}/model/{quote(model, safe='')}/{action}"
        headers = {
            "content-type": "application/json",
            "accept": EVENT_STREAM if request.stream else "application/json",
        }
        headers |= {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED_HEADERS}
        headers |= self._extra
        if self._signer is None:
            headers["authorization"] = f"Bearer {self._key}"
        else:
            try:
                headers = await self._signer.sign(url, body, headers)
            except CredentialsError as exc:
                raise ProviderError(str(exc), deployment=deployment, kind="credentials") from None
            self.scrub = self._signer.scrub
        try:
            response = await self.session.post(URL(url, encoded=True), data=body, headers=headers)
        except Exception as exc:
            error = translate_client_error(deployment, exc)
            if error is None:
                raise
            raise error from None
        kind = response.headers.get("content-type", "")
        if response.status >= 300 or (request.stream and not kind.startswith(EVENT_STREAM)):
            try:
                text = await _read_up_to(response, MAX_ERROR_BYTES)
            except (TimeoutError, aiohttp.ClientError, OSError):
                text = b""
            finally:
                response.close()
            raise self._status_error(deployment, response.status, response.headers, text)
        request_id = self.scrub.clean_or_none(response.headers.get("x-amzn-requestid"))
        message_id = "msg_bdrk_" + (
            "".join(c for c in request_id if c.isalnum()) if request_id else secrets.token_hex(12)
        )
        return BedrockStream(
            deployment=deployment,
            response=response,
            streaming=request.stream,
            scrub=self.scrub,
            model=model,
            message_id=message_id,
            upstream_request_id=request_id,
        )

    def _converse_body(self, deployment: str, request: UpstreamRequest) -> tuple[bytes, str]:
        parsed = orjson.loads(request.body)
        model = parsed.get("model")
        # Claude on Bedrock takes its betas in the body, not as a header.
        header = request.headers.get("anthropic-beta", "")
        betas = [beta.strip() for beta in header.split(",") if beta.strip()]
        try:
            converse = messages_to_converse(parsed, latency=self._latency, betas=betas)
        except TranslationError as exc:
            raise ProviderRejectedError(
                exc.message, deployment=deployment, upstream_status=400, param=exc.param
            ) from None
        return orjson.dumps(converse), str(model)

    def _status_error(
        self, deployment: str, status: int, headers: Mapping[str, str], body: bytes
    ) -> ProviderError:
        return bedrock_error(
            deployment=deployment,
            status=status,
            headers=headers,
            body=body,
            scrub=self.scrub,
            sigv4=self._signer is not None,
            invalidate=self._signer.invalidate if self._signer is not None else None,
        )


def error_type(headers: Mapping[str, str], body: bytes) -> tuple[str | None, str]:
    """Bedrock's error type (`x-amzn-ErrorType`, else the body's `__type`) and message."""
    kind = headers.get("x-amzn-errortype") or headers.get("x-amzn-ErrorType")
    message = ""
    try:
        obj = orjson.loads(body)
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        found = obj.get("message") or obj.get("Message")
        message = found if isinstance(found, str) else ""
        if not kind and isinstance(obj.get("__type"), str):
            kind = obj["__type"]
    if kind:
        kind = kind.split(":", 1)[0].rsplit("#", 1)[-1]  # "Name:http://..." or "ns#Name"
    return kind or None, message


def bedrock_error(
    *,
    deployment: str,
    status: int,
    headers: Mapping[str, str],
    body: bytes,
    scrub: Scrubber,
    sigv4: bool,
    invalidate: Callable[[], None] | None = None,
) -> ProviderError:
    """The gateway's error for a Bedrock error response (its text scrubbed)."""
    kind, message = error_type(headers, body)
    detail = scrub.bounded(f"{kind}: {message}" if kind else message or "no error body", 500)
    if status < 300:
        return ProviderError(
            "upstream answered a streaming request without an event stream",
            deployment=deployment,
            kind="invalid_response",
        )
    if kind in _THROTTLED:
        return RateLimitedError(
            f"upstream returned {status}: {detail}",
            deployment=deployment,
            upstream_status=status,
            retry_after_s=parse_retry_after(headers),
            kind="429",
        )
    if kind in _UNAVAILABLE:
        return ProviderUnavailableError(
            f"upstream returned {status}: {detail}", deployment=deployment, upstream_status=status
        )
    if kind in _AUTH or status in (401, 403):
        if invalidate is not None and kind != "AccessDeniedException":
            invalidate()  # resolve the credential chain again: they may have been rotated
        how = (
            "check the AWS credentials the chain resolves (aws_profile, environment, role) "
            "and the clock"
            if sigv4
            else "check the provider's api_key"
        )
        if kind == "AccessDeniedException":
            how = "check the IAM permissions and the model's access in this region"
        return ProviderError(
            f"upstream rejected the gateway's credentials ({status} {kind or ''}): {how}; "
            f"{scrub.bounded(message, 300)}",
            deployment=deployment,
            upstream_status=status,
        )
    if kind == "ModelTimeoutException":
        return ProviderTimeoutError(
            f"upstream returned {status}: {detail}", deployment=deployment, upstream_status=status
        )
    if kind == "ValidationException":
        status = 400
    return upstream_error(
        deployment=deployment, status=status, detail=detail, headers=headers, upstream_code=kind
    )


async def _read_up_to(response: aiohttp.ClientResponse, limit: int) -> bytes:
    parts: list[bytes] = []
    size = 0
    while size < limit and (data := await response.content.read(limit - size)):
        parts.append(data)
        size += len(data)
    return b"".join(parts)


class BedrockStream:
    """A Converse answer as Messages chunks: one body chunk, or the stream's events."""

    def __init__(
        self,
        *,
        deployment: str,
        response: aiohttp.ClientResponse,
        streaming: bool,
        scrub: Scrubber,
        model: str,
        message_id: str,
        upstream_request_id: str | None,
    ) -> None:
        self.status = response.status
        self.streaming = streaming
        self.upstream_request_id = upstream_request_id
        self._deployment = deployment
        self._response = response
        self._scrub = scrub
        self._model = model
        self._id = message_id
        self._eof = False
        self._done = False
        self._closed = False
        self._buffer = EventStreamBuffer()
        self._translator = ConverseStreamTranslator(model=model, message_id=message_id)
        self._decoder = AnthropicStreamDecoder(scrub=scrub)

    async def read(self) -> list[Chunk] | None:
        if self._done:
            return None
        if not self.streaming:
            self._done = True
            return [await self._body()]
        while True:
            data = await self._next_bytes()
            if not data:
                self._done = True
                tail = self._translator.finish()
                if tail:
                    return self._chunks(tail)
                if not self._translator.complete:
                    raise ProviderError(
                        "the event stream ended before the answer did",
                        deployment=self._deployment,
                        kind="truncated",
                    )
                return None
            chunks = self._feed(data)
            if chunks:
                return chunks

    def _feed(self, data: bytes) -> list[Chunk]:
        self._buffer.add_data(data)
        chunks: list[Chunk] = []
        try:
            for message in self._buffer:
                headers = cast("dict[str, Any]", message.headers)  # the stubs say int
                kind = headers.get(":message-type")
                if kind == "event":
                    payload = orjson.loads(message.payload) if message.payload else {}
                    if not isinstance(payload, dict):
                        raise UpstreamProtocolError("an event payload is not a JSON object")
                    name = str(headers.get(":event-type"))
                    chunks.extend(self._chunks(self._translator.event(name, payload)))
                elif kind in ("exception", "error"):
                    chunks.extend(self._chunks([self._exception(headers, message.payload)]))
                    self._done = True  # nothing follows an exception
                    break
        except (ParserError, ValueError) as exc:  # bad CRCs or framing, or JSON
            raise ProviderError(
                f"invalid event stream from upstream: {self._scrub.bounded(str(exc), 300)}",
                deployment=self._deployment,
                kind="invalid_response",
            ) from None
        return chunks

    def _exception(self, headers: Mapping[str, Any], payload: bytes) -> tuple[str, bytes, bytes]:
        name = headers.get(":exception-type") or headers.get(":error-code") or "exception"
        try:
            obj = orjson.loads(payload) if payload else {}
        except ValueError:
            obj = {}
        message = obj.get("message") or obj.get("Message") if isinstance(obj, dict) else None
        text = message or headers.get(":error-message") or ""
        return exception_event(str(name), self._scrub.bounded(str(text), 500))

    def _chunks(self, events: list[tuple[str, bytes, bytes]]) -> list[Chunk]:
        chunks = []
        for kind, raw, data in events:
            chunk = self._decoder.decode(SSEEvent(raw=raw, data=data, event=kind))
            if kind == "message_delta" and chunk.usage is not None:
                chunk.usage.upstream_latency_ms = self._translator.latency_ms
            chunks.append(chunk)
        return chunks

    async def _body(self) -> Chunk:
        body = await read_whole(self._next_bytes, self._deployment)
        try:
            answer = orjson.loads(body)
            if not isinstance(answer, dict):
                raise ValueError("not a JSON object")
            message = converse_to_message(answer, model=self._model, message_id=self._id)
            chunk = decode_anthropic_body(orjson.dumps(message), scrub=self._scrub)
        except (ValueError, AttributeError, TypeError, UpstreamProtocolError) as exc:
            raise ProviderError(
                f"invalid response from upstream: {self._scrub.bounded(str(exc), 300)}",
                deployment=self._deployment,
                kind="invalid_response",
            ) from None
        if chunk.usage is not None:
            chunk.usage.upstream_latency_ms = latency_ms(answer.get("metrics"))
        return chunk

    async def _next_bytes(self) -> bytes:
        """The next bytes ('' at the end); a read that finds bytes buffered lets the loop turn
        first, so an upstream flooding the gateway cannot starve everything else."""
        content = self._response.content
        try:
            data = content.read_nowait(STREAM_PIECE_BYTES)
            if data:
                await asyncio.sleep(0)
                return data
            data = await (content.read(STREAM_PIECE_BYTES) if self.streaming else content.readany())
        except Exception as exc:
            error = translate_client_error(self._deployment, exc)
            if error is None:
                raise
            raise error from None
        if not data:
            self._eof = True
        return data

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._eof:
            self._response.release()
        else:
            self._response.close()  # abandoned: drop the connection, so the upstream stops

"""What the adapters of upstreams reached over HTTP share: the connection pool, the transport's
errors, the body reader, and `HTTPProvider`, one request sent and its answer read as a stream.

Each protocol is one subclass: `openai.OpenAIProvider` (OpenAI-compatible APIs; `vllm` adds
vLLM's token counter, `azure` Azure's paths and auth), `anthropic.AnthropicProvider`. Each
provider borrows one `aiohttp.ClientSession` (its connection pool), owned by the app's
lifespan. The upstream client is most of a proxy's per-request CPU cost; measured on the gateway's
hot path, aiohttp used directly costs about half of httpx running over an aiohttp transport (URL
parsing, header models and response objects made twice), so the adapter speaks aiohttp.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any, Final, NamedTuple
from urllib.parse import urlsplit

import aiohttp
import orjson

from gateway.admission.validate import off_loop
from gateway.config import ProviderSpec
from gateway.errors import ProviderError, ProviderTimeoutError, inband_error
from gateway.models import Endpoint, InBandError, UpstreamRequest, Wire
from gateway.providers.base import MAX_ERROR_BYTES, ChunkStream, status_error, stream_limits
from gateway.providers.count import counted
from gateway.scrubbing import Scrubber
from gateway.upstream import Counter, TokenQuery, UpstreamStream

_TIMEOUTS = (TimeoutError, aiohttp.ServerTimeoutError)

Session = aiohttp.ClientSession  # what an adapter over HTTP is given (the one owner of aiohttp)

STREAM_PIECE_BYTES: Final = 4 * 1024  # tiny events in this many bytes take ~0.5 ms to parse
MAX_COUNT_BYTES: Final = 64 * 1024 * 1024  # vLLM's answer lists every token id of the prompt


class CountRequest(NamedTuple):
    """Where a protocol's token counter is asked, and how: the body (made on first use, off the
    loop when large), the answer's key holding the count, and whether a client's
    `anthropic-beta` header goes along (only Anthropic's counter takes it)."""

    url: str
    body: Callable[[], dict[str, Any]]
    key: str
    betas: bool = False


def make_session(spec: ProviderSpec) -> aiohttp.ClientSession:
    """The one connection pool of a provider. The caller owns it (`close()` it)."""
    connector = aiohttp.TCPConnector(
        limit=spec.max_connections,
        limit_per_host=0,
        keepalive_timeout=30 if spec.max_keepalive_connections else None,
        force_close=spec.max_keepalive_connections == 0,
        ttl_dns_cache=60,
    )
    timeout = aiohttp.ClientTimeout(
        total=None,
        connect=None,
        sock_connect=spec.connect_timeout_ms / 1000,
        sock_read=spec.read_timeout_ms / 1000,
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        trust_env=False,
        raise_for_status=False,
        skip_auto_headers=("User-Agent",),
    )


def translate_client_error(deployment: str, exc: BaseException) -> ProviderError | None:
    """Map an aiohttp/socket exception to the gateway's vocabulary; None for anything else."""
    if isinstance(exc, _TIMEOUTS):
        return ProviderTimeoutError(
            f"upstream timed out ({type(exc).__name__})", deployment=deployment, kind="timeout"
        )
    if isinstance(exc, aiohttp.ClientError | OSError):
        return ProviderError(
            f"upstream connection failed ({type(exc).__name__})",
            deployment=deployment,
            kind="connection_error",
        )
    return None


async def _read_up_to(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """At most `limit` bytes of a body, read to its end (one read returns only what is buffered)."""
    parts: list[bytes] = []
    size = 0
    while size < limit and (data := await response.content.read(limit - size)):
        parts.append(data)
        size += len(data)
    return b"".join(parts)


class _Body:
    """Reads an aiohttp response piece by piece; closes the connection if left unfinished."""

    __slots__ = ("_eof", "_response")

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self._eof = False

    async def read(self) -> bytes:
        """Whatever is buffered (a body is only collected, so its pieces may be large)."""
        data = await self._response.content.readany()
        if not data:
            self._eof = True
        return data

    async def read_stream(self) -> bytes:
        """At most STREAM_PIECE_BYTES of a stream, each of which is parsed event by event.

        A read that finds bytes already buffered returns without suspending; while an upstream
        floods the gateway that would be every read, so the loop would serve nothing else. Such
        a read first lets the loop turn once.
        """
        content = self._response.content
        data = content.read_nowait(STREAM_PIECE_BYTES)
        if data:
            await asyncio.sleep(0)
            return data
        data = await content.read(STREAM_PIECE_BYTES)
        if not data:
            self._eof = True
        return data

    async def close(self) -> None:
        if self._eof:
            self._response.release()  # read to the end: the connection goes back to the pool
        else:
            self._response.close()  # abandoned: drop the connection, so the upstream stops


class HTTPProvider:
    """An upstream reached over HTTP; a subclass names its wire, paths, auth and counter."""

    wire: Wire
    system: str  # `gen_ai.provider.name`
    paths: Mapping[Endpoint, str]  # below `base_url`
    credential = "api_key"  # what a 401 or 403 says to check

    def __init__(self, name: str, spec: ProviderSpec, session: aiohttp.ClientSession) -> None:
        assert spec.base_url is not None  # checked by the config
        self.name = name
        self.address = urlsplit(spec.base_url).hostname
        self.bulk_priority = spec.bulk_priority
        self.limits = stream_limits(spec)
        self.session = session
        self._spec = spec
        self._base = spec.base_url.rstrip("/")
        self._urls = {endpoint: self._base + path for endpoint, path in self.paths.items()}
        key = spec.api_key.get_secret_value() if spec.api_key else None
        headers = {"content-type": "application/json"} | self._auth_headers(spec, key)
        for header, value in spec.headers.items():
            headers[header.lower()] = value.get_secret_value()
        # Streams are forwarded byte for byte, so they are asked for uncompressed.
        self._stream_headers = headers | {
            "accept": "text/event-stream",
            "accept-encoding": "identity",
        }
        # What a non-streaming request sends: also the token counters' headers (see count.py).
        self.body_headers = headers | {"accept": "application/json"}
        secrets = [v.get_secret_value() for v in spec.headers.values()]
        self.scrub = Scrubber.of([*secrets, key] if key else secrets)

    def _auth_headers(self, spec: ProviderSpec, key: str | None) -> dict[str, str]:
        """The headers that carry the credential (and the API version) on every request."""
        raise NotImplementedError

    def _inband_error(self, body: bytes) -> InBandError | None:
        """The error a 2xx body that is not a stream carries, in the protocol's shape."""
        raise NotImplementedError

    def supports(self, endpoint: Endpoint) -> bool:
        return endpoint in self._urls

    def _count_request(self, upstream_model: str, query: TokenQuery) -> CountRequest | None:
        """The protocol's token counter, if its upstream has one."""
        return None

    def counter(
        self, deployment: str, upstream_model: str, query: TokenQuery, headers: Mapping[str, str]
    ) -> Counter | None:
        """The counter `_count_request` names, asked on the provider's own pool and credentials.

        The session's own timeouts bound connecting and each read; the whole is bounded too, so
        a counter trickling bytes cannot hold the request either."""
        asked = self._count_request(upstream_model, query)
        if asked is None:
            return None
        if not asked.betas:
            headers = {k: v for k, v in headers.items() if k != "anthropic-beta"}
        sent = {**self.body_headers, **headers}
        spec = self._spec
        limit_s = (spec.connect_timeout_ms + spec.read_timeout_ms) / 1000

        async def post() -> int:
            # Translated (and encoded) before anything is sent.
            body = await off_loop(query.size, _encoded, asked.body)
            try:
                async with asyncio.timeout(limit_s):
                    status, answer, reply_headers = await _post(self.session, asked.url, body, sent)
            except TimeoutError:
                raise ProviderTimeoutError(
                    f"the token counter did not answer within {limit_s:g} s",
                    deployment=deployment,
                    kind="timeout",
                ) from None
            except Exception as exc:
                error = translate_client_error(deployment, exc)
                if error is None:
                    raise
                raise error from None
            if status >= 300:
                raise status_error(
                    deployment=deployment,
                    wire=self.wire,
                    status=status,
                    headers=reply_headers,
                    body=answer[:MAX_ERROR_BYTES],
                    scrub=self.scrub,
                )
            try:
                data = orjson.loads(answer)
            except orjson.JSONDecodeError:
                data = None
            return counted(data.get(asked.key) if isinstance(data, dict) else None, deployment)

        return post

    def _target(self, deployment: str, request: UpstreamRequest) -> tuple[str, dict[str, str]]:
        """Where the request goes and with which headers."""
        base = self._stream_headers if request.stream else self.body_headers
        headers = base | request.headers if request.headers else base
        return self._urls[request.endpoint], headers

    async def open(self, deployment: str, request: UpstreamRequest) -> UpstreamStream:
        try:
            url, headers = self._target(deployment, request)
            response = await self.session.post(url, data=request.body, headers=headers)
        except Exception as exc:
            error = self._error(deployment, exc)
            if error is None:
                raise
            raise error from None
        streaming = response.headers.get("content-type", "").startswith("text/event-stream")
        if response.status >= 300 or (request.stream and not streaming):
            try:
                body = await _read_up_to(response, MAX_ERROR_BYTES)
            except (TimeoutError, aiohttp.ClientError, OSError):
                body = b""
            finally:
                response.close()
            if response.status < 300:  # asked for a stream, got a body: an in-band error?
                found = self._inband_error(body)
                if found is not None:
                    raise inband_error(deployment, found)
                raise ProviderError(
                    "upstream answered a streaming request without a stream",
                    deployment=deployment,
                    kind="invalid_response",
                )
            raise status_error(
                deployment=deployment,
                wire=self.wire,
                status=response.status,
                headers=response.headers,
                body=body,
                scrub=self.scrub,
                credential=self.credential,
            )
        reader = _Body(response)
        return ChunkStream(
            deployment=deployment,
            wire=self.wire,
            streaming=request.stream,
            read=reader.read_stream if request.stream else reader.read,
            close=reader.close,
            translate=lambda exc: self._error(deployment, exc),
            scrub=self.scrub,
            status=response.status,
            lazy=request.passthrough,
            responses=request.endpoint == "responses",
            upstream_request_id=response.headers.get("x-request-id")
            or response.headers.get("request-id"),
        )

    def _error(self, deployment: str, exc: BaseException) -> ProviderError | None:
        # Its message names only the exception's type: nothing the upstream wrote.
        return translate_client_error(deployment, exc)


def _encoded(make_body: Callable[[], dict[str, Any]]) -> bytes:
    return orjson.dumps(make_body())


async def _post(
    session: aiohttp.ClientSession, url: str, body: bytes, headers: Mapping[str, str]
) -> tuple[int, bytes, Mapping[str, str]]:
    """POST `body`; the status, at most MAX_COUNT_BYTES of the answer, and its headers."""
    response = await session.post(url, data=body, headers=headers)
    try:
        parts: list[bytes] = []
        size = 0
        while size < MAX_COUNT_BYTES and (data := await response.content.read(65536)):
            parts.append(data)
            size += len(data)
        return response.status, b"".join(parts), response.headers
    finally:
        response.close()

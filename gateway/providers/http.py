"""Adapters for upstreams reached over HTTP: OpenAI-compatible APIs (incl. vLLM) and Anthropic.

The adapter borrows one `httpx.AsyncClient` per provider, owned by the app's lifespan. The client
runs over an aiohttp transport: the upstream client is most of a proxy's per-request CPU cost,
and that transport is several times cheaper than httpx's default one.
"""

from __future__ import annotations

from typing import Final
from urllib.parse import urlsplit

import httpx
from httpx_aiohttp import AiohttpTransport

from gateway.config import ProviderSpec
from gateway.errors import ProviderError, ProviderTimeoutError, scrub
from gateway.models import Endpoint, UpstreamRequest, Wire
from gateway.providers.base import (
    MAX_ERROR_BYTES,
    ChunkStream,
    status_error,
)

_OPENAI_PATHS: Final[dict[Endpoint, str]] = {
    "chat": "/chat/completions",
    "completions": "/completions",
    "embeddings": "/embeddings",
}
_ANTHROPIC_PATHS: Final[dict[Endpoint, str]] = {"messages": "/v1/messages"}

_SYSTEMS: Final[dict[str, str]] = {"openai": "openai", "vllm": "vllm", "anthropic": "anthropic"}


def make_client(spec: ProviderSpec) -> httpx.AsyncClient:
    """The one client of a provider. The caller owns it (aclose)."""
    limits = httpx.Limits(
        max_connections=spec.max_connections,
        max_keepalive_connections=spec.max_keepalive_connections,
    )
    timeout = httpx.Timeout(
        connect=spec.connect_timeout_ms / 1000,
        read=spec.read_timeout_ms / 1000,
        write=spec.read_timeout_ms / 1000,
        pool=spec.connect_timeout_ms / 1000,
    )
    return httpx.AsyncClient(
        transport=AiohttpTransport(limits=limits, trust_env=False),
        timeout=timeout,
        trust_env=False,
        follow_redirects=False,
    )


def translate_transport_error(deployment: str, exc: BaseException) -> ProviderError | None:
    """Map an httpx exception to the gateway's vocabulary; None for anything else."""
    if not isinstance(exc, httpx.TransportError):
        return None
    cause = exc.__cause__
    # The aiohttp transport reports every dropped connection as a ConnectTimeout: look underneath.
    timed_out = isinstance(exc, httpx.TimeoutException) and (
        cause is None or isinstance(cause, TimeoutError)
    )
    name = type(cause).__name__ if cause is not None else type(exc).__name__
    if timed_out:
        return ProviderTimeoutError(
            f"upstream timed out ({name})", deployment=deployment, kind="timeout"
        )
    return ProviderError(
        f"upstream connection failed ({name})", deployment=deployment, kind="connection_error"
    )


class HTTPProvider:
    """An upstream reached over HTTP, speaking the OpenAI or the Anthropic wire format."""

    def __init__(self, name: str, spec: ProviderSpec, client: httpx.AsyncClient) -> None:
        assert spec.base_url is not None  # checked by the config
        self.name = name
        self.wire: Wire = "anthropic" if spec.type == "anthropic" else "openai"
        self.system = _SYSTEMS[spec.type]
        self.address = urlsplit(spec.base_url).hostname
        self._client = client
        self._base = spec.base_url.rstrip("/")
        self._paths = _ANTHROPIC_PATHS if self.wire == "anthropic" else _OPENAI_PATHS
        headers = {"content-type": "application/json"}
        key = spec.api_key.get_secret_value() if spec.api_key else None
        if self.wire == "anthropic":
            headers["anthropic-version"] = spec.anthropic_version
            if key:
                headers["x-api-key"] = key
        elif key:
            headers["authorization"] = f"Bearer {key}"
        for header, value in spec.headers.items():
            headers[header.lower()] = value.get_secret_value()
        self._headers = headers
        self.secrets = tuple(v.get_secret_value() for v in spec.headers.values()) + (
            (key,) if key else ()
        )

    def supports(self, endpoint: Endpoint) -> bool:
        return endpoint in self._paths

    async def open(self, deployment: str, request: UpstreamRequest) -> ChunkStream:
        headers = self._headers | request.headers
        # Streams are forwarded byte for byte, so ask for them uncompressed.
        headers["accept"] = "text/event-stream" if request.stream else "application/json"
        if request.stream:
            headers["accept-encoding"] = "identity"
        outgoing = self._client.build_request(
            "POST",
            self._base + self._paths[request.endpoint],
            content=request.body,
            headers=headers,
        )
        try:
            response = await self._client.send(outgoing, stream=True)
        except httpx.TransportError as exc:
            error = self._error(deployment, exc)
            assert error is not None  # every TransportError translates
            raise error from None
        if response.status_code >= 300:
            try:
                body = await _read_limited(response, MAX_ERROR_BYTES)
            except httpx.TransportError:
                body = b""
            finally:
                await response.aclose()
            raise status_error(
                deployment=deployment,
                wire=self.wire,
                status=response.status_code,
                headers=response.headers,
                body=body,
                secrets=self.secrets,
            )
        streaming = request.stream and "text/event-stream" in response.headers.get(
            "content-type", ""
        )
        source = response.aiter_raw() if streaming else response.aiter_bytes()
        return ChunkStream(
            deployment=deployment,
            wire=self.wire,
            streaming=streaming,
            source=source,
            close=response.aclose,
            translate=lambda exc: self._error(deployment, exc),
            status=response.status_code,
            upstream_request_id=response.headers.get("x-request-id")
            or response.headers.get("request-id"),
        )

    def _error(self, deployment: str, exc: BaseException) -> ProviderError | None:
        error = translate_transport_error(deployment, exc)
        if error is not None and self.secrets:
            error.message = scrub(error.message, self.secrets)
        return error


async def _read_limited(response: httpx.Response, limit: int) -> bytes:
    parts: list[bytes] = []
    size = 0
    async for data in response.aiter_bytes():
        parts.append(data)
        size += len(data)
        if size >= limit:
            break
    return b"".join(parts)[:limit]

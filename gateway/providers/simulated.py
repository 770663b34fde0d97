"""The in-process simulated provider: the simulator's engine behind the provider seam.

It speaks the OpenAI wire format and goes through the same framing and decoding as an HTTP
upstream, so the gateway behaves the same whether the simulator runs in-process or as a server.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from gateway.config import ProviderSpec
from gateway.errors import ProviderError
from gateway.models import Endpoint, UpstreamRequest, Wire
from gateway.providers.base import ChunkStream, status_error, stream_limits
from gateway.scrubbing import Scrubber
from gateway.sim.engine import SimEngine
from gateway.sim.wire import SimConnectionReset
from gateway.upstream import Counter, TokenQuery

_PATHS: Final[dict[Endpoint, str]] = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
}


class SimulatedProvider:
    """Runs requests on an in-process `SimEngine` (no network, no keys)."""

    wire: Wire = "openai"
    system = "simulated"
    address: str | None = None
    scrub = Scrubber.GENERIC
    bulk_priority: int | None = None

    def __init__(self, name: str, spec: ProviderSpec) -> None:
        self.name = name
        self.engine = SimEngine(spec.profiles, spec.default_profile, seed=spec.seed)
        self.limits = stream_limits(spec)

    def supports(self, endpoint: Endpoint) -> bool:
        return endpoint in _PATHS

    def counter(
        self, deployment: str, upstream_model: str, query: TokenQuery, headers: Mapping[str, str]
    ) -> Counter | None:
        """The engine's own tokenizer, the one its usage reports."""
        from gateway.providers.count import simulated_counter

        return simulated_counter(
            self.engine, deployment=deployment, upstream_model=upstream_model, query=query
        )

    async def open(self, deployment: str, request: UpstreamRequest) -> ChunkStream:
        try:
            reply = await self.engine.handle("POST", _PATHS[request.endpoint], request.body)
        except SimConnectionReset:
            raise ProviderError(
                "upstream connection failed (reset before headers)",
                deployment=deployment,
                kind="connection_error",
            ) from None
        if reply.status >= 300:
            raise status_error(
                deployment=deployment,
                wire="openai",
                status=reply.status,
                headers=reply.headers,
                body=reply.body or b"",
                scrub=self.scrub,
            )
        if reply.stream is not None:
            stream = reply.stream

            async def read() -> bytes:
                return await anext(stream, b"")

            close = stream.aclose
        else:
            body = [reply.body or b""]

            async def read() -> bytes:
                return body.pop() if body else b""

            close = _nothing

        def translate(exc: BaseException) -> ProviderError | None:
            if isinstance(exc, SimConnectionReset):
                return ProviderError(
                    "upstream connection failed (reset mid-stream)",
                    deployment=deployment,
                    kind="connection_error",
                )
            return None

        return ChunkStream(
            deployment=deployment,
            wire="openai",
            streaming=reply.stream is not None,
            read=read,
            close=close,
            translate=translate,
            scrub=self.scrub,
            status=reply.status,
            lazy=request.passthrough,
        )


async def _nothing() -> None:
    return None

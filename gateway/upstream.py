"""The provider interface: what every room may know of an upstream, and nothing more.

A leaf: it imports only the ground floor (`models`) and the scrubber, so any room may import it;
the concrete adapters (`gateway.providers.http`, `gateway.providers.simulated`) sit behind it,
built by `gateway.providers.open_providers` and imported by nothing outside `providers/`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.models import Chunk, Endpoint, UpstreamRequest, Wire
from gateway.scrubbing import Scrubber

__all__ = ["Counter", "Provider", "StreamLimits", "TokenQuery", "UpstreamStream"]

Counter = Callable[[], Awaitable[int]]
"""Asks one deployment for a count of input tokens. Raises ProviderError (ProviderRejectedError
when the upstream refused the request itself) or TranslationError."""


class TokenQuery(Protocol):
    """What a client asked to count, in the shapes the counters take (made on first use; each
    raises TranslationError naming what its wire cannot express)."""

    wire: Wire  # the client's: a Messages body (anthropic) or a Responses body (openai)
    size: int  # bytes as sent: a large body is translated off the event loop

    def messages(self) -> dict[str, Any]: ...

    def responses(self) -> dict[str, Any]: ...

    def chat(self) -> dict[str, Any]: ...


@dataclass(frozen=True, slots=True)
class StreamLimits:
    """What a provider's streams may send without content progress (its config's
    `stream_idle_timeout_ms`, `max_precommit_events` and `max_precommit_bytes`)."""

    idle_s: float  # no content token for this long: the stream is given up on
    max_precommit_events: int  # events allowed before the first content token
    max_precommit_bytes: int  # bytes of those events


class UpstreamStream(Protocol):
    """An open upstream response. Whoever opened it must `aclose()` it, on every path."""

    status: int
    streaming: bool  # an SSE stream (else one chunk holding the whole body)
    upstream_request_id: str | None

    async def read(self) -> list[Chunk] | None:
        """The chunks of the next network read (possibly several events); None at the end.

        Raises ProviderError (incl. ProviderTimeoutError) when the upstream fails or is garbled.
        """
        ...

    async def aclose(self) -> None: ...


class Provider(Protocol):
    """One configured upstream (endpoint plus credentials). Borrows its client; owns nothing."""

    name: str
    wire: Wire
    system: str  # gen_ai.provider.name
    address: str | None  # server.address (None for in-process)
    scrub: Scrubber  # its own secrets and the generic patterns: every upstream string passes it
    bulk_priority: int | None  # vLLM request `priority` for bulk requests, if configured
    limits: StreamLimits  # enforced by whoever reads its streams

    def supports(self, endpoint: Endpoint) -> bool: ...

    async def open(self, deployment: str, request: UpstreamRequest) -> UpstreamStream:
        """Send the request and return once the response headers are in (status 2xx).

        Raises a ProviderError subclass for every failure; nothing needs closing then.
        """
        ...

    def counter(
        self, deployment: str, upstream_model: str, query: TokenQuery, headers: Mapping[str, str]
    ) -> Counter | None:
        """The upstream's own token counter for `query` on `deployment` (serving
        `upstream_model`), or None when it has none. `headers` go with the request
        (`x-request-id`, `traceparent`; `anthropic-beta` to Anthropic only)."""
        ...

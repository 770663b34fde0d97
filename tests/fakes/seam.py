"""A provider behind the seam, in process, for the tests where a real server adds nothing (the
planner's policy, the race's accounting): what every such fake shares, with `open` scripted by
each test, as httpx's `MockTransport` scripts a transport."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gateway.models import Chunk, Endpoint, UpstreamRequest, Wire
from gateway.providers.base import NoCounter
from gateway.scrubbing import Scrubber
from gateway.upstream import StreamLimits, UpstreamStream

DEFAULT_LIMITS = StreamLimits(idle_s=60.0, max_precommit_events=1000, max_precommit_bytes=1 << 20)


class FakeProvider(NoCounter):
    """Every member of the `Provider` seam: an OpenAI-wire upstream that serves every endpoint,
    counts no tokens and opens no call until a test scripts `open`."""

    name: str = "fake"
    wire: Wire = "openai"
    system: str = "openai"
    address: str | None = None
    scrub = Scrubber.GENERIC
    bulk_priority: int | None = None
    limits: StreamLimits = DEFAULT_LIMITS

    def supports(self, endpoint: Endpoint) -> bool:
        return True

    async def open(self, deployment: str, request: UpstreamRequest) -> UpstreamStream:
        raise AssertionError(f"{self.name}: this fake opens no call")


class OneTokenStream:
    """An upstream stream of one content event, after `ttft_s` (the upstream's own first-token
    time, not a synchronisation), then `[DONE]`; `on_close` runs at its first `aclose`."""

    status: int = 200
    streaming: bool = True
    upstream_request_id: str | None = None

    def __init__(self, ttft_s: float = 0.0, on_close: Callable[[], None] | None = None) -> None:
        self.ttft_s = ttft_s
        self.on_close = on_close
        self.sent = False
        self.closed = False

    async def read(self) -> list[Chunk] | None:
        if self.sent:
            return [Chunk(raw=b"data: [DONE]\n\n", done=True)]
        if self.ttft_s:
            await asyncio.sleep(self.ttft_s)
        self.sent = True
        return [Chunk(raw=b'data: {"choices":[]}\n\n', content=True)]

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            if self.on_close is not None:
                self.on_close()

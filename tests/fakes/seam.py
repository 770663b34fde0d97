"""A provider behind the seam, in process, for the tests where a real server adds nothing (the
planner's policy, the race's accounting): what every such fake shares, with `open` scripted by
each test, as httpx's `MockTransport` scripts a transport."""

from __future__ import annotations

from gateway.models import Endpoint, UpstreamRequest, Wire
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

"""What the adapters share behind the provider seam (`gateway.upstream`: open an upstream call,
read normalized chunks, close it).

An adapter translates every foreign failure (transport errors, error statuses, error bodies) into
the `ProviderError` family at the edge that sees it; an error status goes through the one table
in `gateway.errors` (`upstream_error`). `ChunkStream` is shared by every adapter: it frames bytes
into SSE events, classifies them with a wire decoder, and owns the upstream until its `aclose()`.

Every string an upstream wrote leaves this seam scrubbed by its provider's `Scrubber`: error
bodies (`status_error`), in-band errors (made by the decoders), the text of a garbled stream, and
the upstream's request id. Content is relayed as it came and never parsed for it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

from gateway.config import ProviderSpec
from gateway.errors import ProviderError, upstream_error
from gateway.models import Chunk, SSEEvent, Wire
from gateway.providers.decode import (
    AnthropicStreamDecoder,
    OpenAIStreamDecoder,
    UpstreamProtocolError,
    anthropic_error,
    decode_anthropic_body,
    decode_openai_body,
    openai_error,
)
from gateway.providers.decode_responses import ResponsesStreamDecoder, decode_responses_body
from gateway.scrubbing import Scrubber
from gateway.sse import SSEFramingError, SSEParser
from gateway.upstream import Counter, StreamLimits, TokenQuery

MAX_RESPONSE_BYTES = 64 * 1024 * 1024
MAX_ERROR_BYTES = 64 * 1024
MAX_CODE_CHARS = 64  # an upstream error code longer than this is cut


async def read_whole(read: Callable[[], Awaitable[bytes | None]], deployment: str) -> bytes:
    """A whole response body, read piece by piece until `read` gives nothing more; more than
    `MAX_RESPONSE_BYTES` fails the attempt rather than the gateway's memory."""
    parts: list[bytes] = []
    size = 0
    while data := await read():
        size += len(data)
        if size > MAX_RESPONSE_BYTES:
            raise ProviderError(
                f"response larger than {MAX_RESPONSE_BYTES} bytes",
                deployment=deployment,
                kind="invalid_response",
            )
        parts.append(data)
    return b"".join(parts)


class NoCounter:
    """An adapter whose upstream's token counter the gateway does not call: a count for its
    deployments comes from the model's other deployments, or the estimate."""

    def counter(
        self, deployment: str, upstream_model: str, query: TokenQuery, headers: Mapping[str, str]
    ) -> Counter | None:
        return None


def stream_limits(spec: ProviderSpec) -> StreamLimits:
    """A provider's stream limits from its config (`stream_idle_timeout_ms`,
    `max_precommit_events`, `max_precommit_bytes`)."""
    return StreamLimits(
        spec.stream_idle_timeout_ms / 1000, spec.max_precommit_events, spec.max_precommit_bytes
    )


class Decoder(Protocol):
    def decode(self, event: SSEEvent) -> Chunk: ...


def stream_decoder(
    wire: Wire, *, scrub: Scrubber, lazy: bool = False, responses: bool = False
) -> Decoder:
    if responses:
        return ResponsesStreamDecoder(scrub=scrub)
    if wire == "anthropic":
        return AnthropicStreamDecoder(scrub=scrub)
    return OpenAIStreamDecoder(scrub=scrub, lazy=lazy)


def decode_body(wire: Wire, body: bytes, *, scrub: Scrubber, responses: bool = False) -> Chunk:
    if responses:
        return decode_responses_body(body, scrub=scrub)
    if wire == "anthropic":
        return decode_anthropic_body(body, scrub=scrub)
    return decode_openai_body(body, scrub=scrub)


ReadBytes = Callable[[], Awaitable[bytes]]
"""Returns the next bytes the upstream sent; b"" at the end."""
TranslateError = Callable[[BaseException], ProviderError | None]


class ChunkStream:
    """Turns upstream bytes into chunks. `aclose()` releases the upstream connection (closing it
    when the response was not read to its end, so the upstream sees the client leave)."""

    __slots__ = (
        "_body_read",
        "_close",
        "_closed",
        "_decoder",
        "_deployment",
        "_parser",
        "_read",
        "_responses",
        "_scrub",
        "_translate",
        "_wire",
        "status",
        "streaming",
        "upstream_request_id",
    )

    def __init__(
        self,
        *,
        deployment: str,
        wire: Wire,
        streaming: bool,
        read: ReadBytes,
        close: Callable[[], Awaitable[None]],
        translate: TranslateError,
        scrub: Scrubber,
        status: int = 200,
        upstream_request_id: str | None = None,
        lazy: bool = False,
        responses: bool = False,  # a native Responses API answer
    ) -> None:
        self._deployment = deployment
        self._wire = wire
        self.streaming = streaming
        self._read = read
        self._close = close
        self._translate = translate
        self._closed = False
        self._body_read = False
        self._parser = SSEParser()
        self._decoder = stream_decoder(wire, scrub=scrub, lazy=lazy, responses=responses)
        self._responses = responses
        self._scrub = scrub
        self.status = status
        # Repeated to the client as a header: whole, or not at all when it holds a secret.
        self.upstream_request_id = scrub.clean_or_none(upstream_request_id)

    async def read(self) -> list[Chunk] | None:
        if not self.streaming:
            return await self._read_body()
        while True:
            data = await self._next_bytes()
            if data is None:
                if self._parser.pending.strip():
                    raise ProviderError(
                        "the stream ended in the middle of an event",
                        deployment=self._deployment,
                        kind="truncated",
                    )
                return None
            try:
                events = self._parser.feed(data)
                if events:
                    decode = self._decoder.decode
                    return [decode(event) for event in events]
            except (SSEFramingError, UpstreamProtocolError) as exc:
                raise ProviderError(
                    f"invalid stream from upstream: {self._scrub.bounded(str(exc), 300)}",
                    deployment=self._deployment,
                    kind="invalid_response",
                ) from None

    async def _read_body(self) -> list[Chunk] | None:
        if self._body_read:
            return None
        self._body_read = True
        body = await read_whole(self._next_bytes, self._deployment)
        try:
            return [decode_body(self._wire, body, scrub=self._scrub, responses=self._responses)]
        except UpstreamProtocolError as exc:
            raise ProviderError(
                f"invalid response from upstream: {self._scrub.bounded(str(exc), 300)}",
                deployment=self._deployment,
                kind="invalid_response",
            ) from None

    async def _next_bytes(self) -> bytes | None:
        try:
            return await self._read() or None
        except Exception as exc:
            error = self._translate(exc)
            if error is None:
                raise
            raise error from None

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._close()


# --- error statuses ------------------------------------------------------------------------------


def status_error(
    *,
    deployment: str,
    wire: Wire,
    status: int,
    headers: Mapping[str, str],
    body: bytes,
    scrub: Scrubber,
    credential: str = "api_key",
) -> ProviderError:
    """Map an upstream error response to the gateway's error vocabulary (`upstream_error`);
    every string taken from it is scrubbed (by the decoders, or here for a snippet)."""
    if wire == "anthropic":
        parsed = anthropic_error(body, scrub=scrub)
    else:
        parsed = openai_error(body, scrub=scrub) or anthropic_error(body, scrub=scrub)
    return upstream_error(
        deployment=deployment,
        status=status,
        detail=parsed.message[:500] if parsed else _snippet(body, scrub),
        headers=headers,
        param=parsed.param if parsed else None,
        upstream_code=parsed.code if parsed else None,
        credential=credential,
    )


def _snippet(body: bytes, scrub: Scrubber) -> str:
    text = body[: 300 + scrub.margin].decode("utf-8", "replace").strip()
    if text.lower().startswith(("<!doctype", "<html")):
        return "an HTML page instead of an API response"
    return scrub.bounded(" ".join(text.split()), 300) or "no error body"

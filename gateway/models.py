"""Hot-path value types shared by every room.

These are plain slotted dataclasses, not pydantic models: one is made per upstream event, so
construction must cost next to nothing. Wire validation happens at the edges (`api`, `config`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Wire = Literal["openai", "anthropic"]
"""A wire format: how a request, response or stream is spelled."""

Endpoint = Literal["chat", "completions", "embeddings", "messages", "responses"]
"""What the client asked for: `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`,
`/v1/messages` (Anthropic), `/v1/responses` (OpenAI's Responses API)."""

MAX_JSON_DEPTH = 128
"""How deeply a request body may nest (the body object is level 1). orjson serialises at most
254 levels; the margin covers translation between wires, which adds a level or two, and stays
below the 200 of parsers built on pydantic-core (vLLM's, among others)."""

ENDPOINT_WIRE: dict[Endpoint, Wire] = {
    "chat": "openai",
    "completions": "openai",
    "embeddings": "openai",
    "messages": "anthropic",
    "responses": "openai",  # its errors are OpenAI's; its stream is its own (see translate.events)
}


@dataclass(slots=True)
class Usage:
    """Token counts as the upstream billed them (None: not reported)."""

    input_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None  # of the input tokens, read from the upstream's prompt cache
    cache_write_tokens: int | None = None  # of the input tokens, written to its prompt cache
    upstream_latency_ms: int | None = None  # the upstream's own timing of it (Bedrock's latencyMs)


@dataclass(frozen=True, slots=True)
class AttemptEnd:
    """How one attempt ended, as its span records it (routing says it, telemetry writes it):
    the outcome (`won`, `won:<error>`, `hedge_lost`, `error:<kind>`, ...), the error if it
    failed, and what the upstream reported (None: not reported)."""

    outcome: str
    error_type: str | None = None
    ttft_s: float | None = None
    usage: Usage | None = None
    output_tokens: int | None = None  # reported, else counted from the streamed text
    finish_reasons: tuple[str, ...] = ()
    response_model: str | None = None


@dataclass(slots=True)
class InBandError:
    """An error the upstream reported inside a 200 response or stream."""

    message: str
    type: str = "server_error"
    code: str | None = None
    status: int | None = None  # an HTTP status the upstream attached, if any
    param: str | None = None  # the request field it names, if any


@dataclass(slots=True)
class SSEEvent:
    """One complete server-sent event, as received.

    `raw` is the exact frame including its terminating blank line, so it can be forwarded untouched.
    `data` is the data lines joined by newlines (no trailing newline). Comment-only frames
    (keep-alives such as `: ping`) have `data == b""` and `event is None`.
    """

    raw: bytes
    data: bytes
    event: str | None = None


@dataclass(slots=True)
class Chunk:
    """One normalized upstream event as the attempt loop sees it.

    `raw` holds the bytes to forward to the client, already in the client's wire format (a
    translator may rewrite or empty it). `content` is true when the event carries generated
    output: text, tool-call name or arguments, reasoning text, or an embedding vector. Role-only
    chunks, empty deltas, keep-alives, `message_start` and `content_block_start` are not content.
    `done` marks the terminal event (`data: [DONE]` or Anthropic `message_stop`), which carries no
    content. For a non-streaming response there is exactly one chunk whose `raw` is the whole body.
    """

    raw: bytes
    data: dict[str, Any] | None = None
    content: bool = False
    tokens: int = 0  # output tokens (or chunks, when the upstream does not say) this event carries
    text: int = 0  # UTF-8 bytes of generated text it carries: output tokens are estimated from it
    finish_reason: str | None = None
    usage: Usage | None = None
    error: InBandError | None = None
    done: bool = False


@dataclass(slots=True)
class UpstreamRequest:
    """What an adapter sends: a body in the provider's own wire format, model already set."""

    endpoint: Endpoint
    body: bytes
    stream: bool
    headers: dict[str, str] = field(default_factory=dict)  # x-request-id, traceparent, ...
    passthrough: bool = False  # events reach the client untouched: decode only what is needed


@dataclass(frozen=True, slots=True)
class Call:
    """One client request, parsed just enough to route it. `body` is the parsed JSON object and
    `raw` its exact bytes (forwarded as-is when nothing needs to change). Never changed once
    parsed: admission makes a new one when a key's cap or the model's priority applies."""

    endpoint: Endpoint
    model: str
    body: dict[str, Any]
    raw: bytes
    stream: bool
    include_usage: bool = False  # the client asked for the final usage chunk
    max_tokens: int | None = None
    n: int = 1  # choices asked for
    priority: str = "interactive"  # interactive | bulk
    lineage: tuple[str, ...] = ()  # Responses: the stored responses it continues, newest first
    history_items: int = 0  # Responses: input items a stored conversation put before its own
    answer_model: str | None = None  # the answer's `model` field; None: as the upstream has it

    @property
    def wire(self) -> Wire:
        return ENDPOINT_WIRE[self.endpoint]

"""Classify a native Responses API answer (an upstream that serves `/v1/responses` itself).

Its stream ends with `response.completed` or `response.incomplete` (there is no `[DONE]`);
content is any text, function-call argument, refusal or reasoning delta, so the commit point is
the first of those; `response.failed` and `error` are in-band errors.
"""

from __future__ import annotations

from typing import Any, Final

from gateway.models import Chunk, InBandError, SSEEvent, Usage
from gateway.numbers import count
from gateway.providers.decode import UpstreamProtocolError, in_band, parse_object, text_bytes
from gateway.scrubbing import Scrubber

_CONTENT: Final = frozenset(
    {
        "response.output_text.delta",
        "response.refusal.delta",
        "response.function_call_arguments.delta",
        "response.reasoning_text.delta",
        "response.reasoning_summary_text.delta",
        "response.custom_tool_call_input.delta",
    }
)
_CONTENT_ITEMS: Final = frozenset({"function_call", "web_search_call", "file_search_call"})
_DONE: Final = frozenset({"response.completed", "response.incomplete"})
_ERRORS: Final = frozenset({"error", "response.failed"})


def _usage(usage: object) -> Usage | None:
    if not isinstance(usage, dict):
        return None
    details = usage.get("input_tokens_details")
    cached = count(details.get("cached_tokens")) if isinstance(details, dict) else None
    return Usage(count(usage.get("input_tokens")), count(usage.get("output_tokens")), cached)


def _error(fields: object, default: str, scrub: Scrubber) -> InBandError:
    fields = fields if isinstance(fields, dict) else {}
    message = fields.get("message")
    code = fields.get("code")
    return in_band(
        scrub,
        message=message if isinstance(message, str) and message else default,
        type="server_error",
        code=code if isinstance(code, str) else None,
    )


class ResponsesStreamDecoder:
    __slots__ = ("_scrub",)

    def __init__(self, *, scrub: Scrubber) -> None:
        self._scrub = scrub

    def decode(self, event: SSEEvent) -> Chunk:
        if not event.data:
            return Chunk(raw=event.raw)  # a keep-alive comment
        data = parse_object(event.data, "stream event")
        # An `error` or `response.failed` event is one whatever type its data claims: else it
        # would be relayed byte for byte, with whatever text the upstream put in it.
        named = event.event
        kind = named if named in _ERRORS else data.get("type") or named
        if kind in _CONTENT:
            delta = data.get("delta")
            return Chunk(
                raw=event.raw, data=data, content=bool(delta), tokens=1, text=text_bytes(delta)
            )
        if kind == "response.output_item.added":
            item = data.get("item")
            # A built-in tool call may have no argument deltas: its item is the content.
            content = isinstance(item, dict) and item.get("type") in _CONTENT_ITEMS
            return Chunk(raw=event.raw, data=data, content=content)
        if kind in _DONE:
            response = data.get("response")
            if isinstance(response, dict) and isinstance(response.get("error"), dict):
                # A finished Response names no error: one that does failed, and its text
                # would otherwise be relayed and stored as it came.
                failed = _error(response["error"], "the response failed", self._scrub)
                return Chunk(raw=event.raw, data=data, error=failed)
            usage = _usage(response.get("usage")) if isinstance(response, dict) else None
            reason = "stop" if kind == "response.completed" else "length"
            return Chunk(raw=event.raw, data=data, usage=usage, finish_reason=reason, done=True)
        if kind == "response.failed":
            response = data.get("response")
            error = response.get("error") if isinstance(response, dict) else None
            return Chunk(
                raw=event.raw, data=data, error=_error(error, "the response failed", self._scrub)
            )
        if kind == "error":
            return Chunk(
                raw=event.raw, data=data, error=_error(data, "upstream error", self._scrub)
            )
        return Chunk(raw=event.raw, data=data)


def _output_bytes(output: list[Any]) -> int:
    """The bytes of a Response's generated text: messages' text and refusals, function calls'
    arguments, reasoning summaries (read only when it reports no usage)."""
    size = 0
    for item in output:
        if not isinstance(item, dict):
            continue
        size += text_bytes(item.get("arguments")) + text_bytes(item.get("input"))
        for part in item.get("content") or item.get("summary") or ():
            if isinstance(part, dict):
                size += text_bytes(part.get("text")) + text_bytes(part.get("refusal"))
    return size


def decode_responses_body(body: bytes, *, scrub: Scrubber) -> Chunk:
    """A non-streaming Response object (or an error body)."""
    obj: dict[str, Any] = parse_object(body, "response body")
    error = obj.get("error")
    if isinstance(error, dict) and obj.get("object") != "response":
        return Chunk(raw=body, data=obj, error=_error(error, "upstream error", scrub))
    if obj.get("object") != "response":
        raise UpstreamProtocolError("the response body is not a Response object")
    if obj.get("status") == "failed" or isinstance(error, dict):
        return Chunk(raw=body, data=obj, error=_error(error, "the response failed", scrub))
    output = obj.get("output")
    usage = _usage(obj.get("usage"))
    known = usage.output_tokens if usage is not None else None
    content = isinstance(output, list) and len(output) > 0
    return Chunk(
        raw=body,
        data=obj,
        content=content,
        tokens=known if known is not None else int(content),
        text=_output_bytes(output) if isinstance(output, list) and known is None else 0,
        finish_reason="stop" if obj.get("status") == "completed" else "length",
        usage=usage,
    )

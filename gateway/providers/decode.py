"""Classify upstream responses: one `Chunk` per stream event or non-streaming body.

This is the hot path of every stream, so each event is parsed once with orjson and then only
inspected: the `Chunk` carries the parsed dict along, and translators reuse it instead of parsing
again. Anything that is not a valid response in the upstream's wire format raises
`UpstreamProtocolError`; errors the upstream reports in a well-formed body become `InBandError`.

Every decoder takes its provider's `Scrubber`, and every `InBandError` is made by `in_band`,
which passes each of its strings through it: an upstream's error text is scrubbed once, here,
before any path (the client's error, a log line, a span, the access log) can see it.
"""

from __future__ import annotations

import re
from typing import Any, Final

import orjson

from gateway.models import Chunk, InBandError, SSEEvent, Usage
from gateway.numbers import MAX_TOKENS, count
from gateway.scrubbing import MARGIN_CHARS, Scrubber

_DONE: Final = b"[DONE]"
_SNIPPET_BYTES: Final = 200

# Anthropic error types and the HTTP status that comes with each (Anthropic's errors page).
ANTHROPIC_ERROR_STATUS: Final[dict[str, int]] = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "billing_error": 402,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "api_error": 500,
    "timeout_error": 504,
    "overloaded_error": 529,
}


class UpstreamProtocolError(ValueError):
    """The upstream sent bytes that are not a valid response in its wire format (non-JSON data,
    HTML, ...)."""


def _snippet(data: bytes) -> str:
    """The start of `data` for a message; the reader scrubs and cuts it (`Scrubber.bounded`),
    so it keeps a margin past the snippet's length: a secret across the cut is masked whole."""
    text = data[: _SNIPPET_BYTES + MARGIN_CHARS].decode("utf-8", "replace")
    return text + "..." if len(data) > _SNIPPET_BYTES + MARGIN_CHARS else text


def parse_object(data: bytes, what: str) -> dict[str, Any]:
    try:
        parsed = orjson.loads(data)
    except orjson.JSONDecodeError:
        try:
            data.decode()
        except UnicodeDecodeError:  # the same refusal as for a stream's events (gateway/sse.py)
            raise UpstreamProtocolError(f"{what} is not valid UTF-8: {_snippet(data)!r}") from None
        raise UpstreamProtocolError(f"{what} is not JSON: {_snippet(data)!r}") from None
    if not isinstance(parsed, dict):
        raise UpstreamProtocolError(f"{what} is not a JSON object: {_snippet(data)!r}")
    return parsed


MAX_PARAM_CHARS = 128  # an upstream's `param`, `type` or `code` longer than this is cut
MAX_MESSAGE_CHARS = 1000  # an upstream's error message longer than this is cut


def _int(value: object) -> int | None:
    return value if type(value) is int else None  # bool is not a token count


def _str(value: object) -> str | None:
    if value is None:
        return None
    return value if isinstance(value, str) else str(value)


# --- OpenAI-compatible ---------------------------------------------------------------------------


def openai_cache_tokens(usage: object) -> tuple[int | None, int | None]:
    """The prompt tokens an OpenAI-compatible server read from its cache
    (`prompt_tokens_details.cached_tokens`) and wrote to it (`..cache_write_tokens`), both part
    of `prompt_tokens` (None: not reported; most servers report reads only)."""
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    if not isinstance(details, dict):
        return None, None
    return count(details.get("cached_tokens")), count(details.get("cache_write_tokens"))


def _openai_usage(usage: object) -> Usage:
    if not isinstance(usage, dict):
        return Usage()  # not an object: no counts, the answer itself stands
    cached, written = openai_cache_tokens(usage)
    return Usage(
        count(usage.get("prompt_tokens")), count(usage.get("completion_tokens")), cached, written
    )


def in_band(
    scrub: Scrubber,
    message: str,
    type: str = "server_error",
    code: str | None = None,
    status: int | None = None,
    param: str | None = None,
) -> InBandError:
    """The one way an upstream's error becomes an `InBandError`: every string scrubbed, and
    bounded (an error event may be megabytes long; the client is shown a few hundred chars)."""
    return InBandError(
        message=scrub.bounded(message, MAX_MESSAGE_CHARS),
        type=scrub.bounded(type, MAX_PARAM_CHARS),
        code=scrub.optional(code, MAX_PARAM_CHARS),
        status=status,
        param=scrub.optional(param, MAX_PARAM_CHARS),
    )


def _error_from_fields(
    fields: dict[str, Any], default_message: str, scrub: Scrubber
) -> InBandError:
    """OpenAI `{"message", "type", "code"}`, vLLM's int `code` (the HTTP status) included."""
    code = fields.get("code")
    status = _int(fields.get("status"))
    if _int(code) is not None:
        # vLLM puts the HTTP status in `code`; it is not an OpenAI error code.
        status = status or code
        code = None
    message = fields.get("message")
    param = fields.get("param")
    return in_band(
        scrub,
        message=_str(message) or default_message,
        type=_str(fields.get("type")) or "server_error",
        code=_str(code),
        status=status,
        param=param if isinstance(param, str) and param else None,
    )


def _openai_error_object(obj: dict[str, Any], scrub: Scrubber) -> InBandError | None:
    """Error shapes that may also arrive with a 200: `{"error": ...}` and old vLLM's flat one."""
    error = obj.get("error")
    if error is not None:
        if isinstance(error, dict):
            return _error_from_fields(error, "upstream error", scrub)
        # Some servers (TGI, llama.cpp, vLLM's auth check) send `{"error": "text"}`.
        return in_band(
            scrub,
            message=_str(error) or "upstream error",
            type=_str(obj.get("error_type")) or "server_error",
            status=_int(obj.get("status")),
        )
    if obj.get("object") == "error":
        return _error_from_fields(obj, "upstream error", scrub)
    return None


def text_bytes(value: object) -> int:
    """The UTF-8 length of a string field (0 for anything else): output tokens are estimated
    from it when the upstream reports none."""
    if not isinstance(value, str):
        return 0
    return len(value) if value.isascii() else len(value.encode("utf-8", "replace"))


_TEXT_FIELDS: Final = ("content", "reasoning_content", "reasoning", "refusal")


def _function_bytes(function: Any) -> int:
    """A tool call's name and arguments; -1 when it carries neither."""
    if not function:
        return -1
    name, arguments = function.get("name"), function.get("arguments")
    return text_bytes(name) + text_bytes(arguments) if name or arguments else -1


def _delta_output(delta: dict[str, Any]) -> tuple[bool, int]:
    """Whether a delta carries generated output, and the bytes of its text."""
    found = False
    size = 0
    for key in _TEXT_FIELDS:
        value = delta.get(key)
        if value:
            found = True
            size += text_bytes(value)
    tool_calls = delta.get("tool_calls")
    if tool_calls:
        for call in tool_calls:
            called = _function_bytes(call.get("function"))
            if called >= 0:
                found = True
                size += called
    called = _function_bytes(delta.get("function_call"))  # the deprecated single-function form
    if called >= 0:
        found = True
        size += called
    audio = delta.get("audio")
    if audio and (audio.get("data") or audio.get("transcript")):
        found = True
        size += text_bytes(audio.get("transcript"))
    return found, size


def _message_has_content(message: dict[str, Any]) -> bool:
    return bool(
        message.get("content")
        or message.get("tool_calls")
        or message.get("function_call")
        or message.get("refusal")
        or message.get("reasoning_content")
        or message.get("reasoning")
        or message.get("audio")
    )


def _message_bytes(message: dict[str, Any]) -> int:
    """The bytes of a whole message's text (read only when the body reports no usage)."""
    size = sum(text_bytes(message.get(key)) for key in _TEXT_FIELDS)
    for call in message.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, dict) else None
        size += max(0, _function_bytes(function)) if isinstance(function, dict) else 0
    function = message.get("function_call")
    size += max(0, _function_bytes(function)) if isinstance(function, dict) else 0
    audio = message.get("audio")
    return size + (text_bytes(audio.get("transcript")) if isinstance(audio, dict) else 0)


class OpenAIStreamDecoder:
    """Classify the SSE events of an OpenAI-compatible chat or completions stream (incl. vLLM).

    With `lazy`, for a stream forwarded to an OpenAI client byte for byte, the common event (one
    choice whose delta carries some text and nothing else of interest) is recognised from its
    bytes without being parsed, and comes with `data=None`; every other event is parsed.
    """

    __slots__ = ("_lazy", "_scrub")

    def __init__(self, *, scrub: Scrubber, lazy: bool = False) -> None:
        self._lazy = lazy
        self._scrub = scrub

    def decode(self, event: SSEEvent) -> Chunk:
        """One chunk per event; raises UpstreamProtocolError for data that is not a JSON object."""
        data = event.data
        if not data:
            return Chunk(raw=event.raw)  # a keep-alive comment or an empty event
        if data == _DONE:
            return Chunk(raw=event.raw, done=True)
        if self._lazy and event.event is None:
            size = _plain_content(data)
            if size:
                return Chunk(raw=event.raw, content=True, tokens=1, text=size)
        obj = parse_object(data, "stream event")
        try:
            return _openai_stream_chunk(event, obj, self._scrub)
        except (AttributeError, KeyError, TypeError):
            raise UpstreamProtocolError(f"malformed stream event: {_snippet(data)!r}") from None


_CONTENT = b'"content":"'
# Anything that needs the parsed event: errors, usage, a finish, tool calls, reasoning, refusals,
# completions text or legacy function calls (one regex search, instead of a scan per marker).
_NEEDS_PARSING = re.compile(
    rb'"(?:error"|usage":\{|finish_reason":"|tool_calls"|reasoning|refusal":"|text":|function_call")'
)


def _plain_content(data: bytes) -> int:
    """The bytes of an event's text (as escaped in JSON, a fair measure for an estimate) when it
    is, by its bytes, one choice with non-empty text content and nothing else; else 0.

    Conservative: a marker inside a string cannot match, since JSON escapes quotes in strings.
    """
    start = data.find(_CONTENT) + len(_CONTENT)
    if start < len(_CONTENT) or data[start : start + 1] == b'"':
        return 0  # no content, or an empty string
    if data.count(b'"delta":') != 1 or data[:1] != b"{" or data[-1:] != b"}":
        return 0
    if data.count(b"{") != data.count(b"}") or data.count(b"[") != data.count(b"]"):
        return 0  # maybe a cut-off object: parsed, so that it is refused rather than relayed
    if _NEEDS_PARSING.search(data) is not None:
        return 0
    end = data.find(b'"', start)
    while end > 0:
        escapes = 0  # backslashes before the quote: an odd number escapes it
        while data[end - 1 - escapes] == 0x5C:
            escapes += 1
        if escapes % 2 == 0:
            break
        end = data.find(b'"', end + 1)
    return end - start if end > 0 else 0


def _openai_stream_chunk(event: SSEEvent, obj: dict[str, Any], scrub: Scrubber) -> Chunk:
    error = _openai_error_object(obj, scrub)
    if error is None and event.event == "error":  # openai-python treats this event as an error
        error = _error_from_fields(obj, "upstream error", scrub)
    if error is not None:
        return Chunk(raw=event.raw, data=obj, error=error)
    tokens = size = 0
    finish_reason = None
    choices = obj.get("choices")
    if choices:
        for choice in choices:
            delta = choice.get("delta")
            if delta is not None:
                found, text = _delta_output(delta)
                tokens, size = tokens + found, size + text
            elif choice.get("text"):  # a completions chunk
                tokens, size = tokens + 1, size + text_bytes(choice["text"])
            if finish_reason is None:
                finish_reason = choice.get("finish_reason")
    usage = obj.get("usage")
    return Chunk(
        raw=event.raw,
        data=obj,
        content=tokens > 0,
        tokens=tokens,
        text=size,
        finish_reason=finish_reason,
        usage=_openai_usage(usage) if usage else None,
    )


def decode_openai_body(body: bytes, *, scrub: Scrubber) -> Chunk:
    """Classify a non-streaming chat, completions or embeddings response.

    Raises UpstreamProtocolError for a body that is not JSON (an HTML page from a load balancer)
    or not one of those responses.
    """
    obj = parse_object(body, "response body")
    try:
        error = _openai_error_object(obj, scrub)
        if error is not None:
            return Chunk(raw=body, data=obj, error=error)
        usage_fields = obj.get("usage")
        usage = _openai_usage(usage_fields) if usage_fields else None
        choices = obj.get("choices")
        if isinstance(choices, list):
            known = usage.output_tokens if usage is not None else None
            with_content = size = 0
            finish_reason = None
            for choice in choices:
                message = choice.get("message")
                if message is not None:
                    if _message_has_content(message):
                        with_content += 1
                        if known is None:  # no count: the text is measured for an estimate
                            size += _message_bytes(message)
                elif choice.get("text"):
                    with_content += 1
                    size += text_bytes(choice["text"])
                if finish_reason is None:
                    finish_reason = choice.get("finish_reason")
            return Chunk(
                raw=body,
                data=obj,
                content=with_content > 0,
                tokens=known if known is not None else with_content,
                text=size,
                finish_reason=finish_reason,
                usage=usage,
            )
        data = obj.get("data")
        if isinstance(data, list):  # embeddings: {"object": "list", "data": [...]}
            return Chunk(raw=body, data=obj, content=bool(data), usage=usage)
    except (AttributeError, KeyError, TypeError):
        pass
    raise UpstreamProtocolError(f"not an OpenAI response: {_snippet(body)!r}")


def openai_error(body: bytes, *, scrub: Scrubber) -> InBandError | None:
    """Parse an error body in any shape an OpenAI-compatible server sends; None if it is not one.

    Shapes: OpenAI `{"error": {...}}`, new vLLM (same, with the HTTP status as int `code`), old
    vLLM `{"object": "error", ...}`, `{"error": "text"}`, FastAPI `{"detail": ...}` and a bare
    `{"message": ...}`. Never raises.
    """
    try:
        obj = orjson.loads(body)
        if not isinstance(obj, dict):
            return None
        error = _openai_error_object(obj, scrub)
        if error is not None:
            return error
        detail = obj.get("detail")
        if isinstance(detail, str):
            return in_band(scrub, message=detail, type="invalid_request_error")
        if isinstance(detail, list) and detail:  # FastAPI validation errors
            first = detail[0]
            text = first.get("msg") if isinstance(first, dict) else None
            return in_band(scrub, message=_str(text) or str(detail), type="invalid_request_error")
        message = obj.get("message")
        if isinstance(message, str) and "choices" not in obj:
            return _error_from_fields(obj, message, scrub)
    except (ValueError, AttributeError, LookupError, TypeError):  # JSONDecodeError included
        return None
    return None


# --- Anthropic -----------------------------------------------------------------------------------


def _anthropic_error_fields(error: dict[str, Any], scrub: Scrubber) -> InBandError:
    kind = _str(error.get("type")) or "api_error"
    return in_band(
        scrub,
        message=_str(error.get("message")) or kind,
        type=kind,
        status=ANTHROPIC_ERROR_STATUS.get(kind),
    )


def anthropic_cached_tokens(usage: object) -> int | None:
    """The prompt tokens Anthropic read from its cache (`cache_read_input_tokens`)."""
    return count(usage.get("cache_read_input_tokens")) if isinstance(usage, dict) else None


def anthropic_cache_write_tokens(usage: object) -> int | None:
    """The prompt tokens Anthropic wrote to its cache (`cache_creation_input_tokens`)."""
    return count(usage.get("cache_creation_input_tokens")) if isinstance(usage, dict) else None


def anthropic_input_tokens(usage: object) -> int | None:
    """All prompt tokens: Anthropic counts cache reads and writes apart from `input_tokens`."""
    if not isinstance(usage, dict):
        return None
    fresh = count(usage.get("input_tokens"))
    if fresh is None:
        return None
    cached = count(usage.get("cache_read_input_tokens")) or 0
    return min(fresh + cached + (count(usage.get("cache_creation_input_tokens")) or 0), MAX_TOKENS)


class AnthropicStreamDecoder:
    """Classify Anthropic Messages stream events; remembers input tokens from message_start.

    `finish_reason` is Anthropic's own `stop_reason`, and usage input tokens include cache reads
    and writes (what `prompt_tokens` means on the OpenAI wire).
    """

    __slots__ = ("_cache_write_tokens", "_cached_tokens", "_input_tokens", "_scrub")

    def __init__(self, *, scrub: Scrubber) -> None:
        self._scrub = scrub
        self._input_tokens: int | None = None
        self._cached_tokens: int | None = None
        self._cache_write_tokens: int | None = None

    def decode(self, event: SSEEvent) -> Chunk:
        """One chunk per event; raises UpstreamProtocolError for data that is not a JSON object."""
        data = event.data
        if not data or event.event == "ping":
            return Chunk(raw=event.raw)
        obj = parse_object(data, "stream event")
        if event.event == "error":  # an error event, whatever type its data claims
            error = obj.get("error")
            fields = error if isinstance(error, dict) else obj
            return Chunk(
                raw=event.raw, data=obj, error=_anthropic_error_fields(fields, self._scrub)
            )
        try:
            return self._classify(event.raw, obj)
        except (AttributeError, KeyError, TypeError):
            raise UpstreamProtocolError(f"malformed stream event: {_snippet(data)!r}") from None

    def _classify(self, raw: bytes, obj: dict[str, Any]) -> Chunk:
        kind = obj.get("type")
        if kind == "content_block_delta":
            delta = obj["delta"]
            delta_type = delta.get("type")
            if delta_type == "text_delta":
                text = delta.get("text")
            elif delta_type == "input_json_delta":
                text = delta.get("partial_json")
            elif delta_type == "thinking_delta":
                text = delta.get("thinking")
            else:  # signature_delta, citations_delta
                text = None
            content = bool(text)
            return Chunk(
                raw=raw, data=obj, content=content, tokens=int(content), text=text_bytes(text)
            )
        if kind == "message_start":
            usage = obj["message"].get("usage")
            if usage:
                self._remember(usage)
            return Chunk(raw=raw, data=obj)
        if kind == "message_delta":
            usage = obj.get("usage")
            usage = usage if isinstance(usage, dict) else {}
            # Newer API versions repeat cumulative input counts here; they win when present.
            if anthropic_input_tokens(usage) is not None:
                self._remember(usage)
            return Chunk(
                raw=raw,
                data=obj,
                finish_reason=obj["delta"].get("stop_reason"),
                usage=Usage(
                    self._input_tokens,
                    count(usage.get("output_tokens")),
                    self._cached_tokens,
                    self._cache_write_tokens,
                ),
            )
        if kind == "message_stop":
            return Chunk(raw=raw, data=obj, done=True)
        if kind == "error":
            error = obj.get("error")
            fields = error if isinstance(error, dict) else {"message": _str(error)}
            return Chunk(raw=raw, data=obj, error=_anthropic_error_fields(fields, self._scrub))
        return Chunk(raw=raw, data=obj)  # content_block_start/stop, ping, unknown future events

    def _remember(self, usage: dict[str, Any]) -> None:
        self._input_tokens = anthropic_input_tokens(usage)
        self._cached_tokens = anthropic_cached_tokens(usage)
        self._cache_write_tokens = anthropic_cache_write_tokens(usage)


def decode_anthropic_body(body: bytes, *, scrub: Scrubber) -> Chunk:
    """Classify a non-streaming Messages response.

    Raises UpstreamProtocolError for a body that is not JSON or not a message or error object.
    """
    obj = parse_object(body, "response body")
    try:
        kind = obj.get("type")
        if kind == "error":
            error = obj.get("error")
            fields = error if isinstance(error, dict) else {"message": _str(error)}
            return Chunk(raw=body, data=obj, error=_anthropic_error_fields(fields, scrub))
        if kind == "message":
            with_content = size = 0
            for block in obj.get("content") or ():
                block_type = block.get("type")
                if block_type == "text":
                    with_content += bool(block.get("text"))
                    size += text_bytes(block.get("text"))
                elif block_type == "thinking":
                    with_content += bool(block.get("thinking"))
                    size += text_bytes(block.get("thinking"))
                else:  # tool_use, server tools' blocks, redacted_thinking: all generated output
                    with_content += 1
            usage_fields = obj.get("usage")
            usage = None
            if isinstance(usage_fields, dict) and usage_fields:
                usage = Usage(
                    anthropic_input_tokens(usage_fields),
                    count(usage_fields.get("output_tokens")),
                    anthropic_cached_tokens(usage_fields),
                    anthropic_cache_write_tokens(usage_fields),
                )
            known = usage.output_tokens if usage is not None else None
            return Chunk(
                raw=body,
                data=obj,
                content=with_content > 0,
                tokens=known if known is not None else with_content,
                text=size,
                finish_reason=obj.get("stop_reason"),
                usage=usage,
            )
    except (AttributeError, KeyError, TypeError):
        pass
    raise UpstreamProtocolError(f"not an Anthropic response: {_snippet(body)!r}")


def anthropic_error(body: bytes, *, scrub: Scrubber) -> InBandError | None:
    """Parse `{"type": "error", "error": {"type", "message"}}`; None if not one. Never raises."""
    try:
        obj = orjson.loads(body)
        if not isinstance(obj, dict):
            return None
        error = obj.get("error")
        if isinstance(error, dict) and (obj.get("type") == "error" or "type" in error):
            return _anthropic_error_fields(error, scrub)
    except (ValueError, AttributeError, LookupError, TypeError):  # JSONDecodeError included
        return None
    return None

"""Stream translation: one stateful translator per response, fed every decoded `Chunk`.

The attempt loop forwards the bytes each `feed` returns. The translators reuse `Chunk.data`
(parsed once by the decoder) and splice pre-built constant bytes around each delta, so the
per-event cost is one small `orjson.dumps`. In-band upstream errors become each wire's own
error event.
"""

from __future__ import annotations

import time
from typing import Any, Final, Protocol

import orjson

from gateway.models import Chunk, InBandError
from gateway.numbers import count
from gateway.providers.decode import ANTHROPIC_ERROR_STATUS, openai_cache_tokens
from gateway.providers.translate.responses import (
    TOOL_CALLER,
    _anthropic_id,
    _anthropic_usage,
    _openai_id,
    _openai_usage,
    _thinking_tokens,
    _tool_id,
    anthropic_stop_reason,
    openai_finish_reason,
)
from gateway.sse import frame


class StreamTranslator(Protocol):
    """Rewrites one response's stream into the client's wire format, one chunk at a time."""

    def feed(self, chunk: Chunk) -> bytes:
        """The bytes to send the client for this chunk; b"" when there is nothing to send."""
        ...


_ANTHROPIC_ERROR_TYPES: Final[dict[int, str]] = {
    status: kind for kind, status in ANTHROPIC_ERROR_STATUS.items()
} | {408: "timeout_error", 422: "invalid_request_error", 503: "overloaded_error"}
_DONE_FRAME: Final = b"data: [DONE]\n\n"


def _is_comment(raw: bytes) -> bool:
    return raw.startswith(b":")  # keep-alives are valid SSE on both wires: forward them


def openai_error_frame(error: InBandError) -> bytes:
    """An in-band upstream error as the OpenAI stream error event openai-python raises on."""
    return frame(
        orjson.dumps(
            {
                "error": {
                    "message": error.message,
                    "type": error.type,
                    "param": None,
                    "code": error.code,
                }
            }
        )
    )


def anthropic_error_frame(error: InBandError) -> bytes:
    """An in-band upstream error as an Anthropic `event: error`."""
    kind = error.type
    if kind not in ANTHROPIC_ERROR_STATUS:
        kind = _ANTHROPIC_ERROR_TYPES.get(error.status or 500, "api_error")
    body = {"type": "error", "error": {"type": kind, "message": error.message}}
    return frame(orjson.dumps(body), event="error")


class OpenAIPassthrough:
    """OpenAI upstream to OpenAI client: forwards every event untouched, except the usage-only
    chunk when the client did not ask for `stream_options.include_usage` (the gateway always asks
    upstream, for its own accounting)."""

    __slots__ = ("_include_usage",)

    def __init__(self, *, include_usage: bool) -> None:
        self._include_usage = include_usage

    def feed(self, chunk: Chunk) -> bytes:
        if (
            chunk.usage is not None
            and not self._include_usage
            and chunk.data is not None
            and not chunk.data.get("choices")
        ):
            return b""
        return chunk.raw


class AnthropicToOpenAIStream:
    """Anthropic Messages stream events → `chat.completion.chunk` SSE frames.

    Every chunk shares one id, `created` and `model`; with `include_usage` the others carry
    `"usage": null` and a usage chunk precedes `[DONE]`. An in-band error becomes OpenAI's error
    event (the attempt loop may send its own instead).
    """

    __slots__ = (
        "_cache_write_tokens",
        "_cached_tokens",
        "_created",
        "_head",
        "_id",
        "_include_usage",
        "_input_tokens",
        "_model",
        "_output_tokens",
        "_tail",
        "_tools",
        "_usage_null",
    )

    def __init__(self, *, model: str, include_usage: bool) -> None:
        self._model = model
        self._include_usage = include_usage
        self._created = int(time.time())
        self._usage_null = b',"usage":null' if include_usage else b""
        self._tail = b',"logprobs":null,"finish_reason":null}]' + self._usage_null + b"}\n\n"
        self._id = ""
        self._head = b""  # `data: {..."choices":[{"index":0,"delta":`, set at message_start
        self._tools: dict[int, int] = {}  # Anthropic block index → OpenAI tool_calls index
        self._input_tokens = 0
        self._cached_tokens = 0
        self._cache_write_tokens = 0
        self._output_tokens = 0

    def _start(self, message_id: object) -> None:
        self._id = _openai_id(message_id)
        common = orjson.dumps(
            {
                "id": self._id,
                "object": "chat.completion.chunk",
                "created": self._created,
                "model": self._model,
            }
        )
        self._head = b"data: " + common[:-1] + b',"choices":[{"index":0,"delta":'

    def _chunk(self, delta: bytes) -> bytes:
        if not self._head:
            self._start(None)
        return self._head + delta + self._tail

    def _count(self, usage: object) -> None:
        # message_start and message_delta both carry counts; later ones are cumulative totals.
        # A count that is not one (negative, a string, ...) is ignored.
        if not isinstance(usage, dict):
            return
        if (tokens := count(usage.get("input_tokens"))) is not None:
            self._input_tokens = tokens
        if (tokens := count(usage.get("cache_read_input_tokens"))) is not None:
            self._cached_tokens = tokens
        if (tokens := count(usage.get("cache_creation_input_tokens"))) is not None:
            self._cache_write_tokens = tokens
        if (tokens := count(usage.get("output_tokens"))) is not None:
            self._output_tokens = tokens

    def feed(self, chunk: Chunk) -> bytes:
        if chunk.error is not None:
            return openai_error_frame(chunk.error)
        data = chunk.data
        if data is None:
            return chunk.raw if _is_comment(chunk.raw) else b""
        kind = data.get("type")
        if kind == "content_block_delta":
            delta = data["delta"]
            delta_type = delta.get("type")
            if delta_type == "text_delta":
                text = delta.get("text")
                return self._chunk(b'{"content":' + orjson.dumps(text) + b"}") if text else b""
            if delta_type == "thinking_delta":
                text = delta.get("thinking")
                if not text:
                    return b""
                return self._chunk(b'{"reasoning_content":' + orjson.dumps(text) + b"}")
            if delta_type == "input_json_delta":
                tool = self._tools.get(data.get("index", -1))
                arguments = delta.get("partial_json")
                if tool is None or not arguments:
                    return b""
                return self._chunk(
                    b'{"tool_calls":[{"index":%d,"function":{"arguments":%b}}]}'
                    % (tool, orjson.dumps(arguments))
                )
            return b""  # signature_delta, citations_delta
        if kind == "content_block_start":
            block = data.get("content_block") or {}
            block_type = block.get("type")
            if block_type == "tool_use":
                tool = self._tools[data.get("index", -1)] = len(self._tools)
                call = {
                    "index": tool,
                    "id": block.get("id"),
                    "type": "function",
                    "function": {"name": block.get("name"), "arguments": ""},
                }
                return self._chunk(orjson.dumps({"tool_calls": [call]}))
            if block_type == "text" and block.get("text"):
                return self._chunk(b'{"content":' + orjson.dumps(block["text"]) + b"}")
            return b""
        if kind == "message_start":
            message = data.get("message") or {}
            self._start(message.get("id"))
            self._count(message.get("usage"))
            return self._chunk(b'{"role":"assistant","content":""}')
        if kind == "message_delta":
            self._count(data.get("usage"))
            finish = openai_finish_reason((data.get("delta") or {}).get("stop_reason"))
            if not self._head:
                self._start(None)
            return (
                self._head
                + b'{},"logprobs":null,"finish_reason":"'
                + finish.encode()
                + b'"}]'
                + self._usage_null
                + b"}\n\n"
            )
        if kind == "message_stop":
            if not self._include_usage:
                return _DONE_FRAME
            usage = _openai_usage(
                {
                    "input_tokens": self._input_tokens,
                    "cache_read_input_tokens": self._cached_tokens,
                    "cache_creation_input_tokens": self._cache_write_tokens,
                    "output_tokens": self._output_tokens,
                }
            )
            if not self._head:
                self._start(None)
            body = {
                "id": self._id,
                "object": "chat.completion.chunk",
                "created": self._created,
                "model": self._model,
                "choices": [],
                "usage": usage,
            }
            return frame(orjson.dumps(body)) + _DONE_FRAME
        return b""  # ping, content_block_stop, events added to the API later


_MESSAGE_STOP: Final = frame(b'{"type":"message_stop"}', event="message_stop")
_BLOCK_START: Final = b'event: content_block_start\ndata: {"type":"content_block_start","index":'
_BLOCK_STOP: Final = b'event: content_block_stop\ndata: {"type":"content_block_stop","index":'
_BLOCK_DELTA: Final = b'event: content_block_delta\ndata: {"type":"content_block_delta","index":'
_TEXT_DELTA: Final = b'{"type":"text_delta","text":'
_THINKING_DELTA: Final = b'{"type":"thinking_delta","thinking":'
_JSON_DELTA: Final = b'{"type":"input_json_delta","partial_json":'
_EMPTY_BLOCKS: Final[dict[str, bytes]] = {
    "text": b'{"type":"text","text":"","citations":null}',
    "thinking": b'{"type":"thinking","thinking":"","signature":""}',
}


class OpenAIToAnthropicStream:
    """`chat.completion.chunk` frames → Anthropic Messages stream events.

    Text, reasoning and each tool call get their own content block, opened when their first delta
    arrives; `[DONE]` closes the open block and sends `message_delta` (stop reason and usage,
    remembered from the upstream's finish and usage chunks) and `message_stop`. The upstream must
    be asked for `stream_options.include_usage`, or output tokens are reported as 0. Every event
    carries the fields Anthropic's schema requires, null where chat has no counterpart.
    """

    __slots__ = (
        "_cache_write_tokens",
        "_cached_tokens",
        "_delta_head",
        "_finish_reason",
        "_finished",
        "_input_tokens",
        "_last_tool",
        "_last_tool_id",
        "_model",
        "_next_block",
        "_open",
        "_output_tokens",
        "_started",
        "_thinking_tokens",
        "_tools",
    )

    def __init__(self, *, model: str) -> None:
        self._model = model
        self._started = False
        self._finished = False
        self._next_block = 0
        self._open: str | None = None  # kind of the open block: text, thinking or tool
        self._delta_head = b""  # `content_block_delta` prefix of the open block
        self._tools: dict[int, int] = {}  # OpenAI tool_calls index → block index
        self._last_tool: int | None = None
        self._last_tool_id: object = None
        self._finish_reason: str | None = None
        self._input_tokens: int | None = None
        self._cached_tokens = 0
        self._cache_write_tokens = 0
        self._output_tokens = 0
        self._thinking_tokens: dict[str, int] | None = None

    def feed(self, chunk: Chunk) -> bytes:
        if self._finished:
            return b""
        if chunk.error is not None:
            self._finished = True  # an error event ends an Anthropic stream
            return anthropic_error_frame(chunk.error)
        data = chunk.data
        if data is None:
            if chunk.done:
                return self._finish()
            return chunk.raw if _is_comment(chunk.raw) else b""
        out = b"" if self._started else self._message_start(data)
        usage = data.get("usage")
        if isinstance(usage, dict) and usage:
            self._count(usage)
        choices = data.get("choices")
        if choices:
            choice = choices[0]
            delta = choice.get("delta")
            if delta:
                reasoning = delta.get("reasoning_content") or delta.get("reasoning")
                if reasoning:
                    out += self._text("thinking", _THINKING_DELTA, reasoning)
                text = delta.get("content")
                if text:
                    out += self._text("text", _TEXT_DELTA, text)
                refusal = delta.get("refusal")
                if refusal:
                    out += self._text("text", _TEXT_DELTA, refusal)
                tool_calls = delta.get("tool_calls")
                if tool_calls:
                    for call in tool_calls:
                        out += self._tool(call)
            finish_reason = choice.get("finish_reason")
            if finish_reason:
                self._finish_reason = finish_reason
        return out

    def _count(self, usage: dict[str, Any]) -> None:
        # Anthropic's `input_tokens` leaves out what was read from the cache and written to it.
        cached, written = (n or 0 for n in openai_cache_tokens(usage))
        prompt = count(usage.get("prompt_tokens"))
        if prompt is not None:
            self._input_tokens = max(prompt - cached - written, 0)
            self._cached_tokens = cached
            self._cache_write_tokens = written
        self._output_tokens = count(usage.get("completion_tokens")) or self._output_tokens
        self._thinking_tokens = _thinking_tokens(usage) or self._thinking_tokens

    def _message_start(self, data: dict[str, Any]) -> bytes:
        self._started = True
        message: dict[str, Any] = {
            "id": _anthropic_id(data.get("id")),
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "stop_details": None,
            "usage": _anthropic_usage({"prompt_tokens": self._input_tokens or 0}),
            "container": None,
        }
        return frame(
            orjson.dumps({"type": "message_start", "message": message}), event="message_start"
        )

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        self._open = None
        return _BLOCK_STOP + b"%d}\n\n" % (self._next_block - 1)

    def _open_block(self, kind: str, content_block: bytes) -> bytes:
        out = self._close()
        index = self._next_block
        self._next_block += 1
        self._open = kind
        self._delta_head = _BLOCK_DELTA + b'%d,"delta":' % index
        return out + _BLOCK_START + b'%d,"content_block":%b}\n\n' % (index, content_block)

    def _text(self, kind: str, head: bytes, text: str) -> bytes:
        out = b"" if self._open == kind else self._open_block(kind, _EMPTY_BLOCKS[kind])
        return out + self._delta_head + head + orjson.dumps(text) + b"}}\n\n"

    def _tool(self, call: dict[str, Any]) -> bytes:
        index = call.get("index")
        if not isinstance(index, int):
            # Servers that omit it send one call at a time; a new id starts the next one.
            call_id = call.get("id")
            last = self._last_tool
            new = last is None or (call_id is not None and call_id != self._last_tool_id)
            index = len(self._tools) if new or last is None else last
        function = call.get("function") or {}
        out = b""
        block = self._tools.get(index)
        if block is None:
            block_body = orjson.dumps(
                {
                    "type": "tool_use",
                    "id": _tool_id(call.get("id")),
                    "name": function.get("name") or "",
                    "input": {},
                    "caller": TOOL_CALLER,
                }
            )
            out = self._open_block("tool", block_body)
            block = self._tools[index] = self._next_block - 1
            self._last_tool = index
            self._last_tool_id = call.get("id")
        arguments = function.get("arguments")
        if not arguments:
            return out
        head = (
            self._delta_head
            if block == self._next_block - 1
            else _BLOCK_DELTA + b'%d,"delta":' % block  # a late delta for an earlier call
        )
        return out + head + _JSON_DELTA + orjson.dumps(arguments) + b"}}\n\n"

    def _finish(self) -> bytes:
        self._finished = True
        out = b"" if self._started else self._message_start({})
        out += self._close()
        # Cumulative counts; without an upstream usage chunk the input is unknown (null).
        usage: dict[str, Any] = {
            "input_tokens": self._input_tokens,
            "cache_creation_input_tokens": self._cache_write_tokens,
            "cache_read_input_tokens": self._cached_tokens,
            "output_tokens": self._output_tokens,
            "output_tokens_details": self._thinking_tokens,
            "server_tool_use": None,
        }
        delta = {
            "type": "message_delta",
            "delta": {
                "stop_reason": anthropic_stop_reason(self._finish_reason),
                "stop_sequence": None,
                "stop_details": None,
                "container": None,
            },
            "usage": usage,
        }
        return out + frame(orjson.dumps(delta), event="message_delta") + _MESSAGE_STOP

"""The Responses API's stream: its event sequence built from chat or Anthropic stream chunks,
and a native Responses stream forwarded as it is.

Every translator here keeps the Response it is building, so that when the stream completes its
final object (`result`) is what the gateway stores for `previous_response_id`; `fail` ends a
stream cut after commit with `error` and `response.failed`, never a clean `response.completed`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import orjson

from gateway.models import Chunk
from gateway.providers.translate.items import (
    chat_to_response,
    finish,
    message_item,
    new_id,
    reasoning_item,
    response_shell,
)
from gateway.providers.translate.responses import anthropic_response_to_openai
from gateway.providers.translate.streams import AnthropicToOpenAIStream
from gateway.providers.translate.tools import NO_TOOLS, ToolNames, custom_input
from gateway.sse import frame


def error_fields(code: str, message: str) -> dict[str, Any]:
    """An `error` event's fields: flat, as OpenAI's reference spells them, and under `error`, as
    the Open Responses specification and OpenAI's SDKs read them (they raise it as an APIError)."""
    flat = {"code": code, "message": message, "param": None}
    return {**flat, "error": {"type": "server_error", **flat}}


def response_error(code: str, message: str) -> dict[str, str]:
    """A failed Response's `error`: its code from the API's own list (the SDKs type it so), the
    gateway's own code (in the `error` event) told in the message."""
    known = code if code in ("server_error", "rate_limit_exceeded") else "server_error"
    return {"code": known, "message": message if known == code else f"{code}: {message}"}


class ResponsesResult:
    """The Response object a translator finished, if it did: what the store keeps."""

    __slots__ = ("response",)

    def __init__(self) -> None:
        self.response: dict[str, Any] | None = None


class _Item:
    __slots__ = ("body", "index", "kind", "parts")

    def __init__(self, kind: str, index: int, body: dict[str, Any]) -> None:
        self.kind = kind  # reasoning | message | function_call | custom_tool_call
        self.index = index  # output_index
        self.body = body
        self.parts: list[str] = []


class ResponsesEvents:
    """Emits the Responses event sequence for output that arrives piece by piece."""

    __slots__ = ("_items", "_names", "_open", "_response", "_sequence", "_tools", "result")

    def __init__(
        self,
        request: Mapping[str, Any],
        response_id: str,
        model: str,
        result: ResponsesResult,
        names: ToolNames = NO_TOOLS,
    ) -> None:
        self._response = response_shell(request, response_id, model)
        self._names = names  # what the chat names of the request's tools map back to
        self._sequence = 0
        self._items: list[_Item] = []
        self._open: _Item | None = None  # the reasoning or message item text goes into
        self._tools: dict[int, _Item] = {}  # chat tool_calls index → its item
        self.result = result

    def _event(self, kind: str, fields: dict[str, Any]) -> bytes:
        data = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return frame(orjson.dumps(data), kind)

    def start(self) -> bytes:
        created = self._event("response.created", {"response": self._response})
        return created + self._event("response.in_progress", {"response": self._response})

    def _add(self, kind: str, body: dict[str, Any]) -> tuple[_Item, bytes]:
        item = _Item(kind, len(self._items), body)
        self._items.append(item)
        out = self._event("response.output_item.added", {"output_index": item.index, "item": body})
        return item, out

    def _text_item(self, kind: str) -> tuple[_Item, bytes]:
        """The open item of this kind, opened (closing another) when needed."""
        item = self._open
        if item is not None and item.kind == kind:
            return item, b""
        out = self._close_open()
        if kind == "reasoning":
            body = {**reasoning_item(""), "status": "in_progress", "content": []}
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            body = {**message_item(""), "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item, added = self._add(kind, body)
        self._open = item
        out += added + self._event(
            "response.content_part.added",
            {"item_id": body["id"], "output_index": item.index, "content_index": 0, "part": part},
        )
        return item, out

    def text(self, delta: str, kind: str = "message") -> bytes:
        item, out = self._text_item(kind)
        item.parts.append(delta)
        name = (
            "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        )
        fields: dict[str, Any] = {
            "item_id": item.body["id"],
            "output_index": item.index,
            "content_index": 0,
            "delta": delta,
        }
        if kind == "message":
            fields["logprobs"] = []
        return out + self._event(name, fields)

    def tool_call(self, index: int, call_id: str | None, name: str | None, delta: str) -> bytes:
        out = b""
        item = self._tools.get(index)
        if item is None:
            out += self._close_open()
            body = self._names.call_item(call_id or new_id("call_"), name or "", "")
            body["status"] = "in_progress"
            item, added = self._add(body["type"], body)
            self._tools[index] = item
            out += added
        elif name and not item.body["name"]:
            named = self._names.call_item(item.body["call_id"], name, "")
            named.update(id=item.body["id"], status="in_progress")
            item.kind = named["type"]
            item.body.clear()
            item.body.update(named)
        if delta:
            item.parts.append(delta)
            # A custom tool's input is inside the JSON of the function's arguments: it is
            # sent whole once they are complete.
            if item.kind == "function_call":
                out += self._event(
                    "response.function_call_arguments.delta",
                    {"item_id": item.body["id"], "output_index": item.index, "delta": delta},
                )
        return out

    def _close_open(self) -> bytes:
        item, self._open = self._open, None
        if item is None:
            return b""
        text = "".join(item.parts)
        body = item.body
        fields = {"item_id": body["id"], "output_index": item.index, "content_index": 0}
        if item.kind == "reasoning":
            part: dict[str, Any] = {"type": "reasoning_text", "text": text}
            out = self._event("response.reasoning_text.done", {**fields, "text": text})
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out = self._event("response.output_text.done", {**fields, "text": text, "logprobs": []})
        body["content"] = [part]
        out += self._event("response.content_part.done", {**fields, "part": part})
        return out + self._item_done(item)

    def _item_done(self, item: _Item) -> bytes:
        item.body["status"] = "completed"
        return self._event(
            "response.output_item.done", {"output_index": item.index, "item": item.body}
        )

    def complete(self, finish_reason: str | None, usage: object) -> bytes:
        out = self._close_open()
        for item in self._tools.values():
            out += self._call_done(item)
            out += self._item_done(item)
        self._tools.clear()
        response = self._response
        response["output"] = [item.body for item in self._items]
        finish(response, finish_reason, usage)
        self.result.response = response
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return out + self._event(kind, {"response": response})

    def _call_done(self, item: _Item) -> bytes:
        arguments = "".join(item.parts)
        body = item.body
        fields: dict[str, Any] = {"item_id": body["id"], "output_index": item.index}
        if item.kind == "custom_tool_call":
            text = body["input"] = custom_input(arguments)
            out = self._event("response.custom_tool_call_input.delta", {**fields, "delta": text})
            return out + self._event(
                "response.custom_tool_call_input.done", {**fields, "input": text}
            )
        body["arguments"] = arguments
        return self._event(
            "response.function_call_arguments.done",
            {**fields, "name": body["name"], "arguments": arguments},
        )

    def fail(self, code: str, message: str) -> bytes:
        """A stream cut after it began: `error`, then `response.failed` with what was sent."""
        response = copy.copy(self._response)
        response["status"] = "failed"
        response["error"] = response_error(code, message)
        response["output"] = [item.body for item in self._items]
        out = self._event("error", error_fields(code, message))
        return out + self._event("response.failed", {"response": response})


class ChatToResponsesStream:
    """`chat.completion.chunk` events (first choice) → the Responses event sequence."""

    __slots__ = ("_events", "_finish", "_started", "_usage", "fail")

    def __init__(self, events: ResponsesEvents) -> None:
        self._events = events
        self._started = False
        self._finish: str | None = None
        self._usage: object = None
        self.fail = events.fail

    def feed(self, chunk: Chunk) -> bytes:
        if chunk.done:
            return self._start() + self._events.complete(self._finish, self._usage)
        data = chunk.data
        if data is None:
            return chunk.raw if chunk.raw.startswith(b":") else b""  # keep-alives
        return self._start() + self.feed_chat(data)

    def _start(self) -> bytes:
        if self._started:
            return b""
        self._started = True
        return self._events.start()

    def feed_chat(self, data: Mapping[str, Any]) -> bytes:
        if (usage := data.get("usage")) is not None:
            self._usage = usage
        out = b""
        events = self._events
        for choice in data.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if isinstance(reasoning, str) and reasoning:
                out += events.text(reasoning, "reasoning")
            content = delta.get("content")
            if isinstance(content, str) and content:
                out += events.text(content)
            for call in delta.get("tool_calls") or ():
                function = call.get("function") or {}
                out += events.tool_call(
                    call.get("index", 0),
                    call.get("id"),
                    function.get("name"),
                    function.get("arguments") or "",
                )
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
        return out


class AnthropicToResponsesStream(ChatToResponsesStream):
    """Anthropic Messages stream events → the Responses event sequence, by way of chat chunks."""

    __slots__ = ("_chat",)

    def __init__(self, events: ResponsesEvents, model: str) -> None:
        super().__init__(events)
        self._chat = AnthropicToOpenAIStream(model=model, include_usage=True)

    def feed(self, chunk: Chunk) -> bytes:
        out = b""
        for piece in self._chat.feed(chunk).split(b"\n\n"):
            if not piece.startswith(b"data: "):
                continue
            data = piece[6:]
            if data == b"[DONE]":
                out += self._start() + self._events.complete(self._finish, self._usage)
            else:
                out += self._start() + self.feed_chat(orjson.loads(data))
        return out


class ResponsesPassthrough:
    """A native Responses stream, forwarded untouched; it keeps the final Response and the
    last sequence number, so a cut stream can still end the way the SDKs expect."""

    __slots__ = ("_response", "_sequence", "result")

    def __init__(self, result: ResponsesResult) -> None:
        self.result = result
        self._response: dict[str, Any] = {}
        self._sequence = 0

    def feed(self, chunk: Chunk) -> bytes:
        data = chunk.data
        if data is not None:
            sequence = data.get("sequence_number")
            if isinstance(sequence, int):
                self._sequence = sequence + 1
            response = data.get("response")
            if isinstance(response, dict):
                self._response = response
                if data.get("type") in ("response.completed", "response.incomplete"):
                    self.result.response = response
        return chunk.raw

    def fail(self, code: str, message: str) -> bytes:
        response = {
            **self._response,
            "status": "failed",
            "error": response_error(code, message),
        }
        error = {"type": "error", "sequence_number": self._sequence, **error_fields(code, message)}
        failed = {
            "type": "response.failed",
            "sequence_number": self._sequence + 1,
            "response": response,
        }
        return frame(orjson.dumps(error), "error") + frame(orjson.dumps(failed), "response.failed")


def chat_body_to_response(
    data: Mapping[str, Any],
    request: Mapping[str, Any],
    response_id: str,
    model: str,
    result: ResponsesResult,
    names: ToolNames = NO_TOOLS,
) -> bytes:
    response = chat_to_response(data, request, response_id, model, names)
    result.response = response
    return orjson.dumps(response)


def anthropic_body_to_response(
    data: dict[str, Any],
    request: Mapping[str, Any],
    response_id: str,
    model: str,
    result: ResponsesResult,
    names: ToolNames = NO_TOOLS,
) -> bytes:
    chat = orjson.loads(anthropic_response_to_openai(data, model=model))
    return chat_body_to_response(chat, request, response_id, model, result, names)


def native_body(data: dict[str, Any] | None, raw: bytes, result: ResponsesResult) -> bytes:
    if data is not None:
        result.response = data
    return raw

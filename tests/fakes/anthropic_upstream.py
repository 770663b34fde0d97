"""A scripted fake of Anthropic's Messages API (`POST /v1/messages`), as a bare ASGI app.

Responses, streams and errors are shaped like the real API's: a stream is `message_start`,
`content_block_start`, `ping`, `content_block_delta`*, `content_block_stop`, `message_delta`
(stop reason and cumulative output tokens), `message_stop`, each framed as `event: <type>` plus
`data: <json>`; errors are `{"type": "error", "error": {"type", "message"}, "request_id"}`.
Like the real API it insists on `anthropic-version`, `max_tokens` and `messages`, and (when built
with `api_key`) on that `x-api-key`.

The requested model name is the script, `claude-x@directive,directive,...`:

- `claude-x`: a text answer of `words` words (default 5), capped by the request's `max_tokens`
  (then `stop_reason` is `max_tokens`). `input_tokens` is the number of words in the text of
  `system` and the messages; `cached=N` adds `cache_read_input_tokens: N`.
- `tool`: a short text block, then a `tool_use` block for the request's first tool (its arguments
  streamed as `input_json_delta` parts), `stop_reason` `tool_use`. When the last user turn carries
  a `tool_result`, a text answer instead, as a model would give.
- `overloaded`: 529 `overloaded_error`. `status=N`: that status with its error type; a 401
  echoes the `x-api-key` it received, the worst case for a gateway that forwards error text.
- `inband_overloaded`: a 200 stream whose only event after `message_start` is an `error` event
  (`overloaded_error`), before any content. (Without streaming: a 529.)
- `error_after=N`: an `api_error` event after N text deltas, then the stream ends.
  (Without streaming: a 500.)
- `slow_ms=N`: N ms before every content delta (before a non-streaming answer: N ms per word).
  The pause ends early when the client leaves.

`POST /v1/messages/count_tokens` answers `{"input_tokens": N}`, N counted as for `input_tokens`
above; like the real API it refuses generation settings (`max_tokens`, `stream`), and the same
scripts apply (`status=N`, `slow_ms=N`: N ms before the answer).

Every request is recorded (`requests`: path, lower-cased headers, parsed body). Streams count as
`streams_finished` (the fake sent all it meant to) or `streams_abandoned` (the client disconnected
first); `await fake.wait_for(predicate)` returns once a predicate over the fake holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any, Final

import orjson

from tests.fakes.asgi import Watched, incoming, json_or_none

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

WORDS: Final = ("Hello", "from", "the", "fake", "Claude", "answering", "every", "question")
TOOL_TEXT: Final = "Let me check."
TOOL_NAME: Final = "get_weather"  # when the request declares no tools
TOOL_INPUT: Final[dict[str, Any]] = {"city": "Paris", "days": 3}
# How the arguments are streamed: the real API starts with an empty part.
TOOL_JSON_PARTS: Final = ("", '{"city": ', '"Paris", "da', 'ys": 3}')
AFTER_TOOL_TEXT: Final = "It is sunny in Paris."

ERROR_TYPES: Final[dict[int, str]] = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}
_ERROR_MESSAGES: Final[dict[str, str]] = {
    "overloaded_error": "Overloaded",
    "api_error": "Internal server error",
    "rate_limit_error": "Number of request tokens has exceeded your per-minute rate limit",
}
_JSON: Final = (b"content-type", b"application/json")
COUNT_TOKENS_PATH: Final = "/v1/messages/count_tokens"
_SSE: Final = (b"content-type", b"text/event-stream; charset=utf-8")


def answer_text(words: int) -> str:
    """The text of a plain answer of `words` words."""
    return " ".join(WORDS[i % len(WORDS)] for i in range(words))


def count_words(body: dict[str, Any]) -> int:
    """The fake's `input_tokens`: words in the text of `system` and the messages."""
    return sum(len(text.split()) for text in _texts(body.get("system"))) + sum(
        len(text.split())
        for message in body.get("messages") or ()
        if isinstance(message, dict)
        for text in _texts(message.get("content"))
    )


def _texts(content: object) -> Iterator[str]:
    if isinstance(content, str):
        yield content
    elif isinstance(content, list):
        for block in content:
            if isinstance(block, dict):
                if isinstance(block.get("text"), str):
                    yield block["text"]
                yield from _texts(block.get("content"))  # tool results


@dataclass(frozen=True, slots=True)
class Received:
    """One request as the fake received it."""

    method: str
    path: str
    headers: dict[str, str]
    body: Any  # the parsed JSON, or None when the body was not JSON


@dataclass(slots=True)
class Script:
    words: int = 5
    tool: bool = False
    status: int | None = None
    inband_overloaded: bool = False
    error_after: int | None = None
    slow_ms: float = 0.0
    cached: int = 0


_FLAGS: Final = ("tool", "overloaded", "inband_overloaded")
_NUMBERS: Final = ("words", "status", "error_after", "slow_ms", "cached")


def parse_script(model: str) -> Script:
    """`name@directive,...` → the script; raises ValueError naming an unknown directive."""
    script = Script()
    _, at, spec = model.partition("@")
    if not at:
        return script
    for directive in filter(None, spec.split(",")):
        key, eq, value = directive.partition("=")
        if not eq and key in _FLAGS:
            if key == "tool":
                script.tool = True
            elif key == "overloaded":
                script.status = 529
            else:
                script.inband_overloaded = True
        elif eq and key in _NUMBERS:
            number = float(value) if key == "slow_ms" else int(value)
            setattr(script, key, number)
        else:
            raise ValueError(f"unknown script directive {directive!r} in model {model!r}")
    return script


class _ScriptedError(Exception):
    def __init__(
        self, status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or []


class AnthropicFake(Watched):
    """The fake as an ASGI 3 application; see the module docstring for the scripts."""

    def __init__(self, *, api_key: str | None = None) -> None:
        self.api_key = api_key
        self.requests: list[Received] = []
        self.streams_finished = 0
        self.streams_abandoned = 0
        self._ids = itertools.count(1)

    # --- ASGI ----------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        received = await incoming(scope, receive, send)
        if received is None:
            return
        raw, headers = received
        body = json_or_none(raw)
        self.requests.append(Received(scope["method"], scope["path"], headers, body))
        await self.notify()

        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        request_id = f"req_fake{next(self._ids):06d}"
        watcher = asyncio.create_task(watch())
        try:
            if scope["path"] == COUNT_TOKENS_PATH and scope["method"] == "POST":
                await self._count_tokens(send, gone, headers, body, request_id)
                return
            try:
                script = self._check(scope, headers, body)
            except _ScriptedError as failure:
                await self._send_error(send, failure, request_id)
                return
            if body.get("stream"):
                await self._stream(send, gone, script, body, request_id)
            else:
                await self._answer(send, gone, script, body, request_id)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    def _check(self, scope: Scope, headers: dict[str, str], body: Any) -> Script:
        if scope["path"] != "/v1/messages" or scope["method"] != "POST":
            raise _ScriptedError(404, f"Not found: {scope['method']} {scope['path']}")
        if "anthropic-version" not in headers:
            raise _ScriptedError(400, "anthropic-version: header is required")
        if self.api_key is not None and headers.get("x-api-key") != self.api_key:
            raise _ScriptedError(401, "invalid x-api-key")
        if not isinstance(body, dict):
            raise _ScriptedError(400, "The request body is not valid JSON.")
        for field, kind in (("model", str), ("max_tokens", int), ("messages", list)):
            if not isinstance(body.get(field), kind):
                raise _ScriptedError(400, f"{field}: Field required")
        try:
            script = parse_script(body["model"])
        except ValueError as exc:
            raise _ScriptedError(400, str(exc)) from None
        streaming = bool(body.get("stream"))
        status = script.status
        if status is None and not streaming:
            if script.inband_overloaded:
                status = 529
            elif script.error_after is not None:
                status = 500
        if status == 401:
            raise _ScriptedError(401, f"invalid x-api-key: {headers.get('x-api-key')}")
        if status is not None:
            extra = [(b"retry-after", b"1")] if status == 429 else []
            message = _ERROR_MESSAGES.get(ERROR_TYPES.get(status, ""), f"scripted status {status}")
            raise _ScriptedError(status, message, extra)
        return script

    async def _count_tokens(
        self,
        send: Send,
        gone: asyncio.Event,
        headers: dict[str, str],
        body: Any,
        request_id: str,
    ) -> None:
        """`POST /v1/messages/count_tokens`: the words of `system` and the messages."""
        try:
            if "anthropic-version" not in headers:
                raise _ScriptedError(400, "anthropic-version: header is required")
            if self.api_key is not None and headers.get("x-api-key") != self.api_key:
                raise _ScriptedError(401, "invalid x-api-key")
            if not isinstance(body, dict):
                raise _ScriptedError(400, "The request body is not valid JSON.")
            for field, kind in (("model", str), ("messages", list)):
                if not isinstance(body.get(field), kind):
                    raise _ScriptedError(400, f"{field}: Field required")
            for extra in ("max_tokens", "stream"):
                if extra in body:
                    raise _ScriptedError(400, f"{extra}: Extra inputs are not permitted")
            try:
                script = parse_script(body["model"])
            except ValueError as exc:
                raise _ScriptedError(400, str(exc)) from None
            if script.status is not None:
                message = ERROR_TYPES.get(script.status, f"scripted status {script.status}")
                raise _ScriptedError(script.status, message)
        except _ScriptedError as failure:
            await self._send_error(send, failure, request_id)
            return
        await _pause(script.slow_ms, gone)
        if gone.is_set():
            return
        data = orjson.dumps({"input_tokens": count_words(body)})
        answer = [_JSON, (b"content-length", str(len(data)).encode())]
        answer.append((b"request-id", request_id.encode()))
        await send({"type": "http.response.start", "status": 200, "headers": answer})
        await send({"type": "http.response.body", "body": data})

    async def _send_error(self, send: Send, failure: _ScriptedError, request_id: str) -> None:
        kind = ERROR_TYPES.get(failure.status, "api_error")
        body = orjson.dumps(
            {
                "type": "error",
                "error": {"type": kind, "message": failure.message},
                "request_id": request_id,
            }
        )
        headers = [
            _JSON,
            (b"content-length", str(len(body)).encode()),
            (b"request-id", request_id.encode()),
            *failure.headers,
        ]
        await send({"type": "http.response.start", "status": failure.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    # --- answers -------------------------------------------------------------------------------

    @staticmethod
    def _calls_tool(script: Script, body: dict[str, Any]) -> bool:
        if not script.tool:
            return False
        last = body["messages"][-1] if body["messages"] else {}
        content = last.get("content") if isinstance(last, dict) else None
        answered = isinstance(content, list) and any(
            isinstance(block, dict) and block.get("type") == "tool_result" for block in content
        )
        return not answered

    @staticmethod
    def _tool_name(body: dict[str, Any]) -> str:
        tools = body.get("tools")
        if isinstance(tools, list) and tools and isinstance(tools[0], dict):
            return str(tools[0].get("name", TOOL_NAME))
        return TOOL_NAME

    def _usage(self, script: Script, body: dict[str, Any], output_tokens: int) -> dict[str, Any]:
        return {
            "input_tokens": count_words(body),
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": script.cached,
            "output_tokens": output_tokens,
        }

    def _text_plan(self, script: Script, body: dict[str, Any]) -> tuple[list[str], str]:
        """The text deltas of a plain answer and its stop reason."""
        if script.tool:  # the answer after a tool result
            words = AFTER_TOOL_TEXT.split(" ")
        else:
            words = answer_text(script.words).split(" ") if script.words else []
        stop_reason = "end_turn"
        if len(words) > body["max_tokens"]:
            words = words[: body["max_tokens"]]
            stop_reason = "max_tokens"
        return [w if i == 0 else " " + w for i, w in enumerate(words)], stop_reason

    async def _answer(
        self, send: Send, gone: asyncio.Event, script: Script, body: dict[str, Any], request_id: str
    ) -> None:
        if self._calls_tool(script, body):
            tool_use = {
                "type": "tool_use",
                "id": f"toolu_fake{request_id[-6:]}",
                "name": self._tool_name(body),
                "input": TOOL_INPUT,
            }
            content: list[dict[str, Any]] = [{"type": "text", "text": TOOL_TEXT}, tool_use]
            stop_reason, output_tokens = "tool_use", len(TOOL_TEXT.split()) + len(TOOL_JSON_PARTS)
        else:
            deltas, stop_reason = self._text_plan(script, body)
            content = [{"type": "text", "text": "".join(deltas)}] if deltas else []
            output_tokens = len(deltas)
            await _pause(script.slow_ms * len(deltas), gone)
            if gone.is_set():
                return
        message = {
            "id": f"msg_fake{request_id[-6:]}",
            "type": "message",
            "role": "assistant",
            "model": body["model"],
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": None,
            "usage": self._usage(script, body, output_tokens),
        }
        data = orjson.dumps(message)
        headers = [
            _JSON,
            (b"content-length", str(len(data)).encode()),
            (b"request-id", request_id.encode()),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": data})

    def _events(
        self, script: Script, body: dict[str, Any], request_id: str
    ) -> Iterator[tuple[dict[str, Any], bool]]:
        """The stream's events, each with whether it carries content (paced by `slow_ms`)."""
        start = {
            "id": f"msg_fake{request_id[-6:]}",
            "type": "message",
            "role": "assistant",
            "model": body["model"],
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": self._usage(script, body, 1),
        }
        yield {"type": "message_start", "message": start}, False
        if script.inband_overloaded:
            error = {"type": "overloaded_error", "message": _ERROR_MESSAGES["overloaded_error"]}
            yield {"type": "error", "error": error}, False
            return
        sent = 0
        if self._calls_tool(script, body):
            yield _block_start(0, {"type": "text", "text": ""}), False
            yield {"type": "ping"}, False
            yield _delta(0, {"type": "text_delta", "text": TOOL_TEXT}), True
            yield {"type": "content_block_stop", "index": 0}, False
            tool_use = {
                "type": "tool_use",
                "id": f"toolu_fake{request_id[-6:]}",
                "name": self._tool_name(body),
                "input": {},
            }
            yield _block_start(1, tool_use), False
            for part in TOOL_JSON_PARTS:
                yield _delta(1, {"type": "input_json_delta", "partial_json": part}), True
            yield {"type": "content_block_stop", "index": 1}, False
            stop_reason, sent = "tool_use", 1 + len(TOOL_JSON_PARTS)
        else:
            deltas, stop_reason = self._text_plan(script, body)
            yield _block_start(0, {"type": "text", "text": ""}), False
            yield {"type": "ping"}, False
            for text in deltas:
                if sent == script.error_after:
                    error = {"type": "api_error", "message": _ERROR_MESSAGES["api_error"]}
                    yield {"type": "error", "error": error}, False
                    return
                yield _delta(0, {"type": "text_delta", "text": text}), True
                sent += 1
            yield {"type": "content_block_stop", "index": 0}, False
        delta = {"stop_reason": stop_reason, "stop_sequence": None}
        yield {"type": "message_delta", "delta": delta, "usage": {"output_tokens": sent}}, False
        yield {"type": "message_stop"}, False

    async def _stream(
        self, send: Send, gone: asyncio.Event, script: Script, body: dict[str, Any], request_id: str
    ) -> None:
        headers = [_SSE, (b"cache-control", b"no-cache"), (b"request-id", request_id.encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        finished = False
        try:
            for event, content in self._events(script, body, request_id):
                if content:
                    await _pause(script.slow_ms, gone)
                if gone.is_set():
                    return
                data = b"event: %b\ndata: %b\n\n" % (event["type"].encode(), orjson.dumps(event))
                await send({"type": "http.response.body", "body": data, "more_body": True})
            if gone.is_set():
                return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            finished = True
        finally:
            if finished:
                self.streams_finished += 1
            else:
                self.streams_abandoned += 1
            await self.notify()


def _block_start(index: int, block: dict[str, Any]) -> dict[str, Any]:
    return {"type": "content_block_start", "index": index, "content_block": block}


def _delta(index: int, delta: dict[str, Any]) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": index, "delta": delta}


async def _pause(ms: float, gone: asyncio.Event) -> None:
    """Simulated generation time, cut short when the client leaves."""
    if ms <= 0:
        return
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(ms / 1000):
            await gone.wait()

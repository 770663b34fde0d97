"""What a client reads from a streamed answer: its content events, its end marker and its errors.

The load client (`gateway.tools.load`) and the benchmarks feed a 200 answer's bytes to a
`StreamReader` as they arrive. The events are cut by `gateway.sse.SSEParser`, the parser the
gateway reads its upstreams with, so a client and the gateway agree on what an event is.
"""

from __future__ import annotations

import orjson

from gateway.sse import SSEFramingError, SSEParser


class StreamReader:
    """Feed a stream's bytes; read how many events carried content, when the first did (`t_first`,
    the `now` of the bytes that completed it), whether the end marker came (`[DONE]`, or
    Anthropic's `message_stop`) and the last error (a bad event, an error event, bytes that are
    no event stream), with the error event's `code`.

    Content is `choices[].delta.content`, `choices[].text` (completions) or an Anthropic
    `content_block_delta`'s text. With `errors_only_after_first`, events after the first content
    are decoded only when they may hold an error: cheaper for a client under heavy load, but
    `content` then counts the first content event only.
    """

    __slots__ = ("_parser", "content", "done", "error", "error_code", "first_only", "t_first")

    def __init__(self, errors_only_after_first: bool = False) -> None:
        self._parser = SSEParser()
        self.first_only = errors_only_after_first
        self.content = 0
        self.t_first: float | None = None
        self.done = False
        self.error: str | None = None
        self.error_code: str | None = None

    def feed(self, data: bytes, now: float) -> None:
        try:
            events = self._parser.feed(data)
        except SSEFramingError as exc:
            self.error = f"bad stream ({exc})"
            return
        for event in events:
            if event.data:  # comments and keep-alives carry none
                self._event(event.data, now)

    def _event(self, payload: bytes, now: float) -> None:
        if payload == b"[DONE]":
            self.done = True
            return
        if self.first_only and self.t_first is not None and b'"error"' not in payload:
            return  # only the first content event and errors matter
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            self.error = f"bad event {payload[:120]!r}"
            return
        if not isinstance(obj, dict):
            self.error = f"bad event {payload[:120]!r}"
            return
        if "error" in obj:
            error = obj["error"]
            self.error = f"error event {payload[:200]!r}"
            self.error_code = error.get("code") if isinstance(error, dict) else None
            return
        kind = obj.get("type")
        if kind == "message_stop":
            self.done = True
        elif kind == "content_block_delta":
            delta = obj.get("delta")
            if isinstance(delta, dict) and delta.get("text"):
                self._content(now)
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if isinstance(text, str) and text:
                self._content(now)

    def _content(self, now: float) -> None:
        self.content += 1
        if self.t_first is None:
            self.t_first = now

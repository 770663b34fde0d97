"""A scripted fake of an upstream that serves OpenAI's Responses API itself (`POST /v1/responses`),
as a bare ASGI app. Its answer is always the text of `WORDS`, with usage that reports cached
input tokens; a streamed answer is the documented event sequence. The model name `native@cut`
ends the stream after two text deltas without `response.completed`. Every request body is kept
(`requests`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Final

import orjson

from tests.fakes.asgi import lifespan, read_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

WORDS: Final = ("Native", " answer", " from", " upstream")
USAGE: Final[dict[str, Any]] = {
    "input_tokens": 12,
    "input_tokens_details": {"cached_tokens": 8},
    "output_tokens": len(WORDS),
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": 12 + len(WORDS),
}


def _response(body: dict[str, Any], status: str, output: list[Any]) -> dict[str, Any]:
    return {
        "id": "resp_native0001",
        "object": "response",
        "created_at": 1_700_000_000,
        "status": status,
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "model": body.get("model"),
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": USAGE if status == "completed" else None,
    }


def _message(text: str) -> dict[str, Any]:
    return {
        "id": "msg_native0001",
        "type": "message",
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


class ResponsesFake:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        raw = await read_body(receive)
        body = orjson.loads(raw)
        self.requests.append(body)
        if scope["path"] != "/v1/responses":
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        text = "".join(WORDS)
        if not body.get("stream"):
            answer = orjson.dumps(_response(body, "completed", [_message(text)]))
            headers = [(b"content-type", b"application/json")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": answer})
            return
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        sequence = 0

        async def event(kind: str, **fields: Any) -> None:
            nonlocal sequence
            data = orjson.dumps({"type": kind, "sequence_number": sequence, **fields})
            sequence += 1
            frame = b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"
            await send({"type": "http.response.body", "body": frame, "more_body": True})

        await event("response.created", response=_response(body, "in_progress", []))
        await event("response.in_progress", response=_response(body, "in_progress", []))
        item = {**_message(""), "status": "in_progress", "content": []}
        await event("response.output_item.added", output_index=0, item=item)
        part = {"type": "output_text", "text": "", "annotations": []}
        ids = {"item_id": "msg_native0001", "output_index": 0, "content_index": 0}
        await event("response.content_part.added", part=part, **ids)
        for index, word in enumerate(WORDS):
            if index == 2 and body.get("model", "").endswith("@cut"):
                await send({"type": "http.response.body", "body": b""})
                return
            await event("response.output_text.delta", delta=word, logprobs=[], **ids)
        await event("response.output_text.done", text=text, logprobs=[], **ids)
        done_part = {**part, "text": text}
        await event("response.content_part.done", part=done_part, **ids)
        await event("response.output_item.done", output_index=0, item=_message(text))
        await event("response.completed", response=_response(body, "completed", [_message(text)]))
        await send({"type": "http.response.body", "body": b""})

"""A scripted upstream for a coding agent's loop, as a bare ASGI app speaking the three wires:
chat completions (`POST /v1/chat/completions`), the Responses API (`POST /v1/responses`) and
Anthropic's Messages (`POST /v1/messages`), streamed or not.

Its script is one turn of an agent: asked first, it calls the agent's shell tool with `COMMAND`
(the tool is found by name among the request's tools: `exec_command`, whose argument is `cmd`,
or `shell`, whose argument is `command`, a list); once the request carries that call's output,
it answers `FINAL_TEXT` (as it does a request without tools). `call`, when set, is the (tool
name, arguments) called instead of the shell. Every request is kept (`requests`: path,
lower-cased headers, body)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any, Final

import orjson

from tests.fakes.asgi import lifespan, read_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

PROOF_FILE: Final = "proof.txt"
COMMAND: Final = f"echo ran-by-the-agent > {PROOF_FILE}"
FINAL_TEXT: Final = "The command ran and wrote proof.txt."
CALL_ID: Final = "call_agent0001"
_USAGE_IN, _USAGE_OUT = 20, 5


@dataclass(frozen=True, slots=True)
class Received:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


def shell_call(tools: object) -> tuple[str, str]:
    """The shell tool's name among declared tools (chat, Responses or Messages shapes) and the
    arguments that run `COMMAND` with it."""
    names: list[str] = []
    for tool in tools if isinstance(tools, list) else ():
        if isinstance(tool, dict):
            function = tool.get("function")
            name = function.get("name") if isinstance(function, dict) else tool.get("name")
            names.append(str(name))
    if "exec_command" in names:
        return "exec_command", orjson.dumps({"cmd": COMMAND}).decode()
    if "shell" in names:
        return "shell", orjson.dumps({"command": ["bash", "-lc", COMMAND]}).decode()
    raise AssertionError(f"no shell tool among {names}")


def _answered(path: str, body: dict[str, Any]) -> bool:
    """Whether the request already carries the shell call's output."""
    if path == "/v1/responses":
        items = body.get("input")
        return isinstance(items, list) and any(
            isinstance(i, dict) and i.get("type") == "function_call_output" for i in items
        )
    messages = body.get("messages") or []
    if path == "/v1/chat/completions":
        return any(m.get("role") == "tool" for m in messages if isinstance(m, dict))
    return any(
        isinstance(block, dict) and block.get("type") == "tool_result"
        for m in messages
        if isinstance(m, dict) and isinstance(m.get("content"), list)
        for block in m["content"]
    )


class AgentUpstream:
    def __init__(self) -> None:
        self.requests: list[Received] = []
        self.call: tuple[str, str] | None = None  # the tool call to make, if not the shell's
        self.url = ""  # where it serves, once it does

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        path = scope["path"]
        body = orjson.loads(await read_body(receive) or b"{}")
        headers = {k.decode().lower(): v.decode("latin-1") for k, v in scope["headers"]}
        self.requests.append(Received(path, headers, body))
        writers = {
            "/v1/chat/completions": _chat,
            "/v1/responses": _responses,
            "/v1/messages": _messages,
        }
        if path not in writers:
            await _send(send, 404, b'{"error": {"message": "not found"}}')
            return
        tool = None
        if body.get("tools") and not _answered(path, body):
            tool = self.call or shell_call(body.get("tools"))
        events = writers[path](body, tool)
        if not body.get("stream"):
            await _send(send, 200, orjson.dumps(next(events)[1]))
            return
        next(events)  # the whole answer: a stream is the rest
        sse = (b"content-type", b"text/event-stream")
        await send({"type": "http.response.start", "status": 200, "headers": [sse]})
        for name, data in events:
            head = b"event: " + name.encode() + b"\n" if name else b""
            raw = data if isinstance(data, bytes) else orjson.dumps(data)
            frame = head + b"data: " + raw + b"\n\n"
            await send({"type": "http.response.body", "body": frame, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


async def _send(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


Events = Iterator[tuple[str, Any]]  # first the whole answer, then the stream's (event, data)


def _chat(body: dict[str, Any], tool: tuple[str, str] | None) -> Events:
    usage = {
        "prompt_tokens": _USAGE_IN,
        "completion_tokens": _USAGE_OUT,
        "total_tokens": _USAGE_IN + _USAGE_OUT,
    }
    base = {"id": "chatcmpl-agent", "created": 1_700_000_000, "model": body.get("model")}
    if tool is None:
        message: dict[str, Any] = {"role": "assistant", "content": FINAL_TEXT}
        finish = "stop"
    else:
        function = {"name": tool[0], "arguments": tool[1]}
        call = {"id": CALL_ID, "type": "function", "function": function}
        message = {"role": "assistant", "content": None, "tool_calls": [call]}
        finish = "tool_calls"
    choice = {"index": 0, "message": message, "finish_reason": finish}
    yield "", {**base, "object": "chat.completion", "choices": [choice], "usage": usage}
    chunk = {**base, "object": "chat.completion.chunk"}
    yield "", {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant"}}]}
    if tool is None:
        delta: dict[str, Any] = {"content": FINAL_TEXT}
        yield "", {**chunk, "choices": [{"index": 0, "delta": delta}]}
    else:
        name, arguments = tool
        half = len(arguments) // 2
        first = {"index": 0, "id": CALL_ID, "type": "function"}
        for part in (
            {**first, "function": {"name": name, "arguments": arguments[:half]}},
            {"index": 0, "function": {"arguments": arguments[half:]}},
        ):
            yield "", {**chunk, "choices": [{"index": 0, "delta": {"tool_calls": [part]}}]}
    yield "", {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}
    yield "", {**chunk, "choices": [], "usage": usage}
    yield "", b"[DONE]"


def _responses(body: dict[str, Any], tool: tuple[str, str] | None) -> Events:
    if tool is None:
        item: dict[str, Any] = {
            "id": "msg_agent0001",
            "type": "message",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": FINAL_TEXT, "annotations": []}],
        }
    else:
        item = {
            "id": "fc_agent0001",
            "type": "function_call",
            "status": "completed",
            "call_id": CALL_ID,
            "name": tool[0],
            "arguments": tool[1],
        }
    usage = {
        "input_tokens": _USAGE_IN,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": _USAGE_OUT,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": _USAGE_IN + _USAGE_OUT,
    }
    response = {
        "id": "resp_agent0001",
        "object": "response",
        "created_at": 1_700_000_000,
        "status": "completed",
        "error": None,
        "incomplete_details": None,
        "model": body.get("model"),
        "output": [item],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": usage,
    }
    yield "", response
    pending = {**response, "status": "in_progress", "output": [], "usage": None}
    sequence = iter(range(100))
    for kind, fields in (
        ("response.created", {"response": pending}),
        ("response.output_item.added", {"output_index": 0, "item": item}),
        ("response.output_item.done", {"output_index": 0, "item": item}),
        ("response.completed", {"response": response}),
    ):
        yield kind, {"type": kind, "sequence_number": next(sequence), **fields}


def _messages(body: dict[str, Any], tool: tuple[str, str] | None) -> Events:
    if tool is None:
        block: dict[str, Any] = {"type": "text", "text": FINAL_TEXT}
        stop = "end_turn"
    else:
        block = {
            "type": "tool_use",
            "id": "toolu_agent0001",
            "name": tool[0],
            "input": orjson.loads(tool[1]),
        }
        stop = "tool_use"
    usage = {"input_tokens": _USAGE_IN, "output_tokens": _USAGE_OUT}
    message = {
        "id": "msg_agent0001",
        "type": "message",
        "role": "assistant",
        "model": body.get("model"),
        "content": [block],
        "stop_reason": stop,
        "stop_sequence": None,
        "usage": usage,
    }
    yield "", message
    start = {**message, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 1}}
    yield "message_start", {"type": "message_start", "message": start}
    if tool is None:
        opened: dict[str, Any] = {"type": "text", "text": ""}
        delta: dict[str, Any] = {"type": "text_delta", "text": FINAL_TEXT}
    else:
        opened = {**block, "input": {}}
        delta = {"type": "input_json_delta", "partial_json": tool[1]}
    yield (
        "content_block_start",
        {"type": "content_block_start", "index": 0, "content_block": opened},
    )
    yield "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}
    yield "content_block_stop", {"type": "content_block_stop", "index": 0}
    yield (
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": stop, "stop_sequence": None},
            "usage": {"output_tokens": _USAGE_OUT},
        },
    )
    yield "message_stop", {"type": "message_stop"}

"""A scripted coding-agent upstream, speaking both Anthropic Messages (`POST /v1/messages`) and
OpenAI chat completions (`POST /v1/chat/completions`), as a bare ASGI app.

The script is the same on both wires, and is what a model does with one shell task:

- a request that offers a tool named `Bash` (Claude Code's shell tool) and carries no tool
  result yet: a call of that tool running `command`;
- a request whose last turn carries a tool result: a final text answer, `FINAL_TEXT` followed
  by the tool's output;
- anything else (an agent's side requests: titles, summaries, quota checks): a short text.

Answers stream when asked to, shaped like the real APIs' (usage included: on chat only when
`stream_options.include_usage` asks). Every request is recorded (`requests`: path, lower-cased
headers, parsed body); `await fake.wait_for(predicate)` returns once a predicate holds.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import orjson
from starlette.types import Receive, Scope, Send

from tests.fakes.asgi import lifespan, read_body

SHELL_TOOL: Final = "Bash"
AGENT_TOOL: Final = "Agent"
SUBAGENT_TASK: Final = b"SUBAGENT-TASK"  # marks the sub-agent's own conversation
FINAL_TEXT: Final = "All done. The command printed:"
SIDE_TEXT: Final = "Shell task"


@dataclass(frozen=True, slots=True)
class Received:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


class AgentFake:
    """The scripted model. `command` is what its shell tool call runs; with `delegate`, the
    model first hands the task to a sub-agent (Claude Code's `Agent` tool), whose own
    conversation then runs the shell tool."""

    def __init__(self, command: str, *, delegate: bool = False) -> None:
        self.command = command
        self.delegate = delegate
        self.requests: list[Received] = []
        self._ids = itertools.count(1)
        self._changed = asyncio.Condition()

    async def wait_for(self, predicate: Callable[[AgentFake], bool]) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: predicate(self))

    @property
    def tool_results(self) -> list[str]:
        """The tool outputs the agent sent back, in order."""
        found = []
        for received in self.requests:
            result = _tool_result(received.body)
            if result is not None:
                found.append(result)
        return found

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        raw = await read_body(receive)
        path = scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if scope["method"] != "POST" or path not in ("/v1/messages", "/v1/chat/completions"):
            await _send(send, 404, b'{"error":{"message":"not found"}}', "application/json")
            return
        body = orjson.loads(raw)
        self.requests.append(Received(path, headers, body))
        async with self._changed:
            self._changed.notify_all()
        call, text = self._plan(body)
        n = next(self._ids)
        if path == "/v1/messages":
            if body.get("stream"):
                await _send(send, 200, _anthropic_stream(body, n, call, text), "text/event-stream")
            else:
                await _send(send, 200, _anthropic_body(body, n, call, text), "application/json")
        elif body.get("stream"):
            await _send(send, 200, _chat_stream(body, n, call, text), "text/event-stream")
        else:
            await _send(send, 200, _chat_body(body, n, call, text), "application/json")

    def _plan(self, body: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
        """The tool call to make (its name and input), or None and the text to answer with."""
        result = _tool_result(body)
        if result is not None:
            return None, f"{FINAL_TEXT} {result.strip()}"
        tools = _tool_names(body)
        if self.delegate and AGENT_TOOL in tools and SUBAGENT_TASK not in orjson.dumps(body):
            task = {
                "description": "Run the task",
                "prompt": SUBAGENT_TASK.decode() + ": run the shell command.",
                "subagent_type": "general-purpose",
            }
            return {"name": AGENT_TOOL, "input": task}, ""
        if SHELL_TOOL in tools:
            task = {"command": self.command, "description": "Run the task"}
            return {"name": SHELL_TOOL, "input": task}, ""
        return None, SIDE_TEXT


def _tool_names(body: dict[str, Any]) -> list[str]:
    names = []
    for tool in body.get("tools") or ():
        function = tool.get("function") if tool.get("type") == "function" else tool
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            names.append(function["name"])
    return names


def _tool_result(body: dict[str, Any]) -> str | None:
    """The output of the last turn's tool result (either wire); None when it has none."""
    messages = body.get("messages") or []
    if not messages:
        return None
    last = messages[-1]
    if last.get("role") == "tool":
        return _text(last.get("content"))
    if last.get("role") != "user" or not isinstance(last.get("content"), list):
        return None
    for block in last["content"]:
        if isinstance(block, dict) and block.get("type") == "tool_result":
            return _text(block.get("content"))
    return None


def _text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return ""


def _anthropic_usage(output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": 12,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": output_tokens,
    }


def _anthropic_body(body: dict[str, Any], n: int, call: dict[str, Any] | None, text: str) -> bytes:
    content: list[dict[str, Any]]
    if call is not None:
        content = [
            {
                "type": "tool_use",
                "id": f"toolu_{n:04d}",
                "name": call["name"],
                "input": call["input"],
            }
        ]
    else:
        content = [{"type": "text", "text": text}]
    return orjson.dumps(
        {
            "id": f"msg_{n:04d}",
            "type": "message",
            "role": "assistant",
            "model": body.get("model"),
            "content": content,
            "stop_reason": "tool_use" if call is not None else "end_turn",
            "stop_sequence": None,
            "usage": _anthropic_usage(5),
        }
    )


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"


def _anthropic_stream(
    body: dict[str, Any], n: int, call: dict[str, Any] | None, text: str
) -> bytes:
    message: dict[str, Any] = {
        "id": f"msg_{n:04d}",
        "type": "message",
        "role": "assistant",
        "model": body.get("model"),
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": _anthropic_usage(1),
    }
    out = _event("message_start", {"message": message})
    if call is not None:
        block = {"type": "tool_use", "id": f"toolu_{n:04d}", "name": call["name"], "input": {}}
        delta = {"type": "input_json_delta", "partial_json": orjson.dumps(call["input"]).decode()}
    else:
        block = {"type": "text", "text": ""}
        delta = {"type": "text_delta", "text": text}
    out += _event("content_block_start", {"index": 0, "content_block": block})
    out += _event("content_block_delta", {"index": 0, "delta": delta})
    out += _event("content_block_stop", {"index": 0})
    stop = "tool_use" if call is not None else "end_turn"
    out += _event(
        "message_delta",
        {"delta": {"stop_reason": stop, "stop_sequence": None}, "usage": {"output_tokens": 5}},
    )
    return out + _event("message_stop", {})


def _chat_usage() -> dict[str, Any]:
    return {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}


def _chat_body(body: dict[str, Any], n: int, call: dict[str, Any] | None, text: str) -> bytes:
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if call is not None:
        message["tool_calls"] = [
            {
                "id": f"call_{n:04d}",
                "type": "function",
                "function": {
                    "name": call["name"],
                    "arguments": orjson.dumps(call["input"]).decode(),
                },
            }
        ]
    choice = {
        "index": 0,
        "message": message,
        "finish_reason": "tool_calls" if call is not None else "stop",
    }
    return orjson.dumps(
        {
            "id": f"chatcmpl-{n:04d}",
            "object": "chat.completion",
            "created": 1_800_000_000,
            "model": body.get("model"),
            "choices": [choice],
            "usage": _chat_usage(),
        }
    )


def _chat_stream(body: dict[str, Any], n: int, call: dict[str, Any] | None, text: str) -> bytes:
    head = {
        "id": f"chatcmpl-{n:04d}",
        "object": "chat.completion.chunk",
        "created": 1_800_000_000,
        "model": body.get("model"),
    }

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return b"data: " + orjson.dumps({**head, "choices": [choice]}) + b"\n\n"

    out = chunk({"role": "assistant", "content": ""})
    if call is not None:
        function = {"name": call["name"], "arguments": orjson.dumps(call["input"]).decode()}
        out += chunk(
            {
                "tool_calls": [
                    {"index": 0, "id": f"call_{n:04d}", "type": "function", "function": function}
                ]
            }
        )
        out += chunk({}, "tool_calls")
    else:
        out += chunk({"content": text})
        out += chunk({}, "stop")
    if (body.get("stream_options") or {}).get("include_usage"):
        out += b"data: " + orjson.dumps({**head, "choices": [], "usage": _chat_usage()}) + b"\n\n"
    return out + b"data: [DONE]\n\n"


async def _send(send: Send, status: int, body: bytes, content_type: str) -> None:
    headers = [(b"content-type", content_type.encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})

"""A scripted coding-agent upstream, as a bare ASGI app speaking the three wires: chat completions
(`POST /v1/chat/completions`), the Responses API (`POST /v1/responses`) and Anthropic's Messages
(`POST /v1/messages`), streamed or not, shaped like the real APIs' answers.

Its script is what a model does with one shell task, the same on every wire:

- a request whose last turn is a tool's output: a final text answer, `FINAL_TEXT` followed by
  that output;
- a request that offers tools: `call` when it is set (a tool name and its arguments); else, with
  `delegate`, a call of Claude Code's `Agent` tool handing the task to a sub-agent (whose own
  conversation, marked by `SUBAGENT_TASK`, then runs the shell); else a call of the agent's shell
  tool running `command`: Claude Code's `Bash` (`command`), Codex's `exec_command` (`cmd`) or
  `shell` (`command`, an argument list);
- anything else (no tools, or none it knows: an agent's side requests): `FINAL_TEXT`.

Streams carry usage on chat only when `stream_options.include_usage` asks, as OpenAI's do. Every
request is recorded (`requests`: path, lower-cased headers, parsed body).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

import orjson
from starlette.types import Receive, Scope, Send

from tests.fakes.asgi import lifespan, read_body

PROOF_FILE: Final = "proof.txt"
COMMAND: Final = f"echo ran-by-the-agent > {PROOF_FILE}"
FINAL_TEXT: Final = "All done. The command printed:"
AGENT_TOOL: Final = "Agent"
SUBAGENT_TASK: Final = "SUBAGENT-TASK"  # marks the sub-agent's own conversation
_USAGE_IN, _USAGE_OUT = 20, 5

Call = tuple[str, str]  # a tool's name and its arguments (JSON text)
Events = Iterator[tuple[str, Any]]  # first the whole answer, then the stream's (event, data)


@dataclass(frozen=True, slots=True)
class Received:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


class AgentUpstream:
    """The scripted model. `command` is what its shell tool call runs; `url` is where it
    serves, for a test that keeps it there."""

    def __init__(self, command: str = COMMAND, *, delegate: bool = False) -> None:
        self.command = command
        self.delegate = delegate
        self.call: Call | None = None  # the tool call to make, if not the script's
        self.url = ""
        self.requests: list[Received] = []
        self._ids = itertools.count(1)

    @property
    def tool_results(self) -> list[str]:
        """The tool outputs the agent sent back (each request's that ended with one), in order."""
        outputs = (_tool_output(r.path, r.body) for r in self.requests)
        return [output for output in outputs if output is not None]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        raw = await read_body(receive)
        path = scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        writer = _WRITERS.get(path)
        if scope["method"] != "POST" or writer is None:
            await _send(send, 404, b'{"error": {"message": "not found"}}')
            return
        body = orjson.loads(raw or b"{}")
        self.requests.append(Received(path, headers, body))
        call, text = self._plan(path, body, raw)
        events = writer(body, f"{next(self._ids):04d}", call, text)
        if not body.get("stream"):
            await _send(send, 200, orjson.dumps(next(events)[1]))
            return
        next(events)  # the whole answer: a stream is the rest
        sse = (b"content-type", b"text/event-stream")
        await send({"type": "http.response.start", "status": 200, "headers": [sse]})
        for name, data in events:
            head = b"event: " + name.encode() + b"\n" if name else b""
            payload = data if isinstance(data, bytes) else orjson.dumps(data)
            frame = head + b"data: " + payload + b"\n\n"
            await send({"type": "http.response.body", "body": frame, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    def _plan(self, path: str, body: dict[str, Any], raw: bytes) -> tuple[Call | None, str]:
        """The tool call to make, or None and the text to answer with."""
        output = _tool_output(path, body)
        if output is not None:
            return None, f"{FINAL_TEXT} {output.strip()}".rstrip()
        tools = _tool_names(body.get("tools"))
        if tools and self.call is not None:
            return self.call, ""
        if self.delegate and AGENT_TOOL in tools and SUBAGENT_TASK.encode() not in raw:
            task = {
                "description": "Run the task",
                "prompt": f"{SUBAGENT_TASK}: run the shell command.",
                "subagent_type": "general-purpose",
            }
            return (AGENT_TOOL, _json(task)), ""
        if "Bash" in tools:
            return ("Bash", _json({"command": self.command, "description": "Run the task"})), ""
        if "exec_command" in tools:
            return ("exec_command", _json({"cmd": self.command})), ""
        if "shell" in tools:
            return ("shell", _json({"command": ["bash", "-lc", self.command]})), ""
        return None, FINAL_TEXT


def _json(value: object) -> str:
    return orjson.dumps(value).decode()


def _tool_names(tools: object) -> list[str]:
    """The names of declared tools, in the chat, Responses or Messages shape."""
    names = []
    for tool in tools if isinstance(tools, list) else ():
        if isinstance(tool, dict):
            function = tool.get("function")
            name = function.get("name") if isinstance(function, dict) else tool.get("name")
            if isinstance(name, str):
                names.append(name)
    return names


def _tool_output(path: str, body: dict[str, Any]) -> str | None:
    """The text of the tool output that ends the request (on its wire); None when its last
    turn is no tool's output (a user's message, an agent's notification)."""
    if path == "/v1/responses":
        items = body.get("input")
        last = items[-1] if isinstance(items, list) and items else None
        if isinstance(last, dict) and str(last.get("type")).endswith("_call_output"):
            return _text(last.get("output"))
        return None
    messages = body.get("messages")
    last = messages[-1] if isinstance(messages, list) and messages else None
    if not isinstance(last, dict):
        return None
    if last.get("role") == "tool":
        return _text(last.get("content"))
    blocks = last.get("content") if last.get("role") == "user" else None
    for block in blocks if isinstance(blocks, list) else ():
        if isinstance(block, dict) and block.get("type") == "tool_result":
            return _text(block.get("content"))
    return None


def _text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return ""


async def _send(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _chat(body: dict[str, Any], n: str, call: Call | None, text: str) -> Events:
    usage = {
        "prompt_tokens": _USAGE_IN,
        "completion_tokens": _USAGE_OUT,
        "total_tokens": _USAGE_IN + _USAGE_OUT,
    }
    base = {"id": f"chatcmpl-{n}", "created": 1_700_000_000, "model": body.get("model")}
    call_id = f"call_{n}"
    if call is None:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish = "stop"
    else:
        function = {"name": call[0], "arguments": call[1]}
        message = {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": function}],
        }
        finish = "tool_calls"
    choice = {"index": 0, "message": message, "finish_reason": finish}
    yield "", {**base, "object": "chat.completion", "choices": [choice], "usage": usage}
    chunk = {**base, "object": "chat.completion.chunk"}
    yield "", {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    if call is None:
        yield "", {**chunk, "choices": [{"index": 0, "delta": {"content": text}}]}
    else:
        # The arguments in two pieces, as a streamed call's arrive.
        name, arguments = call
        half = len(arguments) // 2
        first = {"index": 0, "id": call_id, "type": "function"}
        for part in (
            {**first, "function": {"name": name, "arguments": arguments[:half]}},
            {"index": 0, "function": {"arguments": arguments[half:]}},
        ):
            yield "", {**chunk, "choices": [{"index": 0, "delta": {"tool_calls": [part]}}]}
    yield "", {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}
    if (body.get("stream_options") or {}).get("include_usage"):
        yield "", {**chunk, "choices": [], "usage": usage}
    yield "", b"[DONE]"


def _responses(body: dict[str, Any], n: str, call: Call | None, text: str) -> Events:
    if call is None:
        item: dict[str, Any] = {
            "id": f"msg_{n}",
            "type": "message",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }
    else:
        item = {
            "id": f"fc_{n}",
            "type": "function_call",
            "status": "completed",
            "call_id": f"call_{n}",
            "name": call[0],
            "arguments": call[1],
        }
    usage = {
        "input_tokens": _USAGE_IN,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": _USAGE_OUT,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": _USAGE_IN + _USAGE_OUT,
    }
    response = {
        "id": f"resp_{n}",
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
    sequence = itertools.count()
    for kind, fields in (
        ("response.created", {"response": pending}),
        ("response.output_item.added", {"output_index": 0, "item": item}),
        ("response.output_item.done", {"output_index": 0, "item": item}),
        ("response.completed", {"response": response}),
    ):
        yield kind, {"type": kind, "sequence_number": next(sequence), **fields}


def _messages(body: dict[str, Any], n: str, call: Call | None, text: str) -> Events:
    if call is None:
        block: dict[str, Any] = {"type": "text", "text": text}
        stop = "end_turn"
    else:
        block = {
            "type": "tool_use",
            "id": f"toolu_{n}",
            "name": call[0],
            "input": orjson.loads(call[1]),
        }
        stop = "tool_use"
    usage = {
        "input_tokens": _USAGE_IN,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": _USAGE_OUT,
    }
    message = {
        "id": f"msg_{n}",
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
    if call is None:
        opened: dict[str, Any] = {"type": "text", "text": ""}
        delta: dict[str, Any] = {"type": "text_delta", "text": text}
    else:
        opened = {**block, "input": {}}
        delta = {"type": "input_json_delta", "partial_json": call[1]}
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


_WRITERS: Final = {
    "/v1/chat/completions": _chat,
    "/v1/responses": _responses,
    "/v1/messages": _messages,
}

"""What the Gemini API and Vertex AI tests share: the fakes running on loopback, a gateway over
them, and the conversations each client wire holds with a tool in the middle."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from anthropic.types import MessageParam
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from tests.clients import Clients, open_clients
from tests.fakes.gemini_upstream import AFTER_TOOL_TEXT, TOOL_ARGS
from tests.schemas import validate, validate_stream

CHAT: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hello there"},
]
WEATHER_TOOL: ChatCompletionToolParam = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
RESPONSES_TOOL: dict[str, Any] = {"type": "function", **WEATHER_TOOL["function"]}
MESSAGES_TOOL: dict[str, Any] = {
    "name": "get_weather",
    "description": "The forecast for a city.",
    "input_schema": WEATHER_TOOL["function"]["parameters"],
}
WEATHER = '{"forecast": "sunny"}'


@asynccontextmanager
async def open_gateway(
    providers: dict[str, Any], *models: dict[str, Any], **extra: Any
) -> AsyncIterator[Clients]:
    async with open_clients(providers, list(models), **extra) as clients:
        yield clients


def model(name: str, *deployments: str, **extra: Any) -> dict[str, Any]:
    """A model entry; each deployment is written `provider/upstream model`."""
    pairs = (d.split("/", 1) for d in deployments)
    return {"name": name, "deployments": [{"provider": p, "model": m} for p, m in pairs], **extra}


def sse(body: bytes) -> list[Any]:
    return [
        line[6:] if line[6:] == "[DONE]" else json.loads(line[6:])
        for line in body.decode().split("\n")
        if line.startswith("data: ")
    ]


# --- one tool round trip per client wire, checked against the official schemas ------------------


async def chat_tool_round_trip(c: Clients, name: str, *, stream: bool) -> None:
    """Chat: the model calls the tool, the client answers, the model answers in text."""
    body: dict[str, Any] = {"model": name, "messages": CHAT, "tools": [WEATHER_TOOL]}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    first = await c.post("/v1/chat/completions", body)
    assert first.status_code == 200, first.text
    if stream:
        validate_stream("chat", first.content)
        chunks = [e for e in sse(first.content) if e != "[DONE]"]
        calls: dict[int, dict[str, Any]] = {}  # streamed by index: id and name, then arguments
        for e in chunks:
            for ch in e["choices"]:
                for part in ch["delta"].get("tool_calls", ()):
                    known = calls.setdefault(
                        part["index"], {"id": None, "function": {"name": "", "arguments": ""}}
                    )
                    known["id"] = known["id"] or part.get("id")
                    for key in ("name", "arguments"):
                        known["function"][key] += part.get("function", {}).get(key) or ""
        assert [
            ch["finish_reason"] for e in chunks for ch in e["choices"] if ch["finish_reason"]
        ] == ["tool_calls"]
        (call,) = calls.values()
        assert chunks[-1]["usage"]["prompt_tokens"] > 0
    else:
        answer = first.json()
        validate("chat", "CreateChatCompletionResponse", answer)
        assert answer["choices"][0]["finish_reason"] == "tool_calls"
        (call,) = answer["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == TOOL_ARGS
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": "get_weather", "arguments": call["function"]["arguments"]},
            }
        ],
    }
    tool = {"role": "tool", "tool_call_id": call["id"], "content": WEATHER}
    conversation: list[Any] = [*CHAT, assistant, tool]
    if stream:  # the SDK's own stream reader over the translated chunks
        reply = await c.openai.chat.completions.create(
            model=name, messages=conversation, tools=[WEATHER_TOOL], stream=True
        )
        text = "".join([ch.choices[0].delta.content or "" async for ch in reply if ch.choices])
    else:
        second = await c.openai.chat.completions.create(
            model=name, messages=conversation, tools=[WEATHER_TOOL]
        )
        text = second.choices[0].message.content or ""
    assert text.split() == AFTER_TOOL_TEXT.split()


async def responses_tool_round_trip(c: Clients, name: str, *, stream: bool) -> None:
    """Responses: a function_call item, then its output in the next request, then text."""
    body: dict[str, Any] = {"model": name, "input": "Weather in Paris?", "tools": [RESPONSES_TOOL]}
    first = await c.post("/v1/responses", body | ({"stream": True} if stream else {}))
    assert first.status_code == 200, first.text
    if stream:
        validate_stream("responses", first.content)
        done = [e for e in sse(first.content) if e["type"] == "response.completed"]
        output = done[0]["response"]["output"]
    else:
        validate("responses", "ResponseResource", first.json())
        output = first.json()["output"]
    (call,) = [item for item in output if item["type"] == "function_call"]
    assert json.loads(call["arguments"]) == TOOL_ARGS
    result = {"type": "function_call_output", "call_id": call["call_id"], "output": WEATHER}
    items: list[Any] = [call, result]
    tools: list[Any] = [RESPONSES_TOOL]
    if stream:
        events = await c.openai.responses.create(
            model=name, input=items, tools=tools, store=False, stream=True
        )
        text = "".join([e.delta async for e in events if e.type == "response.output_text.delta"])
    else:
        second = await c.openai.responses.create(model=name, input=items, tools=tools, store=False)
        text = second.output_text
    assert text.split() == AFTER_TOOL_TEXT.split()


async def messages_tool_round_trip(
    c: Clients, name: str, *, stream: bool, passthrough: bool = False
) -> None:
    """Messages: a tool_use block, a tool_result in the next request, then text. The schema
    check is the translation's (`passthrough`: the upstream's own events, relayed unchanged)."""
    messages: list[MessageParam] = [{"role": "user", "content": "Weather in Paris?"}]
    body: dict[str, Any] = {
        "model": name,
        "max_tokens": 200,
        "system": "Be brief.",
        "messages": messages,
        "tools": [MESSAGES_TOOL],
    }
    first = await c.post("/v1/messages", body | ({"stream": True} if stream else {}))
    assert first.status_code == 200, first.text
    if stream:
        if not passthrough:
            validate_stream("messages", first.content)
        events = sse(first.content)
        starts = [e for e in events if e["type"] == "content_block_start"]
        block = next(e["content_block"] for e in starts if e["content_block"]["type"] == "tool_use")
        arguments = "".join(
            e["delta"]["partial_json"]
            for e in events
            if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"
        )
        tool_use = {**block, "input": json.loads(arguments or "{}")}
        stop = next(e for e in events if e["type"] == "message_delta")["delta"]["stop_reason"]
    else:
        if not passthrough:
            validate("messages", "Message", first.json())
        tool_use = next(b for b in first.json()["content"] if b["type"] == "tool_use")
        stop = first.json()["stop_reason"]
    assert stop == "tool_use"
    assert tool_use["input"] == TOOL_ARGS
    use = {k: tool_use[k] for k in ("type", "id", "name", "input")}
    conversation: list[Any] = [
        *messages,
        {"role": "assistant", "content": [use]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": tool_use["id"], "content": WEATHER}],
        },
    ]
    tools: list[Any] = [MESSAGES_TOOL]
    if stream:
        async with c.anthropic.messages.stream(
            model=name, max_tokens=200, tools=tools, messages=conversation
        ) as reader:
            text = await reader.get_final_text()
    else:
        followed = await c.anthropic.messages.create(
            model=name, max_tokens=200, tools=tools, messages=conversation
        )
        text = "".join(b.text for b in followed.content if b.type == "text")
    assert text.split() == AFTER_TOOL_TEXT.split()

"""Azure OpenAI (`type: azure`) end to end: the official SDKs (OpenAI chat and Responses,
Anthropic Messages) through the gateway to a fake of Azure's chat completions API
(`tests/fakes/azure_upstream.py`) that checks the path shape, the api-version, the credential,
and answers with Azure's filter results; both run on loopback in the test's loop.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anthropic
import httpx
import openai
import pytest
from anthropic.types import Message, ToolParam
from openai.types.chat import ChatCompletionToolParam
from openai.types.responses import FunctionToolParam, Response, ResponseFunctionToolCall
from openai.types.responses.response_input_param import FunctionCallOutput

from tests.conftest import Gateway, gateway_settings, run_gateway, serve
from tests.fakes.azure_upstream import AFTER_TOOL_TEXT, WORDS, AzureFake
from tests.schemas import SchemaWire, parse_sse, validate, validate_stream
from tests.timing import scaled

API_KEY = "azure-key-0123456789abcdef0123456789"  # the configured upstream key
TOKEN = "eyJ0eXAiOiJKV1QifQ.entra-token-one.signature-one"
ROTATED = "eyJ0eXAiOiJKV1QifQ.entra-token-two-rotated.signature-two"
VERSION = "2024-10-21"
TEXT = "".join(WORDS)
PARAMETERS: dict[str, object] = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
WEATHER: ChatCompletionToolParam = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The forecast for a city.",
        "parameters": PARAMETERS,
    },
}
WATCHDOG_S = 5.0


def azure(url: str, **extra: Any) -> dict[str, Any]:
    spec = {"type": "azure", "base_url": url, "api_version": VERSION, "api_key": API_KEY}
    return spec | extra


def model(name: str, *deployments: str, **extra: Any) -> dict[str, Any]:
    """A model; each deployment written `provider/model`, weighted from first to last."""
    pairs = [d.split("/", 1) for d in deployments]
    return {
        "name": name,
        # The first deployment is almost always tried first (a weighted random order).
        "deployments": [
            {"provider": p, "model": m, "weight": 1e6 if i == 0 else 1e-6}
            for i, (p, m) in enumerate(pairs)
        ],
        **extra,
    }


@pytest.fixture
async def fake() -> AsyncIterator[tuple[AzureFake, str]]:
    upstream = AzureFake(api_key=API_KEY, tokens={TOKEN}, slow_ms=scaled(3000))
    async with serve(upstream) as url:
        yield upstream, url


class Clients:
    """A running gateway, and the SDK clients for it."""

    def __init__(self, gw: Gateway, stack: AsyncExitStack) -> None:
        self.gw = gw
        self.chat = openai.AsyncOpenAI(base_url=gw.base_url, api_key="client", max_retries=0)
        self.messages = anthropic.AsyncAnthropic(base_url=gw.url, api_key="client", max_retries=0)
        self.http = httpx.AsyncClient(base_url=gw.url, timeout=10)
        stack.push_async_callback(self.chat.close)
        stack.push_async_callback(self.messages.close)
        stack.push_async_callback(self.http.aclose)


@asynccontextmanager
async def gateway(
    providers: dict[str, Any], *models: dict[str, Any], **extra: Any
) -> AsyncIterator[Clients]:
    settings = gateway_settings(providers, list(models), **extra)
    async with run_gateway(settings) as gw, AsyncExitStack() as stack:
        yield Clients(gw, stack)


# --- the wire: paths, versions, credentials, filter results --------------------------------------


async def test_dated_version_uses_the_deployment_path_and_the_api_key(
    fake: tuple[AzureFake, str],
) -> None:
    """A dated api_version: `/openai/deployments/{model}/chat/completions?api-version=...` with
    the `api-key` header; the stream reaches the client without Azure's filter-only events."""
    upstream, url = fake
    async with gateway({"az": azure(url)}, model("gpt", "az/gpt-4o-prod")) as clients:
        chat = clients.chat
        answer = await chat.chat.completions.create(
            model="gpt", messages=[{"role": "user", "content": "hi"}]
        )
        stream = await chat.chat.completions.create(
            model="gpt",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    assert answer.choices[0].message.content == TEXT
    assert answer.usage is not None and answer.usage.completion_tokens == len(WORDS)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == TEXT
    # No event with empty choices but the usage one; none holding only filter results.
    assert [c.usage is not None for c in chunks if not c.choices] == [True]
    assert all(c.choices[0].delta is not None for c in chunks if c.choices)
    assert upstream.refused == []
    for received in upstream.requests:
        assert received.path == "/openai/deployments/gpt-4o-prod/chat/completions"
        assert received.query == {"api-version": [VERSION]}
        assert received.headers["api-key"] == API_KEY
        assert "authorization" not in received.headers


async def test_v1_names_the_deployment_in_the_body_and_sends_the_entra_token(
    fake: tuple[AzureFake, str],
) -> None:
    """`api_version: v1`: `/openai/v1/chat/completions`, the deployment as the body's model,
    an Entra ID token from the config as `Authorization: Bearer`."""
    upstream, url = fake
    spec = {"type": "azure", "base_url": url, "api_version": "v1", "azure_ad_token": TOKEN}
    async with gateway({"az": spec}, model("gpt", "az/gpt-4o-prod")) as clients:
        chat = clients.chat
        answer = await chat.chat.completions.create(
            model="gpt", messages=[{"role": "user", "content": "hi"}]
        )
    assert answer.choices[0].message.content == TEXT
    (received,) = upstream.requests
    assert received.path == "/openai/v1/chat/completions" and received.query == {}
    assert received.body["model"] == "gpt-4o-prod"
    assert received.headers["authorization"] == f"Bearer {TOKEN}"
    assert "api-key" not in received.headers


# --- every client wire, streamed and not, with a tool round trip ---------------------------------


async def test_openai_chat_tool_round_trip(fake: tuple[AzureFake, str]) -> None:
    upstream, url = fake
    async with gateway({"az": azure(url)}, model("gpt", "az/gpt-4o-prod")) as clients:
        chat = clients.chat
        for stream in (False, True):
            messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
            if stream:
                events = await chat.chat.completions.create(
                    model="gpt",
                    messages=messages,
                    tools=[WEATHER],
                    stream=True,
                )
                calls: dict[int, dict[str, str]] = {}
                finish = None
                async for chunk in events:
                    for choice in chunk.choices:
                        finish = choice.finish_reason or finish
                        for call in choice.delta.tool_calls or ():
                            into = calls.setdefault(call.index, {"arguments": ""})
                            if call.id:
                                into["id"] = call.id
                            if call.function and call.function.name:
                                into["name"] = call.function.name
                            if call.function and call.function.arguments:
                                into["arguments"] += call.function.arguments
                assert finish == "tool_calls"
                call_id, name, arguments = (
                    calls[0]["id"],
                    calls[0]["name"],
                    calls[0]["arguments"],
                )
            else:
                first = await chat.chat.completions.create(
                    model="gpt",
                    messages=messages,
                    tools=[WEATHER],
                )
                assert first.choices[0].finish_reason == "tool_calls"
                (tool_call,) = first.choices[0].message.tool_calls or []
                call_id = tool_call.id
                name, arguments = tool_call.function.name, tool_call.function.arguments  # type: ignore[union-attr]
            assert name == "get_weather" and json.loads(arguments) == {"city": "Paris"}
            messages += [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {"name": name, "arguments": arguments},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": call_id, "content": "sunny"},
            ]
            second = await chat.chat.completions.create(
                model="gpt",
                messages=messages,
                tools=[WEATHER],
            )
            assert second.choices[0].message.content == AFTER_TOOL_TEXT
    assert upstream.refused == []
    assert upstream.requests[-1].body["messages"][-1]["role"] == "tool"


async def test_responses_tool_round_trip(fake: tuple[AzureFake, str]) -> None:
    """The Responses API, translated to Azure's chat completions, streamed and not."""
    upstream, url = fake
    tool: FunctionToolParam = {
        "type": "function",
        "name": "get_weather",
        "parameters": PARAMETERS,
        "strict": False,
    }
    async with gateway({"az": azure(url)}, model("gpt", "az/gpt-4o-prod")) as clients:
        chat = clients.chat
        for stream in (False, True):
            if stream:
                events = await chat.responses.create(
                    model="gpt",
                    input="Weather in Paris?",
                    tools=[tool],
                    stream=True,
                )
                first: Response | None = None
                async for event in events:
                    if event.type == "response.completed":
                        first = event.response
                assert first is not None
            else:
                first = await chat.responses.create(
                    model="gpt",
                    input="Weather in Paris?",
                    tools=[tool],
                )
            (call,) = [item for item in first.output if isinstance(item, ResponseFunctionToolCall)]
            assert call.name == "get_weather"
            assert json.loads(call.arguments) == {"city": "Paris"}
            second = await chat.responses.create(
                model="gpt",
                previous_response_id=first.id,
                input=[
                    FunctionCallOutput(
                        type="function_call_output", call_id=call.call_id, output="sunny"
                    )
                ],
                tools=[tool],
            )
            assert second.output_text == AFTER_TOOL_TEXT
    assert upstream.refused == []


async def test_anthropic_messages_tool_round_trip(fake: tuple[AzureFake, str]) -> None:
    """The Messages API, translated to Azure's chat completions, streamed and not."""
    upstream, url = fake
    tool: ToolParam = {
        "name": "get_weather",
        "description": "The forecast for a city.",
        "input_schema": PARAMETERS,
    }
    async with gateway({"az": azure(url)}, model("gpt", "az/gpt-4o-prod")) as clients:
        messages = clients.messages
        for stream in (False, True):
            asked: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
            if stream:
                async with messages.messages.stream(
                    model="gpt",
                    max_tokens=100,
                    messages=asked,
                    tools=[tool],
                ) as events:
                    first: Message = await events.get_final_message()
            else:
                first = await messages.messages.create(
                    model="gpt",
                    max_tokens=100,
                    messages=asked,
                    tools=[tool],
                )
            assert first.stop_reason == "tool_use"
            (use,) = [block for block in first.content if block.type == "tool_use"]
            assert use.name == "get_weather" and use.input == {"city": "Paris"}
            asked += [
                {"role": "assistant", "content": first.content},
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}],
                },
            ]
            second = await messages.messages.create(
                model="gpt",
                max_tokens=100,
                messages=asked,
                tools=[tool],
            )
            assert second.content[0].type == "text" and second.content[0].text == AFTER_TOOL_TEXT
    assert upstream.refused == []


WIRES: dict[SchemaWire, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    "responses": ("/v1/responses", {"input": "hi"}),
    "messages": (
        "/v1/messages",
        {"max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]},
    ),
}
SCHEMA: dict[SchemaWire, str] = {
    "chat": "CreateChatCompletionResponse",
    "responses": "ResponseResource",
    "messages": "Message",
}


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
@pytest.mark.parametrize("wire", list(WIRES))
async def test_answers_validate_and_content_filter_maps_to_each_wire(
    fake: tuple[AzureFake, str], wire: SchemaWire, stream: bool
) -> None:
    """Each client wire's answer from Azure validates against its schema, a plain one and one
    Azure's filter cut short: `finish_reason: content_filter` is chat's own, Anthropic's
    `stop_reason: refusal`, the Responses API's `incomplete` with reason `content_filter`."""
    upstream, url = fake
    path, body = WIRES[wire]
    models = (model("gpt", "az/gpt-4o-prod"), model("bad", "az/unsafe-prod"))
    async with gateway({"az": azure(url)}, *models) as clients:
        http = clients.http
        answers = {}
        for name in ("gpt", "bad"):
            response = await http.post(path, json={**body, "model": name, "stream": stream})
            assert response.status_code == 200, response.text
            if stream:
                validate_stream(wire, response.text)
                answers[name] = _final(wire, parse_sse(response.text))
            else:
                answer = response.json()
                validate(wire, SCHEMA[wire], answer)
                answers[name] = answer["choices"][0] if wire == "chat" else answer
    assert upstream.refused == []
    if wire == "chat":
        assert answers["gpt"]["finish_reason"] == "stop"
        assert answers["bad"]["finish_reason"] == "content_filter"
    elif wire == "messages":
        assert answers["gpt"]["stop_reason"] == "end_turn"
        assert answers["bad"]["stop_reason"] == "refusal"
    else:
        assert answers["gpt"]["status"] == "completed"
        assert answers["bad"]["status"] == "incomplete"
        assert answers["bad"]["incomplete_details"] == {"reason": "content_filter"}


def _final(wire: str, events: list[tuple[str | None, Any]]) -> dict[str, Any]:
    """What a stream ended with: chat's finish (as a dict), Messages' stop reason, the final
    Responses object. Filter-only events never reach a client."""
    data = [d for _, d in events if d != "[DONE]"]
    if wire == "chat":
        assert all(d["choices"] or d.get("usage") for d in data), data
        assert not any("prompt_filter_results" in d for d in data)
        return {
            "finish_reason": next(
                c["finish_reason"] for d in data for c in d["choices"] if c["finish_reason"]
            )
        }
    if wire == "messages":
        return {
            "stop_reason": next(
                d["delta"]["stop_reason"] for d in data if d["type"] == "message_delta"
            )
        }
    (done,) = [
        d["response"] for d in data if d["type"] in ("response.completed", "response.incomplete")
    ]
    return dict(done)

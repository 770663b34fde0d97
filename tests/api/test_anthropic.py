"""Both wires end to end: OpenAI clients on Anthropic deployments, Anthropic clients on any one.

Real HTTP on loopback with the official SDKs as clients: the gateway, a scripted fake of the
Messages API (`tests/fakes/anthropic_upstream.py`) and the simulated OpenAI-compatible upstream
all run under uvicorn in the test's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import anthropic
import httpx
import openai
import pytest
from anthropic.types import (
    Message,
    MessageParam,
    RawContentBlockDeltaEvent,
    RawMessageDeltaEvent,
    RawMessageStreamEvent,
    TextBlock,
    TextDelta,
)
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from tests.clients import CLIENT_KEY, Clients, open_clients
from tests.conftest import Upstream, serve
from tests.fakes.anthropic_upstream import (
    AFTER_TOOL_TEXT,
    TOOL_INPUT,
    TOOL_TEXT,
    AnthropicFake,
    Received,
    answer_text,
)

API_KEY = "sk-ant-api03-configured-upstream-key-0123456789"  # what the config gives the gateway
WATCHDOG_S = 5.0  # only reached when a test is broken; conditions are awaited, not slept on
CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello there"}]
MESSAGES: list[MessageParam] = [{"role": "user", "content": "hello there"}]
WEATHER_TOOL: ChatCompletionToolParam = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
# Many words, each paced: a stream that outlives the watchdog unless someone closes it.
ENDLESS = "claude-x@words=500,slow_ms=20"


class AnthropicUpstream:
    """The fake Messages API running for real on loopback."""

    def __init__(self, fake: AnthropicFake, url: str) -> None:
        self.fake = fake
        self.url = url  # no /v1: the adapter adds /v1/messages, like the real base URL

    @property
    def requests(self) -> list[Received]:
        return self.fake.requests

    @property
    def last(self) -> Received:
        return self.fake.requests[-1]


@pytest.fixture
async def anthropic_upstream() -> AsyncIterator[AnthropicUpstream]:
    """The fake Messages API, accepting only the configured key."""
    fake = AnthropicFake(api_key=API_KEY)
    async with serve(fake) as url:
        yield AnthropicUpstream(fake, url)


OpenGateway = Callable[..., AbstractAsyncContextManager[Clients]]


def model(name: str, *deployments: str, **extra: Any) -> dict[str, Any]:
    """A model entry; each deployment is written `provider/upstream model`."""
    pairs = (d.split("/", 1) for d in deployments)
    return {"name": name, "deployments": [{"provider": p, "model": m} for p, m in pairs], **extra}


@pytest.fixture
def open_gateway(anthropic_upstream: AnthropicUpstream) -> OpenGateway:
    """Opens a gateway serving `models` over providers `anthropic` (the fake), `local` (an
    in-process simulated provider) and, given `sim=upstream`, `sim` (the simulator over HTTP)."""

    @asynccontextmanager
    async def open_(*models: dict[str, Any], sim: Upstream | None = None) -> AsyncIterator[Clients]:
        providers: dict[str, Any] = {
            "anthropic": {
                "type": "anthropic",
                "base_url": anthropic_upstream.url,
                "api_key": API_KEY,
            },
            "local": {"type": "simulated", "default_profile": {"output_tokens": 4}},
        }
        if sim is not None:
            providers["sim"] = {"type": "vllm", "base_url": sim.base_url}
        async with open_clients(providers, list(models)) as clients:
            yield clients

    return open_


async def wait_for(fake: AnthropicFake, predicate: Callable[[AnthropicFake], bool]) -> None:
    async with asyncio.timeout(WATCHDOG_S):
        await fake.wait_for(predicate)


def text_of(message: Message) -> str:
    """The text of a message that holds exactly one block, a text block."""
    (block,) = message.content
    assert isinstance(block, TextBlock)
    return block.text


def streamed_text(events: list[RawMessageStreamEvent]) -> str:
    """The text deltas of a Messages stream, joined."""
    return "".join(
        e.delta.text
        for e in events
        if isinstance(e, RawContentBlockDeltaEvent) and isinstance(e.delta, TextDelta)
    )


def sse_data(body: str) -> list[str]:
    """The `data:` payloads of a raw SSE body, in order."""
    return [line[6:] for line in body.split("\n") if line.startswith("data: ")]


# --- the fake itself ----------------------------------------------------------------------------


async def test_fake_speaks_the_messages_stream_format(
    anthropic_upstream: AnthropicUpstream,
) -> None:
    """The fake's stream has the real API's framing and event order, and counts as finished."""
    fake = anthropic_upstream.fake
    body = {"model": "claude-x@words=2", "max_tokens": 50, "messages": MESSAGES, "stream": True}
    headers = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}
    async with httpx.AsyncClient(base_url=anthropic_upstream.url) as http:
        async with http.stream("POST", "/v1/messages", json=body, headers=headers) as response:
            raw = (await response.aread()).decode()
        refused = await http.post("/v1/messages", json=body, headers={**headers, "x-api-key": "no"})
    frames = [frame.split("\n") for frame in raw.split("\n\n") if frame]
    names = [lines[0].removeprefix("event: ") for lines in frames]
    assert names == [
        "message_start",
        "content_block_start",
        "ping",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert [json.loads(lines[1].removeprefix("data: "))["type"] for lines in frames] == names
    assert response.headers["content-type"].startswith("text/event-stream")
    assert refused.status_code == 401
    assert refused.json()["type"] == "error"
    assert refused.json()["error"]["type"] == "authentication_error"
    await wait_for(fake, lambda f: f.streams_finished == 1)
    assert fake.streams_abandoned == 0


# --- OpenAI clients on an Anthropic deployment ---------------------------------------------------


async def test_openai_chat_round_trips_through_anthropic(
    open_gateway: OpenGateway, anthropic_upstream: AnthropicUpstream
) -> None:
    """A chat request reaches Messages translated (configured key only) and its answer returns."""
    async with open_gateway(model("claude", "anthropic/claude-x")) as c:
        raw = await c.openai.chat.completions.with_raw_response.create(
            model="claude",
            messages=[{"role": "system", "content": "Be brief."}, *CHAT],
            max_tokens=50,
            temperature=0.5,
            stop=["END"],
        )
    received = anthropic_upstream.last
    assert (received.method, received.path) == ("POST", "/v1/messages")
    assert received.body == {
        "model": "claude-x",
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 50,
        "temperature": 0.5,
        "stop_sequences": ["END"],
    }
    assert received.headers["x-api-key"] == API_KEY
    assert received.headers["anthropic-version"] == "2023-06-01"
    assert "authorization" not in received.headers
    assert CLIENT_KEY not in json.dumps(received.headers)
    assert received.headers["x-request-id"] == raw.headers["x-request-id"]
    assert raw.headers["x-tailguard-deployment"] == "anthropic/claude-x"
    assert raw.headers["x-upstream-request-id"].startswith("req_fake")
    completion = raw.parse()
    assert completion.object == "chat.completion"
    assert len(completion.choices) == 1
    choice = completion.choices[0]
    assert (choice.message.role, choice.message.content) == ("assistant", answer_text(5))
    assert choice.message.tool_calls is None
    assert choice.finish_reason == "stop"
    assert completion.usage is not None
    usage = completion.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (4, 5, 9)


async def test_openai_max_tokens_reaches_anthropic(
    open_gateway: OpenGateway, anthropic_upstream: AnthropicUpstream
) -> None:
    """The client's max_tokens caps the answer (finish `length`); else the default is sent."""
    async with open_gateway(model("claude", "anthropic/claude-x")) as c:
        capped = await c.openai.chat.completions.create(model="claude", messages=CHAT, max_tokens=3)
        sent_capped = anthropic_upstream.last.body["max_tokens"]
        uncapped = await c.openai.chat.completions.create(model="claude", messages=CHAT)
        sent_uncapped = anthropic_upstream.last.body["max_tokens"]
    assert (sent_capped, sent_uncapped) == (3, 4096)
    assert capped.choices[0].message.content == answer_text(3)
    assert capped.choices[0].finish_reason == "length"
    assert capped.usage is not None
    assert capped.usage.completion_tokens == 3
    assert uncapped.choices[0].message.content == answer_text(5)
    assert uncapped.choices[0].finish_reason == "stop"


async def test_openai_chat_usage_counts_cached_prompt_tokens(open_gateway: OpenGateway) -> None:
    """Cache reads are part of `prompt_tokens` and reported as `cached_tokens`."""
    async with open_gateway(model("claude", "anthropic/claude-x@cached=7")) as c:
        completion = await c.openai.chat.completions.create(model="claude", messages=CHAT)
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == 2 + 7
    assert completion.usage.prompt_tokens_details is not None
    assert completion.usage.prompt_tokens_details.cached_tokens == 7


async def test_openai_stream_from_anthropic(
    open_gateway: OpenGateway, anthropic_upstream: AnthropicUpstream
) -> None:
    """Text deltas arrive as chunks, the finish reason once, and no usage unless asked for."""
    async with open_gateway(model("claude", "anthropic/claude-x")) as c:
        stream = await c.openai.chat.completions.create(
            model="claude", messages=CHAT, max_tokens=50, stream=True
        )
        chunks = [chunk async for chunk in stream]
    assert anthropic_upstream.last.body["stream"] is True
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert len({chunk.id for chunk in chunks}) == 1
    assert all(len(chunk.choices) == 1 for chunk in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert text == answer_text(5)
    finish_reasons = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert finish_reasons == ["stop"]
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert [chunk.usage for chunk in chunks if chunk.usage is not None] == []


async def test_openai_stream_usage_chunk_when_asked(open_gateway: OpenGateway) -> None:
    """With include_usage a choices-less usage chunk ends the stream; max_tokens maps to length."""
    async with open_gateway(model("claude", "anthropic/claude-x@cached=7")) as c:
        stream = await c.openai.chat.completions.create(
            model="claude",
            messages=CHAT,
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    *content, last = chunks
    assert last.choices == []
    assert last.usage is not None
    usage = last.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (9, 3, 12)
    assert all(chunk.usage is None for chunk in content)
    assert "".join(c.choices[0].delta.content or "" for c in content) == answer_text(3)
    assert content[-1].choices[0].finish_reason == "length"


async def test_openai_stream_ends_with_done(open_gateway: OpenGateway) -> None:
    """On the wire, a translated stream is OpenAI's: `data:` chunks, then `data: [DONE]`."""
    body = {"model": "claude", "messages": CHAT, "stream": True}
    async with (
        open_gateway(model("claude", "anthropic/claude-x")) as c,
        c.http.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        raw = (await response.aread()).decode()
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert "event:" not in raw
    data = sse_data(raw)
    assert data[-1] == "[DONE]"
    assert data.count("[DONE]") == 1
    assert raw.endswith("data: [DONE]\n\n")


async def test_openai_tool_call_round_trip(
    open_gateway: OpenGateway, anthropic_upstream: AnthropicUpstream
) -> None:
    """A tool call comes back as `tool_calls`; the tool's result goes upstream as tool_result."""
    async with open_gateway(model("claude", "anthropic/claude-x@tool")) as c:
        first = await c.openai.chat.completions.create(
            model="claude", messages=CHAT, tools=[WEATHER_TOOL], tool_choice="auto"
        )
        sent = anthropic_upstream.last.body
        message = first.choices[0].message
        assert message.tool_calls is not None
        (call,) = message.tool_calls
        assert call.type == "function"
        follow_up: list[ChatCompletionMessageParam] = [
            *CHAT,
            {
                "role": "assistant",
                "content": message.content,
                "tool_calls": [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {
                            "name": call.function.name,
                            "arguments": call.function.arguments,
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"},
        ]
        second = await c.openai.chat.completions.create(
            model="claude", messages=follow_up, tools=[WEATHER_TOOL]
        )
    assert sent["tools"] == [
        {
            "name": "get_weather",
            "description": "The forecast for a city.",
            "input_schema": WEATHER_TOOL["function"]["parameters"],
        }
    ]
    assert sent["tool_choice"] == {"type": "auto"}
    assert message.content == TOOL_TEXT
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == TOOL_INPUT
    assert first.choices[0].finish_reason == "tool_calls"
    assert anthropic_upstream.last.body["messages"] == [
        {"role": "user", "content": "hello there"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": TOOL_TEXT},
                {"type": "tool_use", "id": call.id, "name": "get_weather", "input": TOOL_INPUT},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": "18 degrees, sunny"}
            ],
        },
    ]
    assert second.choices[0].message.content == AFTER_TOOL_TEXT
    assert second.choices[0].finish_reason == "stop"


async def test_openai_tool_call_streamed(open_gateway: OpenGateway) -> None:
    """Streamed tool calls carry id and name first, then the JSON arguments in pieces."""
    async with open_gateway(model("claude", "anthropic/claude-x@tool")) as c:
        stream = await c.openai.chat.completions.create(
            model="claude", messages=CHAT, tools=[WEATHER_TOOL], stream=True
        )
        chunks = [chunk async for chunk in stream]
    calls = [
        call
        for chunk in chunks
        if chunk.choices
        for call in chunk.choices[0].delta.tool_calls or ()
    ]
    assert {call.index for call in calls} == {0}
    assert calls[0].id is not None
    assert calls[0].id.startswith("toolu_")
    assert calls[0].function is not None
    assert calls[0].function.name == "get_weather"
    assert [call.id for call in calls[1:]] == [None] * (len(calls) - 1)
    arguments = "".join(call.function.arguments or "" for call in calls if call.function)
    assert json.loads(arguments) == TOOL_INPUT
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == TOOL_TEXT
    finish_reasons = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert finish_reasons == ["tool_calls"]


# --- Anthropic clients on an Anthropic deployment: passed through ---------------------------------


async def test_messages_pass_through_to_anthropic(
    open_gateway: OpenGateway, anthropic_upstream: AnthropicUpstream
) -> None:
    """The body is forwarded as sent except for the upstream model name; the key is the config's."""
    async with open_gateway(model("claude", "anthropic/claude-x")) as c:
        message = await c.anthropic.messages.create(
            model="claude", max_tokens=50, system="Be brief.", messages=MESSAGES
        )
    received = anthropic_upstream.last
    assert received.path == "/v1/messages"
    assert received.body == {
        "model": "claude-x",
        "max_tokens": 50,
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "hello there"}],
    }
    assert received.headers["x-api-key"] == API_KEY
    assert received.headers["anthropic-version"] == "2023-06-01"
    assert CLIENT_KEY not in json.dumps(received.headers)
    assert [block.type for block in message.content] == ["text"]
    assert text_of(message) == answer_text(5)
    assert message.stop_reason == "end_turn"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (4, 5)


async def test_anthropic_beta_header_reaches_anthropic_only(
    open_gateway: OpenGateway, anthropic_upstream: AnthropicUpstream, upstream: Upstream
) -> None:
    """A client's `anthropic-beta` flags go to Anthropic deployments and nowhere else."""
    beta = {"anthropic-beta": "prompt-caching-2024-07-31"}
    async with open_gateway(
        model("claude", "anthropic/claude-x"), model("open", "sim/m"), sim=upstream
    ) as c:
        await c.anthropic.messages.create(
            model="claude", max_tokens=5, messages=MESSAGES, extra_headers=beta
        )
        await c.anthropic.messages.create(
            model="open", max_tokens=5, messages=MESSAGES, extra_headers=beta
        )
    assert anthropic_upstream.last.headers["anthropic-beta"] == beta["anthropic-beta"]
    assert upstream.stats.completed == 1


async def test_messages_stream_pass_through(
    open_gateway: OpenGateway, anthropic_upstream: AnthropicUpstream
) -> None:
    """A streamed answer reaches the Anthropic client event for event."""
    async with open_gateway(model("claude", "anthropic/claude-x")) as c:
        stream = await c.anthropic.messages.create(
            model="claude", max_tokens=50, messages=MESSAGES, stream=True
        )
        events = [event async for event in stream]
    assert anthropic_upstream.last.body == {
        "model": "claude-x",
        "max_tokens": 50,
        "messages": [{"role": "user", "content": "hello there"}],
        "stream": True,
    }
    assert [event.type for event in events] == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * 5,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    text = streamed_text(events)
    assert text == answer_text(5)
    (delta,) = [e for e in events if isinstance(e, RawMessageDeltaEvent)]
    assert (delta.delta.stop_reason, delta.usage.output_tokens) == ("end_turn", 5)


async def test_messages_stream_helper_pass_through(open_gateway: OpenGateway) -> None:
    """`messages.stream(...)` assembles the passed-through events into the final message."""
    async with (
        open_gateway(model("claude", "anthropic/claude-x@tool")) as c,
        c.anthropic.messages.stream(
            model="claude",
            max_tokens=50,
            messages=MESSAGES,
            tools=[{"name": "lookup", "input_schema": {"type": "object"}}],
        ) as stream,
    ):
        message = await stream.get_final_message()
    assert [block.type for block in message.content] == ["text", "tool_use"]
    text, tool_use = message.content
    assert text.type == "text"
    assert text.text == TOOL_TEXT
    assert tool_use.type == "tool_use"
    assert (tool_use.name, tool_use.input) == ("lookup", TOOL_INPUT)
    assert message.stop_reason == "tool_use"


# --- Anthropic clients on OpenAI-compatible deployments: translated ------------------------------


@pytest.mark.parametrize(
    ("max_tokens", "words", "stop_reason"), [(50, 5, "end_turn"), (2, 2, "max_tokens")]
)
async def test_messages_translated_for_openai_upstream(
    open_gateway: OpenGateway, upstream: Upstream, max_tokens: int, words: int, stop_reason: str
) -> None:
    """A Messages request served by an OpenAI-compatible server comes back as a Message."""
    async with open_gateway(model("chat", "sim/m"), sim=upstream) as c:
        message = await c.anthropic.messages.create(
            model="chat", max_tokens=max_tokens, system="Be brief.", messages=MESSAGES
        )
    assert message.type == "message"
    assert message.role == "assistant"
    assert message.id.startswith("msg_")
    assert [block.type for block in message.content] == ["text"]
    assert len(text_of(message).split()) == words
    assert message.stop_reason == stop_reason
    assert message.usage.input_tokens == upstream.stats.prompt_tokens
    assert message.usage.input_tokens > 0
    assert message.usage.output_tokens == words


async def test_messages_stream_translated_for_openai_upstream(
    open_gateway: OpenGateway, upstream: Upstream
) -> None:
    """An OpenAI stream reaches the Anthropic client as Messages events, usage included."""
    async with open_gateway(model("chat", "sim/m"), sim=upstream) as c:
        stream = await c.anthropic.messages.create(
            model="chat", max_tokens=50, messages=MESSAGES, stream=True
        )
        events = [event async for event in stream]
    types = [event.type for event in events]
    assert types == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * 5,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    text = streamed_text(events)
    assert len(text.split()) == 5
    (delta,) = [e for e in events if isinstance(e, RawMessageDeltaEvent)]
    assert delta.delta.stop_reason == "end_turn"
    assert delta.usage.output_tokens == 5
    assert delta.usage.input_tokens == upstream.stats.prompt_tokens


@pytest.mark.parametrize("deployment", ["sim/m", "local/m"])
async def test_messages_stream_helper_translated(
    open_gateway: OpenGateway, upstream: Upstream, deployment: str
) -> None:
    """`messages.stream(...)` works against the simulated upstream, over HTTP and in-process."""
    words = 5 if deployment.startswith("sim") else 4
    async with (
        open_gateway(model("chat", deployment), sim=upstream) as c,
        c.anthropic.messages.stream(model="chat", max_tokens=50, messages=MESSAGES) as stream,
    ):
        texts = [text async for text in stream.text_stream]
        message = await stream.get_final_message()
    assert len("".join(texts).split()) == words
    assert [block.type for block in message.content] == ["text"]
    assert text_of(message) == "".join(texts)
    assert message.stop_reason == "end_turn"
    assert message.usage.output_tokens == words
    assert message.usage.input_tokens > 0


# --- errors --------------------------------------------------------------------------------------


async def test_overloaded_anthropic_is_a_503(
    open_gateway: OpenGateway, anthropic_upstream: AnthropicUpstream
) -> None:
    """A 529 from the only deployment is a 503 on both wires, each in its own error shape."""
    async with open_gateway(model("claude", "anthropic/claude-x@overloaded")) as c:
        with pytest.raises(openai.InternalServerError) as on_openai:
            await c.openai.chat.completions.create(model="claude", messages=CHAT)
        with pytest.raises(anthropic.InternalServerError) as on_messages:
            await c.anthropic.messages.create(model="claude", max_tokens=50, messages=MESSAGES)
    assert on_openai.value.status_code == 503
    assert on_openai.value.type == "server_error"
    assert on_openai.value.code == "upstream_overloaded"
    assert "anthropic/claude-x@overloaded" in on_openai.value.message
    assert on_messages.value.status_code == 503
    body = on_messages.value.body
    assert isinstance(body, dict)
    assert (body["type"], body["error"]["type"]) == ("error", "overloaded_error")
    assert len(anthropic_upstream.requests) == 2


async def test_overloaded_anthropic_falls_back(
    open_gateway: OpenGateway, anthropic_upstream: AnthropicUpstream, upstream: Upstream
) -> None:
    """With a fallback model configured, a 529 sends the call there and the headers say so."""
    async with open_gateway(
        model("claude", "anthropic/claude-x@overloaded", fallbacks=["backup"]),
        model("backup", "sim/m"),
        sim=upstream,
    ) as c:
        raw = await c.openai.chat.completions.with_raw_response.create(
            model="claude", messages=CHAT
        )
    completion = raw.parse()
    assert raw.status_code == 200
    assert raw.headers["x-tailguard-route"] == "error_fallback"
    assert raw.headers["x-tailguard-model"] == "backup"
    assert raw.headers["x-tailguard-deployment"] == "sim/m"
    assert raw.headers["x-tailguard-attempts"] == "2"
    assert len((completion.choices[0].message.content or "").split()) == 5
    assert len(anthropic_upstream.requests) == 1


async def test_inband_overload_before_content_fails_over(
    open_gateway: OpenGateway, anthropic_upstream: AnthropicUpstream
) -> None:
    """An error event after a 200 but before any content is a failover, not a client error."""
    async with open_gateway(
        model("claude", "anthropic/claude-x@inband_overloaded", fallbacks=["backup"]),
        model("backup", "anthropic/claude-x"),
    ) as c:
        raw = await c.openai.chat.completions.with_raw_response.create(
            model="claude", messages=CHAT, stream=True
        )
        chunks = [chunk async for chunk in raw.parse()]
    assert raw.headers["x-tailguard-route"] == "error_fallback"
    assert raw.headers["x-tailguard-deployment"] == "anthropic/claude-x"
    assert len({chunk.id for chunk in chunks}) == 1  # nothing of the failed attempt leaked
    assert [c.choices[0].delta.role for c in chunks if c.choices[0].delta.role] == ["assistant"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer_text(5)
    assert chunks[-1].choices[0].finish_reason == "stop"
    models = [request.body["model"] for request in anthropic_upstream.requests]
    assert models == ["claude-x@inband_overloaded", "claude-x"]


async def test_inband_overload_before_content_fails_over_on_messages(
    open_gateway: OpenGateway,
) -> None:
    """The same holds for a passed-through Anthropic stream: the client sees only the fallback."""
    async with open_gateway(
        model("claude", "anthropic/claude-x@inband_overloaded", fallbacks=["backup"]),
        model("backup", "anthropic/claude-x"),
    ) as c:
        stream = await c.anthropic.messages.create(
            model="claude", max_tokens=50, messages=MESSAGES, stream=True
        )
        events = [event async for event in stream]
    assert [event.type for event in events] == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * 5,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0]
    assert start.type == "message_start"
    assert start.message.model == "claude-x"
    text = streamed_text(events)
    assert text == answer_text(5)


async def test_no_content_by_the_ttft_deadline_fails_over(
    open_gateway: OpenGateway, anthropic_upstream: AnthropicUpstream
) -> None:
    """`message_start`, `content_block_start` and `ping` are not a first token: a stream that sends
    only those by the deadline is rescued (by a hedge, as its successor is not yet measured), and
    closed once the successor answers."""
    fake = anthropic_upstream.fake
    async with open_gateway(
        model(
            "claude",
            "anthropic/claude-x@words=1,slow_ms=10000",
            fallbacks=["backup"],
            budget={"ttft_ms": 1000},
        ),
        model("backup", "anthropic/claude-x"),
    ) as c:
        raw = await c.openai.chat.completions.with_raw_response.create(
            model="claude", messages=CHAT, stream=True
        )
        chunks = [chunk async for chunk in raw.parse()]
        await wait_for(fake, lambda f: (f.streams_abandoned, f.streams_finished) == (1, 1))
    assert raw.headers["x-tailguard-route"] == "hedge"
    assert raw.headers["x-tailguard-deployment"] == "anthropic/claude-x"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer_text(5)


async def test_error_after_content_ends_openai_stream_with_error(
    open_gateway: OpenGateway,
) -> None:
    """After content was sent, an upstream error ends the stream with an error and no `[DONE]`."""
    texts: list[str] = []
    body = {"model": "claude", "messages": CHAT, "stream": True}
    async with open_gateway(model("claude", "anthropic/claude-x@error_after=2")) as c:
        stream = await c.openai.chat.completions.create(model="claude", messages=CHAT, stream=True)
        with pytest.raises(openai.APIError) as caught:
            async for chunk in stream:
                texts.append(chunk.choices[0].delta.content or "")
        async with c.http.stream("POST", "/v1/chat/completions", json=body) as response:
            raw = (await response.aread()).decode()
    assert "".join(texts) == answer_text(2)
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["code"] == "upstream_stream_error"
    assert "anthropic/claude-x@error_after=2" in caught.value.message
    assert response.status_code == 200
    data = sse_data(raw)
    assert "[DONE]" not in data
    error = json.loads(data[-1])["error"]
    assert (error["type"], error["code"]) == ("server_error", "upstream_stream_error")
    contents = [json.loads(d)["choices"][0]["delta"].get("content") for d in data[:-1]]
    assert "".join(text or "" for text in contents) == answer_text(2)


async def test_error_after_content_ends_messages_stream_with_error(
    open_gateway: OpenGateway,
) -> None:
    """On /v1/messages a cut stream ends with an Anthropic `error` event the SDK raises on."""
    events: list[Any] = []
    async with open_gateway(model("claude", "anthropic/claude-x@error_after=2")) as c:
        stream = await c.anthropic.messages.create(
            model="claude", max_tokens=50, messages=MESSAGES, stream=True
        )
        with pytest.raises(anthropic.APIStatusError) as caught:
            async for event in stream:
                events.append(event)
    assert [e.type for e in events].count("content_block_delta") == 2
    assert "message_stop" not in [e.type for e in events]
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "api_error"


async def test_upstream_401_is_a_502_naming_the_deployment(open_gateway: OpenGateway) -> None:
    """Rejected credentials are our fault: a 502 on both wires, deployment named, no key."""
    async with open_gateway(model("claude", "anthropic/claude-x@status=401")) as c:
        with pytest.raises(openai.InternalServerError) as on_openai:
            await c.openai.chat.completions.create(model="claude", messages=CHAT)
        with pytest.raises(anthropic.InternalServerError) as on_messages:
            await c.anthropic.messages.create(model="claude", max_tokens=50, messages=MESSAGES)
    assert on_openai.value.status_code == 502
    assert "anthropic/claude-x@status=401" in on_openai.value.message
    assert API_KEY not in on_openai.value.response.text
    assert API_KEY not in str(dict(on_openai.value.response.headers))
    assert on_messages.value.status_code == 502
    body = on_messages.value.body
    assert isinstance(body, dict)
    assert (body["type"], body["error"]["type"]) == ("error", "api_error")
    assert "anthropic/claude-x@status=401" in body["error"]["message"]
    assert API_KEY not in on_messages.value.response.text


async def test_upstream_400_is_final(
    open_gateway: OpenGateway, anthropic_upstream: AnthropicUpstream, upstream: Upstream
) -> None:
    """An upstream 400 says the request is bad: it reaches the client and no fallback is tried."""
    async with open_gateway(
        model("claude", "anthropic/claude-x@status=400", fallbacks=["backup"]),
        model("backup", "sim/m"),
        sim=upstream,
    ) as c:
        with pytest.raises(openai.BadRequestError) as caught:
            await c.openai.chat.completions.create(model="claude", messages=CHAT)
    assert caught.value.status_code == 400
    assert caught.value.type == "invalid_request_error"
    assert len(anthropic_upstream.requests) == 1
    assert upstream.stats.requests == 0


async def test_unknown_model_on_messages_is_anthropic_shaped(open_gateway: OpenGateway) -> None:
    """Errors on /v1/messages use Anthropic's error shape, so its SDK raises the right class."""
    async with open_gateway(model("claude", "anthropic/claude-x")) as c:
        with pytest.raises(anthropic.NotFoundError) as caught:
            await c.anthropic.messages.create(model="nope", max_tokens=50, messages=MESSAGES)
        response = await c.http.post(
            "/v1/messages", json={"model": "nope", "max_tokens": 50, "messages": MESSAGES}
        )
    assert caught.value.status_code == 404
    assert set(response.json()) == {"type", "error", "request_id"}
    assert response.json()["request_id"] == response.headers["x-request-id"]
    assert response.json()["type"] == "error"
    assert set(response.json()["error"]) == {"type", "message"}
    assert response.json()["error"]["type"] == "not_found_error"
    assert "nope" in response.json()["error"]["message"]


# --- disconnects ---------------------------------------------------------------------------------


async def test_anthropic_client_leaving_closes_the_upstream_stream(
    open_gateway: OpenGateway, anthropic_upstream: AnthropicUpstream
) -> None:
    """A Messages client that leaves mid-stream makes the gateway abandon the upstream stream."""
    fake = anthropic_upstream.fake
    async with open_gateway(model("claude", f"anthropic/{ENDLESS}")) as c:
        stream = await c.anthropic.messages.create(
            model="claude", max_tokens=1000, messages=MESSAGES, stream=True
        )
        async with stream:
            event = await anext(stream)
            while event.type != "content_block_delta":
                event = await anext(stream)
        await wait_for(fake, lambda f: f.streams_abandoned == 1)
    assert fake.streams_finished == 0


async def test_openai_client_leaving_closes_the_anthropic_stream(
    open_gateway: OpenGateway, anthropic_upstream: AnthropicUpstream
) -> None:
    """A chat client that leaves a translated stream makes the gateway abandon it upstream."""
    fake = anthropic_upstream.fake
    async with open_gateway(model("claude", f"anthropic/{ENDLESS}")) as c:
        stream = await c.openai.chat.completions.create(
            model="claude", messages=CHAT, max_tokens=1000, stream=True
        )
        async with stream:
            chunk = await anext(stream)
            while not chunk.choices[0].delta.content:
                chunk = await anext(stream)
        await wait_for(fake, lambda f: f.streams_abandoned == 1)
    assert fake.streams_finished == 0


async def test_client_leaving_before_the_first_token_closes_the_upstream(
    open_gateway: OpenGateway, anthropic_upstream: AnthropicUpstream
) -> None:
    """A client that gives up while the gateway still waits for the first token frees it too."""
    fake = anthropic_upstream.fake
    body = {"model": "claude", "max_tokens": 50, "messages": MESSAGES, "stream": True}
    async with open_gateway(model("claude", "anthropic/claude-x@words=1,slow_ms=10000")) as c:

        async def ask() -> None:
            async with c.http.stream("POST", "/v1/messages", json=body) as response:
                await response.aread()

        asking = asyncio.create_task(ask())
        await wait_for(fake, lambda f: len(f.requests) == 1)
        asking.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asking
        await wait_for(fake, lambda f: f.streams_abandoned == 1)
    assert fake.streams_finished == 0

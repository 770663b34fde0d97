"""The Responses API (`/v1/responses`) with the official OpenAI SDK, over real HTTP: translated to
chat completions (the simulator) and to Anthropic Messages (the fake), conversation state kept by
the gateway across providers, and streams that end the way the SDK expects."""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import (
    FunctionToolParam,
    ResponseCompletedEvent,
    ResponseFailedEvent,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseFunctionToolCall,
    ResponseOutputMessage,
)

from tests.api.test_anthropic import API_KEY, AnthropicUpstream, anthropic_upstream  # noqa: F401 (a fixture)
from tests.conftest import Gateway, Upstream, gateway_settings, run_gateway, serve
from tests.fakes.anthropic_upstream import AFTER_TOOL_TEXT, TOOL_INPUT, AnthropicFake
from tests.fakes.responses_upstream import WORDS, ResponsesFake

pytestmark = pytest.mark.timeout(60)

WEATHER_TOOL: FunctionToolParam = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "strict": True,
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}


def _models(*entries: tuple[str, list[str]]) -> list[dict[str, Any]]:
    return [
        {
            "name": name,
            "deployments": [
                {"provider": d.split("/", 1)[0], "model": d.split("/", 1)[1]} for d in deployments
            ],
        }
        for name, deployments in entries
    ]


@pytest.fixture
async def gateway(anthropic_upstream: AnthropicUpstream) -> AsyncIterator[Gateway]:  # noqa: F811
    providers = {
        "anthropic": {"type": "anthropic", "base_url": anthropic_upstream.url, "api_key": API_KEY},
        "local": {"type": "simulated", "default_profile": {"output_tokens": 6}},
    }
    models = _models(
        ("chat", ["local/chat"]),
        ("claude", ["anthropic/claude-x"]),
        ("claude-tool", ["anthropic/claude-x@tool"]),
        ("claude-cut", ["anthropic/claude-x@error_after=2"]),
        # The simulated deployment always fails: the conversation falls back to Anthropic.
        ("flaky", ["local/chat@error_500_rate=1"]),
    )
    models[-1]["fallbacks"] = ["claude"]
    async with run_gateway(gateway_settings(providers, models)) as gw:
        yield gw


@pytest.fixture
async def client(gateway: Gateway) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0) as c:
        yield c


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _text(content: str | list[dict[str, Any]]) -> str:
    """The text of an Anthropic message's content, a string or text blocks."""
    if isinstance(content, str):
        return content
    return "".join(block["text"] for block in content if block["type"] == "text")


def _fake(upstream: AnthropicUpstream) -> AnthropicFake:
    return upstream.fake


async def test_create_translated_to_chat(client: openai.AsyncOpenAI) -> None:
    """A non-streaming response from a chat upstream: one message, usage, a stored id."""
    response = await client.responses.create(
        model="chat", input="Name three colours.", instructions="Be brief."
    )
    assert response.id.startswith("resp_")
    assert response.object == "response"
    assert response.status == "completed"
    assert response.instructions == "Be brief."
    (item,) = response.output
    assert isinstance(item, ResponseOutputMessage)
    assert response.output_text
    assert response.usage is not None
    assert response.usage.output_tokens == 6
    assert response.usage.input_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + 6


async def test_stream_event_sequence(client: openai.AsyncOpenAI) -> None:
    """The stream is the documented sequence, numbered, ending in `response.completed`."""
    stream = await client.responses.create(model="chat", input="Say hi.", stream=True)
    events = [event async for event in stream]
    kinds = [event.type for event in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas == 6
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    done = events[-1]
    assert isinstance(done, ResponseCompletedEvent)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert done.response.output_text == text
    assert done.response.usage is not None and done.response.usage.output_tokens == 6


async def test_stream_helper_collects_the_final_response(client: openai.AsyncOpenAI) -> None:
    async with client.responses.stream(model="claude", input="Hello?") as stream:
        async for _ in stream:
            pass
        final = await stream.get_final_response()
    assert final.status == "completed"
    assert final.output_text == "Hello from the fake Claude"


async def test_translated_to_anthropic(
    client: openai.AsyncOpenAI,
    anthropic_upstream: AnthropicUpstream,  # noqa: F811
) -> None:
    """Instructions become Anthropic's `system`, `max_output_tokens` its `max_tokens`."""
    response = await client.responses.create(
        model="claude", input="Hello?", instructions="Be brief.", max_output_tokens=64
    )
    assert response.output_text == "Hello from the fake Claude"
    sent = _fake(anthropic_upstream).requests[-1].body
    assert sent["system"] == "Be brief."
    assert sent["max_tokens"] == 64
    assert sent["messages"] == [{"role": "user", "content": "Hello?"}]


async def test_function_tool_round_trip(
    client: openai.AsyncOpenAI,
    anthropic_upstream: AnthropicUpstream,  # noqa: F811
) -> None:
    """A function call comes back as a `function_call` item; its output, sent with
    `previous_response_id`, reaches the upstream as a tool result after the whole history."""
    first = await client.responses.create(
        model="claude-tool",
        input="Weather in Paris?",
        tools=[WEATHER_TOOL],
    )
    calls = [item for item in first.output if isinstance(item, ResponseFunctionToolCall)]
    (call,) = calls
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == TOOL_INPUT
    second = await client.responses.create(
        model="claude-tool",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=[WEATHER_TOOL],
    )
    assert second.output_text == AFTER_TOOL_TEXT
    sent = _fake(anthropic_upstream).requests[-1].body["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "user"]
    assert sent[0]["content"] == "Weather in Paris?"
    assert any(b.get("type") == "tool_use" for b in sent[1]["content"])
    (result,) = [b for b in sent[2]["content"] if b.get("type") == "tool_result"]
    assert result["content"] in ("sunny", [{"type": "text", "text": "sunny"}])


async def test_streamed_function_call_arguments(client: openai.AsyncOpenAI) -> None:
    stream = await client.responses.create(
        model="claude-tool",
        input="Weather?",
        tools=[WEATHER_TOOL],
        stream=True,
    )
    events = [event async for event in stream]
    deltas = [e.delta for e in events if isinstance(e, ResponseFunctionCallArgumentsDeltaEvent)]
    assert len(deltas) >= 2
    (done,) = [e for e in events if isinstance(e, ResponseFunctionCallArgumentsDoneEvent)]
    assert json.loads(done.arguments) == TOOL_INPUT == json.loads("".join(deltas))
    assert events[-1].type == "response.completed"


async def test_conversation_continues_across_a_failover(
    client: openai.AsyncOpenAI,
    anthropic_upstream: AnthropicUpstream,  # noqa: F811
) -> None:
    """Turn one on the simulator, turn two on a model whose simulated deployment fails: the
    gateway's store gives Anthropic the whole conversation, which no single provider held."""
    first = await client.responses.create(model="chat", input="My name is Ada.")
    raw = await client.responses.with_raw_response.create(
        model="flaky", previous_response_id=first.id, input="What is my name?"
    )
    second = raw.parse()
    assert raw.headers["x-tailguard-deployment"] == "anthropic/claude-x"
    assert raw.headers["x-tailguard-route"] == "error_fallback"
    assert int(raw.headers["x-tailguard-attempts"]) == 2, raw.headers["server-timing"]
    assert second.previous_response_id == first.id
    sent = _fake(anthropic_upstream).requests[-1].body["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "user"]
    assert [_text(m["content"]) for m in sent] == [
        "My name is Ada.",
        first.output_text,
        "What is my name?",
    ]


async def _cut_stream(base_url: str, model: str) -> list[dict[str, Any]]:
    """The events of a stream that is cut after commit, as sent, checking that the SDK raises
    the `error` event as an APIError (as it does for OpenAI's own)."""
    async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as sdk:
        stream = await sdk.responses.create(model=model, input="Hi", stream=True)
        with pytest.raises(openai.APIError) as raised:
            async for _ in stream:
                pass
    assert "upstream" in raised.value.message
    async with httpx.AsyncClient() as http:
        body = {"model": model, "input": "Hi", "stream": True}
        sent = await http.post(base_url + "/responses", json=body)
    return [json.loads(line[6:]) for line in sent.text.splitlines() if line.startswith("data: ")]


async def test_stream_cut_after_commit_ends_failed(gateway: Gateway) -> None:
    """An upstream failing mid-stream ends the stream with `error` and `response.failed`."""
    events = await _cut_stream(gateway.base_url, "claude-cut")
    kinds = [event["type"] for event in events]
    assert "response.completed" not in kinds
    assert kinds[-2:] == ["error", "response.failed"]
    assert events[-2]["error"]["code"] == events[-2]["code"] == "upstream_stream_error"
    failed = ResponseFailedEvent.model_validate(events[-1])
    assert failed.response.status == "failed"
    assert failed.response.error is not None
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


async def test_retrieve_and_delete(client: openai.AsyncOpenAI) -> None:
    created = await client.responses.create(model="chat", input="Remember this.")
    fetched = await client.responses.retrieve(created.id)
    assert fetched.id == created.id
    assert fetched.output_text == created.output_text
    items = await client.responses.input_items.list(created.id)
    assert [item.type for item in items.data] == ["message"]
    await client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.delete(created.id)


async def test_store_false_stores_nothing(client: openai.AsyncOpenAI) -> None:
    created = await client.responses.create(model="chat", input="Forget this.", store=False)
    assert created.model_extra is not None and created.model_extra["store"] is False
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(created.id)
    with pytest.raises(openai.BadRequestError) as raised:
        await client.responses.create(model="chat", previous_response_id=created.id, input="?")
    assert raised.value.code == "previous_response_not_found"


async def test_unknown_previous_response_is_a_400(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        await client.responses.create(model="chat", previous_response_id="resp_nope", input="?")
    assert raised.value.param == "previous_response_id"


async def test_builtin_tools_are_dropped_naming_them(client: openai.AsyncOpenAI) -> None:
    """A chat or Messages upstream has no web search: by default the request goes on without
    it, and the answer says so in a header, rather than in silence (see test_codex_translation
    for `unsupported_tools: refuse`)."""
    for model in ("chat", "claude"):
        raw = await client.responses.with_raw_response.create(
            model=model, input="News?", tools=[{"type": "web_search"}]
        )
        assert raw.headers["x-tailguard-dropped-tools"] == "web_search"
        assert raw.parse().output_text


async def test_bad_input_is_a_400_in_the_openai_shape(gateway: Gateway) -> None:
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        missing = await http.post("/v1/responses", json={"model": "chat"})
        wrong = await http.post("/v1/responses", json={"model": "chat", "input": 3})
    assert missing.status_code == 400
    assert missing.json()["error"]["param"] == "input"
    assert wrong.status_code == 400
    assert wrong.json()["error"]["code"] == "invalid_type"


async def test_responses_are_scoped_to_their_key(
    anthropic_upstream: AnthropicUpstream,  # noqa: F811
) -> None:
    """Another key's response id reads as not found, for GET, DELETE and continuation."""
    settings = gateway_settings(
        {"local": {"type": "simulated", "default_profile": {"output_tokens": 3}}},
        _models(("chat", ["local/chat"])),
        auth={
            "keys": [
                {"name": "a", "sha256": _sha("sk-a-0123456789")},
                {"name": "b", "sha256": _sha("sk-b-0123456789")},
            ]
        },
    )
    async with run_gateway(settings) as gw, AsyncExitStack() as stack:
        a = openai.AsyncOpenAI(base_url=gw.base_url, api_key="sk-a-0123456789", max_retries=0)
        b = openai.AsyncOpenAI(base_url=gw.base_url, api_key="sk-b-0123456789", max_retries=0)
        stack.push_async_callback(a.close)
        stack.push_async_callback(b.close)
        created = await a.responses.create(model="chat", input="secret")
        assert (await a.responses.retrieve(created.id)).id == created.id
        with pytest.raises(openai.NotFoundError):
            await b.responses.retrieve(created.id)
        with pytest.raises(openai.NotFoundError):
            await b.responses.delete(created.id)
        with pytest.raises(openai.BadRequestError):
            await b.responses.create(model="chat", previous_response_id=created.id, input="?")
        assert (await a.responses.retrieve(created.id)).id == created.id


# --- an upstream that serves the Responses API natively ------------------------------------------


@pytest.fixture
async def native() -> AsyncIterator[tuple[Gateway, ResponsesFake]]:
    fake = ResponsesFake()
    async with serve(fake) as url:
        providers = {
            "openai": {"type": "openai", "base_url": url + "/v1", "responses": "native"},
            "local": {"type": "simulated", "default_profile": {"output_tokens": 4}},
        }
        models = _models(
            ("native", ["openai/native"]),
            ("native-cut", ["openai/native@cut"]),
            ("chat", ["local/chat"]),
        )
        async with run_gateway(gateway_settings(providers, models)) as gw:
            yield gw, fake


async def test_native_upstream_gets_the_request_and_its_answer_is_forwarded(
    native: tuple[Gateway, ResponsesFake],
) -> None:
    """Forwarded as sent (model mapped, nothing stored upstream); the answer comes back untouched
    with its cached tokens; built-in tools are the upstream's business."""
    gateway, fake = native
    async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key="x", max_retries=0) as sdk:
        response = await sdk.responses.create(
            model="native", input="Hi", tools=[{"type": "web_search"}]
        )
        assert response.id == "resp_native0001"
        assert response.output_text == "".join(WORDS)
        assert response.usage is not None
        assert response.usage.input_tokens_details.cached_tokens == 8
        sent = fake.requests[-1]
        assert sent["model"] == "native" and sent["store"] is False
        assert sent["tools"] == [{"type": "web_search"}]
        # The gateway kept it: the next turn may go to another upstream entirely.
        follow = await sdk.responses.create(
            model="chat", previous_response_id=response.id, input="And?"
        )
        assert follow.status == "completed"
        assert (await sdk.responses.retrieve(response.id)).output_text == "".join(WORDS)


async def test_native_continuation_sends_the_history_not_the_id(
    native: tuple[Gateway, ResponsesFake],
) -> None:
    gateway, fake = native
    async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key="x", max_retries=0) as sdk:
        first = await sdk.responses.create(model="chat", input="One")
        await sdk.responses.create(model="native", previous_response_id=first.id, input="Two")
    sent = fake.requests[-1]
    assert "previous_response_id" not in sent
    assert [item.get("content") for item in sent["input"]] == ["One", first.output_text, "Two"]


async def test_native_stream_is_forwarded_and_a_cut_ends_failed(
    native: tuple[Gateway, ResponsesFake],
) -> None:
    gateway, _ = native
    async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key="x", max_retries=0) as sdk:
        stream = await sdk.responses.create(model="native", input="Hi", stream=True)
        events = [event async for event in stream]
        assert events[-1].type == "response.completed"
        assert "".join(
            e.delta for e in events if e.type == "response.output_text.delta"
        ) == "".join(WORDS)
    cut = await _cut_stream(gateway.base_url, "native-cut")
    kinds = [event["type"] for event in cut]
    assert kinds[-2:] == ["error", "response.failed"]
    assert "response.completed" not in kinds
    assert [e["sequence_number"] for e in cut] == list(range(len(cut)))


async def test_a_ttft_budget_fails_a_slow_stream_over(gateway: Gateway) -> None:
    """The attempt loop is the chat one: a primary that cannot make the first-token deadline is
    cut, hedged or passed over, and the next deployment serves the stream, which says so."""
    settings = gateway_settings(
        {
            "slowsim": {"type": "simulated", "default_profile": {"prefill_base_ms": 5000}},
            "local": {"type": "simulated", "default_profile": {"output_tokens": 3}},
        },
        [
            {**_models(("slow", ["slowsim/chat"]))[0], "fallbacks": ["fast"]},
            *_models(("fast", ["local/chat"])),
        ],
    )
    async with (
        run_gateway(settings) as gw,
        openai.AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0) as sdk,
        sdk.responses.with_streaming_response.create(
            model="slow",
            input="Hi",
            stream=True,
            extra_headers={"x-tailguard-ttft-budget-ms": "100"},
        ) as raw,
    ):
        assert raw.headers["x-tailguard-route"] in ("ttft_failover", "hedge", "budget")
        assert raw.headers["x-tailguard-deployment"] == "local/chat"
        body = await raw.text()
    assert body.count("event: response.output_text.delta") == 3
    assert "event: response.completed" in body


async def test_reasoning_and_cached_tokens_from_the_simulator() -> None:
    """Reasoning comes first as its own item and events; a second turn continued with
    `previous_response_id` shares the first turn's prefix, so its input is partly cached."""
    profile = {"output_tokens": 4, "reasoning_tokens": 3, "prefix_cache_tokens": 100_000}
    settings = gateway_settings(
        {"local": {"type": "simulated", "default_profile": profile}},
        _models(("think", ["local/think"])),
    )
    long_input = "Tell me about tail latency. " * 40
    async with (
        run_gateway(settings) as gw,
        openai.AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0) as sdk,
    ):
        stream = await sdk.responses.create(model="think", input=long_input, stream=True)
        events = [event async for event in stream]
        assert isinstance(events[-1], ResponseCompletedEvent)
        second = await sdk.responses.create(
            model="think", previous_response_id=events[-1].response.id, input="And p99?"
        )
    kinds = [e.type for e in events]
    assert kinds.count("response.reasoning_text.delta") == 3
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    first = events[-1]
    assert isinstance(first, ResponseCompletedEvent)
    assert [item.type for item in first.response.output] == ["reasoning", "message"]
    usage = first.response.usage
    assert usage is not None and usage.output_tokens_details.reasoning_tokens == 3
    assert usage.input_tokens_details.cached_tokens == 0
    assert second.usage is not None
    assert second.usage.input_tokens > usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens >= usage.input_tokens // 2


async def test_a_vllm_server_serves_it_translated(upstream: Upstream) -> None:
    """A vLLM-style server over HTTP gets a chat request (a bulk one, through the bulk gate)
    and the answer is a Response with the server's usage."""
    settings = gateway_settings(
        {"vllm": {"type": "vllm", "base_url": upstream.base_url, "bulk_priority": 5}},
        _models(("local", ["vllm/m@scheduling_policy=priority"])),
    )
    async with (
        run_gateway(settings) as gw,
        openai.AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0) as sdk,
    ):
        response = await sdk.responses.create(
            model="local",
            input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
            max_output_tokens=32,
            extra_headers={"x-tailguard-priority": "bulk"},
        )
    assert response.status == "completed"
    assert response.usage is not None and response.usage.output_tokens == 5
    assert response.output_text

"""Everything the gateway writes is valid by the official API schemas (`tests/schemas.py`): each
translation pair whose output is chat or the Responses API (client wire ← upstream wire), streamed
and not, with tools, images and reasoning where the pair carries them; the error bodies and
retry hints of every wire and endpoint; `/v1/models`, token counts and stored-response reads.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from typing import Any, Final

import httpx
import orjson
import pytest

from gateway.models import Chunk
from gateway.providers.decode import AnthropicStreamDecoder, decode_anthropic_body
from gateway.providers.translate import AnthropicToOpenAIStream, anthropic_response_to_openai
from gateway.providers.translate.events import (
    AnthropicToResponsesStream,
    ResponsesEvents,
    ResponsesResult,
    anthropic_body_to_response,
)
from gateway.scrubbing import Scrubber
from gateway.sse import SSEParser
from tests.conftest import gateway_settings, run_gateway
from tests.schemas import (
    SPECS,
    SchemaWire,
    parse_sse,
    validate,
    validate_error,
    validate_stream,
    wire_gateway,
)

pytestmark = pytest.mark.timeout(60)

CLIENT_KEY: Final = "sk-tailguard-client-key-0123456789"
IMAGE: Final = (
    "data:image/jpeg;base64," + base64.b64encode((SPECS / "test_image.jpg").read_bytes()).decode()
)
WEATHER: Final[dict[str, Any]] = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
# Client wire ← upstream wire, and the model that is that pair's upstream.
UPSTREAMS: Final = {"chat": "sim", "messages": "claude"}
FEATURES: Final = ("text", "tools", "image", "reasoning")


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    """A gateway over the simulator (chat), the fake Messages API and a Responses fake."""
    cut = ("claude-cut", "anthropic", "claude-x@error_after=2")
    async with (
        wire_gateway("sim-reasoning", cut) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as client,
    ):
        yield client


def _model(upstream: str, feature: str) -> str:
    if upstream == "sim":
        return "sim-reasoning" if feature == "reasoning" else "sim"
    return "claude-tools" if feature == "tools" else "claude"


def chat_request(model: str, feature: str) -> dict[str, Any]:
    content: Any = "What is the weather in Paris?"
    if feature == "image":
        content = [
            {"type": "text", "text": "Describe this image."},
            {"type": "image_url", "image_url": {"url": IMAGE}},
        ]
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": content}]}
    if feature == "tools":
        body["tools"] = [{"type": "function", "function": WEATHER}]
        body["tool_choice"] = "required"
    if feature == "reasoning":
        body["reasoning_effort"] = "low"
    return body


def responses_request(model: str, feature: str) -> dict[str, Any]:
    content: Any = "What is the weather in Paris?"
    if feature == "image":
        content = [
            {"type": "input_text", "text": "Describe this image."},
            {"type": "input_image", "image_url": IMAGE},
        ]
    body: dict[str, Any] = {
        "model": model,
        "instructions": "Be brief.",
        "input": [{"type": "message", "role": "user", "content": content}],
    }
    if feature == "tools":
        body["tools"] = [{"type": "function", **WEATHER}]
        body["tool_choice"] = "required"
    if feature == "reasoning":
        body["reasoning"] = {"effort": "low"}
    return body


# --- chat output ---------------------------------------------------------------------------------


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("upstream", ["chat", "messages"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_chat_answers_are_valid(
    http: httpx.AsyncClient, upstream: str, feature: str, stream: bool
) -> None:
    """A chat client's answer, from the simulator or translated from Messages, whole or
    streamed (with the usage chunk), is valid by OpenAI's schema."""
    if upstream == "messages" and feature == "reasoning":
        pytest.skip("the Messages fake does not think: see test_translated_thinking_is_valid")
    body = chat_request(_model(UPSTREAMS[upstream], feature), feature)
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    if not stream:
        answer = response.json()
        validate("chat", "CreateChatCompletionResponse", answer)
        if feature == "tools":
            assert answer["choices"][0]["message"]["tool_calls"]
        return
    events = parse_sse(response.content)
    validate_stream("chat", events)
    assert events[-1] == (None, "[DONE]")
    if feature == "tools":
        assert any(
            choice["delta"].get("tool_calls")
            for _, data in events[:-1]
            for choice in data["choices"]
        )


# --- Responses output ----------------------------------------------------------------------------


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("upstream", ["chat", "messages"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_responses_answers_are_valid(
    http: httpx.AsyncClient, upstream: str, feature: str, stream: bool
) -> None:
    """A Responses client's answer translated from chat or Messages, whole or streamed, is valid
    by the Open Responses specification, and so is the stored copy a later GET reads."""
    if upstream == "messages" and feature == "reasoning":
        pytest.skip("the Messages fake does not think: see test_translated_thinking_is_valid")
    body = responses_request(_model(UPSTREAMS[upstream], feature), feature)
    if stream:
        body["stream"] = True
    response = await http.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    if stream:
        events = parse_sse(response.content)
        validate_stream("responses", events)
        answer = events[-1][1]["response"]
    else:
        answer = response.json()
    validate("responses", "ResponseResource", answer)
    validate("chat", "Response", answer)  # OpenAI's own document agrees
    kinds = [item["type"] for item in answer["output"]]
    if feature == "tools":
        assert "function_call" in kinds
    if feature == "reasoning":
        assert kinds[0] == "reasoning"
    stored = await http.get(f"/v1/responses/{answer['id']}")
    assert stored.status_code == 200
    validate("responses", "ResponseResource", stored.json())
    items = await http.get(f"/v1/responses/{answer['id']}/input_items")
    assert items.status_code == 200
    validate("chat", "ResponseItemList", items.json())


async def test_responses_echo_the_request() -> None:
    """The Response object echoes the sampling settings and tools it was asked for, in the
    specification's shapes (numbers where it wants numbers, tools in full)."""
    request = {
        "model": "sim",
        "input": "Hello",
        "temperature": 0.2,
        "top_p": 0.9,
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": "auto",
        "max_output_tokens": 50,
        "metadata": {"k": "v"},
        "safety_identifier": "user-1",
        "prompt_cache_key": "conversation-1",
    }
    settings = gateway_settings(
        {"local": {"type": "simulated", "default_profile": {"output_tokens": 3}}},
        [{"name": "sim", "deployments": [{"provider": "local", "model": "sim"}]}],
    )
    async with (
        run_gateway(settings) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as client,
    ):
        answer = (await client.post("/v1/responses", json=request)).json()
    validate("responses", "ResponseResource", answer)
    validate("chat", "Response", answer)
    assert answer["temperature"] == 0.2
    assert answer["top_p"] == 0.9
    assert answer["tools"] == [
        {
            "type": "function",
            "name": "f",
            "description": None,
            "parameters": {"type": "object"},
            "strict": None,
        }
    ]
    assert answer["completed_at"] >= answer["created_at"]
    assert answer["safety_identifier"] == "user-1"
    assert answer["prompt_cache_key"] == "conversation-1"
    assert answer["metadata"] == {"k": "v"}


async def test_a_cut_responses_stream_ends_valid(http: httpx.AsyncClient) -> None:
    """A stream cut after it began ends with `error` and `response.failed`, both valid."""
    body = {"model": "claude-cut", "input": "Hello", "stream": True}
    response = await http.post("/v1/responses", json=body)
    events = parse_sse(response.content)
    assert [name for name, _ in events[-2:]] == ["error", "response.failed"]
    validate_stream("responses", events)


# --- reasoning translated from Messages (the fake does not think) --------------------------------

_THINKING_BODY: Final[dict[str, Any]] = {
    "id": "msg_01",
    "type": "message",
    "role": "assistant",
    "model": "claude-x",
    "content": [
        {"type": "thinking", "thinking": "Paris is in France.", "signature": "c2ln"},
        {"type": "text", "text": "It is sunny."},
    ],
    "stop_reason": "end_turn",
    "stop_sequence": None,
    "usage": {"input_tokens": 5, "output_tokens": 7},
}


def _thinking_stream() -> bytes:
    events: list[dict[str, Any]] = [
        {
            "type": "message_start",
            "message": {**_THINKING_BODY, "content": [], "stop_reason": None},
        },
        {
            "type": "content_block_start",
            "index": 0,
            "content_block": {"type": "thinking", "thinking": "", "signature": ""},
        },
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "thinking_delta", "thinking": "Paris is in France."},
        },
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "signature_delta", "signature": "c2ln"},
        },
        {"type": "content_block_stop", "index": 0},
        {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}},
        {
            "type": "content_block_delta",
            "index": 1,
            "delta": {"type": "text_delta", "text": "Sunny."},
        },
        {"type": "content_block_stop", "index": 1},
        {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn", "stop_sequence": None},
            "usage": {"output_tokens": 7},
        },
        {"type": "message_stop"},
    ]
    return b"".join(
        b"event: " + e["type"].encode() + b"\ndata: " + orjson.dumps(e) + b"\n\n" for e in events
    )


def _chunks(stream: bytes) -> list[Chunk]:
    decoder = AnthropicStreamDecoder(scrub=Scrubber.GENERIC)
    return [decoder.decode(event) for event in SSEParser().feed(stream)]


def test_translated_thinking_is_valid() -> None:
    """Thinking from a Messages upstream, translated to chat and to the Responses API, whole
    and streamed, is valid by the official schemas."""
    chat = orjson.loads(anthropic_response_to_openai(_THINKING_BODY, model="claude"))
    validate("chat", "CreateChatCompletionResponse", chat)
    translator = AnthropicToOpenAIStream(model="claude", include_usage=True)
    streamed = b"".join(translator.feed(chunk) for chunk in _chunks(_thinking_stream()))
    validate_stream("chat", streamed)
    assert b"reasoning" in streamed

    request = {"model": "claude", "input": "Weather?", "reasoning": {"effort": "low"}}
    whole = decode_anthropic_body(orjson.dumps(_THINKING_BODY), scrub=Scrubber.GENERIC)
    assert whole.data is not None
    body = anthropic_body_to_response(whole.data, request, "resp_1", "claude", ResponsesResult())
    response = orjson.loads(body)
    validate("responses", "ResponseResource", response)
    assert response["output"][0]["type"] == "reasoning"
    events = ResponsesEvents(request, "resp_2", "claude", ResponsesResult())
    responses_stream = AnthropicToResponsesStream(events, "claude")
    out = b"".join(responses_stream.feed(chunk) for chunk in _chunks(_thinking_stream()))
    validate_stream("responses", out)
    assert b"response.reasoning_text.delta" in out


# --- errors: valid bodies and retry hints on every wire ------------------------------------------

_KEY_HASH: Final = __import__("hashlib").sha256(CLIENT_KEY.encode()).hexdigest()
_ENDPOINTS: Final[dict[str, tuple[str, SchemaWire]]] = {
    "chat": ("/v1/chat/completions", "chat"),
    "responses": ("/v1/responses", "responses"),
    "messages": ("/v1/messages", "messages"),
    "count_tokens": ("/v1/messages/count_tokens", "messages"),
    "input_tokens": ("/v1/responses/input_tokens", "responses"),
}


def _asking(endpoint: str, model: str) -> dict[str, Any]:
    if endpoint == "chat":
        return {"model": model, "messages": [{"role": "user", "content": "Hi"}]}
    if endpoint in ("messages", "count_tokens"):
        body = {"model": model, "messages": [{"role": "user", "content": "Hi"}]}
        return body if endpoint == "count_tokens" else {**body, "max_tokens": 50}
    return {"model": model, "input": "Hi"}


@pytest.fixture
async def guarded() -> AsyncIterator[httpx.AsyncClient]:
    """A gateway with one client key (1 request a minute on `limited`), small bodies, and a
    model whose only deployment always fails."""
    providers = {
        "local": {"type": "simulated", "default_profile": {"output_tokens": 3}},
        "broken": {"type": "simulated", "default_profile": {"error_500_rate": 1.0}},
    }
    models = [
        {"name": "sim", "deployments": [{"provider": "local", "model": "sim"}]},
        {"name": "failing", "deployments": [{"provider": "broken", "model": "sim"}]},
    ]
    settings = gateway_settings(
        providers,
        models,
        auth={"keys": [{"name": "team", "sha256": _KEY_HASH}]},
        server={"max_body_bytes": 20_000},
    )
    async with (
        run_gateway(settings) as gw,
        httpx.AsyncClient(
            base_url=gw.url, timeout=10, headers={"authorization": f"Bearer {CLIENT_KEY}"}
        ) as client,
    ):
        yield client


def _check(response: httpx.Response, wire: SchemaWire, status: int, retry: bool) -> None:
    assert response.status_code == status, response.text
    validate_error(wire, response.json())
    assert response.headers["x-should-retry"] == ("true" if retry else "false")
    assert ("retry-after" in response.headers) == retry
    if wire == "messages":
        assert response.json()["request_id"] == response.headers["x-request-id"]


@pytest.mark.parametrize("endpoint", list(_ENDPOINTS))
async def test_errors_are_valid_and_say_whether_to_retry(
    guarded: httpx.AsyncClient, endpoint: str
) -> None:
    """On every endpoint and wire, an error body is valid by the wire's schema, and its headers
    say whether a retry can help: never for a bad request, key, model or size (so agents stop at
    once), and when it can, how long to wait."""
    path, wire = _ENDPOINTS[endpoint]
    anthropic = {"anthropic-version": "2023-06-01"} if wire == "messages" else {}
    bad = await guarded.post(
        path, json={"model": "sim", "messages": 3, "input": 3}, headers=anthropic
    )
    _check(bad, wire, 400, retry=False)
    wrong_key = await guarded.post(
        path,
        json=_asking(endpoint, "sim"),
        headers={**anthropic, "authorization": "Bearer sk-wrong", "x-api-key": "sk-wrong"},
    )
    _check(wrong_key, wire, 401, retry=False)
    unknown = await guarded.post(path, json=_asking(endpoint, "no-such-model"), headers=anthropic)
    _check(unknown, wire, 404, retry=False)
    huge = _asking(endpoint, "sim") | {"metadata": {"padding": "x" * 30_000}}
    _check(await guarded.post(path, json=huge, headers=anthropic), wire, 413, retry=False)
    if endpoint not in ("count_tokens", "input_tokens"):  # a count tries no deployment
        failing = await guarded.post(path, json=_asking(endpoint, "failing"), headers=anthropic)
        _check(failing, wire, 502, retry=True)


async def test_framework_errors_and_reads_are_valid(guarded: httpx.AsyncClient) -> None:
    """`/v1/models` and its errors, an unknown path, a wrong method and a missing stored response
    are valid OpenAI objects, with the same retry hints."""
    models = await guarded.get("/v1/models")
    validate("chat", "ListModelsResponse", models.json())
    validate("chat", "Model", (await guarded.get("/v1/models/sim")).json())
    _check(await guarded.get("/v1/models/nope"), "chat", 404, retry=False)
    _check(await guarded.get("/v1/no-such-path"), "chat", 404, retry=False)
    _check(await guarded.get("/v1/chat/completions"), "chat", 405, retry=False)
    _check(await guarded.get("/v1/responses/resp_missing"), "chat", 404, retry=False)
    counted = await guarded.post(
        "/v1/messages/count_tokens",
        json=_asking("count_tokens", "sim"),
        headers={"anthropic-version": "2023-06-01"},
    )
    validate("messages", "CountMessageTokensResponse", counted.json())


@pytest.mark.parametrize("endpoint", ["chat", "messages"])
async def test_a_cut_stream_ends_with_a_valid_error(http: httpx.AsyncClient, endpoint: str) -> None:
    """A stream cut after commit ends with an error event valid by the wire's schema."""
    path, wire = _ENDPOINTS[endpoint]
    body = _asking(endpoint, "claude-cut") | {"stream": True}
    response = await http.post(path, json=body, headers={"anthropic-version": "2023-06-01"})
    events = parse_sse(response.content)
    _, last = events[-1]
    assert "error" in last
    validate_error(wire, last)

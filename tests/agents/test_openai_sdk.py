"""The official OpenAI SDK works unchanged against the running gateway, over real HTTP."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from gateway.config import load_settings
from tests.conftest import Gateway, Upstream, gateway_settings, run_gateway

MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [
    {"role": "user", "content": "Name three colours."}
]


@pytest.fixture(params=["http", "in-process"])
async def gateway(request: pytest.FixtureRequest, upstream: Upstream) -> AsyncIterator[Gateway]:
    """A gateway over the simulator: as a server (vLLM-style provider) and in-process."""
    provider: dict[str, Any]
    if request.param == "http":
        provider = {"type": "vllm", "base_url": upstream.base_url}
    else:
        provider = {"type": "simulated", "default_profile": {"output_tokens": 5}}
    settings = gateway_settings(
        {"up": provider},
        [
            {"name": "chat", "deployments": [{"provider": "up", "model": "chat"}]},
            {"name": "embed", "deployments": [{"provider": "up", "model": "embed"}]},
        ],
    )
    async with run_gateway(settings) as gw:
        yield gw


@pytest.fixture
async def client(gateway: Gateway) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key="unused") as sdk:
        yield sdk


async def test_chat_completion(client: openai.AsyncOpenAI) -> None:
    """A non-streaming chat completion parses, with text, finish reason and usage."""
    completion = await client.chat.completions.create(model="chat", messages=MESSAGES)
    assert completion.object == "chat.completion"
    assert completion.choices[0].message.content
    assert completion.choices[0].finish_reason in ("stop", "length")
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 5


async def test_chat_stream(client: openai.AsyncOpenAI) -> None:
    """A streamed chat completion yields the tokens, a finish reason, and no usage by default."""
    stream = await client.chat.completions.create(model="chat", messages=MESSAGES, stream=True)
    texts, finish, usage = [], None, []
    async for chunk in stream:
        usage.append(chunk.usage)
        for choice in chunk.choices:
            if choice.delta.content:
                texts.append(choice.delta.content)
            finish = choice.finish_reason or finish
    assert len(texts) == 5
    assert finish in ("stop", "length")
    assert all(u is None for u in usage)


async def test_chat_stream_with_usage(client: openai.AsyncOpenAI) -> None:
    """With include_usage, the last chunk before [DONE] carries the usage and no choices."""
    stream = await client.chat.completions.create(
        model="chat", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 5


async def test_raw_response_headers(client: openai.AsyncOpenAI) -> None:
    """The SDK sees the gateway's decision headers and request id."""
    raw = await client.chat.completions.with_raw_response.create(model="chat", messages=MESSAGES)
    assert raw.headers["x-tailguard-model"] == "chat"
    assert raw.headers["x-tailguard-deployment"] == "up/chat"
    assert raw.request_id and raw.request_id.startswith("req_")


async def test_completions(client: openai.AsyncOpenAI) -> None:
    """Legacy completions work, streaming and not."""
    completion = await client.completions.create(model="chat", prompt="Once upon a time")
    assert completion.choices[0].text
    stream = await client.completions.create(model="chat", prompt="Once", stream=True)
    texts = [c.choices[0].text async for c in stream if c.choices and c.choices[0].text]
    assert len(texts) == 5


async def test_embeddings(client: openai.AsyncOpenAI) -> None:
    """Embeddings work with the SDK's default base64 encoding and with floats."""
    result = await client.embeddings.create(model="embed", input=["a", "b", "a"])
    vectors = [item.embedding for item in result.data]
    assert len(vectors) == 3
    assert vectors[0] == vectors[2] != vectors[1]
    floats = await client.embeddings.create(model="embed", input="a", encoding_format="float")
    assert floats.data[0].embedding == pytest.approx(vectors[0], rel=1e-6)


async def test_models_list(client: openai.AsyncOpenAI) -> None:
    """models.list shows the configured model names."""
    models = [model.id async for model in client.models.list()]
    assert models == ["chat", "embed"]


async def test_models_retrieve(client: openai.AsyncOpenAI) -> None:
    """models.retrieve answers for a configured name, in the list's shape, and raises the SDK's
    NotFoundError (with the names there are) for any other."""
    model = await client.models.retrieve("embed")
    listed = [m async for m in client.models.list()]
    assert model == next(m for m in listed if m.id == "embed")
    assert (model.object, model.owned_by) == ("model", "tailguard")
    with pytest.raises(openai.NotFoundError) as missing:
        await client.models.retrieve("nope")
    assert missing.value.code == "model_not_found"
    assert "Available models: chat, embed." in missing.value.message


async def test_an_unknown_endpoint_says_what_is_served(client: openai.AsyncOpenAI) -> None:
    """A path under /v1/ the gateway does not serve is a 404 that names it and lists the ones
    it does, so it cannot be mistaken for an unknown model."""
    with pytest.raises(openai.NotFoundError) as missing:
        await client.post("/batches", body={}, cast_to=object)
    message = missing.value.message
    assert "POST '/v1/batches'" in message
    served = message.split("are: ")[1].rstrip(".").split(", ")
    for path in ("/v1/chat/completions", "/v1/embeddings", "/v1/messages", "/v1/models/{model_id}"):
        assert path in served
    assert missing.value.code == "not_found"


async def test_errors_become_sdk_exceptions(client: openai.AsyncOpenAI) -> None:
    """Gateway errors map onto the SDK's exception classes with code and param."""
    with pytest.raises(openai.NotFoundError) as missing:
        await client.chat.completions.create(model="nope", messages=MESSAGES)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        await client.chat.completions.create(model="chat", messages=[])
    assert bad.value.param == "messages"


async def test_default_config_serves_every_model() -> None:
    """The embedded default config (what `make run` serves) answers on all its models."""
    settings = load_settings("config/gateway.yaml")
    async with (
        run_gateway(settings) as gw,
        openai.AsyncOpenAI(base_url=gw.base_url, api_key="unused") as sdk,
    ):
        names = [model.id async for model in sdk.models.list()]
        assert {"chat-fast", "chat-large", "embed"} <= set(names)
        stream = await sdk.chat.completions.create(
            model="chat-fast", messages=MESSAGES, max_tokens=3, stream=True
        )
        texts = [c.choices[0].delta.content async for c in stream if c.choices]
        assert "".join(t for t in texts if t)
        embedding = await sdk.embeddings.create(model="embed", input="hello")
        assert len(embedding.data[0].embedding) == 256

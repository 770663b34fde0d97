"""AWS Bedrock (Converse / ConverseStream) behind the gateway, from every client wire.

Real HTTP on loopback: the official OpenAI and Anthropic SDKs call the gateway, which signs its
requests with SigV4 through botocore's credential chain (or sends a Bedrock API key) to a fake of
the Converse API (`tests/fakes/bedrock_upstream.py`) that recomputes every signature and answers
real event-stream frames. The credential chain reads the process environment and files made in
the test; it never reaches a real AWS endpoint (instance metadata is switched off).
"""

from __future__ import annotations

import datetime
import json
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from gateway.config import build_settings
from gateway.providers.bedrock_wire import (
    ConverseStreamTranslator,
    converse_to_message,
    messages_to_converse,
)
from gateway.providers.translate import TranslationError
from gateway.telemetry import semconv as sc
from tests.cli.test_check_config import problems, report, write
from tests.conftest import run_gateway, serve
from tests.fakes.anthropic_upstream import AnthropicFake
from tests.fakes.anthropic_upstream import answer_text as claude_text
from tests.fakes.bedrock_upstream import (
    AFTER_TOOL_TEXT,
    REASONING,
    SIGNATURE,
    TOOL_INPUT,
    TOOL_TEXT,
    BedrockFake,
    StsFake,
    answer_text,
)
from tests.fakes.otlp_receiver import OTLPReceiver
from tests.schemas import parse_sse, validate, validate_error, validate_stream

ACCESS_KEY = "AKIAFAKEBEDROCK00001"
SECRET = "fakeSecret/Bedrock+0123456789abcdefSECRET"
TOKEN = "FwoGZXIvYXdzEFAKEsessionTOKEN0123456789"
OTHER_KEY = "AKIAFAKEBEDROCK00002"
OTHER_SECRET = "otherSecret/Bedrock+0123456789abcdefROTATED"
API_KEY = "ABSKQmVkcm9ja0FQSUtleS1mYWtlLTAxMjM0NTY3ODk="
ANTHROPIC_KEY = "sk-ant-api03-configured-upstream-key-0123456789"
MODEL = "anthropic.claude-x-v1:0"
TIMEOUT_S = 10.0
WEATHER_TOOL: dict[str, Any] = {
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


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """A clean AWS environment: no real files, no instance metadata, the test's credentials."""
    for name in (
        "AWS_PROFILE",
        "AWS_DEFAULT_PROFILE",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_ROLE_ARN",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_BEARER_TOKEN_BEDROCK",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_SESSION_TOKEN", TOKEN)
    yield tmp_path


@pytest.fixture
async def fake() -> AsyncIterator[tuple[BedrockFake, str]]:
    bedrock = BedrockFake(credentials={ACCESS_KEY: (SECRET, TOKEN)}, api_keys=(API_KEY,))
    async with serve(bedrock) as url:
        yield bedrock, url


def config(url: str, model: str = MODEL, *, models: Any = None, **provider: Any) -> Any:
    providers = {"aws": {"type": "bedrock", "region": "us-east-1", "base_url": url, **provider}}
    deployments = [{"provider": "aws", "model": model}]
    return build_settings(
        {
            "providers": providers,
            "models": models or [{"name": "claude", "deployments": deployments}],
        }
    )


class Clients:
    def __init__(self, url: str, stack: AsyncExitStack) -> None:
        self.url = url
        self.openai = openai.AsyncOpenAI(
            base_url=url + "/v1", api_key="client", max_retries=0, timeout=TIMEOUT_S
        )
        self.anthropic = anthropic.AsyncAnthropic(
            base_url=url, api_key="client", max_retries=0, timeout=TIMEOUT_S
        )
        self.http = httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S)
        stack.push_async_callback(self.openai.close)
        stack.push_async_callback(self.anthropic.close)
        stack.push_async_callback(self.http.aclose)


@asynccontextmanager
async def gateway(settings: Any) -> AsyncIterator[Clients]:
    async with AsyncExitStack() as stack:
        gw = await stack.enter_async_context(run_gateway(settings))
        yield Clients(gw.url, stack)


# --- Messages: signing, mapping both ways ---------------------------------------------------------


async def test_messages_are_signed_and_mapped_to_converse(
    aws_env: Path, fake: tuple[BedrockFake, str]
) -> None:
    """An Anthropic SDK request reaches Converse signed with the environment's credentials (the
    fake recomputes the signature), with system, inference settings, cache points, thinking,
    betas and latency-optimized inference mapped; the answer comes back as a valid Message with
    the thinking signature and cache counts."""
    bedrock, url = fake
    async with gateway(
        config(url, MODEL + "@reasoning,cached=7", performance_latency="optimized")
    ) as c:
        message = await c.anthropic.messages.create(
            model="claude",
            max_tokens=300,
            stop_sequences=["END"],
            system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
            messages=[{"role": "user", "content": "hello there"}],
            thinking={"type": "enabled", "budget_tokens": 1024},
            extra_headers={"anthropic-beta": "interleaved-thinking-2025-05-14"},
            extra_body={"temperature": 0.5, "top_p": 0.9},
        )
    received = bedrock.requests[-1]
    assert received.path == f"/model/{MODEL}@reasoning,cached=7/converse"
    assert received.headers["authorization"].startswith(
        f"AWS4-HMAC-SHA256 Credential={ACCESS_KEY}/"
    )
    assert received.headers["x-amz-security-token"] == TOKEN
    assert bedrock.refused == []
    assert received.body == {
        "messages": [{"role": "user", "content": [{"text": "hello there"}]}],
        "system": [{"text": "Be brief."}, {"cachePoint": {"type": "default"}}],
        "inferenceConfig": {
            "maxTokens": 300,
            "temperature": 0.5,
            "topP": 0.9,
            "stopSequences": ["END"],
        },
        "additionalModelRequestFields": {
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "anthropic_beta": ["interleaved-thinking-2025-05-14"],
        },
        "performanceConfig": {"latency": "optimized"},
    }
    assert "anthropic-beta" not in received.headers
    thinking, text = message.content
    assert thinking.type == "thinking" and thinking.thinking == "".join(REASONING)
    assert thinking.signature == SIGNATURE
    assert text.type == "text" and text.text == answer_text(5)
    assert message.stop_reason == "end_turn"
    assert message.usage.input_tokens == 4  # "Be brief." + "hello there"
    assert message.usage.cache_read_input_tokens == 7


async def test_a_messages_stream_is_decoded_from_event_stream_frames(
    aws_env: Path, fake: tuple[BedrockFake, str]
) -> None:
    """ConverseStream's binary frames become a valid Messages stream: thinking with its
    signature, text, then `message_delta` with the stop reason and usage, then `message_stop`."""
    _, url = fake
    async with gateway(config(url, MODEL + "@reasoning,cached=3")) as c:
        body = {
            "model": "claude",
            "max_tokens": 100,
            "stream": True,
            "messages": [{"role": "user", "content": "hello there"}],
        }
        response = await c.http.post("/v1/messages", json=body)
    assert response.status_code == 200, response.text
    events = parse_sse(response.text)
    kinds = [name for name, _ in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    deltas = [data["delta"] for name, data in events if name == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == "".join(REASONING)
    assert [d["signature"] for d in deltas if d["type"] == "signature_delta"] == [SIGNATURE]
    assert "".join(d.get("text", "") for d in deltas) == answer_text(5)
    final = events[-2][1]
    assert final["delta"]["stop_reason"] == "end_turn"
    assert final["usage"]["output_tokens"] == 5 and final["usage"]["cache_read_input_tokens"] == 3


# --- OpenAI clients: chat and Responses, with a tool round trip ---------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_chat_tool_round_trip(
    aws_env: Path, fake: tuple[BedrockFake, str], stream: bool
) -> None:
    """OpenAI chat with a tool: the call comes back as `tool_calls` with its arguments, and the
    tool's result goes out as a Converse toolResult that the model answers."""
    bedrock, url = fake
    async with gateway(config(url, MODEL + "@tool")) as c:
        messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
        first = await chat(c, messages, stream)
        assert first["finish_reason"] == "tool_calls"
        assert first["content"] == TOOL_TEXT
        (call,) = first["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == TOOL_INPUT
        sent = bedrock.requests[-1].body
        assert sent["toolConfig"]["tools"][0]["toolSpec"]["name"] == "get_weather"
        assert sent["toolConfig"]["tools"][0]["toolSpec"]["inputSchema"]["json"]["required"] == [
            "city"
        ]
        messages += [
            {"role": "assistant", "content": first["content"], "tool_calls": first["tool_calls"]},
            {"role": "tool", "tool_call_id": call["id"], "content": "sunny"},
        ]
        second = await chat(c, messages, stream)
    assert second["content"] == AFTER_TOOL_TEXT and second["finish_reason"] == "stop"
    turns = bedrock.requests[-1].body["messages"]
    assert [t["role"] for t in turns] == ["user", "assistant", "user"]
    use = turns[1]["content"][-1]["toolUse"]
    assert use["name"] == "get_weather" and use["input"] == TOOL_INPUT
    result = turns[2]["content"][0]["toolResult"]
    assert result == {"toolUseId": use["toolUseId"], "content": [{"text": "sunny"}]}


async def chat(c: Clients, messages: list[Any], stream: bool) -> dict[str, Any]:
    """One answer through the OpenAI SDK: its message fields and finish reason, each response
    or chunk valid by the chat schema (as the wire had it: fields the SDK did not see left out)."""
    tools: Any = [WEATHER_TOOL]
    if not stream:
        raw = await c.openai.chat.completions.with_raw_response.create(
            model="claude", messages=messages, tools=tools
        )
        validate("chat", "CreateChatCompletionResponse", raw.http_response.json())
        choice = raw.parse().choices[0]
        message = choice.message.model_dump(mode="json", exclude_none=True)
        return {**message, "finish_reason": choice.finish_reason}
    chunks = [
        chunk
        async for chunk in await c.openai.chat.completions.create(
            model="claude", messages=messages, tools=tools, stream=True
        )
    ]
    validate_stream("chat", [(None, k.model_dump(mode="json", exclude_unset=True)) for k in chunks])
    content, finish = "", None
    calls: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or ():
            call = calls.setdefault(
                part.index,
                {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
            )
            call["id"] += part.id or ""
            call["function"]["name"] += (part.function and part.function.name) or ""
            call["function"]["arguments"] += (part.function and part.function.arguments) or ""
        finish = chunk.choices[0].finish_reason or finish
    return {"content": content, "tool_calls": list(calls.values()), "finish_reason": finish}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_responses_tool_round_trip(
    aws_env: Path, fake: tuple[BedrockFake, str], stream: bool
) -> None:
    """The OpenAI SDK's Responses API: a function call, then its output sent back through
    `previous_response_id`, answered by the model."""
    bedrock, url = fake
    tool = {
        "type": "function",
        "name": "get_weather",
        "parameters": WEATHER_TOOL["function"]["parameters"],
    }
    async with gateway(config(url, MODEL + "@tool")) as c:
        first = await respond(c, {"input": "Weather in Paris?", "tools": [tool]}, stream)
        (call,) = [item for item in first.output if item.type == "function_call"]
        assert call.name == "get_weather" and json.loads(call.arguments) == TOOL_INPUT
        output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
        second = await respond(
            c, {"input": [output], "tools": [tool], "previous_response_id": first.id}, stream
        )
    assert second.output_text == AFTER_TOOL_TEXT
    result = bedrock.requests[-1].body["messages"][-1]["content"][0]["toolResult"]
    assert result["content"] == [{"text": "sunny"}]


async def respond(c: Clients, body: dict[str, Any], stream: bool) -> Any:
    if not stream:
        raw = await c.openai.responses.with_raw_response.create(model="claude", **body)
        validate("responses", "ResponseResource", raw.http_response.json())
        return raw.parse()
    events = [e async for e in await c.openai.responses.create(model="claude", stream=True, **body)]
    validate_stream(
        "responses", [(e.type, e.model_dump(mode="json", exclude_unset=True)) for e in events]
    )
    (done,) = [e for e in events if e.type == "response.completed"]
    return done.response


async def test_anthropic_sdk_tool_round_trip_streamed(
    aws_env: Path, fake: tuple[BedrockFake, str]
) -> None:
    """The Anthropic SDK's stream helper assembles the tool call from input_json deltas."""
    bedrock, url = fake
    tool: Any = {
        "name": "get_weather",
        "input_schema": WEATHER_TOOL["function"]["parameters"],
        "cache_control": {"type": "ephemeral"},
    }
    async with gateway(config(url, MODEL + "@tool")) as c:
        turns: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
        async with c.anthropic.messages.stream(
            model="claude",
            max_tokens=100,
            messages=turns,
            tools=[tool],
            tool_choice={"type": "any"},
        ) as stream:
            first = await stream.get_final_message()
        use = first.content[-1]
        assert use.type == "tool_use" and use.input == TOOL_INPUT
        assert first.stop_reason == "tool_use"
        sent = bedrock.requests[-1].body["toolConfig"]
        assert sent["tools"][1] == {"cachePoint": {"type": "default"}}
        assert sent["toolChoice"] == {"any": {}}
        turns += [
            {
                "role": "assistant",
                "content": [b.model_dump(exclude_none=True) for b in first.content],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": use.id,
                        "content": "sunny",
                        "is_error": True,
                    }
                ],
            },
        ]
        second = await c.anthropic.messages.create(
            model="claude", max_tokens=100, messages=turns, tools=[tool]
        )
    answer = second.content[0]
    assert answer.type == "text" and answer.text == AFTER_TOOL_TEXT
    result = bedrock.requests[-1].body["messages"][-1]["content"][0]["toolResult"]
    assert result["status"] == "error"


# --- credentials ---------------------------------------------------------------------------------


async def test_a_wrong_secret_is_refused_and_never_shown(
    aws_env: Path, fake: tuple[BedrockFake, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signature made with a wrong secret is refused by the fake (403
    InvalidSignatureException): the client's error names AWS credentials (not an api_key) and
    holds no part of the secret or token."""
    bedrock, url = fake
    wrong = "wrongSecret/Bedrock+0123456789abcdefWRONG"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong)
    async with gateway(config(url)) as c:
        response = await c.http.post(
            "/v1/messages",
            json={
                "model": "claude",
                "max_tokens": 10,
                "messages": [{"role": "user", "content": "hi"}],
            },
        )
    assert bedrock.refused == ["InvalidSignatureException"]
    assert response.status_code == 502
    validate_error("messages", response.json())
    message = response.json()["error"]["message"]
    assert "AWS credentials" in message and "api_key" not in message
    for secret in (wrong, TOKEN, SECRET):
        assert secret not in response.text


async def test_a_bedrock_api_key_is_sent_as_a_bearer_token(
    aws_env: Path, fake: tuple[BedrockFake, str]
) -> None:
    """With `api_key`, no SigV4: the key goes as `Authorization: Bearer`; a wrong one is
    refused and the error says to check the api_key, without it."""
    bedrock, url = fake
    body = {"model": "claude", "messages": [{"role": "user", "content": "hi"}]}
    async with gateway(config(url, api_key=API_KEY)) as c:
        answer = await c.http.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert bedrock.requests[-1].headers["authorization"] == f"Bearer {API_KEY}"
    assert "x-amz-date" not in bedrock.requests[-1].headers
    async with gateway(config(url, api_key="ABSK-not-the-key-0123456789")) as c:
        refused = await c.http.post("/v1/chat/completions", json=body)
    assert refused.status_code == 502
    assert "api_key" in refused.json()["error"]["message"]
    assert "ABSK-not-the-key-0123456789" not in refused.text


async def test_credentials_from_a_shared_profile_file(
    aws_env: Path, fake: tuple[BedrockFake, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`aws_profile` picks a profile of the shared credentials file."""
    bedrock, url = fake
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name)
    bedrock.credentials[OTHER_KEY] = (OTHER_SECRET, None)
    (aws_env / "credentials").write_text(
        f"[default]\naws_access_key_id = AKIANOTUSED000000000\naws_secret_access_key = x\n\n"
        f"[team]\naws_access_key_id = {OTHER_KEY}\naws_secret_access_key = {OTHER_SECRET}\n"
    )
    body = {"model": "claude", "messages": [{"role": "user", "content": "hi"}]}
    async with gateway(config(url, aws_profile="team")) as c:
        answer = await c.http.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert f"Credential={OTHER_KEY}/" in bedrock.requests[-1].headers["authorization"]
    assert "x-amz-security-token" not in bedrock.requests[-1].headers


async def test_expiring_credentials_are_refreshed(
    aws_env: Path, fake: tuple[BedrockFake, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Temporary credentials from a profile's `credential_process`, about to expire, are
    fetched again (off the event loop) before the next request: once the first set is revoked,
    requests go on with the second."""
    bedrock, url = fake
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name)
    current = aws_env / "current.json"
    script = aws_env / "creds.py"
    script.write_text(f"import sys; sys.stdout.write(open({str(current)!r}).read())\n")
    (aws_env / "config").write_text(
        f"[profile temp]\ncredential_process = {sys.executable} {script}\n"
    )

    def issue(key: str, secret: str, token: str) -> None:
        # Expiring within botocore's refresh window: each use fetches them again.
        expiry = datetime.datetime.now(datetime.UTC) + datetime.timedelta(minutes=5)
        current.write_text(
            json.dumps(
                {
                    "Version": 1,
                    "AccessKeyId": key,
                    "SecretAccessKey": secret,
                    "SessionToken": token,
                    "Expiration": expiry.strftime("%Y-%m-%dT%H:%M:%SZ"),
                }
            )
        )

    issue(ACCESS_KEY, SECRET, TOKEN)
    body = {"model": "claude", "messages": [{"role": "user", "content": "hi"}]}
    async with gateway(config(url, aws_profile="temp")) as c:
        first = await c.http.post("/v1/chat/completions", json=body)
        assert first.status_code == 200, first.text
        del bedrock.credentials[ACCESS_KEY]  # revoked: the old set is now refused
        bedrock.credentials[OTHER_KEY] = (OTHER_SECRET, "rotated-session-token-0123456789")
        issue(OTHER_KEY, OTHER_SECRET, "rotated-session-token-0123456789")
        second = await c.http.post("/v1/chat/completions", json=body)
    assert second.status_code == 200, second.text
    assert f"Credential={OTHER_KEY}/" in bedrock.requests[-1].headers["authorization"]
    assert bedrock.refused == []


# --- errors, failover and hedging across two clouds -----------------------------------------------


@asynccontextmanager
async def two_clouds(
    url: str, bedrock_model: str, claude_model: str = "claude-x", **model: Any
) -> AsyncIterator[tuple[Clients, AnthropicFake]]:
    """Model `claude` on Bedrock, then the same model on Anthropic's API."""
    claude = AnthropicFake(api_key=ANTHROPIC_KEY)
    async with serve(claude) as claude_url:
        settings = build_settings(
            {
                "providers": {
                    "aws": {"type": "bedrock", "region": "us-east-1", "base_url": url},
                    "anthropic": {
                        "type": "anthropic",
                        "base_url": claude_url,
                        "api_key": ANTHROPIC_KEY,
                    },
                },
                "models": [
                    {
                        "name": "claude",
                        "deployments": [
                            {"provider": "aws", "model": bedrock_model, "weight": 1_000_000},
                            {"provider": "anthropic", "model": claude_model, "weight": 0.000001},
                        ],
                        **model,
                    }
                ],
            }
        )
        async with gateway(settings) as c:
            yield c, claude


@pytest.mark.parametrize(
    "script", ["throttle", "not_ready", "unavailable", "stream_exception=throttlingException"]
)
async def test_throttling_fails_over_to_the_same_model_on_another_cloud(
    aws_env: Path, fake: tuple[BedrockFake, str], script: str
) -> None:
    """Throttling (429 ThrottlingException, or inside the stream), a model not ready and an
    unavailable service fail over to the same model on Anthropic's API, and cool Bedrock down."""
    bedrock, url = fake
    async with two_clouds(url, f"{MODEL}@{script}") as (c, claude):
        response = await c.http.post(
            "/v1/chat/completions",
            json={
                "model": "claude",
                "stream": True,
                "messages": [{"role": "user", "content": "hi"}],
            },
        )
    assert response.status_code == 200, response.text
    assert response.headers["x-tailguard-deployment"] == "anthropic/claude-x"
    assert response.headers["x-tailguard-attempts"] == "2"
    text = "".join(
        d["choices"][0]["delta"].get("content") or ""
        for _, d in parse_sse(response.text)
        if d != "[DONE]" and d["choices"]
    )
    assert text == claude_text(5)
    assert len(bedrock.requests) == 1 and len(claude.requests) == 1


async def test_a_slow_first_token_is_hedged_on_the_other_cloud(
    aws_env: Path, fake: tuple[BedrockFake, str]
) -> None:
    """A Bedrock stream with no content by the deadline is hedged on Anthropic's API; the hedge
    wins and the Bedrock stream is closed."""
    bedrock, url = fake
    async with two_clouds(
        url,
        f"{MODEL}@slow_ms=10000",
        budget={"ttft_ms": 500},
        on_ttft_miss="hedge",
        hedge_max_fraction=1.0,
    ) as (c, _):
        response = await c.http.post(
            "/v1/messages",
            json={
                "model": "claude",
                "max_tokens": 50,
                "stream": True,
                "messages": [{"role": "user", "content": "hi"}],
            },
        )
        await bedrock.wait_for(lambda f: f.streams_abandoned == 1)
    assert response.status_code == 200
    assert response.headers["x-tailguard-route"] == "hedge"
    assert response.headers["x-tailguard-deployment"] == "anthropic/claude-x"


async def test_an_exception_after_content_ends_the_stream_with_an_error(
    aws_env: Path, fake: tuple[BedrockFake, str]
) -> None:
    """An exception frame after the first tokens were sent cannot fail over: the client's stream
    ends with its wire's error event."""
    _, url = fake
    async with gateway(config(url, MODEL + "@exception_after=2")) as c:
        response = await c.http.post(
            "/v1/messages",
            json={
                "model": "claude",
                "max_tokens": 50,
                "stream": True,
                "messages": [{"role": "user", "content": "hi"}],
            },
        )
    events = parse_sse(response.text)
    texts = [d["delta"]["text"] for n, d in events if n == "content_block_delta"]
    assert "".join(texts) == "Hello from "
    assert events[-1][0] == "error"
    assert "modelStreamErrorException" in events[-1][1]["error"]["message"]


async def test_a_validation_exception_is_the_clients_400(
    aws_env: Path, fake: tuple[BedrockFake, str]
) -> None:
    """Bedrock's ValidationException (here: a conversation that opens with an assistant turn)
    is a 400 in the client's own wire shape, not retried elsewhere."""
    bedrock, url = fake
    body = {"model": "claude", "messages": [{"role": "assistant", "content": "hi"}]}
    async with gateway(config(url)) as c:
        chat_answer = await c.http.post("/v1/chat/completions", json=body)
        messages_answer = await c.http.post("/v1/messages", json={**body, "max_tokens": 5})
    assert bedrock.refused == ["ValidationException", "ValidationException"]
    assert chat_answer.status_code == 400 and messages_answer.status_code == 400
    validate_error("chat", chat_answer.json())
    validate_error("messages", messages_answer.json())
    assert "alternate" in chat_answer.json()["error"]["message"]


async def test_a_url_image_is_refused_before_sending(
    aws_env: Path, fake: tuple[BedrockFake, str]
) -> None:
    """Converse takes images as bytes only: an image by URL is a 400 naming the field, and
    nothing is sent; a base64 image is sent as Converse image bytes."""
    bedrock, url = fake
    image = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    pixel = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
    }
    async with gateway(config(url)) as c:
        refused = await c.http.post(
            "/v1/messages",
            json={
                "model": "claude",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": [image]}],
            },
        )
        sent = await c.http.post(
            "/v1/messages",
            json={
                "model": "claude",
                "max_tokens": 5,
                "messages": [
                    {"role": "user", "content": [pixel, {"type": "text", "text": "what?"}]}
                ],
            },
        )
    assert refused.status_code == 400 and "URL" in refused.json()["error"]["message"]
    assert sent.status_code == 200, sent.text
    assert len(bedrock.requests) == 1
    assert bedrock.requests[0].body["messages"][0]["content"][0] == {
        "image": {"format": "png", "source": {"bytes": "iVBORw0KGgo="}}
    }


async def test_latency_ms_is_recorded_on_the_attempt_span(
    aws_env: Path, fake: tuple[BedrockFake, str]
) -> None:
    """Bedrock's own `metrics.latencyMs` lands on the attempt's span, streamed and not."""
    _, url = fake
    receiver = OTLPReceiver()
    async with serve(receiver) as otlp:
        environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp, "TAILGUARD_TRACES_TAIL_RATIO": "1"}
        async with (
            run_gateway(config(url, MODEL + "@latency_ms=321"), environ=environ) as gw,
            httpx.AsyncClient(base_url=gw.url, timeout=TIMEOUT_S) as http,
        ):
            for stream in (False, True):
                body = {
                    "model": "claude",
                    "stream": stream,
                    "messages": [{"role": "user", "content": "hi"}],
                }
                assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
        await receiver.wait_for(lambda r: len(r.of_kind("CLIENT")) == 2)
    attempts = receiver.of_kind("CLIENT")
    assert [s.attributes[sc.TG_UPSTREAM_LATENCY_MS] for s in attempts] == [321, 321]
    assert {s.attributes[sc.GEN_AI_PROVIDER_NAME] for s in attempts} == {"aws.bedrock"}


# --- configuration -------------------------------------------------------------------------------

_CONFIG = """\
providers:
  aws:
    type: {type}
{keys}
models:
  - name: claude
    deployments: [{{provider: aws, model: "anthropic.claude-sonnet-4-5-20250929-v1:0"}}]
"""


@pytest.mark.parametrize(
    ("kind", "keys", "expected"),
    [
        (
            "bedrock",
            "    aws_profile: prod",
            "providers.aws: region is required for a provider of type 'bedrock' (the AWS region "
            "the models run in, e.g. us-east-1; it is part of the endpoint and of the SigV4 "
            "signature)",
        ),
        (
            "bedrock",
            "    region: us-east1",
            "providers.aws: region 'us-east1' is not an AWS region name (like us-east-1 or "
            "eu-west-3)",
        ),
        (
            "bedrock",
            "    region: us-east-1\n    aws_profile: prod\n    api_key: ABSK-key-0123456789",
            "providers.aws: api_key (a Bedrock API key, sent as a bearer token) and aws_profile "
            "(SigV4 with that profile's credentials) are two ways to authenticate: set one",
        ),
        (
            "bedrock",
            "    region: us-east-1\n    base_url: https://bedrock-runtime.us-east-1.amazonaws.com"
            "/model/x/converse",
            "providers.aws: base_url is the endpoint alone (like https://bedrock-runtime.us-east-1"
            ".amazonaws.com): the gateway adds /model/{model}/converse itself",
        ),
        (
            "bedrock",
            "    region: us-east-1\n    performance_latency: fast",
            "providers.aws.performance_latency: Input should be 'standard' or 'optimized'",
        ),
        (
            "anthropic",
            "    base_url: https://api.anthropic.com\n    region: us-east-1",
            "providers.aws: region is for providers of type bedrock",
        ),
    ],
    ids=["no-region", "bad-region", "two-auths", "base-url-path", "bad-latency", "not-bedrock"],
)
def test_check_config_explains_bedrock_keys(
    tmp_path: Path, kind: str, keys: str, expected: str
) -> None:
    line = 5 if "performance_latency" in expected else 2
    """`check-config` names the file, line and key, and says what to do."""
    path = write(tmp_path, _CONFIG.format(type=kind, keys=keys))
    assert problems(path).strip() == f"error: {path}:{line}: {expected}"


def test_the_example_config_is_valid_and_shows_the_implied_endpoint() -> None:
    """The example passes `check-config`, which shows the endpoint the region implies and the
    endpoints a Bedrock deployment serves (every LLM wire, none of completions or embeddings)."""
    explained = report("config/examples/bedrock.yaml")
    providers = explained["providers"]
    assert (
        providers["bedrock-east"]["base_url"] == "https://bedrock-runtime.us-east-1.amazonaws.com"
    )
    assert providers["bedrock-east"]["endpoints"] == ["chat", "messages"]


async def test_credentials_an_error_repeats_are_scrubbed(
    aws_env: Path, fake: tuple[BedrockFake, str]
) -> None:
    """An upstream error that repeats the Authorization header and the session token reaches
    the client without the token, the signature or the access key id, streamed or not."""
    bedrock, url = fake
    async with gateway(config(url, MODEL + "@echo")) as c:
        answers = [
            await c.http.post(
                "/v1/chat/completions",
                json={
                    "model": "claude",
                    "stream": stream,
                    "messages": [{"role": "user", "content": "hi"}],
                },
            )
            for stream in (False, True)
        ]
    signature = bedrock.requests[-1].headers["authorization"].rpartition("Signature=")[2]
    for answer in answers:
        assert answer.status_code == 400
        assert "Malformed input" in answer.json()["error"]["message"]
        for secret in (TOKEN, signature, ACCESS_KEY, SECRET):
            assert secret not in answer.text


async def test_refused_credentials_are_resolved_again(
    aws_env: Path, fake: tuple[BedrockFake, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Static keys rotated under a running gateway: the first request with the old ones is
    refused, and the next resolves the chain again and goes through with the new ones."""
    bedrock, url = fake
    body = {"model": "claude", "messages": [{"role": "user", "content": "hi"}]}
    async with gateway(config(url)) as c:
        assert (await c.http.post("/v1/chat/completions", json=body)).status_code == 200
        bedrock.credentials = {OTHER_KEY: (OTHER_SECRET, None)}
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", OTHER_KEY)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", OTHER_SECRET)
        monkeypatch.delenv("AWS_SESSION_TOKEN")
        refused = await c.http.post("/v1/chat/completions", json=body)
        again = await c.http.post("/v1/chat/completions", json=body)
    assert refused.status_code == 502 and again.status_code == 200, again.text
    assert bedrock.refused == ["UnrecognizedClientException"]
    assert f"Credential={OTHER_KEY}/" in bedrock.requests[-1].headers["authorization"]


async def test_repeated_throttling_cools_bedrock_down(
    aws_env: Path, fake: tuple[BedrockFake, str]
) -> None:
    """Throttled three times in a row, the Bedrock deployment cools down: the next request goes
    straight to the same model on Anthropic's API, one attempt, Bedrock not called."""
    bedrock, url = fake
    body = {"model": "claude", "messages": [{"role": "user", "content": "hi"}]}
    async with two_clouds(url, f"{MODEL}@throttle") as (c, _):
        for _ in range(3):
            failed_over = await c.http.post("/v1/chat/completions", json=body)
            assert failed_over.headers["x-tailguard-attempts"] == "2"
        cooled = await c.http.post("/v1/chat/completions", json=body)
    assert cooled.status_code == 200
    assert cooled.headers["x-tailguard-attempts"] == "1"
    assert cooled.headers["x-tailguard-deployment"] == "anthropic/claude-x"
    assert len(bedrock.requests) == 3


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_guardrail_is_a_content_filter_for_chat_clients(
    aws_env: Path, fake: tuple[BedrockFake, str], stream: bool
) -> None:
    """`guardrail_intervened` is a Messages `refusal`, which chat clients see as
    `content_filter`."""
    _, url = fake
    async with gateway(config(url, MODEL + "@stop=guardrail_intervened")) as c:
        answer = await chat(c, [{"role": "user", "content": "hi"}], stream)
    assert answer["finish_reason"] == "content_filter"


async def test_a_frame_with_a_bad_crc_fails_the_attempt(
    aws_env: Path, fake: tuple[BedrockFake, str]
) -> None:
    """A frame whose CRC does not match is a garbled upstream, not content: the attempt fails
    before anything reached the client."""
    _, url = fake
    async with gateway(config(url, MODEL + "@corrupt")) as c:
        response = await c.http.post(
            "/v1/chat/completions",
            json={
                "model": "claude",
                "stream": True,
                "messages": [{"role": "user", "content": "hi"}],
            },
        )
    assert response.status_code == 502
    assert "invalid event stream" in response.json()["error"]["message"]
    assert "Checksum" in response.json()["error"]["message"]


# --- translation details -------------------------------------------------------------------------


def test_blocks_without_an_end_to_end_script_map_both_ways() -> None:
    """Documents, redacted thinking, merged turns and a named tool choice go to Converse; a
    redacted reasoning block and a guardrail stop come back as Messages."""
    body = {
        "max_tokens": 10,
        "messages": [
            {"role": "user", "content": "first"},
            {
                "role": "user",
                "content": [
                    {
                        "type": "document",
                        "title": "Q3 report (final)",
                        "source": {"type": "text", "media_type": "text/plain", "data": "hi"},
                    }
                ],
            },
            {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "b3BhcXVl"}]},
        ],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "tool", "name": "f"},
        "metadata": {"user_id": "u-1"},
        "top_k": 5,
    }
    converse = messages_to_converse(body)
    assert converse["messages"] == [
        {
            "role": "user",
            "content": [
                {"text": "first"},
                {
                    "document": {
                        "format": "txt",
                        "name": "Q3 report final",
                        "source": {"bytes": "aGk="},
                    }
                },
            ],
        },
        {"role": "assistant", "content": [{"reasoningContent": {"redactedContent": "b3BhcXVl"}}]},
    ]
    assert converse["toolConfig"]["toolChoice"] == {"tool": {"name": "f"}}
    assert converse["additionalModelRequestFields"] == {"top_k": 5}
    assert "metadata" not in json.dumps(converse)
    # `none`: no tools at all, unless earlier turns used them (Converse then needs them).
    none = messages_to_converse({**body, "tool_choice": {"type": "none"}})
    assert "toolConfig" not in none
    used = {
        **body,
        "tool_choice": {"type": "none"},
        "messages": [
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [
                            {"type": "text", "text": "ok", "cache_control": {"type": "ephemeral"}}
                        ],
                    }
                ],
            },
        ],
    }
    kept = messages_to_converse(used)
    assert "toolChoice" not in kept["toolConfig"] and kept["toolConfig"]["tools"]
    assert kept["messages"][1]["content"] == [
        {"toolResult": {"toolUseId": "t1", "content": [{"text": "ok"}]}},
        {"cachePoint": {"type": "default"}},
    ]
    with pytest.raises(TranslationError, match="cannot run on Bedrock"):
        messages_to_converse({**body, "tools": [{"type": "web_search_20250305", "name": "w"}]})
    answer = {
        "output": {
            "message": {
                "role": "assistant",
                "content": [{"reasoningContent": {"redactedContent": "eHl6"}}],
            }
        },
        "stopReason": "guardrail_intervened",
        "usage": {"inputTokens": 3, "outputTokens": 0, "cacheWriteInputTokens": 9},
    }
    message = converse_to_message(answer, model="m", message_id="msg_1")
    assert message["content"] == [{"type": "redacted_thinking", "data": "eHl6"}]
    assert message["stop_reason"] == "refusal"
    assert message["usage"] == {
        "input_tokens": 3,
        "output_tokens": 0,
        "cache_creation_input_tokens": 9,
    }


def test_a_stream_without_metadata_still_ends_cleanly() -> None:
    """Usage comes after the stop reason in ConverseStream; a stream that stops without it still
    gets `message_delta` and `message_stop`, and open blocks are closed first."""
    translator = ConverseStreamTranslator(model="m", message_id="msg_1")
    kinds = [k for k, _, _ in translator.event("messageStart", {"role": "assistant"})]
    kinds += [
        k
        for k, _, _ in translator.event(
            "contentBlockDelta", {"contentBlockIndex": 0, "delta": {"text": "Hi"}}
        )
    ]
    kinds += [k for k, _, _ in translator.event("messageStop", {"stopReason": "max_tokens"})]
    tail = translator.finish()
    kinds += [k for k, _, _ in tail]
    assert kinds == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert json.loads(tail[1][2])["delta"]["stop_reason"] == "max_tokens"
    assert translator.complete and translator.finish() == []


async def test_the_idle_timeout_applies_to_event_streams(
    aws_env: Path, fake: tuple[BedrockFake, str]
) -> None:
    """A ConverseStream that sends its start and then nothing for `stream_idle_timeout_ms` is
    given up on like any stream (a 504 here, with nowhere to fail over), and closed upstream."""
    bedrock, url = fake
    settings = config(url, MODEL + "@slow_ms=20000", stream_idle_timeout_ms=300)
    async with gateway(settings) as c:
        response = await c.http.post(
            "/v1/chat/completions",
            json={
                "model": "claude",
                "stream": True,
                "messages": [{"role": "user", "content": "hi"}],
            },
        )
        await bedrock.wait_for(lambda f: f.streams_abandoned == 1)
    assert response.status_code == 504, response.text


async def test_credentials_from_web_identity(
    aws_env: Path, fake: tuple[BedrockFake, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no keys in the environment or files, the chain reaches web identity (as on EKS):
    botocore trades the token file for temporary credentials at STS (a fake here), and the
    requests are signed with them."""
    bedrock, url = fake
    role = "arn:aws:iam::123456789012:role/bedrock"
    issued = (
        "ASIAFAKEWEBIDENTITY1",
        "webSecret/Bedrock+0123456789abcdef",
        "web-session-0123456789",
    )
    sts = StsFake(role_arn=role, web_token="eyJ.fake-oidc.token", issued=issued)
    bedrock.credentials[issued[0]] = (issued[1], issued[2])
    (aws_env / "token").write_text(sts.web_token)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name)
    async with serve(sts) as sts_url:
        monkeypatch.setenv("AWS_ROLE_ARN", role)
        monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(aws_env / "token"))
        monkeypatch.setenv("AWS_ENDPOINT_URL_STS", sts_url)
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        body = {"model": "claude", "messages": [{"role": "user", "content": "hi"}]}
        async with gateway(config(url)) as c:
            answer = await c.http.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert sts.calls == 1
    assert f"Credential={issued[0]}/" in bedrock.requests[-1].headers["authorization"]
    assert bedrock.requests[-1].headers["x-amz-security-token"] == issued[2]


async def test_missing_credentials_are_explained(
    aws_env: Path, fake: tuple[BedrockFake, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A profile that does not exist, or a chain that finds nothing, fails the attempt with a
    message saying so, before anything is sent."""
    bedrock, url = fake
    body = {"model": "claude", "messages": [{"role": "user", "content": "hi"}]}
    async with gateway(config(url, aws_profile="missing")) as c:
        no_profile = await c.http.post("/v1/chat/completions", json=body)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name)
    async with gateway(config(url)) as c:
        nothing = await c.http.post("/v1/chat/completions", json=body)
    assert no_profile.status_code == nothing.status_code == 502
    assert "profile (missing) could not be found" in no_profile.json()["error"]["message"]
    assert "no AWS credentials found" in nothing.json()["error"]["message"]
    assert bedrock.requests == []

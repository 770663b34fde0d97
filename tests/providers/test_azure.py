"""Azure OpenAI (`type: azure`) end to end: the official SDKs (OpenAI chat and Responses,
Anthropic Messages) through the gateway to a fake of Azure's chat completions API
(`tests/fakes/azure_upstream.py`) that checks the path shape, the api-version, the credential,
and answers with Azure's filter results; both run on loopback in the test's loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anthropic
import orjson
import pytest
from anthropic.types import Message, ToolParam
from openai.types.chat import ChatCompletionToolParam
from openai.types.responses import FunctionToolParam, Response, ResponseFunctionToolCall
from openai.types.responses.response_input_param import FunctionCallOutput
from typer.testing import CliRunner

from gateway.cli import app as cli
from gateway.models import SSEEvent
from gateway.providers.azure import filter_results_only
from gateway.providers.decode import OpenAIStreamDecoder
from gateway.scrubbing import Scrubber
from tests.clients import Clients, open_clients
from tests.conftest import serve, simulated
from tests.fakes.azure_upstream import AFTER_TOOL_TEXT, RESPONSES_VERSION, WORDS, AzureFake
from tests.fakes.responses_upstream import WORDS as NATIVE_WORDS
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


@asynccontextmanager
async def gateway(
    providers: dict[str, Any], *models: dict[str, Any], **extra: Any
) -> AsyncIterator[Clients]:
    async with open_clients(providers, list(models), **extra) as clients:
        yield clients


# --- the wire: paths, versions, credentials, filter results --------------------------------------


async def test_dated_version_uses_the_deployment_path_and_the_api_key(
    fake: tuple[AzureFake, str],
) -> None:
    """A dated api_version: `/openai/deployments/{model}/chat/completions?api-version=...` with
    the `api-key` header; the stream reaches the client without Azure's filter-only events."""
    upstream, url = fake
    async with gateway({"az": azure(url)}, model("gpt", "az/gpt-4o-prod")) as clients:
        chat = clients.openai
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
        chat = clients.openai
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
        chat = clients.openai
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
        chat = clients.openai
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
        messages = clients.anthropic
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


# --- credentials ---------------------------------------------------------------------------------


def rotate(path: Path, token: str, *, in_place: bool = False) -> None:
    """Write a new token as a rotation does: a new file renamed over the old one (a projected
    volume's swap), or the same file rewritten."""
    if in_place:
        path.write_text(token + "\n")
        return
    fresh = path.with_suffix(".new")
    fresh.write_text(token + "\n")
    os.replace(fresh, path)


async def test_a_token_rotated_on_disk_is_used_without_failing_a_request(
    fake: tuple[AzureFake, str], tmp_path: Path
) -> None:
    """`azure_ad_token_file`: each rotation (by rename, or rewritten in place) is used from the
    next request on, while Azure accepts only the newest token."""
    upstream, url = fake
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    spec = {
        "type": "azure",
        "base_url": url,
        "api_version": VERSION,
        "azure_ad_token_file": str(path),
    }
    third = ROTATED + "-and-again"
    async with gateway({"az": spec}, model("gpt", "az/gpt-4o-prod")) as clients:
        for token, in_place in ((TOKEN, False), (ROTATED, False), (third, True)):
            rotate(path, token, in_place=in_place)
            upstream.tokens = {token}  # the old token is refused from now on
            for stream in (False, True):
                response = await clients.http.post(
                    "/v1/chat/completions",
                    json={"model": "gpt", "messages": [{"role": "user", "content": "hi"}]}
                    | {"stream": stream},
                )
                assert response.status_code == 200, response.text
        path.unlink()  # between a delete and a rename: the last token read stays in use
        response = await clients.http.post("/v1/chat/completions", json=chat_body("gpt"))
        assert response.status_code == 200, response.text
    assert upstream.refused == []
    sent = [r.headers["authorization"] for r in upstream.requests]
    assert sent == [f"Bearer {t}" for t in (TOKEN, TOKEN, ROTATED, ROTATED, third, third, third)]


async def test_an_unreadable_token_file_fails_over_and_says_why(
    fake: tuple[AzureFake, str], tmp_path: Path
) -> None:
    upstream, url = fake
    spec = {
        "type": "azure",
        "base_url": url,
        "api_version": VERSION,
        "azure_ad_token_file": str(tmp_path / "missing"),
    }
    async with gateway(
        {"az": spec, "good": azure(url)}, model("gpt", "az/gpt-4o-east", "good/gpt-4o-west")
    ) as clients:
        served = await clients.http.post(
            "/v1/chat/completions",
            json={"model": "gpt", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert served.status_code == 200
        assert served.headers["x-tailguard-deployment"] == "good/gpt-4o-west"
        alone = model("solo", "az/gpt-4o-east")
    async with gateway({"az": spec}, alone) as clients:
        failed = await clients.http.post(
            "/v1/chat/completions",
            json={"model": "solo", "messages": [{"role": "user", "content": "hi"}]},
        )
    assert failed.status_code == 502
    assert (
        "cannot read azure_ad_token_file (FileNotFoundError)" in failed.json()["error"]["message"]
    )
    assert upstream.served("gpt-4o-east") == 0


@pytest.mark.parametrize("auth", ["api_key", "azure_ad_token"])
async def test_rejected_credentials_never_show_in_errors_logs_or_admin(
    fake: tuple[AzureFake, str], caplog: pytest.LogCaptureFixture, auth: str
) -> None:
    """Azure's 401 body echoes the credential it was given: the client's error, the log and
    `/admin` carry neither it nor the configured one; the error names the key to check."""
    upstream, url = fake
    wrong = "azure-WRONG-credential-5f3c2a9b7d1e4f60"
    spec = {"type": "azure", "base_url": url, "api_version": VERSION, auth: wrong}
    caplog.set_level(logging.DEBUG)
    async with gateway({"az": spec}, model("gpt", "az/gpt-4o-prod")) as clients:
        bodies = []
        for path, body in WIRES.values():
            for stream in (False, True):
                response = await clients.http.post(
                    path, json={**body, "model": "gpt", "stream": stream}
                )
                assert response.status_code == 502
                bodies.append(response.text)
        for path in ("/admin/latency", "/readyz", "/metrics", "/dashboard"):
            bodies.append((await clients.http.get(path)).text)
    assert upstream.refused and set(upstream.refused) == {401}
    assert f"credentials (401); check the provider's {auth}" in bodies[0]
    seen = "\n".join(bodies) + caplog.text
    assert wrong not in seen and wrong[:20] not in seen


# --- content filter, throttling, failover --------------------------------------------------------


def chat_body(name: str) -> dict[str, Any]:
    return {"model": name, "messages": [{"role": "user", "content": "hi"}]}


async def test_a_content_filter_refusal_is_the_answer_and_not_failed_over(
    fake: tuple[AzureFake, str],
) -> None:
    """A 400 `content_filter` is the client's answer, in each wire's error shape; the model's
    other deployment is not tried, and the refusing one does not cool down."""
    upstream, url = fake
    models = model("gpt", "az/filtered-east", "az/gpt-4o-west")
    async with gateway({"az": azure(url)}, models) as clients:
        for _ in range(4):
            refused = await clients.http.post("/v1/chat/completions", json=chat_body("gpt"))
            assert refused.status_code == 400
            error = refused.json()["error"]
            assert (
                error["code"] == "content_filter"
                and "content management policy" in error["message"]
            )
        with pytest.raises(anthropic.BadRequestError) as caught:
            await clients.anthropic.messages.create(
                model="gpt", max_tokens=10, messages=[{"role": "user", "content": "hi"}]
            )
        latency = (await clients.http.get("/admin/latency")).json()
    assert caught.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert upstream.served("filtered-east") == 5 and upstream.served("gpt-4o-west") == 0
    assert latency["deployments"].get("az/filtered-east", {}).get("cooldown_until") is None


async def test_content_filter_failover_tries_the_other_deployments(
    fake: tuple[AzureFake, str],
) -> None:
    """`content_filter_failover: true`: the refusal sends the request to the next deployment
    (without cooling the refusing one down); refused everywhere, the refusal is the answer."""
    upstream, url = fake
    spec = azure(url, content_filter_failover=True)
    models = (
        model("gpt", "az/filtered-east", "az/gpt-4o-west"),
        model("strict", "az/filtered-a", "az/filtered-b"),
    )
    async with gateway({"az": spec}, *models) as clients:
        for _ in range(4):
            served = await clients.http.post("/v1/chat/completions", json=chat_body("gpt"))
            assert served.status_code == 200
            assert served.headers["x-tailguard-deployment"] == "az/gpt-4o-west"
            assert served.headers["x-tailguard-attempts"] == "2"
        refused = await clients.http.post("/v1/chat/completions", json=chat_body("strict"))
        latency = (await clients.http.get("/admin/latency")).json()
        metrics = (await clients.http.get("/metrics")).text
    assert upstream.served("filtered-east") == 4  # tried first every time: never cooling down
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "content_filter"
    assert upstream.served("filtered-a") == upstream.served("filtered-b") == 1
    assert 'error_type="content_filter"' in metrics  # a label of its own, not upstream_other
    assert not any(d.get("cooldown_until") for d in latency["deployments"].values())


async def test_a_429_with_retry_after_ms_fails_over_and_cools_down(
    fake: tuple[AzureFake, str],
) -> None:
    """Azure's 429 (`retry-after-ms: 30000`): the request is served by the other deployment and
    the throttled one is left alone for the 30 s it asked."""
    upstream, url = fake
    async with gateway({"az": azure(url)}, model("gpt", "az/busy-east", "az/gpt-4o-west")) as c:
        for _ in range(3):
            served = await c.http.post("/v1/chat/completions", json=chat_body("gpt"))
            assert served.status_code == 200
            assert served.headers["x-tailguard-deployment"] == "az/gpt-4o-west"
        latency = (await c.http.get("/admin/latency")).json()
    assert upstream.served("busy-east") == 1  # cooling down after its 429
    left = latency["deployments"]["az/busy-east"]["cooldown_until"] - time.time()
    assert 25 < left <= 30


# --- the same model on Azure and on OpenAI -------------------------------------------------------


async def test_azure_and_openai_deployments_fail_over_both_ways(
    fake: tuple[AzureFake, str],
) -> None:
    """A model on Azure and on OpenAI: a throttled Azure deployment fails over to OpenAI, a
    failing OpenAI deployment (its connection reset) to Azure."""
    _, url = fake
    async with simulated() as oa:
        providers = {"az": azure(url), "oa": {"type": "openai", "base_url": oa.base_url}}
        models = (
            model("gpt", "az/busy-east", "oa/gpt-4o"),
            model("gpt-b", "oa/gpt-4o@reset_rate=1", "az/gpt-4o-west"),
        )
        async with gateway(providers, *models) as clients:
            first = await clients.openai.chat.completions.with_raw_response.create(
                model="gpt", messages=[{"role": "user", "content": "hi"}]
            )
            second = await clients.anthropic.messages.with_raw_response.create(
                model="gpt-b", max_tokens=50, messages=[{"role": "user", "content": "hi"}]
            )
    assert first.headers["x-tailguard-deployment"] == "oa/gpt-4o"
    assert first.headers["x-tailguard-attempts"] == "2"
    assert second.headers["x-tailguard-deployment"] == "az/gpt-4o-west"
    assert second.headers["x-tailguard-attempts"] == "2"
    message = await second.parse()
    assert message.content[0].type == "text" and message.content[0].text == TEXT


async def test_a_slow_azure_deployment_is_hedged_on_openai(fake: tuple[AzureFake, str]) -> None:
    """A first token late on Azure: a hedge on OpenAI wins, and the Azure stream is closed."""
    upstream, url = fake
    async with simulated() as oa:
        providers = {"az": azure(url), "oa": {"type": "openai", "base_url": oa.base_url}}
        gpt = model("gpt", "az/slow-east", "oa/gpt-4o")
        for deployment in gpt["deployments"]:
            deployment["prior"] = {"ttft_ms": 50}
        gpt |= {"budget": {"ttft_ms": 400}, "on_ttft_miss": "hedge", "hedge_max_fraction": 1.0}
        async with gateway(providers, gpt) as clients:
            response = await clients.http.post(
                "/v1/chat/completions", json=chat_body("gpt") | {"stream": True}
            )
            async with asyncio.timeout(WATCHDOG_S):
                await upstream.wait_for(lambda fake: fake.abandoned == 1)
    assert response.status_code == 200
    assert response.headers["x-tailguard-route"] == "hedge"
    assert response.headers["x-tailguard-deployment"] == "oa/gpt-4o"
    assert response.text.rstrip().endswith("data: [DONE]")
    assert upstream.served("slow-east") == 1


# --- check-config --------------------------------------------------------------------------------

AZURE_CONFIG = """\
providers:
  az:
    type: azure
    base_url: https://contoso.openai.azure.com
{keys}
models:
  - name: gpt
    deployments: [{{provider: az, model: gpt-4o-prod}}]
"""


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (
            "    api_key: k-0123456789",
            "providers.az: api_version is required for a provider of type 'azure': 'v1' (the "
            "/openai/v1/ paths) or a dated version such as '2024-10-21' (the "
            "/openai/deployments/{deployment}/ paths)",
        ),
        (
            "    api_version: 2024-10\n    api_key: k-0123456789",
            "providers.az: api_version '2024-10' is neither 'v1' nor a date such as "
            "'2024-10-21' (a preview version: '2025-04-01-preview')",
        ),
        (
            "    api_version: v1",
            "providers.az: a provider of type 'azure' needs a credential: api_key (sent as "
            "api-key), or an Entra ID token in azure_ad_token (use ${VAR}) or "
            "azure_ad_token_file",
        ),
        (
            "    api_version: v1\n    api_key: k-0123456789\n    azure_ad_token_file: /t",
            "providers.az: api_key and azure_ad_token_file are alternatives: set only one of them",
        ),
        (
            "    api_version: v1\n    api_key: k-0123456789\n    responses: native\n"
            "    content_filter_failover: maybe",
            "providers.az.content_filter_failover: Input should be a valid boolean, unable to "
            "interpret input",
        ),
    ],
    ids=["no-version", "bad-version", "no-credential", "two-credentials", "bad-boolean"],
)
def test_check_config_explains_azure_keys(tmp_path: Path, keys: str, message: str) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(AZURE_CONFIG.format(keys=keys))
    assert message in check_config_problems(path)


def test_check_config_explains_azure_urls_and_keys_on_other_types(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(
        AZURE_CONFIG.format(keys="    api_version: v1\n    api_key: k-0123456789").replace(
            "azure.com", "azure.com/openai/v1"
        )
    )
    assert (
        "providers.az: base_url of an azure provider is the resource's root, such as "
        "https://<resource>.openai.azure.com, without '/openai/v1': the gateway adds the "
        "/openai/... path itself, as api_version says"
    ) in check_config_problems(path)
    path.write_text(
        AZURE_CONFIG.format(keys="    content_filter_failover: true").replace(
            "type: azure", "type: openai"
        )
    )
    assert (
        "providers.az: content_filter_failover is for providers of type azure (this one is "
        "'openai')"
    ) in check_config_problems(path)
    path.write_text(AZURE_CONFIG.format(keys="    api_version: v1\n    api_key: k-0123456789"))
    result = CliRunner().invoke(cli, ["check-config", "--config", str(path), "--json"])
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["providers"]["az"]["endpoints"] == [
        "chat",
        "messages",
        "completions",
        "embeddings",
    ]
    assert "k-0123456789" not in result.stdout
    path.write_text(AZURE_CONFIG.format(keys=f"    api_version: v1\n    azure_ad_token: {TOKEN}"))
    result = CliRunner().invoke(cli, ["check-config", "--config", str(path), "--explain"])
    assert result.exit_code == 0, result.stderr
    assert "Entra ID token set" in result.stdout and TOKEN not in result.stdout


def check_config_problems(path: Path) -> str:
    result = CliRunner().invoke(cli, ["check-config", "--config", str(path)])
    assert result.exit_code == 2, result.stdout
    assert "Traceback" not in result.stderr and "k-0123456789" not in result.stderr
    return " ".join(result.stderr.split())


# --- native Responses ----------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["v1", RESPONSES_VERSION])
async def test_native_responses_reach_azures_responses_api(
    fake: tuple[AzureFake, str], version: str
) -> None:
    """`responses: native`: `/v1/responses` goes to Azure's own Responses API, the deployment
    named in the body, streamed and not; the answer passes through."""
    upstream, url = fake
    spec = azure(url, api_version=version, responses="native")
    async with gateway({"az": spec}, model("gpt", "az/gpt-4o-prod")) as clients:
        answer = await clients.openai.responses.create(model="gpt", input="hi")
        events = await clients.openai.responses.create(model="gpt", input="hi", stream=True)
        kinds = [event.type async for event in events]
    assert answer.output_text == "".join(NATIVE_WORDS)
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert upstream.refused == []
    for received in upstream.requests:
        assert received.deployment == "gpt-4o-prod"
        assert received.headers["api-key"] == API_KEY
        if version == "v1":
            assert received.path == "/openai/v1/responses" and received.query == {}
        else:
            assert received.path == "/openai/responses"
            assert received.query == {"api-version": [RESPONSES_VERSION]}


# --- which events are Azure's filter results only ----------------------------------------------


@pytest.mark.parametrize(
    ("event", "dropped"),
    [
        ({"choices": [], "prompt_filter_results": [{"prompt_index": 0}]}, True),
        ({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}}, False),
        ({"choices": [{"index": 0, "finish_reason": None, "content_filter_results": {}}]}, True),
        (
            {
                "choices": [
                    {"index": 0, "content_filter_offsets": {"end_offset": 9}, "delta": {}},
                ]
            },
            True,
        ),
        ({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}, False),
        ({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}, False),
        ({"choices": [{"index": 0, "delta": {}, "finish_reason": None}]}, False),  # not Azure's
        ({"choices": [{"index": 0, "text": "", "content_filter_results": {}}]}, False),
    ],
    ids=[
        "prompt-filter",
        "usage",
        "filter-results",
        "filter-offsets",
        "role",
        "finish",
        "empty-delta",
        "completions-text",
    ],
)
def test_filter_only_events_are_told_apart(event: dict[str, Any], dropped: bool) -> None:
    chunk = OpenAIStreamDecoder(scrub=Scrubber.GENERIC).decode(
        SSEEvent(raw=b"", data=orjson.dumps(event))
    )
    assert chunk.data is not None
    assert filter_results_only(chunk.data, chunk) is dropped

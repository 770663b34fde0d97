"""Token counting: `POST /v1/messages/count_tokens` and `POST /v1/responses/input_tokens`,
answered by the model's deployments' own counters, else by an estimate that says it is one.

Real servers on loopback with the official SDKs as clients: the gateway, the scripted fake of
Anthropic's API (`tests/fakes/anthropic_upstream.py`), the simulator as an HTTP server (its
vLLM-like `/tokenize`) and in-process, and a fake of OpenAI's Responses counter below.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema_rs
import openai
import orjson
import pytest

import gateway.config
from gateway.admission.auth import new_key
from gateway.config import load_settings
from tests.conftest import Gateway, Upstream, gateway_settings, run_gateway, serve
from tests.fakes.anthropic_upstream import COUNT_TOKENS_PATH, AnthropicFake, count_words
from tests.fakes.asgi import lifespan, read_body

API_KEY = "sk-ant-api03-configured-upstream-key-0123456789"  # what the gateway is configured with
CLIENT_TIMEOUT_S = 10.0
WATCHDOG_S = 5.0  # only reached when a test is broken
CLIENT_KEY, CLIENT_HASH = new_key()
MESSAGES: Any = [
    {"role": "user", "content": "What is the weather like in Paris today?"},
    {"role": "assistant", "content": "Let me look that up for you."},
    {"role": "user", "content": [{"type": "text", "text": "Thanks, and tomorrow too please."}]},
]
SYSTEM = "You are a concise weather assistant."
ANTHROPIC_TOOL: Any = {
    "name": "get_weather",
    "description": "The forecast for a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
}
RESPONSES_TOOL: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The forecast for a city.",
    "parameters": ANTHROPIC_TOOL["input_schema"],
}
INPUT: Any = [
    {"role": "user", "content": "What is the weather like in Paris today?"},
    {"role": "assistant", "content": "Let me look that up for you."},
    {"role": "user", "content": [{"type": "input_text", "text": "And tomorrow?"}]},
]
# The same conversation as chat messages (what a chat request would send).
CHAT: Any = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is the weather like in Paris today?"},
    {"role": "assistant", "content": "Let me look that up for you."},
    {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]},
]
PACKAGED_CONFIG = Path(gateway.config.__file__).with_name("gateway.yaml")


# --- harness -------------------------------------------------------------------------------------


class Clients:
    """SDK and raw clients for one running gateway."""

    def __init__(self, gw: Gateway, stack: AsyncExitStack, key: str) -> None:
        self.gateway = gw
        self.openai = openai.AsyncOpenAI(
            base_url=gw.base_url, api_key=key, max_retries=0, timeout=CLIENT_TIMEOUT_S
        )
        self.anthropic = anthropic.AsyncAnthropic(
            base_url=gw.url, api_key=key, max_retries=0, timeout=CLIENT_TIMEOUT_S
        )
        self.http = httpx.AsyncClient(base_url=gw.url, timeout=CLIENT_TIMEOUT_S)
        stack.push_async_callback(self.openai.close)
        stack.push_async_callback(self.anthropic.close)
        stack.push_async_callback(self.http.aclose)


@asynccontextmanager
async def open_gateway(
    providers: dict[str, Any], models: list[dict[str, Any]], **extra: Any
) -> AsyncIterator[Clients]:
    async with (
        run_gateway(gateway_settings(providers, models, **extra)) as gw,
        AsyncExitStack() as s,
    ):
        yield Clients(gw, s, CLIENT_KEY)


def model(name: str, *deployments: str) -> dict[str, Any]:
    """A model entry; each deployment is written `provider/upstream model`."""
    pairs = (d.split("/", 1) for d in deployments)
    return {"name": name, "deployments": [{"provider": p, "model": m} for p, m in pairs]}


def anthropic_provider(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "anthropic", "base_url": url, "api_key": API_KEY, **extra}


@pytest.fixture
async def fake() -> AsyncIterator[tuple[AnthropicFake, str]]:
    """The fake Messages API, accepting only the configured key."""
    upstream = AnthropicFake(api_key=API_KEY)
    async with serve(upstream) as url:
        yield upstream, url


Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class ResponsesCounterFake:
    """OpenAI's `POST /v1/responses/input_tokens`: 7 tokens per input item (1 for a string
    input) plus 3 per tool; every request recorded (path, headers, body)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, str], Any]] = []

    @staticmethod
    def tokens(body: dict[str, Any]) -> int:
        items = body.get("input")
        return (1 if isinstance(items, str) else 7 * len(items or ())) + 3 * len(
            body.get("tools") or ()
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        raw = await read_body(receive)
        body = orjson.loads(raw)
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        self.requests.append((scope["path"], headers, body))
        answer: dict[str, Any] = {"error": {"message": "not found", "type": "invalid_request"}}
        status = 404
        if scope["path"] == "/v1/responses/input_tokens":
            status, answer = 200, {"object": "response.input_tokens", "input_tokens": 0}
            answer["input_tokens"] = self.tokens(body)
        data = orjson.dumps(answer)
        head = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]
        await send({"type": "http.response.start", "status": status, "headers": head})
        await send({"type": "http.response.body", "body": data})


# --- Anthropic upstreams -------------------------------------------------------------------------


async def test_anthropic_sdk_gets_the_anthropic_upstreams_count(
    fake: tuple[AnthropicFake, str],
) -> None:
    """An Anthropic client's count is Anthropic's own: the body passes with the upstream model,
    the configured key, and the client's feature flags; the answer says who counted."""
    upstream, url = fake
    async with open_gateway(
        {"claude": anthropic_provider(url)}, [model("c", "claude/claude-x")]
    ) as c:
        raw = await c.anthropic.messages.with_raw_response.count_tokens(
            model="c",
            messages=MESSAGES,
            system=SYSTEM,
            tools=[ANTHROPIC_TOOL],
            extra_headers={"anthropic-beta": "token-counting-2024-11-01"},
        )
    counted = await raw.parse()
    (received,) = upstream.requests
    assert received.path == COUNT_TOKENS_PATH
    assert received.headers["x-api-key"] == API_KEY  # the gateway's key, never the client's
    assert received.headers["anthropic-beta"] == "token-counting-2024-11-01"
    assert received.body == {
        "model": "claude-x",
        "messages": MESSAGES,
        "system": SYSTEM,
        "tools": [ANTHROPIC_TOOL],
    }
    assert counted.input_tokens == count_words(received.body)
    assert orjson.loads(raw.http_response.content) == {"input_tokens": counted.input_tokens}
    assert raw.headers["x-tailguard-token-count"] == "upstream"
    assert raw.headers["x-tailguard-deployment"] == "claude/claude-x"
    assert raw.headers["x-request-id"] == received.headers["x-request-id"]


async def test_openai_sdk_count_is_translated_for_anthropic(
    fake: tuple[AnthropicFake, str],
) -> None:
    """A Responses count for an Anthropic model asks Anthropic's counter in its own shape:
    instructions as `system`, items as messages, function tools as Anthropic tools, and no
    generation settings (Anthropic's counter refuses `max_tokens`)."""
    upstream, url = fake
    async with open_gateway(
        {"claude": anthropic_provider(url)}, [model("c", "claude/claude-x")]
    ) as c:
        raw = await c.openai.responses.input_tokens.with_raw_response.count(
            model="c", input=INPUT, instructions=SYSTEM, tools=[RESPONSES_TOOL]
        )
    counted = raw.parse()
    (received,) = upstream.requests
    assert received.path == COUNT_TOKENS_PATH
    assert received.body["system"] == SYSTEM
    assert [m["role"] for m in received.body["messages"]] == ["user", "assistant", "user"]
    assert received.body["tools"] == [ANTHROPIC_TOOL]
    assert "max_tokens" not in received.body
    assert counted.object == "response.input_tokens"
    assert counted.input_tokens == count_words(received.body)
    assert raw.headers["x-tailguard-token-count"] == "upstream"


async def test_next_deployment_counts_when_the_first_fails(
    fake: tuple[AnthropicFake, str],
) -> None:
    """Deployments are asked in order: one whose counter is overloaded gives way to the next."""
    upstream, url = fake
    models = [model("c", "claude/claude-x@overloaded", "claude/claude-x")]
    async with open_gateway({"claude": anthropic_provider(url)}, models) as c:
        raw = await c.anthropic.messages.with_raw_response.count_tokens(
            model="c", messages=MESSAGES
        )
    assert [r.body["model"] for r in upstream.requests] == ["claude-x@overloaded", "claude-x"]
    assert raw.headers["x-tailguard-deployment"] == "claude/claude-x"
    assert (await raw.parse()).input_tokens == count_words({"messages": MESSAGES})


async def test_an_upstream_refusing_the_request_is_a_400_in_each_wire(
    fake: tuple[AnthropicFake, str],
) -> None:
    """An upstream counter's 400 means the request itself is bad: it reaches the client (in its
    wire), and neither another deployment nor the estimate is tried."""
    upstream, url = fake
    models = [model("c", "claude/claude-x@status=400", "claude/claude-x")]
    async with open_gateway({"claude": anthropic_provider(url)}, models) as c:
        with pytest.raises(anthropic.BadRequestError) as refused:
            await c.anthropic.messages.count_tokens(model="c", messages=MESSAGES)
        with pytest.raises(openai.BadRequestError) as refused_openai:
            await c.openai.responses.input_tokens.count(model="c", input="hello")
    assert refused.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert refused_openai.value.code == "upstream_rejected"
    assert [r.body["model"] for r in upstream.requests] == ["claude-x@status=400"] * 2


async def test_a_hanging_counter_gives_the_estimate_within_its_timeout(
    fake: tuple[AnthropicFake, str],
) -> None:
    """A counter that does not answer within the provider's read timeout is given up on: the
    answer is the estimate, long before the counter would have answered."""
    upstream, url = fake
    provider = anthropic_provider(url, read_timeout_ms=300)
    async with open_gateway(
        {"claude": provider}, [model("c", "claude/claude-x@slow_ms=30000")]
    ) as c:
        started = time.monotonic()
        async with asyncio.timeout(WATCHDOG_S):
            raw = await c.anthropic.messages.with_raw_response.count_tokens(
                model="c", messages=[{"role": "user", "content": "x" * 40}]
            )
        elapsed = time.monotonic() - started
    assert len(upstream.requests) == 1  # it was asked
    assert 0.3 <= elapsed < WATCHDOG_S
    assert raw.headers["x-tailguard-token-count"] == "estimate"
    assert "x-tailguard-deployment" not in raw.headers
    assert orjson.loads(raw.http_response.content) == {"input_tokens": 10, "estimated": True}


# --- simulated and vLLM-shaped upstreams ---------------------------------------------------------


async def test_simulated_count_equals_the_prompt_tokens_a_chat_reports() -> None:
    """On the default simulated models, both SDKs' counts come from the simulator's tokenizer
    and equal the `usage.prompt_tokens` a chat request with the same messages reports."""
    settings = load_settings(PACKAGED_CONFIG, environ={})
    async with run_gateway(settings) as gw, AsyncExitStack() as stack:
        c = Clients(gw, stack, "unused")
        chat = await c.openai.chat.completions.create(
            model="chat-fast", messages=CHAT, max_completion_tokens=1
        )
        counted = await c.openai.responses.input_tokens.with_raw_response.count(
            model="chat-fast", input=INPUT, instructions=SYSTEM
        )
        anthropic_chat = await c.openai.chat.completions.create(
            model="chat-fast",
            messages=[{"role": "system", "content": SYSTEM}, *_as_chat(MESSAGES)],
            max_completion_tokens=1,
        )
        anthropic_counted = await c.anthropic.messages.with_raw_response.count_tokens(
            model="chat-fast", messages=MESSAGES, system=SYSTEM
        )
    assert chat.usage is not None and anthropic_chat.usage is not None
    assert counted.parse().input_tokens == chat.usage.prompt_tokens
    assert (await anthropic_counted.parse()).input_tokens == anthropic_chat.usage.prompt_tokens
    for raw in (counted, anthropic_counted):
        assert raw.headers["x-tailguard-token-count"] == "upstream"
        assert raw.headers["x-tailguard-deployment"] == "sim/fast"
        assert "estimated" not in orjson.loads(raw.http_response.content)


def _as_chat(messages: Any) -> list[Any]:
    """Anthropic messages as chat messages (text parts joined, as the translation does)."""
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            content = [{"type": "text", "text": part["text"]} for part in content]
        out.append({"role": message["role"], "content": content})
    return out


async def test_vllm_upstream_counts_with_its_tokenize(upstream: Upstream) -> None:
    """A vLLM upstream (the simulator over HTTP) counts with `/tokenize` beside `/v1`; its count
    is the `usage.prompt_tokens` a chat with the same messages reports."""
    providers = {"up": {"type": "vllm", "base_url": upstream.base_url}}
    async with open_gateway(providers, [model("m", "up/m")]) as c:
        chat = await c.openai.chat.completions.create(
            model="m", messages=CHAT, max_completion_tokens=1
        )
        raw = await c.openai.responses.input_tokens.with_raw_response.count(
            model="m", input=INPUT, instructions=SYSTEM
        )
        tokenized = await c.http.post(
            upstream.url + "/tokenize", json={"model": "m", "messages": CHAT}
        )
    assert chat.usage is not None
    assert raw.parse().input_tokens == chat.usage.prompt_tokens == tokenized.json()["count"]
    assert raw.headers["x-tailguard-token-count"] == "upstream"
    assert raw.headers["x-tailguard-deployment"] == "up/m"


# --- OpenAI upstreams ----------------------------------------------------------------------------


async def test_native_responses_upstream_counts_with_its_own_counter() -> None:
    """An OpenAI upstream serving the Responses API natively is asked at its
    `/responses/input_tokens`: an OpenAI client's body untouched but for the model, an
    Anthropic client's translated to Responses items, without its `anthropic-beta` header
    (only Anthropic's counter takes it)."""
    counter = ResponsesCounterFake()
    async with serve(counter) as url:
        provider = {
            "type": "openai",
            "base_url": url + "/v1",
            "api_key": "sk-up",
            "responses": "native",
        }
        async with open_gateway({"oai": provider}, [model("g", "oai/gpt-x")]) as c:
            raw = await c.openai.responses.input_tokens.with_raw_response.count(
                model="g", input=INPUT, instructions=SYSTEM, tools=[RESPONSES_TOOL]
            )
            counted = await c.anthropic.messages.count_tokens(
                model="g",
                messages=MESSAGES,
                tools=[ANTHROPIC_TOOL],
                extra_headers={"anthropic-beta": "token-counting-2024-11-01"},
            )
    (path, headers, body), (_, translated_headers, translated) = counter.requests
    assert "anthropic-beta" not in translated_headers
    assert path == "/v1/responses/input_tokens"
    assert headers["authorization"] == "Bearer sk-up"
    assert body == {
        "model": "gpt-x",
        "input": INPUT,
        "instructions": SYSTEM,
        "tools": [RESPONSES_TOOL],
    }
    assert raw.parse().input_tokens == ResponsesCounterFake.tokens(body)
    assert raw.headers["x-tailguard-deployment"] == "oai/gpt-x"
    assert translated["model"] == "gpt-x"
    assert [item.get("role") for item in translated["input"]] == ["user", "assistant", "user"]
    assert translated["tools"] == [RESPONSES_TOOL]
    assert counted.input_tokens == ResponsesCounterFake.tokens(translated)


async def test_chat_only_upstream_gets_an_estimate_flagged_as_one(upstream: Upstream) -> None:
    """An OpenAI-compatible upstream without a counter: about four characters a token over the
    text of the messages, the system prompt and the tool definitions, flagged in body and
    header, in both wires."""
    providers = {"oai": {"type": "openai", "base_url": upstream.base_url}}
    tool = orjson.dumps([RESPONSES_TOOL])
    async with open_gateway(providers, [model("g", "oai/m")]) as c:
        raw = await c.openai.responses.input_tokens.with_raw_response.count(
            model="g", input="a" * 30, instructions="b" * 10, tools=[RESPONSES_TOOL]
        )
        raw_anthropic = await c.anthropic.messages.with_raw_response.count_tokens(
            model="g", messages=[{"role": "user", "content": "c" * 41}], system="d" * 3
        )
    assert orjson.loads(raw.http_response.content) == {
        "object": "response.input_tokens",
        "input_tokens": math.ceil((40 + len(tool)) / 4),
        "estimated": True,
    }
    assert raw.headers["x-tailguard-token-count"] == "estimate"
    assert "x-tailguard-deployment" not in raw.headers
    assert orjson.loads(raw_anthropic.http_response.content) == {
        "input_tokens": 11,
        "estimated": True,
    }
    assert raw_anthropic.headers["x-tailguard-token-count"] == "estimate"
    assert upstream.stats.requests == 0  # nothing was generated


# --- refusals ------------------------------------------------------------------------------------


async def test_a_model_outside_the_keys_scope_is_refused_as_chat_refuses_it(
    fake: tuple[AnthropicFake, str],
) -> None:
    """A key counts only on its own models, refused exactly as its chat would be: another
    configured model is a 403 `model_not_allowed`, one configured nowhere a 404 listing the
    key's models only, in each wire; the Anthropic route takes the key in `x-api-key`, as
    Anthropic's SDK sends it."""
    _, url = fake
    keys = {"keys": [{"name": "team-a", "sha256": CLIENT_HASH, "models": ["c"]}]}
    models = [model("c", "claude/claude-x"), model("secret", "claude/claude-x")]
    async with open_gateway({"claude": anthropic_provider(url)}, models, auth=keys) as c:
        allowed = await c.anthropic.messages.count_tokens(model="c", messages=MESSAGES)
        with pytest.raises(anthropic.PermissionDeniedError) as counted:
            await c.anthropic.messages.count_tokens(model="secret", messages=MESSAGES)
        with pytest.raises(anthropic.PermissionDeniedError) as chat:
            await c.anthropic.messages.create(model="secret", messages=MESSAGES, max_tokens=5)
        with pytest.raises(openai.PermissionDeniedError) as counted_openai:
            await c.openai.responses.input_tokens.count(model="secret", input="hi")
        with pytest.raises(openai.PermissionDeniedError) as chat_openai:
            await c.openai.responses.create(model="secret", input="hi")
        with pytest.raises(anthropic.NotFoundError) as unknown:
            await c.anthropic.messages.count_tokens(model="nowhere", messages=MESSAGES)
        with pytest.raises(anthropic.AuthenticationError):
            await c.anthropic.messages.count_tokens(
                model="c", messages=MESSAGES, extra_headers={"x-api-key": "sk-wrong"}
            )
    assert allowed.input_tokens == count_words({"messages": MESSAGES})
    refused: dict[str, Any] = counted.value.body  # type: ignore[assignment]
    as_chat: dict[str, Any] = chat.value.body  # type: ignore[assignment]
    assert refused == {**as_chat, "request_id": counted.value.response.headers["x-request-id"]}
    assert refused["error"]["type"] == "permission_error"
    openai_refusals = {
        (error.value.code, error.value.param) for error in (counted_openai, chat_openai)
    }
    assert openai_refusals == {("model_not_allowed", "model")}
    missing: dict[str, Any] = unknown.value.body  # type: ignore[assignment]
    assert missing["error"]["message"] == (
        "The model 'nowhere' does not exist. Available models: c."
    )


async def test_a_count_carries_the_callers_trace(fake: tuple[AnthropicFake, str]) -> None:
    """A count's upstream request carries the caller's `traceparent`, as a chat's does."""
    upstream, url = fake
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    async with open_gateway(
        {"claude": anthropic_provider(url)}, [model("c", "claude/claude-x")]
    ) as c:
        await c.anthropic.messages.count_tokens(
            model="c", messages=MESSAGES, extra_headers={"traceparent": traceparent}
        )
    (received,) = upstream.requests
    assert received.headers["traceparent"] == traceparent


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        (b'{"model": "c", "messages": [', "invalid_json", None),
        (b'{"model": "c", "model": "c", "messages": []}', "duplicate_key", "model"),
        (b"[" * 200 + b"]" * 200, "json_too_deep", None),
        (b'{"messages": []}', "missing_required_parameter", "model"),
    ],
)
async def test_bad_bodies_are_400s_in_each_wire(
    fake: tuple[AnthropicFake, str], body: bytes, code: str, param: str | None
) -> None:
    """The LLM endpoints' body checks apply (JSON, depth, repeated keys, the model), and each
    refusal is spelled in the endpoint's wire."""
    upstream, url = fake
    async with open_gateway(
        {"claude": anthropic_provider(url)}, [model("c", "claude/claude-x")]
    ) as c:
        headers = {"content-type": "application/json"}
        on_anthropic = await c.http.post(COUNT_TOKENS_PATH, content=body, headers=headers)
        on_openai = await c.http.post("/v1/responses/input_tokens", content=body, headers=headers)
    assert on_anthropic.status_code == on_openai.status_code == 400
    assert on_anthropic.json()["type"] == "error"
    assert on_anthropic.json()["error"]["type"] == "invalid_request_error"
    assert on_openai.json()["error"]["code"] == code
    assert on_openai.json()["error"]["param"] == param
    assert upstream.requests == []


async def test_missing_content_names_the_parameter(fake: tuple[AnthropicFake, str]) -> None:
    """Each endpoint needs what it counts: `messages` (Anthropic), `input` (Responses)."""
    _, url = fake
    async with open_gateway(
        {"claude": anthropic_provider(url)}, [model("c", "claude/claude-x")]
    ) as c:
        no_messages = await c.http.post(COUNT_TOKENS_PATH, json={"model": "c"})
        bad_role = await c.http.post(
            COUNT_TOKENS_PATH, json={"model": "c", "messages": [{"role": "system"}]}
        )
        no_input = await c.http.post("/v1/responses/input_tokens", json={"model": "c"})
    assert no_messages.status_code == bad_role.status_code == no_input.status_code == 400
    assert "'messages'" in no_messages.json()["error"]["message"]
    assert "'messages[0].role'" in bad_role.json()["error"]["message"]
    assert no_input.json()["error"]["param"] == "input"


async def test_the_endpoints_are_listed_and_take_only_post(upstream: Upstream) -> None:
    """An unknown endpoint's 404 lists the counting endpoints; another method is a 405."""
    providers = {"up": {"type": "vllm", "base_url": upstream.base_url}}
    async with open_gateway(providers, [model("m", "up/m")]) as c:
        unknown = await c.http.post("/v1/nothing-here", json={})
        wrong_method = await c.http.get(COUNT_TOKENS_PATH)
    assert unknown.status_code == 404
    message = unknown.json()["error"]["message"]
    assert "/v1/messages/count_tokens" in message and "/v1/responses/input_tokens" in message
    assert wrong_method.status_code == 405
    assert wrong_method.json()["type"] == "error"  # Anthropic's shape on its route


async def test_the_document_describes_both_endpoints(fake: tuple[AnthropicFake, str]) -> None:
    """`/openapi.json` describes both endpoints, and real answers (counted and estimated)
    match the schemas it gives for them."""
    _, url = fake
    providers = {"claude": anthropic_provider(url), "oai": {"type": "openai", "base_url": url}}
    models = [model("c", "claude/claude-x"), model("g", "oai/m")]
    async with open_gateway(providers, models) as c:
        document = (await c.http.get("/openapi.json")).json()
        answers = {
            path: [
                await c.http.post(path, json={"model": name, **body})
                for name in ("c", "g")  # counted, then estimated
            ]
            for path, body in (
                (COUNT_TOKENS_PATH, {"messages": MESSAGES}),
                ("/v1/responses/input_tokens", {"input": INPUT}),
            )
        }
    schemas = document["components"]["schemas"]
    for path, (counted, estimated) in answers.items():
        operation = document["paths"][path]["post"]
        assert {"200", "400", "401", "404", "413", "503"} <= set(operation["responses"])
        assert {} in operation["security"]  # no keys configured: credentials optional
        ok = operation["responses"]["200"]
        schema = schemas[ok["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]]
        for answer in (counted, estimated):
            assert answer.status_code == 200
            jsonschema_rs.validate(schema, answer.json())
            assert set(ok["headers"]) >= {"x-request-id", "x-tailguard-token-count"}
        assert "estimated" not in counted.json() and estimated.json()["estimated"] is True
    assert document["paths"][COUNT_TOKENS_PATH]["post"]["responses"]["404"]["$ref"].endswith(
        "/Anthropic404"
    )


async def test_a_stored_conversation_is_counted_whole() -> None:
    """With `previous_response_id` the count covers the stored conversation, as the Responses
    endpoint expands it: it equals the input tokens the next turn reports."""
    settings = load_settings(PACKAGED_CONFIG, environ={})
    async with run_gateway(settings) as gw, AsyncExitStack() as stack:
        c = Clients(gw, stack, "unused")
        first = await c.openai.responses.create(
            model="chat-fast", input=INPUT, instructions=SYSTEM, max_output_tokens=16
        )
        counted = await c.openai.responses.input_tokens.count(
            model="chat-fast", previous_response_id=first.id, input="And the day after?"
        )
        alone = await c.openai.responses.input_tokens.count(
            model="chat-fast", input="And the day after?"
        )
        second = await c.openai.responses.create(
            model="chat-fast",
            previous_response_id=first.id,
            input="And the day after?",
            max_output_tokens=16,
        )
        with pytest.raises(openai.BadRequestError) as unknown:
            await c.openai.responses.input_tokens.count(
                model="chat-fast", previous_response_id="resp_unknown", input="hi"
            )
    assert second.usage is not None
    assert counted.input_tokens == second.usage.input_tokens > alone.input_tokens
    assert unknown.value.param == "previous_response_id"

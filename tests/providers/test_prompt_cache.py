"""Prompt caching end to end: cache markers on each wire, and the cached-token counts reaching the
client's usage, the access log, the attempt span, `/metrics` and `/admin/latency`.

The upstreams are real servers on loopback: the fake Messages API (`tests/fakes/
anthropic_upstream.py`, which records what it received and reports `cached=N` reads) and
`CachingUpstream` below, which answers on both wires with usage saying its prompt cache served
part of the prompt. The clients are the official SDKs, or httpx for exact bodies.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest
from anthropic.types import Message
from openai.types.chat import ChatCompletion

from gateway.models import Usage
from gateway.providers.decode import (
    AnthropicStreamDecoder,
    decode_anthropic_body,
    decode_openai_body,
)
from gateway.scrubbing import Scrubber
from gateway.sse import SSEParser
from gateway.telemetry import semconv as sc
from tests.conftest import ACCESS, gateway_settings, run_gateway, serve
from tests.fakes.anthropic_upstream import AnthropicFake, count_words
from tests.fakes.asgi import lifespan, read_body
from tests.fakes.otlp_receiver import OTLPReceiver
from tests.telemetry.test_metrics import requests_counted, scrape_when
from tests.telemetry.test_tracing import client_spans
from tests.timing import scaled

API_KEY = "sk-ant-api03-configured-upstream-key-0123456789"
EPHEMERAL: dict[str, Any] = {"type": "ephemeral"}
# What `CachingUpstream` reports by default: of 1,320 prompt tokens, 1,000 read from its cache
# and 300 written to it.
PROMPT, CACHED, WRITTEN, FRESH = 1320, 1000, 300, 20
SHARE = round(CACHED / PROMPT, 4)
OUTPUT_TEXT = ("Hi", " there")
LONG_SYSTEM = "You answer questions about the attached handbook. " * 20


# --- the upstream -------------------------------------------------------------------------------


class CachingUpstream:
    """An upstream whose every answer is two words, with usage saying its prompt cache served
    part of the prompt: OpenAI-shaped on `/v1/chat/completions` (reads as
    `prompt_tokens_details.cached_tokens`, writes, unless `written` is None, as
    `..cache_write_tokens`; a stream's usage chunk only when asked for), Anthropic-shaped on
    `/v1/messages` (`cache_read_input_tokens`, `cache_creation_input_tokens`); streamed when
    asked. Records each request's path and parsed body."""

    def __init__(self, *, written: int | None = WRITTEN) -> None:
        self.written = written
        self.received: list[tuple[str, dict[str, Any]]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        raw = await read_body(receive)
        body = orjson.loads(raw)
        self.received.append((scope["path"], body))
        anthropic_wire = scope["path"] == "/v1/messages"
        stream = bool(body.get("stream"))
        if anthropic_wire:
            payload = self._anthropic_stream(body) if stream else self._anthropic_body(body)
        else:
            payload = self._openai_stream(body) if stream else self._openai_body(body)
        kind = b"text/event-stream" if stream else b"application/json"
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", kind)]}
        )
        await send({"type": "http.response.body", "body": payload})

    def _openai_usage(self) -> dict[str, Any]:
        details: dict[str, int] = {"cached_tokens": CACHED}
        if self.written is not None:
            details["cache_write_tokens"] = self.written
        prompt = FRESH + CACHED + (self.written or 0)
        output = len(OUTPUT_TEXT)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": output,
            "total_tokens": prompt + output,
            "prompt_tokens_details": details,
        }

    def _anthropic_usage(self, output: int) -> dict[str, Any]:
        return {
            "input_tokens": FRESH,
            "cache_creation_input_tokens": self.written or 0,
            "cache_read_input_tokens": CACHED,
            "output_tokens": output,
        }

    def _openai_body(self, body: dict[str, Any]) -> bytes:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": "".join(OUTPUT_TEXT)},
            "finish_reason": "stop",
        }
        return orjson.dumps(
            {
                "id": "chatcmpl-cache",
                "object": "chat.completion",
                "created": 1,
                "model": body["model"],
                "choices": [choice],
                "usage": self._openai_usage(),
            }
        )

    def _openai_stream(self, body: dict[str, Any]) -> bytes:
        head = {"id": "chatcmpl-cache", "object": "chat.completion.chunk", "created": 1}
        head["model"] = body["model"]

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            return b"data: " + orjson.dumps({**head, "choices": [choice]}) + b"\n\n"

        frames = [chunk({"role": "assistant", "content": ""})]
        frames += [chunk({"content": text}) for text in OUTPUT_TEXT]
        frames.append(chunk({}, "stop"))
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {**head, "choices": [], "usage": self._openai_usage()}
            frames.append(b"data: " + orjson.dumps(usage) + b"\n\n")
        return b"".join([*frames, b"data: [DONE]\n\n"])

    def _anthropic_body(self, body: dict[str, Any]) -> bytes:
        return orjson.dumps(
            {
                "id": "msg_cache",
                "type": "message",
                "role": "assistant",
                "model": body["model"],
                "content": [{"type": "text", "text": "".join(OUTPUT_TEXT)}],
                "stop_reason": "end_turn",
                "stop_sequence": None,
                "usage": self._anthropic_usage(len(OUTPUT_TEXT)),
            }
        )

    def _anthropic_stream(self, body: dict[str, Any]) -> bytes:
        start = {
            "id": "msg_cache",
            "type": "message",
            "role": "assistant",
            "model": body["model"],
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": self._anthropic_usage(1),
        }
        events: list[dict[str, Any]] = [
            {"type": "message_start", "message": start},
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
            *(
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": t},
                }
                for t in OUTPUT_TEXT
            ),
            {"type": "content_block_stop", "index": 0},
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                "usage": {"output_tokens": len(OUTPUT_TEXT)},
            },
            {"type": "message_stop"},
        ]
        return b"".join(
            b"event: %b\ndata: %b\n\n" % (event["type"].encode(), orjson.dumps(event))
            for event in events
        )


# --- harness -------------------------------------------------------------------------------------


@dataclass
class Upstreams:
    fake: AnthropicFake  # the fake Messages API (`fake` model)
    caching: CachingUpstream  # reads and writes on both wires (`gpt` and `claude` models)
    reads_only: CachingUpstream  # OpenAI-shaped, reads only, as OpenAI and vLLM report them
    settings: Any  # the gateway's settings over all three


@pytest.fixture
async def upstreams() -> AsyncIterator[Upstreams]:
    """The three upstreams on loopback, and models over them: `fake` (the fake Messages API,
    reporting `cached=64` reads), `claude` (Anthropic-shaped), `gpt` (OpenAI-shaped) and
    `gpt-reads` (OpenAI-shaped, reporting no writes)."""
    fake = AnthropicFake(api_key=API_KEY)
    caching, reads_only = CachingUpstream(), CachingUpstream(written=None)
    async with serve(fake) as fake_url, serve(caching) as url, serve(reads_only) as reads_url:
        settings = gateway_settings(
            {
                "fake": {"type": "anthropic", "base_url": fake_url, "api_key": API_KEY},
                "an": {"type": "anthropic", "base_url": url, "api_key": "sk-ant-test"},
                "oa": {"type": "openai", "base_url": url + "/v1"},
                "reads": {"type": "openai", "base_url": reads_url + "/v1"},
            },
            [
                {
                    "name": "fake",
                    "deployments": [{"provider": "fake", "model": "claude-x@cached=64"}],
                },
                {"name": "claude", "deployments": [{"provider": "an", "model": "claude"}]},
                {"name": "gpt", "deployments": [{"provider": "oa", "model": "gpt"}]},
                {"name": "gpt-reads", "deployments": [{"provider": "reads", "model": "gpt"}]},
            ],
        )
        yield Upstreams(fake, caching, reads_only, settings)


@dataclass
class Clients:
    url: str
    openai: openai.AsyncOpenAI
    anthropic: anthropic.AsyncAnthropic
    http: httpx.AsyncClient


@asynccontextmanager
async def clients(url: str) -> AsyncIterator[Clients]:
    """SDK and raw clients of the gateway at `url`."""
    async with AsyncExitStack() as stack:
        oa = openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=10)
        an = anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0, timeout=10)
        http = httpx.AsyncClient(base_url=url, timeout=10)
        stack.push_async_callback(oa.close)
        stack.push_async_callback(an.close)
        stack.push_async_callback(http.aclose)
        yield Clients(url, oa, an, http)


@pytest.fixture
async def gateway(upstreams: Upstreams) -> AsyncIterator[Clients]:
    async with run_gateway(upstreams.settings) as gw, clients(gw.url) as c:
        yield c


def access_lines(caplog: pytest.LogCaptureFixture) -> dict[str, dict[str, Any]]:
    """The access lines by request id."""
    found = (orjson.loads(r.getMessage()) for r in caplog.records if r.name == ACCESS)
    return {line["request_id"]: line for line in found}


async def say(c: Clients, model: str, request_id: str, *, stream: bool = False) -> None:
    """One chat request that must succeed, read to its end (a stream without asking for usage:
    the gateway asks the upstream for it anyway)."""
    body = {"model": model, "stream": stream, "messages": [{"role": "user", "content": "hello"}]}
    resp = await c.http.post(
        "/v1/chat/completions", json=body, headers={"x-request-id": request_id}
    )
    assert resp.status_code == 200, resp.text
    if stream:
        assert resp.text.endswith("data: [DONE]\n\n")
        assert "usage" not in resp.text


# --- markers ------------------------------------------------------------------------------------


async def test_openai_client_markers_reach_an_anthropic_upstream(
    upstreams: Upstreams, gateway: Clients
) -> None:
    """Anthropic-style `cache_control` on an OpenAI chat request's system part, message part
    and tool arrives on the translated blocks and tool at the Anthropic upstream; the
    OpenAI-only `prompt_cache_key` and `prompt_cache_retention` do not, and nothing is refused.
    An OpenAI-compatible upstream gets the request exactly as sent."""
    body: dict[str, Any] = {
        "model": "fake",
        "prompt_cache_key": "tenant-7",
        "prompt_cache_retention": "24h",
        "messages": [
            {
                "role": "system",
                "content": [{"type": "text", "text": LONG_SYSTEM, "cache_control": EPHEMERAL}],
            },
            {
                "role": "user",
                "content": [{"type": "text", "text": "hello there", "cache_control": EPHEMERAL}],
            },
        ],
        "tools": [
            {
                "type": "function",
                "function": {"name": "lookup", "parameters": {"type": "object"}},
                "cache_control": EPHEMERAL,
            }
        ],
    }
    resp = await gateway.http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    sent = upstreams.fake.requests[-1].body
    assert sent["system"] == [{"type": "text", "text": LONG_SYSTEM, "cache_control": EPHEMERAL}]
    assert sent["messages"] == [
        {
            "role": "user",
            "content": [{"type": "text", "text": "hello there", "cache_control": EPHEMERAL}],
        }
    ]
    assert sent["tools"][0]["cache_control"] == EPHEMERAL
    assert "prompt_cache_key" not in sent and "prompt_cache_retention" not in sent

    same_wire = {**body, "model": "gpt"}
    resp = await gateway.http.post("/v1/chat/completions", json=same_wire)
    assert resp.status_code == 200, resp.text
    assert upstreams.caching.received == [("/v1/chat/completions", same_wire)]


async def test_anthropic_client_markers_pass_to_anthropic_and_are_dropped_for_openai(
    upstreams: Upstreams, gateway: Clients
) -> None:
    """The same Messages request with `cache_control` on its system block, a content block and a
    tool reaches an Anthropic upstream exactly as sent, and an OpenAI-compatible one without any
    marker; both answer."""
    system: Any = [{"type": "text", "text": LONG_SYSTEM, "cache_control": EPHEMERAL}]
    messages: Any = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "hello there", "cache_control": EPHEMERAL}],
        }
    ]
    tools: Any = [
        {"name": "lookup", "input_schema": {"type": "object"}, "cache_control": EPHEMERAL}
    ]
    for model in ("fake", "gpt"):
        message = await gateway.anthropic.messages.create(
            model=model, max_tokens=16, system=system, messages=messages, tools=tools
        )
        assert message.content
    sent = upstreams.fake.requests[-1].body
    assert (sent["system"], sent["messages"], sent["tools"]) == (system, messages, tools)
    path, translated = upstreams.caching.received[-1]
    assert path == "/v1/chat/completions"
    assert b"cache_control" not in orjson.dumps(translated)
    assert translated["messages"][0] == {"role": "system", "content": LONG_SYSTEM}


async def test_prompt_cache_key_reaches_openai_untouched_and_not_anthropic(
    upstreams: Upstreams, gateway: Clients
) -> None:
    """`prompt_cache_key` and `prompt_cache_retention` reach an OpenAI-compatible upstream
    as sent, and are left out for an Anthropic one."""
    for model in ("gpt", "claude"):
        completion = await gateway.openai.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hello"}],
            prompt_cache_key="tenant-7",
            prompt_cache_retention="24h",
        )
        assert completion.choices[0].message.content == "Hi there"
    (to_openai_path, to_openai), (to_anthropic_path, to_anthropic) = upstreams.caching.received
    assert (to_openai_path, to_anthropic_path) == ("/v1/chat/completions", "/v1/messages")
    assert (to_openai["prompt_cache_key"], to_openai["prompt_cache_retention"]) == (
        "tenant-7",
        "24h",
    )
    assert "prompt_cache_key" not in to_anthropic and "prompt_cache_retention" not in to_anthropic


# --- the client's usage -------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("model", ["gpt", "claude"], ids=["openai-upstream", "anthropic-upstream"])
async def test_an_openai_client_sees_cached_and_written_tokens(
    gateway: Clients, model: str, stream: bool
) -> None:
    """An OpenAI client's usage counts the cache reads and writes in `prompt_tokens`, reads as
    `prompt_tokens_details.cached_tokens` and writes as `..cache_write_tokens`, whether the
    upstream speaks its wire (forwarded) or Anthropic's (translated), whole or streamed."""
    messages: Any = [{"role": "user", "content": "hello"}]
    completion: ChatCompletion
    if stream:
        async with gateway.openai.chat.completions.stream(
            model=model, messages=messages, stream_options={"include_usage": True}
        ) as events:
            completion = await events.get_final_completion()
    else:
        completion = await gateway.openai.chat.completions.create(model=model, messages=messages)
    usage = completion.usage
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (PROMPT, len(OUTPUT_TEXT))
    assert usage.prompt_tokens_details is not None
    details = usage.prompt_tokens_details
    assert (details.cached_tokens, details.cache_write_tokens) == (CACHED, WRITTEN)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("model", ["gpt", "claude"], ids=["openai-upstream", "anthropic-upstream"])
async def test_an_anthropic_client_sees_cache_reads_and_writes(
    gateway: Clients, model: str, stream: bool
) -> None:
    """An Anthropic client's usage has `cache_read_input_tokens` and
    `cache_creation_input_tokens` apart from `input_tokens`, whether the upstream speaks its
    wire (forwarded) or OpenAI's (translated), whole or streamed."""
    messages: Any = [{"role": "user", "content": "hello"}]
    message: Message
    if stream:
        async with gateway.anthropic.messages.stream(
            model=model, max_tokens=16, messages=messages
        ) as events:
            message = await events.get_final_message()
    else:
        message = await gateway.anthropic.messages.create(
            model=model, max_tokens=16, messages=messages
        )
    usage = message.usage
    assert (
        usage.input_tokens,
        usage.cache_read_input_tokens,
        usage.cache_creation_input_tokens,
        usage.output_tokens,
    ) == (FRESH, CACHED, WRITTEN, len(OUTPUT_TEXT))


async def test_the_fake_messages_api_cache_reads_reach_an_openai_client(gateway: Clients) -> None:
    """The fake Messages API's `cached=64` reads are part of the OpenAI client's prompt tokens
    and its `cached_tokens`, streamed; with no writes there is no `cache_write_tokens`."""
    messages: Any = [{"role": "user", "content": "hello there"}]
    async with gateway.openai.chat.completions.stream(
        model="fake", messages=messages, stream_options={"include_usage": True}
    ) as events:
        completion = await events.get_final_completion()
    usage = completion.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    words = count_words({"messages": messages})
    assert (usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens) == (words + 64, 64)
    assert usage.prompt_tokens_details.cache_write_tokens is None


# --- decoding -----------------------------------------------------------------------------------


def test_decoders_read_cache_reads_and_writes() -> None:
    """Both wires' decoders fill `cached_tokens` and `cache_write_tokens` (as parts of
    `input_tokens`), from a whole answer and from a stream's `message_start`."""
    upstream = CachingUpstream()
    body = {"model": "m", "messages": [], "stream": True, "stream_options": {"include_usage": True}}
    expected = Usage(PROMPT, len(OUTPUT_TEXT), CACHED, WRITTEN)
    assert decode_openai_body(upstream._openai_body(body), scrub=Scrubber.GENERIC).usage == expected
    assert (
        decode_anthropic_body(upstream._anthropic_body(body), scrub=Scrubber.GENERIC).usage
        == expected
    )
    decoder = AnthropicStreamDecoder(scrub=Scrubber.GENERIC)
    chunks = [decoder.decode(event) for event in SSEParser().feed(upstream._anthropic_stream(body))]
    assert [chunk.usage for chunk in chunks if chunk.usage is not None] == [expected]
    reads_only = CachingUpstream(written=None)
    assert decode_openai_body(reads_only._openai_body(body), scrub=Scrubber.GENERIC).usage == Usage(
        FRESH + CACHED, len(OUTPUT_TEXT), CACHED, None
    )


# --- telemetry ----------------------------------------------------------------------------------


async def test_cache_counts_in_the_access_log_metrics_and_admin_view(
    upstreams: Upstreams, access: pytest.LogCaptureFixture
) -> None:
    """Served requests, whole and streamed, put their cache reads and writes in the access line
    (`cached_tokens`, `cache_write_tokens`; null when the upstream reports none), count them in
    `/metrics` per model and deployment next to the prompt tokens (no cache-write series for an
    upstream that never reports writes), and `/admin/latency` shows each deployment's share of
    prompt tokens read from the cache since start."""
    async with run_gateway(upstreams.settings) as gw, clients(gw.url) as c:
        await say(c, "claude", "req-claude-1")
        await say(c, "claude", "req-claude-2", stream=True)
        await say(c, "gpt-reads", "req-reads-1")
        await say(c, "gpt-reads", "req-reads-2", stream=True)
        scrape = await scrape_when(c.http, gw.url, requests_counted(4))
        view = (await c.http.get("/admin/latency")).json()
    lines = access_lines(access)
    for request_id in ("req-claude-1", "req-claude-2"):
        line = lines[request_id]
        assert (line["input_tokens"], line["cached_tokens"], line["cache_write_tokens"]) == (
            PROMPT,
            CACHED,
            WRITTEN,
        )
    for request_id in ("req-reads-1", "req-reads-2"):
        line = lines[request_id]
        assert (line["input_tokens"], line["cached_tokens"], line["cache_write_tokens"]) == (
            FRESH + CACHED,
            CACHED,
            None,
        )

    claude = {"model": "claude", "deployment": "an/claude"}
    assert scrape.value(sc.INPUT_TOKENS + "_total", **claude) == 2 * PROMPT
    assert scrape.value(sc.CACHED_INPUT_TOKENS + "_total", **claude) == 2 * CACHED
    assert scrape.value(sc.CACHE_WRITE_INPUT_TOKENS + "_total", **claude) == 2 * WRITTEN
    gpt = {"model": "gpt-reads", "deployment": "reads/gpt"}
    assert scrape.value(sc.INPUT_TOKENS + "_total", **gpt) == 2 * (FRESH + CACHED)
    assert scrape.value(sc.CACHED_INPUT_TOKENS + "_total", **gpt) == 2 * CACHED
    assert scrape.matching(sc.CACHE_WRITE_INPUT_TOKENS + "_total", **gpt) == []

    deployments = view["deployments"]
    assert deployments["an/claude"]["prompt_cache"] == {
        "input_tokens": 2 * PROMPT,
        "cached_tokens": 2 * CACHED,
        "cache_write_tokens": 2 * WRITTEN,
        "cached_share": SHARE,
    }
    assert deployments["reads/gpt"]["prompt_cache"] == {
        "input_tokens": 2 * (FRESH + CACHED),
        "cached_tokens": 2 * CACHED,
        "cache_write_tokens": None,
        "cached_share": round(CACHED / (FRESH + CACHED), 4),
    }
    assert "prompt_cache" not in deployments.get("oa/gpt", {})  # not served: nothing to show


async def test_cache_counts_on_the_attempt_span(upstreams: Upstreams) -> None:
    """The winning attempt's CLIENT span carries `gen_ai.usage.cache_read.input_tokens` and
    `gen_ai.usage.cache_creation.input_tokens` beside `gen_ai.usage.input_tokens`, for an
    Anthropic upstream behind an OpenAI client; an upstream that reports no writes gets no
    cache-creation attribute."""
    receiver = OTLPReceiver()
    async with serve(receiver) as collector:
        environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector, "TAILGUARD_TRACES_TAIL_RATIO": "1"}
        async with run_gateway(upstreams.settings, environ=environ) as gw, clients(gw.url) as c:
            await say(c, "claude", "req-span-1")
            await say(c, "gpt-reads", "req-span-2")
        async with asyncio.timeout(scaled(5)):
            await receiver.wait_for(lambda r: len(r.of_kind("CLIENT")) == 2)
    claude, reads = (span.attributes for span in client_spans(receiver))
    assert claude[sc.GEN_AI_REQUEST_MODEL] == "claude"
    assert (
        claude[sc.GEN_AI_USAGE_INPUT_TOKENS],
        claude[sc.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS],
        claude[sc.GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS],
    ) == (PROMPT, CACHED, WRITTEN)
    assert reads[sc.GEN_AI_REQUEST_MODEL] == "gpt"
    assert reads[sc.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] == CACHED
    assert sc.GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS not in reads

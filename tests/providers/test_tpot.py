"""TPOT and output tokens end to end, for upstreams that stream several tokens per SSE event.

Many servers batch tokens into events (8 per event is common under load), and some report no
usage. The gateway's time per output token must then come from tokens (the upstream's count,
else the streamed text's length), never from events: counted per event, an 8-token-per-event
stream reads 8x slower per token, and routing mis-ranks the deployment.

The upstream here is a real server on loopback speaking each wire the gateway speaks upstream
(OpenAI chat, Anthropic Messages, a native Responses API); its events each carry `PER_EVENT`
tokens of text `TOKEN` bytes long, paced `GAP_S` apart, the last one sent with the stream's end
in one write.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, Final

import httpx
import orjson
import pytest

from gateway.latency import Sample
from gateway.models import SSEEvent
from gateway.providers.decode import OpenAIStreamDecoder
from gateway.scrubbing import Scrubber
from tests.conftest import Gateway, gateway_settings, run_gateway, serve
from tests.fakes.asgi import lifespan, read_body
from tests.timing import eventually

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

TOKEN: Final = " tok"  # 4 bytes: one token by the gateway's estimate (BYTES_PER_TOKEN)
PER_EVENT: Final = 8
EVENTS: Final = 8
GAP_S: Final = 0.03  # between content events: the stream's pace is what is measured
TOKENS: Final = PER_EVENT * EVENTS  # 64: what the text's length says
REPORTED: Final = 80  # what the upstream says when it reports usage (differs from the text)
KEY: Final = "sk-ant-test"


def _sse(data: dict[str, Any], event: str | None = None) -> bytes:
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + orjson.dumps(data) + b"\n\n"


def _chat_events(usage: bool) -> tuple[list[bytes], bytes]:
    """OpenAI chat chunks shaped as vLLM sends them (the byte-level fast path reads these)."""
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return _sse({**base, "choices": [choice]})

    first = chunk({"role": "assistant", "content": ""})
    contents = [chunk({"content": TOKEN * PER_EVENT}) for _ in range(EVENTS)]
    contents[0] = first + contents[0]
    end = chunk({}, "stop")
    if usage:
        counts = {"prompt_tokens": 5, "completion_tokens": REPORTED, "total_tokens": 5 + REPORTED}
        end += _sse({**base, "choices": [], "usage": counts})
    return contents, end + b"data: [DONE]\n\n"


def _messages_events(usage: bool) -> tuple[list[bytes], bytes]:
    """Anthropic Messages events; without usage, `message_delta` carries no output count."""
    message: dict[str, Any] = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [],
        "stop_reason": None,
        "usage": {"input_tokens": 5},
    }
    start = _sse({"type": "message_start", "message": message}, "message_start")
    start += _sse(
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        "content_block_start",
    )
    delta = {"type": "text_delta", "text": TOKEN * PER_EVENT}
    contents = [
        _sse({"type": "content_block_delta", "index": 0, "delta": delta}, "content_block_delta")
        for _ in range(EVENTS)
    ]
    contents[0] = start + contents[0]
    end = _sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
    counts = {"output_tokens": REPORTED} if usage else {}
    end += _sse(
        {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": counts},
        "message_delta",
    )
    return contents, end + _sse({"type": "message_stop"}, "message_stop")


def _responses_events(usage: bool) -> tuple[list[bytes], bytes]:
    """A native Responses stream; without usage, `response.completed` says none."""
    text = TOKEN * TOKENS
    item = {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed"}
    done = {**item, "content": [{"type": "output_text", "text": text, "annotations": []}]}

    def response(status: str, output: list[Any]) -> dict[str, Any]:
        counts = {"input_tokens": 5, "output_tokens": REPORTED, "total_tokens": 5 + REPORTED}
        return {
            "id": "resp_1",
            "object": "response",
            "created_at": 1,
            "status": status,
            "model": "m",
            "output": output,
            "usage": counts if usage and status == "completed" else None,
        }

    def event(kind: str, **fields: Any) -> bytes:
        return _sse({"type": kind, **fields}, kind)

    ids = {"item_id": "msg_1", "output_index": 0, "content_index": 0}
    start = event("response.created", response=response("in_progress", []))
    start += event("response.output_item.added", output_index=0, item={**item, "content": []})
    contents = [
        event("response.output_text.delta", delta=TOKEN * PER_EVENT, **ids) for _ in range(EVENTS)
    ]
    contents[0] = start + contents[0]
    end = event("response.output_text.done", text=text, **ids)
    end += event("response.output_item.done", output_index=0, item=done)
    return contents, end + event("response.completed", response=response("completed", [done]))


def _body(path: str, usage: bool) -> dict[str, Any]:
    """A non-streaming answer of the same text on each wire."""
    text = TOKEN * TOKENS
    if path == "/v1/chat/completions":
        message = {"role": "assistant", "content": text}
        counts = {"prompt_tokens": 5, "completion_tokens": REPORTED, "total_tokens": 5 + REPORTED}
        body: dict[str, Any] = {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1,
            "model": "m",
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        }
        return {**body, "usage": counts} if usage else body
    if path == "/v1/messages":
        counts = {"input_tokens": 5, "output_tokens": REPORTED} if usage else {}
        return {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": "m",
            "content": [{"type": "text", "text": text}],
            "stop_reason": "end_turn",
            "usage": counts,
        }
    part = {"type": "output_text", "text": text, "annotations": []}
    item = {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed"}
    counts = {"input_tokens": 5, "output_tokens": REPORTED, "total_tokens": 5 + REPORTED}
    return {
        "id": "resp_1",
        "object": "response",
        "created_at": 1,
        "status": "completed",
        "model": "m",
        "output": [{**item, "content": [part]}],
        "usage": counts if usage else None,
    }


STREAMS: Final = {
    "/v1/chat/completions": _chat_events,
    "/v1/messages": _messages_events,
    "/v1/responses": _responses_events,
}


async def batched_upstream(scope: Scope, receive: Receive, send: Send) -> None:
    """Streams `EVENTS` events of `PER_EVENT` tokens each on every wire; the model name
    `m@usage` reports `REPORTED` output tokens, any other none."""
    if scope["type"] == "lifespan":
        await lifespan(receive, send)
        return
    body = orjson.loads(await read_body(receive))
    usage = str(body["model"]).endswith("@usage")
    if not body.get("stream"):
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send(
            {"type": "http.response.body", "body": orjson.dumps(_body(scope["path"], usage))}
        )
        return
    contents, end = STREAMS[scope["path"]](usage)
    headers = [(b"content-type", b"text/event-stream")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    for index, frame in enumerate(contents):
        if index:
            await asyncio.sleep(GAP_S)  # the upstream's pace, not a synchronisation
        last = index == len(contents) - 1
        await send(
            {
                "type": "http.response.body",
                "body": frame + end if last else frame,
                "more_body": True,
            }
        )
    await send({"type": "http.response.body", "body": b""})


@dataclass
class Setup:
    gateway: Gateway
    http: httpx.AsyncClient


@pytest.fixture
async def setup() -> AsyncIterator[Setup]:
    async with serve(batched_upstream) as url:
        providers = {
            "chat": {"type": "openai", "base_url": url + "/v1"},
            "claude": {"type": "anthropic", "base_url": url, "api_key": KEY},
            "native": {"type": "openai", "base_url": url + "/v1", "responses": "native"},
        }
        models = [
            {"name": name, "deployments": [{"provider": provider, "model": upstream}]}
            for name, provider, upstream in (
                ("chat", "chat", "m"),
                ("chat-usage", "chat", "m@usage"),
                ("claude", "claude", "m"),
                ("claude-usage", "claude", "m@usage"),
                ("native", "native", "m"),
                ("native-usage", "native", "m@usage"),
            )
        ]
        async with (
            run_gateway(gateway_settings(providers, models)) as gw,
            httpx.AsyncClient(base_url=gw.url, timeout=30) as http,
        ):
            yield Setup(gw, http)


PROMPT: Final = [{"role": "user", "content": "Count."}]
# Each client wire: its path and body; the text a client sees is checked to be whole.
CLIENTS: Final[dict[str, tuple[str, dict[str, Any]]]] = {
    "openai": ("/v1/chat/completions", {"messages": PROMPT}),
    "anthropic": ("/v1/messages", {"messages": PROMPT, "max_tokens": 200}),
    "responses": ("/v1/responses", {"input": "Count."}),
}


async def stream(setup: Setup, model: str, client: str) -> Sample:
    """One streamed request read to its end; the served deployment's sample."""
    path, body = CLIENTS[client]
    async with setup.http.stream("POST", path, json={**body, "model": model, "stream": True}) as r:
        text = (await r.aread()).decode()
    assert r.status_code == 200, text
    deltas = [line for line in text.splitlines() if line.startswith("data:") and "delta" in line]
    assert sum(line.count(TOKEN) for line in deltas) == TOKENS, text  # the whole answer
    ((samples),) = setup.gateway.recorder.samples.values()
    (sample,) = samples
    return sample


def check_per_token(sample: Sample, tokens: int) -> None:
    """The sample's TPOT spreads the time from the first content event to the last over the
    tokens after the first event (each event carries tokens/EVENTS), so that time is within
    the attempt's time after its first token, and most of it (the stream's end arrived with
    its last event)."""
    assert sample.ok
    assert sample.tpot_s is not None
    assert sample.ttft_s is not None
    decoding = sample.tpot_s * tokens * (EVENTS - 1) / EVENTS
    after_first = sample.total_s - sample.ttft_s
    assert decoding <= after_first + 1e-9, (decoding, after_first)  # 8x over, counted per event
    assert decoding >= after_first / 2, (decoding, after_first)
    assert sample.output_tokens == tokens


@pytest.mark.parametrize(
    ("model", "client"),
    [
        ("chat", "openai"),  # forwarded byte for byte: events read without being parsed
        ("chat", "anthropic"),  # translated: events parsed
        ("chat", "responses"),
        ("claude", "openai"),
        ("claude", "anthropic"),
        ("native", "responses"),
    ],
)
async def test_tpot_is_per_token_when_events_carry_several_and_no_usage(
    setup: Setup, model: str, client: str
) -> None:
    """With 8 tokens per event and no usage, output tokens are estimated from the text (64, not
    8 events) and TPOT is per token, on every upstream wire and for every client wire."""
    check_per_token(await stream(setup, model, client), TOKENS)


@pytest.mark.parametrize(
    ("model", "client"),
    [("chat-usage", "openai"), ("claude-usage", "openai"), ("native-usage", "responses")],
)
async def test_reported_usage_wins_over_the_text_estimate(
    setup: Setup, model: str, client: str
) -> None:
    """When the upstream reports its output tokens, that count is used (80, where the text
    says 64), for the token count and for TPOT."""
    check_per_token(await stream(setup, model, client), REPORTED)


@pytest.mark.parametrize(
    ("model", "client", "tokens"),
    [
        ("chat", "openai", TOKENS),
        ("claude", "openai", TOKENS),
        ("native", "responses", TOKENS),
        ("chat-usage", "openai", REPORTED),
        ("claude-usage", "anthropic", REPORTED),
        ("native-usage", "responses", REPORTED),
    ],
)
async def test_an_answer_without_usage_counts_its_text(
    setup: Setup, model: str, client: str, tokens: int
) -> None:
    """A non-streaming answer that reports no usage counts the tokens its text holds (not one
    per choice), on every wire; one that does report them counts those."""
    path, body = CLIENTS[client]
    resp = await setup.http.post(path, json={**body, "model": model})
    assert resp.status_code == 200, resp.text
    ((samples),) = setup.gateway.recorder.samples.values()
    (sample,) = samples
    assert (sample.ok, sample.output_tokens, sample.tpot_s) == (True, tokens, None)


async def test_admin_latency_shows_per_token_tpot_and_output_length(setup: Setup) -> None:
    """`/admin/latency` shows the deployment's TPOT per token and its mean output length from
    the text, for a stream with several tokens per event and no usage."""
    sample = await stream(setup, "chat", "openai")
    assert sample.tpot_s is not None

    async def refreshed() -> dict[str, Any] | None:  # the snapshot: a periodic task renews it
        shown: dict[str, Any] | None = (
            (await setup.http.get("/admin/latency")).json()["deployments"].get("chat/m")
        )
        return shown if shown is not None and shown["tpot_ms"]["count"] == 1 else None

    shown = await eventually(
        refreshed, within_s=10, what="/admin/latency to show the stream's TPOT", every_s=0.05
    )
    assert shown["output_tokens_mean"] == TOKENS
    assert shown["tpot_ms"]["p50"] == pytest.approx(sample.tpot_s * 1000, rel=0.05)  # sketch


# --- what the decoders measure -------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        " tok tok",
        'say "hi" \\',  # escaped quotes, and a string that ends in an escaped backslash
        "héllo, 世界",  # sent as UTF-8 (as vLLM and OpenAI do)
    ],
)
def test_event_text_is_measured_read_by_its_bytes_or_parsed(text: str) -> None:
    """A content event's text is measured whole whether it is recognised from its bytes (a
    stream forwarded as is: the JSON string's bytes) or parsed (its UTF-8 bytes), and a quote
    or backslash inside it does not end it early."""
    event = {"id": "c", "choices": [{"index": 0, "delta": {"content": text}}]}
    data = orjson.dumps(event)
    lazy = OpenAIStreamDecoder(lazy=True, scrub=Scrubber.GENERIC).decode(
        SSEEvent(raw=data, data=data)
    )
    parsed = OpenAIStreamDecoder(scrub=Scrubber.GENERIC).decode(SSEEvent(raw=data, data=data))
    assert lazy.data is None  # the fast path did read it
    assert lazy.text == len(orjson.dumps(text)) - 2
    assert parsed.text == len(text.encode())

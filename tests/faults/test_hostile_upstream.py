"""Hostile upstreams: floods of events that carry no content, endless lines, trickles, and
bytes that are not UTF-8.

Before the first content token the gateway holds what it read (it may still fail over), so an
upstream may send only so much before it: `max_precommit_events` events and
`max_precommit_bytes` bytes. Whatever it sends, an upstream that makes no content progress for
`stream_idle_timeout_ms` is given up on: before commit like any failed attempt, after it with an
error event. Meanwhile the rest of the gateway keeps answering. The gateway runs in this
process, so its memory is this process's resident set.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any, Final

import httpx
import hypothesis
import orjson
import pytest
from hypothesis import strategies as st

from gateway.config import ConfigError, Settings
from gateway.sse import SSEFramingError, SSEParser
from tests.conftest import Upstream, gateway_settings, run_gateway
from tests.faults.conftest import chat, settled
from tests.faults.scripts import answer, stream
from tests.faults.wire import DONE, Exchange, RawUpstream, Script, sse_finish, sse_token
from tests.timing import scaled, slowdown

# Every time limit configured into the gateways here stretches by one factor, measured once, so
# that which limit trips first is the same on a busy machine as on a quiet one.
SLOW: Final = slowdown()
IDLE_MS: Final = round(400 * SLOW)  # the test providers' stream_idle_timeout_ms
MB: Final = 1024 * 1024
# Less than half the growth a comment flood caused in 4 s before the bounds, and well above
# the largest held legitimately: one event of up to MAX_EVENT_BYTES (8 MB) being framed.
MAX_GROWTH_MB: Final = 25
_STATUS: Final = Path("/proc/self/status")
_CLEAR_REFS: Final = Path("/proc/self/clear_refs")

TOKEN: Final = sse_token("Hello")
ROLE_ONLY: Final = (
    b'data: {"id":"c","object":"chat.completion.chunk","created":0,"model":"raw",'
    b'"choices":[{"index":0,"delta":{"role":"assistant"},"finish_reason":null}]}\n\n'
)
HUGE_LINE_START: Final = b'data: {"choices":[{"index":0,"delta":{"content":"'


def settings(
    primary: str,
    fallback: str | None = None,
    *,
    provider: dict[str, Any] | None = None,
    **model: Any,
) -> Settings:
    """Model `m` on upstream model `raw` at `primary`, whose provider has a short idle timeout;
    with `fallback`, model `b` on `ok` there, which `m` falls back to."""
    providers: dict[str, Any] = {
        "p": {
            "type": "openai",
            "base_url": primary,
            "stream_idle_timeout_ms": IDLE_MS,
            **(provider or {}),
        }
    }
    models: list[dict[str, Any]] = [
        {"name": "m", "deployments": [{"provider": "p", "model": "raw"}], **model}
    ]
    if fallback is not None:
        providers["f"] = {"type": "openai", "base_url": fallback}
        models[0]["fallbacks"] = ["b"]
        models.append(
            {
                "name": "b",
                "deployments": [{"provider": "f", "model": "ok", "prior": {"ttft_ms": 50}}],
            }
        )
    return gateway_settings(providers, models, server={"access_log": False})


# --- hostile scripts -----------------------------------------------------------------------------


def flood(
    unit: bytes, *, first: bytes = b"", flooding: asyncio.Event | None = None, start: bytes = b""
) -> Script:
    """A 200 SSE response: `first` (say a content token), then `start`, then `unit` over and
    over, as fast as the gateway reads, until it leaves. `flooding` is set once 1 MB was sent."""
    block = unit * max(1, 65536 // len(unit))

    async def script(exchange: Exchange) -> None:
        await exchange.read_request()
        await exchange.start_stream()
        if first:
            await exchange.chunk(first)
        if start:
            await exchange.chunk(start)
        sent = 0
        while True:
            await exchange.chunk(block)
            sent += len(block)
            if flooding is not None and sent >= MB:
                flooding.set()

    return script


def trickle(*, first: bytes = b"", every_s: float = 0.02) -> Script:
    """A 200 SSE response: `first`, then a keep-alive comment one byte at a time, a byte every
    `every_s`, for ever: never silent for long, never any content."""
    keep_alive = b": keep-alive\n\n"

    async def script(exchange: Exchange) -> None:
        await exchange.read_request()
        await exchange.start_stream()
        if first:
            await exchange.chunk(first)
        while True:
            for byte in keep_alive:
                await exchange.chunk(bytes([byte]))
                await asyncio.sleep(every_s)  # the upstream's pace, not a synchronisation

    return script


def steady(count: int, every_s: float) -> Script:
    """A healthy but slow stream: `count` tokens, one every `every_s`, then a finish and [DONE]."""

    async def script(exchange: Exchange) -> None:
        await exchange.read_request()
        await exchange.start_stream()
        for index in range(count):
            await asyncio.sleep(every_s)  # the upstream's pace
            await exchange.chunk(sse_token(f"t{index} "))
        await exchange.chunk(sse_finish() + DONE)
        await exchange.end_chunks()

    return script


# name: (what the upstream does, how the request ends: a status, or 200 and an error event's code)
def firehose(count: int, text: str, sent: list[int]) -> Script:
    """A healthy stream sent as fast as the gateway takes it: `count` tokens of `text`, then a
    finish and [DONE]. `sent[0]` counts the tokens written so far."""
    token = sse_token(text)

    async def script(exchange: Exchange) -> None:
        await exchange.read_request()
        await exchange.start_stream()
        for _ in range(count):
            await exchange.chunk(token)
            sent[0] += 1
        await exchange.chunk(sse_finish() + DONE)
        await exchange.end_chunks()

    return script


BEFORE_FIRST_TOKEN: dict[str, tuple[Script, int]] = {
    "comment-flood": (flood(b": keep-alive\n\n"), 502),  # max_precommit_events
    "keep-alive-newline-flood": (flood(b"\n"), 504),  # no events at all: the idle timeout
    "empty-event-flood": (flood(b"data:\n\n"), 502),
    "role-only-event-flood": (flood(ROLE_ONLY), 502),
    "huge-endless-line": (flood(b"a", start=HUGE_LINE_START), 502),  # MAX_EVENT_BYTES
    "trickle": (trickle(), 504),
}
AFTER_FIRST_TOKEN: dict[str, tuple[Script, str]] = {
    "comment-flood-after-token": (flood(b": keep-alive\n\n", first=TOKEN), "upstream_timeout"),
    "huge-endless-line-after-token": (
        flood(b"a", first=TOKEN, start=HUGE_LINE_START),
        "upstream_stream_error",
    ),
    "trickle-after-token": (trickle(first=TOKEN), "upstream_timeout"),
}

BUDGETS: dict[str, dict[str, Any]] = {
    "no-budget": {},
    "budget": {"budget": {"ttft_ms": round(300 * SLOW), "total_ms": round(1500 * SLOW)}},
}


# --- measuring -----------------------------------------------------------------------------------


def _status_kb(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise LookupError(field)


class PeakGrowth:
    """How far this process's peak resident set has risen since this object was made."""

    def __init__(self) -> None:
        _CLEAR_REFS.write_text("5")  # resets VmHWM (the peak) to the current resident set
        self._start_kb = _status_kb("VmRSS")

    @property
    def mb(self) -> float:
        return (_status_kb("VmHWM") - self._start_kb) / 1024


async def read_stream(client: httpx.AsyncClient, url: str, model: str = "m") -> tuple[int, bytes]:
    """A streamed chat request over raw HTTP: its status and the last 4 KB of its body (a flood
    is read but not kept), which must hold the end of the stream."""
    body = chat(model, stream=True)
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        tail = b""
        async for data in response.aiter_bytes():
            tail = (tail + data)[-4096:]
    return response.status_code, tail


def error_of(body: bytes) -> dict[str, Any]:
    """The OpenAI error object of an error response body."""
    error: dict[str, Any] = orjson.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def final_error_event(tail: bytes) -> dict[str, Any]:
    """The error event a cut stream ends with; never a [DONE]."""
    assert b"[DONE]" not in tail
    last = tail.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    assert last.startswith(b"data: {"), last[-300:]
    return error_of(last.removeprefix(b"data: "))


# --- configuration -------------------------------------------------------------------------------


def test_limits_default_and_are_validated() -> None:
    """The limits have defaults (60 s, 1000 events, 1 MiB), and a value out of range is refused
    with an error naming its key."""
    models = [{"name": "m", "deployments": [{"provider": "p", "model": "raw"}]}]
    provider = {"type": "openai", "base_url": "http://127.0.0.1:9/v1"}
    spec = gateway_settings({"p": provider}, models).providers["p"]
    assert (spec.stream_idle_timeout_ms, spec.max_precommit_events) == (60_000, 1_000)
    assert spec.max_precommit_bytes == MB
    bad = {"stream_idle_timeout_ms": 0, "max_precommit_events": 0, "max_precommit_bytes": 10}
    with pytest.raises(ConfigError) as caught:
        gateway_settings({"p": {**provider, **bad}}, models)
    for key in bad:
        assert f"providers.p.{key}:" in str(caught.value)


# --- memory --------------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("behaviour", list(BEFORE_FIRST_TOKEN) + list(AFTER_FIRST_TOKEN))
async def test_memory_stays_bounded(client: httpx.AsyncClient, behaviour: str, budget: str) -> None:
    """Whatever an upstream sends instead of content (comments, blank keep-alive lines, empty or
    role-only events, one line that never ends, a trickle), before or after the first token,
    with or without budgets, the gateway's memory grows by less than 25 MB and the request
    ends with an error in a few seconds: a status before the first token, an error event
    after it."""
    before = behaviour in BEFORE_FIRST_TOKEN
    script = BEFORE_FIRST_TOKEN[behaviour][0] if before else AFTER_FIRST_TOKEN[behaviour][0]
    async with (
        RawUpstream(script) as up,
        run_gateway(settings(up.base_url, **BUDGETS[budget])) as gw,
    ):
        growth = PeakGrowth()
        try:
            async with asyncio.timeout(scaled(4)):
                status, tail = await read_stream(client, gw.url)
        except TimeoutError:
            status, tail = 0, b""  # still going: reported below, after the memory
        assert growth.mb < MAX_GROWTH_MB
        await settled(up.url)
    if before:
        assert status == BEFORE_FIRST_TOKEN[behaviour][1]
        assert "p/raw" in error_of(tail)["message"]
    else:
        assert status == 200
        assert final_error_event(tail)["code"] == AFTER_FIRST_TOKEN[behaviour][1]


async def test_anthropic_ping_flood_is_bounded(client: httpx.AsyncClient) -> None:
    """An Anthropic upstream that sends `message_start` and then only pings is bounded the same
    way, though its pings translate to nothing on the OpenAI wire: a 502 at the event bound."""
    start = (
        b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1",'
        b'"type":"message","role":"assistant","model":"raw","content":[],"stop_reason":null,'
        b'"usage":{"input_tokens":3,"output_tokens":0}}}\n\n'
    )
    script = flood(b'event: ping\ndata: {"type":"ping"}\n\n', start=start)
    async with RawUpstream(script) as up:
        config = gateway_settings(
            {"p": {"type": "anthropic", "base_url": up.url, "api_key": "unused"}},
            [{"name": "m", "deployments": [{"provider": "p", "model": "raw"}]}],
            server={"access_log": False},
        )
        async with run_gateway(config) as gw, asyncio.timeout(scaled(5)):
            growth = PeakGrowth()
            status, tail = await read_stream(client, gw.url)
            assert growth.mb < MAX_GROWTH_MB
            await settled(up.url)
    assert status == 502
    assert "max_precommit_events" in error_of(tail)["message"]


@pytest.mark.parametrize("what", ["events", "bytes"])
async def test_precommit_bound_fails_over(
    upstream: Upstream, client: httpx.AsyncClient, what: str
) -> None:
    """An upstream that sends more than the configured events or bytes without content is
    given up on at that bound: the fallback answers the request."""
    limits = {"max_precommit_events": 50} if what == "events" else {"max_precommit_bytes": 4096}
    script = stream(*[ROLE_ONLY] * 200, TOKEN, end="done")
    async with RawUpstream(script) as up:
        config = settings(up.base_url, upstream.base_url, provider=limits)
        async with run_gateway(config) as gw, asyncio.timeout(scaled(5)):
            async with client.stream(
                "POST", gw.url + "/v1/chat/completions", json=chat(stream=True)
            ) as response:
                body = await response.aread()
            await settled(up.url, upstream.url, at_most=1)
    assert response.status_code == 200
    assert response.headers["x-tailguard-deployment"] == "f/ok"
    assert response.headers["x-tailguard-route"] == "error_fallback"
    assert body.rstrip().endswith(b"data: [DONE]")


async def test_precommit_events_within_the_bound_are_relayed(client: httpx.AsyncClient) -> None:
    """Events before the first token, up to the bounds, are held and relayed as they came."""
    script = stream(*[ROLE_ONLY] * 20, TOKEN, end="done")
    async with RawUpstream(script) as up:
        config = settings(up.base_url, provider={"max_precommit_events": 20})
        async with (
            run_gateway(config) as gw,
            asyncio.timeout(scaled(5)),
            client.stream(
                "POST", gw.url + "/v1/chat/completions", json=chat(stream=True)
            ) as response,
        ):
            body = await response.aread()
    assert response.status_code == 200
    assert body == ROLE_ONLY * 20 + TOKEN + DONE


# --- responsiveness ------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["before-first-token", "after-first-token"])
async def test_flood_leaves_the_gateway_responsive(
    upstream: Upstream, client: httpx.AsyncClient, where: str
) -> None:
    """While an upstream floods the gateway (blank keep-alive lines before the first token,
    comments after it), a /healthz and a chat request on another model are answered at once
    (and the loop-stall watchdog sees no stall)."""
    flooding = asyncio.Event()
    if where == "before-first-token":
        script = flood(b"\n", flooding=flooding)
    else:
        script = flood(b": keep-alive\n\n", first=TOKEN, flooding=flooding)
    async with RawUpstream(script) as up:
        config = gateway_settings(
            {
                "p": {
                    "type": "openai",
                    "base_url": up.base_url,
                    "stream_idle_timeout_ms": round(1500 * SLOW),
                },
                "f": {"type": "openai", "base_url": upstream.base_url},
            },
            [
                {"name": "m", "deployments": [{"provider": "p", "model": "raw"}]},
                {"name": "b", "deployments": [{"provider": "f", "model": "ok"}]},
            ],
            server={"access_log": False},
        )
        async with run_gateway(config) as gw:
            flooded = asyncio.create_task(read_stream(client, gw.url))
            async with asyncio.timeout(scaled(5)):
                await flooding.wait()
            delays = []
            for _ in range(5):
                started = time.perf_counter()
                health = await client.get(gw.url + "/healthz")
                delays.append(time.perf_counter() - started)
                assert health.status_code == 200
                started = time.perf_counter()
                other = await client.post(gw.url + "/v1/chat/completions", json=chat("b"))
                delays.append(time.perf_counter() - started)
                assert other.status_code == 200
            assert not flooded.done()  # the flood lasted through every probe
            async with asyncio.timeout(scaled(5)):
                status, tail = await flooded
            await settled(up.url, upstream.url, at_most=1)
    # A gateway the flood blocked would answer only once the flood ends (its idle timeout,
    # 1.5 s scaled): every probe was answered while it went on (checked above), the typical one
    # at once. The slowest is bounded by the flood, not by a figure of its own: a busy machine
    # may hold one probe for several scheduling slices.
    assert statistics.median(delays) < 0.1 * SLOW, delays
    assert max(delays) < 1.5 * SLOW, delays
    if where == "before-first-token":
        assert status == 504
        assert error_of(tail)["code"] == "upstream_timeout"
    else:
        assert status == 200
        assert final_error_event(tail)["code"] == "upstream_timeout"


# --- the idle timeout ----------------------------------------------------------------------------


@pytest.mark.parametrize("fallback", [False, True], ids=["alone", "fallback"])
async def test_trickle_before_first_token_ends_at_the_idle_timeout(
    upstream: Upstream, client: httpx.AsyncClient, fallback: bool
) -> None:
    """An upstream that keeps the connection busy with a byte now and then but sends no content
    is given up on `stream_idle_timeout_ms` after the attempt began, without any budget: the
    fallback serves, or a 504 names the deployment; the upstream sees the close."""
    async with RawUpstream(trickle()) as up:
        config = settings(up.base_url, upstream.base_url if fallback else None)
        async with run_gateway(config) as gw, asyncio.timeout(scaled(5)):
            started = time.perf_counter()
            async with client.stream(
                "POST", gw.url + "/v1/chat/completions", json=chat(stream=True)
            ) as response:
                body = await response.aread()
            elapsed = time.perf_counter() - started
            await settled(up.url, upstream.url, at_most=1)
    assert IDLE_MS / 1000 <= elapsed < IDLE_MS / 1000 + scaled(1.0)
    if fallback:
        assert response.status_code == 200
        assert response.headers["x-tailguard-deployment"] == "f/ok"
        assert body.rstrip().endswith(b"data: [DONE]")
    else:
        assert response.status_code == 504
        error = error_of(body)
        assert error["code"] == "upstream_timeout"
        assert "p/raw" in error["message"]


async def test_trickle_after_first_token_ends_with_an_error_event(
    client: httpx.AsyncClient,
) -> None:
    """After the first token, an upstream that trickles keep-alive bytes and no content is cut
    `stream_idle_timeout_ms` after its last content: an `upstream_timeout` error event, never a
    clean [DONE]."""
    async with (
        RawUpstream(trickle(first=TOKEN)) as up,
        run_gateway(settings(up.base_url)) as gw,
        asyncio.timeout(scaled(5)),
    ):
        started = time.perf_counter()
        status, tail = await read_stream(client, gw.url)
        elapsed = time.perf_counter() - started
        await settled(up.url)
    assert status == 200
    assert tail.startswith(TOKEN)
    error = final_error_event(tail)
    assert error["code"] == "upstream_timeout"
    assert "p/raw" in error["message"]
    assert IDLE_MS / 1000 <= elapsed < IDLE_MS / 1000 + scaled(1.0)


async def test_slow_steady_content_is_not_idle(client: httpx.AsyncClient) -> None:
    """The idle timeout counts from the last content, not from the start: a stream whose tokens
    come slowly but each within the timeout, for longer than the timeout in all, completes."""
    every_s = IDLE_MS / 1000 / 3
    async with (
        RawUpstream(steady(8, every_s)) as up,
        run_gateway(settings(up.base_url)) as gw,
        asyncio.timeout(scaled(5)),
    ):
        status, tail = await read_stream(client, gw.url)
        await settled(up.url)
    assert status == 200
    assert tail.rstrip().endswith(b"data: [DONE]")
    assert tail.count(b'"content":"') == 8


async def test_a_slow_client_does_not_make_the_upstream_idle(client: httpx.AsyncClient) -> None:
    """Time the relay spends waiting for a client to take what was sent is not upstream idle
    time: a client that stops reading for twice the idle timeout, while the upstream has plenty
    to send, still gets the whole stream."""
    sent = [0]
    count = 5000  # ~20 MB: more than the sockets between them buffer
    async with (
        RawUpstream(firehose(count, "x" * 4000, sent)) as up,
        run_gateway(settings(up.base_url)) as gw,
        asyncio.timeout(scaled(10)),
    ):
        body = chat(stream=True)
        async with client.stream("POST", gw.url + "/v1/chat/completions", json=body) as resp:
            chunks = resp.aiter_bytes()
            tail = await anext(chunks)
            await asyncio.sleep(2 * IDLE_MS / 1000)  # the client's own pace: it stops reading
            backed_up = sent[0] < count
            async for data in chunks:
                tail = (tail + data)[-4096:]
        await settled(up.url)
    assert backed_up  # the stream waited on the client, not the other way round
    assert tail.rstrip().endswith(b"data: [DONE]")


# --- invalid UTF-8 -------------------------------------------------------------------------------

BAD_TEXT: Final = b"caf\xc3"  # a UTF-8 sequence cut short
_CHUNK: Final = (
    b'{"id":"c","object":"chat.completion.chunk","created":0,"model":"raw",'
    b'"choices":[{"index":0,"delta":{"content":"%s"},"finish_reason":null}]}'
)
_BODY: Final = (
    b'{"id":"c","object":"chat.completion","created":0,"model":"raw","choices":[{"index":0,'
    b'"message":{"role":"assistant","content":"%s"},"finish_reason":"stop"}]}'
)
BAD_EVENTS: dict[str, bytes] = {
    "content": b"data: " + _CHUNK % BAD_TEXT + b"\n\n",
    "comment": b": " + BAD_TEXT + b"\n\n",
    "event-name": b"event: " + BAD_TEXT + b"\ndata: " + _CHUNK % b"x" + b"\n\n",
    "split-content": b"data: " + _CHUNK % b"caf\xc3\xa9 \xff" + b"\n\n",
}


BAD_BODIES: dict[str, bytes] = {
    "body-content": _BODY % BAD_TEXT,
    "body-split-content": _BODY % b"caf\xc3\xa9 \xff",
}


_TEXT = st.text(st.characters(codec="utf-8", exclude_characters="\r\n"), max_size=30)


@hypothesis.settings(max_examples=150, deadline=None, derandomize=True, database=None)
@hypothesis.given(
    before=_TEXT,
    after=_TEXT,
    bad=st.sampled_from([b"\xff", b"\xc3", b"\xe2\x82", b"\xed\xa0\x80", b"\xc0\xaf"]),
    cuts=st.lists(st.integers(0, 200), max_size=8),
)
def test_the_parser_refuses_invalid_utf8_however_it_is_cut(
    before: str, after: str, bad: bytes, cuts: list[int]
) -> None:
    """A stream with bytes that are not UTF-8 (a stray byte, a cut or overlong sequence, a
    surrogate) anywhere in an event is refused, however it is split into pieces; the same
    stream without them parses."""
    head = ("data: " + before).encode()
    tail = (after + "\n\n").encode()
    points = sorted({min(cut, len(head) + len(bad) + len(tail)) for cut in cuts})

    def feed(data: bytes) -> list[bytes]:
        parser = SSEParser()
        events, start = [], 0
        for point in [*points, len(data)]:
            events += [event.data for event in parser.feed(data[start:point])]
            start = max(start, point)
        return events

    assert feed(head + tail) == [(before + after).encode()]
    with pytest.raises(SSEFramingError, match="UTF-8"):
        feed(head + bad + tail)


@pytest.mark.parametrize("where", list(BAD_EVENTS) + list(BAD_BODIES))
@pytest.mark.parametrize("fallback", [False, True], ids=["alone", "fallback"])
async def test_invalid_utf8_before_commit_is_one_rule(
    upstream: Upstream, client: httpx.AsyncClient, where: str, fallback: bool
) -> None:
    """An upstream answer that is not valid UTF-8 is an invalid response, streamed or not: the
    fallback answers, or the client gets a 502 naming the deployment; never the bytes."""
    streamed = where in BAD_EVENTS
    script = stream(BAD_EVENTS[where], end="done") if streamed else answer(200, BAD_BODIES[where])
    async with RawUpstream(script) as up:
        config = settings(up.base_url, upstream.base_url if fallback else None)
        async with run_gateway(config) as gw, asyncio.timeout(scaled(5)):
            async with client.stream(
                "POST", gw.url + "/v1/chat/completions", json=chat(stream=streamed)
            ) as response:
                body = await response.aread()
            await settled(up.url, upstream.url, at_most=1)
    body.decode()  # whatever the client got is valid UTF-8
    if fallback:
        assert response.status_code == 200
        assert response.headers["x-tailguard-deployment"] == "f/ok"
    else:
        assert response.status_code == 502
        error = error_of(body)
        assert error["code"] == "all_candidates_failed"
        assert "p/raw" in error["message"]
        assert "UTF-8" in error["message"]


@pytest.mark.parametrize("where", list(BAD_EVENTS))
async def test_invalid_utf8_after_commit_ends_with_an_error_event(
    client: httpx.AsyncClient, where: str
) -> None:
    """After the first token, an event that is not valid UTF-8 is not relayed: the stream ends
    with an error event instead (never [DONE]), and every byte the client got is UTF-8."""
    hold = asyncio.Event()
    script = stream(TOKEN, BAD_EVENTS[where], TOKEN, end="done", hold=hold)
    async with RawUpstream(script) as up, run_gateway(settings(up.base_url)) as gw:
        async with asyncio.timeout(scaled(5)):
            body = chat(stream=True)
            async with client.stream("POST", gw.url + "/v1/chat/completions", json=body) as resp:
                received = b""
                async for data in resp.aiter_bytes():
                    received += data
                    hold.set()  # the first token is through: send the rest
            await settled(up.url)
    received.decode()
    assert resp.status_code == 200
    assert received.startswith(TOKEN)
    error = final_error_event(received)
    assert error["code"] == "upstream_stream_error"
    assert "UTF-8" in error["message"]

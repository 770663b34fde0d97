"""Streams that go wrong: stalls before and after the first token, truncation, garbage, and
errors hidden in a 200.

Before the first token the gateway can still answer with a status (or fall back); after it the
status is spent, so a failure becomes one SSE error event and the stream ends without `[DONE]`:
never a clean end that a client would take for a complete answer.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Literal

import httpx
import openai
import orjson
import pytest

from tests.conftest import Gateway, Upstream, run_gateway
from tests.faults.conftest import MESSAGES, chat, routed, sdk, settled
from tests.faults.scripts import answer, cut_body, silent, stream
from tests.faults.wire import RawUpstream, Script, sse_finish, sse_token
from tests.timing import scaled

TOKENS = (sse_token("Hello"), sse_token(" world"))


async def sse(client: httpx.AsyncClient, url: str) -> tuple[int, list[str]]:
    """One streamed chat request over raw HTTP: the status and the non-empty lines."""
    async with client.stream("POST", url + "/v1/chat/completions", json=chat(stream=True)) as resp:
        lines = [line async for line in resp.aiter_lines() if line]
    return resp.status_code, lines


def last_error(lines: list[str]) -> dict[str, Any]:
    """The error event a broken stream must end with (and no `[DONE]` anywhere)."""
    assert "data: [DONE]" not in lines, lines
    assert lines and lines[-1].startswith("data: {"), lines
    error: dict[str, Any] = orjson.loads(lines[-1].removeprefix("data: "))["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


async def sdk_stream_fails(gw: Gateway) -> openai.APIError:
    """Read a stream with the SDK, which must raise instead of ending cleanly."""
    async with sdk(gw) as client:
        chunks = await client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        with pytest.raises(openai.APIError) as caught:
            async for _ in chunks:
                pass
    return caught.value


# --- stalls before the first token ---------------------------------------------------------------


@pytest.mark.parametrize("head", ["none", "partial", "full"])
async def test_stall_before_first_token_fails_over_at_the_deadline(
    upstream: Upstream, client: httpx.AsyncClient, head: Literal["none", "partial", "full"]
) -> None:
    """A primary that says nothing (no headers, half of them, or all and then nothing) is cut at
    its TTFT deadline; the fallback streams, and the primary sees its connection closed."""
    async with RawUpstream(silent(head=head)) as up:
        settings = routed(up.base_url, "mute", upstream.base_url, budget={"ttft_ms": 300})
        async with run_gateway(settings) as gw, asyncio.timeout(scaled(5)):
            started = time.perf_counter()
            status, lines = await sse(client, gw.url)
            elapsed = time.perf_counter() - started
            await up.wait_for(lambda u: u.peer_closes == 1, within_s=1)
            await settled(up.url)
    assert status == 200
    assert lines[-1] == "data: [DONE]"
    assert elapsed < scaled(0.6)  # deadline 300 - 1.1 x 50 ms, then the fallback's first token


async def test_stall_without_successor_is_bounded_by_the_total_budget() -> None:
    """With no candidate left to rescue it, a silent upstream is waited for only until the total
    budget ends: a 504 `budget_exceeded`, and the upstream sees the close."""
    async with RawUpstream(silent(head="full")) as up:
        settings = routed(up.base_url, "mute", budget={"ttft_ms": 100, "total_ms": 400})
        async with run_gateway(settings) as gw, sdk(gw) as client, asyncio.timeout(scaled(5)):
            started = time.perf_counter()
            with pytest.raises(openai.InternalServerError) as caught:
                await client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
            elapsed = time.perf_counter() - started
            await up.wait_for(lambda u: u.peer_closes == 1, within_s=1)
            await settled(up.url)
    assert caught.value.status_code == 504
    assert caught.value.code == "budget_exceeded"
    assert 0.35 < elapsed < scaled(1.0)


# --- failures after the first token --------------------------------------------------------------


async def test_stall_mid_stream_ends_with_a_timeout_event(client: httpx.AsyncClient) -> None:
    """An upstream that goes silent after two tokens, on a model whose committed streams are cut
    at the total budget (`on_total_miss: cut`), is cut when it runs out: an `upstream_timeout`
    error event, no `[DONE]`, and the upstream sees the close."""
    async with RawUpstream(stream(*TOKENS, end="stall")) as up:
        settings = routed(up.base_url, "stuck", budget={"total_ms": 400}, on_total_miss="cut")
        async with run_gateway(settings) as gw, asyncio.timeout(scaled(5)):
            started = time.perf_counter()
            status, lines = await sse(client, gw.url)
            elapsed = time.perf_counter() - started
            await up.wait_for(lambda u: u.peer_closes == 1, within_s=1)
            error = await sdk_stream_fails(gw)
            await up.wait_for(lambda u: u.peer_closes == 2, within_s=1)
            await settled(up.url)
    assert status == 200
    assert last_error(lines)["code"] == "upstream_timeout"
    assert sum('"content":"' in line for line in lines) == 2
    assert 0.35 < elapsed < scaled(1.0)
    assert "total budget" in error.message


TRUNCATIONS: dict[str, Script] = {
    "chunked-cut": stream(*TOKENS, end="cut"),
    "close-delimited-cut": stream(*TOKENS, end="cut", chunked=False),
    "reset": stream(*TOKENS, end="reset"),
    "clean-end-without-done": stream(*TOKENS, sse_finish(), end="clean"),
    "cut-inside-an-event": stream(TOKENS[0], TOKENS[1][:25], end="cut"),
}


@pytest.mark.parametrize("how", list(TRUNCATIONS))
async def test_truncated_stream_is_never_a_clean_end(client: httpx.AsyncClient, how: str) -> None:
    """A stream the upstream ends early, however it ends (a cut body, a reset, a proper end of
    the body without `[DONE]`, half an event), ends with an error event: the SDK raises."""
    async with (
        RawUpstream(TRUNCATIONS[how]) as up,
        run_gateway(routed(up.base_url, "short")) as gw,
        asyncio.timeout(scaled(5)),
    ):
        status, lines = await sse(client, gw.url)
        error = await sdk_stream_fails(gw)
        await settled(up.url)
    assert status == 200
    assert '"content":"Hello"' in lines[0]
    assert last_error(lines)["code"] == "upstream_stream_error"
    assert "p/short" in error.message


async def test_truncated_stream_on_the_anthropic_endpoint_ends_with_an_error_event(
    client: httpx.AsyncClient,
) -> None:
    """The same holds for a client of `/v1/messages`: its stream ends with Anthropic's `error`
    event, not with `message_stop`."""
    body = {"model": "m", "max_tokens": 16, "stream": True, **chat()}
    async with (
        RawUpstream(TRUNCATIONS["chunked-cut"]) as up,
        run_gateway(routed(up.base_url, "short")) as gw,
        asyncio.timeout(scaled(5)),
    ):
        async with client.stream("POST", gw.url + "/v1/messages", json=body) as resp:
            text = (await resp.aread()).decode()
        await settled(up.url)
    assert resp.status_code == 200
    assert text.startswith("event: message_start")
    assert "message_stop" not in text
    *_, last = (event for event in text.split("\n\n") if event.strip())
    assert last.startswith("event: error\n")
    assert orjson.loads(last.split("data: ", 1)[1])["type"] == "error"


async def test_body_cut_short_is_a_502_or_the_fallback(
    upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """A non-streaming answer whose body ends before its declared length is the deployment's
    failure: a 502 naming it, or, with a fallback, the fallback's answer."""
    script = cut_body(200, b'{"id":"x","choices":[{"index":0,', declared=1000)
    async with RawUpstream(script) as up:
        async with run_gateway(routed(up.base_url, "short")) as gw, asyncio.timeout(scaled(5)):
            alone = await client.post(gw.base_url + "/chat/completions", json=chat())
        settings = routed(up.base_url, "short", upstream.base_url)
        async with run_gateway(settings) as gw, asyncio.timeout(scaled(5)):
            rescued = await client.post(gw.base_url + "/chat/completions", json=chat())
            await settled(up.url)
    assert alone.status_code == 502
    assert "p/short" in alone.json()["error"]["message"]
    assert rescued.status_code == 200
    assert rescued.json()["choices"][0]["message"]["content"]


# --- garbage -------------------------------------------------------------------------------------

HTML = b"<!DOCTYPE html><html><body><h1>502 Bad Gateway</h1></body></html>"


@pytest.mark.parametrize(
    ("script", "message"),
    [
        (stream(b"data: hello\n\n", end="done"), "invalid stream"),
        (stream(b"data: {not json}\n\n", end="done"), "invalid stream"),
        (stream(b'data: {"id":"x"', end="cut", chunked=False), "middle of an event"),
        (answer(200, HTML, content_type="text/html"), "without a stream"),
        (answer(502, HTML, content_type="text/html"), "HTML page"),
    ],
    ids=["non-json", "bad-json", "unterminated-event", "html-200", "html-502"],
)
async def test_garbage_before_the_first_token_is_a_502(
    client: httpx.AsyncClient, script: Script, message: str
) -> None:
    """What is not an SSE stream of JSON events (plain text, an HTML page from a proxy, with a
    200 or a 502) is refused before anything is sent: an OpenAI-shaped 502."""
    async with RawUpstream(script) as up, run_gateway(routed(up.base_url, "junk")) as gw:
        async with asyncio.timeout(scaled(5)):
            resp = await client.post(gw.base_url + "/chat/completions", json=chat(stream=True))
            await settled(up.url)
    assert resp.status_code == 502
    error = resp.json()["error"]
    assert error["code"] == "all_candidates_failed"
    assert message in error["message"] and "p/junk" in error["message"]
    assert "<html>" not in error["message"].lower()


async def test_html_page_for_a_body_request_is_a_502(client: httpx.AsyncClient) -> None:
    """A non-streaming request answered with an HTML page and a 200 is a 502 too."""
    script = answer(200, HTML, content_type="text/html")
    async with RawUpstream(script) as up, run_gateway(routed(up.base_url, "junk")) as gw:
        async with asyncio.timeout(scaled(5)):
            resp = await client.post(gw.base_url + "/chat/completions", json=chat())
            await settled(up.url)
    assert resp.status_code == 502
    assert "invalid response" in resp.json()["error"]["message"]


async def test_garbage_before_the_first_token_falls_back(
    upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """Garbage is a failure of the deployment: with a fallback, the client never sees it."""
    async with RawUpstream(stream(b"data: hello\n\n", end="done")) as up:
        settings = routed(up.base_url, "junk", upstream.base_url)
        async with run_gateway(settings) as gw, asyncio.timeout(scaled(5)):
            status, lines = await sse(client, gw.url)
            await settled(up.url)
    assert status == 200
    assert lines[-1] == "data: [DONE]"


@pytest.mark.parametrize(
    "garbage",
    [b"data: hello\n\n", b'data: {"choices":[{"index":0,"delta":{"content":"x"}}\n\n'],
    ids=["non-json", "truncated-json"],
)
async def test_garbage_after_the_first_token_is_an_error_event(
    client: httpx.AsyncClient, garbage: bytes
) -> None:
    """Garbage after the first token is never relayed, even when it looks like a content event
    cut short: the stream ends with an error event, and the SDK raises."""
    first_seen = asyncio.Event()  # the garbage comes once the client has the first token
    script = stream(TOKENS[0], garbage, TOKENS[1], end="done", hold=first_seen)
    body = chat(stream=True)
    async with RawUpstream(script) as up, run_gateway(routed(up.base_url, "junk")) as gw:
        async with asyncio.timeout(scaled(5)):
            async with client.stream("POST", gw.base_url + "/chat/completions", json=body) as resp:
                lines = []
                async for line in resp.aiter_lines():
                    first_seen.set()
                    if line:
                        lines.append(line)
            first_seen.clear()
            async with sdk(gw) as sdk_client:
                chunks = await sdk_client.chat.completions.create(
                    model="m", messages=MESSAGES, stream=True
                )
                assert (await anext(chunks)).choices[0].delta.content == "Hello"
                first_seen.set()
                with pytest.raises(openai.APIError) as caught:
                    async for _ in chunks:
                        pass
            await settled(up.url)
    assert resp.status_code == 200
    assert all(line.startswith("data: {") for line in lines)
    assert last_error(lines)["code"] == "upstream_stream_error"
    assert '"content":"x"' not in "".join(lines)
    assert "invalid stream" in caught.value.message


# --- errors inside a 200 -------------------------------------------------------------------------


def flat_error(code: int, message: str = "something went wrong") -> bytes:
    """Old vLLM's error shape: flat, with the HTTP status in `code`."""
    return orjson.dumps(
        {
            "object": "error",
            "message": message,
            "type": "BadRequestError",
            "param": None,
            "code": code,
        }
    )


async def test_flat_error_in_a_200_body_is_the_clients_400(
    upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """Old vLLM answers a too-long prompt with a 200 and a flat error object: the client gets a
    proper 400 with the upstream's message, and no fallback is tried (it would refuse too)."""
    body = flat_error(400, "This model's maximum context length is 4096 tokens.")
    async with RawUpstream(answer(200, body)) as up:
        settings = routed(up.base_url, "old", upstream.base_url)
        async with run_gateway(settings) as gw, sdk(gw) as sdk_client, asyncio.timeout(scaled(5)):
            with pytest.raises(openai.BadRequestError) as caught:
                await sdk_client.chat.completions.create(model="m", messages=MESSAGES)
            await settled(up.url)
    assert "maximum context length" in caught.value.message
    assert upstream.stats.requests == 0


@pytest.mark.parametrize("streamed", [False, True], ids=["body", "first-event"])
async def test_flat_server_error_in_a_200_falls_back(
    upstream: Upstream, client: httpx.AsyncClient, streamed: bool
) -> None:
    """A flat 5xx error in a 200 (as a body, or as a stream's first event) is the deployment's
    failure: the fallback serves."""
    body = flat_error(500)
    script = stream(b"data: " + body + b"\n\n", end="done") if streamed else answer(200, body)
    async with RawUpstream(script) as up:
        settings = routed(up.base_url, "old", upstream.base_url)
        async with run_gateway(settings) as gw, asyncio.timeout(scaled(5)):
            resp = await client.post(gw.base_url + "/chat/completions", json=chat(stream=True))
            await settled(up.url)
    assert resp.status_code == 200
    assert resp.headers["x-tailguard-route"] == "error_fallback"
    assert resp.text.rstrip().endswith("data: [DONE]")


async def test_flat_server_error_without_fallback_is_a_clean_error(
    client: httpx.AsyncClient,
) -> None:
    """Without a fallback, a flat 503 error in a 200 stream becomes a 503 in OpenAI's shape."""
    script = stream(b"data: " + flat_error(503, "engine overloaded") + b"\n\n", end="done")
    async with RawUpstream(script) as up, run_gateway(routed(up.base_url, "old")) as gw:
        async with asyncio.timeout(scaled(5)):
            resp = await client.post(gw.base_url + "/chat/completions", json=chat(stream=True))
            await settled(up.url)
    assert resp.status_code == 503
    error = resp.json()["error"]
    assert error["code"] == "upstream_overloaded"
    assert "engine overloaded" in error["message"]


async def test_error_event_after_the_first_token_is_passed_on_as_an_error(
    client: httpx.AsyncClient,
) -> None:
    """An upstream error event after tokens were sent ends the client's stream with an error
    event carrying its message."""
    script = stream(
        TOKENS[0], b"data: " + flat_error(500, "CUDA out of memory") + b"\n\n", end="done"
    )
    async with RawUpstream(script) as up, run_gateway(routed(up.base_url, "old")) as gw:
        async with asyncio.timeout(scaled(5)):
            status, lines = await sse(client, gw.url)
            await settled(up.url)
    assert status == 200
    error = last_error(lines)
    assert error["code"] == "upstream_stream_error"
    assert "CUDA out of memory" in error["message"]

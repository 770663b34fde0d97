"""The simulated upstream, served for real under uvicorn, spoken to by httpx and the openai SDK."""

from __future__ import annotations

import asyncio
import base64
import math
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from pydantic import ValidationError

from gateway.latency.vllm import parse_metrics
from gateway.sim.engine import SimEngine
from gateway.sim.profile import SimProfile, apply_overrides
from gateway.sim.server import SimConfigError, create_sim_app, load_profiles
from gateway.sim.wire import SimConnectionReset
from tests.conftest import serving
from tests.sim_server import until
from tests.timing import scaled

WATCHDOG_S = 10.0  # only ever reached when a test is broken; conditions are awaited, not slept on


@asynccontextmanager
async def serve(engine: SimEngine) -> AsyncIterator[str]:
    """Run the sim under uvicorn (its default protocol) on an ephemeral loopback port, with a
    graceful-shutdown timeout; yield its base URL."""
    async with serving(create_sim_app(engine), http="auto", grace_s=5) as (url, _):
        yield url


@asynccontextmanager
async def sim_client(engine: SimEngine, **kwargs: Any) -> AsyncIterator[httpx.AsyncClient]:
    async with serve(engine) as url, httpx.AsyncClient(base_url=url, **kwargs) as client:
        yield client


def chat(model: str, content: str = "hello there", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


async def sse_events(response: httpx.Response) -> list[Any]:
    """The decoded `data:` payloads of a stream; `[DONE]` stays a string."""
    events: list[Any] = []
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            data = line[6:]
            events.append(data if data == "[DONE]" else orjson.loads(data))
    return events


# Wire format.


async def test_chat_stream_shape_without_usage() -> None:
    """Role chunk, one chunk per token, a finish chunk, [DONE]; no usage unless asked."""
    engine = SimEngine({"fast": SimProfile(output_tokens=5)}, seed=1)
    async with (
        sim_client(engine) as client,
        client.stream("POST", "/v1/chat/completions", json=chat("fast", stream=True)) as response,
    ):
        events = await sse_events(response)
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream"
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    tokens = chunks[1:-1]
    assert len(tokens) == 5
    assert all(len(c["choices"][0]["delta"]["content"].split()) == 1 for c in tokens)
    assert chunks[-1]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "stop",
    }
    for chunk in chunks:
        assert chunk["object"] == "chat.completion.chunk"
        assert chunk["model"] == "fast"
        assert chunk["id"] == chunks[0]["id"]
        assert chunk["id"].startswith("chatcmpl-")
        assert "usage" not in chunk


async def test_chat_stream_with_usage_and_max_tokens() -> None:
    """include_usage adds a choices-less usage chunk; every other chunk says usage null."""
    engine = SimEngine({"fast": SimProfile(output_tokens=50)}, seed=1)
    body = chat("fast", stream=True, stream_options={"include_usage": True}, max_tokens=4)
    async with (
        sim_client(engine) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        events = await sse_events(response)
    assert events[-1] == "[DONE]"
    *chunks, usage = events[:-1]
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert all(chunk["usage"] is None for chunk in chunks)
    assert len(chunks) == 1 + 4 + 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_chat_non_streaming_matches_the_stream() -> None:
    """The same seed gives the same words whether streamed or not."""
    bodies = []
    for stream in (False, True):
        engine = SimEngine(default=SimProfile(output_tokens=7), seed=3)
        reply = await engine.handle(
            "POST", "/v1/chat/completions", orjson.dumps(chat("m", stream=stream))
        )
        if reply.stream is None:
            assert reply.body is not None
            bodies.append(orjson.loads(reply.body)["choices"][0]["message"]["content"])
        else:
            frames = [frame async for frame in reply.stream]
            deltas = [orjson.loads(f[6:])["choices"][0]["delta"] for f in frames[1:-2]]
            bodies.append("".join(d["content"] for d in deltas))
    assert bodies[0] == bodies[1]
    assert len(bodies[0].split()) == 7


async def test_openai_sdk_speaks_to_the_sim() -> None:
    """The official SDK parses chat (both ways), completions, embeddings (base64) and models."""
    engine = SimEngine(
        {"fast": SimProfile(output_tokens=6), "embed": SimProfile(embedding_dims=8)}, seed=5
    )
    async with (
        serve(engine) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as sdk,
        httpx.AsyncClient(base_url=url) as client,
    ):
        completion = await sdk.chat.completions.create(
            model="fast", messages=[{"role": "user", "content": "hi"}]
        )
        assert completion.choices[0].message.role == "assistant"
        assert len((completion.choices[0].message.content or "").split()) == 6
        assert completion.choices[0].finish_reason == "stop"
        assert completion.usage is not None
        assert completion.usage.completion_tokens == 6

        stream = await sdk.chat.completions.create(
            model="fast",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
            max_tokens=3,
        )
        chunks = [chunk async for chunk in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert len(text.split()) == 3
        assert chunks[-1].choices == []
        assert chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 3

        text_completion = await sdk.completions.create(model="fast", prompt="once", max_tokens=2)
        assert text_completion.object == "text_completion"
        assert len(text_completion.choices[0].text.split()) == 2
        assert text_completion.choices[0].finish_reason == "length"
        streamed = await sdk.completions.create(model="fast", prompt="once", stream=True)
        pieces = [c.choices[0].text async for c in streamed if c.choices]
        assert len("".join(pieces).split()) == 6

        embedded = await sdk.embeddings.create(model="embed", input=["a", "b", "a"])
        vectors = [item.embedding for item in embedded.data]
        assert [item.index for item in embedded.data] == [0, 1, 2]
        assert len(vectors[0]) == 8
        assert vectors[0] == vectors[2] != vectors[1]
        floats = (
            await client.post("/v1/embeddings", json={"model": "embed", "input": ["a", "b", "a"]})
        ).json()
        assert [item["embedding"] for item in floats["data"]] == vectors  # same float32 values

        models = await sdk.models.list()
        assert sorted(model.id for model in models.data) == ["embed", "fast"]


async def test_completions_with_a_list_of_prompts() -> None:
    """One choice per prompt, indexed by position, streamed or not."""
    engine = SimEngine(default=SimProfile(output_tokens=3), seed=1)
    async with sim_client(engine) as client:
        response = await client.post(
            "/v1/completions", json={"model": "m", "prompt": ["abcd", "efgh" * 2]}
        )
        body = {"model": "m", "prompt": ["a", "b"], "stream": True, "seed": 3}
        async with client.stream("POST", "/v1/completions", json=body) as streamed:
            events = await sse_events(streamed)
        whole = await client.post("/v1/completions", json={**body, "stream": False})
    body = response.json()
    assert [choice["index"] for choice in body["choices"]] == [0, 1]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
    assert events[-1] == "[DONE]"
    texts = {0: "", 1: ""}
    finishes = {}
    for event in events[:-1]:
        for choice in event["choices"]:
            texts[choice["index"]] += choice["text"]
            if choice["finish_reason"]:
                finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {c["index"]: c["text"] for c in whole.json()["choices"]}
    assert finishes == {0: "stop", 1: "stop"}


async def test_embeddings_are_deterministic_unit_vectors() -> None:
    """Vectors depend on the input alone, are L2-normalised, and base64 is float32 LE."""
    engine = SimEngine(default=SimProfile(embedding_dims=16), seed=1)
    async with sim_client(engine) as client:
        floats = (await client.post("/v1/embeddings", json={"model": "e", "input": "x"})).json()
        packed = (
            await client.post(
                "/v1/embeddings", json={"model": "e", "input": ["x"], "encoding_format": "base64"}
            )
        ).json()
        tokens = await client.post("/v1/embeddings", json={"model": "e", "input": [[1, 2, 3]]})
    vector = floats["data"][0]["embedding"]
    assert len(vector) == 16
    assert math.isclose(math.fsum(v * v for v in vector), 1.0, rel_tol=1e-5)
    decoded = list(struct.unpack("<16f", base64.b64decode(packed["data"][0]["embedding"])))
    assert decoded == vector
    assert floats["usage"] == {"prompt_tokens": 1, "total_tokens": 1}
    assert tokens.json()["usage"]["prompt_tokens"] == 3


async def test_models_and_health() -> None:
    engine = SimEngine({"a": SimProfile(), "b": SimProfile()})
    async with sim_client(engine) as client:
        models = (await client.get("/v1/models")).json()
        health = await client.get("/health")
        missing = await client.get("/v2/nothing")
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["a", "b"]
    assert health.status_code == 200
    assert missing.status_code == 404


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", b"{not json", None),
        ("/v1/chat/completions", b"[1, 2]", None),
        ("/v1/chat/completions", orjson.dumps({"messages": []}), "model"),
        ("/v1/chat/completions", orjson.dumps({"model": "m"}), "messages"),
        ("/v1/chat/completions", orjson.dumps(chat("m", max_tokens=0)), "max_tokens"),
        ("/v1/completions", orjson.dumps({"model": "m"}), "prompt"),
        ("/v1/embeddings", orjson.dumps({"model": "m", "input": []}), "input"),
    ],
)
async def test_bad_requests_are_openai_shaped_400s(
    path: str, body: bytes, param: str | None
) -> None:
    engine = SimEngine()
    reply = await engine.handle("POST", path, body)
    assert reply.status == 400
    assert reply.body is not None
    error = orjson.loads(reply.body)["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert set(error) == {"message", "type", "param", "code"}
    assert engine.stats.requests == 0  # not accepted


async def test_determinism_under_a_seed() -> None:
    """The same seed and the same arrivals give byte-identical answers (but for `created`)."""

    async def run(seed: int) -> list[Any]:
        engine = SimEngine(default=SimProfile(output_tokens=(3, 30)), seed=seed)
        answers = []
        for i in range(6):
            reply = await engine.handle(
                "POST", "/v1/chat/completions", orjson.dumps(chat("m", "x" * i))
            )
            assert reply.body is not None
            answer = orjson.loads(reply.body)
            del answer["created"]
            answers.append(answer)
        return answers

    assert await run(7) == await run(7)
    assert await run(7) != await run(8)


# Timing.


async def first_token_s(client: httpx.AsyncClient, body: dict[str, Any]) -> float:
    """Seconds from sending to the first content delta."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                return loop.time() - started
    raise AssertionError("no content token")


async def test_ttft_grows_with_prompt_length() -> None:
    """Prefill costs per prompt token: a long prompt waits longer for its first token."""
    engine = SimEngine({"p": SimProfile(prefill_ms_per_token=0.5, output_tokens=2)})
    async with sim_client(engine) as client:
        short = await first_token_s(client, chat("p", "hi", stream=True))
        long = await first_token_s(client, chat("p", "x" * 2400, stream=True))  # 600 tokens
    assert long >= 0.25  # 300 ms of prefill, slept for
    assert short < long


async def test_slow_requests_get_their_extra_ttft() -> None:
    engine = SimEngine({"p": SimProfile(output_tokens=1)})
    async with sim_client(engine) as client:
        slow = await first_token_s(client, chat("p@slow_rate=1,slow_ms=300-400", stream=True))
    assert slow >= 0.25


async def test_lognormal_tail_spreads_prefill() -> None:
    """A lognormal tail multiplies prefill by a seeded factor: a few take many times longer."""
    profile = SimProfile(prefill_base_ms=20, ttft_tail="lognormal", ttft_sigma=1.5)
    engine = SimEngine(default=profile, seed=3)  # this seed draws factors from 0.15 to 13.9
    loop = asyncio.get_running_loop()
    body = orjson.dumps(chat("m"))

    async def timed() -> float:
        started = loop.time()
        await engine.handle("POST", "/v1/chat/completions", body)
        return loop.time() - started

    durations = await asyncio.gather(*(timed() for _ in range(8)))
    assert max(durations) >= 0.1  # at least 5x the 20 ms median
    assert min(durations) < max(durations)


async def test_continuous_batching_queues_beyond_max_batch() -> None:
    """With one slot, a second request waits FIFO until the first has sent its last token."""
    engine = SimEngine({"one": SimProfile(max_batch=1, prefill_base_ms=100, output_tokens=2)})
    loop = asyncio.get_running_loop()
    async with sim_client(engine) as client:

        async def run() -> tuple[float, float]:
            async with client.stream(
                "POST", "/v1/chat/completions", json=chat("one", stream=True)
            ) as response:
                first = None
                async for line in response.aiter_lines():
                    if first is None and '"content":"' in line and '"content":""' not in line:
                        first = loop.time()
                assert first is not None
                return first, loop.time()

        a = asyncio.create_task(run())
        await until(engine, lambda s: s.running == 1)
        b = asyncio.create_task(run())
        await until(engine, lambda s: s.waiting == 1)
        (_, a_done), (b_first, _) = await asyncio.gather(a, b)
    assert a_done <= b_first
    assert engine.stats.completed == 2
    assert (engine.stats.running, engine.stats.waiting) == (0, 0)


async def test_decode_slows_as_the_batch_fills() -> None:
    """batch_slowdown=9 makes a full batch of two decode ten times slower than one alone."""
    profile = SimProfile(tokens_per_s=200, max_batch=2, batch_slowdown=9, output_tokens=10)
    engine = SimEngine({"d": profile})
    loop = asyncio.get_running_loop()
    async with sim_client(engine) as client:

        async def timed() -> float:
            started = loop.time()
            response = await client.post("/v1/chat/completions", json=chat("d"))
            assert response.status_code == 200
            return loop.time() - started

        alone = await timed()
        together = await asyncio.gather(timed(), timed())
    assert min(together) >= 0.3  # at least 9 steps of 50 ms once both hold a slot
    assert alone < min(together)


# Faults.


async def test_429_carries_retry_after() -> None:
    engine = SimEngine({"m": SimProfile(error_429_rate=1, retry_after_s=3)})
    async with sim_client(engine) as client:
        response = await client.post("/v1/chat/completions", json=chat("m"))
    assert response.status_code == 429
    assert response.headers["retry-after"] == "3"
    assert response.json()["error"]["code"] == "rate_limit_exceeded"
    assert engine.stats.faults == 1


async def test_500_is_openai_shaped() -> None:
    engine = SimEngine()
    async with sim_client(engine) as client:
        response = await client.post("/v1/chat/completions", json=chat("m@error_500_rate=1"))
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "server_error"


async def test_reset_before_headers_is_a_connection_error() -> None:
    """The client sees the connection go, never an HTTP status."""
    engine = SimEngine()
    async with sim_client(engine) as client:
        with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)):
            await client.post("/v1/chat/completions", json=chat("m@reset_rate=1"))
        after = await client.post("/v1/chat/completions", json=chat("m"))  # the server lives on
    assert after.status_code == 200
    with pytest.raises(SimConnectionReset):  # in-process, the engine raises instead
        await engine.handle("POST", "/v1/embeddings", b'{"model":"m@reset_rate=1","input":"x"}')


async def test_stall_sends_headers_but_no_token() -> None:
    """A stalled stream answers 200 and then says nothing; leaving it cancels the request."""
    engine = SimEngine()
    received: list[str] = []
    async with sim_client(engine, timeout=httpx.Timeout(5.0, read=0.3)) as client:
        body = chat("m@stall_rate=1", stream=True)
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            with pytest.raises(httpx.ReadTimeout):
                async for line in response.aiter_lines():
                    received.append(line)
        await until(engine, lambda s: s.cancelled == 1 and s.open_streams == 0)
    assert received == []


async def test_non_streaming_stall_is_cancelled_when_the_client_leaves() -> None:
    engine = SimEngine({"m": SimProfile(stall_rate=1, stall_ms=60_000)})
    async with sim_client(engine, timeout=httpx.Timeout(5.0, read=0.2)) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/v1/chat/completions", json=chat("m"))
        await until(engine, lambda s: s.cancelled == 1)
    assert engine.stats.completed == 0


async def test_cut_stream_ends_without_done() -> None:
    """About half the tokens arrive, then the chunked body stops short: an error, no [DONE]."""
    engine = SimEngine({"m": SimProfile(output_tokens=10, cut_rate=1)})
    lines: list[str] = []
    async with sim_client(engine) as client:
        with pytest.raises(httpx.RemoteProtocolError):
            async with client.stream(
                "POST", "/v1/chat/completions", json=chat("m", stream=True)
            ) as response:
                async for line in response.aiter_lines():
                    if line:
                        lines.append(line)
        await until(engine, lambda s: s.open_streams == 0)
    assert response.status_code == 200
    assert len(lines) == 1 + 5  # the role chunk, then half of the tokens
    assert "data: [DONE]" not in lines
    assert (engine.stats.faults, engine.stats.cancelled, engine.stats.running) == (1, 0, 0)


async def test_cut_in_process_raises_from_the_stream() -> None:
    engine = SimEngine()
    reply = await engine.handle(
        "POST", "/v1/chat/completions", orjson.dumps(chat("m@cut_rate=1", stream=True))
    )
    assert reply.stream is not None
    frames = []
    with pytest.raises(SimConnectionReset):
        async for frame in reply.stream:
            frames.append(frame)
    assert len(frames) == 1 + 8  # role chunk and half of 16 tokens


async def test_inband_errors() -> None:
    """A 200 whose first event (or whole body) is an error object; the SDK raises on it."""
    engine = SimEngine({"m": SimProfile(inband_error_rate=1)})
    async with (
        serve(engine) as url,
        httpx.AsyncClient(base_url=url) as client,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as sdk,
    ):
        async with client.stream(
            "POST", "/v1/chat/completions", json=chat("m", stream=True)
        ) as response:
            events = await sse_events(response)
        whole = await client.post("/v1/chat/completions", json=chat("m"))
        stream = await sdk.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        with pytest.raises(openai.APIError):
            async for _ in stream:
                pass
    assert response.status_code == 200
    assert set(events[0]) == {"error"}
    assert events[0]["error"]["code"] == "inband_error"
    assert whole.status_code == 200
    assert set(whole.json()) == {"error"}


# Profiles and overrides.


async def test_model_name_overrides() -> None:
    """`name@key=value,...` replaces profile fields for that request; bad overrides are 400s."""
    engine = SimEngine({"fast": SimProfile(output_tokens=9)}, seed=1)
    async with sim_client(engine) as client:
        plain = (await client.post("/v1/chat/completions", json=chat("fast"))).json()
        tuned = await client.post("/v1/chat/completions", json=chat("fast@output_tokens=2"))
        ranged = await client.post("/v1/chat/completions", json=chat("x@output_tokens=3-4"))
        unknown = await client.post("/v1/chat/completions", json=chat("fast@nope=1"))
        invalid = await client.post("/v1/chat/completions", json=chat("fast@stall_rate=2"))
        malformed = await client.post("/v1/chat/completions", json=chat("fast@stall_rate=1,x"))
    assert plain["usage"]["completion_tokens"] == 9
    assert tuned.json()["usage"]["completion_tokens"] == 2
    assert tuned.json()["model"] == "fast@output_tokens=2"
    assert ranged.json()["usage"]["completion_tokens"] in (3, 4)
    for bad in (unknown, invalid, malformed):
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "model"
    assert "nope" in unknown.json()["error"]["message"]


def test_profile_validation() -> None:
    with pytest.raises(ValidationError):
        SimProfile(error_500_rate=1.5)
    with pytest.raises(ValidationError):
        SimProfile(prefill_base_ms=-1)
    with pytest.raises(ValidationError):
        SimProfile(slow_ms=(5, 1))
    with pytest.raises(ValidationError):
        SimProfile.model_validate({"stall_rat": 1})
    assert SimProfile.model_validate({"slow_ms": "2000-4000"}).slow_ms == (2000, 4000)
    assert SimProfile.model_validate({"output_tokens": [4, 8]}).output_tokens == (4, 8)


def test_load_profiles(tmp_path: Path) -> None:
    good = tmp_path / "sim.yaml"
    good.write_text(
        "seed: 7\n"
        "default: {output_tokens: 4}\n"
        "profiles:\n"
        "  fast: {tokens_per_s: 100}\n"
        "  slow: {prefill_base_ms: 500, slow_ms: [100, 200]}\n"
    )
    profiles, default, seed = load_profiles(str(good))
    assert seed == 7
    assert default.output_tokens == 4
    assert profiles["fast"].tokens_per_s == 100
    assert profiles["slow"].slow_ms == (100, 200)

    for text, key in [("seeds: 1\n", "seeds"), ("profiles: {fast: {stal_ms: 1}}\n", "stal_ms")]:
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(SimConfigError, match=key):
            load_profiles(str(bad))


# Client disconnects.


async def test_client_disconnect_cancels_the_stream() -> None:
    """A client that reads two chunks and leaves frees its slot and counts as cancelled."""
    engine = SimEngine({"slow": SimProfile(tokens_per_s=20, output_tokens=1000)})
    async with sim_client(engine) as client:
        async with client.stream(
            "POST", "/v1/chat/completions", json=chat("slow", stream=True)
        ) as response:
            seen = 0
            async for line in response.aiter_lines():
                seen += bool(line)
                if seen == 2:
                    break
        async with asyncio.timeout(scaled(1.0)):
            await engine.stats.wait_for(
                lambda s: s.cancelled == 1 and s.open_streams == 0 and s.running == 0
            )
    assert engine.stats.completed == 0


async def test_in_process_stream_closed_early_is_cancelled() -> None:
    engine = SimEngine(default=SimProfile(max_batch=1))
    reply = await engine.handle(
        "POST", "/v1/chat/completions", orjson.dumps(chat("m", stream=True))
    )
    assert reply.stream is not None
    await anext(reply.stream)
    await anext(reply.stream)
    assert (engine.stats.running, engine.stats.open_streams) == (1, 1)
    await reply.stream.aclose()
    assert (engine.stats.running, engine.stats.open_streams, engine.stats.cancelled) == (0, 0, 1)


async def test_cancelled_waiter_leaves_the_queue() -> None:
    """A request cancelled while queued for a slot gives up its place; the queue moves on."""
    engine = SimEngine(default=SimProfile(max_batch=1, prefill_base_ms=60_000))
    first = asyncio.create_task(
        engine.handle("POST", "/v1/chat/completions", orjson.dumps(chat("m")))
    )
    await until(engine, lambda s: s.running == 1)
    second = asyncio.create_task(
        engine.handle("POST", "/v1/chat/completions", orjson.dumps(chat("m")))
    )
    await until(engine, lambda s: s.waiting == 1)
    second.cancel()
    await until(engine, lambda s: s.waiting == 0 and s.cancelled == 1)
    first.cancel()
    await until(engine, lambda s: s.running == 0 and s.cancelled == 2)
    for task in (first, second):
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_slot_freed_as_its_waiter_is_cancelled() -> None:
    """The holder is cancelled, then its only waiter, in the same loop iteration: the freed slot
    skips the cancelled waiter, which leaves the queue without an error."""
    engine = SimEngine(default=SimProfile(max_batch=1, prefill_base_ms=60_000))
    body = orjson.dumps(chat("m"))
    holder = asyncio.create_task(engine.handle("POST", "/v1/chat/completions", body))
    await until(engine, lambda s: s.running == 1)
    waiter = asyncio.create_task(engine.handle("POST", "/v1/chat/completions", body))
    await until(engine, lambda s: s.waiting == 1)
    holder.cancel()
    waiter.cancel()
    results = await asyncio.gather(holder, waiter, return_exceptions=True)
    assert [type(r) for r in results] == [asyncio.CancelledError, asyncio.CancelledError]
    assert (engine.stats.running, engine.stats.waiting, engine.stats.cancelled) == (0, 0, 2)


# Batched inputs: the context limit, one sequence per prompt, seeded text, batch slots.


def context_error(response: httpx.Response, param: str, limit: int, requested: int) -> None:
    """`response` is OpenAI's context-length 400 for `param`."""
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["code"] == "context_length_exceeded"
    assert error["message"].startswith(
        f"This model's maximum context length is {limit} tokens, however you requested "
        f"{requested} tokens"
    )


async def test_max_input_tokens_rejects_the_whole_request() -> None:
    """One input over the limit fails the request, whatever the others; at the limit is fine."""
    engine = SimEngine({"small": SimProfile(max_input_tokens=5)}, seed=1)
    ok, long = "x" * 20, "x" * 21  # 5 and 6 tokens
    async with sim_client(engine) as client:
        embed_ok = await client.post("/v1/embeddings", json={"model": "small", "input": [ok, ok]})
        embed_bad = await client.post(
            "/v1/embeddings", json={"model": "small", "input": [ok, long, "y"]}
        )
        tokens_bad = await client.post(
            "/v1/embeddings", json={"model": "small", "input": [[1, 2], [1, 2, 3, 4, 5, 6, 7]]}
        )
        prompt_ok = await client.post("/v1/completions", json={"model": "small", "prompt": ok})
        prompt_bad = await client.post(
            "/v1/completions", json={"model": "small", "prompt": ["a", "b", long]}
        )
        streamed_bad = await client.post(
            "/v1/completions", json={"model": "small", "prompt": long, "stream": True}
        )
        chat_bad = await client.post("/v1/chat/completions", json=chat("small", long))
        overridden = await client.post(
            "/v1/embeddings", json={"model": "m@max_input_tokens=50", "input": [ok, "x" * 201]}
        )
        unlimited = await client.post("/v1/embeddings", json={"model": "m", "input": "x" * 9000})
    assert (embed_ok.status_code, prompt_ok.status_code, unlimited.status_code) == (200, 200, 200)
    context_error(embed_bad, "input", 5, 6)
    assert "input 1" in embed_bad.json()["error"]["message"]  # names the culprit
    context_error(tokens_bad, "input", 5, 7)
    context_error(prompt_bad, "prompt", 5, 6)
    assert "prompt 2" in prompt_bad.json()["error"]["message"]
    context_error(streamed_bad, "prompt", 5, 6)
    context_error(chat_bad, "messages", 5, 6)
    context_error(overridden, "input", 50, 51)
    assert engine.stats.requests == 3  # a rejected request is never accepted (nor drawn for)


def test_max_input_tokens_is_a_profile_field() -> None:
    """Settable like any field: in a profile, through `--set` / an override, and unset again."""
    assert SimProfile().max_input_tokens is None
    limited = apply_overrides(SimProfile(), "max_input_tokens=512")  # what --set does
    assert limited.max_input_tokens == 512
    assert apply_overrides(limited, "max_input_tokens=none").max_input_tokens is None
    assert SimProfile.model_validate({"max_input_tokens": "8"}).max_input_tokens == 8
    for bad in (0, -1, "many"):
        with pytest.raises(ValidationError):
            SimProfile.model_validate({"max_input_tokens": bad})
    assert "context_length_exceeded" in (
        SimProfile.model_fields["max_input_tokens"].description or ""
    )


async def test_each_prompt_is_its_own_sequence() -> None:
    """Own length, text and finish reason per prompt; usage sums prompt and generated tokens."""
    engine = SimEngine(default=SimProfile(output_tokens=(2, 30)), seed=4)
    prompts = ["one", "two two", "three three three", "four " * 4]
    async with sim_client(engine) as client:
        response = await client.post(
            "/v1/completions", json={"model": "m", "prompt": prompts, "max_tokens": 20}
        )
    body = response.json()
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    lengths = [len(c["text"].split()) for c in choices]
    assert len(set(lengths)) > 1  # not one plan copied four times
    assert len({c["text"] for c in choices}) > 1
    for choice, length in zip(choices, lengths, strict=True):
        assert 2 <= length <= 20
        if length < 20:
            assert choice["finish_reason"] == "stop"
    assert "length" in {c["finish_reason"] for c in choices}  # this seed draws one over 20
    assert body["usage"] == {
        "prompt_tokens": 1 + 2 + 5 + 5,  # ~chars / 4, rounded up
        "completion_tokens": sum(lengths),
        "total_tokens": 13 + sum(lengths),
    }
    assert (engine.stats.prompt_tokens, engine.stats.generation_tokens) == (13, sum(lengths))
    assert (engine.stats.requests, engine.stats.completed) == (1, 1)


async def test_n_choices_per_prompt() -> None:
    """`n` choices per prompt, indexed prompt * n + j; prompt tokens are counted once."""
    engine = SimEngine(default=SimProfile(output_tokens=3), seed=1)
    async with sim_client(engine) as client:
        response = await client.post(
            "/v1/completions", json={"model": "m", "prompt": ["abcd", "efgh" * 2], "n": 3}
        )
        zero = await client.post("/v1/completions", json={"model": "m", "prompt": "a", "n": 0})
    body = response.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3, 4, 5]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 18, "total_tokens": 21}
    assert zero.status_code == 400
    assert zero.json()["error"]["param"] == "n"


async def completion_texts(
    client: httpx.AsyncClient, prompt: Any, seed: int | None, **extra: Any
) -> list[str]:
    """The choices' texts of one completion request (a stream is joined into one text)."""
    body = {"model": "m", "prompt": prompt, "seed": seed, **extra}
    if extra.get("stream"):
        async with client.stream("POST", "/v1/completions", json=body) as response:
            events = await sse_events(response)
        return ["".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])]
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200
    return [choice["text"] for choice in response.json()["choices"]]


async def test_a_seed_makes_text_a_function_of_seed_and_prompt() -> None:
    """Under a request seed a prompt reads the same alone, in a batch, streamed, on any engine."""
    prompts = ["alpha", "beta", "gamma", "delta"]
    engine = SimEngine(default=SimProfile(output_tokens=(3, 30)), seed=1)
    other = SimEngine(default=SimProfile(output_tokens=(3, 30)), seed=2)
    async with sim_client(engine) as client, sim_client(other) as other_client:
        batch = await completion_texts(client, prompts, 42)
        alone = [(await completion_texts(client, p, 42))[0] for p in reversed(prompts)][::-1]
        listed = [(await completion_texts(other_client, [p], 42))[0] for p in prompts]
        streamed = [(await completion_texts(other_client, p, 42, stream=True))[0] for p in prompts]
        with_n = await completion_texts(client, ["beta"], 42, n=3)
        other_seed = await completion_texts(client, prompts, 43)
        unseeded = [await completion_texts(client, prompts, None) for _ in range(2)]
        token_batch = await completion_texts(client, [[1, 2, 3], [4, 5]], 42)
        token_alone = await completion_texts(other_client, [4, 5], 42)
    assert batch == alone == listed == streamed
    assert len(set(batch)) == len(batch)
    assert with_n[0] == batch[1]  # choice 0 is the n = 1 text; the others differ
    assert len(set(with_n)) == 3
    assert other_seed != batch
    assert unseeded[0] != unseeded[1]  # without a seed the engine's RNG moves on
    assert token_alone == token_batch[1:]


async def test_a_seed_fixes_chat_text_too() -> None:
    texts = []
    for engine_seed in (1, 2):
        engine = SimEngine(default=SimProfile(output_tokens=(3, 30)), seed=engine_seed)
        for stream in (False, True):
            reply = await engine.handle(
                "POST", "/v1/chat/completions", orjson.dumps(chat("m", seed=9, stream=stream))
            )
            if reply.stream is None:
                assert reply.body is not None
                texts.append(orjson.loads(reply.body)["choices"][0]["message"]["content"])
            else:
                frames = [frame async for frame in reply.stream]
                deltas = [orjson.loads(f[6:])["choices"][0]["delta"] for f in frames[1:-2]]
                texts.append("".join(d["content"] for d in deltas))
    assert len(set(texts)) == 1
    bad = await SimEngine().handle(
        "POST", "/v1/chat/completions", orjson.dumps(chat("m", seed="x"))
    )
    assert bad.status == 400


async def test_prompts_take_their_own_batch_slots() -> None:
    """Three prompts on two slots: two run, one queues; leaving cancels all three, once."""
    engine = SimEngine({"two": SimProfile(max_batch=2, prefill_base_ms=60_000)})
    async with sim_client(engine) as client:
        request = asyncio.create_task(
            client.post("/v1/completions", json={"model": "two", "prompt": ["a", "b", "c"]})
        )
        await until(engine, lambda s: (s.requests, s.running, s.waiting) == (1, 2, 1))
        request.cancel()
        await until(engine, lambda s: s.cancelled == 1 and s.running == s.waiting == 0)
        with pytest.raises(asyncio.CancelledError):
            await request
    assert (engine.stats.completed, engine.stats.faults) == (0, 0)


async def test_prompts_run_concurrently_each_with_its_own_prefill() -> None:
    """Four 200 ms prefills in parallel take ~200 ms; one slot runs them one after another, each
    paying for its own prompt's tokens only."""
    loop = asyncio.get_running_loop()
    engine = SimEngine(
        {
            "wide": SimProfile(prefill_base_ms=200),
            "narrow": SimProfile(max_batch=1, prefill_ms_per_token=1.5),
        }
    )
    async with sim_client(engine) as client:

        async def timed(model: str, prompt: list[str]) -> float:
            started = loop.time()
            response = await client.post("/v1/completions", json={"model": model, "prompt": prompt})
            assert response.status_code == 200
            return loop.time() - started

        parallel = await timed("wide", ["a", "b", "c", "d"])
        serial = await timed("narrow", ["x" * 800, "y"])  # 200 and 1 tokens: 300 + 1.5 ms
    assert 0.19 <= parallel < 0.5  # one after another would be 800 ms
    assert 0.29 <= serial < 0.5  # each paying for all 201 tokens would be 603 ms


@pytest.mark.parametrize(
    ("override", "status"),
    [("error_429_rate=1", 429), ("error_500_rate=1", 500), ("inband_error_rate=1", 200)],
)
async def test_faults_stay_per_request(override: str, status: int) -> None:
    engine = SimEngine(default=SimProfile(output_tokens=3))
    async with sim_client(engine) as client:
        response = await client.post(
            "/v1/completions", json={"model": f"m@{override}", "prompt": ["a", "b", "c"]}
        )
    assert response.status_code == status
    assert set(response.json()) == {"error"}
    assert (engine.stats.requests, engine.stats.faults, engine.stats.generation_tokens) == (1, 1, 0)


async def test_a_cut_drops_a_batched_request_once_its_work_is_done() -> None:
    engine = SimEngine(default=SimProfile(output_tokens=3))
    async with sim_client(engine) as client:
        with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)):
            await client.post(
                "/v1/completions", json={"model": "m@cut_rate=1", "prompt": ["a", "b", "c"]}
            )
        with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)):
            await client.post(
                "/v1/completions", json={"model": "m@reset_rate=1", "prompt": ["a", "b", "c"]}
            )
        await until(engine, lambda s: s.faults == 2)
    stats = engine.stats
    assert (stats.requests, stats.completed, stats.running, stats.generation_tokens) == (2, 0, 0, 9)


async def test_embeddings_calls_share_the_batch_slots() -> None:
    """`max_batch: 4` runs four embeddings calls at once; a fifth waits for a slot to free."""
    engine = SimEngine({"e": SimProfile(max_batch=4, embed_base_ms=150, embed_ms_per_input=25)})
    loop = asyncio.get_running_loop()
    async with sim_client(engine) as client:

        async def timed() -> float:
            started = loop.time()
            response = await client.post("/v1/embeddings", json={"model": "e", "input": ["a", "b"]})
            assert response.status_code == 200
            return loop.time() - started

        calls = [asyncio.create_task(timed()) for _ in range(5)]
        await until(engine, lambda s: (s.running, s.waiting) == (4, 1))
        durations = sorted(await asyncio.gather(*calls))
    assert durations[-1] >= 2 * 0.2 - 0.02  # two rounds of 150 + 2 * 25 ms
    assert durations[0] < durations[-1]
    assert (engine.stats.completed, engine.stats.running, engine.stats.waiting) == (5, 0, 0)


# vLLM's /metrics.


def family_names(page: str) -> set[str]:
    return {line.split()[2] for line in page.splitlines() if line.startswith("# TYPE ")}


def sample(page: str, prefix: str) -> float:
    """The value of the one sample line that starts with `prefix` (name and labels)."""
    found = [line.rsplit(" ", 1)[1] for line in page.splitlines() if line.startswith(prefix)]
    assert len(found) == 1, (prefix, found)
    return float(found[0])


async def test_metrics_follow_the_queue_under_load() -> None:
    """running / waiting on the page are the engine's own counts; aborts show when clients go."""
    engine = SimEngine(
        {"q": SimProfile(max_batch=2, tokens_per_s=5, output_tokens=1000, kv_tokens_per_seq=100)}
    )
    async with sim_client(engine, timeout=WATCHDOG_S) as client:
        gone = asyncio.Event()

        async def hold() -> None:
            # A stream the client keeps open without reading on: it holds its slot or its place.
            async with client.stream(
                "POST", "/v1/chat/completions", json=chat("q", "x" * 40, stream=True)
            ):
                await gone.wait()

        holders = [asyncio.create_task(hold()) for _ in range(5)]
        await until(engine, lambda s: s.running == 2 and s.waiting == 3)
        response = await client.get("/metrics")
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
        page = response.text
        load = parse_metrics(page)
        assert (load.running, load.waiting) == (engine.stats.running, engine.stats.waiting)
        assert (load.running, load.waiting) == (2.0, 3.0)
        assert parse_metrics(page, model="q").waiting == 3.0
        # Two running sequences hold their 10-token prompts plus what they generated so far, of
        # 2 x 100 tokens of room.
        assert load.kv_usage is not None and 20 / 200 <= load.kv_usage <= 1.0
        assert sample(page, 'vllm:num_requests_running{model_name="q",engine="0"}') == 2.0

        gone.set()
        await asyncio.gather(*holders)
        await until(engine, lambda s: s.cancelled == 5 and s.running == 0)
        page = (await client.get("/metrics")).text
    load = parse_metrics(page)
    assert (load.running, load.waiting, load.kv_usage) == (0.0, 0.0, 0.0)
    labels = 'model_name="q",engine="0"'
    assert sample(page, f'vllm:request_success_total{{{labels},finished_reason="abort"}}') == 5
    assert sample(page, f'vllm:request_success_total{{{labels},finished_reason="stop"}}') == 0
    assert load.ttft.count == 2  # only the two that got a slot made a first token
    assert sample(page, f"vllm:e2e_request_latency_seconds_count{{{labels}}}") == 0


async def test_metrics_histograms_and_counters_of_finished_requests() -> None:
    """TTFT from arrival (queue included) in vLLM's buckets; one inter-token interval per
    token after the first; e2e and the finish reasons; token counters match the engine's."""
    profile = SimProfile(max_batch=1, prefill_base_ms=30, tokens_per_s=50, output_tokens=4)
    engine = SimEngine({"h": profile})
    async with sim_client(engine, timeout=WATCHDOG_S) as client:
        replies = await asyncio.gather(
            client.post("/v1/chat/completions", json=chat("h")),
            client.post("/v1/chat/completions", json=chat("h", stream=True)),
            client.post("/v1/chat/completions", json=chat("h", max_tokens=2)),
        )
        assert [r.status_code for r in replies] == [200, 200, 200]
        page = (await client.get("/metrics")).text
    load = parse_metrics(page, model="h")
    labels = 'model_name="h",engine="0"'
    # One slot: the second and third queue behind the first (~90 ms each), so TTFTs spread out.
    assert load.ttft.count == 3
    assert load.ttft.total >= 0.03 + 0.12 + 0.21 - 0.01
    buckets = dict(load.ttft.buckets)
    assert set(buckets) == {*SIM_TTFT_BUCKETS, math.inf}
    assert buckets[0.02] == 0  # nothing beats the 30 ms prefill
    assert buckets[math.inf] == 3
    assert load.tpot.count == 3 + 3 + 1  # 4, 4 and 2 tokens: n - 1 intervals each
    assert load.tpot.quantile(0.5) == 0.025  # a 20 ms step lands in vLLM's 25 ms bucket
    assert sample(page, f"vllm:e2e_request_latency_seconds_count{{{labels}}}") == 3
    assert sample(page, f'vllm:request_success_total{{{labels},finished_reason="stop"}}') == 2
    assert sample(page, f'vllm:request_success_total{{{labels},finished_reason="length"}}') == 1
    assert sample(page, f"vllm:prompt_tokens_total{{{labels}}}") == engine.stats.prompt_tokens
    assert sample(page, f"vllm:generation_tokens_total{{{labels}}}") == 10
    assert engine.stats.generation_tokens == 10
    names = family_names(page)
    assert {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:request_success",
    } <= names
    assert not names & {"vllm:gpu_cache_usage_perc", "vllm:time_per_output_token_seconds"}


SIM_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip


async def test_metrics_label_every_model_name_served_or_seen() -> None:
    """Profile names from the start (vLLM's served names), then each name requested, with
    `name@overrides` counted under `name`; the gateway can read one model's series."""
    engine = SimEngine({"a": SimProfile(), "b": SimProfile()}, SimProfile(output_tokens=3))
    async with sim_client(engine) as client:
        before = (await client.get("/metrics")).text
        for model in ("b", "b@output_tokens=5", "other"):
            response = await client.post("/v1/chat/completions", json=chat(model))
            assert response.status_code == 200
        after = (await client.get("/metrics")).text
    assert 'model_name="a",engine="0"' in before and 'model_name="other"' not in before
    assert parse_metrics(before).ttft.count == 0
    assert parse_metrics(after, model="b").ttft.count == 2
    assert parse_metrics(after, model="other").ttft.count == 1
    assert parse_metrics(after, model="a").ttft.count == 0
    assert parse_metrics(after).ttft.count == 3
    assert 'model_name="b@' not in after


async def test_metrics_count_embeddings_and_batched_prompts() -> None:
    engine = SimEngine(default=SimProfile(output_tokens=2))
    async with sim_client(engine) as client:
        embedded = await client.post("/v1/embeddings", json={"model": "e", "input": ["ab", "cd"]})
        completed = await client.post(
            "/v1/completions", json={"model": "c", "prompt": ["one", "two"], "n": 2}
        )
        assert (embedded.status_code, completed.status_code) == (200, 200)
        page = (await client.get("/metrics")).text
    assert sample(page, 'vllm:prompt_tokens_total{model_name="e",engine="0"}') == 2
    stop = 'vllm:request_success_total{model_name="e",engine="0",finished_reason="stop"}'
    assert sample(page, stop) == 1
    assert parse_metrics(page, model="e").ttft.count == 0  # no token is generated
    assert parse_metrics(page, model="c").ttft.count == 4  # one per sequence (prompt x n)
    assert sample(page, 'vllm:generation_tokens_total{model_name="c",engine="0"}') == 8


@pytest.mark.parametrize(
    ("names", "present", "absent"),
    [
        (
            "legacy",
            {"vllm:gpu_cache_usage_perc", "vllm:time_per_output_token_seconds"},
            {"vllm:kv_cache_usage_perc", "vllm:inter_token_latency_seconds"},
        ),
        (
            "both",
            {
                "vllm:gpu_cache_usage_perc",
                "vllm:time_per_output_token_seconds",
                "vllm:kv_cache_usage_perc",
                "vllm:inter_token_latency_seconds",
            },
            set(),
        ),
    ],
)
async def test_metrics_under_the_older_names(
    names: str, present: set[str], absent: set[str]
) -> None:
    """`metrics_names: legacy` serves the deprecated names instead; the gateway reads them."""
    profile = apply_overrides(
        SimProfile(max_batch=1, tokens_per_s=100, output_tokens=3), f"metrics_names={names}"
    )
    engine = SimEngine(default=profile)
    async with sim_client(engine, timeout=WATCHDOG_S) as client:
        async with client.stream(
            "POST", "/v1/chat/completions", json=chat("m", stream=True)
        ) as response:
            async for _ in response.aiter_lines():
                pass
        page = (await client.get("/metrics")).text
    assert present <= family_names(page)
    assert not absent & family_names(page)
    load = parse_metrics(page)
    assert load.kv_usage == 0.0  # read from gpu_cache_usage_perc when that is all there is
    assert load.tpot.count == 2 and load.tpot.quantile(0.99) == 0.01


async def test_metrics_faults() -> None:
    """`metrics_fault`: `error` answers 500, `garbage` 200 with a page that is not Prometheus
    text; both are set from the profile or switched on the running engine."""
    engine = SimEngine(default=SimProfile(metrics_fault="error"))
    async with sim_client(engine) as client:
        failed = await client.get("/metrics")
        engine.metrics_fault = "garbage"
        garbage = await client.get("/metrics")
        engine.metrics_fault = "none"
        good = await client.get("/metrics")
        wrong_method = await client.post("/metrics", content=b"")
    assert failed.status_code == 500
    assert garbage.status_code == 200
    with pytest.raises(ValueError):
        parse_metrics(garbage.text)
    assert good.status_code == 200
    assert parse_metrics(good.text).running == 0
    assert wrong_method.status_code == 405


def test_metrics_options_are_profile_fields() -> None:
    assert SimProfile().metrics_names == "current"
    assert apply_overrides(SimProfile(), "metrics_fault=garbage").metrics_fault == "garbage"
    with pytest.raises(ValidationError):
        SimProfile.model_validate({"metrics_names": "v0"})
    with pytest.raises(ValueError):
        apply_overrides(SimProfile(), "kv_tokens_per_seq=0")

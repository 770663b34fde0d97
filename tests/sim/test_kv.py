"""The simulator's KV cache as a limit (`kv_cache_tokens`): admission, preemption by a growing
sequence or a better arrival, on a simulated server served for real on loopback.

Prompts are token-id arrays, so every count here is exact: a sequence holds its prompt plus the
tokens it has made, and is admitted when its prompt plus one (its prefill's token) fits.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson
import pytest

from gateway.latency.vllm import parse_metrics
from tests.sim_server import LABELS, WATCHDOG_S, sim, until

SLOW = "m@tokens_per_s=1,output_tokens=1000"  # holds its KV, growing one token a second
LONG = "m@output_tokens=50"
KV = {"kv_cache_tokens": 100, "max_batch": 4, "tokens_per_s": 100, "output_tokens": 30}


def body(model: str, prompt_tokens: int, priority: int | None = None) -> dict[str, Any]:
    extra = {} if priority is None else {"priority": priority}
    return {"model": model, "prompt": [7] * prompt_tokens, **extra}


async def usage(client: httpx.AsyncClient) -> float:
    value = parse_metrics((await client.get("/metrics")).text).kv_usage
    assert value is not None
    return value


def metric(page: str, prefix: str) -> float:
    found = [line.rsplit(" ", 1)[1] for line in page.splitlines() if line.startswith(prefix)]
    assert len(found) == 1, (prefix, found)
    return float(found[0])


class Stream:
    """A streamed completion read as it comes: each token's arrival time, its finish, usage."""

    def __init__(self, client: httpx.AsyncClient, request: dict[str, Any]) -> None:
        self.times: list[float] = []
        self.finish: str | None = None
        self.completion_tokens: int | None = None
        self.first = asyncio.Event()  # set once the first token has arrived
        body = {**request, "stream": True, "stream_options": {"include_usage": True}}
        self.task = asyncio.create_task(self._read(client, body))

    async def _read(self, client: httpx.AsyncClient, request: dict[str, Any]) -> None:
        loop = asyncio.get_running_loop()
        async with client.stream("POST", "/v1/completions", json=request) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = orjson.loads(line[6:])
                if event["usage"] is not None:
                    self.completion_tokens = event["usage"]["completion_tokens"]
                for choice in event["choices"]:
                    if choice["text"]:
                        self.times.append(loop.time())
                        self.first.set()
                    self.finish = choice["finish_reason"] or self.finish

    async def started(self) -> None:
        async with asyncio.timeout(WATCHDOG_S):
            await self.first.wait()

    async def done(self) -> None:
        async with asyncio.timeout(WATCHDOG_S):
            await self.task

    async def cancel(self) -> None:
        self.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self.task


@pytest.mark.parametrize(
    ("policy", "priority", "held_back"),
    [("fcfs", None, True), ("priority", 0, True), ("priority", -1, False)],
)
async def test_a_prompt_that_does_not_fit_waits_and_holds_back_the_queue_behind_it(
    policy: str, priority: int | None, held_back: bool
) -> None:
    """With slots free, a prompt that does not fit in the free KV waits until a sequence leaves;
    a small one behind it waits too (vLLM does not skip ahead), unless under `priority` it ranks
    before it. The usage gauge is the held tokens over `kv_cache_tokens`."""
    async with sim(**KV, scheduling_policy=policy) as (engine, client):
        holder = Stream(client, body(SLOW, 60))
        await holder.started()
        assert await usage(client) == 0.61  # 60 prompt tokens and its first token, over 100
        blocked = asyncio.create_task(client.post("/v1/completions", json=body("m", 50)))
        await until(engine, lambda s: s.waiting == 1)
        assert engine.stats.running == 1  # three slots free: the KV cache is what it waits for
        small = asyncio.create_task(
            client.post("/v1/completions", json=body("m@output_tokens=1", 10, priority))
        )
        if held_back:
            await until(engine, lambda s: s.waiting == 2)
            assert engine.stats.running == 1
        else:
            async with asyncio.timeout(WATCHDOG_S):
                assert (await small).status_code == 200
            assert (engine.stats.running, engine.stats.waiting) == (1, 1)
        await holder.cancel()
        async with asyncio.timeout(WATCHDOG_S):
            replies = await asyncio.gather(blocked, small)
        await until(engine, lambda s: s.running == 0)
        after = await usage(client)
    assert [r.status_code for r in replies] == [200, 200]
    assert replies[0].json()["usage"]["completion_tokens"] == 30
    assert (engine.stats.completed, engine.stats.cancelled, engine.stats.preemptions) == (2, 1, 0)
    assert after == 0.0


@pytest.mark.parametrize(
    ("policy", "priorities", "victim"),
    [("fcfs", (None, None), 1), ("priority", (5, 0), 0)],
)
async def test_decode_growth_preempts_the_latest_arrival_or_the_lowest_priority(
    policy: str, priorities: tuple[int | None, int | None], victim: int
) -> None:
    """Two sequences of 30 + 50 tokens outgrow a cache of 100 (the second is admitted while the
    first holds under 69): under fcfs the later arrival is preempted, under `priority` the lower
    priority though it came first. The other decodes on; the victim waits until it is done
    (its 31 + made never fit beside it), prefills again and sends every token."""
    async with sim(**KV, scheduling_policy=policy) as (engine, client):
        first = Stream(client, body(LONG, 30, priorities[0]))
        await first.started()
        second = Stream(client, body(LONG, 30, priorities[1]))
        await until(engine, lambda s: s.preemptions == 1)
        assert (engine.stats.running, engine.stats.waiting) == (1, 1)
        during = await usage(client)
        for stream in (first, second):
            await stream.done()
        page = (await client.get("/metrics")).text
    lost, kept = (first, second) if victim == 0 else (second, first)
    for stream in (lost, kept):
        assert (len(stream.times), stream.completion_tokens, stream.finish) == (50, 50, "stop")
    # The survivor finished while the victim waited: many of the victim's tokens came after.
    assert sum(t < kept.times[-1] for t in lost.times) < 40
    assert 0.0 <= during <= 1.0
    assert metric(page, f"vllm:num_preemptions_total{{{LABELS}}}") == 1
    assert parse_metrics(page).kv_usage == 0.0
    assert (engine.stats.completed, engine.stats.preemptions) == (2, 1)
    assert (engine.stats.running, engine.stats.waiting) == (0, 0)


async def test_a_better_arrival_preempts_strictly_lower_priorities_only_to_make_room() -> None:
    """An equal priority waits; a better arrival preempts the lowest-priority latest arrival and
    no more than it needs; one that all the lower ones could not make room for waits, preempting
    nobody, and is the first seated when room frees."""
    async with sim(**KV, scheduling_policy="priority", priority_preemption="max_num_seqs") as (
        engine,
        client,
    ):
        low = [Stream(client, body(SLOW, 30, 5))]
        await low[0].started()
        low.append(Stream(client, body(SLOW, 30, 5)))
        await low[1].started()  # they hold 31 + 31
        peer = asyncio.create_task(
            client.post("/v1/completions", json=body("m@output_tokens=1", 40, 5))
        )
        await until(engine, lambda s: s.waiting == 1)
        assert engine.stats.preemptions == 0
        high = Stream(client, body(SLOW, 60, 0))
        await until(engine, lambda s: s.preemptions == 1)
        await high.started()
        assert (engine.stats.running, engine.stats.waiting) == (2, 2)  # the later low one went
        # 8 free, and the one lower sequence's 31 would not make room for 46.
        middle = asyncio.create_task(
            client.post("/v1/completions", json=body("m@output_tokens=1", 45, 1))
        )
        await until(engine, lambda s: s.waiting == 3)
        assert (engine.stats.running, engine.stats.preemptions) == (2, 1)
        await high.cancel()
        async with asyncio.timeout(WATCHDOG_S):
            assert (await middle).status_code == 200
        assert engine.stats.completed == 1  # the better one went first, the others still wait
        for stream in low:
            await stream.cancel()
        async with asyncio.timeout(WATCHDOG_S):
            assert (await peer).status_code == 200
        await until(engine, lambda s: s.running == 0)
    assert (engine.stats.completed, engine.stats.cancelled, engine.stats.preemptions) == (2, 3, 1)
    assert engine.stats.waiting == 0


async def test_as_vllm_v1_a_better_arrival_waits_for_room_and_preempts_nobody() -> None:
    """vLLM V1 (`priority_preemption: kv_cache`): a waiting request never preempts, even when
    running sequences of a lower priority hold the room it needs; it waits at the head of the
    queue (nobody behind it goes first) and is seated once room frees."""
    async with sim(**KV, scheduling_policy="priority") as (engine, client):
        low = [Stream(client, body(SLOW, 30, 5))]
        await low[0].started()
        low.append(Stream(client, body(SLOW, 30, 5)))
        await low[1].started()  # they hold 31 + 31: 38 free
        high = asyncio.create_task(
            client.post("/v1/completions", json=body("m@output_tokens=1", 60, 0))
        )
        await until(engine, lambda s: s.waiting == 1)
        behind = asyncio.create_task(
            client.post("/v1/completions", json=body("m@output_tokens=1", 5, 5))
        )
        await until(engine, lambda s: s.waiting == 2)
        assert (engine.stats.running, engine.stats.preemptions) == (2, 0)
        await low[1].cancel()
        async with asyncio.timeout(WATCHDOG_S):
            assert (await high).status_code == 200
            assert (await behind).status_code == 200
        await low[0].cancel()
        await until(engine, lambda s: s.running == 0)
    assert (engine.stats.completed, engine.stats.cancelled, engine.stats.preemptions) == (2, 2, 0)


async def test_a_prompt_larger_than_the_cache_runs_alone_and_the_gauge_stays_at_one() -> None:
    """A prompt that could never fit waits for an empty cache, then runs alone rather than
    forever; the usage gauge reads at most 1."""
    async with sim(**KV) as (engine, client):
        holder = Stream(client, body(SLOW, 10))
        await holder.started()
        huge = Stream(client, body("m@tokens_per_s=5,output_tokens=3", 150))
        await until(engine, lambda s: s.waiting == 1)
        await holder.cancel()
        await huge.started()
        during = await usage(client)
        await huge.done()
    assert during == 1.0
    assert (len(huge.times), huge.finish) == (3, "stop")
    assert engine.stats.preemptions == 0


@pytest.mark.parametrize("model", ["m", "m@kv_cache_tokens=none"])
async def test_without_the_key_the_kv_cache_limits_nothing(model: str) -> None:
    """Unset (or `none`), the cache only scales the gauge: prompts far beyond it run together,
    none waits or is preempted, and the gauge is capped at 1."""
    async with sim(max_batch=2, kv_tokens_per_seq=10, tokens_per_s=100, output_tokens=30) as (
        engine,
        client,
    ):
        streams = [Stream(client, body(model, 50)) for _ in range(2)]
        for stream in streams:
            await stream.started()
        assert (engine.stats.running, engine.stats.waiting) == (2, 0)
        during = await usage(client)
        for stream in streams:
            await stream.done()
    assert during == 1.0
    assert [len(s.times) for s in streams] == [30, 30]
    assert engine.stats.preemptions == 0


async def test_embeddings_wait_for_room_in_the_kv_cache() -> None:
    """An embeddings input takes KV like a prompt: one that does not fit waits for room."""
    async with sim(**KV) as (engine, client):
        holder = Stream(client, body(SLOW, 80))
        await holder.started()
        embedding = asyncio.create_task(
            client.post("/v1/embeddings", json={"model": "m", "input": [7] * 30})
        )
        await until(engine, lambda s: s.waiting == 1)
        await holder.cancel()
        async with asyncio.timeout(WATCHDOG_S):
            assert (await embedding).status_code == 200
    assert (engine.stats.completed, engine.stats.preemptions) == (1, 0)

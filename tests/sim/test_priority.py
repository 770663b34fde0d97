"""The simulator's priority scheduling (vLLM's `--scheduling-policy priority`) and preemption,
on a simulated server served for real on loopback."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson
import pytest

from gateway.latency.vllm import parse_metrics
from gateway.sim.engine import SimEngine
from tests.sim_server import LABELS, WATCHDOG_S, chat, sim, until


def metric(page: str, prefix: str) -> float:
    found = [line.rsplit(" ", 1)[1] for line in page.splitlines() if line.startswith(prefix)]
    assert len(found) == 1, (prefix, found)
    return float(found[0])


class Stream:
    """A streamed chat read as it comes: each content token's arrival time, and every event."""

    def __init__(self, client: httpx.AsyncClient, body: dict[str, Any], *, mark: int = 1) -> None:
        self.times: list[float] = []
        self.events: list[Any] = []
        self.marked = asyncio.Event()  # set once `mark` content tokens have arrived
        self._mark = mark
        self.task = asyncio.create_task(self._read(client, {**body, "stream": True}))

    async def _read(self, client: httpx.AsyncClient, body: dict[str, Any]) -> None:
        loop = asyncio.get_running_loop()
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                event = data if data == "[DONE]" else orjson.loads(data)
                self.events.append(event)
                choices = event["choices"] if isinstance(event, dict) else None
                if choices and choices[0]["delta"].get("content"):
                    self.times.append(loop.time())
                    if len(self.times) == self._mark:
                        self.marked.set()

    async def done(self) -> list[Any]:
        async with asyncio.timeout(WATCHDOG_S):
            await self.task
        return self.events


async def _order(engine: SimEngine, client: httpx.AsyncClient, priorities: list[int]) -> list[int]:
    """Queue one request per priority behind a holder of the only slot, in that order, then let
    the holder go: the order in which they are served (each prefills for 30 ms alone)."""
    holder = Stream(client, chat("m@tokens_per_s=5,output_tokens=1000"))
    await until(engine, lambda s: s.running == 1)
    served: list[int] = []

    async def one(i: int, priority: int) -> None:
        body = chat(priority=priority) if priority else chat()
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        served.append(i)

    tasks = []
    for i, priority in enumerate(priorities):
        tasks.append(asyncio.create_task(one(i, priority)))
        await until(engine, lambda s, queued=i + 1: s.waiting == queued)
    holder.task.cancel()
    async with asyncio.timeout(WATCHDOG_S):
        await asyncio.gather(*tasks)
    with pytest.raises(asyncio.CancelledError):
        await holder.task
    return served


async def test_the_waiting_queue_is_ordered_by_priority_then_arrival() -> None:
    """A lower value first, equal ones by arrival; none of them preempts the holder, whose
    priority (0) is better than or equal to theirs."""
    async with sim(
        scheduling_policy="priority", max_batch=1, prefill_base_ms=30, output_tokens=1
    ) as (engine, client):
        served = await _order(engine, client, [5, 1, 3, 1, 0])
        page = (await client.get("/metrics")).text
    assert served == [4, 1, 3, 2, 0]
    assert engine.stats.preemptions == 0
    assert metric(page, f"vllm:num_preemptions_total{{{LABELS}}}") == 0
    assert (engine.stats.running, engine.stats.waiting) == (0, 0)


async def test_fcfs_serves_in_arrival_order_and_never_preempts() -> None:
    async with sim(max_batch=1, prefill_base_ms=30, output_tokens=1) as (engine, client):
        served = await _order(engine, client, [0, 0, 0])
    assert served == [0, 1, 2]
    assert engine.stats.preemptions == 0


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", chat()),
        ("/v1/completions", {"model": "m", "prompt": "a"}),
        ("/v1/embeddings", {"model": "m", "input": "a"}),
    ],
)
async def test_priority_is_refused_under_fcfs_and_a_bad_one_everywhere(
    path: str, body: dict[str, Any]
) -> None:
    """Under fcfs a non-zero priority is a 400 naming it, with vLLM's words; 0 is accepted. A
    priority that is not an integer is a 400 naming it under either policy."""
    async with sim() as (engine, client):
        refused = await client.post(path, json={**body, "priority": 3})
        zero = await client.post(path, json={**body, "priority": 0})
        bad = await client.post(path, json={**body, "priority": "high"})
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == "priority"
    assert error["message"] == "Got priority 3 but Priority scheduling is not enabled."
    assert zero.status_code == 200
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
    assert engine.stats.requests == 1  # the refused ones never counted as requests
    async with sim(scheduling_policy="priority") as (engine, client):
        answers = [
            await client.post(path, json={**body, "priority": value})
            for value in (3, -2, 1.5, True, "1")
        ]
    assert [a.status_code for a in answers] == [200, 200, 400, 400, 400]
    assert {a.json()["error"]["param"] for a in answers[2:]} == {"priority"}


PREEMPTIVE: dict[str, Any] = {
    "scheduling_policy": "priority",
    "priority_preemption": "max_num_seqs",
    "max_batch": 1,
    "prefill_base_ms": 100,
    "tokens_per_s": 100,  # 10 ms a step
    "output_tokens": 20,
}


async def test_an_interactive_request_preempts_a_running_bulk_stream() -> None:
    """The interactive request takes the slot at once and gets its first token while the
    victim waits; the victim's stream pauses, then resumes after a second prefill and completes
    with every token; the counters return to rest."""
    async with sim(**PREEMPTIVE) as (engine, client):
        victim = Stream(client, chat(priority=5, stream_options={"include_usage": True}), mark=5)
        async with asyncio.timeout(WATCHDOG_S):
            await victim.marked.wait()
        interactive = Stream(client, chat())
        await until(engine, lambda s: s.preemptions == 1)
        assert (engine.stats.running, engine.stats.waiting) == (1, 1)
        during = (await client.get("/metrics")).text
        async with asyncio.timeout(WATCHDOG_S):
            await interactive.marked.wait()
        assert engine.stats.waiting == 1  # its first token came while the victim waited
        await interactive.done()
        events = await victim.done()
        after = (await client.get("/metrics")).text
    assert len(interactive.times) == 20
    # The victim sent every token once, in order, and said so in its usage.
    contents = [e["choices"][0]["delta"].get("content") for e in events[1:-3]]
    assert len(contents) == 20 and all(contents)
    assert events[-3]["choices"][0]["finish_reason"] == "stop"
    assert events[-2]["usage"]["completion_tokens"] == 20
    assert events[-1] == "[DONE]"
    # Paused from the preemption until the interactive one was done, then a whole prefill more.
    resumed = next(t for t in victim.times if t > interactive.times[-1])
    assert resumed - interactive.times[-1] >= 0.08
    assert victim.times[-1] > interactive.times[-1]
    assert metric(during, f"vllm:num_requests_running{{{LABELS}}}") == 1
    assert metric(during, f"vllm:num_requests_waiting{{{LABELS}}}") == 1
    assert metric(after, f"vllm:num_preemptions_total{{{LABELS}}}") == 1
    assert "# TYPE vllm:num_preemptions counter" in after
    load = parse_metrics(after)
    assert (load.running, load.waiting, load.kv_usage) == (0.0, 0.0, 0.0)
    assert (engine.stats.completed, engine.stats.preemptions) == (2, 1)
    assert metric(after, f"vllm:generation_tokens_total{{{LABELS}}}") == 40


async def test_as_vllm_v1_a_better_request_waits_for_a_slot_instead_of_preempting() -> None:
    """vLLM V1 (`priority_preemption: kv_cache`, the default): with every slot taken by bulk, an
    interactive request preempts nothing; it waits at the head of the queue, ahead of bulk that
    came earlier, and gets the slot when the running sequence ends."""
    profile = {**PREEMPTIVE, "priority_preemption": "kv_cache"}
    async with sim(**profile) as (engine, client):
        running = Stream(client, chat(priority=5), mark=2)
        async with asyncio.timeout(WATCHDOG_S):
            await running.marked.wait()
        queued = Stream(client, chat(priority=5))
        await until(engine, lambda s: s.waiting == 1)
        interactive = Stream(client, chat())
        await until(engine, lambda s: s.waiting == 2)
        during = (await client.get("/metrics")).text
        assert (engine.stats.running, engine.stats.preemptions) == (1, 0)
        await interactive.done()
        await running.done()
        await queued.done()
        after = (await client.get("/metrics")).text
    assert metric(during, f"vllm:num_requests_running{{{LABELS}}}") == 1
    assert metric(during, f"vllm:num_requests_waiting{{{LABELS}}}") == 2
    # Its first token came only once the running sequence had ended, and before the earlier bulk.
    assert interactive.times[0] > running.times[-1]
    assert interactive.times[-1] < queued.times[0]
    assert len(running.times) == 20  # never paused for a recompute
    assert metric(after, f"vllm:num_preemptions_total{{{LABELS}}}") == 0
    assert (engine.stats.completed, engine.stats.preemptions) == (3, 0)


async def test_an_equal_priority_waits_and_the_latest_arrival_is_preempted() -> None:
    """Two choices of one bulk request run in both slots; a request of the same priority waits,
    a better one preempts the later choice (the latest arrival); the non-streamed bulk answer
    still has every token of both choices."""
    profile = {**PREEMPTIVE, "max_batch": 2}
    async with sim(**profile) as (engine, client):
        bulk = asyncio.create_task(client.post("/v1/chat/completions", json=chat(priority=5, n=2)))
        await until(engine, lambda s: s.running == 2)
        peer = asyncio.create_task(
            client.post("/v1/chat/completions", json=chat(priority=5, max_tokens=1))
        )
        await until(engine, lambda s: s.waiting == 1)
        assert engine.stats.preemptions == 0
        urgent = asyncio.create_task(client.post("/v1/chat/completions", json=chat(priority=1)))
        await until(engine, lambda s: s.preemptions == 1)
        assert (engine.stats.running, engine.stats.waiting) == (2, 2)
        async with asyncio.timeout(WATCHDOG_S):
            bulk_reply, peer_reply, urgent_reply = await asyncio.gather(bulk, peer, urgent)
    assert [r.status_code for r in (bulk_reply, peer_reply, urgent_reply)] == [200] * 3
    answer = bulk_reply.json()
    assert answer["usage"]["completion_tokens"] == 40
    assert [len(c["message"]["content"].split()) for c in answer["choices"]] == [20, 20]
    assert (engine.stats.running, engine.stats.waiting, engine.stats.completed) == (0, 0, 3)


async def test_cancelling_a_preempted_or_waiting_victim_frees_everything() -> None:
    """A preempted stream whose client leaves, and a bulk request that only ever waited, give
    up their places; the interactive request is served and the pool ends empty."""
    # The victim's answer is long (10 s): on a busy machine it must still be running when the
    # interactive request arrives; the interactive one is short.
    async with sim(**{**PREEMPTIVE, "output_tokens": 1000}) as (engine, client):
        victim = Stream(client, chat(priority=5), mark=2)
        async with asyncio.timeout(WATCHDOG_S):
            await victim.marked.wait()
        interactive = Stream(client, chat(max_tokens=30))
        await until(engine, lambda s: s.preemptions == 1 and s.waiting == 1)
        queued = asyncio.create_task(client.post("/v1/chat/completions", json=chat(priority=9)))
        await until(engine, lambda s: s.waiting == 2)
        victim.task.cancel()
        await until(engine, lambda s: s.cancelled == 1 and s.waiting == 1)
        queued.cancel()
        await until(engine, lambda s: s.cancelled == 2 and s.waiting == 0)
        await interactive.done()
        await until(engine, lambda s: s.completed == 1 and s.running == 0)
        page = (await client.get("/metrics")).text
    for task in (victim.task, queued):
        with pytest.raises(asyncio.CancelledError):
            await task
    load = parse_metrics(page)
    assert (load.running, load.waiting, load.kv_usage) == (0.0, 0.0, 0.0)
    assert metric(page, f'vllm:request_success_total{{{LABELS},finished_reason="abort"}}') == 2
    assert engine.stats.preemptions == 1

"""The bulk admission gate: its AIMD steering, weights and capacity driven by hand (a fake
clock), and its reaction to a real simulated vLLM server's queue."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway.batching import BulkGate
from gateway.batching.gate import Upstream
from gateway.config import BulkSpec, Settings
from gateway.errors import OverloadedError
from gateway.latency.vllm import Histogram, ServerLoad, ServerState
from gateway.sim.profile import SimProfile
from tests.batching.test_batching import BULK
from tests.conftest import gateway_settings, run_gateway
from tests.routing.test_vllm_routing import MAX_BATCH, WATCHDOG_S, Sim, ask, served_well, sims, vllm
from tests.timing import eventually


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def gate(clock: Clock, **spec: object) -> BulkGate:
    settings = {"initial_concurrency": 4, "max_concurrency": 16, "max_queue": 2, **spec}
    return BulkGate(BulkSpec.model_validate(settings), clock=clock)


def test_slow_interactive_first_tokens_halve_the_limit_once_per_episode() -> None:
    """An interactive TTFT above 80% of its budget halves the bulk limit; a burst of such
    samples within the cooldown counts once; the limit never drops below the minimum."""
    clock = Clock()
    g = gate(clock)
    g.observe("d", 0.9, 1.0)
    assert g.limits() == {"d": 2}
    g.observe("d", 0.95, 1.0)  # same episode
    assert g.limits() == {"d": 2}
    for _ in range(5):
        clock.now += 1
        g.observe("d", 0.9, 1.0)
    assert g.limits() == {"d": 1}


async def test_headroom_grows_the_limit_only_while_bulk_waits() -> None:
    """Fast interactive first tokens add one slot at a time, and only when bulk requests are
    waiting for one (an unused limit does not grow without bound)."""
    clock = Clock()
    g = gate(clock, initial_concurrency=1)
    g.observe("d", 0.1, 1.0)
    assert g.limits() == {"d": 1}  # nobody waiting
    await g.acquire("d")
    waiting = asyncio.create_task(g.acquire("d"))
    await asyncio.sleep(0)
    assert g.waiting() == {"d": 1}
    clock.now += 1
    g.observe("d", 0.1, 1.0)
    await asyncio.wait_for(waiting, 1)  # the new slot went to the waiting request
    assert g.limits() == {"d": 2}


async def test_the_waiting_line_is_bounded_and_slots_pass_on() -> None:
    """Beyond max_queue waiting bulk requests the gate answers 503; a released slot goes to
    the first in line; a waiter that gives up leaves the line."""
    clock = Clock()
    g = gate(clock, initial_concurrency=1)
    g.observe("d", 0.5, 1.0)  # interactive traffic present: no idle growth
    await g.acquire("d")
    first = asyncio.create_task(g.acquire("d"))
    second = asyncio.create_task(g.acquire("d"))
    await asyncio.sleep(0)
    with pytest.raises(OverloadedError):
        await g.acquire("d")
    assert g.rejected == 1
    second.cancel()
    g.release("d")
    await asyncio.wait_for(first, 1)
    assert g.waiting() == {"d": 0}


async def test_no_interactive_traffic_lets_bulk_use_the_capacity() -> None:
    """With no interactive first token for a second, waiting bulk requests grow the limit."""
    clock = Clock()
    g = gate(clock, initial_concurrency=1)
    await g.acquire("d")
    waiting = asyncio.create_task(g.acquire("d"))
    await asyncio.sleep(0)
    clock.now += 2
    third = asyncio.create_task(g.acquire("d"))
    await asyncio.wait_for(waiting, 1)
    assert g.limits()["d"] >= 2
    third.cancel()


# --- weights, capacity and the server's load (an injectable clock; a ServerState fed by hand) ---


def server(clock: Clock, *, slots: float | None = None, waiting: float = 0.0) -> ServerState:
    state = ServerState("http://sim/metrics", 1.0, slots=slots, clock=clock)
    scrape(state, clock, waiting=waiting)
    return state


def scrape(
    state: ServerState,
    clock: Clock,
    *,
    waiting: float,
    kv: float = 0.1,
    preemptions: float | None = None,
) -> None:
    """A new page, as the scraper would store it (4 requests running)."""
    state.previous = state.load
    state.load = ServerLoad(
        4.0, waiting, kv, Histogram(), Histogram(), clock.now, preemptions=preemptions
    )


def on_vllm(
    clock: Clock, state: ServerState, prioritized: bool = False, **spec: object
) -> BulkGate:
    settings = {"initial_concurrency": 4, "max_concurrency": 64, **spec}
    upstream = {"d": Upstream(state, prioritized)}
    return BulkGate(BulkSpec.model_validate(settings), servers=upstream, clock=clock)


async def test_a_batch_weighs_its_inputs_and_a_chat_one() -> None:
    """A micro-batch of N embeddings inputs takes N slot-equivalents (vLLM runs each input as a
    sequence), N / embedding_inputs_per_slot where a server embeds a call on one slot; a chat
    takes one; work heavier than the whole limit runs alone rather than never."""
    clock = Clock()
    g = gate(clock, initial_concurrency=8)
    assert g.batch_weight("embeddings", 6) == 6
    assert g.batch_weight("completions", 3, n=2) == 6
    await g.acquire("d", g.batch_weight("embeddings", 6))
    await g.acquire("d")  # a chat: 7 of 8
    heavy = asyncio.create_task(g.acquire("d", g.batch_weight("embeddings", 2)))
    await asyncio.sleep(0)
    assert g.waiting() == {"d": 1}  # 7 + 2 > 8
    g.release("d")
    await asyncio.wait_for(heavy, 1)
    g.release("d", 6)
    g.release("d", 2)
    await asyncio.wait_for(g.acquire("d", 20), 1)  # alone: heavier than the limit
    assert BulkGate(BulkSpec(embedding_inputs_per_slot=64)).batch_weight("embeddings", 64) == 1


async def test_a_quiet_spell_grows_the_limit_no_further_than_the_learned_slots() -> None:
    """With no interactive traffic bulk grows its limit, but never past the server's learned
    batch slots (max_concurrency is far above them)."""
    clock = Clock()
    state = server(clock, slots=6)
    g = on_vllm(clock, state, initial_concurrency=1, reserve_slots=0)
    await g.acquire("d")
    waiting = [asyncio.create_task(g.acquire("d"))]
    for _ in range(30):
        await asyncio.sleep(0)
        clock.now += 2
        scrape(state, clock, waiting=0)
        waiting.append(asyncio.create_task(g.acquire("d")))  # each arrival may grow the limit
    await asyncio.sleep(0)
    assert g.limits() == {"d": 6}
    assert sum(task.done() for task in waiting) == 5  # six in flight, the first included
    for task in waiting:
        task.cancel()


async def test_a_fifo_server_keeps_room_for_interactive_requests() -> None:
    """On a first-come-first-served server bulk leaves the slots interactive requests hold,
    plus reserve_slots; on one that serves bulk at a lower priority, only theirs."""
    clock = Clock()
    fifo = on_vllm(clock, server(clock, slots=4), initial_concurrency=4)
    prio = on_vllm(clock, server(clock, slots=4), prioritized=True, initial_concurrency=4)
    for g in (fifo, prio):
        g.enter("d")
        g.observe("d", 0.05, None)
    assert fifo.limits() == {"d": 2}  # 4 slots - 1 interactive - 1 in reserve
    assert prio.limits() == {"d": 3}
    fifo.leave("d")
    assert fifo.limits() == {"d": 3}


async def test_a_full_queue_holds_bulk_while_interactive_requests_run() -> None:
    """A scrape showing requests waiting, with interactive traffic present: a FIFO server
    gets no more bulk, and the limit halves; a new scrape with an empty queue lets bulk in
    again. A server that orders bulk after interactive work keeps admitting."""
    clock = Clock()
    state = server(clock, slots=8, waiting=3)
    g = on_vllm(clock, state, reserve_slots=0)
    g.enter("d")
    held = asyncio.create_task(g.acquire("d"))
    await asyncio.sleep(0)
    assert g.limits() == {"d": 0} and g.waiting() == {"d": 1}
    clock.now += 0.1
    scrape(state, clock, waiting=0)
    g.leave("d")  # any event looks at the new page
    await asyncio.wait_for(held, 1)
    assert g.limits() == {"d": 2}  # 4, halved by the full queue
    prio = on_vllm(clock, server(clock, slots=8, waiting=3), prioritized=True)
    prio.enter("d")
    await asyncio.wait_for(prio.acquire("d"), 1)
    assert prio.limits() == {"d": 4}


async def test_a_priority_server_that_lets_interactive_requests_wait_is_not_trusted() -> None:
    """A priority server trusted to preempt: bulk may take every slot interactive requests do
    not hold. Two late interactive first tokens while bulk runs in every slot with the KV cache
    free (no preemption counted) and the gate treats it as a FIFO server (reserve and all);
    a late one with a full KV cache is no evidence. The server's preemption counter rising
    while interactive requests run, with KV room to spare, restores the trust."""
    clock = Clock()
    state = server(clock, slots=4)
    g = on_vllm(clock, state, prioritized=True, min_concurrency=4)
    await g.acquire("d")
    g.enter("d")
    assert g.limits() == {"d": 3} and g.server_preempts() == {"d": True}
    clock.now += 1
    scrape(state, clock, waiting=1, kv=0.97, preemptions=0)
    g.observe("d", 0.9, 1.0)  # late, but the KV cache was full: the server could not help it
    clock.now += 1
    scrape(state, clock, waiting=1, preemptions=0)
    for _ in range(2):
        clock.now += 1
        g.observe("d", 0.9, 1.0)
    assert g.server_preempts() == {"d": False}
    scrape(state, clock, waiting=0, preemptions=0)
    g.leave("d")
    assert g.limits() == {"d": 3}  # 4 slots - 1 in reserve, as on a FIFO server
    g.enter("d")
    assert g.limits() == {"d": 2}
    clock.now += 1
    scrape(state, clock, waiting=0, preemptions=1)
    assert g.limits() == {"d": 3}  # the page, read: the server preempted for the one in flight
    assert g.server_preempts() == {"d": True}
    g.leave("d")
    assert g.limits() == {"d": 4}


async def test_scrapes_showing_an_interactive_request_queued_behind_bulk_are_strikes() -> None:
    """Two scrapes showing a queue while an interactive request waits for its first token, bulk
    in every slot and no preemption counted: the server is not trusted, and bulk keeps a slot in
    reserve. On a server whose counter rises for the waiting request, the queue (its preempted
    bulk) is no strike."""
    clock = Clock()
    v1 = on_vllm(clock, v1_state := server(clock, slots=4), prioritized=True)
    pre = on_vllm(clock, pre_state := server(clock, slots=4), prioritized=True)
    for g in (v1, pre):
        await g.acquire("d")
        g.enter("d")
    for preempted in (0, 1):
        clock.now += 0.25
        scrape(v1_state, clock, waiting=1, preemptions=0)
        scrape(pre_state, clock, waiting=1, preemptions=preempted)
        assert pre.limits() == {"d": 3} and v1.limits() == {"d": 2 if preempted else 3}
    assert v1.server_preempts() == {"d": False}
    assert pre.server_preempts() == {"d": True}
    pre.observe("d", 0.05, 1.0)  # its first token: nobody waits for one now
    clock.now += 0.25
    scrape(pre_state, clock, waiting=1, preemptions=1)  # the preempted bulk, still queued
    assert pre.limits() == {"d": 3} and pre.server_preempts() == {"d": True}


def test_first_tokens_well_above_the_unloaded_ttft_halve_the_limit() -> None:
    """On vLLM with known load, an interactive TTFT 2x the fastest of the last minute halves the
    limit though it is far inside its budget; without server load only the budget counts."""
    clock = Clock()
    g = on_vllm(clock, server(clock, slots=8), initial_concurrency=8)
    plain = gate(clock, initial_concurrency=8)
    for _ in range(5):
        clock.now += 0.01
        for each in (g, plain):
            each.observe("d", 0.05, 1.0)
    clock.now += 1
    for each in (g, plain):
        each.observe("d", 0.1, 1.0)  # 10% of the budget, 2x the unloaded TTFT
    assert g.limits() == {"d": 4}
    assert plain.limits() == {"d": 8}


# --- a real simulated vLLM server, scraped by an in-process gateway -------------------------------


async def test_a_queue_at_the_server_holds_bulk_back_until_it_drains() -> None:
    """The server's metrics show requests waiting while an interactive request runs through the
    gateway: the bulk limit falls to nothing and a bulk chat waits at the gate; once the queue
    has drained (a page with none waiting), it is let in and answered."""
    profile = SimProfile(max_batch=MAX_BATCH, prefill_base_ms=20, tokens_per_s=200, output_tokens=4)
    limits = httpx.Limits(max_connections=50, max_keepalive_connections=20)
    async with (
        sims(profile) as (sim,),
        httpx.AsyncClient(timeout=WATCHDOG_S, limits=limits) as client,
    ):
        settings = gateway_settings(
            {"up": vllm(sim)},
            [{"name": "m", "deployments": [{"provider": "up", "model": "local"}]}],
            routing={"bulk": {"reserve_slots": 0}},
        )
        async with run_gateway(settings) as gw:
            await sim.hold(client, MAX_BATCH + 1)  # every slot taken, one more waiting
            interactive = asyncio.create_task(ask(client, gw.url))
            await sim.wait(lambda s: s.waiting == 2)  # the interactive request queues too
            # The gateway holds a fresh scrape showing the queue (a stale one counts as unknown).
            await gateway_shows(
                client, gw.url, 'tailguard_vllm_requests_waiting{provider="up"} 2.0'
            )
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            bulk = asyncio.create_task(
                client.post(gw.url + "/v1/chat/completions", json=body, headers=BULK)
            )
            await gate_shows(client, gw.url, limit=0, waiting=1)
            assert not bulk.done()
            await sim.release()  # the held requests go: the queue drains
            assert served_well(await interactive)
            answer = await bulk
    assert answer.status_code == 200
    assert "queue;dur=" in answer.headers["server-timing"]


async def gate_shows(
    client: httpx.AsyncClient, url: str, *, limit: int, waiting: int, requeued: bool = False
) -> None:
    """Return once the gateway's metrics show this bulk limit and queue on `up/local`; with
    `requeued`, the queue also holds every bulk request preempted so far (read on the same page:
    a preempted request waits at the gate again)."""
    queue = 'tailguard_bulk_waiting{deployment="up/local"} '
    held = f'tailguard_bulk_concurrency_limit{{deployment="up/local"}} {float(limit)}'

    async def shown() -> bool:
        lines = (await client.get(url + "/metrics")).text.splitlines()
        again = _preempted(lines) if requeued else 0.0
        return held in lines and queue + str(float(waiting + again)) in lines

    await eventually(
        shown, within_s=WATCHDOG_S, what=f"the gate at limit {limit}, {waiting} waiting"
    )


# --- preemption of bulk work on a FIFO server, through the real gateway -------------------------

# Bulk chats take ~1.5 s; an interactive request ~40 ms: one that waited for a bulk sequence
# would be served only after it ended.
PREEMPT_PROFILE = SimProfile(
    max_batch=MAX_BATCH, prefill_base_ms=20, tokens_per_s=100, output_tokens=100_000
)
BULK_TOKENS = 150


def bulk_chat(client: httpx.AsyncClient, url: str) -> asyncio.Task[httpx.Response]:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "index this"}],
        "max_tokens": BULK_TOKENS,
    }
    return asyncio.create_task(client.post(url + "/v1/chat/completions", json=body, headers=BULK))


def answered_whole(response: httpx.Response) -> bool:
    body = response.json()
    choice = body["choices"][0]
    return (
        response.status_code == 200
        and bool(choice["message"]["content"])
        and choice["finish_reason"] == "length"
        and body["usage"]["completion_tokens"] == BULK_TOKENS
    )


def preempted(response: httpx.Response) -> int:
    """How often the gateway preempted a bulk response's work, from its server-timing."""
    for entry in response.headers["server-timing"].split(", "):
        if entry.startswith("preempted;"):
            return int(entry.split('desc="')[1].rstrip('"'))
    return 0


async def preemptions(client: httpx.AsyncClient, url: str) -> float:
    return _preempted((await client.get(url + "/metrics")).text.splitlines())


def _preempted(lines: list[str]) -> float:
    for line in lines:
        if line.startswith('tailguard_bulk_preemptions_total{deployment="up/local"}'):
            return float(line.split()[-1])
    return 0.0


async def nothing_failed(client: httpx.AsyncClient, url: str) -> bool:
    """No attempt on the deployment ended but as won, and its breaker never opened."""
    page = (await client.get(url + "/metrics")).text
    attempts = [
        line
        for line in page.splitlines()
        if line.startswith("tailguard_attempts_total{") and "up/local" in line
    ]
    cooled = [
        line
        for line in page.splitlines()
        if line.startswith("tailguard_cooldowns_total{") and not line.endswith(" 0.0")
    ]
    return bool(attempts) and all('outcome="won"' in line for line in attempts) and not cooled


async def learned_slots(client: httpx.AsyncClient, sim: Sim) -> None:
    """Let the gateway learn the server's batch slots (a page with every slot busy and one
    more waiting), then see it empty again."""
    await sim.hold(client, MAX_BATCH + 1)
    await sim.read_by_gateway()
    await sim.release()
    await sim.read_by_gateway()


async def fill(client: httpx.AsyncClient, sim: Sim, url: str) -> list[asyncio.Task[httpx.Response]]:
    """Two bulk chats through the gateway, one after the other, on both of the server's slots
    (the second is the younger)."""
    tasks = []
    for running in (1, 2):
        tasks.append(bulk_chat(client, url))
        await sim.wait(lambda s, n=running: s.running == n)  # type: ignore[misc]
    return tasks


def preempting(sim: Sim, provider: dict[str, object] | None = None, **bulk: object) -> Settings:
    return gateway_settings(
        {"up": vllm(sim, **(provider or {}))},
        [{"name": "m", "deployments": [{"provider": "up", "model": "local"}]}],
        routing={"bulk": {"reserve_slots": 0, **bulk}},
    )


async def test_an_interactive_request_preempts_bulk_chat_on_a_full_fifo_server() -> None:
    """Two bulk chats hold both slots of a FIFO server; an interactive request arrives. The
    younger bulk chat is aborted upstream (the server counts a cancelled request), the
    interactive request is served before either bulk chat ends, and the aborted one runs again
    and answers 200 with its whole body; the abort is no failure (no error, no cooldown)."""
    limits = httpx.Limits(max_connections=50, max_keepalive_connections=20)
    async with (
        sims(PREEMPT_PROFILE) as (sim,),
        httpx.AsyncClient(timeout=WATCHDOG_S, limits=limits) as client,
        run_gateway(preempting(sim)) as gw,
    ):
        await learned_slots(client, sim)
        cancelled, completed = sim.stats.cancelled, sim.stats.completed
        older, younger = await fill(client, sim, gw.url)
        interactive = await ask(client, gw.url, max_tokens=2)
        assert served_well(interactive)
        assert not older.done() and not younger.done()  # it waited for neither
        assert sim.stats.completed == completed + 1
        assert sim.stats.cancelled == cancelled + 1  # the younger one, aborted
        first, second = await older, await younger
        assert answered_whole(first) and answered_whole(second)
        assert (preempted(first), preempted(second)) == (0, 1)
        assert second.headers["x-tailguard-deployment"] == "up/local"
        assert await preemptions(client, gw.url) == 1
        assert await nothing_failed(client, gw.url)


async def test_bulk_work_is_preempted_at_most_max_preemptions_times() -> None:
    """With max_preemptions 1, the first interactive arrival preempts the younger bulk chat,
    the second the older one (the younger was preempted once already), and a third preempts
    nothing: it waits at the server, and both bulk chats still answer in full."""
    limits = httpx.Limits(max_connections=50, max_keepalive_connections=20)
    async with (
        sims(PREEMPT_PROFILE) as (sim,),
        httpx.AsyncClient(timeout=WATCHDOG_S, limits=limits) as client,
        run_gateway(preempting(sim, max_preemptions=1)) as gw,
    ):
        await learned_slots(client, sim)
        cancelled = sim.stats.cancelled
        older, younger = await fill(client, sim, gw.url)
        for aborted in (1, 2):
            assert served_well(await ask(client, gw.url, max_tokens=2))
            assert sim.stats.cancelled == cancelled + aborted
            await sim.wait(lambda s: s.running == 2)  # the aborted one runs again
        third = asyncio.create_task(ask(client, gw.url, max_tokens=2))
        await sim.wait(lambda s: s.waiting == 1)  # no slot was freed for it
        assert served_well(await third)
        first, second = await older, await younger
        assert answered_whole(first) and answered_whole(second)
        assert (preempted(first), preempted(second)) == (1, 1)
        assert await preemptions(client, gw.url) == 2
        assert sim.stats.cancelled == cancelled + 2


@pytest.mark.parametrize("mode", ["off", "bulk_priority"])
async def test_no_gateway_preemption_when_off_or_the_server_orders_bulk_itself(
    mode: str,
) -> None:
    """`preempt: false`, or a provider with `bulk_priority` (the server preempts bulk itself):
    the gateway aborts nothing; the interactive request is served all the same."""
    profile = PREEMPT_PROFILE
    if mode == "bulk_priority":
        profile = PREEMPT_PROFILE.model_copy(
            update={"scheduling_policy": "priority", "priority_preemption": "max_num_seqs"}
        )
    limits = httpx.Limits(max_connections=50, max_keepalive_connections=20)
    async with (
        sims(profile) as (sim,),
        httpx.AsyncClient(timeout=WATCHDOG_S, limits=limits) as client,
    ):
        if mode == "off":
            settings = preempting(sim, preempt=False)
        else:
            settings = preempting(sim, {"bulk_priority": 10})
        async with run_gateway(settings) as gw:
            await learned_slots(client, sim)
            cancelled = sim.stats.cancelled
            older, younger = await fill(client, sim, gw.url)
            interactive = asyncio.create_task(ask(client, gw.url, max_tokens=2))
            if mode == "off":
                await sim.wait(lambda s: s.waiting == 1)  # it queues behind the bulk chats
            else:
                await sim.wait(lambda s: s.preemptions == 1)  # the server makes room itself
            assert served_well(await interactive)
            first, second = await older, await younger
            assert answered_whole(first) and answered_whole(second)
            assert preempted(first) == preempted(second) == 0
            assert await preemptions(client, gw.url) == 0
            assert sim.stats.cancelled == cancelled


# --- a priority server as vLLM V1 is (no preemption at a full batch), through the gateway --------

V1_PROFILE = SimProfile(
    max_batch=MAX_BATCH,
    prefill_base_ms=20,
    tokens_per_s=100,
    output_tokens=100_000,
    scheduling_policy="priority",  # priority_preemption: kv_cache, vLLM V1's
)


async def gateway_shows(client: httpx.AsyncClient, url: str, *lines: str) -> None:
    """Return once the gateway's metrics show every one of `lines` (a state: polled)."""
    want = set(lines)

    async def shown() -> bool:
        return want <= set((await client.get(url + "/metrics")).text.splitlines())

    await eventually(
        shown, within_s=WATCHDOG_S, what=f"/metrics showing {sorted(want)}", every_s=0.01
    )


def bulk_of(client: httpx.AsyncClient, url: str, tokens: int) -> asyncio.Task[httpx.Response]:
    body = {"model": "m", "messages": [{"role": "user", "content": "index"}], "max_tokens": tokens}
    return asyncio.create_task(client.post(url + "/v1/chat/completions", json=body, headers=BULK))


@pytest.mark.slow
async def test_a_priority_server_that_does_not_preempt_at_a_full_batch_gets_slots_kept_free() -> (
    None
):
    """vLLM V1 with `bulk_priority`: bulk chats hold both slots, and an interactive request
    waits at the server behind them (it preempts nothing) until one ends, twice. The gateway
    then stops relying on the server (`tailguard_bulk_server_preempts` 0) and keeps bulk below
    the server's slots: more bulk waits at the gate while one bulk chat runs, and the next
    interactive request finds a slot."""
    limits = httpx.Limits(max_connections=50, max_keepalive_connections=20)
    async with (
        sims(V1_PROFILE) as (sim,),
        httpx.AsyncClient(timeout=WATCHDOG_S, limits=limits) as client,
    ):
        settings = gateway_settings(
            {"up": vllm(sim, bulk_priority=10)},
            [
                {
                    "name": "m",
                    "deployments": [{"provider": "up", "model": "local"}],
                    "budget": {"ttft_ms": 300},
                    "on_ttft_miss": "none",
                }
            ],
            routing={"bulk": {"min_concurrency": MAX_BATCH}},
        )
        async with run_gateway(settings) as gw:
            await learned_slots(client, sim)
            belief = 'tailguard_bulk_server_preempts{deployment="up/local"}'
            long = bulk_of(client, gw.url, 2_000)  # runs through the whole test
            await sim.wait(lambda s: s.running == 1)
            shorts = []
            for _ in range(2):
                shorts.append(bulk_of(client, gw.url, 40))  # ~0.4 s
                await sim.wait(lambda s: s.running == 2)  # bulk in every slot
                await gateway_shows(client, gw.url, f"{belief} 1.0")
                late = asyncio.create_task(ask(client, gw.url, max_tokens=2))
                await sim.wait(lambda s: s.waiting == 1)  # it waits behind bulk
                assert served_well(await late)
                if not await preemptions(client, gw.url):
                    assert (await shorts[-1]).status_code == 200
            assert sim.stats.preemptions == 0  # the server never preempted bulk for it
            await gateway_shows(client, gw.url, f"{belief} 0.0")
            # Bulk now keeps a slot free: two more bulk chats wait at the gate. So may the last
            # short one: the gate takes its slot back if it caught the second interactive request
            # still waiting (read from the same page as the queue: it may come late).
            more = [bulk_of(client, gw.url, 40) for _ in range(2)]
            await gate_shows(client, gw.url, limit=1, waiting=2, requeued=True)
            assert (sim.stats.running, sim.stats.waiting) == (1, 0)
            # Long enough (3 s of tokens) that a busy machine's polls cannot miss it running.
            interactive = asyncio.create_task(ask(client, gw.url, max_tokens=300))
            # None while it runs.
            await gate_shows(client, gw.url, limit=0, waiting=2, requeued=True)
            assert served_well(await interactive)
            assert sim.stats.waiting == 0 and sim.stats.preemptions == 0
            for task in (long, *shorts, *more):
                task.cancel()
            await asyncio.gather(long, *shorts, *more, return_exceptions=True)

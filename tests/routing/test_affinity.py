"""Cache-aware routing: the prefix chain, the bounded table, the steering, and end to end with
simulated vLLM servers (real prefix caches, real `/metrics`) behind the real gateway.

End-to-end tests wait for states (the gateway has read every server's page, a held request is
running at its server), never for a fixed time.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import AffinitySpec, DeploymentSpec
from gateway.latency import BandStats, MetricStats, TargetStats
from gateway.latency.vllm import Histogram, ServerLoad
from gateway.models import Call
from gateway.routing.affinity import (
    MAX_HOLDERS,
    MAX_LEVELS,
    Affinity,
    Chain,
    PrefixTable,
    _Calibration,
    prefix_chain,
)
from gateway.routing.plan import Candidate, Plan
from gateway.sim.profile import SimProfile
from gateway.sim.scheduler import SimStats
from gateway.telemetry import semconv as sc
from tests.conftest import gateway_settings, run_gateway, serve
from tests.fakes.otlp_receiver import OTLPReceiver
from tests.routing.test_plan import StubProvider
from tests.routing.test_vllm_routing import WATCHDOG_S, Sim, sims, vllm

SYSTEM = {"role": "system", "content": "You answer questions about queues. " * 20}


def chat(messages: list[dict[str, Any]], **extra: Any) -> Call:
    body = {"model": "m", "messages": messages, **extra}
    return Call("chat", "m", body, orjson.dumps(body), stream=True)


def turns(n: int, system: dict[str, Any] = SYSTEM, tag: str = "") -> list[dict[str, Any]]:
    """A conversation of `n` user turns, each answered."""
    out = [system]
    for i in range(n):
        out.append({"role": "user", "content": f"question {tag}{i} " * 30})
        if i < n - 1:
            out.append({"role": "assistant", "content": f"answer {tag}{i} " * 40})
    return out


def chain_of(call: Call, max_bytes: int = 64 * 1024) -> Chain:
    found = prefix_chain(call, max_bytes)
    assert found is not None
    return found


# --- the chain -----------------------------------------------------------------------------------


def test_a_turn_extends_the_chain_of_the_turn_before() -> None:
    """Turn n + 1's chain holds every prefix of turn n's, its whole prompt included; the head
    (the system prompt) is level 0 and is shared by any conversation under the same one."""
    first, second = chain_of(chat(turns(2))), chain_of(chat(turns(3)))
    assert second.hashes[: len(first.hashes)] == first.hashes
    assert second.sizes[: len(first.sizes)] == first.sizes
    other = chain_of(chat(turns(2, tag="other")))
    assert other.hashes[0] == first.hashes[0]
    assert not set(other.hashes[1:]) & set(first.hashes)
    assert first.sizes[0] == len(SYSTEM["content"])


def test_tools_and_the_system_prompt_lead_the_chain() -> None:
    """Different tools or a different system prompt share no prefix, as they lead the prompt."""
    base = chain_of(chat(turns(2)))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    with_tools = chain_of(chat(turns(2), tools=tools))
    other_system = chain_of(chat(turns(2, system={"role": "system", "content": "Be short."})))
    assert not set(with_tools.hashes) & set(base.hashes)
    assert not set(other_system.hashes) & set(base.hashes)
    # Tool calls and content arrays are hashed too (as their JSON).
    odd = [*turns(1), {"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}]
    assert len(chain_of(chat(odd)).hashes) == 3


def test_the_bytes_and_levels_hashed_are_capped() -> None:
    """A long prompt is hashed up to `max_bytes` of text and `MAX_LEVELS` boundaries."""
    long = [{"role": "user", "content": "x" * 100_000}]
    capped = chain_of(chat(long), max_bytes=4096)
    assert capped.sizes == (4096,)
    many = [{"role": "user", "content": f"m{i}"} for i in range(1000)]
    assert len(chain_of(chat(many)).hashes) == MAX_LEVELS


def test_completions_responses_and_embeddings() -> None:
    """A completion's prompt is cut in fixed blocks (a longer prompt extends a shorter one's
    chain); the Responses input chains like messages; embeddings have no chain; a body of
    unexpected shapes has none either and raises nothing."""

    def call(endpoint: Any, **body: Any) -> Call:
        return Call(endpoint, "m", body, orjson.dumps(body), stream=False)

    short = chain_of(call("completions", prompt="a" * 9000))
    longer = chain_of(call("completions", prompt="a" * 9000 + "b" * 5000))
    assert longer.hashes[: len(short.hashes) - 1] == short.hashes[:-1]
    assert len(chain_of(call("completions", prompt=list(range(3000)))).hashes) == 3
    items = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert len(chain_of(call("responses", instructions="Be brief.", input=items)).hashes) == 3
    assert prefix_chain(call("embeddings", input="x"), 1024) is None
    assert prefix_chain(call("chat", messages=7), 1024) is None
    assert prefix_chain(call("completions", prompt=["a", "b"]), 1024) is None


# --- the table -----------------------------------------------------------------------------------


def test_the_longest_prefix_a_server_holds_wins() -> None:
    """Each server is credited with the longest prefix of the prompt it was sent; the head
    (a shared system prompt) counts for a server that holds nothing longer."""
    table = PrefixTable(100, 60)
    table.remember(chain_of(chat(turns(2))), "a", 0.0)
    table.remember(chain_of(chat(turns(3, tag="b"))), "b", 0.0)
    found = table.lookup(chain_of(chat(turns(3))), {"a", "b", "c"}, 1.0)
    assert found == {"a": chain_of(chat(turns(2))).sizes[-1], "b": len(SYSTEM["content"])}
    assert table.lookup(chain_of(chat(turns(3))), {"b"}, 1.0) == {"b": len(SYSTEM["content"])}


def test_the_table_is_bounded_and_forgets_the_least_recent() -> None:
    """Whatever clients send, the table keeps at most `max_entries` prefixes (the least
    recently used go first), each with at most `MAX_HOLDERS` servers."""
    table = PrefixTable(64, 600)
    rng = random.Random(1)
    for i in range(5000):
        body = [{"role": "user", "content": f"{rng.random()}"}, {"role": "user", "content": "x"}]
        table.remember(chain_of(chat(body)), f"s{i % 7}", float(i))
        assert len(table) <= 64
    kept = chain_of(chat(turns(2)))
    table.remember(kept, "a", 5000.0)
    for i in range(31):  # 62 more prefixes: `kept`'s two are among the 64 newest
        table.remember(chain_of(chat([{"role": "user", "content": f"n{i}"}] * 2)), "b", 5001.0)
    assert table.lookup(kept, {"a"}, 5002.0) == {"a": kept.sizes[-1]}
    table.remember(chain_of(chat([{"role": "user", "content": "last"}] * 2)), "b", 5003.0)
    assert table.lookup(kept, {"a"}, 5004.0) == {}  # its head, the least recent, went first
    hot = chain_of(chat(turns(1)))
    for server in ("a", "b", "c", "d", "e", "f"):
        table.remember(hot, server, 5005.0)
    assert set(table.lookup(hot, "abcdef", 5006.0)) == {"f", "e", "d", "c"}
    assert len(set(table.lookup(hot, "abcdef", 5006.0))) == MAX_HOLDERS


def test_a_prefix_expires_after_its_ttl() -> None:
    """A prefix not seen for `ttl_s` is not matched, and expired prefixes are dropped as new
    ones come in."""
    table = PrefixTable(100, 10)
    old = chain_of(chat(turns(2)))
    table.remember(old, "a", 0.0)
    assert table.lookup(old, {"a"}, 10.0) == {"a": old.sizes[-1]}
    assert table.lookup(old, {"a"}, 10.5) == {}
    table.remember(chain_of(chat(turns(1, tag="new"))), "b", 11.0)
    assert len(table) == 2  # the old pair went, the new pair came


# --- steering ------------------------------------------------------------------------------------


class FakeServer:
    """A vLLM server's scraped state, as steering reads it."""

    def __init__(self, waiting: float = 0, hit_rate: float | None = None) -> None:
        self.load = ServerLoad(0, waiting, None, Histogram(), Histogram(), 0.0)
        self.hit_rate = hit_rate

    def current(self) -> ServerLoad | None:
        return self.load

    def prefix_hit_rate(self) -> float | None:
        return self.hit_rate


def line_stats(ms_per_byte: float) -> TargetStats:
    """Median TTFT = 10 ms + `ms_per_byte` x prompt bytes, in two trusted prompt bands."""

    def ttft(ms: float) -> MetricStats:
        return MetricStats(ms, ms, ms, ms, 100, True)

    bands = {b: BandStats(ttft(10 + ms_per_byte * size), size) for b, size in ((0, 1e3), (3, 1e4))}
    empty = TargetStats.empty()
    return TargetStats(empty.ttft, empty.tpot, empty.total, 0, 0, 0, bands=bands)


def cand(provider: str, predicted: float | None = None, stats: TargetStats | None = None) -> Any:
    return Candidate(
        "m",
        DeploymentSpec(provider=provider, model="x"),
        StubProvider(),
        stats,
        predicted_ttft_s=predicted,
    )


def steer_once(
    affinity: Affinity,
    found: list[Candidate],
    call: Call,
    servers: dict[str, FakeServer],
    inflight: dict[str, int] | None = None,
) -> Plan:
    """One decision: steer, then settle on the order steering left."""
    steering = affinity.steer(found, call, servers, lambda d: (inflight or {}).get(d, 0))
    return steering.settle(Plan(steering.found, "primary"))


def test_the_holder_leads_while_its_saving_outweighs_its_queue() -> None:
    """A holder's predicted TTFT is credited the prefill its prefix saves (slope x bytes):
    with a long prefix it beats a server predicted 0.2 s faster; with a short one it does
    not (`queue`). Nobody holding anything is a `miss`."""
    affinity = Affinity(AffinitySpec())
    servers = {"a": FakeServer(), "b": FakeServer()}
    stats = line_stats(0.1)  # 0.1 ms a byte
    long_call = chat(turns(4))
    first = steer_once(affinity, [cand("b", 0.2, stats), cand("a", 0.5, stats)], long_call, servers)
    assert first.affinity == "miss" and first.candidates[0].id == "b/x"
    # `b` was sent it: now the holder, slower by 0.2 s than `a` but holding 3120 bytes (0.31 s).
    found = [cand("a", 0.2, stats), cand("b", 0.4, stats)]
    second = steer_once(affinity, found, chat(turns(5)), servers)
    assert (second.affinity, second.candidates[0].id) == ("hit", "b/x")
    # A held prefix worth less than the queue difference: the queue decides.
    affinity = Affinity(AffinitySpec())
    short = [{"role": "user", "content": "hi"}, {"role": "user", "content": "you"}]
    steer_once(affinity, [cand("b", 0.2, stats), cand("a", 0.2, stats)], chat(short), servers)
    found = [cand("a", 0.2, stats), cand("b", 0.5, stats)]
    third = steer_once(
        affinity, found, chat([*short, {"role": "user", "content": "more"}]), servers
    )
    assert (third.affinity, third.candidates[0].id) == ("queue", "a/x")
    assert affinity.counts == {("m", "miss"): 1, ("m", "queue"): 1}


def test_a_holder_over_the_load_bound_goes_last() -> None:
    """A holder whose load (in flight + queued) exceeds bound x mean + slack gets no credit
    and is tried after the others (`bounded`); within the bound it leads, prediction or not."""
    affinity = Affinity(AffinitySpec(load_bound=1.25, load_slack=2))
    servers = {"a": FakeServer(), "b": FakeServer(), "c": FakeServer()}
    call = chat(turns(2))
    steer_once(affinity, [cand("a"), cand("b"), cand("c")], call, servers)
    found = [cand("b"), cand("c"), cand("a")]
    # a: 2 in flight, 0 elsewhere: 3 <= 1.25 x 3 / 3 + 2.
    within = steer_once(affinity, found, call, servers, {"a/x": 2})
    assert (within.affinity, within.candidates[0].id) == ("hit", "a/x")
    # a: 2 in flight and 2 queued: 5 > 1.25 x 5 / 3 + 2.
    servers["a"].load = ServerLoad(0, 2, None, Histogram(), Histogram(), 1.0)
    over = steer_once(affinity, found, call, servers, {"a/x": 2})
    assert over.affinity == "bounded"
    assert [c.id for c in over.candidates] == ["b/x", "c/x", "a/x"]


def test_a_new_conversation_starts_on_the_least_loaded_server() -> None:
    """When only the head (a shared system prompt) is held, the conversation is new to every
    server: it starts on the least loaded one, whatever the predictions say (`queue`: the
    head's holder was passed over)."""
    affinity = Affinity(AffinitySpec())
    servers = {"a": FakeServer(), "b": FakeServer(), "c": FakeServer()}
    stats = line_stats(0.1)
    steer_once(affinity, [cand("a", 0.1, stats), cand("b"), cand("c")], chat(turns(2)), servers)
    found = [cand("a", 0.1, stats), cand("b", 0.5, stats), cand("c", 0.1, stats)]
    placed = steer_once(affinity, found, chat(turns(1, tag="new")), servers, {"a/x": 3, "c/x": 1})
    assert (placed.affinity, placed.candidates[0].id) == ("queue", "b/x")


def test_off_or_alone_steering_changes_nothing() -> None:
    """Off, with one vLLM server, or without any whose load is read: no decision at all."""
    servers = {"a": FakeServer(), "b": FakeServer()}
    call = chat(turns(2))
    found = [cand("a"), cand("b")]
    for spec, where in ((AffinitySpec(enabled=False), servers), (AffinitySpec(), {})):
        settled = steer_once(Affinity(spec), found, call, where)
        assert settled.affinity is None and settled.candidates == found
    alone = steer_once(Affinity(AffinitySpec()), found, call, {"a": servers["a"]})
    assert alone.affinity is None


def test_the_server_hit_rate_calibrates_the_credit() -> None:
    """Predicted hits the server's own counters do not confirm shrink the credit: 90% predicted,
    45% measured, so a third of the way to half the credit."""
    calibration = _Calibration(sent=1000, predicted=900)
    server = FakeServer(hit_rate=0.45)
    assert calibration.update(server) == pytest.approx(0.85)
    assert calibration.update(server) == pytest.approx(0.85)  # the same scrape: unchanged
    server.load = ServerLoad(0, 0, None, Histogram(), Histogram(), 1.0)
    assert calibration.update(server) == pytest.approx(0.85)  # nothing predicted since


# --- end to end ----------------------------------------------------------------------------------

CACHED = SimProfile(prefix_cache_tokens=200_000, output_tokens=8)
HELD = "local@prefill_base_ms=600000"  # ten minutes of prefill: a request stays in flight
TRACED = {"TAILGUARD_TRACES_TAIL_RATIO": "1"}  # every trace kept


def three(servers: list[Sim], upstream: str = "local", **affinity: Any) -> Any:
    """Model `m` on three vLLM servers, read every 0.1 s."""
    return gateway_settings(
        {p: vllm(s) for p, s in zip("abc", servers, strict=True)},
        [{"name": "m", "deployments": [{"provider": p, "model": upstream} for p in "abc"]}],
        routing={"affinity": affinity},
    )


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=20)
    async with httpx.AsyncClient(timeout=WATCHDOG_S, limits=limits) as http:
        yield http


async def turn(
    client: httpx.AsyncClient, url: str, messages: list[dict[str, Any]]
) -> tuple[httpx.Headers, str]:
    """One streamed turn; the response headers and the answer's text."""
    body = {"model": "m", "stream": True, "messages": messages}
    text = []
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                for choice in orjson.loads(line[6:]).get("choices") or ():
                    text.append((choice.get("delta") or {}).get("content") or "")
    return resp.headers, "".join(text)


async def converse(client: httpx.AsyncClient, url: str, n: int) -> list[tuple[str, str | None]]:
    """`n` turns of one conversation: per turn, the deployment and the affinity entry of
    `server-timing` (None without one)."""
    messages: list[dict[str, Any]] = [SYSTEM]
    seen = []
    for i in range(n):
        messages.append({"role": "user", "content": f"Tell me about queue {i}. " * 20})
        headers, answer = await turn(client, url, messages)
        messages.append({"role": "assistant", "content": answer})
        entries = [e for e in headers["server-timing"].split(", ") if e.startswith("affinity;")]
        affinity = entries[0].partition('desc="')[2].rstrip('"') if entries else None
        seen.append((headers["x-tailguard-deployment"], affinity))
    return seen


def samples(text: str, name: str) -> dict[tuple[str, ...], float]:
    return {
        tuple(s.labels.values()): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


async def decisions(client: httpx.AsyncClient, url: str) -> dict[tuple[str, ...], float]:
    return samples((await client.get(url + "/metrics")).text, "tailguard_affinity_decisions_total")


async def test_a_conversation_stays_on_the_server_that_holds_its_history(
    client: httpx.AsyncClient,
) -> None:
    """Four turns of one conversation over three servers: the first goes where the queue says
    (`miss`), the next three to the same server (`hit`, in `server-timing`, the span and the
    counter), whose prefix cache then serves their histories; the others see nothing."""
    receiver = OTLPReceiver()
    async with serve(receiver) as otlp, sims(CACHED, CACHED, CACHED) as servers:
        environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp, **TRACED}
        async with run_gateway(three(servers), environ=environ) as gw:
            await asyncio.gather(*(s.read_by_gateway() for s in servers))
            seen = await converse(client, gw.url, 4)
            counts = await decisions(client, gw.url)
        pages = [await s.page(client) for s in servers]
    assert [a for _, a in seen] == ["miss", "hit", "hit", "hit"]
    assert {d for d, _ in seen} == {seen[0][0]}
    holder = "abc".index(seen[0][0][0])
    assert [s.stats.requests for s in servers] == [4 if i == holder else 0 for i in range(3)]
    hits = [sum(samples(page, "vllm:prefix_cache_hits_total").values()) for page in pages]
    assert hits[holder] > 0 and sum(hits) == hits[holder]
    assert counts == {("m", "hit"): 3.0, ("m", "miss"): 1.0}
    spans = receiver.of_kind("SERVER")
    assert sorted(str(s.attributes.get(sc.TG_AFFINITY)) for s in spans) == ["hit"] * 3 + ["miss"]


async def test_the_off_switch(client: httpx.AsyncClient) -> None:
    """`routing.affinity.enabled: false`: no decision in `server-timing` or the counter."""
    async with (
        sims(CACHED, CACHED, CACHED) as servers,
        run_gateway(three(servers, enabled=False), environ={}) as gw,
    ):
        await asyncio.gather(*(s.read_by_gateway() for s in servers))
        seen = await converse(client, gw.url, 2)
        counts = await decisions(client, gw.url)
    assert [a for _, a in seen] == [None, None]
    assert counts == {}


def changed(was: int) -> Callable[[SimStats], bool]:
    return lambda stats: stats.running != was


async def running(servers: list[Sim], n: int) -> None:
    """Return once `n` requests run across `servers`."""
    async with asyncio.timeout(WATCHDOG_S):
        while (now := [s.stats.running for s in servers]) and sum(now) < n:
            waits = [
                asyncio.ensure_future(s.stats.wait_for(changed(r)))
                for s, r in zip(servers, now, strict=True)
            ]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
                await asyncio.gather(*waits, return_exceptions=True)


@pytest.mark.parametrize("bound", [1.25, 10.0])
async def test_a_hot_prefix_spreads_once_its_server_is_over_the_bound(
    client: httpx.AsyncClient, bound: float
) -> None:
    """Six requests with one prompt, kept in flight (their prefill never ends). Their server
    takes them while its load stays within 1.25 x the mean + 2 (three of them), then the rest
    go elsewhere (`bounded`); with a bound of 10 it takes all six."""
    async with (
        sims(CACHED, CACHED, CACHED) as servers,
        run_gateway(three(servers, HELD, load_bound=bound), environ={}) as gw,
    ):
        await asyncio.gather(*(s.read_by_gateway() for s in servers))
        body = {"model": "m", "stream": True, "messages": turns(2)}
        tasks = []
        try:
            for n in range(1, 7):
                post = client.post(gw.url + "/v1/chat/completions", json=body)
                tasks.append(asyncio.create_task(post))
                await running(servers, n)
            counts = await decisions(client, gw.url)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    got = sorted((s.stats.requests for s in servers), reverse=True)
    if bound == 10.0:
        assert got == [6, 0, 0]
        assert counts == {("m", "miss"): 1.0, ("m", "hit"): 5.0}
    else:
        assert got[0] in (3, 4) and sum(got) == 6
        assert counts[("m", "bounded")] >= 1

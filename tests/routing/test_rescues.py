"""The rescue rules of the attempt loop, on scripted upstreams behind the provider seam.

Each test runs the real race (`open_first`) with real guards and a real latency store; only the
upstreams are scripted, as the deployments a scenario needs: fast, slow, failing.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace

import orjson
import pytest

from gateway.admission.validate import parse_call
from gateway.config import CooldownSpec, DeploymentSpec, OnTTFTMiss, PriorSpec, RetryBudgetSpec
from gateway.errors import AllCandidatesFailedError, ProviderError
from gateway.latency import MemoryLatencyStore, MetricStats, TargetStats
from gateway.models import UpstreamRequest
from gateway.routing import Budget, Candidate, Guards, Ledger, Opened, Plan, open_first, plan
from gateway.routing.attempts import background_done
from gateway.upstream import UpstreamStream
from tests.fakes.seam import FakeProvider, OneTokenStream
from tests.timing import scaled


@dataclass
class Upstream(FakeProvider):
    """A deployment whose first token takes `ttft_s`, or that fails every request."""

    name: str
    ttft_s: float = 0.0
    fails: bool = False
    opened: int = 0

    async def open(self, deployment: str, request: UpstreamRequest) -> UpstreamStream:
        self.opened += 1
        if self.fails:
            raise ProviderError("upstream returned 503", deployment=deployment)
        return OneTokenStream(self.ttft_s)


def candidate(upstream: Upstream, prior_ms: float | None = None) -> Candidate:
    prior = PriorSpec(ttft_ms=prior_ms) if prior_ms is not None else None
    spec = DeploymentSpec(provider=upstream.name, model="m", prior=prior)
    return Candidate(upstream.name, spec, upstream)


async def race(
    plan: Plan,
    guards: Guards,
    store: MemoryLatencyStore,
    *,
    ttft_s: float | None = 0.5,
    on_miss: OnTTFTMiss = "failover",
    cap: float = 1.0,
) -> tuple[Opened, Ledger]:
    """The committed attempt, and the ledger whose `aclose()` the caller owes."""
    call = parse_call(
        "chat",
        orjson.dumps(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        ),
    )
    budget = Budget(
        ttft_s=ttft_s,
        on_ttft_miss=on_miss,
        rescue_share=cap,
        model="m",
        arrived=time.perf_counter(),
    )
    store.arrived("m")
    ledger = Ledger(call, budget, headers={}, recorder=store, guards=guards, inflight=store)
    try:
        return await open_first(ledger, plan, store.local_snapshot()), ledger
    except BaseException:
        await ledger.aclose()
        raise


def guards(*, floor: int = 3, failures: int = 3) -> Guards:
    return Guards(
        CooldownSpec(failures=failures, base_s=30.0),
        RetryBudgetSpec(percent=0, min_concurrent=floor),
    )


async def test_an_outage_onset_tries_the_healthy_fallback_whatever_the_retry_budget() -> None:
    """Many requests meet a primary that just went down, more at once than the retry budget
    allows (here none at all): a request's first failover goes to another deployment and adds
    nothing to the failing one, so it is never refused, and every request is served by the
    healthy fallback instead of a 502. The budget still bounds a request's later failovers."""
    down, healthy = Upstream("down", fails=True), Upstream("ok", ttft_s=0.01)
    shared, store = guards(floor=0), MemoryLatencyStore()
    shared.retries.active = 20
    plan = Plan([candidate(down), candidate(healthy, prior_ms=50)], "primary")
    served = await asyncio.gather(*(race(plan, shared, store, ttft_s=None) for _ in range(10)))
    assert {o.candidate.id for o, _ in served} == {"ok/m"}
    for _, ledger in served:
        await ledger.aclose()
    assert shared.retries.retries == 0
    fresh, also_down = guards(floor=0), Upstream("down2", fails=True)
    twice = Plan([candidate(down), candidate(also_down), candidate(healthy)], "primary")
    with pytest.raises(AllCandidatesFailedError):  # a second failover: the budget says no
        await race(twice, fresh, store, ttft_s=None)
    assert healthy.opened == 10


async def test_over_the_cap_a_slow_attempt_is_not_rescued() -> None:
    """The rescue cap counts client requests: with room for none, a slow primary is neither
    hedged nor failed over; it is waited for (no extra upstream request)."""
    slow, fast = Upstream("slow", ttft_s=0.3), Upstream("fast", ttft_s=0.01)
    shared, store = guards(), MemoryLatencyStore()
    plan = Plan([candidate(slow), candidate(fast, prior_ms=20)], "primary")
    opened, ledger = await race(plan, shared, store, ttft_s=0.2, cap=0.0)
    await ledger.aclose()
    assert (opened.candidate.id, opened.route) == ("slow/m", "primary")
    assert fast.opened == 0


async def test_a_deadline_failover_is_a_rescue_counted_for_the_requested_model() -> None:
    """A deadline failover spends the model's rescue cap like a hedge, and the store counts it
    against the model the client asked for, over its client requests."""
    slow, fast = Upstream("slow", ttft_s=5.0), Upstream("fast", ttft_s=0.01)
    shared, store = guards(), MemoryLatencyStore()
    plan = Plan([candidate(slow), candidate(fast, prior_ms=20)], "primary")
    opened, ledger = await race(plan, shared, store, ttft_s=0.2)
    assert opened.route == "ttft_failover"
    assert opened.hedge_for == "m"  # its sample counts as a rescue of the model asked for
    assert shared.hedges.held() == 1  # held by the committed response until it closes
    await ledger.aclose()
    assert shared.hedges.held() == 0


async def test_an_explored_deployment_is_raced_and_timed_even_when_it_loses() -> None:
    """An exploring plan starts the routed-away deployment and the one that would have served at
    once: the client gets the first answer, and the explored one is still timed to its first
    token (an exact TTFT, not a censored one) before it is closed."""
    explored, lead = Upstream("away", ttft_s=0.15), Upstream("lead", ttft_s=0.01)
    shared, store = guards(), MemoryLatencyStore(min_samples=1)
    plan = Plan([candidate(explored), candidate(lead, prior_ms=20)], "budget", explore=True)
    opened, ledger = await race(plan, shared, store, ttft_s=0.5, on_miss="hedge")
    await ledger.aclose()
    assert (opened.candidate.id, opened.route) == ("lead/m", "hedge")
    assert explored.opened == 1
    async with asyncio.timeout(scaled(2)):
        await background_done()  # the explored attempt is timed in the background
    away = store.local_snapshot().deployments["away/m"]
    assert (away.ttft.count, away.ttft.censored, away.errors) == (1, 0, 0)
    assert away.ttft.p50 == pytest.approx(150, rel=0.5)
    assert shared.hedges.held() == 0 and store.inflight("away/m") == 0


def _measured(found: Candidate, p99: float, p95: float, p90: float) -> Candidate:
    """`found` with a trusted window of first tokens (ms)."""
    ttft = MetricStats(p90 / 2, p90, p95, p99, 100, True)
    no_data = MetricStats(None, None, None, None, 0, False)
    return replace(found, stats=TargetStats(ttft, no_data, no_data, 100, 0, 0))


async def test_a_stalling_primary_keeps_its_request_and_is_hedged_by_the_fastest() -> None:
    """The plan and the race together: a primary whose 8% of first tokens stall, a slow second
    provider of the same model and a fast smaller fallback model. The primary leads (not the
    fallback), and when it stalls the rescue goes to the fastest candidate, the fallback, at
    its hedge point: the slow second provider is never tried."""
    large, second, small = Upstream("large", ttft_s=60), Upstream("second", 60), Upstream("small")
    found = [
        _measured(candidate(large), 8000.0, 5000.0, 200.0),
        _measured(candidate(second), 1500.0, 1200.0, 850.0),
        replace(_measured(candidate(small), 300.0, 300.0, 300.0), model="small"),
    ]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    call = parse_call("chat", orjson.dumps(body))
    budget = Budget(ttft_s=1.0, on_ttft_miss="hedge", rescue_share=0.10, model="m")
    chosen = plan(found, call, budget)
    assert [c.id for c in chosen.candidates] == ["large/m", "small/m", "second/m"]
    assert chosen.route == "primary"
    shared, store = guards(), MemoryLatencyStore()
    opened, ledger = await race(chosen, shared, store, ttft_s=1.0, on_miss="hedge", cap=0.10)
    await ledger.aclose()
    assert (opened.candidate.id, opened.route) == ("small/m", "hedge")
    assert (large.opened, second.opened, small.opened) == (1, 0, 1)


async def test_an_error_fails_over_to_the_requested_model_before_a_faster_fallback() -> None:
    """The plan puts the lead's rescuer, the fast fallback model, second; but an error is no
    late first token: its failover goes to the requested model's other deployment first, and
    the fallback is not tried while that one answers."""
    primary, second = Upstream("large", fails=True), Upstream("second", ttft_s=0.01)
    small = Upstream("small", ttft_s=0.01)
    found = [
        replace(_measured(candidate(primary), 3000.0, 500.0, 300.0), model="m"),
        replace(_measured(candidate(second), 1500.0, 1200.0, 850.0), model="m"),
        replace(_measured(candidate(small), 300.0, 300.0, 300.0), model="small"),
    ]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    budget = Budget(ttft_s=1.0, on_ttft_miss="hedge", rescue_share=0.10, model="m")
    chosen = plan(found, parse_call("chat", orjson.dumps(body)), budget)
    assert [c.id for c in chosen.candidates] == ["large/m", "small/m", "second/m"]
    opened, ledger = await race(chosen, guards(), MemoryLatencyStore(), ttft_s=1.0, cap=0.10)
    await ledger.aclose()
    assert (opened.candidate.id, opened.route) == ("second/m", "error_fallback")
    assert (primary.opened, second.opened, small.opened) == (1, 1, 0)

"""Every way an attempt can end gives back what it claimed.

An attempt claims up to four things: a place in the in-flight count, the breaker's half-open
probe, a hedge slot and a retry-budget token. Whatever ends it (a win, a provider error, any other
exception at any stage, a cancellation, a skip) must give each back, or a deployment stays
"cooling down" until restart. The property runs the real attempt loop against scripted upstreams
behind the provider seam; the end-to-end case is the one first seen in the field.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Literal

import httpx
import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.admission.validate import parse_call
from gateway.config import CooldownSpec, DeploymentSpec, OnTTFTMiss, RetryBudgetSpec
from gateway.errors import (
    GatewayError,
    ProviderError,
    ProviderRejectedError,
    RateLimitedError,
)
from gateway.latency import MemoryLatencyStore, MemoryRecorder
from gateway.models import Chunk, UpstreamRequest, Wire
from gateway.routing import Budget, Candidate, Ledger, Plan, open_first
from gateway.routing.guards import Guards
from gateway.upstream import UpstreamStream
from tests.conftest import run_gateway
from tests.fakes.seam import FakeProvider, OneTokenStream
from tests.faults.conftest import chat, routed, settled
from tests.faults.wire import DONE, Exchange, RawUpstream, sse_token
from tests.timing import scaled

# --- the case from the field ---------------------------------------------------------------------


async def test_a_probe_that_fails_oddly_does_not_disable_the_deployment(
    client: httpx.AsyncClient,
) -> None:
    """The breaker opens, its cooldown ends and the probe meets an answer the gateway once could
    not digest (a 429 with `retry-after: inf`). The probe slot must come back: a later request
    probes again and is served, instead of `503 deployments_cooling_down` until restart."""
    answers = iter(
        [
            (500, {}),  # opens the breaker (one failure is enough here)
            (429, {"retry-after": "inf"}),  # the probe
        ]
    )

    async def script(exchange: Exchange) -> None:
        await exchange.read_request()
        status, headers = next(answers, (200, {}))
        if status != 200:
            body = orjson.dumps({"error": {"message": "no", "type": "server_error"}})
            await exchange.respond(status, body, headers=headers)
            return
        await exchange.start_stream()
        await exchange.chunk(sse_token("hi"))
        await exchange.chunk(DONE)
        await exchange.end_chunks()

    top = {"routing": {"cooldown": {"failures": 1, "base_s": 0.05, "max_s": 0.1}}}
    async with RawUpstream(script) as up, run_gateway(routed(up.base_url, "x", top=top)) as gw:
        url = gw.url + "/v1/chat/completions"
        first = await client.post(url, json=chat(stream=True))
        assert first.status_code == 502
        # Until the cooldown ends the gateway answers without calling; then the probe goes out.
        async with asyncio.timeout(scaled(5)):
            while up.requests < 2:
                await client.post(url, json=chat(stream=True))
        served = None
        async with asyncio.timeout(scaled(5)):
            while served is None or served.status_code != 200:
                served = await client.post(url, json=chat(stream=True))
                assert served.status_code in (200, 429, 502, 503), served.text
        assert up.requests == 3
        await settled(up.url)


# --- the property: scripted upstreams behind the provider seam ------------------------------------

Stage = Literal[
    "ok",  # a content token, then the end
    "ok_close_fails",  # served, but closing its stream raises
    "provider_error",  # 502 before the first token (retryable)
    "rejected",  # 400: the request is at fault (not retryable)
    "rate_limited",  # 429 with retry-after
    "prepare_fails",  # shaping the request for this upstream raises
    "open_fails",  # opening raises something that is not a ProviderError
    "read_fails",  # reading the first event raises something that is not a ProviderError
    "truncated",  # the stream ends before its first token
    "stall",  # says nothing until it is cancelled
]
STAGES: tuple[Stage, ...] = Stage.__args__  # type: ignore[attr-defined]


@dataclass
class Upstreams:
    """What the scripted upstreams did: streams opened and still open."""

    opened: int = 0
    open_now: int = 0
    any_opened: asyncio.Event = field(default_factory=asyncio.Event)
    all_closed: asyncio.Event = field(default_factory=asyncio.Event)

    def open(self) -> None:
        self.opened += 1
        self.open_now += 1
        self.any_opened.set()
        self.all_closed.clear()

    def close(self) -> None:
        self.open_now -= 1
        if not self.open_now:
            self.all_closed.set()


class ScriptedStream(OneTokenStream):
    """One content event then `[DONE]`, or the failure its stage names."""

    def __init__(self, stage: Stage, upstreams: Upstreams) -> None:
        super().__init__(on_close=upstreams.close)
        self._stage = stage

    async def read(self) -> list[Chunk] | None:
        if self._stage == "read_fails":
            raise RuntimeError("a decoder bug")
        if self._stage == "truncated":
            return None
        if self._stage == "stall":
            await asyncio.Event().wait()
        return await super().read()

    async def aclose(self) -> None:
        await super().aclose()
        if self._stage == "ok_close_fails":
            raise RuntimeError("the connection pool broke")


class ScriptedProvider(FakeProvider):
    """A provider whose one deployment behaves as `stage` says, at the stage it names."""

    def __init__(self, name: str, stage: Stage, upstreams: Upstreams) -> None:
        self.name = name
        self._stage = stage
        self._upstreams = upstreams

    @property
    def wire(self) -> Wire:
        if self._stage == "prepare_fails":
            raise RuntimeError("cannot shape the request")
        return "openai"

    @wire.setter
    def wire(self, value: Wire) -> None:  # the seam declares a plain attribute
        raise AttributeError("a scripted provider's wire is fixed")

    async def open(self, deployment: str, request: UpstreamRequest) -> UpstreamStream:
        stage = self._stage
        if stage == "open_fails":
            raise OverflowError("cannot convert float infinity to integer")
        if stage == "provider_error":
            raise ProviderError("upstream returned 502", deployment=deployment)
        if stage == "rejected":
            raise ProviderRejectedError("bad request", deployment=deployment, upstream_status=400)
        if stage == "rate_limited":
            raise RateLimitedError("slow down", deployment=deployment, retry_after_s=0.01)
        self._upstreams.open()
        return ScriptedStream(stage, self._upstreams)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


PROPERTY = settings(
    max_examples=250,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@given(
    stages=st.lists(st.sampled_from(STAGES), min_size=1, max_size=3),
    probes=st.lists(st.booleans(), min_size=3, max_size=3),
    mode=st.sampled_from(["none", "failover", "hedge"]),
    stream=st.booleans(),
    leave=st.sampled_from(["never", "on_open", "at_once"]),
    seed=st.integers(0, 2**16),
)
@PROPERTY
async def test_every_attempt_exit_gives_back_what_it_claimed(
    stages: list[Stage], probes: list[bool], mode: str, stream: bool, leave: str, seed: int
) -> None:
    """Whatever each attempt meets, at whatever stage, and however the request ends (a winner,
    an error, the client leaving at once or once an upstream answered), afterwards no probe,
    hedge slot, retry token or in-flight count is held and every upstream stream is closed; and
    once any cooldown the attempts opened is over, every deployment may be tried again."""
    clock = Clock()
    guards = Guards(
        CooldownSpec(failures=1, base_s=5.0, max_s=10.0),
        RetryBudgetSpec(percent=0, min_concurrent=2),
        clock=clock,
        rng=random.Random(seed),
    )
    store = MemoryLatencyStore()
    upstreams = Upstreams()
    candidates = []
    for index, stage in enumerate(stages):
        spec = DeploymentSpec(provider=f"p{index}", model="m")
        provider = ScriptedProvider(f"p{index}", stage, upstreams)
        candidates.append(Candidate(model=f"model{index}", deployment=spec, provider=provider))
        if probes[index]:  # its breaker opened and cooled down: this attempt is the probe
            guards.cooldowns.failed(spec.id, ProviderError("boom", deployment=spec.id))
    clock.now += 11.0
    on_miss: OnTTFTMiss = "hedge" if mode == "hedge" else "failover"
    budget = Budget(
        ttft_s=None if mode == "none" else 0.005,
        on_ttft_miss=on_miss,
        rescue_share=1.0,
        model="model0",
        arrived=time.perf_counter(),
    )
    call = parse_call("chat", orjson.dumps(chat("model0", stream=stream)))

    async def request() -> None:
        # The request counts in the retry budget's active requests until the ledger closes.
        ledger = Ledger(
            call, budget, headers={}, recorder=MemoryRecorder(), guards=guards, inflight=store
        )
        try:
            opened = await open_first(ledger, Plan(candidates, "primary"), store.snapshot)
            assert ledger.opened is opened  # the winner is handed to the response
        finally:
            await ledger.aclose()

    task = asyncio.create_task(request())
    if leave == "at_once":
        task.cancel()
    elif leave == "on_open":
        opened_or_done = asyncio.create_task(upstreams.any_opened.wait())
        await asyncio.wait([task, opened_or_done], return_when=asyncio.FIRST_COMPLETED)
        opened_or_done.cancel()
        task.cancel()
    try:
        async with asyncio.timeout(0.05 if "stall" in stages else 5):
            await task
    except (GatewayError, RuntimeError, OverflowError, asyncio.CancelledError, TimeoutError):
        pass  # every way a request may end; what matters is what is left behind
    if upstreams.open_now:  # a cancelled request's losers finish unwinding in the background
        async with asyncio.timeout(scaled(1)):
            await upstreams.all_closed.wait()

    assert guards.cooldowns.probes_out() == 0, stages
    assert guards.hedges.held() == 0
    assert guards.retries.retries == 0
    assert guards.retries.active == 0
    assert all(store.inflight(c.id) == 0 for c in candidates)
    assert upstreams.open_now == 0
    clock.now += 100.0  # past any cooldown the attempts opened: each may be tried again
    for candidate in candidates:
        assert guards.cooldowns.begin(candidate.id), (candidate.id, stages)

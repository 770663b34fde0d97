"""What keeps fallback from making things worse: cooldowns, the retry budget and the hedge cap.

Each is per process, O(1) on the request path and never waits; time comes from an injected
monotonic clock so tests can drive it.
"""

from __future__ import annotations

import asyncio
import enum
import random
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from gateway.config import CooldownSpec, RetryBudgetSpec
from gateway.errors import ProviderError, RateLimitedError
from gateway.latency import TTFT_DEADLINE, Snapshot

_NOTHING: Mapping[str, float] = MappingProxyType({})
PROBE_WAIT_S = 1.0
"""What `cooling` reports for a deployment whose half-open probe is still out; also the longest
a request with nowhere else to go waits for that probe's verdict before it is sent beside it."""
MAX_DOUBLINGS = 32
"""The back-off's exponent stops growing here (it is capped far sooner; 2**1024 is no float)."""


class Admission(enum.IntEnum):
    """What `Cooldowns.begin` allows (falsy when the attempt may not start)."""

    DENIED = 0
    FREE = 1  # the breaker is closed, or its cooldown is over and the probe already answered
    PROBE = 2  # this attempt is the half-open probe: its owner must report or abandon it


DENIED, FREE, PROBE = Admission.DENIED, Admission.FREE, Admission.PROBE


@dataclass(slots=True)
class _Breaker:
    failures: int = 0  # consecutive
    trips: int = 0  # times opened since it last worked: each doubles the cooldown
    until: float = 0.0  # monotonic time the cooldown ends
    tripped: bool = False  # open or half-open: the next attempt is a probe
    probing: bool = False  # the probe is out


class Cooldowns:
    """A circuit breaker per deployment.

    `failures` consecutive failures before commit open it for `base_s`, doubled each time it
    reopens (jittered, capped at `probe_interval_s` and `max_s`); a 429 with `retry-after` opens
    it for that long (capped at `max_s`). When the cooldown ends one attempt is let through as a
    probe: success closes the breaker, failure reopens it. A TTFT deadline miss is slowness, not
    failure: the planner handles it through the latency statistics.

    The breaker routes around a failing deployment; it does not refuse when there is nowhere
    else to go. A request whose every candidate is cooling down begins as a `last_resort`: it
    takes the probe at once, cooldown or not, so such requests reach the deployment one at a
    time (`settled` lets the others wait for each verdict).
    """

    def __init__(
        self,
        spec: CooldownSpec,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self._spec = spec
        self._clock = clock
        self._rng = rng or random.Random()
        self._states: dict[str, _Breaker] = {}
        self._waiting: list[asyncio.Future[None]] = []  # requests waiting for a probe's verdict
        self.opened: dict[str, int] = {}  # times each breaker opened

    @property
    def max_s(self) -> float:
        """The longest a deployment cools down, whatever an upstream's retry-after says."""
        return self._spec.max_s

    def cooling(self) -> Mapping[str, float]:
        """Deployments that may not be tried now, with the seconds until they may."""
        if not self._states:
            return _NOTHING
        now = self._clock()
        found: dict[str, float] = {}
        for deployment, state in self._states.items():
            if state.until > now:
                found[deployment] = state.until - now
            elif state.probing:
                found[deployment] = PROBE_WAIT_S
        return found

    def begin(self, deployment: str, *, last_resort: bool = False) -> Admission:
        """An attempt is about to start: DENIED if it may not, PROBE if it claimed the half-open
        probe (then `succeeded`, `failed` or `abandoned` must follow), else FREE. `last_resort`:
        the request has nowhere else to go, so the probe is its as soon as none is out, before
        the cooldown ends."""
        state = self._states.get(deployment)
        if state is None or not state.tripped:
            return FREE
        if state.probing or (state.until > self._clock() and not last_resort):
            return DENIED
        state.probing = True
        return PROBE

    def may_probe(self, deployment: str) -> bool:
        """Whether a last-resort attempt on `deployment` could begin now (no probe is out)."""
        state = self._states.get(deployment)
        return state is None or not state.tripped or not state.probing

    def next_verdict(self) -> asyncio.Future[None]:
        """A future done when some probe next ends (succeeded, failed or abandoned)."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        return waiter

    async def settled(self, timeout_s: float) -> bool:
        """Wait for `next_verdict`, at most `timeout_s`; False when the time ran out first. The
        one place a guard waits: only requests with nowhere else to go, while every candidate's
        probe is out."""
        waiter = self.next_verdict()
        try:
            async with asyncio.timeout(timeout_s):
                await waiter
        except TimeoutError:
            return False
        finally:
            if waiter in self._waiting:  # timed out or cancelled: no longer waiting
                self._waiting.remove(waiter)
        return True

    @property
    def waiting(self) -> int:
        """Requests waiting now for a probe's verdict."""
        return len(self._waiting)

    def _probe_ended(self) -> None:
        """Wake every request waiting for a verdict (each looks again at what it may do)."""
        waiting, self._waiting = self._waiting, []
        for waiter in waiting:
            if not waiter.done():
                waiter.set_result(None)

    def probes_out(self) -> int:
        """Half-open probes currently claimed (zero whenever no attempt is in flight)."""
        return sum(1 for state in self._states.values() if state.probing)

    def succeeded(self, deployment: str) -> None:
        if not self._states:
            return
        state = self._states.get(deployment)
        # An attempt that began before the breaker opened proves nothing about now: only the
        # probe (or any attempt once the cooldown is over) closes it.
        if state is not None and (state.probing or state.until <= self._clock()):
            del self._states[deployment]
            if self._waiting:
                self._probe_ended()

    def abandoned(self, deployment: str) -> None:
        """The attempt ended without a verdict (cancelled): another may probe."""
        state = self._states.get(deployment)
        if state is not None and state.probing:
            state.probing = False
            if self._waiting:
                self._probe_ended()

    def failed(self, deployment: str, error: ProviderError) -> None:
        if error.kind == TTFT_DEADLINE:
            self.abandoned(deployment)
            return
        state = self._states.get(deployment)
        if state is None:
            state = self._states[deployment] = _Breaker()
        now = self._clock()
        probe, state.probing = state.probing, False
        if probe and self._waiting:
            self._probe_ended()
        if isinstance(error, RateLimitedError) and error.retry_after_s:
            if state.until <= now:
                self.opened[deployment] = self.opened.get(deployment, 0) + 1
            state.tripped = True
            state.failures = 0
            state.until = max(state.until, now + min(error.retry_after_s, self._spec.max_s))
            return
        if state.until > now:
            # Began before the breaker opened, or probed early as a last resort: it is open
            # already, for the right time (a last resort's failures do not stretch it).
            return
        state.failures += 1
        if state.tripped or state.failures >= self._spec.failures:
            spec = self._spec
            wait = spec.base_s * 2 ** min(state.trips, MAX_DOUBLINGS) * self._rng.uniform(0.9, 1.1)
            state.until = now + min(wait, spec.probe_interval_s, spec.max_s)
            state.trips += 1
            state.tripped = True
            state.failures = 0
            self.opened[deployment] = self.opened.get(deployment, 0) + 1

    def until_wall(self) -> dict[str, float]:
        """The end of each cooldown in progress, as Unix time (for `/admin/latency`)."""
        now, wall = self._clock(), time.time()
        return {d: wall + (s.until - now) for d, s in self._states.items() if s.until > now}


class LastResort:
    """How a request with nowhere else to go (every candidate cooling down) begins its attempts:
    each takes its deployment's probe as soon as none is out, cooldown or not; `beside`: the
    request waited long enough for a probe's verdict, so its first attempt goes beside the probe
    that is out (a probe that slow is no evidence the deployment is down)."""

    __slots__ = ("_beside", "_cooldowns")

    def __init__(self, cooldowns: Cooldowns, *, beside: bool) -> None:
        self._cooldowns = cooldowns
        self._beside = beside

    def __call__(self, deployment: str) -> Admission:
        admitted = self._cooldowns.begin(deployment, last_resort=True)
        if not admitted and self._beside:
            admitted = FREE
        self._beside = False  # only the first attempt goes beside
        return admitted


class RetryBudget:
    """Envoy's retry budget: failover attempts in flight are capped at `percent` of the active
    requests, but at least `min_concurrent` are always allowed."""

    def __init__(self, spec: RetryBudgetSpec) -> None:
        self._share = spec.percent / 100.0
        self._floor = spec.min_concurrent
        self.active = 0  # requests in progress (each counted by its `Ledger`)
        self.retries = 0  # failover attempts of those requests
        self.denied = 0

    def acquire(self, *, first: bool = False) -> bool:
        """Take a token for a failover after an error. `first`: the request's first failover,
        which goes to another deployment and so adds no load to the failing one; it is never
        refused (an outage's first seconds must not turn into client errors while a healthy
        fallback exists). The budget bounds the failovers after that."""
        if first or self.retries < max(self._floor, self._share * self.active):
            self.retries += 1
            return True
        self.denied += 1
        return False

    def release(self, count: int = 1) -> None:
        self.retries -= count


HEDGE_FLOOR_REQUESTS = 20
"""The hedge cap is computed as if the window held at least this many requests, so a fresh
gateway may hedge a little (with the default 5% cap: one hedge) before it has seen traffic."""


class HedgeBudget:
    """Caps latency rescues (hedges and deadline failovers: the extra upstream requests started
    for a slow attempt) at a fraction of the model's client requests over the latency window.

    The window's client requests and rescues come from the latency snapshot (shared by every
    replica when the store is Redis), counted against the model the client asked for whichever
    deployment served; rescues of this process not yet in the snapshot are added. Failovers
    after errors are not rescues: the retry budget bounds those.
    """

    def __init__(self) -> None:
        self._inflight: dict[str, int] = {}
        self._ended: dict[str, int] = {}  # since the snapshot was taken
        self._snapshot_at = 0.0
        self.denied = 0
        self.counts: dict[tuple[str, str], int] = {}  # (model, started|won|denied) -> hedges

    def acquire(self, model: str, fraction: float, snapshot: Snapshot) -> bool:
        if snapshot.taken_at != self._snapshot_at:
            self._snapshot_at = snapshot.taken_at
            self._ended.clear()
        stats = snapshot.models.get(model)
        hedged = stats.hedges if stats is not None else 0
        requests = stats.clients if stats is not None else 0
        used = hedged + self._inflight.get(model, 0) + self._ended.get(model, 0)
        if used + 1 <= fraction * max(requests, HEDGE_FLOOR_REQUESTS):
            self._inflight[model] = self._inflight.get(model, 0) + 1
            self.count(model, "started")
            return True
        self.denied += 1
        self.count(model, "denied")
        return False

    def count(self, model: str, result: str) -> None:
        key = (model, result)
        self.counts[key] = self.counts.get(key, 0) + 1

    def release(self, model: str) -> None:
        """The hedge ended (and is about to be recorded in the statistics)."""
        self._inflight[model] -= 1
        self._ended[model] = self._ended.get(model, 0) + 1

    def held(self) -> int:
        """Hedges of this process in flight, over every model."""
        return sum(self._inflight.values())

    def refund(self, model: str) -> None:
        """The hedge could not be started after all."""
        self._inflight[model] -= 1
        self.counts[(model, "started")] -= 1


FALLBACK_WINDOW = 200
"""Requests per model over which `max_fallback_share` is counted: both counts are halved when
the total reaches it, so the share follows the latest few hundred requests."""
FALLBACK_FLOOR_REQUESTS = 20
"""The share is computed as if at least this many requests were counted, so a fresh gateway
may move a few before it has seen traffic (with a 10% cap: two)."""


class FallbackShare:
    """Bounds the share of a model's requests routed to its fallback models for latency while
    one of its own deployments is available (`max_fallback_share`). Kept in-process, per
    replica (each replica keeps its own share within the bound): per model, the requests moved
    and all requests over its latest ones. Counts only what `decide` routes, never awaits."""

    def __init__(self) -> None:
        self._counts: dict[str, list[float]] = {}  # model -> [moved, requests]

    def allows(self, model: str, share: float) -> bool:
        """Whether one more request of `model` may be moved without passing `share`."""
        moved, requests = self._counts.get(model, (0.0, 0.0))
        return moved + 1 <= share * max(requests + 1, FALLBACK_FLOOR_REQUESTS)

    def count(self, model: str, *, moved: bool) -> None:
        """One request of `model` was routed: to a fallback model for latency, or not."""
        counts = self._counts.get(model)
        if counts is None:
            counts = self._counts[model] = [0.0, 0.0]
        counts[0] += moved
        counts[1] += 1
        if counts[1] >= FALLBACK_WINDOW:
            counts[0] /= 2
            counts[1] /= 2

    def share(self, model: str) -> float | None:
        """The share of `model`'s latest requests moved to a fallback; None before any."""
        counts = self._counts.get(model)
        return counts[0] / counts[1] if counts else None


EXPLORE_EVERY_S = 0.5
"""A deployment that was routed away is explored at most this often per replica (and within the
model's cap on extra load)."""


EXPLORED_KEPT = 5
"""Explorations whose answers, all in time, show a routed-away deployment has recovered."""
EXPLORED_FRESH_S = 10.0
"""How long an exploration's answer counts."""


class Explorer:
    """Paces exploration of deployments that were routed away, and remembers what the latest
    explorations measured: once the last `EXPLORED_KEPT` all answered (recently), the slowest of
    them says how the deployment does now, without waiting for its window to forget the spell
    it was routed away for."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._next: dict[str, float] = {}
        self._seen: dict[str, deque[tuple[float, float | None]]] = {}

    def observed(self, deployment: str, ttft_s: float | None) -> None:
        """An exploration ended: its TTFT, or None when it gave no first token in time."""
        seen = self._seen.get(deployment)
        if seen is None:
            seen = self._seen[deployment] = deque(maxlen=EXPLORED_KEPT)
        seen.append((self._clock(), ttft_s))

    def latest(self) -> Mapping[str, float]:
        """Per deployment whose latest explorations are all fresh and answered, the slowest."""
        if not self._seen:
            return _NOTHING
        oldest = self._clock() - EXPLORED_FRESH_S
        found: dict[str, float] = {}
        for deployment, seen in self._seen.items():
            if len(seen) == EXPLORED_KEPT and seen[0][0] >= oldest:
                times = [ttft for _, ttft in seen]
                if all(ttft is not None for ttft in times):
                    found[deployment] = max(t for t in times if t is not None)
        return found

    def due(self, deployment: str) -> bool:
        """True at most once per `EXPLORE_EVERY_S` for each deployment."""
        now = self._clock()
        if now < self._next.get(deployment, 0.0):
            return False
        self._next[deployment] = now + EXPLORE_EVERY_S
        return True


class Guards:
    """The guards, one set per app."""

    def __init__(
        self,
        cooldown: CooldownSpec,
        retry_budget: RetryBudgetSpec,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.cooldowns = Cooldowns(cooldown, clock=clock, rng=rng)
        self.retries = RetryBudget(retry_budget)
        self.hedges = HedgeBudget()
        self.fallbacks = FallbackShare()
        self.explorer = Explorer(clock=clock)

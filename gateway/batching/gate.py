"""Admission of bulk traffic: bulk fills a deployment's idle capacity and yields under pressure.

Each deployment has a limit for bulk work in flight, counted in *slot-equivalents*: one upstream
sequence, what one batch slot of the server runs. A bulk chat of `n` choices weighs `n`; a
micro-batch of completions weighs its prompts times `n`; a micro-batch of embeddings weighs its
inputs over `embedding_inputs_per_slot` (vLLM runs each input as a sequence: 1), at least 1.
Work heavier than the whole limit runs alone rather than never.

The limit is steered by the first-token times of the deployment's *interactive* requests (AIMD,
as TCP does with its window): one above `backoff_at` of its budget halves it (at most once per
`cooldown_s`, so one congestion episode counts once); while they stay under `grow_below` of
their budgets, or there is no interactive traffic at all, and bulk work is waiting, it grows by
one at a time. Bulk requests beyond the limit wait in a bounded queue; beyond it, a 503.

On a vLLM deployment whose load is known (its metrics scraped), the gate steers on the server
itself as well:

- Capacity. The limit never exceeds the server's learned batch slots (`Server.slots`, else
  `max_concurrency`), less the interactive requests in flight on it; on a first-come-first-served
  server (no `bulk_priority`) less `reserve_slots` too, so an interactive arrival finds a free
  slot instead of a queue of bulk (a batch job running alone leaves them free as well: the
  first interactive user after it would otherwise wait for a bulk sequence to end).
- The queue. A scrape showing requests waiting, or the KV cache at `kv_full`, means the server
  is full: with interactive requests present, a FIFO server gets no more bulk until a scrape
  shows room again, and the limit halves; a server that serves bulk at a lower priority orders
  its own queue, so there the limit only stops growing (and halves when the KV cache is full).
- The unloaded TTFT. An interactive first token more than `backoff_over_unloaded` times the
  fastest of the last minute (per prompt band) halves the limit long before a loose budget is
  at risk; growth waits for first tokens under `grow_under_unloaded` times it.

Without known load (an OpenAI-type provider, or metrics failing) the budget-based AIMD alone
steers.

On a FIFO vLLM server the gate also takes a slot back for an interactive arrival that would
queue there: it preempts the youngest bulk work in flight (see gateway/batching/preempt.py).

A priority server (`bulk_priority`) is trusted to preempt bulk for interactive requests only
while it is seen to: vLLM V1 does not at a full batch. On a server caught letting interactive
requests wait behind running bulk the gate keeps `reserve_slots` free and preempts its own bulk,
as on a FIFO server (its queue, served by priority, still takes bulk), until the server is seen
preempting (gateway/batching/kind.py).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from gateway.batching.kind import ServerKind
from gateway.batching.preempt import Hold, victims
from gateway.config import BulkSpec
from gateway.errors import OverloadedError

GROW_EVERY_S = 1.0  # additive increase: at most one step per this long
SETTLE_S = 2.0  # and none this soon after a cut: the queue it left must drain first
QUIET_S = 1.0  # no interactive request for this long: the deployment is idle
FLOOR_S = 30.0  # the unloaded TTFT: the fastest interactive first token of the last 30-60 s
FLOOR_SAMPLES = 5  # first tokens needed before that floor is trusted
_EPSILON = 1e-9


class Load(Protocol):
    """What the gate reads of one scrape of a server."""

    @property
    def running(self) -> float: ...
    @property
    def waiting(self) -> float: ...
    @property
    def kv_usage(self) -> float | None: ...
    @property
    def preemptions(self) -> float | None: ...


class Server(Protocol):
    """What the gate reads of a vLLM server (`gateway.latency.vllm.ServerState`, handed over
    by the composition root: batching imports no provider)."""

    @property
    def interval_s(self) -> float: ...
    @property
    def slots(self) -> float | None: ...
    def current(self) -> Load | None: ...


@dataclass(frozen=True, slots=True)
class Upstream:
    """The vLLM server behind a deployment, as the gate reads it."""

    state: Server
    prioritized: bool = False  # bulk is sent with a lower vLLM `priority`


@dataclass(slots=True)
class _Floor:
    """The fastest first token of the last one to two windows of FLOOR_S."""

    since: float
    current: float = math.inf
    previous: float = math.inf
    samples: int = 0

    def value(self, now: float) -> float | None:
        self._rotate(now)
        if self.samples < FLOOR_SAMPLES:
            return None
        return min(self.current, self.previous)

    def add(self, ttft_s: float, now: float) -> None:
        self._rotate(now)
        self.current = min(self.current, ttft_s)
        self.samples += 1

    def _rotate(self, now: float) -> None:
        if now - self.since >= FLOOR_S:
            gone = now - self.since >= 2 * FLOOR_S
            self.previous = math.inf if gone else self.current
            self.current, self.since = math.inf, now


@dataclass(slots=True)
class _Lane:
    deployment: str
    limit: float
    upstream: Upstream | None
    units: float = 0.0  # bulk slot-equivalents in flight
    waiters: deque[tuple[asyncio.Future[None], float]] = field(default_factory=deque)
    interactive: int = 0  # interactive requests in flight
    awaiting: deque[float] = field(default_factory=deque)  # when those without a first token began
    shown: bool = False  # bulk or a first token was seen: the lane is in the metrics
    full: bool = False  # the latest scrape showed the server full
    seen: Load | None = None  # the scrape `full` was read from
    floors: dict[str, _Floor] = field(default_factory=dict)  # by prompt band
    holds: list[Hold] = field(default_factory=list)  # bulk work in flight that may be preempted
    timer: asyncio.TimerHandle | None = None
    last_cut: float = -1e9
    last_grow: float = -1e9
    last_interactive: float = -1e9
    kind: ServerKind = field(default_factory=ServerKind)  # on a priority server: does it preempt?


class _Steering:
    """The bulk limits of every deployment and their steering; `BulkGate` admits bulk work
    within them. `servers`: the vLLM server behind each deployment whose metrics are scraped
    (by deployment id)."""

    def __init__(
        self,
        spec: BulkSpec,
        *,
        servers: Mapping[str, Upstream] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._spec = spec
        self._servers = dict(servers or {})
        self._clock = clock
        self._lanes: dict[str, _Lane] = {}
        self.rejected = 0
        self.preemptions: dict[str, int] = {}  # bulk work preempted, by deployment

    def _lane(self, deployment: str) -> _Lane:
        lane = self._lanes.get(deployment)
        if lane is None:
            spec, upstream = self._spec, self._servers.get(deployment)
            lane = _Lane(deployment, float(spec.initial_concurrency), upstream)
            self._lanes[deployment] = lane
        return lane

    def limits(self) -> dict[str, int]:
        """The bulk limit in force per deployment, in slot-equivalents (for metrics)."""
        now = self._clock()
        out = {}
        for d, lane in self._lanes.items():
            if lane.shown:
                self._steer(lane, now)
                out[d] = int(self._allowed(lane, now) + _EPSILON)
        return out

    def waiting(self) -> dict[str, int]:
        return {d: len(lane.waiters) for d, lane in self._lanes.items() if lane.shown}

    def server_preempts(self) -> dict[str, bool]:
        """Per deployment on a priority server (`bulk_priority`): whether the gate believes the
        server preempts bulk for interactive requests at a full batch (for metrics)."""
        return {
            d: lane.kind.preempts
            for d, lane in self._lanes.items()
            if lane.shown and lane.upstream is not None and lane.upstream.prioritized
        }

    def batch_weight(self, endpoint: str, inputs: int, n: int = 1) -> float:
        """The slot-equivalents of a micro-batch of `inputs` (embeddings or prompts)."""
        if endpoint == "embeddings":
            return max(1.0, inputs / self._spec.embedding_inputs_per_slot)
        return float(max(1, inputs * max(1, n)))

    # -- steering on interactive first tokens --

    def observe(
        self, deployment: str, ttft_s: float, budget_s: float | None, band: str = "short"
    ) -> None:
        """An interactive request's first token on `deployment`, against its TTFT budget and,
        on vLLM with known load, the unloaded TTFT of its prompt band."""
        lane = self._lane(deployment)
        lane.shown = True
        now = self._clock()
        lane.last_interactive = now
        if lane.awaiting:
            lane.awaiting.popleft()
        self._steer(lane, now)
        spec = self._spec
        slow = fast = False
        if budget_s:
            ratio = ttft_s / budget_s
            slow, fast = ratio > spec.backoff_at, ratio < spec.grow_below
        if lane.upstream is not None:
            floor = lane.floors.get(band)
            if floor is None:
                floor = lane.floors[band] = _Floor(now)
            unloaded = floor.value(now)
            floor.add(ttft_s, now)
            if unloaded is not None and lane.upstream.state.current() is not None:
                slow = slow or ttft_s > unloaded * spec.backoff_over_unloaded
                under = ttft_s < unloaded * spec.grow_under_unloaded
                fast = under and (fast or not budget_s)
        if slow:
            self._strike(lane)
            self._cut(lane, now)
        elif fast:
            self._grow(lane, now)

    # -- what kind of server it is --

    def _protects(self, lane: _Lane) -> bool:
        """The server itself keeps interactive requests ahead of bulk: it serves bulk at a lower
        priority and is believed to preempt it for them."""
        up = lane.upstream
        return up is not None and up.prioritized and lane.kind.preempts

    def _strike(self, lane: _Lane) -> None:
        """An interactive request late for its first token (or seen waiting at the server): on
        a priority server that had every slot running, bulk among them, and KV room to spare, it
        did not preempt for it."""
        up = lane.upstream
        if up is None or not up.prioritized:
            return
        load, slots = up.state.current(), up.state.slots
        if load is None or not slots:
            return
        if lane.kind.late(
            bulk_in_flight=lane.units > 0,
            slots_full=load.running >= slots,
            kv_free=self._kv_free(load),
        ):
            self._distrusted(lane)

    def _waited(self, lane: _Lane, now: float) -> bool:
        """An interactive request in flight has waited for its first token longer than an
        unloaded server takes (when that is known): the queue the last scrape shows holds it."""
        if not lane.awaiting:
            return False
        floors = [f for f in (f.value(now) for f in lane.floors.values()) if f is not None]
        return not floors or now - lane.awaiting[0] > min(floors) * self._spec.backoff_over_unloaded

    def _distrusted(self, lane: _Lane) -> None:
        """The gate stopped trusting the server to preempt (BulkGate frees a slot at once)."""

    def _kv_free(self, load: Load) -> bool:
        return load.kv_usage is None or load.kv_usage < self._spec.kv_full

    # -- the policy --

    def _capacity(self, lane: _Lane) -> float:
        """What the server can run at once: its learned slots, else `max_concurrency`."""
        cap = float(self._spec.max_concurrency)
        if lane.upstream is not None and lane.upstream.state.slots:
            cap = min(cap, lane.upstream.state.slots)
        return cap

    def _allowed(self, lane: _Lane, now: float) -> float:
        """The bulk slot-equivalents admitted now: the steered limit within the server's room."""
        up = lane.upstream
        if up is None:
            return lane.limit
        present = lane.interactive > 0 or now - lane.last_interactive < QUIET_S
        if lane.full and present and not up.prioritized:
            return 0.0  # a FIFO server with a queue: bulk must not add to it
        cap = self._capacity(lane)
        if not self._protects(lane):  # interactive arrivals wait for whatever bulk holds
            cap = max(cap - self._spec.reserve_slots, 1.0)
        return max(0.0, min(lane.limit, cap - lane.interactive))

    def _fits(self, lane: _Lane, weight: float, now: float) -> bool:
        allowed = self._allowed(lane, now)
        if lane.units + weight <= allowed + _EPSILON:
            return True
        return lane.units <= 0 and allowed >= 1  # heavier than the limit: alone

    def _steer(self, lane: _Lane, now: float) -> None:
        """Read a new scrape of the lane's server once: is it full?"""
        up = lane.upstream
        if up is None:
            return
        # Learned or not, the server's capacity bounds the limit: a quiet spell grows no further.
        lane.limit = min(lane.limit, max(self._capacity(lane), self._spec.min_concurrency))
        load = up.state.current()
        if load is None:
            lane.full, lane.seen = False, None  # unknown: the budgets alone steer
            return
        if load is lane.seen:
            return
        lane.seen = load
        kv_full = not self._kv_free(load)
        lane.full = load.waiting > 0 or kv_full
        if up.prioritized:
            rose = lane.kind.scraped(
                load.preemptions, interactive=lane.interactive > 0, kv_free=not kv_full
            )
            if not rose and load.waiting > 0 and self._waited(lane, now):
                self._strike(lane)  # one is waiting at the server now, and nothing preempted
        present = lane.interactive > 0 or now - lane.last_interactive < QUIET_S
        if present and (kv_full or (lane.full and not up.prioritized)):
            self._cut(lane, now)  # a priority server serves its queue's interactive ones first

    def _cut(self, lane: _Lane, now: float) -> None:
        if now - lane.last_cut >= self._spec.cooldown_s:
            lane.limit = max(float(self._spec.min_concurrency), lane.limit / 2)
            lane.last_cut = now

    def _grow(self, lane: _Lane, now: float) -> None:
        if (
            lane.waiters
            and not lane.full
            and now - lane.last_grow >= GROW_EVERY_S
            and now - lane.last_cut >= SETTLE_S
        ):
            lane.limit = min(max(self._capacity(lane), lane.limit), lane.limit + 1)
            lane.last_grow = now
            self._wake(lane)

    def _wake(self, lane: _Lane) -> None:
        now = self._clock()
        while lane.waiters:
            waiter, weight = lane.waiters[0]
            if waiter.done():  # cancelled: it leaves the line
                lane.waiters.popleft()
                continue
            if not self._fits(lane, weight, now):
                return
            lane.waiters.popleft()
            lane.units += weight  # handed over: the waiter owns these now
            waiter.set_result(None)

    def _drop(self, lane: _Lane, waiter: asyncio.Future[None]) -> None:
        for entry in lane.waiters:
            if entry[0] is waiter:
                lane.waiters.remove(entry)
                break
        self._wake(lane)  # it may have blocked lighter work behind it

    def _arm(self, deployment: str, lane: _Lane) -> None:
        """With bulk waiting and none in flight, no release will wake it: a timer looks again
        (a new scrape may show room; interactive traffic may have gone quiet)."""
        if lane.timer is not None or lane.units > 0 or not lane.waiters:
            return
        every = lane.upstream.state.interval_s if lane.upstream is not None else QUIET_S
        loop = asyncio.get_running_loop()
        lane.timer = loop.call_later(every, self._recheck, deployment)

    def _recheck(self, deployment: str) -> None:
        lane = self._lanes[deployment]
        lane.timer = None
        now = self._clock()
        self._steer(lane, now)
        if now - lane.last_interactive >= QUIET_S and not lane.interactive:
            self._grow(lane, now)
        self._wake(lane)
        self._arm(deployment, lane)


class BulkGate(_Steering):
    """Admission of bulk work within the steered limits, the interactive requests it leaves
    room for, and preemption of bulk work for them on FIFO servers (and on priority servers
    that do not preempt it themselves)."""

    # -- interactive traffic --

    def enter(self, deployment: str) -> None:
        """An interactive request began on `deployment`; `leave` when it ends."""
        lane = self._lane(deployment)
        ahead = lane.interactive
        lane.interactive += 1
        lane.last_interactive = self._clock()
        lane.awaiting.append(lane.last_interactive)
        if lane.holds:
            self._make_room(deployment, lane, ahead)

    def leave(self, deployment: str) -> None:
        lane = self._lane(deployment)
        lane.interactive -= 1
        lane.last_interactive = self._clock()
        while len(lane.awaiting) > lane.interactive:  # ended before a first token
            lane.awaiting.popleft()
        if lane.waiters:
            self._wake(lane)

    def _distrusted(self, lane: _Lane) -> None:
        """Interactive requests may be waiting behind bulk at the server right now: free the
        slots they lack by the gate's count."""
        self._make_room(lane.deployment, lane, lane.interactive, arriving=False)

    # -- bulk work --

    async def acquire(self, deployment: str, weight: float = 1.0) -> None:
        """Take `weight` slot-equivalents of bulk on `deployment`, waiting for them; raises
        OverloadedError when too many bulk requests are already waiting. Give them back with
        `release`."""
        lane = self._lane(deployment)
        lane.shown = True
        now = self._clock()
        self._steer(lane, now)
        if now - lane.last_interactive >= QUIET_S and not lane.interactive:
            self._grow(lane, now)  # nobody interactive to protect: use the idle capacity
        if not lane.waiters and self._fits(lane, weight, now):
            lane.units += weight
            return
        if len(lane.waiters) >= self._spec.max_queue:
            self.rejected += 1
            raise OverloadedError(
                "Too many bulk requests are waiting for this deployment; retry later.",
                retry_after_s=1.0,
            )
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        lane.waiters.append((waiter, weight))
        self._arm(deployment, lane)
        await self._turn(deployment, lane, waiter, weight)

    async def _turn(
        self, deployment: str, lane: _Lane, waiter: asyncio.Future[None], weight: float
    ) -> None:
        try:
            await waiter
        except asyncio.CancelledError:
            if not waiter.done() or waiter.cancelled():
                self._drop(lane, waiter)
            else:
                self.release(deployment, weight)  # handed over as we left: pass it on
            raise

    def release(self, deployment: str, weight: float = 1.0) -> None:
        lane = self._lane(deployment)
        lane.units = max(0.0, lane.units - weight)
        if lane.waiters:
            self._steer(lane, self._clock())
            self._wake(lane)

    # -- preemption (FIFO vLLM servers, and priority ones that do not preempt at a full batch;
    # see gateway/batching/preempt.py) --

    def hold(self, deployment: str, weight: float, preemptions: int) -> Hold:
        """Bulk work holding `weight` slot-equivalents starts: the gate may preempt it (set its
        `abort`) until `unhold`."""
        hold = Hold(deployment, weight, self._clock(), preemptions)
        self._lane(deployment).holds.append(hold)
        return hold

    def unhold(self, hold: Hold, *, rejoining: bool = False) -> None:
        """The work ended, or committed. A preempted one that is not `rejoining` the queue (it
        finished anyway, or its caller left) takes its slot-equivalents back from its place in
        line, so its owner's `release` stays right."""
        lane = self._lane(hold.deployment)
        if hold in lane.holds:
            lane.holds.remove(hold)
        waiter = hold.waiter
        if hold.preempted and not rejoining and waiter is not None and not waiter.done():
            lane.units += hold.weight  # before the line moves on without it
            waiter.cancel()
            self._drop(lane, waiter)

    async def rejoin(self, hold: Hold) -> None:
        """Wait at the head of the queue, where the preemption put `hold`, for its
        slot-equivalents again."""
        assert hold.waiter is not None
        await self._turn(hold.deployment, self._lane(hold.deployment), hold.waiter, hold.weight)

    def _make_room(
        self, deployment: str, lane: _Lane, ahead: int, *, arriving: bool = True
    ) -> None:
        """An interactive request arrives with `ahead` others in flight: on a FIFO server with
        no slot left for it (by the gate's count, or a queue in the last scrape), preempt the
        youngest bulk work until one is. Not `arriving`: free what the `ahead` lack, by the
        gate's count alone (a queue in the last scrape may be theirs, already seated)."""
        up, spec = lane.upstream, self._spec
        if up is None or self._protects(lane) or not spec.preempt:
            return
        self._steer(lane, self._clock())
        slots = up.state.slots
        need = ahead + lane.units - slots + arriving if slots else 0.0
        if lane.full and arriving:
            need = max(need, 1.0)
        freed = 0.0
        for hold in victims(lane.holds, need, spec.max_preemptions):
            if freed >= need:
                break
            if not hold.abort():
                continue  # it has its answer already
            hold.preempted = True
            lane.holds.remove(hold)
            lane.units = max(0.0, lane.units - hold.weight)
            freed += hold.weight
            hold.waiter = asyncio.get_running_loop().create_future()
            lane.waiters.appendleft((hold.waiter, hold.weight))
            self.preemptions[deployment] = self.preemptions.get(deployment, 0) + 1
        if freed:
            self._arm(deployment, lane)

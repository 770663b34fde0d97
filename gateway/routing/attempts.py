"""The race: the only place where failover and hedging happen.

`open_first` starts the plan's candidates until one produces its first content token (the commit
point) and returns it; once it returns, bytes flow to the client and the choice is final. Every
attempt runs as a task, so a TTFT deadline races the upstream read itself: a stalled upstream is
cut (failover) or joined by a second attempt (hedge) at the deadline, not when a byte finally
arrives. What every attempt holds is the request's `Ledger`'s: the race begins attempts through
it and closes each one that does not win before `open_first` returns or raises.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import traceback
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any

from gateway.errors import (
    AllCandidatesFailedError,
    CoolingDownError,
    GatewayError,
    ProviderError,
    ProviderTimeoutError,
    inband_error,
)
from gateway.latency import HEDGE_LOST, TTFT_DEADLINE, Snapshot
from gateway.providers.request import Prepared
from gateway.routing.deadline import explore_left, rescue_at, ttft_end
from gateway.routing.guards import PROBE, PROBE_WAIT_S, Admission, Cooldowns, LastResort
from gateway.routing.ledger import Ledger, Live, Opened, Tally
from gateway.routing.plan import Candidate, Plan, Route
from gateway.upstream import UpstreamStream

log = logging.getLogger("tailguard")

PREEMPTED = "preempted"  # an attempt of bulk work the gateway took its slot back from


async def open_first(
    ledger: Ledger, plan: Plan, snapshot: Snapshot, preempted: Callable[[], bool] | None = None
) -> Opened:
    """Start `plan`'s candidates until one commits; the only place failover and hedging happen.

    Raises the request's own error (an InvalidRequestError from the first candidate, or a
    non-retryable ProviderError), CoolingDownError, or AllCandidatesFailedError. The returned
    attempt is handed to the response (`ledger.opened`); whatever happens, `ledger.aclose()` is
    its owner's last call. `preempted`: asked when the race is cancelled, whether the bulk gate
    preempted it (gateway/batching/preempt.py); its attempts then end as `preempted`, which is
    no failure and no sample (the request runs again later).
    """
    race = _Race(ledger, plan, snapshot)
    race.preempted = preempted
    try:
        cooldowns = ledger.guards.cooldowns
        if _nowhere_else(cooldowns, plan):
            waited_out = not await _probe_verdict(cooldowns, plan, race.ttft_end)
            race.admit = LastResort(cooldowns, beside=waited_out)
        opened = await race.run()
    except BaseException as error:
        # Its traceback holds the race's finished frames, whose locals (the race, its tasks)
        # hold the error: a reference cycle, freed only by a full collection. Cleared here.
        traceback.clear_frames(error.__traceback__)
        raise
    finally:
        await race.settle()
        race.errors, race.refused = [], None  # this frame is in the traceback too
    ledger.opened = opened
    return opened


_reaping: set[asyncio.Task[None]] = set()  # cleanups that outlive a cancelled request


def _requested_first(queue: deque[Candidate], model: str) -> None:
    """Move the requested model's next deployment to the front of `queue`. The plan puts a
    lead's rescuer second, which may be a faster fallback model; an error is no late first
    token, so its failover keeps the model asked for while one of its deployments is left."""
    for index, candidate in enumerate(queue):
        if candidate.model == model:
            if index:
                del queue[index]
                queue.appendleft(candidate)
            return


class _Race:
    """One request's attempts as they run. Every attempt it starts is in the ledger until closed;
    `settle()` (always run, in `open_first`'s `finally`) closes whatever is left but the winner."""

    def __init__(self, ledger: Ledger, plan: Plan, snapshot: Snapshot) -> None:
        self.ledger = ledger
        self.guards = ledger.guards
        self.budget = ledger.budget
        self.plan = plan
        self.snapshot = snapshot
        self.queue = deque(plan.candidates)
        self.live: dict[asyncio.Task[Opened], Live] = {}  # attempts running as tasks
        self.errors: list[ProviderError] = []
        self.refused: ProviderError | None = None  # a non-retryable error while others ran
        self.cooling_skipped = False
        self.admit: Callable[[str], Admission] = self.guards.cooldowns.begin  # or LastResort
        self.hedged = False  # a rescue was started (at most one per request)
        self.explore = False  # the armed rescue explores an unmeasured successor, as a hedge
        self.timer_at: float | None = None  # perf_counter time to rescue `timed`
        self.timed: Live | None = None
        self.cut: list[asyncio.Task[Opened]] = []  # failed-over attempts, unwinding
        self.ttft_end = ttft_end(self.budget)
        self.preempted: Callable[[], bool] | None = None

    async def run(self) -> Opened:
        if self.ttft_end is None:
            return await self._run_in_order()
        if self.plan.explore and not self._explore():
            self._lead_first()  # no room under the cap (or a client's own retry)
        if not self.live and self._launch(self.plan.route) is None:
            raise self._nothing_left()
        while True:
            timeout = None
            if self.timer_at is not None:
                timeout = max(0.0, self.timer_at - time.perf_counter())
            done, _ = await asyncio.wait(
                self.live, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
            if not done:
                self._rescue()
                continue
            won: list[asyncio.Task[Opened]] = []
            failed = ""
            for task in sorted(done, key=lambda t: self.live[t].attempt.started):
                error = task.exception()
                if error is None:
                    won.append(task)
                else:
                    live = self.live.pop(task)
                    failed = live.candidate.id
                    self._failed(live, error)
            if won:
                return self.ledger.won(self.live.pop(won[0]), won[0].result())
            if not self.live and not self._failover(failed):
                raise self._nothing_left()

    def _lead_first(self) -> None:
        """Not exploring after all: the chosen lead goes before the explored candidate."""
        explored, lead = self.queue.popleft(), self.queue.popleft()
        self.queue.extendleft((explored, lead))

    def _explore(self) -> bool:
        """Start the explored candidate and, beside it at once, the one that would have served
        (extra upstream load like a rescue, so under the same cap); False when the cap has no
        room, and nothing was started."""
        budget = self.budget
        if not budget.may_hedge or len(self.queue) < 2:
            return False
        if not self.guards.hedges.acquire(budget.model, budget.rescue_share, self.snapshot):
            return False
        self.hedged = True  # before the launches: neither gets a rescue timer
        beside = None
        try:
            first = self._launch(self.plan.route)
            if first is not None and first.candidate is self.plan.candidates[0]:
                first.explore = True
            beside = self._launch("hedge", rescue_for=budget.model)
        finally:
            if beside is None:
                self.guards.hedges.refund(budget.model)
        return True

    async def _run_in_order(self) -> Opened:
        """Without a first-token deadline nothing races: the attempts run one after another,
        inline, which spares the common path a task per request."""
        why = self.plan.route
        if self.plan.explore:
            self._lead_first()  # nothing to start beside it inline: no exploring here
        while True:
            found = self._next(why)
            if found is None:
                raise self._nothing_left()
            live, prepared = found
            try:
                opened = await _attempt(live.candidate, prepared)
            except Exception as error:
                self._failed(live, error)
                if not self.queue or not self.ledger.retry_token():
                    raise self._nothing_left() from None
                why = "error_fallback"
                continue
            return self.ledger.won(live, opened)

    # -- starting attempts --

    def _launch(self, why: Route, *, rescue_for: str | None = None) -> Live | None:
        """Start the next candidate that can be tried, as a task; None if none is left."""
        found = self._next(why, rescue_for=rescue_for)
        if found is None:
            return None
        live, prepared = found
        task = asyncio.create_task(_attempt(live.candidate, prepared))
        self.live[task] = live
        self._arm(live, live.attempt.started)
        return live

    def _next(self, why: Route, *, rescue_for: str | None = None) -> tuple[Live, Prepared] | None:
        """The next candidate that can be tried, begun in the ledger; None if none is left."""
        while self.queue:
            candidate = self.queue.popleft()
            admitted = self.admit(candidate.id)
            if not admitted:
                self.cooling_skipped = True
                continue
            found = self.ledger.begin(
                candidate,
                why,
                probe=admitted is PROBE,
                rescue_for=rescue_for,
                first=candidate is self.plan.candidates[0],
            )
            if found is not None:
                return found
        return None

    def _arm(self, live: Live, now: float) -> None:
        """Set when `live` is rescued if it has no first token yet (at most one rescue)."""
        self.timer_at = self.timed = None
        if self.ttft_end is None or not self.queue or self.hedged or not self.plan.ttft_rescue:
            return
        found = rescue_at(
            self.ttft_end - now,
            live.candidate,
            self.queue[0],
            hedging=self._hedging(),
            share=self.budget.rescue_share,
        )
        if found is None:
            return  # let it run
        wait, self.explore = found
        if self.explore and not self.budget.may_hedge:
            return  # a client's own retry is not multiplied
        self.timer_at, self.timed = now + wait, live

    def _hedging(self) -> bool:
        return self.budget.on_ttft_miss == "hedge" and self.budget.may_hedge

    def _rescue(self) -> None:
        """The timed attempt missed its rescue point: hedge it, or fail over from it. Both are
        latency rescues under one cap; over it, the attempt is left to run."""
        slow = self.timed
        self.timer_at = self.timed = None
        if slow is None or slow not in self.live.values():
            return
        budget = self.budget
        if not self.guards.hedges.acquire(budget.model, budget.rescue_share, self.snapshot):
            return  # over the cap: this slow request is not rescued
        self.hedged = True  # before the launch: a rescue gets no timer of its own
        hedge = self._hedging() or self.explore
        rescue = None
        try:
            rescue = self._launch("hedge" if hedge else "ttft_failover", rescue_for=budget.model)
        finally:
            if rescue is None:  # none could start (or starting one failed): no rescue
                self.hedged = False
                self.guards.hedges.refund(budget.model)
        if rescue is None or hedge:
            return
        for task, live in list(self.live.items()):
            if live is slow:
                del self.live[task]
                task.cancel()  # its stream is closed as the task unwinds, right away
                self.cut.append(task)
                self.ledger.close(live, TTFT_DEADLINE, wasted=True)

    def _failover(self, failed: str) -> bool:
        """Every attempt failed (the last on `failed`): start the next, within the retry budget."""
        if not self.queue or not self.ledger.retry_token():
            return False
        _requested_first(self.queue, self.budget.model)
        return self._launch("error_fallback") is not None

    # -- ending attempts --

    def _failed(self, live: Live, error: BaseException) -> None:
        if not isinstance(error, ProviderError):
            # A bug or an unexpected library error: end the race with it.
            self.ledger.close(live, "error:internal")
            raise error
        kind = error.kind or "error"
        if not error.retryable:
            if not self.live:
                self.ledger.close(live, f"error:{kind}")
                raise error  # the request itself was refused: not the deployment's failure
            self.refused = self.refused or error
        else:
            self.errors.append(error)
            if error.faults_deployment:
                self.guards.cooldowns.failed(live.candidate.id, error)
            live.claims.verdict()
        self.ledger.close(live, f"error:{kind}", error=kind if error.retryable else None)

    async def settle(self) -> None:
        """Close every attempt but the winner, and give back the retry budget.

        What the attempts hold is given back before the first await, so a cancellation while
        their tasks unwind cannot leak it; the unwinding itself finishes in the background."""
        ledger = self.ledger
        ledger.release_retries()
        won = ledger.winner is not None
        losers = []
        for task, live in self.live.items():
            if won and live.explore:
                _background(_time_explored(ledger, task, live))  # runs to its first token
            else:
                task.cancel()
                losers.append(task)
        self.live.clear()
        if self.preempted is not None and not won and self.preempted():
            for live in ledger.claimed:  # given back by the gateway itself: not a failure
                ledger.close(live, PREEMPTED)
        ledger.close_losers()
        unwinding = self.cut + losers
        if unwinding:
            await asyncio.shield(_background(_reap(unwinding)))

    def _nothing_left(self) -> GatewayError:
        if self.refused is not None and not self.errors:
            return self.refused
        if self.errors and not any(e.faults_deployment for e in self.errors):
            return self.errors[0]  # the content was refused everywhere: the refusal is the answer
        if not self.errors and self.cooling_skipped:
            return CoolingDownError(
                f"Every deployment of '{self.budget.model}' is cooling down after failures.",
                retry_after_s=PROBE_WAIT_S,
            )
        failed = AllCandidatesFailedError(self.errors)
        # An upstream may ask for an absurd wait (retry-after: 99999); its deployment cools
        # down for at most the configured cap, so the client is not told to wait longer.
        wait, cap = failed.headers.get("retry-after"), math.ceil(self.guards.cooldowns.max_s)
        if wait is not None and wait.isdigit() and int(wait) > cap:
            failed.headers["retry-after"] = str(cap)
        return failed


def _nowhere_else(cooldowns: Cooldowns, plan: Plan) -> bool:
    """Whether every candidate is cooling down: the breaker has nowhere to route around to, so
    the request is not refused but sent as a probe (a plain proxy would send it)."""
    cooling = cooldowns.cooling()
    return bool(cooling) and all(c.id in cooling for c in plan.candidates)


async def _probe_verdict(cooldowns: Cooldowns, plan: Plan, ttft_end: float | None) -> bool:
    """With nowhere else to go and every candidate's probe out, wait for a verdict: a success
    closes the breaker and the request goes as usual, a failure frees the probe for it. False
    when the wait ended first, at `PROBE_WAIT_S` or the TTFT budget: the request is then sent
    beside the probe, since a probe that slow is no evidence the deployment is down."""
    ids = [candidate.id for candidate in plan.candidates]
    until = time.perf_counter() + PROBE_WAIT_S
    if ttft_end is not None:
        until = min(until, ttft_end)
    while not any(cooldowns.may_probe(deployment) for deployment in ids):
        left = until - time.perf_counter()
        if left <= 0 or not await cooldowns.settled(left):
            return False
    return True


async def _time_explored(ledger: Ledger, task: asyncio.Task[Opened], live: Live) -> None:
    """An explored attempt that lost the race is still timed to its first token (then closed):
    what it measures is the point of exploring. Bounded by the TTFT budget."""
    started = live.attempt.started
    try:
        done, _ = await asyncio.wait({task}, timeout=explore_left(ledger.budget, started))
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    guards = ledger.guards
    if not done:
        guards.explorer.observed(live.candidate.id, None)
        ledger.close(live, HEDGE_LOST, wasted=True)
        return
    error = task.exception()
    if error is None:
        opened = task.result()
        first = opened.tally.first_token_at
        try:
            ttft = None if first is None else first - started
            guards.explorer.observed(live.candidate.id, ttft)
            ledger.close(live, HEDGE_LOST, wasted=True, ttft_s=ttft)
        finally:
            await opened.stream.aclose()
    elif isinstance(error, ProviderError) and error.retryable:
        guards.explorer.observed(live.candidate.id, None)
        if error.faults_deployment:
            guards.cooldowns.failed(live.candidate.id, error)
        live.claims.verdict()
        ledger.close(live, f"error:{error.kind or 'error'}", error=error.kind or "error")
    else:
        ledger.close(live, "error:internal")


def _background(work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    """Run cleanup that must finish even if the request that started it is cancelled."""
    task = asyncio.create_task(work)
    _reaping.add(task)
    task.add_done_callback(_reaping.discard)
    return task


async def background_done() -> None:
    """Wait for the cleanups still running after their requests (cancelled losers unwinding,
    explored attempts being timed): for a graceful shutdown, and for tests."""
    while _reaping:
        await asyncio.gather(*list(_reaping), return_exceptions=True)


async def _reap(tasks: list[asyncio.Task[Opened]]) -> None:
    """Wait for cancelled attempts to unwind; close the stream of any that committed anyway
    (it finished in the same instant as the winner: too late)."""
    await asyncio.gather(*tasks, return_exceptions=True)
    for task in tasks:
        if not task.cancelled() and task.exception() is None:
            try:
                await task.result().stream.aclose()
            except Exception:
                log.warning("closing a late attempt's stream failed", exc_info=True)


# --- one attempt, up to its first token ----------------------------------------------------------


async def _attempt(candidate: Candidate, prepared: Prepared) -> Opened:
    if not prepared.request.stream:
        return await _open_until_first_token(candidate, prepared)
    # A stream that makes no content progress is given up on, whatever else it sends: without
    # a budget, a byte now and then would otherwise hold the attempt until read_timeout_ms.
    # (A body cannot be watched for progress: it is whole or nothing.)
    idle_s = candidate.provider.limits.idle_s
    timer = asyncio.timeout(idle_s)
    try:
        async with timer:
            return await _open_until_first_token(candidate, prepared)
    except TimeoutError:
        if not timer.expired():
            raise
        raise ProviderTimeoutError(
            f"no content token within the stream idle timeout ({round(idle_s * 1000)} ms)",
            deployment=candidate.id,
            kind="stream_idle",
        ) from None


async def _open_until_first_token(candidate: Candidate, prepared: Prepared) -> Opened:
    stream = await candidate.provider.open(candidate.id, prepared.request)
    connected = time.perf_counter()  # the response headers are in
    try:
        opened = await _until_first_token(candidate, stream, prepared)
    except BaseException:
        await stream.aclose()
        raise
    opened.connected = connected
    return opened


async def _until_first_token(
    candidate: Candidate, stream: UpstreamStream, prepared: Prepared
) -> Opened:
    """Read until the first content token (or the end); raise on an in-band error before it,
    and on more events or bytes before it than the provider's limits allow (all of them are
    held until the commit)."""
    head: list[bytes] = []
    tally = Tally()
    translate = prepared.stream.feed if stream.streaming else prepared.body
    limits = candidate.provider.limits
    events = size = 0  # events read without content so far, and their bytes
    while True:
        batch = await stream.read()
        if batch is None:
            if not stream.streaming:
                return Opened(candidate, stream, prepared, head, [], tally, ended=True)
            raise ProviderError(
                "the stream ended before the first token",
                deployment=candidate.id,
                kind="truncated",
            )
        now = time.perf_counter()
        for index, chunk in enumerate(batch):
            if chunk.error is not None:
                raise inband_error(candidate.id, chunk.error)
            tally.add(chunk, now)
            head.append(translate(chunk))
            if chunk.content or chunk.done or not stream.streaming:
                return Opened(
                    candidate,
                    stream,
                    prepared,
                    head,
                    batch[index + 1 :],
                    tally,
                    ended=chunk.done or not stream.streaming,
                )
            events += 1
            size += len(chunk.raw)
            if events > limits.max_precommit_events or size > limits.max_precommit_bytes:
                raise ProviderError(
                    f"more than {limits.max_precommit_events} events or "
                    f"{limits.max_precommit_bytes} bytes before the first content token "
                    "(max_precommit_events, max_precommit_bytes)",
                    deployment=candidate.id,
                    kind="precommit_limit",
                )

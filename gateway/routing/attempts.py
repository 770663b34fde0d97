"""The attempt loop: the only place where failover and hedging happen.

`open_first` starts the plan's candidates until one produces its first content token (the commit
point) and returns it; once it returns, bytes flow to the client and the choice is final. Every
attempt runs as a task, so a TTFT deadline races the upstream read itself: a stalled upstream is
cut (failover) or joined by a second attempt (hedge) at the deadline, not when a byte finally
arrives. Every attempt that does not win is closed before `open_first` returns or raises.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.config import OnTTFTMiss
from gateway.errors import (
    AllCandidatesFailedError,
    CoolingDownError,
    GatewayError,
    InvalidRequestError,
    ProviderError,
    ProviderTimeoutError,
)
from gateway.latency import CANCELLED, HEDGE_LOST, TTFT_DEADLINE, Recorder, Sample, Snapshot
from gateway.models import Call, Chunk, Usage
from gateway.providers.base import UpstreamStream, inband_error
from gateway.providers.request import Prepared, prepare
from gateway.routing.guards import PROBE, PROBE_WAIT_S, Guards
from gateway.routing.plan import Candidate, Plan, Route, deadline, rescue_point
from gateway.semconv import OPERATIONS

log = logging.getLogger("tailguard")
MAX_FINISH_REASONS = 16  # kept per stream (an upstream may repeat one on every event)


class AttemptTracer(Protocol):
    """Spans per attempt (implemented by telemetry; routing only calls it)."""

    def attempt(
        self, *, operation: str, model: str, provider: str, address: str | None, hedge: bool
    ) -> tuple[Any, str]:
        """Start a span for an attempt; returns it and the `traceparent` to send upstream."""
        ...

    def capture_prompt(self, span: Any, body: Mapping[str, Any]) -> None: ...

    def end_attempt(self, span: Any, *, outcome: str, error_type: str | None = None) -> None: ...


class InflightTracker(Protocol):
    """Counts upstream attempts in flight; the committed attempt's owner calls `finished`."""

    def started(self, deployment: str, model: str | None = None) -> None: ...

    def finished(self, deployment: str, model: str | None = None) -> None: ...


@dataclass(slots=True)
class Attempt:
    """One upstream try, and why it ended: `won`, `error:<kind>`, `ttft_deadline` (cut by a
    failover), `hedge_lost` (a hedge answered first), `cancelled` (no longer needed)."""

    deployment: str
    model: str
    started: float
    ended: float | None = None
    outcome: str = "open"
    hedge: bool = False
    span: Any = None  # its trace span, when tracing is on


@dataclass(slots=True)
class Tally:
    """What the committed stream carried, for statistics and telemetry."""

    first_token_at: float | None = None
    last_token_at: float | None = None
    tokens: int = 0  # content events seen (output tokens when the upstream reports no usage)
    usage: Usage = field(default_factory=Usage)
    finish_reasons: list[str] = field(default_factory=list)

    def add(self, chunk: Chunk, now: float) -> None:
        if chunk.content:
            if self.first_token_at is None:
                self.first_token_at = now
            self.last_token_at = now
            self.tokens += chunk.tokens or 1
        if chunk.usage is not None:
            if chunk.usage.input_tokens is not None:
                self.usage.input_tokens = chunk.usage.input_tokens
            if chunk.usage.output_tokens is not None:
                self.usage.output_tokens = chunk.usage.output_tokens
            if chunk.usage.cached_tokens is not None:
                self.usage.cached_tokens = chunk.usage.cached_tokens
        if chunk.finish_reason is not None and len(self.finish_reasons) < MAX_FINISH_REASONS:
            self.finish_reasons.append(chunk.finish_reason)  # one per choice; bounded whatever

    @property
    def output_tokens(self) -> int:
        return self.usage.output_tokens if self.usage.output_tokens is not None else self.tokens


@dataclass(slots=True)
class Opened:
    """A committed attempt. Its owner must `close()` it (which closes `stream`), on every path."""

    candidate: Candidate
    stream: UpstreamStream
    prepared: Prepared
    head: list[bytes]  # translated bytes up to and including the committing event
    pending: list[Chunk]  # events read in the same network read after the committing one
    tally: Tally
    ended: bool  # the upstream already finished (non-streaming, or a stream read to its end)
    attempts: list[Attempt] = field(default_factory=list)
    started: float = 0.0  # when this attempt was opened (perf_counter seconds)
    connected: float = 0.0  # when its response headers arrived
    route: Route = "primary"
    attempt: Attempt | None = None  # the winning attempt
    hedge_for: str | None = None  # the winner is a rescue: its sample and cap belong to this model
    claims: Claims | None = None  # what the winning attempt holds, given back by `close`

    async def close(self) -> None:
        """Give back what the attempt holds and close its stream; the owner's last call."""
        claims, self.claims = self.claims, None
        try:
            if claims is not None:
                claims.release()
        finally:
            await self.stream.aclose()


@dataclass(frozen=True, slots=True)
class Policy:
    """How one request's attempts may be rescued."""

    model: str  # the model the client asked for: whose hedge cap is spent
    arrived: float  # perf_counter time the request arrived: the TTFT budget counts from here
    ttft_s: float | None = None  # TTFT budget; None: no deadline, attempts run until they end
    on_ttft_miss: OnTTFTMiss = "failover"
    hedge_fraction: float = 0.05
    may_hedge: bool = True  # False for a client's own retry: do not multiply it


async def open_first(
    call: Call,
    plan: Plan,
    policy: Policy,
    *,
    headers: dict[str, str],
    recorder: Recorder,
    guards: Guards,
    snapshot: Snapshot,
    inflight: InflightTracker | None = None,
    trace: AttemptTracer | None = None,
) -> Opened:
    """Start candidates until one commits; the only place failover and hedging happen.

    Raises the request's own error (an InvalidRequestError from the first candidate, or a
    non-retryable ProviderError), CoolingDownError, or AllCandidatesFailedError. The caller owns
    the returned `Opened` and must `close()` it.
    """
    race = _Race(call, plan, policy, headers, recorder, guards, snapshot, inflight, trace)
    opened: Opened | None = None
    try:
        opened = await race.run()
    finally:
        try:
            await race.settle()
        except BaseException:
            if opened is not None:  # cancelled while the losers unwound: nobody else has it
                await opened.close()
            raise
    return opened


@dataclass(slots=True, eq=False)
class Claims:
    """What one attempt holds: its place in the in-flight count, the breaker's half-open probe
    when it is the probe, and a rescue slot when it is a hedge or a deadline failover. `release`
    gives all of it back, once, whatever way the attempt ended; its owner calls it (the race for
    every attempt that does not win, the committed response for the one that does)."""

    deployment: str
    model: str
    guards: Guards
    inflight: InflightTracker | None = None
    probe: bool = False  # holds the half-open probe and has not yet told the breaker how it went
    counted: bool = False  # counted in flight
    rescue_for: str | None = None  # a hedge or deadline failover: holds a rescue slot of this model
    released: bool = False

    def verdict(self) -> None:
        """The breaker was told how the attempt went: the probe is no longer held."""
        self.probe = False

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        try:
            if self.counted and self.inflight is not None:
                self.inflight.finished(self.deployment, self.model)
        finally:
            if self.rescue_for is not None:
                self.guards.hedges.release(self.rescue_for)
            if self.probe:
                self.guards.cooldowns.abandoned(self.deployment)


@dataclass(slots=True, eq=False)
class _Live:
    candidate: Candidate
    attempt: Attempt
    why: Route  # how this attempt came to be tried
    claims: Claims
    closed: bool = False  # its outcome is recorded and its claims given back
    explore: bool = False  # explores a routed-away deployment: if it loses, it is still timed


_reaping: set[asyncio.Task[None]] = set()  # cleanups that outlive a cancelled request


class _Race:
    """One request's attempts. Every attempt it starts is in `claimed` until it is closed, and
    `settle()` (always run, in `open_first`'s `finally`) closes whatever is left: the only
    attempt that leaves the race unclosed is the winner, whose claims travel in `Opened`."""

    def __init__(
        self,
        call: Call,
        plan: Plan,
        policy: Policy,
        headers: dict[str, str],
        recorder: Recorder,
        guards: Guards,
        snapshot: Snapshot,
        inflight: InflightTracker | None,
        trace: AttemptTracer | None,
    ) -> None:
        self.call = call
        self.trace = trace
        self.plan = plan
        self.policy = policy
        self.headers = headers
        self.recorder = recorder
        self.guards = guards
        self.snapshot = snapshot
        self.inflight = inflight
        self.queue = deque(plan.candidates)
        self.claimed: list[_Live] = []  # every attempt begun, closed or not
        self.live: dict[asyncio.Task[Opened], _Live] = {}  # attempts running as tasks
        self.attempts: list[Attempt] = []
        self.errors: list[ProviderError] = []
        self.refused: ProviderError | None = None  # a non-retryable error while others ran
        self.cooling_skipped = False
        self.retries = 0  # retry-budget tokens held
        self.hedged = False  # a rescue was started (at most one per request)
        self.explore = False  # the armed rescue explores an unmeasured successor, as a hedge
        self.timer_at: float | None = None  # perf_counter time to rescue `timed`
        self.timed: _Live | None = None
        self.winner: _Live | None = None
        self.opened: Opened | None = None
        self.cut: list[asyncio.Task[Opened]] = []  # failed-over attempts, unwinding
        end = policy.arrived + policy.ttft_s if policy.ttft_s is not None else None
        self.ttft_end = end if policy.on_ttft_miss != "none" else None

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
                return self._won(self.live.pop(won[0]), won[0].result())
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
        policy = self.policy
        if not policy.may_hedge or len(self.queue) < 2:
            return False
        if not self.guards.hedges.acquire(policy.model, policy.hedge_fraction, self.snapshot):
            return False
        self.hedged = True  # before the launches: neither gets a rescue timer
        beside = None
        try:
            first = self._launch(self.plan.route)
            if first is not None and first.candidate is self.plan.candidates[0]:
                first.explore = True
            beside = self._launch("hedge", rescue_for=policy.model)
        finally:
            if beside is None:
                self.guards.hedges.refund(policy.model)
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
                if not self.queue or not self._retry_token(live.candidate.id):
                    raise self._nothing_left() from None
                why = "error_fallback"
                continue
            return self._won(live, opened)

    def _retry_token(self, failed: str) -> bool:
        """A retry-budget token for a failover after `failed` erred (given back in `settle`);
        the request's first is never refused (see `RetryBudget.acquire`)."""
        if not self.guards.retries.acquire(first=self.retries == 0):
            return False
        self.retries += 1
        return True

    # -- starting attempts --

    def _launch(self, why: Route, *, rescue_for: str | None = None) -> _Live | None:
        """Start the next candidate that can be tried, as a task; None if none is left."""
        found = self._next(why, rescue_for=rescue_for)
        if found is None:
            return None
        live, prepared = found
        task = asyncio.create_task(_attempt(live.candidate, prepared))
        self.live[task] = live
        self._arm(live, live.attempt.started)
        return live

    def _next(self, why: Route, *, rescue_for: str | None = None) -> tuple[_Live, Prepared] | None:
        """The next candidate that can be tried, counted as started; None if none is left.

        Its claims are registered before anything that can fail, so `settle` finds them."""
        while self.queue:
            candidate = self.queue.popleft()
            admitted = self.guards.cooldowns.begin(candidate.id)
            if not admitted:
                self.cooling_skipped = True
                continue
            claims = Claims(
                candidate.id, candidate.model, self.guards, self.inflight, probe=admitted is PROBE
            )
            attempt = Attempt(
                candidate.id, candidate.model, time.perf_counter(), hedge=why == "hedge"
            )
            live = _Live(candidate, attempt, why, claims)
            self.claimed.append(live)
            headers = self.headers
            trace = self.trace
            if trace is not None:
                provider = candidate.provider
                attempt.span, traceparent = trace.attempt(
                    operation=OPERATIONS.get(self.call.endpoint, self.call.endpoint),
                    model=candidate.deployment.model,
                    provider=provider.system,
                    address=provider.address,
                    hedge=why == "hedge",
                )
                headers = {**headers, "traceparent": traceparent}
            try:
                prepared = prepare(
                    self.call, candidate.provider, candidate.deployment.model, headers
                )
            except InvalidRequestError as error:
                self._close(live, "skipped", span_error=error.code)
                if not self.attempts and candidate is self.plan.candidates[0]:
                    raise  # the first choice cannot take the request: the request is at fault
                continue  # a fallback that cannot express this request is skipped
            if trace is not None:
                trace.capture_prompt(attempt.span, self.call.body)
            self.attempts.append(attempt)
            if self.inflight is not None:
                self.inflight.started(candidate.id, candidate.model)
                claims.counted = True
            claims.rescue_for = rescue_for
            return live, prepared
        return None

    def _arm(self, live: _Live, now: float) -> None:
        """Set when `live` is rescued if it has no first token yet (at most one rescue)."""
        self.timer_at = self.timed = None
        if self.ttft_end is None or not self.queue or self.hedged or not self.plan.ttft_rescue:
            return
        remaining = self.ttft_end - now
        if remaining <= 0:
            return  # the budget is spent: rescuing now would only cascade through the list
        successor = self.queue[0]
        hedging = self._hedging()
        share = self.policy.hedge_fraction
        wait = rescue_point(remaining, live.candidate, successor, hedge=hedging, share=share)
        if wait is None:
            return  # let it run: no rescue could land sooner
        # A failover to a successor nobody has measured is explored as a hedge instead: the
        # attempt keeps running, so trying the unknown costs the client nothing.
        self.explore = not hedging and deadline(remaining, successor) is None
        if self.explore and not self.policy.may_hedge:
            return  # a client's own retry is not multiplied
        self.timer_at, self.timed = now + wait, live

    def _hedging(self) -> bool:
        return self.policy.on_ttft_miss == "hedge" and self.policy.may_hedge

    def _rescue(self) -> None:
        """The timed attempt missed its rescue point: hedge it, or fail over from it. Both are
        latency rescues under one cap; over it, the attempt is left to run."""
        slow = self.timed
        self.timer_at = self.timed = None
        if slow is None or slow not in self.live.values():
            return
        policy = self.policy
        if not self.guards.hedges.acquire(policy.model, policy.hedge_fraction, self.snapshot):
            return  # over the cap: this slow request is not rescued
        self.hedged = True  # before the launch: a rescue gets no timer of its own
        hedge = self._hedging() or self.explore
        rescue = None
        try:
            rescue = self._launch("hedge" if hedge else "ttft_failover", rescue_for=policy.model)
        finally:
            if rescue is None:  # none could start (or starting one failed): no rescue
                self.hedged = False
                self.guards.hedges.refund(policy.model)
        if rescue is None or hedge:
            return
        for task, live in list(self.live.items()):
            if live is slow:
                del self.live[task]
                task.cancel()  # its stream is closed as the task unwinds, right away
                self.cut.append(task)
                self._close(live, TTFT_DEADLINE, wasted=True)

    def _failover(self, failed: str) -> bool:
        """Every attempt failed (the last on `failed`): start the next candidate, within the
        retry budget."""
        if not self.queue or not self._retry_token(failed):
            return False
        return self._launch("error_fallback") is not None

    # -- ending attempts --

    def _won(self, live: _Live, opened: Opened) -> Opened:
        self.winner, self.opened = live, opened
        live.attempt.outcome = "won"
        self.guards.cooldowns.succeeded(live.candidate.id)
        live.claims.verdict()
        opened.claims = live.claims  # from here the response owns them
        opened.attempts = self.attempts
        opened.started = live.attempt.started
        opened.route = live.why
        opened.attempt = live.attempt
        opened.hedge_for = live.claims.rescue_for
        first = opened.tally.first_token_at
        if live.explore and first is not None:  # the explored one answered first
            self.guards.explorer.observed(live.candidate.id, first - live.attempt.started)
        if live.attempt.hedge:
            self.guards.hedges.count(self.policy.model, "won")
        return opened

    def _failed(self, live: _Live, error: BaseException) -> None:
        if not isinstance(error, ProviderError):
            # A bug or an unexpected library error: end the race with it.
            self._close(live, "error:internal")
            raise error
        kind = error.kind or "error"
        if not error.retryable:
            if not self.live:
                self._close(live, f"error:{kind}")
                raise error  # the request itself was refused: not the deployment's failure
            self.refused = self.refused or error
        else:
            self.errors.append(error)
            self.guards.cooldowns.failed(live.candidate.id, error)
            live.claims.verdict()
        self._close(live, f"error:{kind}", error=kind if error.retryable else None)

    def _close(
        self,
        live: _Live,
        outcome: str,
        *,
        error: str | None = None,
        span_error: str | None = None,
        wasted: bool = False,
        ttft_s: float | None = None,
    ) -> None:
        """Record how an attempt that did not win ended, and give back what it held (once).
        `wasted`: it was started and thrown away for another attempt of the same request."""
        if live.closed:
            return
        live.closed = True
        attempt, candidate = live.attempt, live.candidate
        attempt.ended = time.perf_counter()
        attempt.outcome = outcome
        try:
            live.claims.release()
        finally:
            elapsed = attempt.ended - attempt.started
            ttft_over = total_over = None
            if outcome in (TTFT_DEADLINE, HEDGE_LOST, CANCELLED):
                # Cut before it answered: censored, "slower than this", never a value of this
                # (an explored attempt timed after it lost did answer: `ttft_s`).
                error = outcome
                if ttft_s is None and self.call.stream:
                    ttft_over = elapsed
                elif ttft_s is None:
                    total_over = elapsed
            hedge_for = live.claims.rescue_for
            if error is not None:
                self.recorder.record(
                    Sample(
                        candidate.id,
                        candidate.model,
                        ok=False,
                        total_s=elapsed,
                        ttft_s=ttft_s,
                        ttft_over_s=ttft_over,
                        total_over_s=total_over,
                        error=error,
                        hedge_for=hedge_for,
                        endpoint=self.call.endpoint,
                        prompt_bytes=len(self.call.raw),
                        wasted=wasted,
                    )
                )
            if attempt.span is not None and self.trace is not None:
                failed = outcome.startswith("error:")
                self.trace.end_attempt(
                    attempt.span,
                    outcome=outcome,
                    error_type=span_error or (outcome[6:] if failed else None),
                )

    async def settle(self) -> None:
        """Close every attempt but the winner, and give back the retry budget.

        What the attempts hold is given back before the first await, so a cancellation while
        their tasks unwind cannot leak it; the unwinding itself finishes in the background."""
        if self.retries:
            self.guards.retries.release(self.retries)
            self.retries = 0
        winner = self.opened
        losers = []
        for task, live in self.live.items():
            if winner is not None and live.explore:
                _background(self._time_explored(task, live))  # runs to its first token
            else:
                task.cancel()
                losers.append(task)
        self.live.clear()
        for live in self.claimed:
            if live is self.winner or live.closed or (live.explore and winner is not None):
                continue
            beaten = winner is not None and live.attempt.started < winner.started
            # With a winner, every other attempt still running was work thrown away.
            self._close(live, HEDGE_LOST if beaten else CANCELLED, wasted=winner is not None)
        unwinding = self.cut + losers
        if unwinding:
            await asyncio.shield(_background(_reap(unwinding)))

    async def _time_explored(self, task: asyncio.Task[Opened], live: _Live) -> None:
        """An explored attempt that lost the race is still timed to its first token (then
        closed): what it measures is the point of exploring. Bounded by the TTFT budget."""
        limit = self.policy.ttft_s or EXPLORE_LIMIT_S
        started = live.attempt.started
        left = max(0.0, started + limit - time.perf_counter())
        try:
            done, _ = await asyncio.wait({task}, timeout=left)
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        explorer = self.guards.explorer
        if not done:
            explorer.observed(live.candidate.id, None)
            self._close(live, HEDGE_LOST, wasted=True)
            return
        error = task.exception()
        if error is None:
            opened = task.result()
            first = opened.tally.first_token_at
            try:
                ttft = None if first is None else first - started
                explorer.observed(live.candidate.id, ttft)
                self._close(live, HEDGE_LOST, wasted=True, ttft_s=ttft)
            finally:
                await opened.stream.aclose()
        elif isinstance(error, ProviderError) and error.retryable:
            explorer.observed(live.candidate.id, None)
            self.guards.cooldowns.failed(live.candidate.id, error)
            live.claims.verdict()
            self._close(live, f"error:{error.kind or 'error'}", error=error.kind or "error")
        else:
            self._close(live, "error:internal")

    def _nothing_left(self) -> GatewayError:
        if self.refused is not None and not self.errors:
            return self.refused
        if not self.errors and self.cooling_skipped:
            return CoolingDownError(
                f"Every deployment of '{self.policy.model}' is cooling down after failures.",
                retry_after_s=PROBE_WAIT_S,
            )
        failed = AllCandidatesFailedError(self.errors)
        # An upstream may ask for an absurd wait (retry-after: 99999); its deployment cools
        # down for at most the configured cap, so the client is not told to wait longer.
        wait, cap = failed.headers.get("retry-after"), math.ceil(self.guards.cooldowns.max_s)
        if wait is not None and wait.isdigit() and int(wait) > cap:
            failed.headers["retry-after"] = str(cap)
        return failed


EXPLORE_LIMIT_S = 10.0
"""How long an explored attempt that lost is timed when the request has no TTFT budget."""


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
                raise inband_error(candidate.id, chunk.error, candidate.provider.secrets)
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

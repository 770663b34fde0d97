"""The response: the race to a committed attempt, its head, the body or the SSE relay, the
client's disconnect, and failure after commit.

Bytes already sent cannot be taken back: once the status line is out, an upstream failure ends
the stream with an error event in the client's wire (never a clean end), and a failure of the
gateway itself does too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from starlette.types import Receive, Scope, Send

from gateway.api.admit import REQUEST_ID
from gateway.api.conversation import keep, owner_of
from gateway.api.outcome import RequestOutcome, record, start_trace
from gateway.api.render import send_error
from gateway.batching import BulkGate
from gateway.batching.preempt import BulkWork
from gateway.errors import (
    GatewayError,
    OverloadedError,
    ProviderError,
    ProviderTimeoutError,
    StreamInterruptedError,
    stream_error,
)
from gateway.latency import CANCELLED, TOTAL_DEADLINE, Snapshot
from gateway.models import Call, Wire
from gateway.routing import Decision, Ledger, Opened, Plan, open_first, prompt_band
from gateway.routing.attempts import PREEMPTED
from gateway.routing.deadline import before_commit, ran_out, stream_deadline
from gateway.routing.idle import IdleWatch
from gateway.runtime import Services

log = logging.getLogger("tailguard")

_JSON = b"application/json"
_SSE = b"text/event-stream; charset=utf-8"
DROPPED_TOOLS_HEADER = b"x-tailguard-dropped-tools"


class Proxy:
    """Runs the race and relays the answer, as an ASGI callable.

    A watcher cancels the work as soon as the client disconnects, streaming or not, so the
    upstream connection is closed at once (by the ledger that owns it, in the `finally`).
    """

    __slots__ = (
        "_bulk",
        "_call",
        "_client_gone",
        "_decision",
        "_gate_lane",
        "_gated",
        "_outcome",
        "_request_id",
        "_responded",
        "_services",
        "_started",
    )

    def __init__(self, services: Services, decision: Decision, outcome: RequestOutcome) -> None:
        self._services = services
        self._decision = decision
        self._call = decision.call
        self._outcome = outcome
        self._request_id = outcome.ctx.request_id
        self._client_gone = False
        self._started = False  # the status line went out: errors must now be in-band
        self._responded = False  # the last byte went out: a disconnect now is just the end
        self._gate_lane, self._bulk = _gate_of(decision, services.gate)
        self._gated = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.create_task(self._watch(receive, task))
        services, outcome, decision = self._services, self._outcome, self._decision
        services.enter()
        if services.tracing.enabled:
            start_trace(outcome)
        ledger = Ledger(
            decision.call,
            decision.budget,
            headers=decision.headers,
            recorder=services.recorder,
            guards=services.guards,
            inflight=services.latency,
            trace=outcome.trace,
            predictor=services.predictor,
        )
        try:
            await self._serve(send, ledger)
        except asyncio.CancelledError:
            # The client left: nothing is wrong with the server, unless something else (a
            # shutdown) asked for cancellation too.
            if not (self._client_gone and task.uncancel() == 0):
                # The server is shutting down and its grace period is over: a stream that
                # began says it was cut, rather than just stopping.
                outcome.error_type = "shutdown"
                await self._fail(send, "The gateway is shutting down.")
                raise
            outcome.error_type = "client_disconnected"
            if self._call.stream:
                # The client left mid-stream: what the stream showed so far still counts.
                ledger.ended(ok=False, error=CANCELLED, cut=True)
        except Exception:
            log.exception("request %s failed inside the gateway", self._request_id)
            outcome.status, outcome.error_type = 500, "internal"
            await self._fail(send)
        finally:
            try:
                await ledger.aclose(outcome.error_type)
            except Exception:  # closing the committed stream failed: the response is done
                log.exception("request %s failed inside the gateway", self._request_id)
                outcome.status, outcome.error_type = 500, "internal"
            finally:
                if self._gated and self._gate_lane is not None and services.gate is not None:
                    _ungate(services.gate, self._gate_lane, self._bulk)
                watcher.cancel()
                record(outcome)
                services.leave()

    async def _fail(self, send: Send, why: str | None = None) -> None:
        """Answer a failure of the gateway itself in the client's wire: a 500 (503 when shutting
        down) before the status was sent, an error event after it (never a silently cut
        stream). Best effort: the connection may be gone already."""
        if self._responded:
            return
        self._responded = True
        wire = self._call.wire
        try:
            if self._started:
                cut = StreamInterruptedError(
                    why or "The gateway failed while relaying the response."
                )
                body = _cut(self._outcome.opened, cut, wire)
                await send({"type": "http.response.body", "body": body, "more_body": False})
            elif why is not None:
                self._outcome.status = 503
                await send_error(send, OverloadedError(why), wire, self._request_id)
            else:
                error = GatewayError("The gateway failed to process the request.")
                await send_error(send, error, wire, self._request_id)
        except Exception:  # the client or the transport went away first
            log.debug("request %s: could not send the final error", self._request_id)

    async def _watch(self, receive: Receive, task: asyncio.Task[Any]) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not self._responded:
                    self._client_gone = True
                    task.cancel()
                return

    async def _serve(self, send: Send, ledger: Ledger) -> None:
        call, outcome = self._call, self._outcome
        try:
            opened = await before_commit(self._decision.budget, self._open(ledger))
        except GatewayError as error:
            if isinstance(error, ProviderError) or error.status >= 500:
                log.warning("request %s failed: %s", self._request_id, error.message)
            outcome.status, outcome.error_type = error.status, error.code or error.type
            await send_error(send, error, call.wire, self._request_id)
            self._responded = True
            return
        # From here the ledger holds the committed attempt: it is closed on every path.
        outcome.opened = opened
        outcome.status, outcome.error_type = 200, None
        _observe(self._services, self._decision, opened)
        if call.stream:
            await self._relay(opened, send, ledger)
        else:
            await self._respond(opened, send, ledger)

    async def _open(self, ledger: Ledger) -> Opened:
        """Everything before the commit: a bulk request's slot, then the race."""
        services = self._services
        plan, snapshot = self._decision.plan, services.latency.snapshot
        if self._gate_lane is not None and services.gate is not None:
            self._gated = True
            if self._bulk is not None:
                return await _open_bulk(self._bulk, self._outcome, ledger, plan, snapshot)
            services.gate.enter(self._gate_lane)
        return await open_first(ledger, plan, snapshot)

    async def _respond(self, opened: Opened, send: Send, ledger: Ledger) -> None:
        body = b"".join(opened.head)
        kept = _keep(self._outcome, self._call, opened)
        headers = _head(self._outcome, self._call, opened, _JSON)
        if not kept:  # the answer says `store: true`: say it was not (a read says why)
            headers.append((b"x-tailguard-stored", b"false"))
        headers.append((b"content-length", str(len(body)).encode()))
        self._started = True
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        self._responded = True
        ledger.ended()

    async def _relay(self, opened: Opened, send: Send, ledger: Ledger) -> None:
        call = self._call
        headers = _head(self._outcome, call, opened, _SSE)
        headers += [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
        self._started = True
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        tally = opened.tally
        translate = opened.prepared.stream.feed
        stream = opened.stream
        deadline = stream_deadline(self._decision.budget)
        failure: GatewayError | None = None
        finished = opened.ended
        body = b"".join(opened.head)
        pending = opened.pending
        idle_s = opened.candidate.provider.limits.idle_s
        idle = IdleWatch(idle_s)  # no content for idle_s (keep-alives or not): the stream ends
        try:
            while True:
                out = [body] if body else []
                now = time.perf_counter()  # one clock read per network read, not per event
                tokens = tally.tokens
                for chunk in pending:
                    if chunk.error is not None:
                        failure = StreamInterruptedError(
                            f"{opened.candidate.id}: upstream error after the stream began: "
                            f"{chunk.error.message[:300]}"
                        )
                        break
                    tally.add(chunk, now)
                    out.append(translate(chunk))
                    if chunk.done:
                        finished = True
                        break
                if tally.tokens != tokens:
                    idle.progressed()
                if finished:
                    _keep(
                        self._outcome, self._call, opened
                    )  # before the last event: the next turn may follow
                data = b"".join(out)
                if data:
                    await send({"type": "http.response.body", "body": data, "more_body": True})
                if failure is not None or finished:
                    break
                body = b""
                try:
                    idle.reading()
                    if deadline is None:  # no budget: skip the timer on this per-event path
                        batch = await stream.read()
                    else:
                        async with asyncio.timeout_at(deadline):
                            batch = await stream.read()
                    idle.read()
                except asyncio.CancelledError:
                    if not idle.expired():
                        raise
                    failure = _went_idle(opened.candidate.id, idle_s)
                    break
                except TimeoutError:
                    failure = ran_out(self._decision.budget, opened.candidate.id)
                    break
                if batch is None:
                    failure = StreamInterruptedError(
                        f"{opened.candidate.id}: the upstream ended the stream before it was "
                        "complete"
                    )
                    break
                pending = batch
        except ProviderError as error:
            failure = StreamInterruptedError(error.message)
        finally:
            idle.close()
        if failure is not None:
            log.warning("request %s: stream cut: %s", self._request_id, failure.message)
            self._outcome.error_type = failure.code
            tally.finish_reasons.append("error")
            body = _cut(opened, failure, call.wire)
            await send({"type": "http.response.body", "body": body, "more_body": False})
        else:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        self._responded = True
        # Cut by its own total budget, a stream is slow, not broken: its total is censored and
        # what it observed (TTFT, the pace of its tokens) still counts.
        cut = isinstance(failure, ProviderTimeoutError) and failure.kind == TOTAL_DEADLINE
        why = TOTAL_DEADLINE if cut else failure.code if failure is not None else None
        ledger.ended(ok=failure is None, error=why, cut=cut)


def _gate_of(decision: Decision, gate: BulkGate | None) -> tuple[str | None, BulkWork | None]:
    """Where bulk admission counts the request (its first candidate), and a bulk chat's
    slot-equivalents there, one per choice; an interactive request (none) is only counted, so
    bulk leaves it room (see gateway/batching/gate.py)."""
    call, candidates = decision.call, decision.plan.candidates
    if call.priority == "bulk" and (
        call.stream or call.endpoint in ("chat", "messages", "responses")
    ):
        lane = candidates[0].id
        return lane, BulkWork(gate, lane, max(1, call.n)) if gate is not None else None
    if call.priority == "interactive" and candidates:
        return candidates[0].id, None
    return None, None


async def _open_bulk(
    work: BulkWork, outcome: RequestOutcome, ledger: Ledger, plan: Plan, snapshot: Snapshot
) -> Opened:
    """A bulk request's slot-equivalents, then the race. Until it has an answer the gate may
    preempt it for an interactive request (gateway/batching/preempt.py): it is then sent again,
    on the same ledger."""
    await work.acquire()
    outcome.queue_s = work.queued_s
    try:
        return await work.run(
            lambda preempted: open_first(ledger, plan, snapshot, preempted),
            committed=lambda: ledger.winner is not None,
        )
    finally:
        outcome.queue_s = work.queued_s


def _ungate(gate: BulkGate, lane: str, bulk: BulkWork | None) -> None:
    if bulk is not None:
        bulk.release()
    else:
        gate.leave(lane)


def _went_idle(deployment: str, idle_s: float) -> ProviderTimeoutError:
    return ProviderTimeoutError(  # its message names the deployment
        f"no content from the upstream for {round(idle_s * 1000)} ms (the stream idle timeout)",
        deployment=deployment,
        kind="stream_idle",
    )


def _keep(outcome: RequestOutcome, call: Call, opened: Opened) -> bool:
    """Store a finished Responses API answer for `previous_response_id` and GET; False when it
    was to be stored and was not."""
    result = opened.prepared.result
    if result is not None and result.response is not None:
        owner = owner_of(outcome.ctx.principal)
        return keep(outcome.services.responses, call, result.response, owner)
    return True


def _cut(opened: Opened | None, error: GatewayError, wire: Wire) -> bytes:
    """The last bytes of a stream cut after it began, in the client's wire: the Responses API
    ends with its own `error` and `response.failed` events."""
    fail = opened.prepared.fail if opened is not None else None
    if fail is not None:
        return fail(error.code or error.type, error.message)
    return stream_error(error, wire)


def _observe(services: Services, decision: Decision, opened: Opened) -> None:
    """What the committed first token teaches bulk admission (the queue predictor learns in
    the `Ledger`, which also sees the attempts cut before theirs)."""
    call, budget = decision.call, decision.budget
    first = opened.tally.first_token_at
    if first is None or not call.stream:
        return
    band = prompt_band(len(call.raw))
    if call.priority == "interactive" and services.gate is not None:
        # Bulk admission on this deployment follows how interactive first tokens fare.
        ttft = first - budget.arrived
        services.gate.observe(opened.candidate.id, ttft, budget.ttft_s, band)


def _head(
    outcome: RequestOutcome, call: Call, opened: Opened, content_type: bytes
) -> list[tuple[bytes, bytes]]:
    """The response head of a committed attempt; notes what the gateway added (its overhead)."""
    arrived = outcome.ctx.arrived
    now = time.perf_counter()
    first = opened.attempts[0].started
    committed = opened.tally.first_token_at or now
    route_ms = (first - arrived) * 1000
    overhead_ms = route_ms + (now - committed) * 1000
    outcome.overhead_s = overhead_ms / 1000
    timing = [f"route;dur={route_ms:.2f}"]
    if outcome.queue_s is not None:
        timing.insert(0, f"queue;dur={outcome.queue_s * 1000:.1f}")
    for index, attempt in enumerate(opened.attempts):
        ended = attempt.ended or committed
        timing.append(
            f"attempt{index + 1};dur={(ended - attempt.started) * 1000:.1f};"
            f'desc="{attempt.deployment} {attempt.outcome}"'
        )
    if opened.connected:
        timing.append(f"connect;dur={(opened.connected - opened.started) * 1000:.1f}")
    stage = "ttft" if call.stream else "upstream"
    timing.append(f"{stage};dur={(committed - arrived) * 1000:.1f}")
    preempted = sum(a.outcome == PREEMPTED for a in opened.attempts)
    if preempted:  # bulk work the gate took its slot back from, and sent again
        timing.append(f'preempted;desc="{preempted}"')
    affinity = outcome.decision.plan.affinity if outcome.decision is not None else None
    if affinity is not None:  # cache-aware routing decided: hit, bounded, queue or miss
        timing.append(f'affinity;desc="{affinity}"')
    headers = [
        (b"content-type", content_type),
        (b"x-request-id", outcome.ctx.request_id.encode()),
        (b"x-tailguard-model", opened.candidate.model.encode()),
        (b"x-tailguard-deployment", opened.candidate.id.encode()),
        (b"x-tailguard-route", opened.route.encode()),
        (b"x-tailguard-attempts", str(len(opened.attempts)).encode()),
        (b"x-tailguard-overhead-ms", f"{overhead_ms:.3f}".encode()),
        (b"server-timing", ", ".join(timing).encode()),
    ]
    upstream_id = opened.stream.upstream_request_id
    if upstream_id and REQUEST_ID.match(upstream_id):  # never echo arbitrary bytes
        headers.append((b"x-upstream-request-id", upstream_id.encode()))
    if len(opened.attempts) > 1:
        headers.append((b"x-should-retry", b"false"))
    if opened.prepared.dropped:  # Responses tools the translated upstream went without
        headers.append((DROPPED_TOOLS_HEADER, ", ".join(opened.prepared.dropped).encode()))
    ticket = outcome.ticket
    if ticket is not None and ticket.verdict is not None:
        headers += ticket.verdict.headers(call.wire)
    return headers

"""The answer to a routed call: its admission, the race to a committed attempt, the response
head, and failure before and after the commit.

Bytes already sent cannot be taken back: once the status line is out, an upstream failure ends
the stream with an error event in the client's wire (never a clean end), and a failure of the
gateway itself does too. What goes out is written by `relay`; what it is, routing's `Committed`
decides.
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
from gateway.api.relay import Sent, send_stream, send_whole
from gateway.api.render import send_error
from gateway.batching.admission import Admission
from gateway.errors import GatewayError, OverloadedError, ProviderError, StreamInterruptedError
from gateway.models import Call
from gateway.routing import Decision, Ledger, Opened, open_first, prompt_band
from gateway.routing.attempts import PREEMPTED
from gateway.routing.committed import Committed, Keeper
from gateway.routing.deadline import before_commit
from gateway.runtime import Services

log = logging.getLogger("tailguard")

_JSON = b"application/json"
_SSE = b"text/event-stream; charset=utf-8"
DROPPED_TOOLS_HEADER = b"x-tailguard-dropped-tools"


class Proxy:
    """Runs the race and answers with what it committed to, as an ASGI callable.

    A watcher cancels the work as soon as the client disconnects, streaming or not, so the
    upstream connection is closed at once (by the ledger that owns it, in the `finally`).
    """

    __slots__ = (
        "_admission",
        "_call",
        "_client_gone",
        "_committed",
        "_decision",
        "_outcome",
        "_request_id",
        "_sent",
        "_services",
    )

    def __init__(self, services: Services, decision: Decision, outcome: RequestOutcome) -> None:
        self._services = services
        self._decision = decision
        self._call = decision.call
        self._outcome = outcome
        self._request_id = outcome.ctx.request_id
        self._client_gone = False
        self._sent = Sent()
        self._admission = _admission_of(decision, services)
        self._committed: Committed | None = None

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
            async with self._admission:
                await self._answer(send, ledger, task)
        finally:
            watcher.cancel()
            record(outcome)
            services.leave()

    async def _answer(self, send: Send, ledger: Ledger, task: asyncio.Task[Any]) -> None:
        outcome = self._outcome
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
            if self._call.stream and self._committed is not None:
                self._committed.client_left()
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

    async def _fail(self, send: Send, why: str | None = None) -> None:
        """Answer a failure of the gateway itself in the client's wire: a 500 (503 when shutting
        down) before the status was sent, an error event after it (never a silently cut
        stream). Best effort: the connection may be gone already."""
        sent = self._sent
        if sent.responded:
            return
        sent.responded = True
        wire = self._call.wire
        try:
            if sent.started and self._committed is not None:
                cut = StreamInterruptedError(
                    why or "The gateway failed while relaying the response."
                )
                body = self._committed.cut(cut)
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
                if not self._sent.responded:
                    self._client_gone = True
                    task.cancel()
                return

    async def _serve(self, send: Send, ledger: Ledger) -> None:
        call, outcome, decision = self._call, self._outcome, self._decision
        plan, snapshot = decision.plan, self._services.latency.snapshot
        admission = self._admission
        try:
            opened = await before_commit(
                decision.budget,
                admission.open(
                    lambda preempted: open_first(ledger, plan, snapshot, preempted),
                    committed=lambda: ledger.winner is not None,
                ),
            )
        except GatewayError as error:
            if isinstance(error, ProviderError) or error.status >= 500:
                log.warning("request %s failed: %s", self._request_id, error.message)
            outcome.status, outcome.error_type = error.status, error.code or error.type
            await send_error(send, error, call.wire, self._request_id)
            self._sent.responded = True
            return
        finally:
            outcome.queue_s = admission.queued_s
        # From here the ledger holds the committed attempt: it is closed on every path.
        committed = self._committed = Committed(opened, ledger, decision.budget, self._keeper())
        outcome.opened = opened
        outcome.status, outcome.error_type = 200, None
        first = opened.tally.first_token_at
        if first is not None and call.stream:
            band = prompt_band(len(call.raw))
            admission.first_token(
                opened.candidate.id, first - decision.budget.arrived, decision.budget.ttft_s, band
            )
        if not call.stream:
            body = committed.body()
            headers = _head(outcome, call, opened, _JSON)
            if not committed.stored:  # the answer says `store: true`: say it was not
                headers.append((b"x-tailguard-stored", b"false"))
            await send_whole(send, headers, body, self._sent)
            return
        headers = _head(outcome, call, opened, _SSE)
        await send_stream(send, headers, committed, self._sent)
        failure = committed.failure
        if failure is not None:
            log.warning("request %s: stream cut: %s", self._request_id, failure.message)
            outcome.error_type = failure.code

    def _keeper(self) -> Keeper | None:
        """Where a finished Responses answer is kept (for `previous_response_id` and GET)."""
        call, outcome = self._call, self._outcome
        if call.endpoint != "responses":
            return None
        store, owner = self._services.responses, owner_of(outcome.ctx.principal)
        return lambda response: keep(store, call, response, owner)


def _admission_of(decision: Decision, services: Services) -> Admission:
    """Where bulk admission counts the request (its first candidate), and a bulk chat's
    slot-equivalents there, one per choice; an interactive request is only counted, so bulk
    leaves it room (see gateway/batching/admission.py)."""
    call, candidates, gate = decision.call, decision.plan.candidates, services.gate
    if call.priority == "bulk" and (
        call.stream or call.endpoint in ("chat", "messages", "responses")
    ):
        return Admission(gate, candidates[0].id, max(1, call.n))
    if call.priority == "interactive" and candidates:
        return Admission(gate, candidates[0].id)
    return Admission(None, None)


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

"""Every attempt of one request and what each holds, with the one owner that closes them.

An attempt claims up to four things: a place in the in-flight count, the breaker's half-open
probe, a rescue slot (a hedge or a deadline failover) and, for a failover after an error, a
retry-budget token. `Ledger` begins every attempt of a request and closes each one once, whatever
ended it: the attempts that do not win as the race ends them, the committed one when the
response is done. Closing records the attempt's sample, ends its span and gives back its claims.
Each first token, and each attempt cut without one, also teaches the TTFT predictor.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.errors import InvalidRequestError
from gateway.latency import BYTES_PER_TOKEN, CANCELLED, HEDGE_LOST, TTFT_DEADLINE, Recorder, Sample
from gateway.latency.prompt_size import uncached_bytes
from gateway.models import AttemptEnd, Call, Chunk, Usage
from gateway.providers.request import Prepared, prepare
from gateway.routing.guards import Guards
from gateway.routing.plan import Budget, Candidate, Route
from gateway.routing.predict import TTFTPredictor, prompt_band
from gateway.telemetry.semconv import OPERATIONS
from gateway.upstream import UpstreamStream

MAX_FINISH_REASONS = 16  # kept per stream (an upstream may repeat one on every event)


class AttemptTracer(Protocol):
    """Spans per attempt (implemented by telemetry; routing only calls it)."""

    def attempt(
        self, *, operation: str, model: str, provider: str, address: str | None, hedge: bool
    ) -> tuple[Any, str]:
        """Start a span for an attempt; returns it and the `traceparent` to send upstream."""
        ...

    def capture_prompt(self, span: Any, body: Mapping[str, Any]) -> None: ...

    def end_attempt(self, span: Any, end: AttemptEnd) -> None: ...


class InflightTracker(Protocol):
    """Counts upstream attempts in flight (the latency store)."""

    def started(self, deployment: str, model: str | None = None) -> None: ...

    def finished(self, deployment: str, model: str | None = None) -> None: ...

    def inflight(self, tag: str) -> int: ...


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
    inflight: int | None = None  # this replica's other attempts on its deployment when sent


@dataclass(slots=True)
class Tally:
    """What the committed stream carried, for statistics and telemetry.

    Output tokens are the upstream's count when it reports one; else an estimate from the
    generated text's length (an event may carry many tokens), never less than one per content
    event and choice.
    """

    first_token_at: float | None = None
    last_token_at: float | None = None
    events: int = 0  # content events seen
    tokens: int = 0  # of those, one per choice with content (or a body's own count)
    text: int = 0  # UTF-8 bytes of the generated text they carried
    usage: Usage = field(default_factory=Usage)
    finish_reasons: list[str] = field(default_factory=list)

    def add(self, chunk: Chunk, now: float) -> None:
        if chunk.content:
            if self.first_token_at is None:
                self.first_token_at = now
            self.last_token_at = now
            self.events += 1
            self.tokens += chunk.tokens or 1
            self.text += chunk.text
        if chunk.usage is not None:
            if chunk.usage.input_tokens is not None:
                self.usage.input_tokens = chunk.usage.input_tokens
            if chunk.usage.output_tokens is not None:
                self.usage.output_tokens = chunk.usage.output_tokens
            if chunk.usage.cached_tokens is not None:
                self.usage.cached_tokens = chunk.usage.cached_tokens
            if chunk.usage.cache_write_tokens is not None:
                self.usage.cache_write_tokens = chunk.usage.cache_write_tokens
            if chunk.usage.upstream_latency_ms is not None:
                self.usage.upstream_latency_ms = chunk.usage.upstream_latency_ms
        if chunk.finish_reason is not None and len(self.finish_reasons) < MAX_FINISH_REASONS:
            self.finish_reasons.append(chunk.finish_reason)  # one per choice; bounded whatever

    @property
    def output_tokens(self) -> int:
        reported = self.usage.output_tokens
        if reported is not None:
            return reported
        return max(self.tokens, round(self.text / BYTES_PER_TOKEN))

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token: from the first content event to the last, over the
        tokens of every event but the first (which is taken to carry an average event's share);
        None without two content events."""
        first, last, events = self.first_token_at, self.last_token_at, self.events
        if first is None or last is None or events < 2:
            return None
        after = self.output_tokens * (events - 1) / events
        return (last - first) / after if after > 0 else None


@dataclass(slots=True)
class Opened:
    """An attempt that reached its first content token (or its end). The committed one is
    closed by its request's `Ledger`; `stream` is closed with it."""

    candidate: Candidate
    stream: UpstreamStream
    prepared: Prepared
    head: list[bytes]  # translated bytes up to and including the committing event
    pending: list[Chunk]  # events read in the same network read after the committing one
    tally: Tally
    ended: bool  # the upstream already finished (non-streaming, or a stream read to its end)
    attempts: list[Attempt] = field(default_factory=list)  # of the request, in start order
    started: float = 0.0  # when this attempt was opened (perf_counter seconds)
    connected: float = 0.0  # when its response headers arrived
    route: Route = "primary"
    hedge_for: str | None = None  # the winner is a rescue: its sample and cap belong to this model


@dataclass(slots=True, eq=False)
class Claims:
    """What one attempt holds: its place in the in-flight count, the breaker's half-open probe
    when it is the probe, and a rescue slot when it is a hedge or a deadline failover. `release`
    gives all of it back, once, whatever way the attempt ended."""

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
class Live:
    """An attempt begun, with its claims, until it is closed."""

    candidate: Candidate
    attempt: Attempt
    why: Route  # how this attempt came to be tried
    claims: Claims
    closed: bool = False  # its outcome is recorded and its claims given back
    explore: bool = False  # explores a routed-away deployment: if it loses, it is still timed


class Ledger:
    """One request's attempts, from the first begun to the last closed.

    Every attempt is registered by `begin` before anything that can fail, so nothing it claims
    can be missed. One that does not win is closed by `close` (as the race ends it, or by
    `close_losers`); the committed one gets its sample from `ended` once the response is done,
    and `aclose` ends its span and gives back its claims and its stream. The request counts in
    the retry budget's active requests from construction to `aclose`, which its owner must
    await on every path.
    """

    __slots__ = (
        "_closed",
        "_recorded",
        "_won",
        "attempts",
        "budget",
        "call",
        "claimed",
        "guards",
        "headers",
        "inflight",
        "opened",
        "predictor",
        "recorder",
        "retries",
        "trace",
        "winner",
    )

    def __init__(
        self,
        call: Call,
        budget: Budget,
        *,
        headers: dict[str, str],
        recorder: Recorder,
        guards: Guards,
        inflight: InflightTracker | None = None,
        trace: AttemptTracer | None = None,
        predictor: TTFTPredictor | None = None,
    ) -> None:
        self.call = call
        self.budget = budget
        self.headers = headers  # sent upstream with every attempt
        self.recorder = recorder
        self.guards = guards
        self.inflight = inflight
        self.trace = trace
        self.predictor = predictor
        self.claimed: list[Live] = []  # every attempt begun, closed or not
        self.attempts: list[Attempt] = []  # those sent upstream, in start order
        self.retries = 0  # retry-budget tokens held
        self.winner: Live | None = None
        self._won: Opened | None = None
        self.opened: Opened | None = None  # the winner, once handed to the response
        self._recorded = False  # the committed attempt's sample was handed to the store
        self._closed = False
        guards.retries.active += 1  # the retry budget is a share of the requests in progress

    def begin(
        self, candidate: Candidate, why: Route, *, probe: bool, rescue_for: str | None, first: bool
    ) -> tuple[Live, Prepared] | None:
        """Register an attempt on `candidate` and shape its request; None when this candidate
        cannot express the call (it is skipped). `first`: the plan's first choice, whose refusal
        is the request's fault: its InvalidRequestError is raised."""
        claims = Claims(candidate.id, candidate.model, self.guards, self.inflight, probe=probe)
        attempt = Attempt(candidate.id, candidate.model, time.perf_counter(), hedge=why == "hedge")
        live = Live(candidate, attempt, why, claims)
        self.claimed.append(live)
        headers = self.headers
        trace = self.trace
        upstream_model, provider = candidate.deployment.model, candidate.provider
        if trace is not None:
            attempt.span, traceparent = trace.attempt(
                operation=OPERATIONS.get(self.call.endpoint, self.call.endpoint),
                model=upstream_model,
                provider=provider.system,
                address=provider.address,
                hedge=why == "hedge",
            )
            headers = {**headers, "traceparent": traceparent}
        try:
            policy = candidate.unsupported_tools  # what a translation does with hosted tools
            prepared = prepare(self.call, provider, upstream_model, headers, policy)
        except InvalidRequestError as error:
            self.close(live, "skipped", span_error=error.code)
            if not self.attempts and first:
                raise  # the first choice cannot take the request: the request is at fault
            return None  # a fallback that cannot express this request is skipped
        if trace is not None:
            trace.capture_prompt(attempt.span, self.call.body)
        self.attempts.append(attempt)
        if self.inflight is not None:
            attempt.inflight = self.inflight.inflight(candidate.id)
            self.inflight.started(candidate.id, candidate.model)
            claims.counted = True
        claims.rescue_for = rescue_for
        return live, prepared

    def retry_token(self) -> bool:
        """A retry-budget token for a failover after an error (given back by `release_retries`);
        the request's first is never refused (see `RetryBudget.acquire`)."""
        if not self.guards.retries.acquire(first=self.retries == 0):
            return False
        self.retries += 1
        return True

    def release_retries(self) -> None:
        if self.retries:
            self.guards.retries.release(self.retries)
            self.retries = 0

    def won(self, live: Live, opened: Opened) -> Opened:
        """`live` committed: from here its claims are held until `aclose`."""
        self.winner, self._won = live, opened
        live.attempt.outcome = "won"
        self.guards.cooldowns.succeeded(live.candidate.id)
        live.claims.verdict()
        opened.attempts = self.attempts
        opened.started = live.attempt.started
        opened.route = live.why
        opened.hedge_for = live.claims.rescue_for
        first = opened.tally.first_token_at
        if first is not None:
            _teach(self.predictor, self.call, live, first - live.attempt.started)
        if live.explore and first is not None:  # the explored one answered first
            self.guards.explorer.observed(live.candidate.id, first - live.attempt.started)
        if live.attempt.hedge:
            self.guards.hedges.count(self.budget.model, "won")
        return opened

    def close(
        self,
        live: Live,
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
                if ttft_s is not None or ttft_over is not None:
                    seen = ttft_s if ttft_s is not None else elapsed
                    _teach(self.predictor, self.call, live, seen, censored=ttft_s is None)
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
                        hedge_for=live.claims.rescue_for,
                        endpoint=self.call.endpoint,
                        prompt_bytes=len(self.call.raw),
                        wasted=wasted,
                    )
                )
            if attempt.span is not None and self.trace is not None:
                failed = outcome.startswith("error:")
                error_type = span_error or (outcome[6:] if failed else None)
                self.trace.end_attempt(attempt.span, AttemptEnd(outcome, error_type))

    def close_losers(self) -> None:
        """Close every attempt begun but the winner and the explored ones still being timed;
        with a winner, each was work thrown away."""
        winner = self.winner
        for live in self.claimed:
            if live is winner or live.closed or (live.explore and winner is not None):
                continue
            beaten = winner is not None and live.attempt.started < winner.attempt.started
            self.close(live, HEDGE_LOST if beaten else CANCELLED, wasted=winner is not None)

    def ended(self, *, ok: bool = True, error: str | None = None, cut: bool = False) -> None:
        """The committed attempt's sample, once its response is done (nothing without one).
        `cut`: the stream ended before the upstream finished for a reason not the upstream's
        (the total budget, the client leaving), so its total is censored ("more than this");
        what it observed (TTFT, the pace of its tokens) counts."""
        opened = self.opened
        if opened is None or self._recorded:
            return
        self._recorded = True
        if self.call.stream:
            sample = _stream_sample(self.call, opened, ok=ok, error=error, cut=cut)
        else:
            sample = _body_sample(self.call, opened)
        self.recorder.record(sample)

    async def aclose(self, error_type: str | None = None) -> None:
        """The request is done with its attempts: end the committed attempt's span
        (`error_type`: how the request failed after commit, if it did), give back its claims
        and close its stream (a winner never handed over is closed the same way); the request
        leaves the retry budget's count. Once; the losers are closed already."""
        if self._closed:
            return
        self._closed = True
        self.guards.retries.active -= 1
        live, opened = self.winner, self._won
        if live is None or opened is None:
            return
        try:
            span = live.attempt.span
            if self.opened is not None and span is not None and self.trace is not None:
                tally = opened.tally
                first = tally.first_token_at
                end = AttemptEnd(
                    "won" if error_type is None else f"won:{error_type}",
                    error_type,
                    ttft_s=first - opened.started if first is not None else None,
                    usage=tally.usage,
                    output_tokens=tally.output_tokens,
                    finish_reasons=tuple(tally.finish_reasons),
                    response_model=opened.candidate.deployment.model,
                )
                self.trace.end_attempt(span, end)
            live.claims.release()
        finally:
            await opened.stream.aclose()


def _body_sample(call: Call, opened: Opened) -> Sample:
    """A complete non-streaming answer: its total only (its first token is its whole body)."""
    tally = opened.tally
    return Sample(
        opened.candidate.id,
        opened.candidate.model,
        ok=True,
        total_s=time.perf_counter() - opened.started,
        input_tokens=tally.usage.input_tokens,
        output_tokens=tally.output_tokens,
        hedge_for=opened.hedge_for,
        endpoint=call.endpoint,
        prompt_bytes=uncached_bytes(
            len(call.raw), tally.usage.input_tokens, tally.usage.cached_tokens
        ),
    )


def _teach(
    predictor: TTFTPredictor | None,
    call: Call,
    live: Live,
    ttft_s: float,
    *,
    censored: bool = False,
) -> None:
    """A streamed attempt's TTFT (`censored`: cut this long after it was sent, without
    one) for the predictor: against the queue its vLLM server's scrape showed, else against
    this replica's in-flight count on the deployment when it was sent (its knee)."""
    candidate = live.candidate
    if predictor is None or not call.stream:
        return
    band = prompt_band(len(call.raw))
    if candidate.queue is not None and not candidate.from_inflight:
        if not censored:  # what the vLLM fit learns from: first tokens only
            predictor.observe(candidate.id, band, candidate.queue, ttft_s)
    elif live.attempt.inflight is not None:
        predictor.observe_sent(candidate.id, band, live.attempt.inflight, ttft_s, censored=censored)


def _stream_sample(call: Call, opened: Opened, *, ok: bool, error: str | None, cut: bool) -> Sample:
    tally = opened.tally
    ended = time.perf_counter()
    ttft = tally.first_token_at - opened.started if tally.first_token_at else None
    return Sample(
        opened.candidate.id,
        opened.candidate.model,
        ok=ok,
        total_s=ended - opened.started,
        ttft_s=ttft,
        tpot_s=tally.tpot_s,
        input_tokens=tally.usage.input_tokens,
        output_tokens=tally.output_tokens,
        error=error,
        hedge_for=opened.hedge_for,
        endpoint=call.endpoint,
        prompt_bytes=uncached_bytes(
            len(call.raw), tally.usage.input_tokens, tally.usage.cached_tokens
        ),
        total_over_s=ended - opened.started if cut else None,
    )

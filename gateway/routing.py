"""Routing: which deployments a call may go to, in what order, and the one attempt loop.

`plan` is pure policy. `open_first` is the only place where fallback happens: it opens candidates
in order until one produces its first content token (the commit point). Once it returns, bytes
flow to the client and the choice is final.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gateway.config import DeploymentSpec, ModelSpec, Settings
from gateway.errors import (
    AllCandidatesFailedError,
    InvalidRequestError,
    ProviderError,
    ProviderTimeoutError,
)
from gateway.latency import TTFT_DEADLINE, Recorder, Sample
from gateway.models import Call, Chunk, Usage
from gateway.providers import can_serve
from gateway.providers.base import Provider, UpstreamStream, inband_error
from gateway.providers.request import Prepared, prepare

NEXT_CANDIDATE_SHARE = 0.5
"""An attempt that has a successor gets this share of the remaining TTFT budget; the successor
gets the rest. (Routing on each candidate's observed p99 TTFT is the next step.)"""


class InflightTracker(Protocol):
    """Counts upstream attempts in flight; the committed attempt's owner calls `finished`."""

    def started(self, deployment: str, model: str | None = None) -> None: ...

    def finished(self, deployment: str, model: str | None = None) -> None: ...


@dataclass(frozen=True, slots=True)
class Candidate:
    """One deployment the call may be sent to, and the model name it serves under."""

    model: str
    deployment: DeploymentSpec
    provider: Provider

    @property
    def id(self) -> str:
        return self.deployment.id


def weighted_order(
    deployments: Sequence[DeploymentSpec], rng: random.Random
) -> list[DeploymentSpec]:
    """A random order where a deployment's chance to come first is proportional to its weight."""
    if len(deployments) < 2:
        return list(deployments)
    # Efraimidis-Spirakis: sort by u^(1/w), largest first.
    keyed = sorted(
        ((rng.random() ** (1.0 / d.weight), i) for i, d in enumerate(deployments)), reverse=True
    )
    return [deployments[i] for _, i in keyed]


def fallback_chain(spec: ModelSpec, settings: Settings) -> list[ModelSpec]:
    """The model, then its fallbacks, then theirs (breadth first, each model once)."""
    chain = [spec]
    names = {spec.name}
    index = 0
    while index < len(chain):
        for name in chain[index].fallbacks:
            model = settings.model(name)
            if model is not None and name not in names:
                names.add(name)
                chain.append(model)
        index += 1
    return chain


def plan(
    chain: Sequence[ModelSpec],
    providers: Mapping[str, Provider],
    call: Call,
    rng: random.Random,
) -> list[Candidate]:
    """The deployments of `chain` (the model, then its fallbacks: see `fallback_chain`), each
    model's in weighted order, each deployment once, skipping those that cannot serve the call.

    Raises InvalidRequestError when no configured deployment can serve this kind of call.
    """
    candidates: list[Candidate] = []
    seen: set[str] = set()
    for model in chain:
        for deployment in weighted_order(model.deployments, rng):
            provider = providers[deployment.provider]
            if deployment.id not in seen and can_serve(provider, call.endpoint):
                seen.add(deployment.id)
                candidates.append(Candidate(model.name, deployment, provider))
    if not candidates:
        raise InvalidRequestError(
            f"model {chain[0].name!r} has no deployment that serves {call.endpoint} requests",
            param="model",
        )
    return candidates


@dataclass(slots=True)
class Attempt:
    """One upstream try, and why it ended (`won`, `error:429`, `ttft_deadline`, ...)."""

    deployment: str
    model: str
    started: float
    ended: float | None = None
    outcome: str = "open"


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
        if chunk.finish_reason is not None:
            self.finish_reasons.append(chunk.finish_reason)

    @property
    def output_tokens(self) -> int:
        return self.usage.output_tokens if self.usage.output_tokens is not None else self.tokens


@dataclass(slots=True)
class Opened:
    """A committed attempt. The caller owns `stream` and must `aclose()` it."""

    candidate: Candidate
    stream: UpstreamStream
    prepared: Prepared
    head: list[bytes]  # translated bytes up to and including the committing event
    pending: list[Chunk]  # events read in the same network read after the committing one
    tally: Tally
    attempts: list[Attempt]
    started: float  # when this attempt was opened (perf_counter seconds)
    ended: bool  # the upstream already finished (non-streaming, or a stream read to its end)
    route: str  # primary | error_fallback | ttft_failover


async def open_first(
    call: Call,
    candidates: Sequence[Candidate],
    *,
    headers: dict[str, str],
    recorder: Recorder,
    inflight: InflightTracker | None = None,
    ttft_budget_s: float | None = None,
) -> Opened:
    """Open candidates in order until one commits; the only place fallback happens.

    Raises the first non-retryable ProviderError, or AllCandidatesFailedError.
    """
    errors: list[ProviderError] = []
    attempts: list[Attempt] = []
    route = "primary"
    loop_started = time.perf_counter()
    last = len(candidates) - 1
    for index, candidate in enumerate(candidates):
        started = time.perf_counter()
        attempt = Attempt(candidate.id, candidate.model, started)
        attempts.append(attempt)
        try:
            prepared = prepare(call, candidate.provider, candidate.deployment.model, headers)
        except InvalidRequestError:
            if index == 0:
                raise  # the first choice cannot take the request: the request is at fault
            attempts.pop()  # a fallback that cannot express this request is skipped
            continue
        stream: UpstreamStream | None = None
        if inflight is not None:
            inflight.started(candidate.id, candidate.model)
        try:
            remaining = None
            if ttft_budget_s is not None:
                remaining = max(0.0, loop_started + ttft_budget_s - started)
                if index < last:
                    # Leave the next candidate room to land inside the budget too.
                    remaining *= NEXT_CANDIDATE_SHARE
            try:
                async with asyncio.timeout(remaining):
                    stream = await candidate.provider.open(candidate.id, prepared.request)
                    opened = await _until_first_token(candidate, stream, prepared)
            except TimeoutError:
                raise ProviderTimeoutError(
                    f"no first token within the {round((ttft_budget_s or 0) * 1000)} ms budget",
                    deployment=candidate.id,
                    kind=TTFT_DEADLINE,
                ) from None
        except ProviderError as error:
            attempt.ended = time.perf_counter()
            attempt.outcome = (
                TTFT_DEADLINE if error.kind == TTFT_DEADLINE else f"error:{error.kind}"
            )
            if inflight is not None:
                inflight.finished(candidate.id, candidate.model)
            if stream is not None:
                await stream.aclose()
            if not error.retryable:
                raise  # the request itself was refused: not the deployment's failure
            recorder.record(
                Sample(
                    candidate.id,
                    candidate.model,
                    ok=False,
                    total_s=attempt.ended - started,
                    error=error.kind,
                )
            )
            errors.append(error)
            if route == "primary":
                route = "ttft_failover" if error.kind == TTFT_DEADLINE else "error_fallback"
            continue
        except BaseException:
            if inflight is not None:
                inflight.finished(candidate.id, candidate.model)
            if stream is not None:
                await stream.aclose()
            raise
        attempt.outcome = "won"
        opened.attempts = attempts
        opened.started = started
        opened.route = route
        return opened
    raise AllCandidatesFailedError(errors)


async def _until_first_token(
    candidate: Candidate, stream: UpstreamStream, prepared: Prepared
) -> Opened:
    """Read until the first content token (or the end); raise on an in-band error before it."""
    head: list[bytes] = []
    tally = Tally()
    translate = prepared.stream.feed if stream.streaming else prepared.body
    while True:
        batch = await stream.read()
        if batch is None:
            if not stream.streaming:
                return _opened(candidate, stream, prepared, head, [], tally, ended=True)
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
                return _opened(
                    candidate,
                    stream,
                    prepared,
                    head,
                    batch[index + 1 :],
                    tally,
                    ended=chunk.done or not stream.streaming,
                )


def _opened(
    candidate: Candidate,
    stream: UpstreamStream,
    prepared: Prepared,
    head: list[bytes],
    pending: list[Chunk],
    tally: Tally,
    *,
    ended: bool,
) -> Opened:
    return Opened(candidate, stream, prepared, head, pending, tally, [], 0.0, ended, "primary")

"""Where one admitted call goes: candidates, the batcher swap, predictions and the plan.

`decide` reads the services the request was admitted under and returns one `Decision`: the
call, the ordered plan, the budget its attempts run under and the headers they forward. It
never awaits, so the request keeps what it read to its end.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from gateway.config import ModelSpec
from gateway.latency import LatencyStore
from gateway.latency.vllm import ServerLoad, ServerState
from gateway.models import Call
from gateway.routing.affinity import Affinity
from gateway.routing.guards import Guards
from gateway.routing.measured import with_measured_tpot
from gateway.routing.plan import (
    Budget,
    Candidate,
    Plan,
    baseline_p50_ms,
    by_inflight,
    by_prediction,
    candidates,
    plan,
    with_exploration,
)
from gateway.routing.predict import TTFTPredictor, prompt_band
from gateway.upstream import Provider


class Routes(Protocol):
    """What `decide` reads from the services a request was admitted under."""

    @property
    def chains(self) -> Mapping[str, list[ModelSpec]]: ...
    @property
    def providers(self) -> Mapping[str, Provider]: ...
    @property
    def latency(self) -> LatencyStore: ...
    @property
    def guards(self) -> Guards: ...
    @property
    def rng(self) -> random.Random: ...
    @property
    def servers(self) -> Mapping[str, ServerState]: ...  # vLLM load, by provider
    @property
    def predictor(self) -> TTFTPredictor: ...
    @property
    def affinity(self) -> Affinity: ...  # the prompt prefixes each vLLM server was sent


@dataclass(frozen=True, slots=True)
class Decision:
    """Where one call goes, and how."""

    call: Call
    plan: Plan
    budget: Budget
    headers: dict[str, str]  # sent upstream with every attempt (x-request-id, traceparent...)
    # The id of the first candidate the plan was made from: the one a request goes to when
    # nothing moves it (budget, cooldown, failover). An answer from any other is a fallback.
    first: str = ""


def decide(
    routes: Routes,
    call: Call,
    spec: ModelSpec,
    budget: Budget,
    *,
    headers: dict[str, str],
    batchers: Mapping[str, Provider] | None = None,
) -> Decision:
    """Route an admitted call for `spec`. `batchers` (by deployment id): the micro-batch queues
    a bulk call goes through instead of its deployment, when it is one they batch. Raises
    InvalidRequestError when no deployment serves this kind of call. Deployments cooling down
    are left out, unless every one is: then none is (the race sends the request as a probe)."""
    snapshot = routes.latency.snapshot
    routes.latency.arrived(spec.name)  # caps on extra load are a share of client requests
    explored = routes.guards.explorer.latest()
    found = candidates(
        routes.chains[spec.name], routes.providers, call, routes.rng, snapshot, explored
    )
    if batchers:
        found = [replace(c, provider=batchers[c.id]) if c.id in batchers else c for c in found]
    if routes.servers:
        found = with_measured_tpot(found, routes.servers)
        found = by_prediction(found, predictions(routes, found, call))
    # Providers without a load scrape: their queue is inferred from this replica's in-flight.
    found = by_inflight(found, inflight_predictions(routes, found, call))
    # The server that holds this prompt's prefix in its cache leads, within its load bound.
    steering = routes.affinity.steer(found, call, routes.servers, routes.latency.inflight)
    found = steering.found
    cooling: Mapping[str, float] | None = routes.guards.cooldowns.cooling()
    if cooling and all(c.id in cooling for c in found):
        # Nowhere to route around to: the request is not refused but sent, as the probe, one
        # at a time (see `_Race._await_probe`), as a plain proxy would send it.
        cooling = None
    chosen = plan(found, call, budget, cooling=cooling)
    if spec.max_fallback_share is not None:
        shares = routes.guards.fallbacks
        moved = moved_for_latency(chosen, spec.name)
        if moved and not shares.allows(spec.name, spec.max_fallback_share):
            # Over the cap: the requested model's own fittest deployment leads.
            chosen = plan(found, call, budget, cooling=cooling, fallback_lead=False)
            moved = moved_for_latency(chosen, spec.name)
        shares.count(spec.name, moved=moved)
    if budget.ttft_s is not None and spec.on_ttft_miss != "none" and budget.may_hedge:
        # A deployment routed away is now and then tried again, raced by the one that serves.
        chosen = with_exploration(chosen, found, routes.guards.explorer.due)
    return Decision(call, steering.settle(chosen), budget, headers, first=found[0].id)


def moved_for_latency(chosen: Plan, model: str) -> bool:
    """Whether `chosen` leads with a fallback model for latency (routed by budget) while a
    deployment of the requested `model` was available: what `max_fallback_share` bounds."""
    lead = chosen.candidates[0]
    return (
        chosen.route in ("budget", "budget_unattainable")
        and lead.model != model
        and any(c.model == model for c in chosen.candidates)
    )


def predictions(
    routes: Routes, found: Sequence[Candidate], call: Call
) -> dict[str, tuple[float, float]]:
    """Predicted TTFT (and the queue it assumes) of each vLLM candidate whose load is known.

    The queue counts the requests this replica sent since the scrape once they overflow the
    server's batch slots (`TTFTPredictor.queued`). A server with no latency history of its own
    (just added, or idle since before the window) is predicted from the lowest baseline of the
    model's other vLLM servers, so its queue ranks it among them instead of after them all."""
    band = prompt_band(len(call.raw))
    predictor = routes.predictor
    loaded: list[tuple[Candidate, ServerLoad, float, float | None, float | None]] = []
    for candidate in found:
        server = routes.servers.get(candidate.deployment.provider)
        load = server.current() if server is not None else None
        if server is None or load is None:
            continue
        queue = predictor.queued(
            candidate.id,
            running=load.running,
            waiting=load.waiting,
            scraped_at=load.scraped_at,
            slots=server.slots,
            inflight=routes.latency.inflight(candidate.id),
        )
        stats = candidate.stats
        # The unloaded baseline: the deployment's typical TTFT for a prompt of this size.
        ttft_p50 = _finite_s(baseline_p50_ms(stats, len(call.raw))) if stats else None
        if ttft_p50 is None:
            ttft_p50 = server.recent_ttft_p50()
        total_p50 = _finite_s(stats.total.p50) if stats else None
        loaded.append((candidate, load, queue, ttft_p50, total_p50))
    out: dict[str, tuple[float, float]] = {}
    for candidate, load, queue, ttft_p50, total_p50 in loaded:
        if ttft_p50 is None:
            siblings = [
                (base, total)
                for other, _, _, base, total in loaded
                if other.model == candidate.model and base is not None
            ]
            if siblings:
                ttft_p50, borrowed_total = min(siblings, key=lambda s: s[0] or 0.0)
                total_p50 = total_p50 if total_p50 is not None else borrowed_total
        predicted = predictor.predict(
            candidate.id,
            band,
            waiting=queue,
            running=load.running,
            ttft_p50_s=ttft_p50,
            total_p50_s=total_p50,
        )
        if predicted is not None:
            out[candidate.id] = (predicted, queue)
    return out


def inflight_predictions(
    routes: Routes, found: Sequence[Candidate], call: Call
) -> dict[str, tuple[float, float]]:
    """Predicted TTFT (and the queue it assumes) of each candidate without a load scrape that a
    request sent now would queue at: this replica's in-flight attempts on it are at or above
    its learned knee (`TTFTPredictor.predict_inflight`). Below the knee, or with none learned,
    a candidate gets no prediction and its latency statistics judge it."""
    out: dict[str, tuple[float, float]] = {}
    band: str | None = None
    for candidate in found:
        if candidate.deployment.provider in routes.servers:
            continue  # a vLLM server: its scrape says more than the in-flight count
        if band is None:
            band = prompt_band(len(call.raw))
        stats = candidate.stats
        predicted = routes.predictor.predict_inflight(
            candidate.id,
            band,
            routes.latency.inflight(candidate.id),
            total_p50_s=_finite_s(stats.total.p50) if stats else None,
        )
        if predicted is not None:
            out[candidate.id] = predicted
    return out


def _finite_s(ms: float | None) -> float | None:
    """Milliseconds as seconds; None when unknown (no samples, or beyond every cut)."""
    return ms / 1000 if ms is not None and ms != float("inf") else None

"""The plan: which deployments a call may go to, in what order, and when to rescue an attempt.

Pure policy. It reads the latency snapshot and the set of cooling deployments it is given and
touches neither the network nor the clock, so every decision is unit-testable.

The model for a TTFT budget B: an attempt is given until its *deadline* to produce a first token;
at the deadline its successor is started (a failover cancels the attempt, a hedge keeps it). The
deadline leaves the successor room to land inside B: it is B minus the successor's p99 TTFT plus a
margin (half of B when the successor is unknown). A candidate *fits* when the share of its first
tokens that would come after its deadline is within what a successor may rescue (the hedge cap, or
the retry budget), or when its p99 fits B outright. The successor that rescues a candidate is the
fastest other one that can land (see `rescuer`): a deployment of the same model or a fallback.

The model the client asked for is kept unless it cannot be saved: its deployments are judged
first, each with its rescuer, and a fallback model leads only when none of them fits. A
predicted total is admitted with headroom (`TOTAL_HEADROOM`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from gateway.config import DeploymentSpec, ModelSpec, OnTotalMiss, OnTTFTMiss, Settings
from gateway.errors import CoolingDownError, InvalidRequestError
from gateway.latency import Snapshot
from gateway.latency.prompt_size import band_of
from gateway.models import Call
from gateway.providers import can_serve

# What a candidate is, and its TTFT for a prompt's size (re-exported: the planner's vocabulary).
from gateway.routing.candidate import BAND_EVIDENCE as BAND_EVIDENCE
from gateway.routing.candidate import Candidate as Candidate
from gateway.routing.candidate import Level as Level
from gateway.routing.candidate import baseline_p50_ms as baseline_p50_ms
from gateway.routing.candidate import ttft_for_size as ttft_for_size
from gateway.upstream import Provider

Route = Literal[
    "primary", "budget", "budget_unattainable", "ttft_failover", "hedge", "error_fallback"
]

SUCCESSOR_MARGIN = 1.1
"""A successor's p99 TTFT is padded by 10% (the sketch's own error, drift since the snapshot)."""
UNKNOWN_SHARE = 0.5
"""A successor whose TTFT is unknown is explored, as a hedge, once this share of the budget is
gone."""
HEDGE_LEVEL: Literal["p90"] = "p90"
"""The successor's TTFT quantile a hedge is timed by: a hedge wins on the typical case."""
EXPLORE_MAX_BYTES = 4096
"""Explorations are made with requests of at most this many bytes (~1k prompt tokens): one of
the two attempts is thrown away, so the prompt it prefilled should be short; what they measure
speaks for prompts of that size only."""
TOTAL_HEADROOM = 0.9
"""A candidate fits a total budget when its predicted total is within 90% of it: the prediction
is a p99 from a sketch (2% error) over a window that lags drift, and a stream that overruns is
either finished late or cut (`on_total_miss`), so the plan keeps a tenth of the budget spare."""


@dataclass(frozen=True, slots=True)
class Budget:
    """What a request must meet, counted from its arrival, and how a TTFT miss may be rescued
    (built by `deadline.budget_for`; the planner reads the figures, the race the rest)."""

    ttft_s: float | None = None  # streaming only; None: no deadline, attempts run until they end
    total_s: float | None = None
    tpot_s: float | None = None  # a per-token target (`x-slo-tpot-ms`), streaming only
    on_ttft_miss: OnTTFTMiss = "failover"
    on_total_miss: OnTotalMiss = "finish"  # a committed stream past total_s: finished or cut
    rescue_share: float = 0.2  # share of requests a successor may take over (hedge cap, retries)
    model: str = ""  # the model the client asked for: whose rescue cap is spent
    arrived: float = 0.0  # perf_counter time the request arrived: every budget counts from here
    may_hedge: bool = True  # False for a client's own retry: do not multiply it

    @property
    def quantile(self) -> Literal["p90", "p95", "p99"]:
        """The TTFT quantile that must meet an attempt's deadline for it to fit."""
        if self.on_ttft_miss == "none":
            return "p99"
        if self.rescue_share >= 0.10:
            return "p90"
        return "p95" if self.rescue_share >= 0.05 else "p99"


@dataclass(frozen=True, slots=True)
class Plan:
    candidates: list[Candidate]  # in try order
    route: Route  # why the first candidate leads: primary | budget | budget_unattainable | ...
    ttft_rescue: bool = True  # False: a late first token is not worth a failover or a hedge
    # The first candidate is explored: it was routed away, and is tried with the one that would
    # have served started beside it at once, so the client gets whichever answers first.
    explore: bool = False
    affinity: str | None = None  # what cache-aware routing decided (routing/affinity.py)


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


def candidates(
    chain: Sequence[ModelSpec],
    providers: Mapping[str, Provider],
    call: Call,
    rng: random.Random,
    snapshot: Snapshot | None = None,
    explored: Mapping[str, float] | None = None,
) -> list[Candidate]:
    """The deployments of `chain` (the model, then its fallbacks: see `fallback_chain`), each
    model's in weighted order, each deployment once, skipping those that cannot serve the call.
    `explored`: what recent explorations measured (see `Explorer.latest`).

    Raises InvalidRequestError when no configured deployment can serve this kind of call.
    """
    stats = snapshot.deployments if snapshot is not None else {}
    recent = snapshot.recent if snapshot is not None else {}
    explored = explored or {}
    found: list[Candidate] = []
    seen: set[str] = set()
    for model in chain:
        for deployment in weighted_order(model.deployments, rng):
            provider = providers[deployment.provider]
            if deployment.id not in seen and can_serve(provider, call.endpoint):
                seen.add(deployment.id)
                found.append(
                    Candidate(
                        model.name,
                        deployment,
                        provider,
                        stats.get(deployment.id),
                        prompt_bytes=len(call.raw),
                        recent=recent.get(deployment.id),
                        explored_s=explored.get(deployment.id),
                        unsupported_tools=model.unsupported_tools,
                    )
                )
    if not found:
        raise InvalidRequestError(
            f"model {chain[0].name!r} has no deployment that serves {call.endpoint} requests",
            param="model",
        )
    return found


def by_prediction(
    found: Sequence[Candidate], predictions: Mapping[str, tuple[float, float]]
) -> list[Candidate]:
    """Attach predicted TTFTs (deployment id -> (predicted seconds, queue)) and, within each
    model, put the deployments with a prediction first, fastest first: several vLLM servers
    behind one model are balanced by predicted TTFT, not by weight. Those without one keep
    their order after them."""
    if not predictions:
        return list(found)
    out: list[Candidate] = []
    index = 0
    while index < len(found):
        end = index
        while end < len(found) and found[end].model == found[index].model:
            end += 1
        group = []
        for candidate in found[index:end]:
            known = predictions.get(candidate.id)
            if known is not None:
                candidate = replace(candidate, predicted_ttft_s=known[0], queue=known[1])
            group.append(candidate)
        group.sort(
            key=lambda c: (0, c.predicted_ttft_s) if c.predicted_ttft_s is not None else (1, 0.0)
        )
        out.extend(group)
        index = end
    return out


def by_inflight(
    found: Sequence[Candidate], predictions: Mapping[str, tuple[float, float]]
) -> list[Candidate]:
    """Attach the TTFTs predicted from in-flight counts (deployment id -> (predicted seconds,
    queue): deployments without a load scrape, above their knee) and move each such candidate
    after the siblings of its model expected to answer sooner (their prediction, else their
    median TTFT for this prompt; unknown counts as sooner). The others keep their order."""
    if not predictions:
        return list(found)
    out = list(found)
    for candidate in found:
        known = predictions.get(candidate.id)
        if known is None:
            continue
        loaded = replace(candidate, predicted_ttft_s=known[0], queue=known[1], from_inflight=True)
        at = next(i for i, c in enumerate(out) if c is candidate)
        del out[at]
        for index in range(at, len(out)):  # only ever later: after the last sibling sooner
            other = out[index]
            if other.model == candidate.model and _sooner(other, known[0]):
                at = index + 1
        out.insert(at, loaded)
    return out


def _sooner(other: Candidate, predicted_s: float) -> bool:
    expected = other.ttft_quantile_s("p50")
    return expected is None or expected < predicted_s


def deadline(remaining_s: float, successor: Candidate | None) -> float | None:
    """How long an attempt may wait for its first token before `successor` replaces it: what
    remains once the successor's padded p99 TTFT is set aside. None when a failover cannot help:
    no successor, one not yet measured (see `explore_point`: it is tried by a hedge instead), or
    one whose p99 would not land inside the budget either (cutting would only restart the wait)."""
    need = successor.ttft_p99_s if successor is not None else None
    if need is None:
        return None
    need *= SUCCESSOR_MARGIN
    return remaining_s - need if need < remaining_s else None


def explore_point(remaining_s: float, successor: Candidate | None) -> float | None:
    """When to start a successor nobody has measured yet, as a hedge (the attempt keeps
    running, so exploring costs the client nothing): once this share of the budget is gone.
    Only with a short prompt (`EXPLORE_MAX_BYTES`): the loser's prefill is thrown away."""
    if successor is None or _typical_s(successor) is not None:
        return None
    if successor.prompt_bytes is not None and successor.prompt_bytes > EXPLORE_MAX_BYTES:
        return None
    return remaining_s * UNKNOWN_SHARE


def _typical_s(candidate: Candidate) -> float | None:
    """What a hedge can count on from `candidate`: its p90 TTFT, trusted or seen in a few
    samples (a fallback that serves little is still known to be fast), else its p99 or the
    configured prior (a stand-in on the slow side), else unknown."""
    typical = candidate.ttft_quantile_s(HEDGE_LEVEL)
    if typical is None:
        typical = candidate.ttft_seen_s(HEDGE_LEVEL)
    return typical if typical is not None else candidate.ttft_p99_s


def hedge_point(
    remaining_s: float,
    candidate: Candidate,
    successor: Candidate | None,
    *,
    early: Level = "p95",
) -> float | None:
    """When to start a hedge. A hedge wins on the successor's typical TTFT (its p90), not its
    tail, so it starts once what remains is just that (padded). When the budget is tight (the
    candidate's p99 plus the successor would not fit) it starts earlier, as early as the
    successor's p99 needs to land and never before the candidate's own `early` quantile (p90
    when the cap allows 20% of requests, else p95). None when no hedge could land in time, when
    even the candidate's p99 comes before the hedge would land (nothing to rescue), or when the
    latest point falls before the candidate's own p90 (a guess, not a rescue). An unknown
    successor is explored at `explore_point`."""
    if successor is None:
        return None
    typical = _typical_s(successor)
    if typical is None:
        at = explore_point(remaining_s, successor)
        soon = candidate.ttft_quantile_s(early)
        if at is not None and soon is not None and soon < at:
            return soon  # the attempt is late by its own measure before half the budget
        return at
    need = typical * SUCCESSOR_MARGIN
    if need >= remaining_s:
        # A heavy-tailed successor's p90 may sit in its tail: its median may still land.
        median = successor.ttft_quantile_s("p50")
        if median is None or median * SUCCESSOR_MARGIN >= remaining_s:
            return None
        need = median * SUCCESSOR_MARGIN
    at = remaining_s - need
    # A lead that serves little (a fallback leading long prompts) is judged by what it showed.
    soon = candidate.ttft_quantile_s(early) or candidate.ttft_seen_s(early)
    sized = candidate.ttft_seen_for_size_s(early)
    if soon is not None and sized is not None:
        soon = max(soon, sized)  # a few long prompts say the deployment-wide figure is short
    p99 = candidate.ttft_p99_s or candidate.ttft_seen_s("p99")
    if soon is not None and p99 is not None and p99 + need > remaining_s:
        if soon < at:
            # Early enough for the successor's tail to land as well, but no earlier: a hedge
            # started while the attempt is only slower than usual mostly loses to it, and one
            # of the two prefills is thrown away.
            tail = successor.ttft_p99_s or typical  # no tail known: none to wait for
            safe = remaining_s - tail * SUCCESSOR_MARGIN
            at = min(at, max(soon, safe))
            # Even its p99 comes before a hedge started then would land (a fast lead, a slower
            # rescuer): it has no tail to rescue, only a prefill to throw away.
            return None if p99 <= at + typical else at
        own = _typical_s(candidate)
        if own is not None and at < own:
            # It would hedge more than a tenth of these prompts (a long one, whose typical first
            # token is near the last point a rescue could start): a guess that mostly loses,
            # its prefill thrown away, not a rescue.
            return None
    floor = candidate.ttft_seen_for_size_s(HEDGE_LEVEL)
    if floor is not None and at < floor:
        return None  # the same guess, seen in a few prompts of this size before it is trusted
    return at


def lands_first(candidate: Candidate, wait_s: float, successor: Candidate) -> bool:
    """Whether an attempt still waiting at `wait_s` is expected to answer before a successor
    started then would: its typical TTFT for this prompt lies beyond the wait (it is not late,
    only long) and before the successor's typical landing. Such an attempt is never cut."""
    own = candidate.ttft_quantile_s("p50") or candidate.ttft_seen_s("p50")
    theirs = successor.ttft_quantile_s("p50") or successor.ttft_seen_s("p50")
    if own is None or theirs is None or math.isinf(own):
        return False
    return wait_s < own <= wait_s + theirs


def rescue_point(
    remaining_s: float,
    candidate: Candidate,
    successor: Candidate | None,
    *,
    hedge: bool,
    share: float = 0.05,
) -> float | None:
    """When an attempt without a first token is rescued (by a hedge, or a failover that cuts
    it); None when it is left to run. `share`: the rescue cap, as a share of requests."""
    if successor is None:
        return None
    if hedge:
        # Hedging from the attempt's p90 would spend a 10% cap on fast requests as well as on
        # the slow ones it exists for: p90 only when the cap leaves room for both.
        early: Level = "p90" if share >= 0.20 else "p95"
        return hedge_point(remaining_s, candidate, successor, early=early)
    at = deadline(remaining_s, successor)
    if at is None:
        return explore_point(remaining_s, successor)
    return None if lands_first(candidate, at, successor) else at


def fits(
    candidate: Candidate, successor: Candidate | None, budget: Budget, call: Call
) -> bool | None:
    """Whether `candidate` can meet the budget (with `successor` to rescue its misses);
    None when there is nothing to judge it by yet."""
    verdicts: list[bool] = []
    first_by: float | None = None  # the first token comes by then (alone or rescued)
    if budget.ttft_s is not None and call.stream:
        p99 = candidate.ttft_p99_s
        if p99 is not None:
            at = None
            if successor is not None and budget.on_ttft_miss != "none":
                hedge = budget.on_ttft_miss == "hedge"
                at = rescue_point(
                    budget.ttft_s, candidate, successor, hedge=hedge, share=budget.rescue_share
                )
            rescuable = at is not None
            cut = at if at is not None else budget.ttft_s
            # A prediction is this request's own expected TTFT, not a tail: the attempt would be
            # cut at its deadline, so that is what it must meet.
            alone = p99 <= (cut if candidate.predicted_ttft_s is not None else budget.ttft_s)
            rescued = False
            if rescuable:
                late = candidate.ttft_quantile_s(budget.quantile)
                # Rescued only if the successor, started at the deadline, can still land in time.
                rescued = late is not None and late <= cut < budget.ttft_s
            verdicts.append(alone or rescued)
            if alone or rescued:
                first_by = budget.ttft_s
    if budget.total_s is not None:
        total = candidate.predicted_total_s(call.max_tokens, ttft_at_most_s=first_by)
        if total is None:
            total = _typical_total_s(candidate, call.max_tokens)
        if total is not None:
            verdicts.append(total <= budget.total_s * TOTAL_HEADROOM)
    if budget.tpot_s is not None and call.stream:
        tpot = candidate.tpot_p99_s
        if tpot is not None:
            verdicts.append(tpot <= budget.tpot_s)
    return all(verdicts) if verdicts else None


def plan(
    found: Sequence[Candidate],
    call: Call,
    budget: Budget,
    *,
    cooling: Mapping[str, float] | None = None,
    fallback_lead: bool = True,
) -> Plan:
    """Order `found` (from `candidates`) for this call.

    Deployments in `cooling` (id → seconds until they may be tried) are left out; when all are,
    raises CoolingDownError with the soonest retry-after. The first remaining candidate that fits
    the budget, with its `rescuer` to rescue a late first token, leads (an unknown one fits: it
    is explored); its rescuer follows it, then the rest in their order. When none fits, the one
    with the lowest predicted latency leads and the route says so. `fallback_lead=False` (the
    model's `max_fallback_share` is spent): while a deployment of the requested model is
    available, only those may lead; fallback models still rescue.
    """
    available = [c for c in found if not cooling or c.id not in cooling]
    if not available:
        assert cooling is not None
        soonest = min(cooling[c.id] for c in found)
        raise CoolingDownError(
            f"Every deployment of '{found[0].model}' is cooling down after failures.",
            retry_after_s=soonest,
        )
    route: Route = "primary" if available[0] is found[0] else "error_fallback"
    if budget.ttft_s is None and budget.total_s is None and budget.tpot_s is None:
        return Plan(available, route)
    requested = found[0].model
    own_only = not fallback_lead and any(c.model == requested for c in available)
    best: tuple[float, int, Candidate | None] | None = None
    for index, candidate in enumerate(available):
        if own_only and candidate.model != requested:
            continue
        others = available[:index] + available[index + 1 :]
        successor = rescuer(candidate, others, budget, call)
        verdict = fits(candidate, successor, budget, call)
        if verdict is False and recovered(candidate, successor, budget, call):
            verdict = True
        if verdict is None or verdict:
            if index == 0:
                return Plan(_rescued_by(candidate, successor, others), route)
            return _budget_lead(candidate, successor, others, budget, call)
        cost = _cost(candidate, budget, call)
        if cost is not None and (best is None or cost < best[0]):
            best = (cost, index, successor)
    if best is None:
        return Plan(available, route)
    _, index, successor = best
    lead = available[index]
    others = available[:index] + available[index + 1 :]
    return Plan(_rescued_by(lead, successor, others), "budget_unattainable")


def rescuer(
    lead: Candidate, others: Sequence[Candidate], budget: Budget, call: Call
) -> Candidate | None:
    """Who rescues `lead`'s late first token: of `others` (any deployment, of the requested
    model or a fallback), the one whose rescue point is latest, that is the fastest to land by
    the measure the rescue is timed with (its typical TTFT for a hedge, its padded p99 for a
    failover). Without one that is measured and can land, the first of `others` (an unknown one
    is explored as a hedge); None when there are no others."""
    if not others:
        return None
    if budget.ttft_s is None or not call.stream or budget.on_ttft_miss == "none":
        return others[0]
    hedge = budget.on_ttft_miss == "hedge"
    best: Candidate | None = None
    latest = (-math.inf, 0.0)
    for other in others:
        typical = _typical_s(other)
        if typical is None:
            continue  # unmeasured: explored only when nothing measured can land
        at = rescue_point(budget.ttft_s, lead, other, hedge=hedge, share=budget.rescue_share)
        # The same rescue point (both started at the lead's own late quantile): the faster wins.
        if at is not None and (at, -typical) > latest:
            best, latest = other, (at, -typical)
    return best if best is not None else others[0]


def _rescued_by(
    lead: Candidate, successor: Candidate | None, others: Sequence[Candidate]
) -> list[Candidate]:
    """The lead, its rescuer next (the race rescues with the candidate after the lead), then
    the rest in their order."""
    if successor is None:
        return [lead, *others]
    return [lead, successor, *(c for c in others if c is not successor)]


def recovered(
    candidate: Candidate, successor: Candidate | None, budget: Budget, call: Call
) -> bool:
    """Whether a candidate the window says does not fit fits on its last few seconds alone (with
    enough samples there to judge): it was routed away and is better now. The full window would
    hold the bad spell for its whole length; the recent view lets traffic return in seconds."""
    explored = candidate.explored_s
    short = candidate.prompt_bytes is None or candidate.prompt_bytes <= EXPLORE_MAX_BYTES
    if explored is not None and short and budget.ttft_s is not None and explored <= budget.ttft_s:
        return True  # its latest explorations (short prompts) all answered within the budget
    recent = candidate.recent
    if recent is None or not recent.trusted:
        return False
    if candidate.prompt_bytes is not None and recent.bands:
        # Only what it showed for prompts of this size: short ones flowing to it prove
        # nothing about long ones it is routed away for.
        own = recent.bands.get(band_of(candidate.prompt_bytes))
        if own is None or own.ttft.count < BAND_EVIDENCE:
            return False
    return fits(replace(candidate, stats=recent, recent=None), successor, budget, call) is True


def with_exploration(chosen: Plan, found: Sequence[Candidate], due: Callable[[str], bool]) -> Plan:
    """`chosen`, or, when it leads with another deployment because the preferred one (the first
    of `found` still on the list) did not fit and `due(preferred id)` says it is time, a plan
    that explores the preferred one: it goes first, with the chosen lead started beside it."""
    if chosen.route != "budget" or len(chosen.candidates) < 2:
        return chosen
    preferred = next((c for c in found if c in chosen.candidates), None)
    if preferred is None or preferred is chosen.candidates[0]:
        return chosen
    if preferred.predicted_ttft_s is not None and not preferred.from_inflight:
        return chosen  # its load is read from the server itself: exploring would only add to it
    # A knee learned from in-flight counts is explored like a latency: it may be stale.
    if preferred.recent is not None and preferred.recent.trusted:
        return chosen  # it still gets traffic (other requests fit it): its samples are fresh
    if preferred.prompt_bytes is not None and preferred.prompt_bytes > EXPLORE_MAX_BYTES:
        return chosen  # one of the two prefills is thrown away: explore with a short prompt
    if not due(preferred.id):
        return chosen
    rest = [c for c in chosen.candidates if c is not preferred]
    return Plan([preferred, *rest], chosen.route, chosen.ttft_rescue, explore=True)


def _typical_total_s(candidate: Candidate, max_tokens: int | None) -> float | None:
    """Before TTFT and TPOT are trusted: a total that even their medians put over budget is
    evidence enough (a few streams cut by the budget all show the same pace), so a deployment
    that cannot finish in time stops being tried after `BAND_EVIDENCE` streams, not
    `min_samples`; None without that many."""
    stats = candidate.stats
    tokens = max_tokens or (stats.output_tokens if stats else None)
    if stats is None or not tokens or stats.tpot.count < BAND_EVIDENCE:
        return None
    ttft, tpot = stats.ttft.p50, stats.tpot.p50
    if ttft is None or tpot is None or math.isinf(ttft):
        return None
    typical = (ttft + tpot * max(0.0, tokens - 1)) / 1000.0
    return typical if typical > 0 else None


def _budget_lead(
    lead: Candidate,
    successor: Candidate | None,
    others: Sequence[Candidate],
    budget: Budget,
    call: Call,
) -> Plan:
    """A later candidate leads because the earlier ones cannot meet the budget. Its rescuer
    follows it when one can land in time: a lead that can stall keeps its rescue, whether or
    not the rescuer would meet the budget on its own (a hedge needs only its typical TTFT).
    Failing over back into one that cannot land (a saturated local server, say) would not help
    a late first token: after the rescuer, those that fit follow first; with no rescuer that
    lands and none that fits, the lead gets no TTFT deadline."""
    verdicts = [(c, fits(c, None, budget, call) is not False) for c in others]
    fitting = [c for c, fit in verdicts if fit]
    rest = [c for c, fit in verdicts if not fit]
    lands = successor is not None and _lands(lead, successor, budget, call)
    if lands:
        assert successor is not None
        order = _rescued_by(lead, successor, [*fitting, *rest])
    else:
        order = [lead, *fitting, *rest]
    return Plan(order, "budget", ttft_rescue=lands or bool(fitting))


def _lands(lead: Candidate, successor: Candidate, budget: Budget, call: Call) -> bool:
    """Whether `successor` can rescue a late first token on `lead` inside the TTFT budget."""
    if budget.ttft_s is None or not call.stream or budget.on_ttft_miss == "none":
        return False
    hedge = budget.on_ttft_miss == "hedge"
    at = rescue_point(budget.ttft_s, lead, successor, hedge=hedge, share=budget.rescue_share)
    return at is not None


def _cost(candidate: Candidate, budget: Budget, call: Call) -> float | None:
    """How far over budget a candidate is expected to be, relative to the budget."""
    over: list[float] = []
    if budget.ttft_s is not None and call.stream:
        p99 = candidate.ttft_p99_s
        if p99 is not None:
            over.append(p99 / budget.ttft_s)
    if budget.total_s is not None:
        total = candidate.predicted_total_s(call.max_tokens)
        if total is not None:
            over.append(total / budget.total_s)
    return max(over) if over else None

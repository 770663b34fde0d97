"""The plan: which deployments a call may go to, in what order, and when to rescue an attempt.

Pure policy. It reads the latency snapshot and the set of cooling deployments it is given and
touches neither the network nor the clock, so every decision is unit-testable.

The model for a TTFT budget B: an attempt is given until its *deadline* to produce a first token;
at the deadline its successor is started (a failover cancels the attempt, a hedge keeps it). The
deadline leaves the successor room to land inside B: it is B minus the successor's p99 TTFT plus a
margin (half of B when the successor is unknown). A candidate *fits* when the share of its first
tokens that would come after its deadline is within what a successor may rescue (the hedge cap, or
the retry budget), or when its p99 fits B outright.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from gateway.config import DeploymentSpec, ModelSpec, OnTTFTMiss, Settings
from gateway.errors import CoolingDownError, InvalidRequestError
from gateway.latency import MetricStats, Snapshot, TargetStats
from gateway.models import Call
from gateway.providers import can_serve
from gateway.providers.base import Provider

Route = Literal[
    "primary", "budget", "budget_unattainable", "ttft_failover", "hedge", "error_fallback"
]

SUCCESSOR_MARGIN = 1.1
"""A successor's p99 TTFT is padded by 10% (the sketch's own error, drift since the snapshot)."""
UNKNOWN_SHARE = 0.5
"""An attempt whose successor's TTFT is unknown gets this share of the remaining budget."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """One deployment the call may be sent to, the model name it serves under, and what the
    window says about it (None: no samples yet)."""

    model: str
    deployment: DeploymentSpec
    provider: Provider
    stats: TargetStats | None = None
    # A vLLM deployment whose load is known: the TTFT predicted from its queue right now, and
    # the queue it was predicted from (see gateway/routing/predict.py).
    predicted_ttft_s: float | None = None
    queue: float | None = None

    @property
    def id(self) -> str:
        return self.deployment.id

    @property
    def ttft_p99_s(self) -> float | None:
        """The TTFT predicted from the server's load, else the trusted observed p99, else the
        configured prior, else unknown."""
        if self.predicted_ttft_s is not None:
            return self.predicted_ttft_s
        return _trusted(self.stats.ttft if self.stats else None, "p99", self._prior("ttft_ms"))

    def ttft_quantile_s(self, level: Literal["p90", "p95", "p99"]) -> float | None:
        """The predicted TTFT, else a trusted observed quantile (the prior only knows p99)."""
        if self.predicted_ttft_s is not None:
            return self.predicted_ttft_s
        return _trusted(self.stats.ttft if self.stats else None, level, self._prior("ttft_ms"))

    def predicted_total_s(self, max_tokens: int | None) -> float | None:
        """p99 TTFT + p99 TPOT * expected output tokens (`max_tokens`, or the observed mean
        length); the observed p99 total when the parts are unknown (a non-streaming deployment)."""
        stats = self.stats
        ttft = self.ttft_p99_s
        tpot = _trusted(stats.tpot if stats else None, "p99", self._prior("tpot_ms"))
        tokens = max_tokens or (stats.output_tokens if stats else None)
        if ttft is not None and tpot is not None and tokens:
            return ttft + tpot * max(0.0, tokens - 1)
        return _trusted(stats.total if stats else None, "p99", None)

    def _prior(self, name: Literal["ttft_ms", "tpot_ms"]) -> float | None:
        prior = self.deployment.prior
        value = getattr(prior, name) if prior is not None else None
        return None if value is None else value / 1000.0


def _trusted(
    stats: MetricStats | None, level: Literal["p90", "p95", "p99"], prior_s: float | None
) -> float | None:
    if stats is not None and stats.trusted:
        value: float | None = getattr(stats, level)
        if value is not None:
            return value / 1000.0
    return prior_s if level == "p99" else None


@dataclass(frozen=True, slots=True)
class Budget:
    """What a request must meet, and how a TTFT miss may be rescued."""

    ttft_s: float | None = None  # streaming only
    total_s: float | None = None
    on_ttft_miss: OnTTFTMiss = "failover"
    rescue_share: float = 0.2  # share of requests a successor may take over (hedge cap, retries)

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
) -> list[Candidate]:
    """The deployments of `chain` (the model, then its fallbacks: see `fallback_chain`), each
    model's in weighted order, each deployment once, skipping those that cannot serve the call.

    Raises InvalidRequestError when no configured deployment can serve this kind of call.
    """
    stats = snapshot.deployments if snapshot is not None else {}
    found: list[Candidate] = []
    seen: set[str] = set()
    for model in chain:
        for deployment in weighted_order(model.deployments, rng):
            provider = providers[deployment.provider]
            if deployment.id not in seen and can_serve(provider, call.endpoint):
                seen.add(deployment.id)
                found.append(Candidate(model.name, deployment, provider, stats.get(deployment.id)))
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


def deadline(remaining_s: float, successor: Candidate | None) -> float:
    """How long an attempt may wait for its first token before `successor` is started: what
    remains once the successor's padded p99 TTFT is set aside; half of it when the successor is
    unknown; all of it when the successor could not land inside the budget anyway."""
    if successor is None:
        return remaining_s
    need = successor.ttft_p99_s
    if need is None:
        return remaining_s * UNKNOWN_SHARE
    need *= SUCCESSOR_MARGIN
    return remaining_s - need if need < remaining_s else remaining_s


def hedge_point(remaining_s: float, candidate: Candidate, successor: Candidate | None) -> float:
    """When to start a hedge: at the deadline, or at the candidate's observed p95 when that is
    earlier and the budget is tight (its p99 plus a failover would not fit)."""
    at = deadline(remaining_s, successor)
    p95, p99 = candidate.ttft_quantile_s("p95"), candidate.ttft_p99_s
    need = successor.ttft_p99_s if successor is not None else None
    if p95 is not None and p99 is not None and need is not None:
        tight = p99 + need * SUCCESSOR_MARGIN > remaining_s
        if tight and p95 < at:
            return p95
    return at


def fits(
    candidate: Candidate, successor: Candidate | None, budget: Budget, call: Call
) -> bool | None:
    """Whether `candidate` can meet the budget (with `successor` to rescue its misses);
    None when there is nothing to judge it by yet."""
    verdicts: list[bool] = []
    if budget.ttft_s is not None and call.stream:
        p99 = candidate.ttft_p99_s
        if p99 is not None:
            rescuable = successor is not None and budget.on_ttft_miss != "none"
            cut = deadline(budget.ttft_s, successor) if rescuable else budget.ttft_s
            # A prediction is this request's own expected TTFT, not a tail: the attempt would be
            # cut at its deadline, so that is what it must meet.
            alone = p99 <= (cut if candidate.predicted_ttft_s is not None else budget.ttft_s)
            rescued = False
            if rescuable:
                late = candidate.ttft_quantile_s(budget.quantile)
                # Rescued only if the successor, started at the deadline, can still land in time.
                rescued = late is not None and late <= cut < budget.ttft_s
            verdicts.append(alone or rescued)
    if budget.total_s is not None:
        total = candidate.predicted_total_s(call.max_tokens)
        if total is not None:
            verdicts.append(total <= budget.total_s)
    return all(verdicts) if verdicts else None


def plan(
    found: Sequence[Candidate],
    call: Call,
    budget: Budget,
    *,
    cooling: Mapping[str, float] | None = None,
) -> Plan:
    """Order `found` (from `candidates`) for this call.

    Deployments in `cooling` (id → seconds until they may be tried) are left out; when all are,
    raises CoolingDownError with the soonest retry-after. The first remaining candidate that fits
    the budget leads (an unknown one fits: it is explored); the rest follow in their order. When
    none fits, the one with the lowest predicted latency leads and the route says so.
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
    if budget.ttft_s is None and budget.total_s is None:
        return Plan(available, route)
    best: tuple[float, int] | None = None
    for index, candidate in enumerate(available):
        # Whoever leads, the first of the others follows it.
        successor = None if len(available) == 1 else available[1 if index == 0 else 0]
        verdict = fits(candidate, successor, budget, call)
        if verdict is None or verdict:
            if index == 0:
                return Plan(available, route)
            return _budget_lead(available, index, budget, call)
        cost = _cost(candidate, budget, call)
        if cost is not None and (best is None or cost < best[0]):
            best = (cost, index)
    if best is None:
        return Plan(available, route)
    return Plan(_lead(available, best[1]), "budget_unattainable")


def _budget_lead(available: list[Candidate], index: int, budget: Budget, call: Call) -> Plan:
    """A later candidate leads because the earlier ones cannot meet the budget. Failing over
    back into one of those (a saturated local server, say) would not help a late first token:
    the ones that fit follow first, and with none of them the lead gets no TTFT deadline."""
    lead = available[index]
    others = available[:index] + available[index + 1 :]
    fitting = [c for c in others if fits(c, None, budget, call) is not False]
    rest = [c for c in others if fits(c, None, budget, call) is False]
    return Plan([lead, *fitting, *rest], "budget", ttft_rescue=bool(fitting))


def _lead(available: list[Candidate], index: int) -> list[Candidate]:
    return [available[index], *available[:index], *available[index + 1 :]]


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

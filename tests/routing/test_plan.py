"""The latency-budget planner: pure policy over hand-built statistics, no network, no clock."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace

import pytest

from gateway.config import (
    DeploymentSpec,
    ModelSpec,
    OnTTFTMiss,
    PriorSpec,
    build_settings,
)
from gateway.errors import CoolingDownError, InvalidRequestError
from gateway.latency import BandStats, MetricStats, Snapshot, TargetStats
from gateway.latency.prompt_size import band_of
from gateway.models import Call, Endpoint
from gateway.routing.plan import (
    Budget,
    Candidate,
    baseline_p50_ms,
    candidates,
    deadline,
    explore_point,
    fallback_chain,
    fits,
    hedge_point,
    lands_first,
    plan,
    rescue_point,
    rescuer,
    ttft_for_size,
    weighted_order,
    with_exploration,
)
from tests.fakes.seam import FakeProvider

MIN_SAMPLES = 20


@dataclass
class StubProvider(FakeProvider):
    """Just enough of a `Provider` for the planner, which never opens a call."""

    name: str = "p"
    system: str = "stub"
    endpoints: frozenset[Endpoint] = field(default_factory=lambda: frozenset({"chat"}))

    def supports(self, endpoint: Endpoint) -> bool:
        return endpoint in self.endpoints


def metric(
    p99: float, *, p95: float | None = None, p90: float | None = None, count: int = 100
) -> MetricStats:
    """Percentiles in ms; p90 and p95 default to p99 (a flat distribution)."""
    p95 = p99 if p95 is None else p95
    p90 = p95 if p90 is None else p90
    return MetricStats(p90 / 2, p90, p95, p99, count, count >= MIN_SAMPLES)


NO_DATA = MetricStats(None, None, None, None, 0, False)


def stats(
    ttft: MetricStats = NO_DATA,
    tpot: MetricStats = NO_DATA,
    total: MetricStats = NO_DATA,
    output_tokens: float | None = None,
) -> TargetStats:
    return TargetStats(
        ttft=ttft,
        tpot=tpot,
        total=total,
        requests=max(ttft.count, total.count),
        errors=0,
        inflight=0,
        output_tokens=output_tokens,
    )


def cand(
    name: str,
    ttft: MetricStats | None = None,
    *,
    tpot: MetricStats = NO_DATA,
    output_tokens: float | None = None,
    prior: PriorSpec | None = None,
) -> Candidate:
    """A deployment `p/<name>` of model `m`; no `ttft` means no statistics at all."""
    spec = DeploymentSpec(provider="p", model=name, prior=prior)
    target = None if ttft is None else stats(ttft, tpot, output_tokens=output_tokens)
    return Candidate("m", spec, StubProvider(), target)


def call(*, stream: bool = True, max_tokens: int | None = None) -> Call:
    return Call("chat", "m", {}, b"{}", stream, max_tokens=max_tokens)


def ids(found: list[Candidate]) -> list[str]:
    return [c.deployment.model for c in found]


FAST, SLOW, SLOWER = metric(300.0), metric(3000.0), metric(5000.0)
STRICT = Budget(ttft_s=1.0, on_ttft_miss="none")


# --- ordering by budget ------------------------------------------------------------------------


def test_without_a_budget_the_order_is_kept() -> None:
    """No TTFT or total budget: the candidates stay in their order and the route is primary."""
    found = [cand("a", SLOW), cand("b", FAST)]
    chosen = plan(found, call(), Budget())
    assert ids(chosen.candidates) == ["a", "b"]
    assert chosen.route == "primary"


def test_the_first_that_fits_leads() -> None:
    """A first candidate whose trusted p99 TTFT fits the budget leads as the primary."""
    chosen = plan([cand("a", FAST), cand("b", FAST)], call(), STRICT)
    assert ids(chosen.candidates) == ["a", "b"]
    assert chosen.route == "primary"


def test_a_later_candidate_that_fits_leads_and_the_rest_keep_their_order() -> None:
    """The first that fits is moved to the front (route budget); of the others, those that
    fit follow first (failing over back to one that cannot meet the budget would not help), each
    group in its order; with one of them to rescue it, the lead keeps its TTFT deadline."""
    found = [cand("a", SLOW), cand("b", SLOWER), cand("c", FAST), cand("d", FAST)]
    chosen = plan(found, call(), STRICT)
    assert ids(chosen.candidates) == ["c", "d", "a", "b"]
    assert chosen.route == "budget"
    assert chosen.ttft_rescue


def test_a_budget_lead_with_no_fitting_successor_gets_no_ttft_deadline() -> None:
    """When no other candidate fits either, nor could land in time as a rescue (no rescue
    here: `on_ttft_miss: none`), a late first token on the lead is waited for."""
    chosen = plan([cand("a", SLOW), cand("c", FAST)], call(), STRICT)
    assert ids(chosen.candidates) == ["c", "a"]
    assert not chosen.ttft_rescue


@pytest.mark.parametrize(
    "lead",
    [
        metric(990.0, p95=600.0, p90=300.0),  # fits by its p99, with a tail that can stall
        metric(8000.0, p95=5000.0, p90=200.0),  # fits only if its 8% stalls are rescued
    ],
)
def test_a_budget_lead_keeps_a_rescue_when_no_other_candidate_fits(lead: MetricStats) -> None:
    """Every request routed by budget keeps a rescue when its lead can stall: a candidate that
    would not meet the budget alone (its own stalls put its p99 over) still lands a hedge in
    its typical 0.25 s, so it follows the lead and the lead keeps its TTFT deadline. (Before,
    no other candidate fitting meant no deadline: the lead's stalls were waited out.)"""
    budget = Budget(ttft_s=1.0, on_ttft_miss="hedge", rescue_share=0.10)
    slow = cand("a", SLOW)  # 3 s flat: neither fits nor lands in time
    rescuing = cand("c", metric(1500.0, p95=1200.0, p90=250.0))
    assert fits(rescuing, None, budget, call()) is False
    chosen = plan([slow, cand("b", lead), rescuing], call(), budget)
    assert ids(chosen.candidates) == ["b", "c", "a"]
    assert chosen.route == "budget"
    assert chosen.ttft_rescue


# --- the rescuer, and the model the client asked for ---------------------------------------------


def fallback(name: str, ttft: MetricStats) -> Candidate:
    """A deployment `p/<name>` of the fallback model `small`."""
    return replace(cand(name, ttft), model="small")


# The production trace's three: a primary whose 8% first tokens stall for seconds, a slow second
# provider of the same model, and a fast smaller fallback model.
PRIMARY = metric(8000.0, p95=5000.0, p90=200.0)  # 8% stall: p90 0.2 s, p99 8 s
SECOND = metric(1500.0, p95=1200.0, p90=850.0)


@pytest.mark.parametrize("on_ttft_miss", ["hedge", "failover"])
def test_the_rescuer_is_the_fastest_candidate_not_the_next_in_order(
    on_ttft_miss: OnTTFTMiss,
) -> None:
    """The primary is rescued by whoever lands soonest, a fallback model included: timed by the
    fast fallback (p90 0.3 s: a hedge at 0.67 s) its p90 of 0.2 s is rescued and it keeps
    the request, with the fallback next to rescue it. (Before, its rescuer was the next
    deployment in weight order, the slow second provider: a hedge point of 0.065 s fell before
    the primary's own p90, so it "did not fit" and the fallback model served every request.)"""
    budget = Budget(ttft_s=1.0, on_ttft_miss=on_ttft_miss, rescue_share=0.10, model="m")
    primary, second, small = cand("large", PRIMARY), cand("second", SECOND), fallback("s", FAST)
    chosen = plan([primary, second, small], call(), budget)
    assert ids(chosen.candidates) == ["large", "s", "second"]
    assert chosen.route == "primary"
    assert chosen.ttft_rescue
    assert rescuer(primary, [second, small], budget, call()) is small


def test_a_lead_without_a_tail_to_rescue_is_not_hedged() -> None:
    """A fast lead (p99 0.4 s) with only slower candidates to rescue it (0.6 s): a hedge started
    at its p95 would land after even its p99, so none is planned; it fits on its own."""
    budget = Budget(ttft_s=1.0, on_ttft_miss="hedge", rescue_share=0.10, model="m")
    fast = cand("fast", metric(400.0, p95=300.0, p90=250.0))
    slower = cand("slower", metric(900.0, p95=700.0, p90=600.0))
    assert rescue_point(1.0, fast, slower, hedge=True) is None
    assert fits(fast, slower, budget, call()) is True
    # The same with too few samples to trust (a fallback that leads only long prompts).
    few = cand("fast", MetricStats(200.0, 250.0, 300.0, 400.0, 8, False))
    assert rescue_point(1.0, few, slower, hedge=True) is None


def test_of_two_rescuers_started_at_the_same_point_the_faster_rescues() -> None:
    """Two heavy-tailed rescuers both start at the primary's own p95 (neither tail lands
    otherwise): the one with the lower typical TTFT rescues, whatever the order."""
    budget = Budget(ttft_s=1.0, on_ttft_miss="hedge", rescue_share=0.10, model="m")
    primary = cand("large", metric(8000.0, p95=300.0, p90=200.0))
    slower = cand("slower", metric(2000.0, p95=700.0, p90=500.0))
    faster = cand("faster", metric(2000.0, p95=500.0, p90=300.0))
    assert rescue_point(1.0, primary, slower, hedge=True) == pytest.approx(0.3)
    assert rescue_point(1.0, primary, faster, hedge=True) == pytest.approx(0.3)
    assert rescuer(primary, [slower, faster], budget, call()) is faster
    assert rescuer(primary, [faster, slower], budget, call()) is faster


def test_a_fallback_seen_in_a_few_fast_samples_rescues_before_a_slow_trusted_one() -> None:
    """A fallback that serves little (six samples, all fast) is still known to land fast: it
    rescues the primary, at the last moment its tail allows, rather than the slow second
    provider the primary's own p95 would start (a hedge that mostly loses)."""
    budget = Budget(ttft_s=1.0, on_ttft_miss="hedge", rescue_share=0.10, model="m")
    primary = cand("large", metric(750.0, p95=290.0, p90=250.0))
    second = cand("second", metric(780.0, p95=600.0, p90=500.0))
    few_fast = fallback("s", MetricStats(150.0, 180.0, 190.0, 200.0, 6, False))
    assert rescuer(primary, [second, few_fast], budget, call()) is few_fast
    assert rescue_point(1.0, primary, few_fast, hedge=True) == pytest.approx(1.0 - 0.198)
    # The second, started at the primary's p95 (0.29 s), would land after even its p99.
    assert rescue_point(1.0, primary, second, hedge=True) is None


def test_a_deployment_of_the_requested_model_that_can_be_saved_leads_before_a_fallback() -> None:
    """The requested model's first deployment cannot meet the budget (3 s flat); its second
    stalls 8% of the time but, rescued by the fallback, fits: it leads, not the fallback. (Before,
    the second was judged with the slow first as its rescuer, and the fallback model led.)"""
    budget = Budget(ttft_s=1.0, on_ttft_miss="hedge", rescue_share=0.10, model="m")
    found = [cand("a", SLOW), cand("b", PRIMARY), fallback("s", FAST)]
    chosen = plan(found, call(), budget)
    assert ids(chosen.candidates) == ["b", "s", "a"]
    assert chosen.route == "budget"
    assert chosen.ttft_rescue


def test_a_fallback_model_leads_only_when_no_deployment_of_the_requested_model_can_be_saved() -> (
    None
):
    """A primary whose p90 (0.9 s) is past even the fastest rescuer's hedge point (0.67 s) cannot
    be saved, nor can its 3 s sibling: then, and only then, the fallback model leads."""
    budget = Budget(ttft_s=1.0, on_ttft_miss="hedge", rescue_share=0.10, model="m")
    late = metric(8000.0, p95=5000.0, p90=900.0)
    chosen = plan([cand("a", late), cand("b", SLOW), fallback("s", FAST)], call(), budget)
    assert ids(chosen.candidates)[0] == "s"
    assert chosen.route == "budget"


def test_an_unmeasured_candidate_rescues_only_when_nothing_measured_can_land() -> None:
    """A measured candidate that lands is preferred as the rescuer to an unmeasured one (which
    could only be explored); without one, the first of the others stays the rescuer."""
    budget = Budget(ttft_s=1.0, on_ttft_miss="hedge", rescue_share=0.10)
    primary, unknown = cand("a", PRIMARY), cand("u")
    assert rescuer(primary, [unknown, cand("f", FAST)], budget, call()) == cand("f", FAST)
    assert rescuer(primary, [unknown, cand("slow", SLOW)], budget, call()) is unknown
    assert rescuer(primary, [], budget, call()) is None


def test_with_the_fallback_share_spent_the_requested_model_leads() -> None:
    """`fallback_lead=False` (the model's `max_fallback_share` is spent): a requested model
    that cannot meet the budget still leads, as budget_unattainable, the fallback next to rescue
    it; with every deployment of the requested model cooling down, the fallback still serves."""
    budget = Budget(ttft_s=1.0, on_ttft_miss="hedge", rescue_share=0.10, model="m")
    found = [cand("a", SLOWER), fallback("s", FAST)]
    assert ids(plan(found, call(), budget).candidates) == ["s", "a"]
    capped = plan(found, call(), budget, fallback_lead=False)
    assert ids(capped.candidates) == ["a", "s"]
    assert capped.route == "budget_unattainable"
    cooling = plan(found, call(), budget, cooling={"p/a": 3.0}, fallback_lead=False)
    assert ids(cooling.candidates) == ["s"]
    assert cooling.route == "error_fallback"


# --- the rescue rule ---------------------------------------------------------------------------

# 8% of first tokens stall: p90 is fast, p95 and p99 are far over a 1 s budget.
STALLING = metric(8000.0, p95=5000.0, p90=200.0)


def test_a_rescuable_primary_fits_despite_its_p99() -> None:
    """With a hedge covering 10%, a p90 under the deadline fits though p99 is 8x the budget."""
    successor = cand("b", FAST)  # deadline = max(1.0 - 1.1 * 0.3, 0.5) = 0.67 s
    budget = Budget(ttft_s=1.0, on_ttft_miss="hedge", rescue_share=0.10)
    assert fits(cand("a", STALLING), successor, budget, call()) is True
    chosen = plan([cand("a", STALLING), successor], call(), budget)
    assert ids(chosen.candidates) == ["a", "b"]
    assert chosen.route == "primary"


def test_the_rescued_quantile_must_meet_the_deadline_not_the_budget() -> None:
    """A p90 under the budget but past the deadline (budget - 1.1 * successor p99): not rescued."""
    successor = cand("b", metric(400.0))  # deadline = 1.0 - 0.44 = 0.56 s
    budget = Budget(ttft_s=1.0, on_ttft_miss="hedge", rescue_share=0.10)
    late_p90 = metric(8000.0, p95=5000.0, p90=700.0)
    assert fits(cand("a", late_p90), successor, budget, call()) is False


def test_a_successor_that_cannot_land_in_time_rescues_nothing() -> None:
    """A successor too slow to land inside the budget is never started for a slow attempt
    (cutting or joining it would only restart the wait), and a primary that needs rescuing then
    does not fit."""
    # p50 and p99 alike padded to 1.045 s: more than the whole budget.
    successor = cand("b", MetricStats(950.0, 950.0, 950.0, 950.0, 100, True))
    assert deadline(1.0, successor) is None
    primary = cand("a", metric(8000.0, p95=5000.0, p90=450.0))
    assert rescue_point(1.0, primary, successor, hedge=False) is None
    assert rescue_point(1.0, primary, successor, hedge=True) is None
    budget = Budget(ttft_s=1.0, on_ttft_miss="hedge", rescue_share=0.10)
    assert (
        fits(cand("a", metric(8000.0, p95=5000.0, p90=450.0)), successor, budget, call()) is False
    )


def test_a_smaller_rescue_share_checks_the_p95() -> None:
    """With 5% rescuable, the p95 must meet the deadline: 8% stalls do not fit."""
    budget = Budget(ttft_s=1.0, on_ttft_miss="hedge", rescue_share=0.05)
    assert budget.quantile == "p95"
    assert fits(cand("a", STALLING), cand("b", FAST), budget, call()) is False
    chosen = plan([cand("a", STALLING), cand("b", FAST)], call(), budget)
    assert ids(chosen.candidates) == ["b", "a"]
    assert chosen.route == "budget"


def test_without_rescue_only_p99_within_the_budget_fits() -> None:
    """on_ttft_miss none: no successor rescues, so p99 must fit the budget itself."""
    budget = Budget(ttft_s=1.0, on_ttft_miss="none", rescue_share=0.10)
    assert budget.quantile == "p99"
    assert fits(cand("a", STALLING), cand("b", FAST), budget, call()) is False
    assert fits(cand("a", metric(1000.0)), cand("b", FAST), budget, call()) is True


def test_without_a_successor_nothing_is_rescued() -> None:
    """The last candidate standing has no successor: its p99 must fit the budget."""
    budget = Budget(ttft_s=1.0, on_ttft_miss="hedge", rescue_share=0.10)
    assert fits(cand("a", STALLING), None, budget, call()) is False


# --- untrusted statistics and priors -----------------------------------------------------------


def test_untrusted_statistics_are_explored() -> None:
    """Too few samples: nothing to judge by (None), so the candidate fits and keeps its place."""
    few = metric(9000.0, count=MIN_SAMPLES - 1)
    assert fits(cand("a", few), cand("b", FAST), STRICT, call()) is None
    assert fits(cand("a"), cand("b", FAST), STRICT, call()) is None
    chosen = plan([cand("a", few), cand("b", FAST)], call(), STRICT)
    assert ids(chosen.candidates) == ["a", "b"]
    assert chosen.route == "primary"


def test_a_prior_stands_in_for_untrusted_statistics() -> None:
    """A configured prior p99 TTFT is judged instead of the untrusted samples, either way."""
    few_fast = metric(100.0, count=5)
    slow_prior = PriorSpec(ttft_ms=2000.0)
    assert cand("a", few_fast, prior=slow_prior).ttft_p99_s == pytest.approx(2.0)
    assert fits(cand("a", few_fast, prior=slow_prior), cand("b", FAST), STRICT, call()) is False
    chosen = plan([cand("a", few_fast, prior=slow_prior), cand("b", FAST)], call(), STRICT)
    assert ids(chosen.candidates) == ["b", "a"]
    assert chosen.route == "budget"
    few_slow = metric(9000.0, count=5)
    assert fits(cand("a", few_slow, prior=PriorSpec(ttft_ms=500.0)), None, STRICT, call()) is True


def test_trusted_statistics_override_the_prior() -> None:
    """Once the samples are trusted the prior is no longer used."""
    assert cand("a", FAST, prior=PriorSpec(ttft_ms=9000.0)).ttft_p99_s == pytest.approx(0.3)


# --- nothing fits --------------------------------------------------------------------------------


def test_when_nothing_fits_the_least_over_budget_leads() -> None:
    """All over budget: the lowest p99 relative to the budget leads, route budget_unattainable."""
    found = [cand("a", metric(3000.0)), cand("b", metric(1500.0)), cand("c", metric(2000.0))]
    chosen = plan(found, call(), STRICT)
    assert ids(chosen.candidates) == ["b", "a", "c"]
    assert chosen.route == "budget_unattainable"


def test_the_cost_is_relative_to_each_budget() -> None:
    """The worse of TTFT/ttft budget and total/total budget ranks those that do not fit."""
    budget = Budget(ttft_s=1.0, total_s=10.0, on_ttft_miss="none")
    tpot = metric(10.0)  # total = ttft + 0.01 s * 999 tokens
    a = cand("a", metric(1200.0), tpot=tpot)  # ttft 1.2x, total 11.2 s = 1.12x: cost 1.2
    b = cand("b", metric(500.0), tpot=tpot)  # ttft fits, total 10.5 s = 1.05x: cost 1.05
    chosen = plan([a, b], call(max_tokens=1000), budget)
    assert ids(chosen.candidates) == ["b", "a"]
    assert chosen.route == "budget_unattainable"


# --- total budget --------------------------------------------------------------------------------


def test_predicted_total_uses_max_tokens_else_the_mean_output_length() -> None:
    """Predicted total = p99 TTFT + p99 TPOT * (tokens - 1), tokens from max_tokens or the mean."""
    c = cand("a", metric(500.0), tpot=metric(20.0), output_tokens=50.0)
    assert c.predicted_total_s(100) == pytest.approx(0.5 + 0.02 * 99)
    assert c.predicted_total_s(None) == pytest.approx(0.5 + 0.02 * 49)


def test_a_predicted_total_is_admitted_only_with_headroom() -> None:
    """The total budget steers routing with a margin: a predicted total of 2.48 s does not fit
    a 2.6 s budget (it needs 10% spare: at most 2.34 s), and fits a 2.8 s one (2.52 s). (Before,
    a prediction just under the budget fitted, and long answers ran past it.)"""
    c = cand("a", metric(500.0), tpot=metric(20.0))
    assert c.predicted_total_s(100) == pytest.approx(2.48)
    assert fits(c, None, Budget(total_s=2.6), call(max_tokens=100)) is False
    assert fits(c, None, Budget(total_s=2.8), call(max_tokens=100)) is True


def test_a_candidate_over_the_total_budget_does_not_fit() -> None:
    """The total budget is checked against the predicted total for this call's max_tokens."""
    c = cand("a", metric(500.0), tpot=metric(20.0), output_tokens=50.0)  # 2.48 s at 100 tokens
    assert fits(c, None, Budget(total_s=3.0), call(max_tokens=100)) is True
    assert fits(c, None, Budget(total_s=2.0), call(max_tokens=100)) is False
    assert fits(c, None, Budget(total_s=2.0), call()) is True  # 1.48 s at the mean 50 tokens


def test_a_non_streaming_call_ignores_the_ttft_budget() -> None:
    """Without a stream there is no first token to wait for: only the total budget counts."""
    slow_start = cand("a", SLOWER, tpot=metric(1.0))  # 5 s to first token, 5.1 s total
    assert fits(slow_start, None, Budget(ttft_s=1.0), call(stream=False)) is None
    budget = Budget(ttft_s=1.0, total_s=6.0, on_ttft_miss="none")
    assert fits(slow_start, None, budget, call(stream=False, max_tokens=100)) is True
    assert fits(slow_start, None, budget, call(stream=True, max_tokens=100)) is False


# --- cooldowns -----------------------------------------------------------------------------------


def test_cooling_candidates_are_skipped() -> None:
    """A cooling first candidate is left out and the next leads as an error fallback."""
    found = [cand("a", FAST), cand("b", FAST), cand("c", FAST)]
    chosen = plan(found, call(), Budget(), cooling={"p/a": 3.0})
    assert ids(chosen.candidates) == ["b", "c"]
    assert chosen.route == "error_fallback"
    chosen = plan(found, call(), Budget(), cooling={"p/b": 3.0})
    assert ids(chosen.candidates) == ["a", "c"]
    assert chosen.route == "primary"


def test_all_cooling_raises_with_the_soonest_retry_after() -> None:
    """Every candidate cooling: 503 CoolingDownError, retry-after the ceiling of the soonest."""
    found = [cand("a", FAST), cand("b", FAST)]
    with pytest.raises(CoolingDownError) as caught:
        plan(found, call(), STRICT, cooling={"p/a": 7.5, "p/b": 2.2, "p/other": 0.5})
    assert caught.value.status == 503
    assert caught.value.headers["retry-after"] == str(math.ceil(2.2))
    assert caught.value.retry_after_s == pytest.approx(2.2)


# --- deadlines and hedge points ------------------------------------------------------------------


def test_deadline_arithmetic() -> None:
    """A failover deadline is what remains less 1.1 x the successor's p99; there is none alone,
    when the successor cannot land in time, or when it is unknown (explored by a hedge at half
    of what remains instead of being trusted with it)."""
    assert deadline(2.0, None) is None
    assert deadline(2.0, cand("b")) is None
    assert explore_point(2.0, cand("b")) == pytest.approx(1.0)
    assert explore_point(2.0, cand("b", FAST)) is None  # a measured successor needs no exploring
    assert deadline(2.0, cand("b", metric(500.0))) == pytest.approx(2.0 - 0.55)
    assert deadline(2.0, cand("b", metric(1500.0))) == pytest.approx(2.0 - 1.65)
    assert deadline(2.0, cand("b", metric(1900.0))) is None
    assert deadline(2.0, cand("b", prior=PriorSpec(ttft_ms=500.0))) == pytest.approx(1.45)


def test_hedge_point_without_a_successor_is_none() -> None:
    """No successor: nothing to hedge with, the attempt runs."""
    assert hedge_point(2.0, cand("a", metric(1900.0, p95=400.0)), None) is None


def test_hedge_point_with_an_unknown_successor_explores_at_half() -> None:
    """An unknown successor is explored once half of what remains is gone, or sooner once the
    attempt is late by its own measure (its p95 here)."""
    assert hedge_point(2.0, cand("a", metric(1900.0)), cand("b")) == pytest.approx(1.0)
    assert hedge_point(2.0, cand("a", metric(1900.0, p95=400.0)), cand("b")) == pytest.approx(0.4)


def test_a_heavy_tailed_successor_is_hedged_with_on_its_median() -> None:
    """A successor whose p90 sits in its heavy tail (too late to land) but whose median would
    land is still worth a hedge, timed by its median."""
    tailed = cand("b", MetricStats(100.0, 2000.0, 2500.0, 3000.0, 100, True))
    assert hedge_point(1.0, cand("a", metric(500.0)), tailed) == pytest.approx(1.0 - 0.11)


def test_a_hedge_is_timed_by_the_successors_typical_ttft() -> None:
    """A hedge wins on the successor's typical first token, so it starts once what remains is
    1.1 x its p90, although its p99 (a heavy tail) would leave no room for a failover at all."""
    tailed = cand("b", metric(900.0, p95=300.0, p90=200.0))
    assert deadline(1.0, tailed) == pytest.approx(1.0 - 0.99)
    assert hedge_point(1.0, cand("a", metric(500.0)), tailed) == pytest.approx(1.0 - 0.22)


def test_an_attempt_that_is_long_not_late_is_never_cut() -> None:
    """At its deadline an attempt whose typical TTFT for this prompt is still ahead, and comes
    before a successor started then could answer, is left to run: cutting it would make the
    request later, not sooner."""
    long_prompt = cand("a", metric(700.0, p90=600.0))  # p50 300 ms
    successor = cand("b", metric(400.0))  # p50 200 ms; deadline 1.0 - 0.44 = 0.56 s
    assert lands_first(long_prompt, 0.2, successor)
    assert rescue_point(0.64, long_prompt, successor, hedge=False) is None
    late = cand("a", metric(700.0, p90=100.0))  # p50 50 ms: at 0.56 s it is late, not long
    assert rescue_point(1.0, late, successor, hedge=False) == pytest.approx(0.56)


def test_hedge_point_is_as_early_as_the_successors_tail_needs_when_the_budget_is_tight() -> None:
    """p99 plus a failover would not fit: the hedge starts early enough for the successor's
    p99 to land too, and never before the attempt's own p95. A successor with no tail beyond
    its p90 is started at the last moment: a hedge of an attempt only slower than usual mostly
    loses to it, and one of the two prefills is thrown away."""
    a = cand("a", metric(900.0, p95=400.0))  # 0.9 + 1.1 * 0.3 = 1.23 > 1.0: tight
    assert deadline(1.0, cand("b", FAST)) == pytest.approx(0.67)
    stalls = cand("a", metric(3000.0, p95=400.0))
    assert hedge_point(1.0, stalls, cand("b", FAST)) == pytest.approx(0.67)
    # Started at 0.67 s, FAST would land at 0.97 s: after even a's p99 (0.9 s). No hedge.
    assert hedge_point(1.0, a, cand("b", FAST)) is None
    tailed = cand("b", metric(450.0, p95=350.0, p90=300.0))  # its p99 lands if started by 0.505
    assert hedge_point(1.0, a, tailed) == pytest.approx(1.0 - 0.495)
    heavy = cand("b", metric(800.0, p95=350.0, p90=300.0))  # not even by the p95: at the p95
    assert hedge_point(1.0, a, heavy) == pytest.approx(0.4)


def test_an_attempt_that_is_long_not_late_is_not_hedged() -> None:
    """A long prompt whose p90 first token (0.76 s) comes after the latest point a hedge could
    start and still land (0.604 s) is not hedged: a hedge then would start for more than a
    tenth of such prompts and mostly lose, its prefill thrown away. A short prompt on the same
    deployment, late by then, is hedged."""
    long_prompt = cand("a", MetricStats(700.0, 760.0, 800.0, 900.0, 100, True))
    successor = cand("b", MetricStats(360.0, 360.0, 360.0, 360.0, 100, True))
    assert hedge_point(1.0, long_prompt, successor) is None
    assert rescue_point(1.0, long_prompt, successor, hedge=True) is None
    short = cand("a", MetricStats(180.0, 250.0, 300.0, 3000.0, 100, True))  # 1% stall
    assert rescue_point(1.0, short, successor, hedge=True) == pytest.approx(1.0 - 0.396)


def test_hedge_point_is_the_deadline_when_the_budget_is_not_tight() -> None:
    """p99 plus a failover fits: hedge at the deadline, not at the earlier p95."""
    a = cand("a", metric(500.0, p95=400.0))  # 0.5 + 0.33 = 0.83 <= 1.0
    assert hedge_point(1.0, a, cand("b", FAST)) == pytest.approx(0.67)


def test_hedge_point_ignores_a_p95_later_than_the_deadline() -> None:
    """Tight, but the p95 comes after the deadline: hedge at the deadline, when that is past
    the attempt's p90; before it, no hedge (it would be a guess on more than a tenth)."""
    a = cand("a", metric(900.0, p95=800.0, p90=600.0))
    assert hedge_point(1.0, a, cand("b", FAST)) == pytest.approx(0.67)
    late = cand("a", metric(900.0, p95=800.0, p90=700.0))
    assert hedge_point(1.0, late, cand("b", FAST)) is None


# --- candidate order -----------------------------------------------------------------------------


def test_weighted_order_follows_the_weights() -> None:
    """Weights 3:1 put the heavier deployment first about 75% of the time."""
    heavy = DeploymentSpec(provider="p", model="heavy", weight=3.0)
    light = DeploymentSpec(provider="p", model="light", weight=1.0)
    rng = random.Random(42)
    draws = 4000
    first = sum(weighted_order([light, heavy], rng)[0] is heavy for _ in range(draws))
    assert abs(first / draws - 0.75) < 0.03
    assert weighted_order([heavy], rng) == [heavy]


def test_fallback_chain_is_breadth_first_and_each_model_once() -> None:
    """The model, then its fallbacks, then theirs; a model reached twice is listed once."""
    deployment = [{"provider": "sim", "model": "x"}]
    settings = build_settings(
        {
            "providers": {"sim": {"type": "simulated"}},
            "models": [
                {"name": "a", "deployments": deployment, "fallbacks": ["b", "c"]},
                {"name": "b", "deployments": deployment, "fallbacks": ["d", "c"]},
                {"name": "c", "deployments": deployment, "fallbacks": ["d"]},
                {"name": "d", "deployments": deployment},
            ],
        }
    )
    spec = settings.model("a")
    assert spec is not None
    assert [m.name for m in fallback_chain(spec, settings)] == ["a", "b", "c", "d"]


def test_candidates_skip_what_cannot_serve_the_call() -> None:
    """Each deployment once, those whose provider cannot serve the endpoint left out, with stats."""
    chat, emb = StubProvider("chat"), StubProvider("emb", endpoints=frozenset({"embeddings"}))
    first = ModelSpec(
        name="m",
        deployments=(
            DeploymentSpec(provider="chat", model="x"),
            DeploymentSpec(provider="emb", model="e"),
        ),
    )
    second = ModelSpec(name="n", deployments=(DeploymentSpec(provider="emb", model="e"),))
    snapshot = Snapshot(
        window_s=60.0, taken_at=1.0, source="memory", deployments={"emb/e": stats()}
    )
    embed = Call("embeddings", "m", {}, b"{}", False)
    found = candidates(
        [first, second], {"chat": chat, "emb": emb}, embed, random.Random(1), snapshot
    )
    assert [(c.model, c.id) for c in found] == [("m", "emb/e")]
    assert found[0].stats is snapshot.deployments["emb/e"]
    complete = Call("completions", "m", {}, b"{}", False)
    with pytest.raises(InvalidRequestError, match="completions"):
        candidates([first], {"chat": chat, "emb": emb}, complete, random.Random(1))


# --- prompt size, recovery, exploration ----------------------------------------------------------

SHORT, LONG = 500, 64_000  # request body bytes: ~125 and ~16k prompt tokens


def sized(*bands: tuple[int, float, float]) -> TargetStats:
    """Deployment statistics whose TTFT is known per prompt band: (band, mean bytes, p99 ms);
    the deployment-wide TTFT mixes them (its p99 is the slowest band's)."""
    worst = max(p99 for _, _, p99 in bands)
    return replace(
        stats(metric(worst)),
        bands={b: BandStats(metric(p99), mean) for b, mean, p99 in bands},
    )


def test_a_short_prompt_is_judged_by_short_prompts() -> None:
    """A primary that serves short prompts at 127 ms and long ones at 880 ms fits a 600 ms budget
    for a short prompt (the long samples no longer make its p99 look like 880 ms to everyone)
    and does not fit it for a long one."""
    primary = sized((band_of(SHORT), SHORT, 127.0), (band_of(LONG), LONG, 880.0))
    budget = Budget(ttft_s=0.6, on_ttft_miss="none")
    short = Candidate(
        "m", DeploymentSpec(provider="p", model="a"), StubProvider(), primary, prompt_bytes=SHORT
    )
    long_ = replace(short, prompt_bytes=LONG)
    assert short.ttft_p99_s == pytest.approx(0.127)
    assert fits(short, None, budget, call()) is True
    assert fits(long_, None, budget, call()) is False


def test_an_unseen_size_is_read_off_the_line_through_the_seen_ones() -> None:
    """Between (or beyond) trusted bands the quantile follows base + slope x size: prefill grows
    linearly with the prompt; a size no band has seen and no line can reach is left unknown."""
    two = sized((0, 1_000.0, 100.0), (5, 41_000.0, 500.0))  # 10 ms per KB
    assert ttft_for_size(two, 21_000, "p99") == pytest.approx(300.0)
    assert ttft_for_size(two, 81_000, "p99") == pytest.approx(900.0)
    one = sized((5, 41_000.0, 500.0))
    assert ttft_for_size(one, 1_000, "p99") == pytest.approx(500.0)  # an upper bound
    assert ttft_for_size(one, 200_000, "p99") is None


def test_a_tail_beyond_every_cut_does_not_fit() -> None:
    """A p99 known only to exceed the cuts (math.inf) fits no budget, and so does any longer
    prompt on that deployment."""
    cut = sized((0, 1_000.0, math.inf))
    assert ttft_for_size(cut, 50_000, "p99") == math.inf
    budget = Budget(ttft_s=0.6, on_ttft_miss="none")
    found = Candidate(
        "m", DeploymentSpec(provider="p", model="a"), StubProvider(), cut, prompt_bytes=900
    )
    assert fits(found, None, budget, call()) is False


def test_a_deployment_that_recovered_leads_again_on_its_recent_samples() -> None:
    """Routed away for a slow spell its full window still holds, a deployment whose last few
    seconds fit again (enough samples there) leads again at once."""
    slow_window, fast_now = stats(metric(3000.0)), stats(metric(200.0))
    primary = replace(cand("a", metric(3000.0)), recent=fast_now)
    assert primary.stats == slow_window
    chosen = plan([primary, cand("b", FAST)], call(), STRICT)
    assert ids(chosen.candidates) == ["a", "b"]
    assert chosen.route == "primary"
    few = stats(metric(200.0, count=3))  # too few recent samples to judge by
    chosen = plan([replace(primary, recent=few), cand("b", FAST)], call(), STRICT)
    assert ids(chosen.candidates) == ["b", "a"]


def test_a_routed_away_deployment_is_explored_when_due() -> None:
    """When the preferred deployment leads no more, a plan that explores it (first, with the
    lead beside it) comes out when the explorer says it is due, and only then; a deployment
    whose load the server reports is never explored (its prediction already follows it)."""
    found = [cand("a", SLOW), cand("b", FAST)]
    chosen = plan(found, call(), STRICT)
    assert (ids(chosen.candidates), chosen.route) == (["b", "a"], "budget")
    explored = with_exploration(chosen, found, lambda deployment: deployment == "p/a")
    assert (ids(explored.candidates), explored.explore) == (["a", "b"], True)
    assert with_exploration(chosen, found, lambda _: False) is chosen
    loaded = [replace(found[0], predicted_ttft_s=3.0), found[1]]
    assert with_exploration(plan(loaded, call(), STRICT), loaded, lambda _: True).explore is False


def test_explorations_are_made_with_short_prompts_and_speak_for_short_prompts() -> None:
    """One of an exploration's two attempts is thrown away, prefill and all: a long prompt is
    not explored with (nor does it use up the deployment's turn), and what short explorations
    measured brings a deployment back for short prompts only."""
    found = [replace(c, prompt_bytes=LONG) for c in (cand("a", SLOW), cand("b", FAST))]
    chosen = plan(found, call(), STRICT)
    asked: list[str] = []

    def due(deployment: str) -> bool:
        asked.append(deployment)
        return True

    assert with_exploration(chosen, found, due) is chosen
    assert asked == []
    short = [replace(c, prompt_bytes=SHORT) for c in found]
    assert with_exploration(plan(short, call(), STRICT), short, lambda _: True).explore
    back = [replace(found[0], explored_s=0.4), found[1]]
    assert ids(plan(back, call(), STRICT).candidates) == ["b", "a"]
    back_short = [replace(c, prompt_bytes=SHORT) for c in back]
    assert ids(plan(back_short, call(), STRICT).candidates) == ["a", "b"]


def test_explorations_that_all_answered_in_time_bring_a_deployment_back() -> None:
    """A deployment routed away for a slow spell its window still holds leads again once its
    latest explorations all answered within the budget (the slowest of them is what counts)."""
    away = cand("a", metric(3000.0))
    assert ids(plan([away, cand("b", FAST)], call(), STRICT).candidates) == ["b", "a"]
    back = replace(away, explored_s=0.4)
    assert ids(plan([back, cand("b", FAST)], call(), STRICT).candidates) == ["a", "b"]
    still_slow = replace(away, explored_s=1.4)
    assert ids(plan([still_slow, cand("b", FAST)], call(), STRICT).candidates) == ["b", "a"]


def test_recent_samples_of_other_sizes_do_not_bring_a_size_back() -> None:
    """Short prompts flowing to a primary prove nothing about the long ones it is routed away
    for: its recent view counts for a prompt size only with recent samples of that size."""
    window = sized((band_of(SHORT), SHORT, 120.0), (band_of(LONG), LONG, 900.0))
    recent_short_only = sized((band_of(SHORT), SHORT, 120.0))
    spec = DeploymentSpec(provider="p", model="a")
    long_ = Candidate(
        "m", spec, StubProvider(), window, prompt_bytes=LONG, recent=recent_short_only
    )
    budget = Budget(ttft_s=0.6, on_ttft_miss="none")
    assert ids(plan([long_, cand("b", FAST)], call(), budget).candidates) == ["b", "a"]
    short = replace(long_, prompt_bytes=SHORT)
    assert ids(plan([short, cand("b", FAST)], call(), budget).candidates) == ["a", "b"]


def test_a_few_cut_streams_show_a_deployment_cannot_finish_in_time() -> None:
    """Before TTFT and TPOT are trusted, five streams whose typical pace puts the total over
    budget are evidence enough: the deployment stops leading instead of being cut again."""
    few = MetricStats(100.0, 110.0, 120.0, 130.0, 5, False)
    slow_pace = MetricStats(40.0, 41.0, 42.0, 43.0, 5, False)
    capable = Candidate(
        "m", DeploymentSpec(provider="p", model="a"), StubProvider(), stats(few, slow_pace)
    )
    budget = Budget(total_s=8.0)
    assert fits(capable, None, budget, call(max_tokens=400)) is False
    assert fits(capable, None, budget, call(max_tokens=100)) is True


def test_a_queue_prediction_starts_from_the_typical_ttft_for_this_size() -> None:
    """The vLLM queue predictor adds the queue to the deployment's typical TTFT for a prompt of
    this size: its band's median once the band has a few observations (trusted or not), else
    the deployment-wide median."""
    window = sized((band_of(SHORT), SHORT, 120.0), (band_of(LONG), LONG, 900.0))
    assert baseline_p50_ms(window, SHORT) == pytest.approx(60.0)  # metric(): p50 = p90 / 2
    assert baseline_p50_ms(window, LONG) == pytest.approx(450.0)
    assert baseline_p50_ms(stats(metric(300.0)), LONG) == pytest.approx(150.0)


def test_a_rescued_tail_does_not_count_against_the_total_budget() -> None:
    """A primary whose slow first tokens are all rescued has a TTFT tail beyond every cut, yet
    its first token comes within the TTFT budget (alone or rescued): its total is predicted
    from that, so a total budget does not send it away for a tail its rescues remove."""
    stalling = MetricStats(75.0, 150.0, math.inf, math.inf, 100, True)
    primary = cand("a", stalling, tpot=metric(20.0))
    budget = Budget(ttft_s=0.6, total_s=10.0, on_ttft_miss="hedge", rescue_share=0.10)
    assert fits(primary, cand("b", FAST), budget, call(max_tokens=100)) is True
    alone = Budget(ttft_s=0.6, total_s=10.0, on_ttft_miss="none")
    assert fits(primary, cand("b", FAST), alone, call(max_tokens=100)) is False


def test_a_successor_known_by_its_prior_is_hedged_to_without_exploring() -> None:
    """A successor with only a configured prior (a p99) is not unknown: the hedge is timed by
    that prior, on the slow side, instead of exploring at half the budget."""
    backup = cand("b", prior=PriorSpec(ttft_ms=330.0))
    assert explore_point(0.6, backup) is None
    assert hedge_point(0.6, cand("a", metric(3000.0, p95=2500.0, p90=160.0)), backup) == (
        pytest.approx(0.6 - 0.363)
    )


# --- a server's measured TPOT --------------------------------------------------------------------


def test_a_measured_tpot_comes_before_the_nominal_prior() -> None:
    """A vLLM server's measured TPOT stands in for untrusted statistics ahead of the operator's
    nominal prior; the window's own trusted p99 still comes first."""
    prior = PriorSpec(ttft_ms=200.0, tpot_ms=100.0)
    few = metric(50.0, count=3)  # untrusted
    nominal = cand("a", few, tpot=few, prior=prior)
    assert nominal.predicted_total_s(51) == pytest.approx(0.2 + 0.1 * 50)  # 5.2 s
    measured = replace(nominal, measured_tpot_s=0.01)
    assert measured.predicted_total_s(51) == pytest.approx(0.2 + 0.01 * 50)  # 0.7 s
    budget = Budget(total_s=2.0)
    assert fits(nominal, None, budget, call(max_tokens=51)) is False
    assert fits(measured, None, budget, call(max_tokens=51)) is True
    trusted = replace(cand("b", metric(200.0), tpot=metric(60.0)), measured_tpot_s=0.01)
    assert trusted.predicted_total_s(51) == pytest.approx(0.2 + 0.06 * 50)
    assert cand("c", prior=PriorSpec(ttft_ms=200.0)).predicted_total_s(51) is None
    alone = replace(cand("c", prior=PriorSpec(ttft_ms=200.0)), measured_tpot_s=0.01)
    assert alone.predicted_total_s(51) == pytest.approx(0.7)


def test_a_per_token_target_is_judged_on_the_measured_tpot() -> None:
    """`x-slo-tpot-ms` reads the same TPOT the total budget does: measured before nominal."""
    prior = PriorSpec(ttft_ms=200.0, tpot_ms=100.0)
    few = metric(50.0, count=3)  # untrusted
    nominal = cand("a", few, tpot=few, prior=prior)
    budget = Budget(tpot_s=0.05)
    assert fits(nominal, None, budget, call()) is False
    assert fits(replace(nominal, measured_tpot_s=0.02), None, budget, call()) is True
    assert fits(replace(nominal, measured_tpot_s=0.08), None, budget, call()) is False


def test_one_stall_among_a_few_samples_of_a_size_is_not_its_typical_case() -> None:
    """A band of prompts with a few samples, one of them a 3 s stall, is as slow as its median
    says (here 20% slower than the deployment's), with the deployment's own tail: its p90 is
    not that stall. A primary with a 4% stall rate keeps such prompts, its stalls hedged by a
    fast fallback, instead of sending them all to the fallback until the band is trusted."""
    size = 8_000
    whole = MetricStats(250.0, 400.0, 600.0, 3000.0, 200, True)
    few = MetricStats(300.0, 3000.0, 3000.0, 3000.0, 6, False)  # one stall of six
    primary_stats = replace(stats(whole), bands={band_of(size): BandStats(few, size)})
    assert ttft_for_size(primary_stats, size, "p90") == pytest.approx(480.0)
    assert ttft_for_size(primary_stats, size, "p99") == pytest.approx(3600.0)
    spec = DeploymentSpec(provider="p", model="a")
    primary = Candidate("m", spec, StubProvider(), primary_stats, prompt_bytes=size)
    fallback = Candidate(
        "f", DeploymentSpec(provider="p", model="b"), StubProvider(), stats(metric(200.0))
    )
    budget = Budget(ttft_s=1.0, on_ttft_miss="hedge", rescue_share=0.10)
    chosen = plan([primary, fallback], call(), budget)
    assert (ids(chosen.candidates), chosen.route) == (["a", "b"], "primary")
    # A size whose few samples are all slow still reads slow.
    slow = MetricStats(2500.0, 3000.0, 3000.0, 3000.0, 6, False)
    all_slow = replace(stats(whole), bands={band_of(size): BandStats(slow, size)})
    assert ttft_for_size(all_slow, size, "p90") == pytest.approx(4000.0)


def test_a_long_prompt_is_not_hedged_before_it_typically_answers() -> None:
    """A primary trusted on short prompts (median 200 ms, p90 300 ms) has answered three long
    ones in about 700 ms: too few to trust, enough to say a hedge at 780 ms (the fast fallback's
    p90 of 200 ms, padded, before a 1 s budget) would start on most such prompts while they are
    prefilling, and lose. It is not hedged then; a short prompt still is, at the same point."""
    short, long = 1_000, 40_000
    short_band = MetricStats(200.0, 300.0, 320.0, 3000.0, 200, True)
    long_band = MetricStats(700.0, 720.0, 720.0, 720.0, 3, False)
    window = replace(
        stats(short_band),
        bands={
            band_of(short): BandStats(short_band, short),
            band_of(long): BandStats(long_band, long),
        },
    )
    spec = DeploymentSpec(provider="p", model="a")
    fallback = Candidate(
        "f", DeploymentSpec(provider="p", model="b"), StubProvider(), stats(metric(200.0))
    )

    def lead(size: int) -> Candidate:
        return Candidate("m", spec, StubProvider(), window, prompt_bytes=size)

    assert lead(long).ttft_seen_for_size_s("p90") == pytest.approx(0.7 * 1.5)
    assert hedge_point(1.0, lead(long), fallback) is None
    assert hedge_point(1.0, lead(short), fallback) == pytest.approx(1.0 - 0.22)
    # A size between the two bands is read off the line through their medians.
    middle = lead((short + long) // 2).ttft_seen_for_size_s("p50")
    assert middle == pytest.approx((0.2 + 0.7) / 2, rel=0.01)


def test_an_unmeasured_successor_is_explored_with_a_short_prompt_only() -> None:
    """Exploring an unmeasured successor throws one prefill away: a long prompt is not used for
    it (a short one measures the successor as well)."""
    lead = cand("a", metric(1900.0))
    unknown = replace(cand("b"), prompt_bytes=1_000)
    assert hedge_point(2.0, replace(lead, prompt_bytes=1_000), unknown) == pytest.approx(1.0)
    long_lead, long_unknown = (
        replace(lead, prompt_bytes=40_000),
        replace(unknown, prompt_bytes=40_000),
    )
    assert hedge_point(2.0, long_lead, long_unknown) is None
    assert explore_point(2.0, long_unknown) is None

"""Cooldowns, the retry budget and the hedge cap, driven by a hand-moved clock."""

from __future__ import annotations

import random

import pytest

from gateway.config import CooldownSpec, RetryBudgetSpec
from gateway.errors import ProviderError, ProviderTimeoutError, RateLimitedError
from gateway.latency import TTFT_DEADLINE, MetricStats, Snapshot, TargetStats
from gateway.routing.guards import (
    EXPLORED_FRESH_S,
    EXPLORED_KEPT,
    FALLBACK_WINDOW,
    FREE,
    HEDGE_FLOOR_REQUESTS,
    PROBE,
    PROBE_WAIT_S,
    Cooldowns,
    Explorer,
    FallbackShare,
    HedgeBudget,
    RetryBudget,
)

D = "p/d"
SPEC = CooldownSpec(failures=3, base_s=5.0, max_s=60.0)


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def breaker(spec: CooldownSpec = SPEC) -> tuple[Cooldowns, Clock]:
    clock = Clock()
    return Cooldowns(spec, clock=clock, rng=random.Random(7)), clock


def boom() -> ProviderError:
    return ProviderError("upstream returned 500", deployment=D, upstream_status=500)


def fail(cooldowns: Cooldowns, times: int) -> None:
    for _ in range(times):
        cooldowns.failed(D, boom())


def opened(spec: CooldownSpec = SPEC) -> tuple[Cooldowns, Clock]:
    """A breaker just opened by `spec.failures` failures, and its clock."""
    cooldowns, clock = breaker(spec)
    fail(cooldowns, spec.failures)
    return cooldowns, clock


def past_cooldown(cooldowns: Cooldowns, clock: Clock) -> None:
    clock.now += cooldowns.cooling()[D] + 0.001


# --- cooldowns -----------------------------------------------------------------------------------


def test_n_consecutive_failures_open_the_breaker() -> None:
    """N - 1 failures leave it closed; the N-th opens it for base_s (±10% jitter)."""
    cooldowns, _ = breaker()
    fail(cooldowns, SPEC.failures - 1)
    assert cooldowns.cooling() == {}
    assert cooldowns.begin(D)
    fail(cooldowns, 1)
    assert 4.5 <= cooldowns.cooling()[D] <= 5.5
    assert not cooldowns.begin(D)


def test_cooling_reports_the_remaining_seconds() -> None:
    """As the clock moves, cooling() counts down; at the end the deployment is no longer listed."""
    cooldowns, clock = opened()
    first = cooldowns.cooling()[D]
    clock.now += 2.0
    assert cooldowns.cooling()[D] == pytest.approx(first - 2.0)
    clock.now += first
    assert cooldowns.cooling() == {}


def test_a_success_resets_the_consecutive_count() -> None:
    """Failures must be consecutive: a success in between starts the count again."""
    cooldowns, _ = breaker()
    fail(cooldowns, SPEC.failures - 1)
    cooldowns.succeeded(D)
    fail(cooldowns, SPEC.failures - 1)
    assert cooldowns.cooling() == {}
    fail(cooldowns, 1)
    assert D in cooldowns.cooling()


def test_exactly_one_probe_after_the_cooldown() -> None:
    """When the cooldown ends one begin gets the probe; others wait while it is out."""
    cooldowns, clock = opened()
    past_cooldown(cooldowns, clock)
    assert cooldowns.cooling() == {}
    assert cooldowns.begin(D)
    assert not cooldowns.begin(D)
    assert cooldowns.cooling() == {D: PROBE_WAIT_S}


def test_a_successful_probe_closes_the_breaker() -> None:
    """Probe success: nothing cools, every attempt may begin, and the count starts from zero."""
    cooldowns, clock = opened()
    past_cooldown(cooldowns, clock)
    assert cooldowns.begin(D)
    cooldowns.succeeded(D)
    assert cooldowns.cooling() == {}
    assert cooldowns.begin(D)
    assert cooldowns.begin(D)
    fail(cooldowns, SPEC.failures - 1)
    assert cooldowns.cooling() == {}


def test_a_failed_probe_reopens_with_about_double_the_wait() -> None:
    """Probe failure reopens it at once, for 2 * base_s (±10% jitter), below the probe interval."""
    cooldowns, clock = opened(CooldownSpec(failures=3, base_s=5.0, probe_interval_s=60.0))
    past_cooldown(cooldowns, clock)
    assert cooldowns.begin(D)
    fail(cooldowns, 1)
    assert 9.0 <= cooldowns.cooling()[D] <= 11.0
    assert not cooldowns.begin(D)


def test_abandoning_the_probe_frees_it() -> None:
    """A probe cancelled without a verdict lets the next attempt probe."""
    cooldowns, clock = opened()
    past_cooldown(cooldowns, clock)
    assert cooldowns.begin(D)
    cooldowns.abandoned(D)
    assert cooldowns.cooling() == {}
    assert cooldowns.begin(D)


def test_a_rate_limit_opens_it_for_the_retry_after() -> None:
    """A 429 with retry-after opens the breaker at once for exactly that long."""
    cooldowns, _ = breaker()
    cooldowns.failed(D, RateLimitedError("slow down", deployment=D, retry_after_s=30.0))
    assert cooldowns.cooling() == {D: pytest.approx(30.0)}
    assert not cooldowns.begin(D)


def test_a_rate_limit_retry_after_is_capped() -> None:
    """A retry-after longer than max_s opens it for max_s."""
    cooldowns, _ = breaker()
    cooldowns.failed(D, RateLimitedError("slow down", deployment=D, retry_after_s=3600.0))
    assert cooldowns.cooling() == {D: pytest.approx(SPEC.max_s)}


def test_a_ttft_deadline_miss_is_not_a_failure() -> None:
    """Slowness is the planner's business: deadline misses never open the breaker."""
    cooldowns, _ = breaker()
    late = ProviderTimeoutError("no first token in time", deployment=D, kind=TTFT_DEADLINE)
    for _ in range(SPEC.failures * 3):
        cooldowns.failed(D, late)
    assert cooldowns.cooling() == {}
    fail(cooldowns, SPEC.failures - 1)
    assert cooldowns.cooling() == {}


def test_the_cooldown_never_exceeds_max_s() -> None:
    """However often it reopens, a cooldown is capped at max_s (jitter included)."""
    spec = CooldownSpec(failures=1, base_s=5.0, max_s=20.0)
    cooldowns, clock = opened(spec)
    longest = 0.0
    for _ in range(10):
        past_cooldown(cooldowns, clock)
        assert cooldowns.begin(D)
        fail(cooldowns, 1)
        longest = max(longest, cooldowns.cooling()[D])
    assert longest <= spec.max_s


def test_a_burst_of_failures_opens_it_for_base_s() -> None:
    """Attempts in flight when the breaker opens fail too; that is not a reopening."""
    cooldowns, _ = breaker()
    burst = SPEC.failures + 3  # six concurrent attempts, all begun while it was closed
    assert all(cooldowns.begin(D) for _ in range(burst))
    fail(cooldowns, burst)
    assert cooldowns.cooling()[D] <= SPEC.base_s * 1.1


def test_the_back_off_stops_at_the_probe_interval() -> None:
    """However many probes fail, the next comes within `probe_interval_s` (5 s by default), so
    a deployment that recovered is back within seconds, not after a doubled minute."""
    cooldowns, clock = opened()
    longest = 0.0
    for _ in range(6):
        past_cooldown(cooldowns, clock)
        assert cooldowns.begin(D)
        fail(cooldowns, 1)
        longest = max(longest, cooldowns.cooling()[D])
    assert SPEC.probe_interval_s == 5.0
    assert longest <= SPEC.probe_interval_s + 1e-9  # (the clock is a float)


def test_a_long_outage_never_overflows_the_back_off() -> None:
    """Over a thousand failed probes (hours of outage) the back-off is still a number."""
    spec = CooldownSpec(failures=1, base_s=5.0, max_s=60.0)
    cooldowns, clock = opened(spec)
    for _ in range(1100):
        past_cooldown(cooldowns, clock)
        assert cooldowns.begin(D)
        fail(cooldowns, 1)
    assert cooldowns.cooling()[D] <= spec.max_s


def test_a_last_resort_probes_at_once_one_at_a_time() -> None:
    """With nowhere else to go a request takes the probe before the cooldown ends; while it is
    out no other may; its failure frees the probe without stretching the cooldown, and its
    success closes the breaker."""
    cooldowns, _ = opened()
    remaining = cooldowns.cooling()[D]
    assert not cooldowns.begin(D)
    assert cooldowns.begin(D, last_resort=True) is PROBE
    assert not cooldowns.may_probe(D)
    assert not cooldowns.begin(D, last_resort=True)
    fail(cooldowns, 1)
    assert cooldowns.cooling()[D] == pytest.approx(remaining)
    assert cooldowns.may_probe(D)
    assert cooldowns.begin(D, last_resort=True) is PROBE
    cooldowns.succeeded(D)
    assert cooldowns.cooling() == {}
    assert cooldowns.begin(D) is FREE


@pytest.mark.parametrize("verdict", ["succeeded", "failed", "abandoned"])
async def test_a_probe_verdict_wakes_whoever_waits_for_it(verdict: str) -> None:
    """Requests waiting for the probe are woken when it ends, however it ends."""
    cooldowns, _ = opened()
    assert cooldowns.begin(D, last_resort=True) is PROBE
    waiter = cooldowns.next_verdict()
    assert cooldowns.waiting == 1
    if verdict == "succeeded":
        cooldowns.succeeded(D)
    elif verdict == "failed":
        fail(cooldowns, 1)
    else:
        cooldowns.abandoned(D)
    assert waiter.done()
    assert cooldowns.waiting == 0


async def test_waiting_for_a_verdict_is_bounded() -> None:
    """No verdict within the time given: `settled` says so, and no longer counts as waiting."""
    cooldowns, _ = opened()
    assert cooldowns.begin(D, last_resort=True) is PROBE
    assert not await cooldowns.settled(0.0)
    assert cooldowns.waiting == 0


# --- retry budget --------------------------------------------------------------------------------


def test_the_retry_budget_allows_min_concurrent_when_idle() -> None:
    """With no active requests min_concurrent retries are allowed; the next is denied, counted."""
    budget = RetryBudget(RetryBudgetSpec(percent=20.0, min_concurrent=3))
    assert [budget.acquire() for _ in range(4)] == [True, True, True, False]
    assert budget.denied == 1


def test_the_retry_budget_scales_with_active_requests() -> None:
    """With 100 active requests, 20% of them (20) may be retries in flight."""
    budget = RetryBudget(RetryBudgetSpec(percent=20.0, min_concurrent=3))
    budget.active = 100
    assert sum(budget.acquire() for _ in range(25)) == 20
    assert budget.denied == 5


def test_releasing_retries_gives_them_back() -> None:
    """Released retries no longer count against the budget."""
    budget = RetryBudget(RetryBudgetSpec(percent=20.0, min_concurrent=3))
    for _ in range(3):
        assert budget.acquire()
    assert not budget.acquire()
    budget.release(2)
    assert budget.acquire()
    assert budget.acquire()
    assert not budget.acquire()


# --- hedge cap -----------------------------------------------------------------------------------

NO_DATA = MetricStats(None, None, None, None, 0, False)


def snapshot(taken_at: float, *, requests: int = 100, hedges: int = 0) -> Snapshot:
    """A window whose model `m` had `requests` client requests and `hedges` rescues."""
    model = TargetStats(NO_DATA, NO_DATA, NO_DATA, 0, 0, 0, hedges=hedges, clients=requests)
    return Snapshot(window_s=60.0, taken_at=taken_at, source="memory", models={"m": model})


def test_hedges_are_capped_at_a_fraction_of_the_window() -> None:
    """100 client requests in the window and a 5% cap: five rescues, then denied."""
    hedges = HedgeBudget()
    window = snapshot(1.0)
    assert [hedges.acquire("m", 0.05, window) for _ in range(6)] == [True] * 5 + [False]
    assert hedges.denied == 1


def test_hedges_already_in_the_window_count() -> None:
    """Five rescues recorded in the window use up a 5% cap over 100 client requests."""
    hedges = HedgeBudget()
    assert not hedges.acquire("m", 0.05, snapshot(1.0, hedges=5))
    assert hedges.denied == 1


def test_ended_hedges_count_until_a_fresh_snapshot() -> None:
    """A hedge that ended still counts until a new snapshot (which then holds it) is taken."""
    hedges = HedgeBudget()
    window = snapshot(1.0)
    for _ in range(5):
        assert hedges.acquire("m", 0.05, window)
    for _ in range(5):
        hedges.release("m")
    assert not hedges.acquire("m", 0.05, window)
    fresh = snapshot(2.0, hedges=3)
    assert [hedges.acquire("m", 0.05, fresh) for _ in range(3)] == [True, True, False]


def test_an_empty_window_still_allows_one_hedge() -> None:
    """No traffic yet: the cap is computed over HEDGE_FLOOR_REQUESTS, so 5% allows one hedge."""
    assert HEDGE_FLOOR_REQUESTS == 20
    hedges = HedgeBudget()
    empty = Snapshot(window_s=60.0, taken_at=1.0, source="memory")
    assert [hedges.acquire("m", 0.05, empty) for _ in range(2)] == [True, False]


def test_a_refund_frees_the_slot_without_counting_it() -> None:
    """A hedge that could not start is refunded: the slot is free and nothing counts as ended."""
    hedges = HedgeBudget()
    empty = Snapshot(window_s=60.0, taken_at=1.0, source="memory")
    assert hedges.acquire("m", 0.05, empty)
    assert not hedges.acquire("m", 0.05, empty)
    hedges.refund("m")
    assert hedges.acquire("m", 0.05, empty)
    hedges.release("m")
    assert not hedges.acquire("m", 0.05, empty)


def test_explorations_count_once_the_latest_all_answered_recently() -> None:
    """The explorer reports a deployment's latest explorations (their slowest TTFT) once it
    has enough of them, all answered and all fresh; one that gave no first token resets that."""
    clock = Clock()
    explorer = Explorer(clock=clock)
    for ttft in (0.1, 0.2, 0.15, 0.3):
        explorer.observed(D, ttft)
    assert D not in explorer.latest()  # four: not enough yet
    explorer.observed(D, 0.25)
    assert explorer.latest()[D] == pytest.approx(0.3)
    explorer.observed(D, None)
    assert D not in explorer.latest()
    for _ in range(EXPLORED_KEPT):
        explorer.observed(D, 0.2)
    clock.now += EXPLORED_FRESH_S + 1
    assert D not in explorer.latest()  # stale


# --- the share moved to fallback models ----------------------------------------------------------


def test_the_fallback_share_bounds_requests_moved_for_latency() -> None:
    """`max_fallback_share` 0.1: a fresh gateway may move 2 requests (counted as if 20 were
    seen), then one more for each ten requests served by the model itself; 0 moves none."""
    shares = FallbackShare()
    assert not shares.allows("m", 0.0)
    for _ in range(2):
        assert shares.allows("m", 0.1)
        shares.count("m", moved=True)
    assert not shares.allows("m", 0.1)
    for _ in range(8):
        shares.count("m", moved=False)
    assert not shares.allows("m", 0.1)  # 3 of 11 (counted as 20) is over 10%
    for _ in range(20):
        shares.count("m", moved=False)
    assert shares.allows("m", 0.1)  # 3 of 31
    assert shares.allows("other", 0.1)  # counted per model
    assert shares.share("m") == pytest.approx(2 / 30)


def test_the_fallback_share_follows_the_latest_requests() -> None:
    """Both counts halve once the window is full: a burst of moves long ago fades."""
    shares = FallbackShare()
    for _ in range(FALLBACK_WINDOW // 2):
        shares.count("m", moved=True)
    for _ in range(FALLBACK_WINDOW * 4):
        shares.count("m", moved=False)
    share = shares.share("m")
    assert share is not None and share < 0.01

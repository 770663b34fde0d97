"""The concurrency knee of a provider without a load scrape, learned from in-flight counts.

`TTFTPredictor.observe_sent` is fed literal observations (this replica's in-flight count on the
deployment when an attempt was sent, its TTFT) on a clock the test moves; the knee (the
provider's slots), the unloaded base and the prediction come out. The end-to-end test is in
tests/routing/test_knee_routing.py.
"""

from __future__ import annotations

import pytest

from gateway.routing.predict import KNEE_STALE_S, LEVEL_EVIDENCE, TTFTPredictor
from tests.routing.test_spill import Clock

BASE_S = 0.05


def four_slots(p: TTFTPredictor, queued_s: float = 0.3) -> None:
    """Attempts sent with 0-3 others in flight answer at the base; with 4 or 5, later."""
    for _ in range(LEVEL_EVIDENCE):
        for inflight in range(4):
            p.observe_sent("d", "short", inflight, BASE_S)
        p.observe_sent("d", "short", 4, queued_s)
        p.observe_sent("d", "short", 5, 2 * queued_s)


def test_the_knee_is_the_first_in_flight_count_whose_ttfts_queue() -> None:
    """Four attempts run at once at the base TTFT, the fifth waits: the slots are 4. Below them
    there is no prediction; at and above, the queue (itself counted) times what a queued
    request costs: before the fit has enough observations, the p50 total over the slots."""
    p = TTFTPredictor(Clock())
    assert p.predict_inflight("d", "short", 8, total_p50_s=1.0) is None  # nothing learned yet
    four_slots(p)
    for inflight in range(4):
        assert p.predict_inflight("d", "short", inflight, total_p50_s=1.0) is None
    assert p.predict_inflight("d", "short", 4, total_p50_s=1.0) == pytest.approx(
        (BASE_S + 1.0 / 4, 1.0)
    )
    assert p.predict_inflight("d", "short", 6, total_p50_s=1.0) == pytest.approx(
        (BASE_S + 3 * 1.0 / 4, 3.0)
    )
    learned = p.learned()["d/short"]
    assert (learned["slots"], learned["unloaded_ms"]) == (4.0, BASE_S * 1000)


def test_the_fit_learns_what_each_queued_request_costs() -> None:
    """Once the knee is known, each TTFT joins the deployment's fit against its queue: 200 ms
    per queued request, learned, outweighs the prior's 100 ms (a 0.4 s total over 4 slots)."""
    p = TTFTPredictor(Clock())
    four_slots(p, queued_s=BASE_S + 0.2)
    for _ in range(10):
        for inflight in range(7):
            p.observe_sent("d", "short", inflight, BASE_S + 0.2 * max(0, inflight - 3))
    predicted = p.predict_inflight("d", "short", 5, total_p50_s=0.4)
    assert predicted is not None
    assert predicted[1] == 2.0
    assert predicted[0] == pytest.approx(BASE_S + 0.2 * 2, rel=0.05)


def test_a_stall_tail_below_the_knee_is_no_knee() -> None:
    """A provider that never queues but stalls now and then (one attempt in seven takes 3 s, at
    any in-flight count) has no knee: no prediction at any load, its latency statistics rule."""
    p = TTFTPredictor(Clock())
    for round_ in range(7):
        for inflight in range(12):
            stalled = (round_ + inflight) % 7 == 0
            p.observe_sent("d", "short", inflight, 3.0 if stalled else BASE_S)
    assert all(p.predict_inflight("d", "short", n, total_p50_s=1.0) is None for n in range(20))
    assert p.learned()["d/short"]["slots"] is None


def test_attempts_cut_without_a_first_token_show_a_level_is_queued() -> None:
    """Attempts sent with 4 in flight were all cut (a deadline, a hedge that won) 250 ms in:
    past twice the base, so they are queued though none answered. Cut sooner than that they
    say nothing (a hedge may have won first)."""
    p = TTFTPredictor(Clock())
    for _ in range(LEVEL_EVIDENCE):
        for inflight in range(4):
            p.observe_sent("d", "short", inflight, BASE_S)
        p.observe_sent("d", "short", 4, 0.08, censored=True)  # no information
    assert p.predict_inflight("d", "short", 4, total_p50_s=1.0) is None
    for _ in range(LEVEL_EVIDENCE):
        p.observe_sent("d", "short", 4, 0.25, censored=True)
    assert p.predict_inflight("d", "short", 4, total_p50_s=1.0) == pytest.approx(
        (BASE_S + 0.25, 1.0)
    )


def test_the_knee_is_per_provider_and_the_base_per_prompt_band() -> None:
    """Long prompts not yet seen queueing use the knee the short ones showed, from their own
    unloaded base."""
    p = TTFTPredictor(Clock())
    four_slots(p)
    for _ in range(LEVEL_EVIDENCE):
        p.observe_sent("d", "long", 0, 0.2)
    assert p.predict_inflight("d", "long", 4, total_p50_s=1.0) == pytest.approx((0.2 + 0.25, 1.0))
    assert p.predict_inflight("other", "short", 9, total_p50_s=1.0) is None


def test_a_knee_not_seen_again_is_forgotten() -> None:
    """The provider may have grown: a knee whose queued level is not seen for `KNEE_STALE_S`
    no longer predicts, until the level queues again."""
    clock = Clock()
    p = TTFTPredictor(clock)
    four_slots(p)
    clock.now += KNEE_STALE_S / 2
    for _ in range(LEVEL_EVIDENCE):  # traffic below the knee keeps coming; the knee ages
        p.observe_sent("d", "short", 2, BASE_S)
    assert p.predict_inflight("d", "short", 4, total_p50_s=1.0) is not None
    clock.now += KNEE_STALE_S / 2 + 1.0
    assert p.predict_inflight("d", "short", 4, total_p50_s=1.0) is None
    for _ in range(LEVEL_EVIDENCE):
        p.observe_sent("d", "short", 0, BASE_S)
        p.observe_sent("d", "short", 4, 0.3)
    assert p.predict_inflight("d", "short", 4, total_p50_s=1.0) is not None


def test_a_slow_spell_is_not_a_knee() -> None:
    """A provider that slows down at every level (more requests are in flight because each takes
    longer) shows no knee: its levels are compared on what they show now, side by side, not a
    slow level today against the fast base it had before the spell."""
    clock = Clock()
    p = TTFTPredictor(clock)
    for _ in range(LEVEL_EVIDENCE):
        for inflight in range(2):
            p.observe_sent("d", "short", inflight, BASE_S)  # before the spell: one or two
    clock.now += 40.0  # the spell starts: in it, nothing is as fast as before
    for _ in range(LEVEL_EVIDENCE):
        for inflight in range(1, 8):  # the spell: four times slower, more in flight
            p.observe_sent("d", "short", inflight, 4 * BASE_S)
    assert p.learned()["d/short"]["slots"] is None
    assert p.predict_inflight("d", "short", 6, total_p50_s=1.0) is None
    clock.now += KNEE_STALE_S + 1.0  # the spell is over; then queueing: the low levels fast
    four_slots(p)  # beside the slow high ones, at the same time
    assert p.learned()["d/short"]["slots"] == 4.0

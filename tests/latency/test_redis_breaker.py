"""The one Redis breaker (`gateway.redis.Breaker`) that the latency store, the rate limiter and
the stored responses share: its states on a clock moved by hand, no Redis and no sleeps."""

from __future__ import annotations

import logging
import random

import pytest

from gateway.redis import Breaker


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def breaker(
    clock: Clock, *, jitter: tuple[float, float] = (1.0, 1.0), rng: random.Random | None = None
) -> Breaker:
    """Bounds 1 s to 8 s and no jitter unless asked: every wait is exact."""
    return Breaker(
        "test store",
        fallback="serving locally",
        backoff_min_s=1.0,
        backoff_max_s=8.0,
        jitter=jitter,
        clock=clock,
        rng=rng,
    )


def test_closed_lets_every_call_through() -> None:
    """Closed, every call gets a ticket, none of them a probe; a success changes nothing."""
    clock = Clock()
    b = breaker(clock)
    tickets = [b.ask() for _ in range(3)]
    assert all(t is not None and not t.probe for t in tickets)
    b.succeeded(tickets[0])  # type: ignore[arg-type]
    assert (b.state, b.degraded, b.outages, b.wait_s()) == ("ok", False, 0, 0.0)


def test_a_failure_opens_it_for_the_backoff() -> None:
    """One failure opens the breaker for `backoff_min_s`: no call goes until it is over."""
    clock = Clock()
    b = breaker(clock)
    ticket = b.ask()
    assert ticket is not None
    b.failed(ticket, ConnectionError())
    assert (b.state, b.degraded, b.outages, b.last_error) == (
        "degraded",
        True,
        1,
        "ConnectionError",
    )
    assert b.wait_s() == 1.0
    assert b.ask() is None
    clock.now += 0.999
    assert b.ask() is None
    assert b.wait_s() == pytest.approx(0.001)


def test_calls_that_fail_together_open_it_once() -> None:
    """Ten calls in flight when Redis stops answering are one outage: one opening, one back-off
    (not 2^9 of it), and a success of one of them proves nothing about now."""
    clock = Clock()
    b = breaker(clock)
    tickets = [b.ask() for _ in range(11)]
    for ticket in tickets[:10]:
        b.failed(ticket, TimeoutError())  # type: ignore[arg-type]
    assert (b.outages, b.wait_s()) == (1, 1.0)
    b.succeeded(tickets[10])  # type: ignore[arg-type]  # began before the opening
    assert b.state == "degraded"


def test_half_open_lets_one_probe_through() -> None:
    """After the back-off one call probes; the others are turned away while it is out."""
    clock = Clock()
    b = breaker(clock)
    b.failed(b.force(), OSError())
    clock.now += 1.0
    probe = b.ask()
    assert probe is not None and probe.probe
    assert b.ask() is None and b.ask() is None
    assert b.wait_s() == 0.0  # the wait is over; the probe is out
    b.succeeded(probe)
    assert (b.state, b.degraded, b.outages, b.wait_s()) == ("ok", False, 1, 0.0)
    after = b.ask()
    assert after is not None and not after.probe


def test_failed_probes_double_the_backoff_up_to_its_bound() -> None:
    """Each failed probe opens the breaker again for twice as long, up to `backoff_max_s`; a
    success starts over from `backoff_min_s`."""
    clock = Clock()
    b = breaker(clock)
    b.failed(b.force(), OSError())
    waits = [b.wait_s()]
    for _ in range(5):
        clock.now += waits[-1]
        probe = b.ask()
        assert probe is not None and probe.probe
        b.failed(probe, OSError())
        waits.append(b.wait_s())
    assert waits == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert b.outages == 6
    clock.now += 8.0
    probe = b.ask()
    assert probe is not None
    b.succeeded(probe)
    b.failed(b.force(), OSError())
    assert b.wait_s() == 1.0


def test_an_abandoned_probe_frees_the_probe() -> None:
    """A probe cancelled before it knew frees its place: the next call probes instead."""
    clock = Clock()
    b = breaker(clock)
    b.failed(b.force(), OSError())
    clock.now += 1.0
    probe = b.ask()
    assert probe is not None
    b.abandoned(probe)
    assert b.state == "degraded"
    again = b.ask()
    assert again is not None and again.probe


def test_a_forced_call_goes_while_open_and_counts_like_a_probe() -> None:
    """A flush made whatever the breaker says is not the probe, but it began after the opening:
    its failure opens the breaker again for twice as long, its success closes it."""
    clock = Clock()
    b = breaker(clock)
    b.failed(b.force(), OSError())
    forced = b.force()
    assert not forced.probe
    b.failed(forced, OSError())
    assert (b.outages, b.wait_s()) == (2, 2.0)
    b.succeeded(b.force())
    assert (b.state, b.wait_s()) == ("ok", 0.0)


def test_retry_now_ends_the_backoff() -> None:
    """`retry_now` (a last flush at shutdown) lets the next call probe at once."""
    clock = Clock()
    b = breaker(clock)
    b.failed(b.force(), OSError())
    b.retry_now()
    assert b.wait_s() == 0.0
    probe = b.ask()
    assert probe is not None and probe.probe
    assert b.state == "degraded"


def test_jitter_scales_each_backoff_within_its_bounds() -> None:
    """A factor drawn from `jitter` scales the back-off, so replicas that failed together come
    back apart; with (0.8, 1.0) a wait never exceeds the back-off a refusal announces."""
    waits = set()
    for seed in range(50):
        clock = Clock()
        b = breaker(clock, jitter=(0.8, 1.0), rng=random.Random(seed))
        b.failed(b.force(), OSError())
        waits.add(b.wait_s())
    assert all(0.8 <= w <= 1.0 for w in waits)
    assert len(waits) > 40


def test_openings_and_recovery_are_logged_without_the_message(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Each opening is logged with the caller, the exception's type, what is done meanwhile and
    for how long; never the exception's message (it may quote an address or a password). The
    recovery is logged once."""
    caplog.set_level(logging.WARNING, logger="gateway.redis")
    clock = Clock()
    b = breaker(clock)
    b.failed(b.force(), ConnectionError("AUTH hunter2 refused"))
    clock.now += 1.0
    probe = b.ask()
    assert probe is not None
    b.succeeded(probe)
    b.succeeded(b.force())
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "test store: Redis failed (ConnectionError); serving locally for 1.0 s",
        "test store: Redis is back (1 failed calls)",
    ]

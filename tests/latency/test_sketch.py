"""The sketch's accuracy and merges, and exact nearest-rank percentiles of raw values."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.latency.sketch import Sketch, latency_report, nearest_rank

LOW, HIGH = 1.0, 600_000.0  # 1 ms to 10 min
QUANTILES = [i / 100 for i in range(1, 100)] + [0.0, 0.995, 0.999, 1.0]


def _clamped(draw: Callable[[random.Random], float]) -> Callable[[random.Random], float]:
    return lambda rng: min(HIGH, max(LOW, draw(rng)))


DISTRIBUTIONS: dict[str, Callable[[random.Random], float]] = {
    "uniform": lambda rng: rng.uniform(LOW, HIGH),
    "lognormal": _clamped(lambda rng: rng.lognormvariate(math.log(300.0), 1.5)),
    "bimodal": _clamped(
        lambda rng: rng.gauss(120.0, 15.0) if rng.random() < 0.9 else rng.gauss(45_000.0, 5_000.0)
    ),
}


def _exact(ordered: list[float], q: float) -> float:
    return ordered[nearest_rank(q, len(ordered)) - 1]


@pytest.mark.parametrize("alpha", [0.01, 0.02])
@pytest.mark.parametrize("name", sorted(DISTRIBUTIONS))
def test_every_quantile_is_within_alpha_of_the_exact_one(name: str, alpha: float) -> None:
    """Each quantile of 20k values is within relative error alpha of the exact nearest rank."""
    rng = random.Random(f"{name}-{alpha}")
    values = [DISTRIBUTIONS[name](rng) for _ in range(20_000)]
    sketch = Sketch(alpha)
    for value in values:
        sketch.add(value)
    ordered = sorted(values)
    assert sketch.count == len(values)
    for q in QUANTILES:
        exact = _exact(ordered, q)
        assert abs(sketch.quantile(q) - exact) <= alpha * exact * (1 + 1e-9), q


def test_quantiles_match_single_quantile_calls() -> None:
    """One walk for several quantiles gives the same answers as separate calls, in any order."""
    rng = random.Random(7)
    sketch = Sketch()
    for _ in range(1000):
        sketch.add(rng.uniform(1, 5000))
    qs = (0.99, 0.5, 0.9, 0.0, 1.0)
    assert sketch.quantiles(qs) == [sketch.quantile(q) for q in qs]


def test_merge_equals_the_sketch_of_the_union() -> None:
    """Merging two sketches gives exactly the buckets of one sketch fed both inputs."""
    rng = random.Random(3)
    left = [rng.lognormvariate(5, 1) for _ in range(5000)]
    right = [rng.uniform(0, 20_000) for _ in range(3000)]
    a, b, union = Sketch(), Sketch(), Sketch()
    for value in left:
        a.add(value)
        union.add(value)
    for value in right:
        b.add(value)
        union.add(value)
    a.merge(b)
    assert a.buckets == union.buckets
    assert a.count == union.count == 8000
    assert a.quantile(0.99) == union.quantile(0.99)


def test_merge_refuses_a_different_alpha() -> None:
    """Sketches with different mappings cannot be merged."""
    with pytest.raises(ValueError, match="alpha"):
        Sketch(0.01).merge(Sketch(0.02))


def test_low_values_share_one_bucket_reported_as_one_ms() -> None:
    """Values of at most 1 ms (0, negative, NaN) land in one bucket, reported as its 1 ms bound."""
    sketch = Sketch()
    for value in (0.0, 0.3, 1.0, -2.0, math.nan):
        sketch.add(value)
    assert sketch.buckets == {0: 5}
    assert sketch.quantile(0.5) == 1.0
    sketch.add(math.inf, count=3)  # clamped: a finite bucket, not an OverflowError
    assert sketch.count == 8
    assert math.isfinite(sketch.quantile(1.0))


def test_from_buckets_round_trips() -> None:
    """A sketch rebuilt from its buckets answers the same quantiles."""
    sketch = Sketch()
    for value in (5.0, 50.0, 500.0, 5000.0):
        sketch.add(value, count=2)
    rebuilt = Sketch.from_buckets(sketch.buckets)
    assert rebuilt.buckets == sketch.buckets
    assert rebuilt.quantile(0.75) == sketch.quantile(0.75)


def test_empty_sketch_has_no_quantile() -> None:
    """Asking an empty sketch for a quantile is an error, not a made-up number."""
    with pytest.raises(ValueError, match="empty"):
        Sketch().quantile(0.5)


def test_nearest_rank_is_not_pushed_up_by_float_rounding() -> None:
    """ceil(q*n) with decimal q: 0.07 of 100 is rank 7, 0.99 of 100 is 99, 0.5 of 1 is 1."""
    assert nearest_rank(0.07, 100) == 7
    assert nearest_rank(0.99, 100) == 99
    assert nearest_rank(0.5, 1) == 1
    assert nearest_rank(0.0, 10) == 1
    with pytest.raises(ValueError):
        nearest_rank(1.5, 10)


@pytest.mark.parametrize(
    ("n", "p50", "p90", "p99"),
    [
        (1, 1.0, 1.0, 1.0),  # every percentile of one value is that value
        (2, 1.0, 2.0, 2.0),  # ceil(0.5*2)=1, ceil(0.9*2)=2, ceil(0.99*2)=2
        (10, 5.0, 9.0, 10.0),  # ranks 5, 9, 10
        (100, 50.0, 90.0, 99.0),  # ranks 50, 90, 99: p99 is not the maximum
    ],
)
def test_latency_report_uses_nearest_rank(n: int, p50: float, p90: float, p99: float) -> None:
    """latency_report returns the ceil(q*n)-th smallest value, whatever the input order."""
    values = [float(v) for v in range(n, 0, -1)]  # n..1, reversed on purpose
    report = latency_report(values)
    assert report == {
        "p50": p50,
        "p90": p90,
        "p99": p99,
        "mean": (n + 1) / 2,
        "max": float(n),
        "count": float(n),
    }


def test_latency_report_of_nothing_is_nan() -> None:
    """With no values the count is zero and every statistic is NaN."""
    report = latency_report([])
    assert report["count"] == 0.0
    assert all(math.isnan(v) for k, v in report.items() if k != "count")


# --- censored observations -----------------------------------------------------------------------

_TIMES = st.floats(min_value=1.5, max_value=60_000.0, allow_nan=False)


@given(
    exact=st.lists(_TIMES, min_size=1, max_size=60),
    cuts=st.lists(_TIMES, min_size=1, max_size=40),
    q=st.sampled_from([0.5, 0.9, 0.95, 0.99]),
)
@settings(max_examples=300, deadline=None, derandomize=True, database=None)
def test_a_cut_observation_never_lowers_a_quantile(
    exact: list[float], cuts: list[float], q: float
) -> None:
    """Counting "more than t" as censored gives quantiles at least as high as counting it as a
    value of t (what a cut attempt used to record): a rescued tail can only look slower."""
    censored, as_values = Sketch(), Sketch()
    for value in exact:
        censored.add(value)
        as_values.add(value)
    for cut in cuts:
        censored.add_censored(cut)
        as_values.add(cut)
    assert censored.quantile(q) >= as_values.quantile(q)


def test_the_estimate_redistributes_cut_observations_to_slower_ones() -> None:
    """Kaplan-Meier: a cut observation's weight moves to the exact ones slower than its cut; a
    quantile beyond every exact value (the slow ones were all cut) is infinite, not the cut."""
    sketch = Sketch()
    sketch.add(100.0, 90)
    sketch.add_censored(600.0, 5)
    sketch.add(2_000.0, 5)
    p90, p95, p99 = sketch.quantiles((0.90, 0.95, 0.99))
    assert p90 == pytest.approx(100, rel=0.02)
    assert p95 == pytest.approx(2_000, rel=0.02)  # the 5 cut at 600 ms count as slower ones
    assert p99 == pytest.approx(2_000, rel=0.02)
    rescued = Sketch()
    rescued.add(100.0, 92)
    rescued.add_censored(600.0, 8)  # every slow request cut at its deadline
    assert rescued.quantile(0.9) == pytest.approx(100, rel=0.02)
    assert rescued.quantile(0.99) == math.inf
    assert rescued.largest_cut() == pytest.approx(600, rel=0.02)
    assert (rescued.count, rescued.exact_count, rescued.censored_count) == (100, 92, 8)


def test_censored_counts_merge_and_round_trip() -> None:
    """Merging adds censored counts too, and `from_buckets` rebuilds both kinds."""
    a, b = Sketch(), Sketch()
    a.add(100.0, 3)
    a.add_censored(500.0, 2)
    b.add_censored(500.0, 1)
    a.merge(b)
    assert a.censored_count == 3
    rebuilt = Sketch.from_buckets(a.buckets, censored=a.censored_buckets)
    assert rebuilt.quantiles((0.5, 0.99)) == a.quantiles((0.5, 0.99))

"""Quantile maths: a mergeable log-bucket sketch and exact percentiles of raw values.

`Sketch` follows DDSketch (Masson, Rim, Lee, VLDB 2019): a value x > 1 ms goes to bucket
`i = ceil(ln(x) / ln(gamma))` with `gamma = (1 + alpha) / (1 - alpha)`, and a bucket is reported
as `2 * gamma**i / (gamma + 1)`, which is within `alpha` of every value it holds. Sketches merge
exactly by adding counts, so slices of time and replicas combine without loss.

A sketch also counts right-censored observations, "the value was more than t" (an attempt cut at
a deadline, beaten by a hedge, or cut by the total budget before it ended), in buckets of their
own. Quantiles then come from the Kaplan-Meier estimate over the buckets: walking up from the
smallest, each bucket's exact values remove their share of the observations still "at risk"
(those not yet seen to end, censored ones included), so a censored observation lifts the
quantiles above its cut time rather than pulling them down to it. A quantile the estimate cannot
reach (every slower observation was cut) is `math.inf`: known only to exceed the largest cut.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

DEFAULT_ALPHA = 0.02
LOW_BUCKET = 0  # every value <= 1 ms, including 0 and anything unmeasurable (NaN, negative)
_MAX_MS = 1e10  # ~115 days: larger values (and inf) are clamped so the bucket stays finite


def nearest_rank(q: float, n: int) -> int:
    """The 1-based rank of the q-quantile of n values: ceil(q * n), at least 1.

    The product is nudged down by a relative 1e-12 so that decimal quantiles are not pushed up a
    rank by binary rounding (0.07 * 100 is 7.000000000000001 in floating point).
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be within [0, 1], got {q}")
    return max(1, math.ceil(q * n * (1.0 - 1e-12)))


class Sketch:
    """A DDSketch-style histogram of durations in milliseconds with relative accuracy `alpha`.

    Values of at most 1 ms share one low bucket, reported as 1 ms, its upper bound: sub-millisecond
    differences do not matter for routing, and the upper bound never flatters a deployment.
    """

    __slots__ = ("_buckets", "_censored", "_count", "_inv_log_gamma", "alpha", "gamma")

    def __init__(self, alpha: float = DEFAULT_ALPHA) -> None:
        if not 0.0 < alpha < 1.0:
            raise ValueError(f"alpha must be within (0, 1), got {alpha}")
        self.alpha = alpha
        self.gamma = (1.0 + alpha) / (1.0 - alpha)
        self._inv_log_gamma = 1.0 / math.log(self.gamma)
        self._buckets: dict[int, int] = {}
        self._censored: dict[int, int] = {}  # bucket of the cut time -> observations cut there
        self._count = 0  # exact observations (`censored_count` holds the others)

    @classmethod
    def from_buckets(
        cls,
        buckets: Mapping[int, int],
        alpha: float = DEFAULT_ALPHA,
        *,
        censored: Mapping[int, int] | None = None,
    ) -> Sketch:
        """Rebuild a sketch from bucket counts (as stored elsewhere, e.g. in Redis)."""
        sketch = cls(alpha)
        for key, count in buckets.items():
            sketch.add_key(key, count)
        for key, count in (censored or {}).items():
            sketch.add_censored_key(key, count)
        return sketch

    def key(self, value_ms: float) -> int:
        """The bucket that holds `value_ms`."""
        if not value_ms > 1.0:  # also catches NaN
            return LOW_BUCKET
        return math.ceil(math.log(min(value_ms, _MAX_MS)) * self._inv_log_gamma)

    def add_key(self, key: int, count: int = 1) -> None:
        """Count `count` values into bucket `key` (see `key`)."""
        if key < LOW_BUCKET:
            key = LOW_BUCKET
        self._buckets[key] = self._buckets.get(key, 0) + count
        self._count += count

    def add(self, value_ms: float, count: int = 1) -> None:
        self.add_key(self.key(value_ms), count)

    def add_censored_key(self, key: int, count: int = 1) -> None:
        """Count `count` observations known only to exceed a value in bucket `key`."""
        if key < LOW_BUCKET:
            key = LOW_BUCKET
        self._censored[key] = self._censored.get(key, 0) + count

    def add_censored(self, over_ms: float, count: int = 1) -> None:
        """Count an observation that was cut after `over_ms`: its value is more than that."""
        self.add_censored_key(self.key(over_ms), count)

    def merge(self, other: Sketch) -> None:
        """Add `other`'s counts to this sketch; both must share `alpha`."""
        if other.alpha != self.alpha:
            raise ValueError(f"cannot merge sketches with alpha {self.alpha} and {other.alpha}")
        for key, count in other._buckets.items():
            self._buckets[key] = self._buckets.get(key, 0) + count
        for key, count in other._censored.items():
            self._censored[key] = self._censored.get(key, 0) + count
        self._count += other._count

    @property
    def count(self) -> int:
        """Observations of either kind."""
        return self._count + self.censored_count

    @property
    def exact_count(self) -> int:
        return self._count

    @property
    def censored_count(self) -> int:
        return sum(self._censored.values()) if self._censored else 0

    @property
    def buckets(self) -> dict[int, int]:
        """A copy of the exact observations' bucket counts, by bucket key."""
        return dict(self._buckets)

    @property
    def censored_buckets(self) -> dict[int, int]:
        """A copy of the censored observations' counts, by the bucket of their cut time."""
        return dict(self._censored)

    def largest_cut(self) -> float | None:
        """The value reported for the bucket of the latest cut, if any observation was cut."""
        return self.value(max(self._censored)) if self._censored else None

    def value(self, key: int) -> float:
        """The estimate reported for bucket `key`, in milliseconds."""
        if key <= LOW_BUCKET:
            return 1.0
        return 2.0 * self.gamma**key / (self.gamma + 1.0)

    def quantile(self, q: float) -> float:
        """The value of nearest rank ceil(q * count), in milliseconds. Raises on an empty sketch."""
        return self.quantiles((q,))[0]

    def quantiles(self, qs: Iterable[float]) -> list[float]:
        """Several quantiles in one walk of the buckets (`qs` in any order); `math.inf` for one
        that lies beyond every exact value because the slower observations were all cut."""
        if self.count == 0:
            raise ValueError("quantile of an empty sketch")
        if self._censored:
            return self._kaplan_meier(list(qs))
        wanted = sorted((nearest_rank(q, self._count), i) for i, q in enumerate(qs))
        out = [0.0] * len(wanted)
        keys = iter(sorted(self._buckets))
        key = next(keys)
        seen = self._buckets[key]
        for rank, i in wanted:
            while seen < rank:
                key = next(keys)
                seen += self._buckets[key]
            out[i] = self.value(key)
        return out

    def _kaplan_meier(self, qs: list[float]) -> list[float]:
        """Quantiles of the Kaplan-Meier estimate; within a bucket, its exact values end before
        its censored ones are cut (the usual convention: a cut at t was still at risk at t)."""
        at_risk = self.count
        survival = 1.0
        out = [math.inf] * len(qs)
        pending = sorted(range(len(qs)), key=lambda i: qs[i])
        keys = sorted(self._buckets.keys() | self._censored.keys())
        for key in keys:
            ended = self._buckets.get(key, 0)
            if ended:
                survival *= 1.0 - ended / at_risk
                # The same nudge as `nearest_rank`: decimal quantiles are not pushed up a bucket
                # by binary rounding.
                while pending and 1.0 - survival >= qs[pending[0]] * (1.0 - 1e-12):
                    out[pending.pop(0)] = self.value(key)
            at_risk -= ended + self._censored.get(key, 0)
            if not pending or at_risk <= 0:
                break
        return out

    def __repr__(self) -> str:
        return (
            f"Sketch(alpha={self.alpha}, count={self._count}, censored={self.censored_count}, "
            f"buckets={len(self._buckets)})"
        )


def latency_report(values: Sequence[float]) -> dict[str, float]:
    """p50, p90, p99, mean, max and count of raw values, in the values' own unit.

    Percentiles are nearest-rank: the k-th smallest value with k = ceil(q * n), 1-based. (Indexing a
    sorted list at `int(n * q)` is off by one: with n = 100 it returns the maximum as p99 instead
    of the 99th value.) With no values every statistic but `count` is NaN.
    """
    n = len(values)
    if n == 0:
        nan = math.nan
        return {"p50": nan, "p90": nan, "p99": nan, "mean": nan, "max": nan, "count": 0.0}
    ordered = sorted(values)
    return {
        "p50": ordered[nearest_rank(0.50, n) - 1],
        "p90": ordered[nearest_rank(0.90, n) - 1],
        "p99": ordered[nearest_rank(0.99, n) - 1],
        "mean": math.fsum(ordered) / n,
        "max": ordered[-1],
        "count": float(n),
    }

"""Latency statistics: what every request hands over when it ends, and where it is kept.

`Recorder.record` is called on the request path, so it only touches memory. The stores keep, per
deployment and per model name, one sketch per metric (`ttft`, `tpot`, `total`) and per time slice;
the window is the sum of its slices. `refresh()` swaps in an immutable `Snapshot` for the router.
`MemoryLatencyStore` serves one process; `RedisLatencyStore` shares the slices between replicas
(through a standalone Redis, a Sentinel-managed one or a Redis Cluster: see `connect_redis`) and
falls back to its own numbers while Redis is unreachable. `run_store` owns their background
flush and refresh tasks.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import re
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Literal, Protocol, TypeVar
from urllib.parse import parse_qsl, unquote

import orjson
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import BlockingConnectionPool, parse_url
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff

from gateway.prompt_size import band_label, band_of, fit_line
from gateway.sketch import DEFAULT_ALPHA, Sketch, latency_report

__all__ = [
    "CANCELLED",
    "HEDGE_LOST",
    "METRICS",
    "NOT_FAILURES",
    "TOTAL_DEADLINE",
    "TTFT_DEADLINE",
    "BandStats",
    "FanOutRecorder",
    "LatencyStore",
    "MemoryLatencyStore",
    "MemoryRecorder",
    "MetricStats",
    "Recorder",
    "RedisClient",
    "RedisLatencyStore",
    "RedisTarget",
    "SLOStats",
    "Sample",
    "Sketch",
    "Snapshot",
    "TargetStats",
    "connect_redis",
    "latency_report",
    "observations",
    "parse_redis_url",
    "run_store",
]

logger = logging.getLogger(__name__)
_K = TypeVar("_K")
_F = TypeVar("_F")


@dataclass(frozen=True, slots=True)
class Sample:
    """One finished upstream attempt. Times in seconds; None when not measured."""

    deployment: str
    model: str
    ok: bool
    total_s: float
    ttft_s: float | None = None  # streaming only: attempt start to first content token
    tpot_s: float | None = None  # mean time per output token after the first
    # Right-censored observations: the attempt was cut (a deadline, a hedge that won, the total
    # budget, a client that left) after this long, so its TTFT or total is known only to exceed
    # it. What a cut attempt did observe (a first token, its tokens' pace) is kept as measured.
    ttft_over_s: float | None = None
    total_over_s: float | None = None
    prompt_bytes: int | None = None  # the request body's size: TTFT is also kept per size band
    wasted: bool = False  # started and thrown away for another attempt of the same request
    input_tokens: int | None = None
    output_tokens: int | None = None
    error: str | None = None  # why the attempt ended early (low-cardinality), when not ok
    hedge_for: str | None = None  # a hedge, started for a request to this model name
    endpoint: str = ""  # chat | completions | embeddings | messages (for telemetry)


class Recorder(Protocol):
    def record(self, sample: Sample) -> None: ...


class MemoryRecorder:
    """Keeps the most recent samples per deployment, in this process only."""

    def __init__(self, keep: int = 1000) -> None:
        self._keep = keep
        self.samples: dict[str, deque[Sample]] = {}
        self.errors: dict[str, int] = {}

    def record(self, sample: Sample) -> None:
        kept = self.samples.get(sample.deployment)
        if kept is None:
            kept = self.samples[sample.deployment] = deque(maxlen=self._keep)
        kept.append(sample)
        if not sample.ok:
            self.errors[sample.deployment] = self.errors.get(sample.deployment, 0) + 1


class FanOutRecorder:
    """Hands every sample to several recorders (e.g. a test's `MemoryRecorder` and the store)."""

    def __init__(self, *recorders: Recorder) -> None:
        self.recorders = recorders

    def record(self, sample: Sample) -> None:
        for recorder in self.recorders:
            recorder.record(sample)


# --- windowed statistics ---------------------------------------------------------------------

Metric = Literal["ttft", "tpot", "total"]
METRICS: tuple[Metric, ...] = ("ttft", "tpot", "total")
TTFT_DEADLINE = (
    "ttft_deadline"  # `Sample.error` of an attempt whose first token missed its deadline
)
HEDGE_LOST = "hedge_lost"  # the waited-on attempt a hedge beat: censored at its cancellation
CANCELLED = "cancelled"  # an attempt nobody needed any more (a hedge that lost, a client gone)
TOTAL_DEADLINE = "total_deadline"  # a stream the request's total budget cut before its end
NOT_FAILURES = frozenset({HEDGE_LOST, CANCELLED, TOTAL_DEADLINE})  # cut, not the upstream's fault
_CUT_BEFORE_FIRST_TOKEN = frozenset({TTFT_DEADLINE, HEDGE_LOST, CANCELLED})
Source = Literal["memory", "redis", "local-fallback"]
RECENT_SLICES = 2  # the recent view: the current slice and the one before (~5-10 s)
BYTES_PER_TOKEN = 4  # a request body's bytes per prompt token, roughly (no tokenizer on the path)
_MODEL_TAG = "model:"  # hash-tag prefix of per-model keys; deployments are tagged by bare name


def observations(sample: Sample) -> list[tuple[Metric, float, bool]]:
    """The latencies (ms) a sample contributes, each with whether it is censored.

    A successful attempt contributes what it measured. An attempt that ended early contributes
    what it saw (a first token and the pace of its tokens, when it got that far) exactly, and
    what it did not see as censored: "TTFT > t" for one cut before its first token, "total > t"
    for one cut before its end. Plain failures (errors) contribute nothing but their count.
    """
    found: list[tuple[Metric, float, bool]] = []
    if sample.ok:
        found.append(("total", sample.total_s * 1000.0, False))
    elif sample.total_over_s is not None:
        found.append(("total", sample.total_over_s * 1000.0, True))
    if sample.ttft_s is not None:
        found.append(("ttft", sample.ttft_s * 1000.0, False))
    elif sample.ttft_over_s is not None:
        found.append(("ttft", sample.ttft_over_s * 1000.0, True))
    elif sample.error in _CUT_BEFORE_FIRST_TOKEN and sample.total_over_s is None:
        found.append(("ttft", sample.total_s * 1000.0, True))
    if sample.tpot_s is not None:
        found.append(("tpot", sample.tpot_s * 1000.0, False))
    return found


def _tags(sample: Sample) -> tuple[str, str]:
    return sample.deployment, _MODEL_TAG + sample.model


class _Band:
    """TTFT and total time of one prompt-size band, and the sizes its TTFT observations had
    (for a fit across bands)."""

    __slots__ = ("bytes", "sketch", "total")

    def __init__(self, alpha: float) -> None:
        self.sketch = Sketch(alpha)  # TTFT
        self.total = Sketch(alpha)
        self.bytes = 0  # summed over the band's TTFT observations

    def merge(self, other: _Band) -> None:
        self.sketch.merge(other.sketch)
        self.total.merge(other.total)
        self.bytes += other.bytes


class _Counts:
    """One slice (or a merged window) of one deployment or model."""

    __slots__ = (
        "alpha",
        "bands",
        "clients",
        "errors",
        "hedges",
        "output_tokens",
        "outputs",
        "requests",
        "sketches",
        "slo",
        "wasted",
        "wasted_tokens",
    )

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.sketches: dict[Metric, Sketch] = {m: Sketch(alpha) for m in METRICS}
        self.bands: dict[int, _Band] = {}  # TTFT by prompt-size band (see gateway/prompt_size)
        self.requests = 0
        self.clients = 0  # client requests that asked for this model name (models only)
        self.errors = 0
        self.hedges = 0  # latency rescues (hedges, deadline failovers) for this model's requests
        self.slo = [0] * 6  # met and judged, for ttft, total and tpot (see `judged`)
        self.wasted = 0  # attempts started and thrown away for another of the same request
        self.wasted_tokens = 0  # their prompt tokens (estimated from the body: ~4 bytes each)
        self.output_tokens = 0  # summed over `outputs` successful attempts that reported them
        self.outputs = 0

    def add(self, sample: Sample) -> None:
        """Count everything but the latencies (see `observations`)."""
        self.requests += 1
        if not sample.ok and sample.error not in NOT_FAILURES:
            self.errors += 1
        if sample.ok and sample.output_tokens:
            self.output_tokens += sample.output_tokens
            self.outputs += 1
        if sample.wasted:
            self.wasted += 1
            self.wasted_tokens += (sample.prompt_bytes or 0) // BYTES_PER_TOKEN

    def band(self, band: int) -> _Band:
        found = self.bands.get(band)
        if found is None:
            found = self.bands[band] = _Band(self.alpha)
        return found

    def merge(self, other: _Counts) -> None:
        for metric, sketch in other.sketches.items():
            self.sketches[metric].merge(sketch)
        for band, counts in other.bands.items():
            self.band(band).merge(counts)
        self.requests += other.requests
        self.clients += other.clients
        self.slo = [a + b for a, b in zip(self.slo, other.slo, strict=True)]
        self.wasted += other.wasted
        self.wasted_tokens += other.wasted_tokens
        self.errors += other.errors
        self.hedges += other.hedges
        self.output_tokens += other.output_tokens
        self.outputs += other.outputs


class _Windows:
    """Per-tag slices of sketches in this process; a tag is a deployment or `model:<name>`."""

    def __init__(self, window_s: float, slice_s: float, alpha: float) -> None:
        if not 0 < slice_s <= window_s:
            raise ValueError("need 0 < slice_s <= window_s")
        self.slice_s = slice_s
        self.alpha = alpha
        # The window is the current slice plus older ones: a sample counts for at most window_s.
        self.n_slices = math.ceil(window_s / slice_s)
        self._slices: dict[str, dict[int, _Counts]] = {}

    def slice_of(self, now: float) -> int:
        return int(now // self.slice_s)

    def window(self, now: float) -> range:
        current = self.slice_of(now)
        return range(current - self.n_slices + 1, current + 1)

    def counts(self, tag: str, index: int) -> _Counts:
        slices = self._slices.get(tag)
        if slices is None:
            slices = self._slices[tag] = {}
        counts = slices.get(index)
        if counts is None:
            # A new slice starts: drop the ones that left the window (amortised O(1)).
            for old in [i for i in slices if i <= index - self.n_slices]:
                del slices[old]
            counts = slices[index] = _Counts(self.alpha)
        return counts

    def peek(self, tag: str, index: int) -> _Counts | None:
        """The counts of one slice, if this process has any (creates nothing)."""
        slices = self._slices.get(tag)
        return None if slices is None else slices.get(index)

    def tags(self) -> set[str]:
        return set(self._slices)

    def merged(self, now: float, *, last: int | None = None) -> dict[str, _Counts]:
        """Every tag's counts over the window (over its `last` slices only, when given)."""
        window = self.window(now)
        start = window.start if last is None else window.stop - last
        out: dict[str, _Counts] = {}
        for tag, slices in self._slices.items():
            total = out[tag] = _Counts(self.alpha)
            for index in [i for i in slices if i < window.start]:
                del slices[index]
            for index, counts in slices.items():
                if start <= index < window.stop:
                    total.merge(counts)
        return out


@dataclass(frozen=True, slots=True)
class MetricStats:
    """Percentiles (ms) of one metric over the window; None when there are no samples, and
    `math.inf` when the quantile lies beyond every exact value because the slower observations
    were all cut (it is then known only to exceed `beyond`)."""

    p50: float | None
    p90: float | None
    p95: float | None
    p99: float | None
    count: int  # observations, censored ones included
    trusted: bool  # count >= min_samples: below that p99 is little more than the maximum
    censored: int = 0  # observations known only as "more than t"
    beyond: float | None = None  # the latest cut time among them

    @classmethod
    def of(cls, sketch: Sketch, min_samples: int) -> MetricStats:
        if sketch.count == 0:
            return cls(None, None, None, None, 0, False)
        p50, p90, p95, p99 = sketch.quantiles((0.50, 0.90, 0.95, 0.99))
        count = sketch.count
        return cls(
            p50,
            p90,
            p95,
            p99,
            count,
            count >= min_samples,
            sketch.censored_count,
            sketch.largest_cut(),
        )

    def as_dict(self) -> dict[str, float | int | None]:
        # The sketch is only good to ~2% anyway: three decimals of a millisecond is plenty.
        # A quantile known only to exceed `beyond_ms` is null.
        return {
            "p50": _ms(self.p50),
            "p90": _ms(self.p90),
            "p95": _ms(self.p95),
            "p99": _ms(self.p99),
            "count": self.count,
            "censored": self.censored,
            "beyond_ms": _ms(self.beyond),
        }


def _ms(value: float | None) -> float | None:
    return None if value is None or math.isinf(value) else round(value, 3)


SLO = Literal["ttft", "total", "tpot"]
SLOS: tuple[SLO, ...] = ("ttft", "total", "tpot")


@dataclass(frozen=True, slots=True)
class SLOStats:
    """How many of the window's client requests met their TTFT, total and TPOT budgets, of
    those that had one (a request is judged on each budget it carries; an error misses all)."""

    ttft_met: int = 0
    ttft_judged: int = 0
    total_met: int = 0
    total_judged: int = 0
    tpot_met: int = 0
    tpot_judged: int = 0

    def counts(self, slo: SLO) -> tuple[int, int]:
        """(met, judged) for one SLO."""
        at = SLOS.index(slo)
        values = (
            self.ttft_met,
            self.ttft_judged,
            self.total_met,
            self.total_judged,
            self.tpot_met,
            self.tpot_judged,
        )
        return values[2 * at], values[2 * at + 1]

    def attainment(self, slo: SLO) -> float | None:
        met, judged = self.counts(slo)
        return met / judged if judged else None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for slo in SLOS:
            met, judged = self.counts(slo)
            share = self.attainment(slo)
            out[slo] = {
                "met": met,
                "judged": judged,
                "attainment": None if share is None else round(share, 4),
            }
        return out


@dataclass(frozen=True, slots=True)
class BandStats:
    """TTFT of one prompt-size band over the window, and the mean body size it saw."""

    ttft: MetricStats
    mean_bytes: float
    total: MetricStats = field(default_factory=lambda: MetricStats.of(Sketch(), 1))

    def as_dict(self, band: int) -> dict[str, Any]:
        return {
            "band": band,
            "prompt": band_label(band),
            "mean_prompt_bytes": round(self.mean_bytes),
            **self.ttft.as_dict(),
            "total_ms": self.total.as_dict(),
        }


def _no_bands() -> Mapping[int, BandStats]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class TargetStats:
    """What the window says about one deployment or one model name."""

    ttft: MetricStats
    tpot: MetricStats
    total: MetricStats
    requests: int  # attempts that ended in the window, failed ones and hedges included
    errors: int  # attempts that failed (lost hedge races and cancellations are not failures)
    inflight: int  # this process's attempts in progress now (not shared between replicas)
    hedges: int = 0  # latency rescues (hedges, deadline failovers) for this model's requests
    clients: int = 0  # client requests that asked for this model name (models only)
    slo: SLOStats = field(default_factory=SLOStats)
    wasted: int = 0  # attempts started and thrown away for another of the same request
    wasted_prompt_tokens: int = 0  # their prompt tokens (estimated)
    output_tokens: float | None = None  # mean output length of the successful attempts
    bands: Mapping[int, BandStats] = field(default_factory=_no_bands)  # TTFT by prompt size

    @classmethod
    def empty(cls) -> TargetStats:
        nothing = MetricStats(None, None, None, None, 0, False)
        return cls(ttft=nothing, tpot=nothing, total=nothing, requests=0, errors=0, inflight=0)

    @property
    def trusted(self) -> bool:
        """Enough samples of TTFT or total latency; routing should check the metric it uses."""
        return self.ttft.trusted or self.total.trusted

    def as_dict(self) -> dict[str, Any]:
        return {
            "ttft_ms": self.ttft.as_dict(),
            "tpot_ms": self.tpot.as_dict(),
            "total_ms": self.total.as_dict(),
            "requests": self.requests,
            "errors": self.errors,
            "hedges": self.hedges,
            "client_requests": self.clients,
            "extra_load": round(self.hedges / self.clients, 4) if self.clients else None,
            "slo": self.slo.as_dict(),
            "wasted": {"attempts": self.wasted, "prompt_tokens": self.wasted_prompt_tokens},
            "inflight": self.inflight,
            "output_tokens_mean": None
            if self.output_tokens is None
            else round(self.output_tokens, 1),
            "trusted": self.trusted,
            "cooldown_until": None,  # filled in by the router's view, which owns cooldowns
            "ttft_by_prompt": [self.bands[b].as_dict(b) for b in sorted(self.bands)],
            "ttft_model": self.ttft_model(),
        }

    def ttft_model(self) -> dict[str, dict[str, float] | None]:
        """TTFT as `base + slope x prompt size` per quantile, fitted through the trusted prompt
        bands (None for a quantile with fewer than two sizes to fit, or a tail beyond the cuts)."""
        out: dict[str, dict[str, float] | None] = {}
        for level in ("p50", "p90", "p99"):
            points = [
                (band.mean_bytes, value)
                for band in self.bands.values()
                if band.ttft.trusted
                and (value := getattr(band.ttft, level)) is not None
                and not math.isinf(value)
            ]
            line = fit_line(points)
            out[level] = (
                None
                if line is None
                else {"base_ms": round(line[0], 3), "ms_per_kib": round(line[1] * 1024, 4)}
            )
        return out


def _no_targets() -> Mapping[str, TargetStats]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Snapshot:
    """An immutable view of the window, swapped in whole by `refresh()`; what the router reads."""

    window_s: float
    taken_at: float  # clock time of the refresh that built it
    source: Source
    deployments: Mapping[str, TargetStats] = field(default_factory=_no_targets)
    models: Mapping[str, TargetStats] = field(default_factory=_no_targets)
    # Deployments over the last `RECENT_SLICES` slices only: how a deployment that was routed
    # away is doing now (its full window still holds the bad spell it was routed away for).
    recent: Mapping[str, TargetStats] = field(default_factory=_no_targets)

    def age_s(self, now: float | None = None) -> float:
        return (time.time() if now is None else now) - self.taken_at

    def as_dict(self, now: float | None = None) -> dict[str, Any]:
        """The JSON body of `GET /admin/latency`."""
        return {
            "window_s": self.window_s,
            "taken_at": self.taken_at,
            "age_s": round(self.age_s(now), 3),
            "source": self.source,
            "deployments": {name: s.as_dict() for name, s in sorted(self.deployments.items())},
            "models": {name: s.as_dict() for name, s in sorted(self.models.items())},
        }


def _snapshot(
    merged: Mapping[str, _Counts],
    inflight: Mapping[str, int],
    *,
    window_s: float,
    min_samples: int,
    now: float,
    source: Source,
    alpha: float,
    recent: Mapping[str, _Counts] | None = None,
) -> Snapshot:
    deployments: dict[str, TargetStats] = {}
    models: dict[str, TargetStats] = {}
    for tag in merged.keys() | inflight.keys():
        counts = merged.get(tag) or _Counts(alpha)
        stats = TargetStats(
            ttft=MetricStats.of(counts.sketches["ttft"], min_samples),
            tpot=MetricStats.of(counts.sketches["tpot"], min_samples),
            total=MetricStats.of(counts.sketches["total"], min_samples),
            requests=counts.requests,
            errors=counts.errors,
            inflight=inflight.get(tag, 0),
            hedges=counts.hedges,
            clients=counts.clients,
            slo=SLOStats(*counts.slo),
            wasted=counts.wasted,
            wasted_prompt_tokens=counts.wasted_tokens,
            output_tokens=counts.output_tokens / counts.outputs if counts.outputs else None,
            bands=MappingProxyType(
                {
                    band: BandStats(
                        MetricStats.of(found.sketch, min_samples),
                        found.bytes / found.sketch.count if found.sketch.count else 0.0,
                        MetricStats.of(found.total, min_samples),
                    )
                    for band, found in counts.bands.items()
                    if found.sketch.count or found.total.count
                }
            ),
        )
        if tag.startswith(_MODEL_TAG):
            models[tag.removeprefix(_MODEL_TAG)] = stats
        else:
            deployments[tag] = stats
    latest: dict[str, TargetStats] = {}
    recent_min = max(1, min_samples // 2)  # judged on a short spell: fewer samples, by design
    for tag, counts in (recent or {}).items():
        if tag.startswith(_MODEL_TAG) or not counts.requests:
            continue
        latest[tag] = TargetStats(
            ttft=MetricStats.of(counts.sketches["ttft"], recent_min),
            tpot=MetricStats.of(counts.sketches["tpot"], recent_min),
            total=MetricStats.of(counts.sketches["total"], recent_min),
            requests=counts.requests,
            errors=counts.errors,
            inflight=inflight.get(tag, 0),
            bands=MappingProxyType(
                {
                    band: BandStats(
                        MetricStats.of(found.sketch, recent_min),
                        found.bytes / found.sketch.count,
                    )
                    for band, found in counts.bands.items()
                    if found.sketch.count
                }
            ),
        )
    return Snapshot(
        window_s=window_s,
        taken_at=now,
        source=source,
        deployments=MappingProxyType(deployments),
        models=MappingProxyType(models),
        recent=MappingProxyType(latest),
    )


# --- stores ----------------------------------------------------------------------------------


class LatencyStore(Recorder, Protocol):
    """Windowed latency statistics. `record`, `started` and `finished` run on the request path
    (memory only, O(1)); `flush` and `refresh` run in background tasks (see `run_store`)."""

    @property
    def snapshot(self) -> Snapshot: ...

    @property
    def state(self) -> Literal["ok", "degraded"]: ...

    def started(self, deployment: str, model: str | None = None) -> None: ...

    def finished(self, deployment: str, model: str | None = None) -> None: ...

    def arrived(self, model: str) -> None: ...

    def judged(
        self,
        model: str,
        deployment: str | None,
        *,
        ttft_met: bool | None,
        total_met: bool | None,
        tpot_met: bool | None = None,
    ) -> None: ...

    def inflight(self, tag: str) -> int: ...

    async def flush(self) -> None: ...

    async def refresh(self) -> Snapshot: ...

    def health(self) -> dict[str, Any]: ...

    async def aclose(self) -> None: ...


class MemoryLatencyStore:
    """Windowed sketches in this process only: one replica, or the local view of a shared store."""

    _source: Source = "memory"

    def __init__(
        self,
        *,
        window_s: float = 60.0,
        slice_s: float = 5.0,
        min_samples: int = 20,
        alpha: float = DEFAULT_ALPHA,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.window_s = window_s
        self.min_samples = min_samples
        self.alpha = alpha
        self._clock = clock
        self._windows = _Windows(window_s, slice_s, alpha)
        self._inflight: dict[str, int] = {}
        self._mapping = Sketch(alpha)  # computes bucket keys once per observation
        self._snapshot = Snapshot(window_s=window_s, taken_at=clock(), source=self._source)

    @property
    def snapshot(self) -> Snapshot:
        return self._snapshot

    @property
    def state(self) -> Literal["ok", "degraded"]:
        return "ok"

    def record(self, sample: Sample) -> None:
        self._record_local(sample, self._windows.slice_of(self._clock()))

    def _record_local(self, sample: Sample, index: int) -> list[tuple[Metric, int, bool]]:
        """Count `sample` into slice `index`; return the bucket key of each observation."""
        found = observations(sample)
        keyed = [(metric, self._mapping.key(ms), censored) for metric, ms, censored in found]
        for tag in _tags(sample):
            counts = self._windows.counts(tag, index)
            counts.add(sample)
            for metric, key, censored in keyed:
                if censored:
                    counts.sketches[metric].add_censored_key(key)
                else:
                    counts.sketches[metric].add_key(key)
                if metric != "tpot" and sample.prompt_bytes is not None:
                    band = counts.band(band_of(sample.prompt_bytes))
                    sketch = band.total
                    if metric == "ttft":
                        band.bytes += sample.prompt_bytes
                        sketch = band.sketch
                    if censored:
                        sketch.add_censored_key(key)
                    else:
                        sketch.add_key(key)
        if sample.hedge_for is not None:
            # Hedges count against the model the client asked for, whose cap they spend.
            self._windows.counts(_MODEL_TAG + sample.hedge_for, index).hedges += 1
        return keyed

    def arrived(self, model: str) -> None:
        """A client request for `model` was admitted: what caps on extra load are a share of."""
        self._windows.counts(_MODEL_TAG + model, self._windows.slice_of(self._clock())).clients += 1

    def judged(
        self,
        model: str,
        deployment: str | None,
        *,
        ttft_met: bool | None,
        total_met: bool | None,
        tpot_met: bool | None = None,
    ) -> None:
        """A client request for `model` ended: whether it met its TTFT, total and TPOT budgets
        (None: it had no such budget), counted for the model and the deployment that served it."""
        index = self._windows.slice_of(self._clock())
        tags = [_MODEL_TAG + model] if deployment is None else [_MODEL_TAG + model, deployment]
        for tag in tags:
            slo = self._windows.counts(tag, index).slo
            for at, met in enumerate((ttft_met, total_met, tpot_met)):
                if met is not None:
                    slo[2 * at] += met
                    slo[2 * at + 1] += 1
        self._judged(tags, index)

    def _judged(self, tags: list[str], index: int) -> None:
        """Hook for stores that share what was counted."""

    def inflight(self, tag: str) -> int:
        """Attempts in progress now on a deployment (this process only)."""
        return self._inflight.get(tag, 0)

    def started(self, deployment: str, model: str | None = None) -> None:
        """An attempt began; pass the same arguments to `finished` when it ends."""
        for tag in (deployment,) if model is None else (deployment, _MODEL_TAG + model):
            self._inflight[tag] = self._inflight.get(tag, 0) + 1

    def finished(self, deployment: str, model: str | None = None) -> None:
        for tag in (deployment,) if model is None else (deployment, _MODEL_TAG + model):
            left = self._inflight.get(tag, 0) - 1
            if left > 0:
                self._inflight[tag] = left
            else:
                self._inflight.pop(tag, None)

    def local_snapshot(self, source: Source | None = None) -> Snapshot:
        """A snapshot of this process's own window."""
        now = self._clock()
        return _snapshot(
            self._windows.merged(now),
            self._inflight,
            window_s=self.window_s,
            min_samples=self.min_samples,
            now=now,
            source=source or self._source,
            alpha=self.alpha,
            recent=self._windows.merged(now, last=RECENT_SLICES),
        )

    async def flush(self) -> None:
        """Nothing to share: everything is already in memory."""

    async def refresh(self) -> Snapshot:
        self._snapshot = self.local_snapshot()
        return self._snapshot

    def health(self) -> dict[str, Any]:
        """The latency-store part of `/readyz`."""
        return {"type": "memory", "state": "ok", "snapshot_age_s": self._age()}

    def _age(self) -> float:
        return round(self._snapshot.age_s(self._clock()), 3)

    async def aclose(self) -> None:
        pass


# --- connecting ------------------------------------------------------------------------------

RedisClient = Redis | RedisCluster
"""What `RedisLatencyStore` talks to: a standalone or Sentinel-managed Redis, or a Redis Cluster."""

RedisTopology = Literal["standalone", "sentinel", "cluster"]
_STANDALONE_SCHEMES = ("redis", "rediss", "unix")
_SENTINEL_SCHEME = "redis+sentinel"
_CLUSTER_SCHEME = "redis+cluster"
_SCHEMES = "redis://, rediss://, unix://, redis+sentinel:// or redis+cluster://"


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """A parsed Redis URL (see `parse_redis_url`); `repr` leaves the credentials out."""

    topology: RedisTopology
    nodes: tuple[tuple[str, int], ...] = ()  # the sentinels, or the cluster's startup nodes
    service: str | None = None  # the master's name at the sentinels
    db: int = 0
    username: str | None = field(default=None, repr=False)
    password: str | None = field(default=None, repr=False)
    sentinel_password: str | None = field(default=None, repr=False)


def parse_redis_url(url: str) -> RedisTarget:
    """Check a Redis URL and say which topology it names. Accepted forms:

    - `redis://[[user]:password@]host[:port][/db]`, `rediss://...` (TLS), `unix://[[user]:
      password@]/path.sock[?db=N]`: one Redis server (redis-py's own URL syntax, query included);
    - `redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db]
      [?sentinel_password=password]`: the master that the Sentinels at `host:port` (default port
      26379) know as `service`; the credentials are the master's, `sentinel_password` (if the
      Sentinels themselves require one) the Sentinels';
    - `redis+cluster://[[user]:password@]host[:port][,host[:port]...][/]`: a Redis Cluster
      discovered from these startup nodes (default port 6379); database 0 only.

    User names and passwords are percent-decoded (encode `@`, `:`, `/`, `,` and `%` in them). An
    IPv6 host is written in brackets, `[::1]:26379`. Raises ValueError with a message that never
    repeats the URL or any part of its credentials.
    """
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in (*_STANDALONE_SCHEMES, _SENTINEL_SCHEME, _CLUSTER_SCHEME):
        raise ValueError(f"Redis URL: unsupported scheme; expected {_SCHEMES}")
    if scheme in _STANDALONE_SCHEMES:
        try:
            parse_url(url)
        except ValueError as exc:
            raise ValueError(f"Redis URL: {_safe_reason(exc, rest)}") from None
        return RedisTarget("standalone")
    # The host list holds commas, which urlsplit's port parsing would reject: split by hand.
    location, _, query = rest.partition("?")
    location, hash_, _ = location.partition("#")
    if hash_:
        raise ValueError("Redis URL: a fragment (#...) is not allowed")
    credentials, at, location = location.rpartition("@")
    hosts, slash, path = location.partition("/")
    if at and "/" in credentials:
        raise ValueError("Redis URL: percent-encode '/' in the user name or password (%2F)")
    username, colon, password = credentials.partition(":")
    options = _query(query, allowed=("sentinel_password",) if scheme == _SENTINEL_SCHEME else ())
    default_port = 26379 if scheme == _SENTINEL_SCHEME else 6379
    target = RedisTarget(
        "standalone",  # replaced below
        nodes=_nodes(hosts, default_port),
        username=unquote(username) or None,
        password=unquote(password) if colon and password else None,
        sentinel_password=options.get("sentinel_password") or None,
    )
    parts = [unquote(p) for p in path.split("/")] if slash else []
    if parts and not parts[-1]:
        parts.pop()  # a trailing slash
    if scheme == _CLUSTER_SCHEME:
        if parts not in ([], ["0"]):
            raise ValueError("Redis URL: a Redis Cluster has database 0 only; leave the path empty")
        return replace(target, topology="cluster")
    if not parts or not parts[0]:
        raise ValueError(
            "Redis URL: name the master after the sentinels, redis+sentinel://host:port/<service>"
        )
    if len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise ValueError(
            "Redis URL: the path after the sentinels is /<service>[/<db>], db a number"
        )
    db = int(parts[1]) if len(parts) == 2 else 0
    return replace(target, topology="sentinel", service=parts[0], db=db)


def _nodes(hosts: str, default_port: int) -> tuple[tuple[str, int], ...]:
    """`host[:port],...` as pairs. Errors name the node by position: text around an unencoded
    special character in a password could end up here, so none of it is repeated."""
    found: list[tuple[str, int]] = []
    items = hosts.split(",")
    for number, item in enumerate(items, 1):
        where = f"node {number} of {len(items)}"
        if item.startswith("["):  # [IPv6]:port
            host, closed, after = item[1:].partition("]")
            if not closed or (after and not after.startswith(":")):
                raise ValueError(f"Redis URL: {where}: expected [IPv6 address]:port")
            port_text = after[1:]
        else:
            host, _, port_text = item.partition(":")
            if ":" in port_text:
                raise ValueError(f"Redis URL: {where}: write an IPv6 address in brackets")
        if not host:
            raise ValueError(f"Redis URL: {where}: no host (expected host:port,host:port)")
        if port_text and not (port_text.isdigit() and 0 < int(port_text) < 65536):
            raise ValueError(f"Redis URL: {where}: the port is not a number from 1 to 65535")
        found.append((host, int(port_text) if port_text else default_port))
    return tuple(found)


def _query(query: str, allowed: tuple[str, ...]) -> dict[str, str]:
    options = dict(parse_qsl(query, keep_blank_values=True))
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        accepted = f"only {', '.join(allowed)} is accepted" if allowed else "none is accepted"
        raise ValueError(f"Redis URL: unknown query parameter {unknown[0]!r} ({accepted})")
    return options


def _safe_reason(exc: ValueError, rest: str) -> str:
    """redis-py's reason for rejecting a URL, unless it might quote part of the credentials."""
    reason = str(exc)
    credentials = rest.partition("?")[0].rpartition("@")[0]
    if any(piece and piece in reason for piece in re.split(r"[:/]", credentials)):
        return "cannot parse it (percent-encode special characters in the password)"
    return reason


class _SentinelMaster(Redis):
    """The master's client from `Sentinel.master_for`. The clients it asks for the master's
    address have connections of their own: closing the master's client closes them too."""

    sentinels: tuple[Redis, ...] = ()

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        try:
            await super().aclose(close_connection_pool)
        finally:
            for sentinel in self.sentinels:
                await sentinel.aclose()


def connect_redis(
    url: str,
    *,
    timeout_s: float = 0.25,
    max_connections: int = 4,
    wait_for_connection: bool = False,
) -> RedisClient:
    """A client suited to `RedisLatencyStore`: short timeouts, no retries (the store's breaker
    decides when to try again) and a small pool (per node, for a cluster), so an outage cannot
    cause a connection storm. The URL picks the topology: see `parse_redis_url`.

    Nothing is connected yet. The caller owns the client and must `await client.aclose()`.
    Raises ValueError (a message without the URL's secrets) when the URL is not usable.
    With `wait_for_connection`, a call finding every pooled connection busy waits (up to
    `timeout_s`) for one instead of failing at once: for callers on the request path.
    """
    target = parse_redis_url(url)
    if target.topology == "standalone" and wait_for_connection:
        pool = BlockingConnectionPool.from_url(
            url,
            timeout=timeout_s,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            max_connections=max_connections,
            retry=Retry(NoBackoff(), 0),
        )
        return Redis.from_pool(pool)  # the client closes its pool
    if target.topology == "standalone":
        return Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            max_connections=max_connections,
            retry=Retry(NoBackoff(), 0),
        )
    if target.topology == "cluster":
        # Without retries the client never re-reads the slot map by itself after a failover;
        # RedisLatencyStore closes it after a failure so that the next call does.
        return RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in target.nodes],
            username=target.username,
            password=target.password,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            max_connections=max_connections,
            retry=Retry(NoBackoff(), 0),
        )
    assert target.service is not None  # parse_redis_url requires it
    timeouts: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": Retry(NoBackoff(), 0),
        "max_connections": max_connections,
    }
    sentinel = Sentinel(  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
        target.nodes,
        sentinel_kwargs={**timeouts, "password": target.sentinel_password},
        username=target.username,
        password=target.password,
        db=target.db,
        **timeouts,
    )
    # A master's connection asks the sentinels where the master is whenever it (re)connects, so
    # a failover is followed on the first call after the breaker lets the store try again.
    master = sentinel.master_for(target.service, redis_class=_SentinelMaster)
    assert isinstance(master, _SentinelMaster)
    master.sentinels = tuple(sentinel.sentinels)
    return master


class RedisLatencyStore(MemoryLatencyStore):
    """Latency shared by every replica through Redis, failing open to this process's own numbers.

    Layout: one hash per deployment (or model name) and time slice,
    `tg:lat:{<tag>}:<slice start>`, with one field per replica holding that replica's running
    totals for the slice (bucket counts of each metric, requests, errors), packed as JSON. The tag
    is the deployment name or `model:<name>`; the `{...}` hash tag keeps each deployment's keys on
    one Redis Cluster node. A replica only ever overwrites its own field with its latest totals, so
    a write is idempotent (a retried or repeated flush cannot count twice), merging is addition over
    the fields, and Redis work grows with deployments and slices, not with requests: one `HSET`
    and `EXPIRE` per touched hash per flush (a `HINCRBY` per bucket would cost one command per
    distinct bucket per flush, several per request at a few hundred requests a second). Tags
    written in the last window are listed in the sorted set `tg:lat:index`, so replicas learn
    each other's deployments.

    `record` only touches memory (the local window, which is also the fallback). `flush` writes
    the slices touched since the last flush in one pipeline; `refresh` reads the window back,
    re-reading only the two newest slices once older ones are closed, and uses this replica's own
    totals fresh from memory. Any Redis failure opens a breaker: Redis is left alone until a
    jittered, doubling backoff expires, and meanwhile `refresh` serves the local window
    (`source="local-fallback"`). Touched slices stay marked until a flush succeeds; a slice that
    leaves the window before then is counted in `dropped_samples` (still counted locally).

    Every command names one key and the pipelines are not transactions, so on a Redis Cluster
    the client splits each pipeline by node and no command crosses slots; the index is one key.

    The store borrows `redis` (see `connect_redis`: a standalone, Sentinel-managed or cluster
    client); the caller closes it after `aclose()`.
    """

    _source: Source = "local-fallback"  # until the first successful read

    def __init__(
        self,
        redis: RedisClient,
        *,
        window_s: float = 60.0,
        slice_s: float = 5.0,
        min_samples: int = 20,
        alpha: float = DEFAULT_ALPHA,
        clock: Callable[[], float] = time.time,
        timeout_s: float = 0.5,
        backoff_min_s: float = 0.5,
        backoff_max_s: float = 10.0,
        prefix: str = "tg",
        rng: random.Random | None = None,
        replica: str | None = None,
    ) -> None:
        super().__init__(
            window_s=window_s, slice_s=slice_s, min_samples=min_samples, alpha=alpha, clock=clock
        )
        self._redis = redis
        self._slice_s = slice_s
        self._ttl_s = math.ceil(window_s + 2 * slice_s)
        self._timeout_s = timeout_s
        self._backoff_min_s = backoff_min_s
        self._backoff_max_s = backoff_max_s
        self._prefix = prefix
        self._index_key = f"{prefix}:lat:index"
        self._rng = rng or random.Random()
        self.replica = replica or os.urandom(8).hex()
        # (tag, slice) -> samples recorded there since its last successful flush
        self._dirty: dict[tuple[str, int], int] = {}
        self._closed: dict[tuple[str, int], _Counts] = {}  # merged slices no replica still writes
        self._failures_in_row = 0
        self._retry_at = -math.inf
        self.last_error: str | None = None
        self.last_ok_at: float | None = None
        self.flush_failures = 0
        self.refresh_failures = 0
        self.dropped_samples = 0

    # -- request path --

    def record(self, sample: Sample) -> None:
        index = self._windows.slice_of(self._clock())
        self._record_local(sample, index)
        dirty = self._dirty
        for tag in _tags(sample):
            place = (tag, index)
            dirty[place] = dirty.get(place, 0) + 1
        if sample.hedge_for is not None:
            place = (_MODEL_TAG + sample.hedge_for, index)
            dirty[place] = dirty.get(place, 0)

    def arrived(self, model: str) -> None:
        super().arrived(model)
        place = (_MODEL_TAG + model, self._windows.slice_of(self._clock()))
        self._dirty[place] = self._dirty.get(place, 0)

    def _judged(self, tags: list[str], index: int) -> None:
        for tag in tags:
            self._dirty[(tag, index)] = self._dirty.get((tag, index), 0)

    @property
    def pending_fields(self) -> int:
        """Hashes (deployment or model, slice) waiting for the next flush (one `HSET` each)."""
        return len(self._dirty)

    # -- breaker --

    @property
    def state(self) -> Literal["ok", "degraded"]:
        return "ok" if self._failures_in_row == 0 else "degraded"

    def _may_call(self) -> bool:
        return self._clock() >= self._retry_at

    def _failed(self, exc: BaseException) -> None:
        if self._failures_in_row == 0:
            logger.warning("latency store: Redis failed (%r); using local statistics", exc)
        self._failures_in_row += 1
        self.last_error = type(exc).__name__
        delay = min(self._backoff_max_s, self._backoff_min_s * 2 ** (self._failures_in_row - 1))
        self._retry_at = self._clock() + delay * self._rng.uniform(0.8, 1.2)

    async def _forget_topology(self) -> None:
        """Cluster only: make the next call re-read the slot map. A cluster client that does not
        retry never does so by itself, so after a failover it would keep calling the dead primary;
        closed, it drops its connections and rediscovers nodes and slots on its next call."""
        if isinstance(self._redis, RedisCluster):
            try:
                async with asyncio.timeout(self._timeout_s):
                    await self._redis.aclose()
            except Exception as exc:  # the next call tries again anyway
                logger.debug("latency store: closing the cluster client failed (%r)", exc)

    def _succeeded(self) -> None:
        if self._failures_in_row:
            logger.warning("latency store: Redis is back after %d failures", self._failures_in_row)
        self._failures_in_row = 0
        self._retry_at = -math.inf
        self.last_ok_at = self._clock()

    # -- background --

    def _key(self, tag: str, index: int) -> str:
        return f"{self._prefix}:lat:{{{tag}}}:{int(index * self._slice_s)}"

    async def flush(self) -> None:
        """Write this replica's totals of every touched slice in one pipeline."""
        if not self._dirty or not self._may_call():
            return
        now = self._clock()
        window = self._windows.window(now)
        dirty, self._dirty = self._dirty, {}
        writes: list[tuple[str, int, bytes]] = []
        for (tag, index), samples in dirty.items():
            counts = self._windows.peek(tag, index)
            if index < window.start or counts is None:
                self.dropped_samples += samples  # the slice left the window before Redis was back
                continue
            writes.append((tag, index, _pack(counts)))
        if not writes:
            return
        try:
            async with (
                asyncio.timeout(self._timeout_s),
                self._redis.pipeline(transaction=False) as pipe,
            ):
                for tag, index, packed in writes:
                    key = self._key(tag, index)
                    pipe.hset(key, self.replica, packed)
                    # Every write sets the TTL again: a Redis that restarted empty (or was
                    # flushed) must not be left with keys that never expire.
                    pipe.expire(key, self._ttl_s)
                pipe.zadd(self._index_key, dict.fromkeys({tag for tag, _, _ in writes}, now))
                pipe.zremrangebyscore(self._index_key, "-inf", now - self._ttl_s)
                pipe.expire(self._index_key, self._ttl_s)
                await pipe.execute()
        except Exception as exc:  # fail open: whatever went wrong, requests must not notice
            self.flush_failures += 1
            self._failed(exc)
            for tag, index, _ in writes:
                place = (tag, index)
                self._dirty[place] = self._dirty.get(place, 0) + dirty[place]
            await self._forget_topology()
        else:
            self._succeeded()

    async def refresh(self) -> Snapshot:
        """Swap in a snapshot of the shared window, or of the local one while Redis is failing."""
        if self._may_call():
            try:
                self._snapshot = await self._read()
            except Exception as exc:  # fail open, as in flush
                self.refresh_failures += 1
                self._failed(exc)
                await self._forget_topology()
            else:
                self._succeeded()
                return self._snapshot
        self._snapshot = self.local_snapshot("local-fallback")
        return self._snapshot

    async def _read(self) -> Snapshot:
        now = self._clock()
        window = self._windows.window(now)
        # Replicas flush every fraction of a second: a slice two slices old gets no more writes,
        # so it is read once and kept.
        open_from = window.stop - 2
        self._closed = {k: v for k, v in self._closed.items() if k[1] >= window.start}
        async with asyncio.timeout(self._timeout_s):
            listed = await self._redis.zrangebyscore(self._index_key, now - self._ttl_s, "+inf")
            tags = sorted(
                self._windows.tags()
                | self._inflight.keys()
                | {_text(t) for t in listed if isinstance(t, str | bytes)}
            )
            wanted = [
                (tag, index)
                for tag in tags
                for index in window
                if index >= open_from or (tag, index) not in self._closed
            ]
            async with self._redis.pipeline(transaction=False) as pipe:
                for tag, index in wanted:
                    pipe.hgetall(self._key(tag, index))
                replies = await pipe.execute()
        fresh: dict[tuple[str, int], _Counts] = {}
        for place, fields in zip(wanted, replies, strict=True):
            others = _Counts(self.alpha)  # every replica but this one, whose totals are in memory
            for replica, packed in fields.items():
                if _text(replica) != self.replica:
                    _unpack_into(others, packed)
            if place[1] < open_from:
                self._closed[place] = others
            else:
                fresh[place] = others
        merged: dict[str, _Counts] = {}
        recent: dict[str, _Counts] = {}
        recent_from = window.stop - RECENT_SLICES
        for tag in tags:
            total = merged[tag] = _Counts(self.alpha)
            latest = recent[tag] = _Counts(self.alpha)
            for index in window:
                for found in (
                    (self._closed if index < open_from else fresh).get((tag, index)),
                    self._windows.peek(tag, index),
                ):
                    if found is not None:
                        total.merge(found)
                        if index >= recent_from:
                            latest.merge(found)
        return _snapshot(
            merged,
            self._inflight,
            window_s=self.window_s,
            min_samples=self.min_samples,
            now=now,
            source="redis",
            alpha=self.alpha,
            recent=recent,
        )

    def health(self) -> dict[str, Any]:
        return {
            "type": "redis",
            "state": self.state,
            "last_error": self.last_error,
            "last_ok_at": self.last_ok_at,
            "flush_failures": self.flush_failures,
            "refresh_failures": self.refresh_failures,
            "dropped_samples": self.dropped_samples,
            "pending_fields": self.pending_fields,
            "snapshot_source": self._snapshot.source,
            "snapshot_age_s": self._age(),
        }

    async def aclose(self) -> None:
        """A last best-effort flush, bounded by the store's timeout; ignores the breaker."""
        self._retry_at = -math.inf
        await self.flush()


def _pack(counts: _Counts) -> bytes:
    """A replica's totals for one slice, as stored in its hash field."""
    return orjson.dumps(
        {
            "r": counts.requests,
            "e": counts.errors,
            "h": counts.hedges,
            "c": counts.clients,
            "s": counts.slo,
            "w": [counts.wasted, counts.wasted_tokens],
            "o": counts.output_tokens,
            "on": counts.outputs,
            **{metric: sketch.buckets for metric, sketch in counts.sketches.items()},
            # Censored observations ("more than t"), by metric; absent when there are none, so
            # replicas that predate them read the field unchanged.
            **{
                f"{metric}>": sketch.censored_buckets
                for metric, sketch in counts.sketches.items()
                if sketch.censored_count
            },
            # TTFT by prompt-size band: exact and censored buckets, and the sizes summed.
            "b": {
                band: [
                    counts_.sketch.buckets,
                    counts_.sketch.censored_buckets,
                    counts_.bytes,
                    counts_.total.buckets,
                    counts_.total.censored_buckets,
                ]
                for band, counts_ in counts.bands.items()
            },
        },
        option=orjson.OPT_NON_STR_KEYS,
    )


def _unpack_into(counts: _Counts, packed: str | bytes) -> None:
    try:
        data = orjson.loads(packed)
        counts.requests += int(data.get("r", 0))
        counts.errors += int(data.get("e", 0))
        counts.hedges += int(data.get("h", 0))
        counts.clients += int(data.get("c", 0))
        slo = [*(data.get("s") or ()), 0, 0, 0, 0, 0, 0][:6]
        counts.slo = [a + int(b) for a, b in zip(counts.slo, slo, strict=True)]
        wasted, wasted_tokens = data.get("w") or (0, 0)
        counts.wasted += int(wasted)
        counts.wasted_tokens += int(wasted_tokens)
        counts.output_tokens += int(data.get("o", 0))
        counts.outputs += int(data.get("on", 0))
        for metric in METRICS:
            sketch = counts.sketches[metric]
            for key, n in (data.get(metric) or {}).items():
                sketch.add_key(int(key), int(n))
            for key, n in (data.get(f"{metric}>") or {}).items():
                sketch.add_censored_key(int(key), int(n))
        for band, (exact, cut, size, *total) in (data.get("b") or {}).items():
            into = counts.band(int(band))
            into.bytes += int(size)
            for sketch, (exact_, cut_) in ((into.sketch, (exact, cut)), (into.total, total)):
                for key, n in exact_.items():
                    sketch.add_key(int(key), int(n))
                for key, n in cut_.items():
                    sketch.add_censored_key(int(key), int(n))
    except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError):
        logger.warning("latency store: ignoring a malformed entry in Redis")


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


@asynccontextmanager
async def run_store(
    store: LatencyStore, *, flush_every_s: float = 0.25, refresh_every_s: float = 1.0
) -> AsyncIterator[LatencyStore]:
    """Own the store's periodic flush and refresh tasks while the block runs.

    The snapshot is refreshed once on entry. On exit both tasks are cancelled and awaited, then the
    store makes a final flush. An exception in one round is logged and the loop carries on.
    """
    await _attempt(store.refresh, "refresh")
    tasks = [
        asyncio.create_task(_every(flush_every_s, store.flush, "flush"), name="latency-flush"),
        asyncio.create_task(
            _every(refresh_every_s, store.refresh, "refresh"), name="latency-refresh"
        ),
    ]
    try:
        yield store
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await _attempt(store.flush, "final flush")


async def _every(period_s: float, action: Callable[[], Awaitable[object]], what: str) -> None:
    while True:
        await asyncio.sleep(period_s)
        await _attempt(action, what)


async def _attempt(action: Callable[[], Awaitable[object]], what: str) -> None:
    try:
        await action()
    except Exception:  # a bad round must not end the loop; the next one may succeed
        logger.exception("latency store: %s failed", what)

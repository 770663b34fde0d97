"""The immutable view of the window that the router reads, and how it is built from counts."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from gateway.latency.prompt_size import band_label, fit_line
from gateway.latency.sketch import Sketch
from gateway.latency.window import MODEL_TAG, Counts

Source = Literal["memory", "redis", "local-fallback"]


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


def build_snapshot(
    merged: Mapping[str, Counts],
    inflight: Mapping[str, int],
    *,
    window_s: float,
    min_samples: int,
    now: float,
    source: Source,
    alpha: float,
    recent: Mapping[str, Counts] | None = None,
) -> Snapshot:
    """The snapshot of every tag's `merged` counts and this process's `inflight` attempts;
    `recent` (the last `RECENT_SLICES` slices) gives the deployments' recent view."""
    deployments: dict[str, TargetStats] = {}
    models: dict[str, TargetStats] = {}
    for tag in merged.keys() | inflight.keys():
        counts = merged.get(tag) or Counts(alpha)
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
        if tag.startswith(MODEL_TAG):
            models[tag.removeprefix(MODEL_TAG)] = stats
        else:
            deployments[tag] = stats
    latest: dict[str, TargetStats] = {}
    recent_min = max(1, min_samples // 2)  # judged on a short spell: fewer samples, by design
    for tag, counts in (recent or {}).items():
        if tag.startswith(MODEL_TAG) or not counts.requests:
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

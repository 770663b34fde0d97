"""A candidate: one deployment a call may be sent to, and what the latency window says about it.

Its TTFT and TPOT quantiles are read for this request's prompt size (`ttft_for_size`), from a
vLLM server's predicted load, trusted statistics, or the configured prior, in that order. Pure:
the planner (`gateway/routing/plan.py`) judges candidates by these figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from gateway.config import DeploymentSpec
from gateway.latency import MetricStats, TargetStats
from gateway.latency.prompt_size import band_of, fit_line
from gateway.upstream import Provider

Level = Literal["p50", "p90", "p95", "p99"]

BAND_EVIDENCE = 5
"""Observations of a prompt-size band that count as evidence it is slower than the rest."""
SEEN_EVIDENCE = 2
"""Observations of a prompt-size band whose median is taken as a hint of that size's TTFT."""


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
    # The prediction is from this replica's in-flight attempts against the deployment's learned
    # knee (a provider without a load scrape), not from a server's own queue.
    from_inflight: bool = False
    prompt_bytes: int | None = None  # this request's body size: its TTFT is read for that size
    recent: TargetStats | None = None  # the last few seconds only (see `Snapshot.recent`)
    explored_s: float | None = None  # the slowest TTFT of its latest explorations, if fresh
    # A vLLM deployment: the mean time per output token its server measured lately. Ahead of
    # the nominal prior, which knows nothing of the server's load or speculative decoding.
    measured_tpot_s: float | None = None
    # Its model's `unsupported_tools`: what a translated Responses request's hosted tools do.
    unsupported_tools: Literal["drop", "refuse"] = "drop"

    @property
    def id(self) -> str:
        return self.deployment.id

    @property
    def ttft_p99_s(self) -> float | None:
        """The TTFT predicted from the server's load, else the trusted observed p99 for this
        request's prompt size, else the configured prior, else unknown."""
        return self.ttft_quantile_s("p99")

    def ttft_quantile_s(self, level: Level) -> float | None:
        """The predicted TTFT, else a trusted observed quantile for this request's prompt size
        (see `ttft_for_size`), else the prior (which only knows p99)."""
        if self.predicted_ttft_s is not None:
            return self.predicted_ttft_s
        stats = self.stats
        if stats is not None and self.prompt_bytes is not None and stats.bands:
            sized = ttft_for_size(stats, self.prompt_bytes, level)
            if sized is not None:
                return sized / 1000.0
        return _trusted(stats.ttft if stats else None, level, self._prior("ttft_ms"))

    def ttft_seen_s(self, level: Level) -> float | None:
        """A TTFT quantile of a few samples (`BAND_EVIDENCE`), too few to trust for a budget's
        verdict: what a rescue may count on from a deployment that serves little."""
        stats = self.stats
        if stats is None or stats.ttft.count < BAND_EVIDENCE:
            return None
        value: float | None = getattr(stats.ttft, level)
        return None if value is None else value / 1000.0

    def ttft_seen_for_size_s(self, level: Level) -> float | None:
        """What even a few samples say of this prompt size's TTFT quantile: the median of its
        band (`SEEN_EVIDENCE` samples), else read off a line through the medians of the bands
        seen, scaled by the spread (`level` over median) of the deployment's TTFTs for one size
        (its most-observed trusted band, else the whole window). A hint for when a rescue would
        start too early to be one, never a budget's verdict."""
        stats, size = self.stats, self.prompt_bytes
        if stats is None or size is None or not stats.bands:
            return None
        own = stats.bands.get(band_of(size))
        median: float | None = None
        if own is not None and own.ttft.count >= SEEN_EVIDENCE:
            median = own.ttft.p50
        if median is None:
            line = fit_line(
                [
                    (band.mean_bytes, band.ttft.p50)
                    for band in stats.bands.values()
                    if band.ttft.count >= SEEN_EVIDENCE
                    and band.ttft.p50 is not None
                    and not math.isinf(band.ttft.p50)
                ]
            )
            median = None if line is None else line[0] + line[1] * size
        spread = _spread(stats, level)
        if median is None or spread is None or math.isinf(median):
            return None
        return median * spread / 1000.0

    def predicted_total_s(
        self, max_tokens: int | None, *, ttft_at_most_s: float | None = None
    ) -> float | None:
        """p99 TTFT + p99 TPOT * expected output tokens (`max_tokens`, or the observed mean
        length); the observed p99 total when the parts are unknown (a non-streaming deployment).
        The TPOT is the window's trusted p99, else the server's measured one, else the prior.
        `ttft_at_most_s`: the first token is known to come by then (its misses are rescued
        within the TTFT budget), whatever the deployment's own tail."""
        stats = self.stats
        ttft = self.ttft_p99_s
        if ttft is not None and ttft_at_most_s is not None:
            ttft = min(ttft, ttft_at_most_s)
        tpot = self.tpot_p99_s
        tokens = max_tokens or (stats.output_tokens if stats else None)
        if ttft is not None and tpot is not None and tokens:
            return ttft + tpot * max(0.0, tokens - 1)
        return _trusted(stats.total if stats else None, "p99", None)

    @property
    def tpot_p99_s(self) -> float | None:
        """The window's trusted p99 time per output token, else the server's measured one (a
        draft model or a full batch changes it), else the operator's nominal prior."""
        stats, measured = self.stats, self.measured_tpot_s
        fallback = measured if measured is not None else self._prior("tpot_ms")
        return _trusted(stats.tpot if stats else None, "p99", fallback)

    def _prior(self, name: Literal["ttft_ms", "tpot_ms"]) -> float | None:
        prior = self.deployment.prior
        value = getattr(prior, name) if prior is not None else None
        return None if value is None else value / 1000.0


def ttft_for_size(stats: TargetStats, prompt_bytes: int, level: Level) -> float | None:
    """A TTFT quantile (ms) for a prompt of `prompt_bytes`, from the window's prompt-size bands:
    its own band's when trusted; else read off a line fitted through the trusted bands' values
    against their mean sizes (prefill grows linearly with the prompt); else, with one trusted
    band of larger prompts, that band's (an upper bound). `math.inf` when a trusted band of
    prompts no longer than this one has that quantile beyond every cut; None when the bands say
    nothing for this size (the deployment-wide figure then stands)."""
    own = stats.bands.get(band_of(prompt_bytes))
    if own is not None and own.ttft.trusted:
        value: float | None = getattr(own.ttft, level)
        return value
    if own is not None and own.ttft.count >= BAND_EVIDENCE:
        # Too few to trust that this size is fast, enough to believe it is slow: a few long
        # prompts that all prefilled slowly outweigh a deployment-wide figure of short ones.
        # Their median says so; their tail does not (one stall in five samples is their p90),
        # so the tail is the deployment's, scaled by how much slower this size's median is.
        seen, typical = own.ttft.p50, stats.ttft.p50
        whole = getattr(stats.ttft, level)
        if seen is not None and typical and whole is not None:
            if seen > typical:
                return float(whole * seen / typical)
        elif (tail := getattr(own.ttft, level)) is not None and (whole is None or tail > whole):
            return float(tail)
    points: list[tuple[float, float]] = []
    for band in stats.bands.values():
        found = getattr(band.ttft, level) if band.ttft.trusted else None
        if found is None:
            continue
        if math.isinf(found):
            if band.mean_bytes <= prompt_bytes:
                return math.inf  # shorter prompts already have no known tail
            continue
        points.append((band.mean_bytes, found))
    line = fit_line(points)
    if line is not None:
        base, slope = line
        return base + slope * prompt_bytes
    if len(points) == 1 and prompt_bytes <= points[0][0]:
        return points[0][1]
    return None


def baseline_p50_ms(stats: TargetStats, prompt_bytes: int) -> float | None:
    """A deployment's typical TTFT (ms) for a prompt of this size, trusted or not: its band's
    median when the band has a few observations, else the size-aware estimate, else the
    deployment-wide median. What a queue-based prediction adds the queue to."""
    own = stats.bands.get(band_of(prompt_bytes))
    if own is not None and own.ttft.count >= BAND_EVIDENCE and own.ttft.p50 is not None:
        return own.ttft.p50
    sized = ttft_for_size(stats, prompt_bytes, "p50") if stats.bands else None
    return sized if sized is not None else stats.ttft.p50


def _spread(stats: TargetStats, level: Level) -> float | None:
    """How far `level` lies above the median for prompts of one size: from the trusted band with
    the most samples (the whole window's figure mixes sizes, so it overstates the spread)."""
    trusted = [band.ttft for band in stats.bands.values() if band.ttft.trusted]
    metric = max(trusted, key=lambda m: m.count) if trusted else stats.ttft
    value: float | None = getattr(metric, level)
    if value is None or metric.p50 is None or metric.p50 <= 0 or math.isinf(value):
        return None
    return max(1.0, value / metric.p50)


def _trusted(stats: MetricStats | None, level: Level, prior_s: float | None) -> float | None:
    if stats is not None and stats.trusted:
        value: float | None = getattr(stats, level)
        if value is not None:
            return value / 1000.0
    return prior_s if level == "p99" else None

"""Counts per time slice: the mutable side of the statistics, kept on the request path.

A tag is a deployment or `model:<name>`. Each tag has one `Counts` per slice (sketches of every
metric, TTFT by prompt-size band, request and error counts); the window is the sum of its slices.
"""

from __future__ import annotations

import math

from gateway.latency.samples import BYTES_PER_TOKEN, METRICS, NOT_FAILURES, Metric, Sample
from gateway.latency.sketch import Sketch

RECENT_SLICES = 2  # the recent view: the current slice and the one before (~5-10 s)
MODEL_TAG = "model:"  # hash-tag prefix of per-model keys; deployments are tagged by bare name


def tags_of(sample: Sample) -> tuple[str, str]:
    """The deployment and the model name a sample counts for."""
    return sample.deployment, MODEL_TAG + sample.model


class Band:
    """TTFT and total time of one prompt-size band, and the sizes its TTFT observations had
    (for a fit across bands)."""

    __slots__ = ("bytes", "sketch", "total")

    def __init__(self, alpha: float) -> None:
        self.sketch = Sketch(alpha)  # TTFT
        self.total = Sketch(alpha)
        self.bytes = 0  # summed over the band's TTFT observations

    def merge(self, other: Band) -> None:
        self.sketch.merge(other.sketch)
        self.total.merge(other.total)
        self.bytes += other.bytes


class Counts:
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
        self.bands: dict[int, Band] = {}  # TTFT by prompt-size band (see gateway/prompt_size)
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

    def band(self, band: int) -> Band:
        found = self.bands.get(band)
        if found is None:
            found = self.bands[band] = Band(self.alpha)
        return found

    def merge(self, other: Counts) -> None:
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


class Windows:
    """Per-tag slices of sketches in this process; a tag is a deployment or `model:<name>`."""

    def __init__(self, window_s: float, slice_s: float, alpha: float) -> None:
        if not 0 < slice_s <= window_s:
            raise ValueError("need 0 < slice_s <= window_s")
        self.slice_s = slice_s
        self.alpha = alpha
        # The window is the current slice plus older ones: a sample counts for at most window_s.
        self.n_slices = math.ceil(window_s / slice_s)
        self._slices: dict[str, dict[int, Counts]] = {}

    def slice_of(self, now: float) -> int:
        return int(now // self.slice_s)

    def window(self, now: float) -> range:
        current = self.slice_of(now)
        return range(current - self.n_slices + 1, current + 1)

    def counts(self, tag: str, index: int) -> Counts:
        slices = self._slices.get(tag)
        if slices is None:
            slices = self._slices[tag] = {}
        counts = slices.get(index)
        if counts is None:
            # A new slice starts: drop the ones that left the window (amortised O(1)).
            for old in [i for i in slices if i <= index - self.n_slices]:
                del slices[old]
            counts = slices[index] = Counts(self.alpha)
        return counts

    def peek(self, tag: str, index: int) -> Counts | None:
        """The counts of one slice, if this process has any (creates nothing)."""
        slices = self._slices.get(tag)
        return None if slices is None else slices.get(index)

    def tags(self) -> set[str]:
        return set(self._slices)

    def merged(self, now: float, *, last: int | None = None) -> dict[str, Counts]:
        """Every tag's counts over the window (over its `last` slices only, when given)."""
        window = self.window(now)
        start = window.start if last is None else window.stop - last
        out: dict[str, Counts] = {}
        for tag, slices in self._slices.items():
            total = out[tag] = Counts(self.alpha)
            for index in [i for i in slices if i < window.start]:
                del slices[index]
            for index, counts in slices.items():
                if start <= index < window.stop:
                    total.merge(counts)
        return out

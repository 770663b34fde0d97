"""The store protocol, and the store that keeps the window in this process only."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal, Protocol

from gateway.latency.prompt_size import band_of
from gateway.latency.samples import Metric, Recorder, Sample, observations
from gateway.latency.sketch import DEFAULT_ALPHA, Sketch
from gateway.latency.snapshot import Snapshot, Source, build_snapshot
from gateway.latency.window import MODEL_TAG, RECENT_SLICES, Windows, tags_of


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
        self._windows = Windows(window_s, slice_s, alpha)
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
        for tag in tags_of(sample):
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
            self._windows.counts(MODEL_TAG + sample.hedge_for, index).hedges += 1
        return keyed

    def arrived(self, model: str) -> None:
        """A client request for `model` was admitted: what caps on extra load are a share of."""
        self._windows.counts(MODEL_TAG + model, self._windows.slice_of(self._clock())).clients += 1

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
        tags = [MODEL_TAG + model] if deployment is None else [MODEL_TAG + model, deployment]
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
        for tag in (deployment,) if model is None else (deployment, MODEL_TAG + model):
            self._inflight[tag] = self._inflight.get(tag, 0) + 1

    def finished(self, deployment: str, model: str | None = None) -> None:
        for tag in (deployment,) if model is None else (deployment, MODEL_TAG + model):
            left = self._inflight.get(tag, 0) - 1
            if left > 0:
                self._inflight[tag] = left
            else:
                self._inflight.pop(tag, None)

    def local_snapshot(self, source: Source | None = None) -> Snapshot:
        """A snapshot of this process's own window."""
        now = self._clock()
        return build_snapshot(
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

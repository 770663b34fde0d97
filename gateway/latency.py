"""Latency statistics: what every request hands over when it ends, and where it is kept.

`Recorder.record` is called on the request path, so it only touches memory.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Sample:
    """One finished upstream attempt. Times in seconds; None when not measured."""

    deployment: str
    model: str
    ok: bool
    total_s: float
    ttft_s: float | None = None  # streaming only: attempt start to first content token
    tpot_s: float | None = None  # mean time per output token after the first
    input_tokens: int | None = None
    output_tokens: int | None = None
    error: str | None = None  # why the attempt failed (low-cardinality), when not ok


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

"""What every upstream attempt hands over when it ends, and what it observed.

`Recorder.record` is called on the request path, so recorders only touch memory. `observations`
turns a sample into the latencies it contributes, censored ones ("more than t") included.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal, Protocol


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
BYTES_PER_TOKEN = 4  # a request body's bytes per prompt token, roughly (no tokenizer on the path)


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

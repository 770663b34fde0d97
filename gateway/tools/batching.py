"""Static versus continuous batching in discrete time: the course's batching exercise.

A GPU decodes one token per tick for every sequence in its batch of at most `max_batch`. Every
request arrives at tick 0 and waits in one FIFO queue (the exercise gives no arrival times, only
"requests of random output lengths arriving in a queue"). A request of output length L that starts
at tick s decodes during ticks s .. s + L - 1 and is complete at tick s + L.

- *static*: load up to `max_batch` requests, run until EVERY member has finished, then load the next
  ones. A member that finishes early leaves its slot idle until the whole batch is done.
- *continuous*: a finished sequence's slot is refilled from the queue on the very next tick.

Per run: the mean *wait* (ticks from arrival to a request's first decode tick: the time it sits in
the queue, what TTFT is made of), the mean and the p50 / p99 of *completion* (ticks from arrival to
its last token: the request's latency), the *total* ticks to drain the queue, and the GPU *slot
utilisation*: decoded tokens over `max_batch * total ticks`. Only a slot holding an unfinished
sequence counts as work; an idle slot in a static batch does not. Percentiles are nearest-rank.

Pure and deterministic: random lengths come from `random.Random(seed)`. The loop steps tick by tick
but jumps over ticks in which nothing finishes (nothing else can change then), so its cost is per
request, not per token.
"""

from __future__ import annotations

import random
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from gateway.latency.sketch import nearest_rank

__all__ = [
    "MODES",
    "BatchingExperiment",
    "BatchingRun",
    "Mode",
    "conclusion",
    "equal_lengths",
    "random_lengths",
    "run_experiment",
    "simulate",
]

Mode = Literal["static", "continuous"]
MODES: Final[tuple[Mode, ...]] = ("static", "continuous")


@dataclass(frozen=True, slots=True)
class BatchingRun:
    """One mode over one list of output lengths: when each request started and completed."""

    mode: Mode
    max_batch: int
    lengths: tuple[int, ...]
    starts: tuple[int, ...]  # tick of each request's first token (all arrive at tick 0)
    completions: tuple[int, ...]  # tick at which each request's last token is out

    @property
    def total_ticks(self) -> int:
        """Ticks until the last request is complete."""
        return max(self.completions, default=0)

    @property
    def work(self) -> int:
        """Slot-ticks spent decoding: one per output token (idle slots do no work)."""
        return sum(self.lengths)

    @property
    def utilisation(self) -> float:
        """Share of the `max_batch * total_ticks` slot-ticks that decoded a token."""
        capacity = self.max_batch * self.total_ticks
        return self.work / capacity if capacity else 0.0

    @property
    def tokens_per_tick(self) -> float:
        return self.work / self.total_ticks if self.total_ticks else 0.0

    @property
    def mean_wait(self) -> float:
        """Mean ticks from arrival to the first token (time in the queue)."""
        return statistics.fmean(self.starts)

    @property
    def mean_completion(self) -> float:
        """Mean ticks from arrival to the last token (the request's latency)."""
        return statistics.fmean(self.completions)

    def completion_percentile(self, q: float) -> int:
        """Nearest-rank q-quantile (0 < q <= 1) of completion times."""
        ordered = sorted(self.completions)
        return ordered[nearest_rank(q, len(ordered)) - 1]

    def summary(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "requests": len(self.lengths),
            "max_batch": self.max_batch,
            "mean_wait_ticks": round(self.mean_wait, 3),
            "mean_completion_ticks": round(self.mean_completion, 3),
            "p50_completion_ticks": self.completion_percentile(0.50),
            "p99_completion_ticks": self.completion_percentile(0.99),
            "total_ticks": self.total_ticks,
            "slot_utilisation": round(self.utilisation, 4),
            "tokens_per_tick": round(self.tokens_per_tick, 3),
        }


def simulate(lengths: Sequence[int], max_batch: int, mode: Mode) -> BatchingRun:
    """Decode `lengths` (output tokens per request, in arrival order) in `mode`."""
    if max_batch < 1:
        raise ValueError("max_batch must be >= 1")
    if not lengths:
        raise ValueError("at least one request is needed")
    if any(length < 1 for length in lengths):
        raise ValueError("every output length must be >= 1 token")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}")
    queue = deque(range(len(lengths)))
    left: dict[int, int] = {}  # the batch: request -> tokens still to decode
    starts = [0] * len(lengths)
    completions = [0] * len(lengths)
    tick = 0
    while queue or left:
        # Admission, at the start of a tick: static loads only an empty batch; continuous tops the
        # batch up, so a slot freed at the end of the previous tick is busy again in this one.
        if mode == "continuous" or not left:
            while queue and len(left) < max_batch:
                request = queue.popleft()
                starts[request] = tick
                left[request] = lengths[request]
        # Every sequence in the batch decodes one token per tick. Until the next one finishes no
        # slot frees and nothing is admitted, so those ticks are taken in one step.
        ticks = min(left.values())
        tick += ticks
        for request in list(left):
            left[request] -= ticks
            if not left[request]:
                del left[request]
                completions[request] = tick
    return BatchingRun(mode, max_batch, tuple(lengths), tuple(starts), tuple(completions))


def random_lengths(count: int, min_tokens: int, max_tokens: int, seed: int) -> list[int]:
    """`count` output lengths drawn uniformly from [min_tokens, max_tokens] (inclusive)."""
    if not 1 <= min_tokens <= max_tokens:
        raise ValueError("output lengths need 1 <= min_tokens <= max_tokens")
    rng = random.Random(seed)
    return [rng.randint(min_tokens, max_tokens) for _ in range(count)]


def equal_lengths(lengths: Sequence[int]) -> list[int]:
    """As many lengths, all equal to the (rounded) mean of `lengths`: the same total work."""
    mean = max(1, round(statistics.fmean(lengths)))
    return [mean] * len(lengths)


@dataclass(frozen=True, slots=True)
class BatchingExperiment:
    """Both modes on varied lengths, then both on equal lengths of the same mean."""

    seed: int
    min_tokens: int
    max_tokens: int
    varied: dict[Mode, BatchingRun]
    equal: dict[Mode, BatchingRun]

    def to_json(self) -> dict[str, Any]:
        def block(runs: dict[Mode, BatchingRun]) -> dict[str, Any]:
            lengths = runs["static"].lengths
            return {
                "lengths": {
                    "min": min(lengths),
                    "max": max(lengths),
                    "mean": round(statistics.fmean(lengths), 3),
                    "stdev": round(statistics.pstdev(lengths), 3),
                },
                **{mode: run.summary() for mode, run in runs.items()},
                "continuous_gain": _gains(runs),
            }

        first = self.varied["static"]
        return {
            "parameters": {
                "requests": len(first.lengths),
                "max_batch": first.max_batch,
                "min_tokens": self.min_tokens,
                "max_tokens": self.max_tokens,
                "seed": self.seed,
                "arrivals": "all at tick 0, FIFO",
            },
            "definitions": {
                "wait": "ticks from arrival to the request's first token (time queued)",
                "completion": "ticks from arrival to the request's last token",
                "slot_utilisation": "decoded tokens / (max_batch * total_ticks)",
                "percentiles": "nearest rank",
            },
            "varied": block(self.varied),
            "equal": block(self.equal),
            "conclusion": conclusion(self),
        }


def run_experiment(
    requests: int = 60,
    max_batch: int = 8,
    min_tokens: int = 10,
    max_tokens: int = 200,
    seed: int = 1,
) -> BatchingExperiment:
    """The exercise: random lengths in both modes, then equal lengths (their mean) in both."""
    if requests < 1:
        raise ValueError("requests must be >= 1")
    varied = random_lengths(requests, min_tokens, max_tokens, seed)
    equal = equal_lengths(varied)
    return BatchingExperiment(
        seed=seed,
        min_tokens=min_tokens,
        max_tokens=max_tokens,
        varied={mode: simulate(varied, max_batch, mode) for mode in MODES},
        equal={mode: simulate(equal, max_batch, mode) for mode in MODES},
    )


def _gain(static: float, continuous: float) -> float:
    """How much lower continuous is than static, as a fraction of static."""
    return 1.0 - continuous / static if static else 0.0


def _gains(runs: dict[Mode, BatchingRun]) -> dict[str, float]:
    static, continuous = runs["static"], runs["continuous"]
    return {
        "total_ticks": round(_gain(static.total_ticks, continuous.total_ticks), 4),
        "mean_completion": round(_gain(static.mean_completion, continuous.mean_completion), 4),
        "mean_wait": round(_gain(static.mean_wait, continuous.mean_wait), 4),
    }


def _pct(fraction: float) -> str:
    return f"{fraction:.0%}" if abs(fraction) >= 0.005 else "0%"


def conclusion(experiment: BatchingExperiment) -> str:
    """One plain-English paragraph drawn from the experiment's numbers."""
    static, continuous = experiment.varied["static"], experiment.varied["continuous"]
    eq_static, eq_continuous = experiment.equal["static"], experiment.equal["continuous"]
    lengths = static.lengths
    requests, batch = len(lengths), static.max_batch
    if min(lengths) == max(lengths):
        spread = f"of {lengths[0]} tokens each"
    else:
        mean = statistics.fmean(lengths)
        spread = f"from {min(lengths)} to {max(lengths)} tokens (mean {mean:.0f})"
    total_gain = _gain(static.total_ticks, continuous.total_ticks)
    mean_gain = _gain(static.mean_completion, continuous.mean_completion)
    varied_gain = max(total_gain, mean_gain)
    eq_gain = max(
        _gain(eq_static.total_ticks, eq_continuous.total_ticks),
        _gain(eq_static.mean_completion, eq_continuous.mean_completion),
    )
    if (eq_static.total_ticks, eq_static.mean_completion) == (
        eq_continuous.total_ticks,
        eq_continuous.mean_completion,
    ):
        equal = (
            f"both modes take {eq_static.total_ticks} ticks, with a mean completion time of "
            f"{eq_static.mean_completion:.0f}"
        )
    else:
        equal = (
            f"static and continuous batching take {eq_static.total_ticks} and "
            f"{eq_continuous.total_ticks} ticks, with mean completion times of "
            f"{eq_static.mean_completion:.0f} and {eq_continuous.mean_completion:.0f}"
        )
    equal = f"With every output {eq_static.lengths[0]} tokens long (that mean, rounded), {equal}"

    if varied_gain < 0.005:
        if batch == 1:
            why = "a batch of one slot has no member to wait for"
        elif requests <= batch:
            why = f"all {requests} requests fit in one batch of {batch}, so no slot is refilled"
        elif min(lengths) == max(lengths):
            why = "the members of a batch all finish together"
        else:
            why = "no slot happened to free early while requests were still queued"
        return (
            f"With output lengths {spread}, continuous batching gained nothing over static "
            f"batching ({continuous.total_ticks} vs {static.total_ticks} ticks to drain "
            f"{requests} requests): {why}. {equal}. Continuous batching only helps when a "
            f"sequence finishes while others are still decoding and requests are still waiting, "
            f"which takes several slots, more requests than slots and output lengths that "
            f"differ."
        )
    if eq_gain < 0.005:
        verdict = "the advantage disappears"
    elif eq_gain <= varied_gain / 4:
        verdict = "the advantage nearly disappears"
    else:
        verdict = "the advantage shrinks"
    return (
        f"With output lengths {spread}, continuous batching drained the {requests} requests "
        f"in {continuous.total_ticks} ticks instead of {static.total_ticks} "
        f"({_pct(total_gain)} fewer) and cut the mean completion time from "
        f"{static.mean_completion:.0f} to {continuous.mean_completion:.0f} ticks "
        f"({_pct(mean_gain)} lower; p99 {static.completion_percentile(0.99)} -> "
        f"{continuous.completion_percentile(0.99)}, mean wait {static.mean_wait:.0f} -> "
        f"{continuous.mean_wait:.0f}). The win is the idle slots: a static batch runs as long "
        f"as its longest member, so the slots of members that have finished sit empty; "
        f"refilling them at once raises slot utilisation from {static.utilisation:.0%} to "
        f"{continuous.utilisation:.0%}. {equal}: {verdict}, because a batch whose members "
        f"finish together leaves no slot idle. Variance in output length is what continuous "
        f"batching exploits."
    )

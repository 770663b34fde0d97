"""Predicted time to first token on a vLLM deployment, from its queue right now.

A request sent now waits for a batch slot to come free (behind the server's queue), then
prefills. So TTFT ≈ base + queued x cost, where `queued` is the slots it waits for (0 while one
is free), `base` the TTFT with no queue and `cost` what each slot it waits for adds. Both are
learned online from the gateway's own measurements: every first token from a vLLM deployment is
an observation (the queue estimated when it was sent, its TTFT), fitted by exponentially
weighted least squares, separately for short and long prompts (prefill time grows with the
prompt).

The queue is estimated between scrapes (`TTFTPredictor.queued`): the requests this replica sent
since the scrape fill the server's free batch slots, and once those are full they count as
queued, so one scrape interval cannot herd every request onto the server it showed idle.

Until a (deployment, prompt band) has enough observations, a prior stands in: `base` is the
deployment's p50 TTFT, and `cost` its p50 total time divided by the requests running (a queued
request starts when one of those finishes). A fit that no new observation has refreshed for
`STALE_S` while the queue reads empty fades back to that prior (half the way every
`HALF_LIFE_S`): a base learned under congestion would otherwise keep an idle server out for
good, since only traffic sent to it could correct it. With neither the queue (metrics unknown)
nor any latency to go on, there is no prediction and routing uses the latency statistics alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

DECAY = 0.98  # per observation: about the last 50 observations count
MIN_WEIGHT = 10.0  # observations (decayed) before a fit is used
MIN_SPREAD = 1.0  # variance of the queue depths seen before the slope is trusted
LONG_PROMPT_BYTES = 8_000  # request bodies above this (~2k tokens) are "long"
STALE_S = 2.0  # a fit without observations for this long, while the queue reads empty, fades
HALF_LIFE_S = 1.0  # ... half the way to the prior every this long
STAND_IN_SLOTS = 8.0
"""Batch slots assumed of a server never yet seen full (or twice the most it was seen running,
if more): few, so that a burst spreads over idle servers early rather than late. Most servers'
real limit (vLLM's `max_num_seqs`, 256 by default, or its KV cache) is higher, and is learned
once a scrape shows the server full."""


def prompt_band(body_bytes: int) -> str:
    return "long" if body_bytes > LONG_PROMPT_BYTES else "short"


@dataclass(slots=True)
class _Fit:
    """Exponentially weighted sums for y = a + b x, and when they last changed."""

    w: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0
    observed_at: float = 0.0  # clock time of the latest observation
    faded_at: float = 0.0  # clock time up to which staleness has been applied

    def add(self, x: float, y: float, now: float) -> None:
        self.w = self.w * DECAY + 1.0
        self.x = self.x * DECAY + x
        self.y = self.y * DECAY + y
        self.xx = self.xx * DECAY + x * x
        self.xy = self.xy * DECAY + x * y
        self.observed_at = self.faded_at = now

    def fade(self, now: float, prior_s: float | None) -> bool:
        """Move toward the prior by the time the fit has been stale: what it learned gives way
        to pseudo-observations of `prior_s` at an empty queue, keeping the weight, so the next
        real observations count as much as ever. Without a prior it only loses weight. False
        while it is fresh."""
        start = max(self.faded_at, self.observed_at + STALE_S)
        if now <= start:
            return False
        keep = 0.5 ** ((now - start) / HALF_LIFE_S)
        self.faded_at = now
        self.x *= keep
        self.xx *= keep
        self.xy *= keep
        if prior_s is None:
            self.w *= keep
            self.y *= keep
        else:
            self.y = self.y * keep + (1.0 - keep) * self.w * prior_s
        return True

    def mean_y(self) -> float:
        return self.y / self.w

    def line(self) -> tuple[float, float] | None:
        """(a, b), or None while the queue depths seen vary too little to fit a slope."""
        mean_x = self.x / self.w
        spread = self.xx / self.w - mean_x * mean_x
        if spread < MIN_SPREAD:
            return None
        b = (self.xy / self.w - mean_x * self.y / self.w) / spread
        b = max(0.0, b)
        a = max(0.0, self.y / self.w - b * mean_x)
        return a, b


@dataclass(slots=True)
class _Seen:
    """Per deployment: the latest scrape, this replica's in-flight count when it was first
    read, and the most requests the server was ever seen running (a floor for its slots)."""

    scraped_at: float
    inflight: int
    most_running: float


class TTFTPredictor:
    """The fits, and what each deployment's scrapes showed. `clock`: monotonic seconds."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._fits: dict[tuple[str, str], _Fit] = {}
        self._seen: dict[str, _Seen] = {}

    def observe(self, deployment: str, band: str, waiting: float, ttft_s: float) -> None:
        """A first token from `deployment`, sent when the server had `waiting` queued."""
        key = (deployment, band)
        fit = self._fits.get(key)
        if fit is None:
            fit = self._fits[key] = _Fit()
        fit.add(waiting, ttft_s, self._clock())

    def queued(
        self,
        deployment: str,
        *,
        running: float,
        waiting: float,
        scraped_at: float,
        slots: float | None,
        inflight: int,
    ) -> float:
        """The queue a request sent now would join, itself counted: 0 while the server has a
        free batch slot, else the slots that must come free before it starts. The occupancy is
        what the scrape showed plus the requests this replica sent since (its in-flight count
        now, against the count when the scrape was first read here); requests that finished
        since come off only when they were this replica's (others' show in the next scrape).
        `slots`: the server's, learned; unknown, twice the most it was seen running, at least
        `STAND_IN_SLOTS`."""
        seen = self._seen.get(deployment)
        if seen is None:
            seen = self._seen[deployment] = _Seen(scraped_at, inflight, running)
        elif seen.scraped_at != scraped_at:
            seen.scraped_at, seen.inflight = scraped_at, inflight
            seen.most_running = max(seen.most_running, running)
        # Never fewer than this replica has in flight itself, however late the scrape was read.
        occupied = max(float(inflight), running + waiting + inflight - seen.inflight)
        # Unknown slots: a server seen running k without a queue is allowed twice that first.
        capacity = slots if slots is not None else max(STAND_IN_SLOTS, 2 * seen.most_running)
        return max(0.0, occupied + 1.0 - max(capacity, running))

    def predict(
        self,
        deployment: str,
        band: str,
        *,
        waiting: float,
        running: float,
        ttft_p50_s: float | None,
        total_p50_s: float | None,
    ) -> float | None:
        """Expected TTFT of a request sent now with `waiting` ahead of it; None when there is
        nothing to go on. With nothing ahead, a stale fit fades toward the prior first."""
        key = (deployment, band)
        fit = self._fits.get(key)
        if fit is not None and waiting <= 0:
            faded = fit.fade(self._clock(), ttft_p50_s)
            if faded and fit.w < MIN_WEIGHT and ttft_p50_s is None:
                del self._fits[key]  # faded out: the next observations start afresh
                fit = None
        prior_cost = total_p50_s / max(running, 1.0) if total_p50_s is not None else ttft_p50_s
        if fit is not None and fit.w >= MIN_WEIGHT:
            line = fit.line()
            if line is not None:
                a, b = line
                # A slot comes free about every total / running: a slope fitted below that
                # is the noise in the queue estimates flattening it, not a faster server.
                return a + max(b, prior_cost or 0.0) * waiting
            # Always the same queue depth so far: its mean TTFT is known, the slope is not.
            mean_x = fit.x / fit.w
            if prior_cost is None:
                return fit.mean_y()
            return max(0.0, fit.mean_y() + (waiting - mean_x) * prior_cost)
        if ttft_p50_s is None or prior_cost is None:
            return None
        return ttft_p50_s + waiting * prior_cost

    def learned(self) -> dict[str, dict[str, float | None]]:
        """Per (deployment/band), the fitted base and per-request cost (for /admin/latency)."""
        out: dict[str, dict[str, float | None]] = {}
        for (deployment, band), fit in self._fits.items():
            line = fit.line() if fit.w >= MIN_WEIGHT else None
            out[f"{deployment}/{band}"] = {
                "observations": round(fit.w, 1),
                "base_ms": round(line[0] * 1000, 3) if line else None,
                "per_waiting_ms": round(line[1] * 1000, 3) if line else None,
            }
        return out

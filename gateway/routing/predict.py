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

A deployment without a load scrape (an OpenAI-type or Anthropic-type provider) has no queue to
read, so its queue is inferred from this replica's own in-flight attempts on it (`_Knee`): every
attempt's TTFT is kept by the in-flight count it was sent with, and the knee is the in-flight
count from which the median TTFT leaves the unloaded base (more than `SLOW_FACTOR` times it):
the provider's slots, as seen from here. A request sent with `n` in flight joins a queue of
`n + 1 - slots`; that queue feeds the same fit as a vLLM server's (its `cost` defaults to the
deployment's p50 total time divided by its slots). Below the knee, or before one is learned,
there is no prediction and the latency statistics decide. A cut attempt (a deadline, a hedge
that won) is a censored TTFT: past the slow threshold it still shows the level is queued.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
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


LEVEL_KEEP = 7  # TTFTs kept per in-flight level: the median of the latest judges the level
LEVEL_EVIDENCE = 3  # TTFTs at a level before its median counts
SLOW_FACTOR = 2.0
"""A level is queued when its median TTFT is over this times the unloaded base: a request that
waits for a slot waits about a stream's length over the slots, mostly well over its own TTFT."""
KNEE_STALE_S = 30.0
"""Levels are compared on the TTFTs of their last this-many seconds only, and a knee whose
queued level has not been seen again for this long is forgotten (the provider may have grown:
traffic then piles on until it is seen again). Queueing shows as a slow level beside a fast one
at the same time; a provider slow at every level (a slow spell, in which more requests are in
flight because each takes longer) has a slow base, and no knee."""
MOST_LEVELS = 1024  # in-flight counts beyond this are counted as this (a bound on memory)
BANDS = ("short", "long")


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
class _Level:
    """The latest TTFTs (a ring of `LEVEL_KEEP`, with when each came) of attempts sent at one
    in-flight count."""

    ttfts: list[tuple[float, float]]  # (clock time, TTFT seconds)
    next: int = 0
    observed_at: float = 0.0  # the newest TTFT's time
    oldest_at: float = 0.0  # the oldest kept TTFT's time
    whole: float = 0.0  # the median of every kept TTFT

    def add(self, ttft_s: float, now: float) -> None:
        if len(self.ttfts) < LEVEL_KEEP:
            self.ttfts.append((now, ttft_s))
        else:
            self.ttfts[self.next] = (now, ttft_s)
            self.next = (self.next + 1) % LEVEL_KEEP
        self.observed_at = now
        self.oldest_at = min(at for at, _ in self.ttfts)
        self.whole = sorted(ttft for _, ttft in self.ttfts)[len(self.ttfts) // 2]

    def median(self, since: float) -> float | None:
        """The median of the TTFTs seen since `since`; None with fewer than `LEVEL_EVIDENCE`.
        Called for every level on every first token: the kept median serves while all of them
        are fresh, and a level with none fresh is passed over at once."""
        if self.observed_at < since:
            return None
        if self.oldest_at >= since:
            return self.whole if len(self.ttfts) >= LEVEL_EVIDENCE else None
        fresh = sorted(ttft for at, ttft in self.ttfts if at >= since)
        return fresh[len(fresh) // 2] if len(fresh) >= LEVEL_EVIDENCE else None


@dataclass(slots=True)
class _Knee:
    """A deployment's TTFT by this replica's in-flight count when the attempt was sent, for one
    prompt band: the unloaded base, and the slots (the first count whose TTFTs are queued)."""

    levels: dict[int, _Level]
    base_s: float | None = None  # median TTFT at the lowest in-flight count with evidence
    slots: int | None = None
    queued_at: float = 0.0  # when the queued level was last seen
    queued_s: float = 0.0  # its median TTFT: the base plus the wait for the first slot to free

    def add(self, inflight: int, ttft_s: float, now: float, *, censored: bool) -> None:
        """One attempt's TTFT; `censored`: it was cut this long after it was sent, with no
        first token. That says "queued" only when past the slow threshold, else nothing."""
        if censored and (self.base_s is None or ttft_s <= self.base_s * SLOW_FACTOR):
            return
        count = min(inflight, MOST_LEVELS)
        level = self.levels.get(count)
        if level is None:
            level = self.levels[count] = _Level([])
        level.add(ttft_s, now)
        if self.slots is None or count <= self.slots:
            self._judge(now)  # levels above the knee do not move it

    def _judge(self, now: float) -> None:
        """Base and knee again, from the levels with evidence (fresh ones only), lowest first:
        the knee is the first count whose median TTFT is over `SLOW_FACTOR` times the base."""
        base = slots = None
        since = now - KNEE_STALE_S  # only what the levels show now, side by side
        for count in sorted(self.levels):
            level = self.levels[count]
            median = level.median(since)
            if median is None:
                continue
            if base is None:
                base = median
            elif median > base * SLOW_FACTOR:
                slots, self.queued_at, self.queued_s = count, level.observed_at, median
                break
        self.base_s, self.slots = base, slots

    def knee(self, now: float) -> int | None:
        """The slots, while the level that showed them is fresh."""
        if self.slots is not None and now - self.queued_at > KNEE_STALE_S:
            self.slots = None
        return self.slots


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
        self._knees: dict[tuple[str, str], _Knee] = {}

    def observe(self, deployment: str, band: str, waiting: float, ttft_s: float) -> None:
        """A first token from `deployment`, sent when the server had `waiting` queued."""
        key = (deployment, band)
        fit = self._fits.get(key)
        if fit is None:
            fit = self._fits[key] = _Fit()
        fit.add(waiting, ttft_s, self._clock())

    def observe_sent(
        self, deployment: str, band: str, inflight: int, ttft_s: float, *, censored: bool = False
    ) -> None:
        """An attempt on a deployment without a load scrape, sent while this replica had
        `inflight` others on it: its TTFT, or (`censored`) how long it ran without one before it
        was cut. Its queue (against the knee known when it lands) feeds the deployment's fit;
        a fit counted against another knee is dropped."""
        key = (deployment, band)
        knee = self._knees.get(key)
        if knee is None:
            knee = self._knees[key] = _Knee({})
        now = self._clock()
        slots = knee.knee(now)
        if slots is not None and not censored:
            self.observe(deployment, band, max(0, inflight + 1 - slots), ttft_s)
        knee.add(inflight, ttft_s, now, censored=censored)
        if knee.slots != slots:
            self._fits.pop(key, None)

    def predict_inflight(
        self, deployment: str, band: str, inflight: int, *, total_p50_s: float | None
    ) -> tuple[float, float] | None:
        """(expected TTFT, queue) of a request sent now to a deployment without a load scrape,
        with `inflight` of this replica's attempts on it; None below its knee (the request
        would not queue) or while no knee is known. Several dict reads: the hot path."""
        if not self._knees:
            return None
        now = self._clock()
        slots = found = None
        for knee in self._knees_of(deployment, band):
            slots = knee.knee(now)
            if slots is not None:
                found = knee
                break
        if found is None or slots is None or inflight + 1 <= slots:
            return None
        base = found.base_s
        own = self._knees.get((deployment, band))
        if own is not None and own.base_s is not None:
            base = own.base_s  # the knee is the provider's; the base is this prompt size's
        queue = float(inflight + 1 - slots)
        # A slot frees about every total / slots; without a total, what the first queued level
        # was seen to wait stands in.
        waited = found.queued_s - (found.base_s or 0.0)
        predicted = self.predict(
            deployment,
            band,
            waiting=queue,
            running=float(slots),
            ttft_p50_s=base,
            total_p50_s=total_p50_s if total_p50_s is not None else waited * slots,
        )
        return None if predicted is None else (predicted, queue)

    def _knees_of(self, deployment: str, band: str) -> Iterator[_Knee]:
        """The band's own knee first, then the other band's (the slots are the provider's)."""
        for key in ((deployment, band), *((deployment, b) for b in BANDS if b != band)):
            knee = self._knees.get(key)
            if knee is not None:
                yield knee

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
        now = self._clock()
        for (deployment, band), knee in self._knees.items():
            entry = out.setdefault(
                f"{deployment}/{band}",
                {"observations": 0.0, "base_ms": None, "per_waiting_ms": None},
            )
            slots = knee.knee(now)
            entry["slots"] = float(slots) if slots is not None else None
            entry["unloaded_ms"] = round(knee.base_s * 1000, 3) if knee.base_s else None
        return out

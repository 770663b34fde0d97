"""Predicted time to first token on a vLLM deployment, from its queue right now.

A request sent now waits behind the server's `waiting` requests for a batch slot, then
prefills. So TTFT ≈ base + waiting x cost, where `base` is the TTFT with no queue and `cost` what
each queued request adds. Both are learned online from the gateway's own measurements: every
first token from a vLLM deployment is an observation (the queue seen when it was sent, its TTFT),
fitted by exponentially weighted least squares, separately for short and long prompts (prefill
time grows with the prompt).

Until a (deployment, prompt band) has enough observations spread over different queue depths, a
prior stands in: `base` is the deployment's p50 TTFT, and `cost` its p50 total time divided by
the requests running (a queued request starts when one of those finishes). With neither the
queue (metrics unknown) nor any latency to go on, there is no prediction and routing uses the
latency statistics alone.
"""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.98  # per observation: about the last 50 observations count
MIN_WEIGHT = 10.0  # observations (decayed) before a fit is used
MIN_SPREAD = 1.0  # variance of the queue depths seen before the slope is trusted
LONG_PROMPT_BYTES = 8_000  # request bodies above this (~2k tokens) are "long"


def prompt_band(body_bytes: int) -> str:
    return "long" if body_bytes > LONG_PROMPT_BYTES else "short"


@dataclass(slots=True)
class _Fit:
    """Exponentially weighted sums for y = a + b x."""

    w: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0

    def add(self, x: float, y: float) -> None:
        self.w = self.w * DECAY + 1.0
        self.x = self.x * DECAY + x
        self.y = self.y * DECAY + y
        self.xx = self.xx * DECAY + x * x
        self.xy = self.xy * DECAY + x * y

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


class TTFTPredictor:
    def __init__(self) -> None:
        self._fits: dict[tuple[str, str], _Fit] = {}

    def observe(self, deployment: str, band: str, waiting: float, ttft_s: float) -> None:
        """A first token from `deployment`, sent when the server had `waiting` queued."""
        key = (deployment, band)
        fit = self._fits.get(key)
        if fit is None:
            fit = self._fits[key] = _Fit()
        fit.add(waiting, ttft_s)

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
        """Expected TTFT of a request sent now; None when there is nothing to go on."""
        fit = self._fits.get((deployment, band))
        prior_cost = total_p50_s / max(running, 1.0) if total_p50_s is not None else ttft_p50_s
        if fit is not None and fit.w >= MIN_WEIGHT:
            line = fit.line()
            if line is not None:
                a, b = line
                return a + b * waiting
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

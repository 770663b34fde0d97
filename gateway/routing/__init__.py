"""Routing: which deployments a call may go to, in what order, and the one attempt loop.

`plan` is pure policy over the latency snapshot; `guards` keeps fallback from amplifying
failures (cooldowns, retry budget, hedge cap); `attempts` runs the candidates.
"""

from gateway.routing.attempts import (
    Attempt,
    InflightTracker,
    Opened,
    Policy,
    Tally,
    open_first,
)
from gateway.routing.guards import Cooldowns, Guards, HedgeBudget, RetryBudget
from gateway.routing.plan import (
    Budget,
    Candidate,
    Plan,
    Route,
    baseline_p50_ms,
    by_prediction,
    candidates,
    deadline,
    fallback_chain,
    fits,
    hedge_point,
    plan,
    weighted_order,
    with_exploration,
)
from gateway.routing.predict import TTFTPredictor, prompt_band

__all__ = [
    "Attempt",
    "Budget",
    "Candidate",
    "Cooldowns",
    "Guards",
    "HedgeBudget",
    "InflightTracker",
    "Opened",
    "Plan",
    "Policy",
    "RetryBudget",
    "Route",
    "TTFTPredictor",
    "Tally",
    "baseline_p50_ms",
    "by_prediction",
    "candidates",
    "deadline",
    "fallback_chain",
    "fits",
    "hedge_point",
    "open_first",
    "plan",
    "prompt_band",
    "weighted_order",
    "with_exploration",
]

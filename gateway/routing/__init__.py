"""Routing: which deployments a call may go to, in what order, and the one attempt loop.

`decide` turns an admitted call into one `Decision` (candidates, predictions, the plan); `plan`
is pure policy over the latency snapshot; `deadline` holds the request's budgets and every
deadline they set; `attempts` runs the race; `ledger` owns what each attempt holds and closes
it; `guards` keeps fallback from amplifying failures (cooldowns, retry budget, hedge cap);
`predict` models a vLLM server's TTFT from its queue; `idle` is the stream idle timeout.
"""

from gateway.routing.affinity import Affinity
from gateway.routing.attempts import open_first
from gateway.routing.deadline import budget_for
from gateway.routing.decide import Decision, Routes, decide
from gateway.routing.guards import Cooldowns, Guards, HedgeBudget, RetryBudget
from gateway.routing.ledger import Attempt, InflightTracker, Ledger, Opened, Tally
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
    "Affinity",
    "Attempt",
    "Budget",
    "Candidate",
    "Cooldowns",
    "Decision",
    "Guards",
    "HedgeBudget",
    "InflightTracker",
    "Ledger",
    "Opened",
    "Plan",
    "RetryBudget",
    "Route",
    "Routes",
    "TTFTPredictor",
    "Tally",
    "baseline_p50_ms",
    "budget_for",
    "by_prediction",
    "candidates",
    "deadline",
    "decide",
    "fallback_chain",
    "fits",
    "hedge_point",
    "open_first",
    "plan",
    "prompt_band",
    "weighted_order",
    "with_exploration",
]

"""A request's budgets, and every deadline they set.

Both budgets count from the request's arrival. The TTFT budget sets when the race rescues an
attempt that has no first token yet (`rescue_at`): a hedge started beside it, or a failover that
cuts it, timed so that the successor can still land inside the budget. The total budget bounds
everything before the commit (`before_commit`); after it, a stream that overruns is finished and
counted as a miss (`on_total_miss: finish`, the default: a plain proxy would deliver it), or cut
at the budget (`cut`: `stream_deadline` bounds every upstream read; the relay applies it inline,
since a call per read would cost a coroutine per event). The stream idle timeout is the
provider's, not the request's: see `idle` and `attempts`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar

from gateway.config import ModelSpec
from gateway.errors import BudgetExceededError, ProviderTimeoutError
from gateway.latency import TOTAL_DEADLINE
from gateway.models import Call
from gateway.routing.plan import Budget, Candidate, deadline, rescue_point

T = TypeVar("T")

EXPLORE_LIMIT_S = 10.0
"""How long an explored attempt that lost is timed when the request has no TTFT budget."""


def budget_for(
    spec: ModelSpec,
    call: Call,
    *,
    arrived: float,
    ttft_ms: int | None = None,
    total_ms: int | None = None,
    tpot_ms: int | None = None,
    may_hedge: bool = True,
) -> Budget:
    """The budget `call` runs under: what its headers asked for (None: nothing), else its
    model's. A tighter total also tightens the first token. A non-streaming answer's first token
    is its whole body, so only its total applies; a per-token target means something for a
    stream only."""
    ttft = ttft_ms or spec.budget.ttft_ms
    total = total_ms or spec.budget.total_ms
    if ttft is not None and total is not None:
        ttft = min(ttft, total)
    if not call.stream:
        ttft = None
    return Budget(
        ttft_s=ttft / 1000 if ttft else None,
        total_s=total / 1000 if total else None,
        tpot_s=tpot_ms / 1000 if tpot_ms and call.stream else None,
        on_ttft_miss=spec.on_ttft_miss,
        on_total_miss=spec.on_total_miss,
        rescue_share=spec.hedge_max_fraction,  # hedges and deadline failovers share one cap
        model=spec.name,
        arrived=arrived,
        may_hedge=may_hedge,
    )


# --- the TTFT budget: when a slow attempt is rescued ---------------------------------------------


def ttft_end(budget: Budget) -> float | None:
    """When the TTFT budget runs out (perf_counter time); None when there is none, or when a miss
    is not to be rescued (`on_ttft_miss: none`)."""
    if budget.ttft_s is None or budget.on_ttft_miss == "none":
        return None
    return budget.arrived + budget.ttft_s


def rescue_at(
    remaining_s: float,
    candidate: Candidate,
    successor: Candidate,
    *,
    hedging: bool,
    share: float,
) -> tuple[float, bool] | None:
    """How long an attempt on `candidate`, with `remaining_s` of the TTFT budget left, may wait
    for its first token before `successor` rescues it, and whether that rescue explores: a
    failover to a successor nobody has measured is tried as a hedge instead (the attempt keeps
    running, so trying the unknown costs the client nothing). None: it is left to run."""
    if remaining_s <= 0:
        return None  # the budget is spent: rescuing now would only cascade through the list
    wait = rescue_point(remaining_s, candidate, successor, hedge=hedging, share=share)
    if wait is None:
        return None  # no rescue could land sooner
    return wait, not hedging and deadline(remaining_s, successor) is None


def explore_left(budget: Budget, started: float) -> float:
    """Seconds an explored attempt that lost (started at `started`) is still timed for: to the
    end of the TTFT budget, counted from its own start."""
    limit = budget.ttft_s or EXPLORE_LIMIT_S
    return max(0.0, started + limit - time.perf_counter())


# --- the total budget: before the commit and after it --------------------------------------------


async def before_commit(budget: Budget, work: Awaitable[T]) -> T:
    """Await `work` (everything up to the commit) within what is left of the total budget.

    Raises BudgetExceededError when the budget runs out first."""
    remaining = None
    if budget.total_s is not None:
        remaining = max(0.0, budget.total_s - (time.perf_counter() - budget.arrived))
    try:
        async with asyncio.timeout(remaining):
            return await work
    except TimeoutError:
        budget_ms = round((budget.total_s or 0) * 1000)
        raise BudgetExceededError(f"No answer within the total budget of {budget_ms} ms.") from None


def stream_deadline(budget: Budget) -> float | None:
    """When the total budget runs out, as event-loop time for `asyncio.timeout_at` around each
    upstream read after the commit; None without a total budget, or when a stream that overruns
    it is finished (`on_total_miss: finish`): no timer on that path."""
    if budget.total_s is None or budget.on_total_miss != "cut":
        return None
    left = budget.total_s - (time.perf_counter() - budget.arrived)
    return asyncio.get_running_loop().time() + max(0.0, left)


def ran_out(budget: Budget, deployment: str) -> ProviderTimeoutError:
    """The failure that ends a committed stream whose total budget ran out (its message names
    the deployment)."""
    return ProviderTimeoutError(
        f"the total budget of {round((budget.total_s or 0) * 1000)} ms ran out mid-stream",
        deployment=deployment,
        kind=TOTAL_DEADLINE,
    )

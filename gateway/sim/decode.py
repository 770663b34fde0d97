"""Sequences decoded step by step: preemption (priority scheduling, a KV-cache limit) and
speculative decoding.

The plain path (`gateway.sim.timeline`) sleeps once for a whole constant-speed decode; a model
with `scheduling_policy: priority`, `kv_cache_tokens` or `spec_tokens` takes this one, where a
sequence holds a `Ticket` on its pool and every decode step is a point in time:

- A sequence may be preempted at any moment (`PriorityPool`): a sleep (prefill or a step) ends
  at once, the step under way is lost, and it waits for a slot again at its original place.
  Scheduled again, it prefills its prompt and the tokens it has generated, less what the prefix
  cache holds (vLLM's preemption by recompute), which makes its next token, then goes on where
  it stopped. A stream stays open and pauses meanwhile.
- Under a KV-cache limit a sequence is seated once its prompt (and the tokens to recompute)
  fits, and each token it makes takes room there: a token that finds the cache full preempts a
  sequence (`PriorityPool.hold`), maybe its own, whose step is then lost with it.
- With speculation each target step costs `Speculation.step_cost` plain steps (still slowed by
  a full batch) and yields one token plus the accepted run of the draft (drawn from the
  sequence's own seeded RNG), capped at the tokens left; a stream sends them back to back.

The inter-token histogram keeps the client's view: a step's first token comes a step after the
one before (a preemption's wait and prefill included), the rest of its tokens at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator

from gateway.sim.planner import Plan
from gateway.sim.scheduler import Pool, Ticket
from gateway.sim.wire import SimConnectionReset
from gateway.sim.writer import Frames

__all__ = ["frames", "prefilled", "schedule", "sequence", "steps", "work"]


def schedule(plan: Plan) -> float:
    """The sequence got its slot: look its prompt up in the prefix cache; its TTFT from now.

    Prefill costs what the cache does not hold (the tail factor drawn for the whole prompt
    applies to it), then a slow request's extra.
    """
    target = plan.target
    metrics = target.pool.metrics
    prefill = plan.prefill_s
    cache = target.cache
    if cache is not None and plan.blocks is not None:
        cached = cache.match(plan.blocks, plan.prompt_tokens)
        plan.cached_tokens = cached
        metrics.prefix_queries += plan.prompt_tokens
        metrics.prefix_hits += cached
        if cached:
            prefill = target.prefill_s(plan.prompt_tokens - cached, plan.factor)
    metrics.prefill.observe(prefill)
    return prefill + plan.slow_s


def prefilled(plan: Plan) -> None:
    """The prompt's KV is computed: its blocks join the prefix cache."""
    cache = plan.target.cache
    if cache is not None and plan.blocks:
        cache.insert(plan.blocks)


def _recompute_s(plan: Plan, made: int) -> float:
    """A preempted sequence's prefill: its prompt and `made` generated tokens, less the cached
    prefix of its prompt (generated tokens are never cached)."""
    target = plan.target
    cached = 0
    if target.cache is not None and plan.blocks is not None:
        cached = target.cache.match(plan.blocks, plan.prompt_tokens)
    return target.prefill_s(plan.prompt_tokens + made - cached, plan.factor)


def _ring(wake: asyncio.Future[None]) -> None:
    if not wake.done():
        wake.set_result(None)


async def _nap(loop: asyncio.AbstractEventLoop, ticket: Ticket, delay: float) -> None:
    """Sleep `delay` seconds, or until the ticket's sequence is preempted."""
    wake = ticket.wake = loop.create_future()
    handle = loop.call_later(delay, _ring, wake)
    try:
        await wake
    finally:
        handle.cancel()
        ticket.wake = None


async def _regain(pool: Pool, ticket: Ticket) -> None:
    """Wait until a preempted ticket is seated again (it may be preempted while it resumes)."""
    while ticket.preempted:
        ticket.preempted = False
        await pool.wait(ticket)


async def steps(plan: Plan, limit: int) -> AsyncGenerator[int, None]:
    """Run one sequence on a ticket; yield the count of tokens made so far after each step:
    1 after prefill, then one step's worth more each time, until `limit`."""
    target = plan.target
    pool = target.pool
    metrics = pool.metrics
    spec, rng, counters = target.speculation, plan.spec_rng, metrics.spec
    cost = 1.0 if spec is None else spec.step_cost
    step_s, slowdown = target.step_s, target.profile.batch_slowdown
    loop = asyncio.get_running_loop()
    ticket = pool.ticket(plan.priority, plan.prompt_tokens, 1)  # its KV: the prompt, then more
    made = 0
    last = due = 0.0  # simulated times of the last token and of the next step's end
    try:
        await pool.admit(ticket)
        await _regain(pool, ticket)
        prefill_s = schedule(plan)
        while True:  # seated: (re)prefill, then decode until done or preempted
            if prefill_s:
                await _nap(loop, ticket, prefill_s)
            if not ticket.preempted:  # a full KV cache may preempt it for its new token
                pool.hold(ticket, 1)
            if not ticket.preempted:  # a prefill makes a token: the first, or the next one
                now = loop.time()
                if not made:
                    prefilled(plan)
                    metrics.first_token(plan.arrived, plan.prompt_tokens)
                else:
                    metrics.itl.observe(now - last)
                made += 1
                metrics.generation_tokens += 1
                last = due = now
                yield made
                while made < limit and not ticket.preempted:
                    # A virtual clock: a slow reader gets a burst, not a slower model.
                    due += pool.step_s(step_s, slowdown) * cost
                    if (delay := due - loop.time()) > 0:
                        await _nap(loop, ticket, delay)
                        if ticket.preempted:
                            break
                    count = 1
                    if spec is not None:
                        assert rng is not None
                        count += min(spec.draw(rng), limit - made - 1)
                    pool.hold(ticket, count)
                    if ticket.preempted:  # no KV for the step's tokens: it was the one to go
                        break
                    if spec is not None:
                        assert counters is not None
                        counters.step(spec.k, count - 1)
                    made += count
                    metrics.generation_tokens += count
                    metrics.itl.observe(due - last)
                    if count > 1:  # the step's other tokens follow at once
                        metrics.itl.observe(0.0, count - 1)
                    last = due
                    yield made
            if made >= limit or not ticket.preempted:
                return
            await _regain(pool, ticket)
            prefill_s = _recompute_s(plan, made)
    finally:
        pool.drop(ticket)


async def sequence(plan: Plan) -> None:
    """A sequence that sends nothing (a non-streaming request's choice)."""
    reason = "abort"
    try:
        async with contextlib.aclosing(steps(plan, plan.n)) as made:
            async for _ in made:
                pass
        reason = plan.finish_reason
    finally:
        plan.target.pool.metrics.done(plan.arrived, reason)


async def frames(plan: Plan, frames: Frames, sent: list[int]) -> AsyncGenerator[bytes, None]:
    """A streamed sequence: its frames, as its steps make the tokens (`sent` counts them)."""
    first, token_head, token_tails = frames.first, frames.token_head, frames.token_tails
    tokens = frames.tokens
    n, offset, words = plan.n, plan.offset, len(token_tails)
    limit = min(n, max(1, n // 2)) if plan.cut else n
    shown = 0
    opened = done = False
    try:
        async with contextlib.aclosing(steps(plan, limit)) as made_so_far:
            async for made in made_so_far:
                if not opened:
                    opened = True
                    if first is not None:
                        yield first
                upto = min(made, limit)
                for i in range(shown, upto):
                    sent[0] += 1
                    if tokens is None:
                        yield token_head + token_tails[(offset + i) % words]
                    elif (frame := tokens[i]) is not None:
                        yield frame
                shown = upto
        if plan.cut:
            raise SimConnectionReset("simulated connection drop mid-stream")
        yield frames.finish
        done = True
    finally:
        plan.target.pool.metrics.done(plan.arrived, plan.finish_reason if done else "abort")


async def work(pool: Pool, work_s: float, prompt_tokens: int, priority: int) -> None:
    """A non-generating request on a ticket: hold a slot for `work_s`; preempted, start over."""
    loop = asyncio.get_running_loop()
    ticket = pool.ticket(priority, prompt_tokens)
    try:
        await pool.admit(ticket)
        while True:
            await _regain(pool, ticket)
            if work_s:
                await _nap(loop, ticket, work_s)
            if not ticket.preempted:
                return
    finally:
        pool.drop(ticket)

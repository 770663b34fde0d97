"""Where simulated time passes: stalls, queueing for a batch slot, prefill and decode.

A request stalls once; then each of its sequences (one per choice) queues for a slot of its own,
looks its prompt up in the prefix cache as it is scheduled, prefills what the cache lacks, and
decodes its tokens, one step each. A stream of several choices interleaves their frames as they
are made. With every delay at zero nothing sleeps. A model that schedules by priority, limits its
KV cache or decodes speculatively runs its sequences step by step instead (`gateway.sim.decode`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Callable, Sequence

from gateway.sim import decode
from gateway.sim.decode import prefilled, schedule
from gateway.sim.planner import Plan
from gateway.sim.scheduler import Pool, SimStats
from gateway.sim.wire import SimConnectionReset
from gateway.sim.writer import DONE, Frames

__all__ = ["Timeline"]


async def _interleaved(
    sources: Sequence[AsyncGenerator[bytes, None]],
) -> AsyncGenerator[bytes, None]:
    """Several sequences' frames at once, in the order they are made. The first cut ends them
    all; closing this cancels every sequence and waits until their slots are free."""
    queue: asyncio.Queue[bytes | Exception | None] = asyncio.Queue()

    async def pump(source: AsyncGenerator[bytes, None]) -> None:
        try:
            async with contextlib.aclosing(source):
                async for frame in source:
                    queue.put_nowait(frame)
        except Exception as exc:  # a cut, or a bug: the stream ends with it
            queue.put_nowait(exc)
            return
        queue.put_nowait(None)

    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(pump(source)) for source in sources]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for source in sources:  # a task cancelled before it ran never opened its source
            await source.aclose()


async def _hold(
    pool: Pool, work_s: float, prompt_tokens: int, priority: int, arrived: float
) -> None:
    """A non-generating request's slot, held for `work_s` (preemptible on a priority pool)."""
    metrics = pool.metrics
    if pool.preemptive:
        reason = "abort"
        try:
            await decode.work(pool, work_s, prompt_tokens, priority)
            metrics.prompt_tokens += prompt_tokens
            reason = "stop"
        finally:
            metrics.done(arrived, reason)
        return
    try:
        await pool.acquire()
    except asyncio.CancelledError:
        metrics.done(arrived, "abort")
        raise
    pool.kv_tokens += prompt_tokens
    reason = "abort"
    try:
        if work_s:
            await asyncio.sleep(work_s)
        metrics.prompt_tokens += prompt_tokens
        reason = "stop"
    finally:
        pool.release()
        pool.kv_tokens -= prompt_tokens
        metrics.done(arrived, reason)


class Timeline:
    """Runs requests' sequences on their batch slots and closes each request's account.

    In the engine's `stats` every request ends as one of `completed`, `cancelled` (the client
    left first) or `faults` (a cut connection), and its tokens are counted.
    """

    def __init__(self, stats: SimStats) -> None:
        self.stats = stats

    async def work(
        self,
        pool: Pool,
        stall_s: float,
        work_s: float,
        cut: bool,
        *,
        prompt_tokens: int,
        priority: int = 0,
    ) -> None:
        """A non-generating request: stall, queue, hold a slot for `work_s`, then finish."""
        stats = self.stats
        arrived = time.monotonic()
        try:
            if stall_s:
                await asyncio.sleep(stall_s)
            await _hold(pool, work_s, prompt_tokens, priority, arrived)
        except asyncio.CancelledError:
            stats.cancelled += 1
            stats.changed()
            raise
        stats.prompt_tokens += prompt_tokens
        self._finish(cut)

    def _finish(self, cut: bool) -> None:
        stats = self.stats
        if cut:  # the work was done, then the connection dropped instead of the answer
            stats.faults += 1
            stats.changed()
            raise SimConnectionReset("simulated connection drop before the response")
        stats.completed += 1
        stats.changed()

    async def generate(self, plans: Sequence[Plan], prompt_tokens: int) -> None:
        """A non-streaming generation: the same timeline as a stream, without the frames.

        The request stalls once, then its sequences run concurrently, each in its own batch slot
        (queueing for one like any other request); it answers when the last one is done.
        """
        stats = self.stats
        try:
            if plans[0].stall_s:
                await asyncio.sleep(plans[0].stall_s)
            if len(plans) == 1:
                await self._sequence(plans[0])
            else:  # cancelling the request cancels every sequence and waits for their slots
                await asyncio.gather(*(self._sequence(plan) for plan in plans))
        except asyncio.CancelledError:
            stats.cancelled += 1
            stats.changed()
            raise
        stats.prompt_tokens += prompt_tokens
        stats.generation_tokens += sum(plan.n for plan in plans)
        self._finish(plans[0].cut)

    async def _sequence(self, plan: Plan) -> None:
        """One sequence: a batch slot, held through prefill and decode (sending nothing)."""
        target = plan.target
        if target.stepwise:
            await decode.sequence(plan)
            return
        pool, metrics = target.pool, target.pool.metrics
        try:
            await pool.acquire()
        except asyncio.CancelledError:
            metrics.done(plan.arrived, "abort")
            raise
        held = plan.prompt_tokens  # in the simulated KV cache
        pool.kv_tokens += held
        reason = "abort"
        try:
            if ttft_s := schedule(plan):
                await asyncio.sleep(ttft_s)
            prefilled(plan)
            metrics.first_token(plan.arrived, plan.prompt_tokens)
            pool.kv_tokens += 1
            held += 1
            metrics.generation_tokens += 1
            steps, step_s = plan.n - 1, target.step_s
            slowdown = target.profile.batch_slowdown
            if steps > 0 and step_s and slowdown:
                loop = asyncio.get_running_loop()
                due = loop.time()
                for _ in range(steps):  # the batch may fill or drain between any two steps
                    step = pool.step_s(step_s, slowdown)
                    due += step
                    if (delay := due - loop.time()) > 0:
                        await asyncio.sleep(delay)
                    metrics.itl.observe(step)
                    pool.kv_tokens += 1
                    held += 1
                    metrics.generation_tokens += 1
            elif steps > 0:  # constant step time: one sleep
                if step_s:
                    await asyncio.sleep(steps * step_s)
                metrics.itl.observe(step_s, steps)
                pool.kv_tokens += steps
                held += steps
                metrics.generation_tokens += steps
            reason = plan.finish_reason
        finally:
            pool.release()
            pool.kv_tokens -= held
            metrics.done(plan.arrived, reason)

    async def stream(
        self,
        plans: Sequence[Plan],
        frames: Sequence[Frames],
        usage: Callable[[], bytes] | None,
        prompt_tokens: int,
    ) -> AsyncGenerator[bytes, None]:
        """A streamed request: each choice's frames, paced by its own sequence, then the usage
        chunk (`usage()`, built once every sequence is done) and `[DONE]`."""
        stats = self.stats
        stats.open_streams += 1
        stats.changed()
        sent = [0]  # tokens sent, over every sequence
        done = cut = False
        try:
            if plans[0].stall_s:
                await asyncio.sleep(plans[0].stall_s)
            # Closed as soon as this is: that frees the batch slots at once.
            source = decode.frames if plans[0].target.stepwise else self._frames
            if len(plans) == 1:
                inner = source(plans[0], frames[0], sent)
            else:
                inner = _interleaved(
                    [source(p, f, sent) for p, f in zip(plans, frames, strict=True)]
                )
            async with contextlib.aclosing(inner):
                async for frame in inner:
                    yield frame
            if usage is not None:
                yield usage()
            done = True
            yield DONE
        except SimConnectionReset:
            cut = True
            raise
        finally:
            stats.open_streams -= 1
            stats.generation_tokens += sent[0]
            if done:
                stats.prompt_tokens += prompt_tokens
                stats.completed += 1
            elif cut:
                stats.faults += 1
            else:
                stats.cancelled += 1
            stats.changed()

    async def _frames(
        self, plan: Plan, frames: Frames, sent: list[int]
    ) -> AsyncGenerator[bytes, None]:
        """One streamed sequence: its frames, paced by prefill and decode, in a batch slot."""
        first, token_head, token_tails = frames.first, frames.token_head, frames.token_tails
        tokens = frames.tokens
        target = plan.target
        pool = target.pool
        metrics = pool.metrics
        acquired = done = False
        count = held = 0  # tokens made; tokens held in the simulated KV cache
        step_s = target.step_s
        slowdown = target.profile.batch_slowdown if step_s else 0.0
        try:
            await pool.acquire()
            acquired = True
            held = plan.prompt_tokens
            pool.kv_tokens += held
            if ttft_s := schedule(plan):
                await asyncio.sleep(ttft_s)
            prefilled(plan)
            metrics.first_token(plan.arrived, plan.prompt_tokens)
            if first is not None:
                yield first
            n, offset, words = plan.n, plan.offset, len(token_tails)
            limit = min(n, max(1, n // 2)) if plan.cut else n
            if step_s:
                loop = asyncio.get_running_loop()
                due = loop.time()
            for i in range(limit):
                if step_s and i:
                    # A virtual clock: a slow reader gets a burst, not a slower model.
                    step = pool.step_s(step_s, slowdown)
                    due += step
                    if slowdown:
                        metrics.itl.observe(step)
                    if (delay := due - loop.time()) > 0:
                        await asyncio.sleep(delay)
                count = i + 1
                sent[0] += 1
                pool.kv_tokens += 1
                held += 1
                metrics.generation_tokens += 1
                if tokens is None:
                    yield token_head + token_tails[(offset + i) % words]
                elif (frame := tokens[i]) is not None:
                    yield frame
            if plan.cut:
                raise SimConnectionReset("simulated connection drop mid-stream")
            yield frames.finish
            done = True
        finally:
            if acquired:
                pool.release()
                pool.kv_tokens -= held
            if not slowdown and count > 1:  # constant step time: every interval was one step
                metrics.itl.observe(step_s, count - 1)
            metrics.done(plan.arrived, plan.finish_reason if done else "abort")

    async def error_stream(self, error: bytes) -> AsyncGenerator[bytes, None]:
        """A 200 stream whose first event is an error object (counted as a fault already)."""
        self.stats.open_streams += 1
        self.stats.changed()
        try:
            yield b"data: " + error + b"\n\n"
            yield DONE
        finally:
            self.stats.open_streams -= 1
            self.stats.changed()

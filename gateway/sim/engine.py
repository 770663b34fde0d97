"""The simulated LLM upstream: an OpenAI-compatible server modelled well enough to study latency.

Time to first token is queueing (waiting FIFO for one of `max_batch` slots) plus prefill (a base
cost plus a cost per prompt token, optionally with a heavy tail). Decoding runs at `tokens_per_s`,
each step slower as the batch fills (continuous batching). A completions request with several
prompts (or `n` > 1) runs one sequence per choice, each in its own slot, as vLLM does. Faults and
every other random choice are drawn by the planner (`gateway.sim.planner`) from one seeded RNG.

The engine speaks bytes in and bytes out (`SimEngine.handle`), so the in-process provider and the
standalone server (`gateway.sim.server`) share one implementation. It reads a request
(`gateway.sim.wire`), has it planned, lets simulated time pass on the batch slots
(`Timeline`, over `gateway.sim.scheduler`) and has the reply written (`gateway.sim.writer`). With
every delay at zero it never sleeps, and a streamed token costs one bytes concatenation (and a
few counter updates).

`GET /metrics` serves vLLM's Prometheus metrics, driven by the engine's real state
(`gateway.sim.metrics`); it can be made to fail.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from typing import Any

import orjson

from gateway.sim import wire
from gateway.sim.metrics import MetricsPage
from gateway.sim.planner import Deployments, Plan, Planner, seeded
from gateway.sim.profile import MetricsFault, MetricsNames, SimProfile
from gateway.sim.scheduler import Pool, SimStats
from gateway.sim.wire import (
    INBAND_ERROR,
    SSE_HEADERS,
    BadRequestError,
    SimConnectionReset,
    SimReply,
    json_reply,
)
from gateway.sim.writer import DONE, Frames, ReplyWriter, embeddings_body, usage

__all__ = ["SimEngine"]


class SimEngine:
    """A simulated OpenAI-compatible server: named profiles, a default, one seeded RNG."""

    def __init__(
        self,
        profiles: Mapping[str, SimProfile] | None = None,
        default: SimProfile | None = None,
        *,
        seed: int | None = None,
    ) -> None:
        self.profiles: dict[str, SimProfile] = dict(profiles or {})
        self.default = default if default is not None else SimProfile()
        self.stats = SimStats()
        self._planner = Planner(seed, self.stats)
        self._writer = ReplyWriter(self._planner.id_prefix)
        self._timeline = Timeline(self.stats)
        names = list(self.profiles) or ["default"]
        self._page = MetricsPage(names, self.default.metrics_names, self.default.metrics_fault)
        self._deployments = Deployments(self.profiles, self.default, self.stats, self._page)
        self._models_body = orjson.dumps(
            {
                "object": "list",
                "data": [
                    {"id": name, "object": "model", "created": 0, "owned_by": "tailguard-sim"}
                    for name in names
                ],
            }
        )
        self._routes: dict[tuple[str, str], Callable[[dict[str, Any]], Awaitable[SimReply]]] = {
            ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/v1/completions"): self._completions,
            ("POST", "/v1/embeddings"): self._embeddings,
        }

    @property
    def metrics_names(self) -> MetricsNames:
        """The names `/metrics` serves (from the default profile; may be changed while running)."""
        return self._page.names

    @metrics_names.setter
    def metrics_names(self, value: MetricsNames) -> None:
        self._page.names = value

    @property
    def metrics_fault(self) -> MetricsFault:
        """How `/metrics` fails (from the default profile; may be changed while running)."""
        return self._page.fault

    @metrics_fault.setter
    def metrics_fault(self, value: MetricsFault) -> None:
        self._page.fault = value

    def metrics_page(self) -> str:
        """vLLM's Prometheus text for every model name served or requested so far."""
        return self._page.render()

    async def handle(self, method: str, path: str, body: bytes) -> SimReply:
        """Answer one request. Raises `SimConnectionReset` for a reset before headers."""
        route = self._routes.get((method, path))
        try:
            if route is not None:
                request = wire.parse_body(body)
                reply: SimReply = await route(request)
                return reply
            if path == "/v1/models" and method == "GET":
                return json_reply(200, self._models_body)
            if path == "/health" and method == "GET":
                return SimReply(200, {}, b"")
            if path == "/metrics" and method == "GET":
                return self._page.reply()
            if path in ("/v1/models", "/health", "/metrics") or any(
                p == path for _, p in self._routes
            ):
                raise BadRequestError(f"method {method} not allowed on {path}", status=405)
            raise BadRequestError(f"no such endpoint: {method} {path}", status=404)
        except BadRequestError as exc:
            return json_reply(
                exc.status,
                wire.error_body(exc.message, "invalid_request_error", exc.param, exc.code),
            )

    def _faults(self, profile: SimProfile, stream: bool) -> SimReply | None:
        """The faults that answer before any work (a reset raises), then an in-band error."""
        if (early := self._planner.early_fault(profile)) is not None:
            return early
        if not self._planner.inband(profile):
            return None
        if stream:
            return SimReply(
                200, dict(SSE_HEADERS), stream=self._timeline.error_stream(INBAND_ERROR)
            )
        return json_reply(200, INBAND_ERROR)

    async def _chat(self, request: dict[str, Any]) -> SimReply:
        model = wire.model_name(request)
        target = self._deployments.resolve(model)
        chat = wire.read_chat(request, target.profile)
        if (fault := self._faults(target.profile, chat.stream)) is not None:
            return fault
        text = None if chat.seed is None else seeded(chat.seed, orjson.dumps(chat.messages), 0)
        plan = self._planner.plan(target, chat.prompt_tokens, chat.max_tokens, text=text)
        if chat.stream:
            frames = self._writer.chat_frames(plan, include_usage=chat.include_usage)
            return SimReply(200, dict(SSE_HEADERS), stream=self._timeline.stream(plan, frames))
        await self._timeline.generate((plan,), plan.prompt_tokens)
        return json_reply(200, self._writer.chat_body(model, plan))

    async def _completions(self, request: dict[str, Any]) -> SimReply:
        """Each prompt, and each of its `n` choices, is a sequence of its own (as in vLLM).

        Choice `index` is `prompt * n + j`. Under an integer `seed` a choice's text is a function
        of (seed, prompt, j), so a prompt reads the same alone or among others. Faults are drawn
        once for the whole request.
        """
        model = wire.model_name(request)
        target = self._deployments.resolve(model)
        completions = wire.read_completions(request, target.profile)
        if (fault := self._faults(target.profile, completions.stream)) is not None:
            return fault
        seed, max_tokens = completions.seed, completions.max_tokens
        plans: list[Plan] = []
        for key, tokens in completions.prompts:
            for j in range(completions.per_prompt):
                text = None if seed is None else seeded(seed, key, j)
                first = plans[0] if plans else None
                plans.append(
                    self._planner.plan(target, tokens, max_tokens, text=text, request=first)
                )
        plan = plans[0]
        if completions.stream:
            frames = self._writer.completion_frames(plan, include_usage=completions.include_usage)
            return SimReply(200, dict(SSE_HEADERS), stream=self._timeline.stream(plan, frames))
        # Prompt tokens count once per prompt, whatever n is.
        prompt_tokens = sum(tokens for _, tokens in completions.prompts)
        await self._timeline.generate(plans, prompt_tokens)
        return json_reply(200, self._writer.completions_body(model, plans, prompt_tokens))

    async def _embeddings(self, request: dict[str, Any]) -> SimReply:
        model = wire.model_name(request)
        target = self._deployments.resolve(model)
        embeddings = wire.read_embeddings(request, target.profile)
        profile = target.profile
        if (fault := self._faults(profile, stream=False)) is not None:
            return fault
        stall_s, cut = self._planner.stall_and_cut(profile)
        inputs = embeddings.inputs
        work_s = (profile.embed_base_ms + profile.embed_ms_per_input * len(inputs)) / 1000
        tokens = sum(t for _, t in inputs)
        await self._timeline.work(target.pool, stall_s, work_s, cut, prompt_tokens=tokens)
        body = embeddings_body(model, inputs, embeddings.dims, b64=embeddings.base64, tokens=tokens)
        return json_reply(200, body)


class Timeline:
    """Where simulated time passes: stalls, queueing for a batch slot, prefill and decode.

    It closes each request's account in the engine's `stats`: `completed`, `cancelled` (the
    client left first) or `faults` (a cut connection), and its tokens.
    """

    def __init__(self, stats: SimStats) -> None:
        self.stats = stats

    async def work(
        self, pool: Pool, stall_s: float, work_s: float, cut: bool, *, prompt_tokens: int
    ) -> None:
        """A non-generating request: stall, queue, hold a slot for `work_s`, then finish."""
        stats, metrics = self.stats, pool.metrics
        arrived = time.monotonic()
        try:
            if stall_s:
                await asyncio.sleep(stall_s)
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
        (queueing FIFO for one like any other request); it answers when the last one is done.
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
            if plan.ttft_s:
                await asyncio.sleep(plan.ttft_s)
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

    async def stream(self, plan: Plan, frames: Frames) -> AsyncGenerator[bytes, None]:
        """One streamed sequence: its frames, paced by prefill and decode, in a batch slot."""
        first, token_head, token_tails = frames.first, frames.token_head, frames.token_tails
        stats, target = self.stats, plan.target
        pool = target.pool
        metrics = pool.metrics
        stats.open_streams += 1
        stats.changed()
        queued = acquired = done = cut = False
        sent = held = 0  # tokens sent; tokens held in the simulated KV cache
        step_s = target.step_s
        slowdown = target.profile.batch_slowdown if step_s else 0.0
        try:
            if plan.stall_s:
                await asyncio.sleep(plan.stall_s)
            queued = True
            await pool.acquire()
            acquired = True
            held = plan.prompt_tokens
            pool.kv_tokens += held
            if plan.ttft_s:
                await asyncio.sleep(plan.ttft_s)
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
                sent = i + 1
                pool.kv_tokens += 1
                held += 1
                metrics.generation_tokens += 1
                yield token_head + token_tails[(offset + i) % words]
            if plan.cut:
                cut = True
                raise SimConnectionReset("simulated connection drop mid-stream")
            yield frames.finish
            if frames.usage_head is not None:
                yield frames.usage_head + orjson.dumps(usage(plan.prompt_tokens, n)) + b"}\n\n"
            done = True
            yield DONE
        finally:
            if acquired:
                pool.release()
                pool.kv_tokens -= held
            if not slowdown and sent > 1:  # constant step time: every interval was one step
                metrics.itl.observe(step_s, sent - 1)
            if queued:
                metrics.done(plan.arrived, plan.finish_reason if done else "abort")
            stats.open_streams -= 1
            stats.generation_tokens += sent
            if done:
                stats.prompt_tokens += plan.prompt_tokens
                stats.completed += 1
            elif cut:
                stats.faults += 1
            else:
                stats.cancelled += 1
            stats.changed()

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

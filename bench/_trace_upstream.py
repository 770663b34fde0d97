"""Latency-modelled upstreams for the trace benchmark, served in the benchmark's own process.

Each upstream streams OpenAI chat completions with a time to first token of
`(base + prefill per token x prompt tokens) x jitter (+ a stall, with a probability)` after a
free slot, then the answer's tokens `tokens_per_event` at a time, one every `tpot` per token.
The draws (jitter, stall) are seeded per request: by the upstream's seed, its name, the request's
key (the body's `user` field) and how many attempts of that key it has seen. Two copies with the
same seed therefore give the same request the same latency, whichever arm sends it: that is
what pairs the overhead measurement.

States, switched by the scenario: `normal`; `slow` (everything but the stalls `slow_factor`
times slower, for requests arriving in it); `down` (the port is closed and open connections
are reset: connections refused, as when a server is gone).

A stall is a wait for the provider's capacity before the prefill begins (a queue, a cold
replica); the prefill follows it. Each attempt is recorded: its key, prompt tokens, whether its
prefill began and whether its stream completed. An attempt whose prefill began and whose stream
the client closed before its end is waste (a hedge's loser, a cancelled attempt); one given up
while it waited in the queue or its stall cost the provider nothing.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import orjson
from aiohttp import web

State = Literal["normal", "slow", "down"]
SLOW_FACTOR: Final = 4.0


@dataclass(frozen=True, slots=True)
class LatencyModel:
    """How one upstream answers."""

    name: str
    base_ms: float
    prefill_ms_per_1k: float  # per 1,000 prompt tokens
    tpot_ms: float
    slots: int  # requests served at once; the others queue
    stall_rate: float = 0.0
    stall_ms: tuple[float, float] = (1500.0, 4000.0)
    tokens_per_event: int = 4
    usage: bool = True  # a final usage chunk (without, the gateway counts tokens another way)
    jitter_sigma: float = 0.1


@dataclass(slots=True)
class Attempt:
    key: str
    prompt_tokens: int
    completed: bool = False
    prefilling: bool = False  # its prefill began: if it does not complete, that work is waste
    answered: bool = False  # its first token was sent (a loser timed to its first token)
    arrived: float = 0.0  # loop time it arrived, and it ended (for a run's own diagnostics)
    ended: float = 0.0


def draw(model: LatencyModel, seed: int, key: str, attempt: int) -> tuple[float, float]:
    """(jitter factor, stall in seconds) of one attempt; the same for the same arguments."""
    rng = random.Random(f"{seed}:{model.name}:{key}:{attempt}")
    jitter = rng.lognormvariate(0.0, model.jitter_sigma)
    stall = rng.uniform(*model.stall_ms) / 1000.0 if rng.random() < model.stall_rate else 0.0
    return jitter, stall


def output_tokens(key: str, max_tokens: int) -> int:
    """The answer's length: the trace's, carried at the end of the key (`...-<tokens>`), at most
    `max_tokens`."""
    try:
        planned = int(key.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        planned = max_tokens
    return max(1, min(planned, max_tokens))


def _chunk(model: str, content: str, finish: str | None, usage: dict[str, int] | None) -> bytes:
    event: dict[str, object] = {
        "id": "chatcmpl-trace",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}],
    }
    if usage is not None:
        event["usage"] = usage
    return b"data: " + orjson.dumps(event) + b"\n\n"


@dataclass
class TraceUpstream:
    model: LatencyModel
    seed: int
    state: State = "normal"
    port: int = 0
    attempts: list[Attempt] = field(default_factory=list)
    _seen: Counter[str] = field(default_factory=Counter)
    _slots: asyncio.Semaphore | None = None
    _web: web.Server | None = None
    _server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self._slots = asyncio.Semaphore(self.model.slots)
        # Cancelled with its connection: a client that gives up frees the slot at once.
        self._web = web.Server(self._handle, handler_cancellation=True, access_log=None)
        await self._listen()

    async def _listen(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._web is not None
        self._server = await loop.create_server(
            self._web, "127.0.0.1", self.port, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        await self._close()
        if self._web is not None:
            await self._web.shutdown(0.5)

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for connection in list(self._web.connections if self._web else ()):
            connection.force_close()

    async def set_state(self, state: State) -> None:
        if state == "down" and self.state != "down":
            await self._close()
        elif state != "down" and self.state == "down":
            await self._listen()
        self.state = state

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.method != "POST":
            return web.Response(text="ok")
        body = orjson.loads(await request.read())
        key = str(body.get("user", ""))
        chars = sum(
            len(m["content"])
            for m in body.get("messages", ())
            if isinstance(m, dict) and isinstance(m.get("content"), str)
        )
        loop = asyncio.get_running_loop()
        attempt = Attempt(key, max(1, (chars + 3) // 4), arrived=loop.time())
        self.attempts.append(attempt)
        try:
            return await self._serve(request, attempt, body, key)
        finally:
            attempt.ended = loop.time()

    async def _serve(
        self, request: web.BaseRequest, attempt: Attempt, body: dict[str, Any], key: str
    ) -> web.StreamResponse:
        n = self._seen[key]
        self._seen[key] += 1
        jitter, stall = draw(self.model, self.seed, key, n)
        factor = SLOW_FACTOR if self.state == "slow" else 1.0
        tokens = output_tokens(key, int(body.get("max_tokens") or 16))
        model = self.model
        assert self._slots is not None
        async with self._slots:
            if stall:  # waiting for the provider's capacity: no prefill done yet
                await asyncio.sleep(stall)
            attempt.prefilling = True
            prefill_ms = model.base_ms + model.prefill_ms_per_1k * attempt.prompt_tokens / 1000
            await asyncio.sleep(prefill_ms * jitter * factor / 1000.0)
            response = web.StreamResponse(headers={"content-type": "text/event-stream"})
            try:
                await response.prepare(request)
                attempt.answered = True
                sent = 0
                while sent < tokens:
                    step = min(model.tokens_per_event, tokens - sent)
                    if sent:  # the first event is the first token, after the prefill
                        await asyncio.sleep(model.tpot_ms * step * factor / 1000.0)
                    sent += step
                    last = sent >= tokens
                    usage = None
                    if last and model.usage:
                        usage = {
                            "prompt_tokens": attempt.prompt_tokens,
                            "completion_tokens": tokens,
                            "total_tokens": attempt.prompt_tokens + tokens,
                        }
                    await response.write(
                        _chunk(model.name, "tok " * step, "stop" if last else None, usage)
                    )
                await response.write(b"data: [DONE]\n\n")
                await response.write_eof()
            except ConnectionError:  # the client closed it: a loser, or an outage
                return response
            attempt.completed = True
            return response

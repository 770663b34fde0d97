"""The spill benchmark's client: open-loop Poisson arrivals of streaming chat requests, each
timed from its scheduled send, and the local server's own queue sampled beside them."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from bench._harness import (
    post_stream,
    stream_chat_body,
)
from bench._spill_setup import (
    KEEPALIVE_S,
    MAX_TOKENS,
    MODEL,
    PROMPT,
    QUEUE_SAMPLE_S,
    REQUEST_TIMEOUT_S,
)
from gateway.latency.vllm import parse_metrics
from gateway.tools.stream import StreamReader


@dataclass(slots=True)
class Outcome:
    """One client request, as the client saw it."""

    step: int  # index into the steps; -1: warm-up
    lag_s: float
    ttft_s: float | None = None
    status: int = 0
    deployment: str | None = None
    route: str | None = None
    error: str | None = None


async def one_request(
    session: aiohttp.ClientSession, url: str, body: bytes, step: int, due: float
) -> Outcome:
    started = time.perf_counter()
    origin = min(due, started)
    outcome = Outcome(step=step, lag_s=started - due)
    reader = StreamReader(errors_only_after_first=True)
    outcome.status, headers, outcome.error, _ = await post_stream(
        session, url, body, {"content-type": "application/json"}, reader
    )
    outcome.deployment = headers.get("x-tailguard-deployment")
    outcome.route = headers.get("x-tailguard-route")
    if reader.t_first is not None:
        outcome.ttft_s = reader.t_first - origin
    return outcome


def schedule(
    rates: Sequence[float], seconds: Sequence[float], seed: int
) -> list[tuple[float, int]]:
    """Poisson arrivals (offset, phase) through consecutive phases of the given rates."""
    rng = random.Random(seed)
    arrivals: list[tuple[float, int]] = []
    start = 0.0
    for phase, (rate, length) in enumerate(zip(rates, seconds, strict=True)):
        t = start + rng.expovariate(rate)
        while t < start + length:
            arrivals.append((t, phase))
            t += rng.expovariate(rate)
        start += length
    return arrivals


@dataclass(slots=True)
class LocalView:
    """The local server's own account, per phase: its queue samples and abort counter."""

    waiting: list[list[float]]
    aborts: list[float]  # the counter at each phase's end


async def local_metrics(session: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    """(waiting, aborted so far) from the local server's `/metrics`."""
    async with session.get(url) as response:
        text = await response.text()
    aborted = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line:
            aborted += float(line.rsplit(" ", 1)[1])
    return parse_metrics(text).waiting, aborted


async def drive(
    gateway_url: str, local_metrics_url: str, arrivals: Sequence[tuple[float, int]], phases: int
) -> tuple[list[Outcome], LocalView]:
    url = gateway_url + "/v1/chat/completions"
    body = stream_chat_body(MODEL, MAX_TOKENS, PROMPT)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    view = LocalView(waiting=[[] for _ in range(phases)], aborts=[0.0] * phases)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        loop = asyncio.get_running_loop()
        tasks: list[asyncio.Task[Outcome]] = []
        phase_now = 0
        stop = asyncio.Event()

        async def watch() -> None:
            while not stop.is_set():
                with contextlib.suppress(aiohttp.ClientError, ValueError, TimeoutError):
                    waiting, aborted = await local_metrics(session, local_metrics_url)
                    view.waiting[phase_now].append(waiting)
                    view.aborts[phase_now] = aborted
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), QUEUE_SAMPLE_S)

        watcher = asyncio.create_task(watch())
        t0 = time.perf_counter() + 0.05
        for offset, phase in arrivals:
            due = t0 + offset
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            phase_now = phase
            tasks.append(loop.create_task(one_request(session, url, body, phase - 1, due)))
        outcomes = list(await asyncio.gather(*tasks))
        stop.set()
        await watcher
        with contextlib.suppress(aiohttp.ClientError, ValueError, TimeoutError):
            view.aborts[-1] = (await local_metrics(session, local_metrics_url))[1]
    return outcomes, view

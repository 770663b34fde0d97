"""A simulated vLLM server served for real on loopback, for the simulator's scheduling tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx

from gateway.sim.engine import SimEngine
from gateway.sim.profile import SimProfile
from gateway.sim.server import create_sim_app
from tests.conftest import serve

WATCHDOG_S = 10.0  # only ever reached when a test is broken; states are awaited, not slept on
LABELS = 'model_name="m",engine="0"'  # the labels of the default model's /metrics series


@asynccontextmanager
async def sim(seed: int = 1, **profile: Any) -> AsyncIterator[tuple[SimEngine, httpx.AsyncClient]]:
    """An engine with `profile` as its default, and a client of its HTTP server."""
    engine = SimEngine(default=SimProfile(**profile), seed=seed)
    async with (
        serve(create_sim_app(engine)) as url,
        httpx.AsyncClient(base_url=url, timeout=WATCHDOG_S) as client,
    ):
        yield engine, client


def chat(model: str = "m", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hello there"}], **extra}


async def until(engine: SimEngine, predicate: Any) -> None:
    """Wait until the engine's counters satisfy `predicate`."""
    async with asyncio.timeout(WATCHDOG_S):
        await engine.stats.wait_for(predicate)

"""Shared test harness: real servers on loopback, in the test's own event loop."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import pytest
import uvicorn

from gateway.api import create_app
from gateway.config import Settings, build_settings
from gateway.latency import MemoryRecorder
from gateway.sim.engine import SimEngine, SimProfile
from gateway.sim.server import create_sim_app


@asynccontextmanager
async def serve(app: Any) -> AsyncIterator[str]:
    """Run an ASGI app under uvicorn on an ephemeral loopback port; yield its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(
        app, log_level="warning", lifespan="on", http="httptools", access_log=False
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():  # start-up failed: surface the reason
                task.result()
                raise RuntimeError("server stopped during start-up")
            await asyncio.sleep(0.002)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
        sock.close()


class Upstream:
    """A simulated LLM server running for real on loopback."""

    def __init__(self, engine: SimEngine, url: str) -> None:
        self.engine = engine
        self.url = url
        self.base_url = url + "/v1"

    @property
    def stats(self) -> Any:
        return self.engine.stats


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    """A zero-delay simulated upstream; tests script it through model names (`m@key=value`)."""
    engine = SimEngine({}, SimProfile(output_tokens=5), seed=1)
    async with serve(create_sim_app(engine)) as url:
        yield Upstream(engine, url)


def gateway_settings(
    providers: dict[str, Any], models: list[dict[str, Any]], **extra: Any
) -> Settings:
    return build_settings({"providers": providers, "models": models, **extra})


class Gateway:
    def __init__(self, url: str, recorder: MemoryRecorder) -> None:
        self.url = url
        self.base_url = url + "/v1"
        self.recorder = recorder


GatewayFactory = Callable[[Settings], AbstractAsyncContextManager[Gateway]]


@asynccontextmanager
async def run_gateway(settings: Settings) -> AsyncIterator[Gateway]:
    recorder = MemoryRecorder()
    async with serve(create_app(settings, recorder=recorder)) as url:
        yield Gateway(url, recorder)


def one_model(upstream_url: str, upstream_model: str = "m", **model: Any) -> Settings:
    """A gateway with one model `m` on one OpenAI-compatible deployment."""
    return gateway_settings(
        {"up": {"type": "vllm", "base_url": upstream_url}},
        [{"name": "m", "deployments": [{"provider": "up", "model": upstream_model}], **model}],
    )

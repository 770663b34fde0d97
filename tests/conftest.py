"""Shared test harness: real servers on loopback, in the test's own event loop."""

from __future__ import annotations

import asyncio
import logging
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import pytest
import uvicorn

from gateway.api import create_app
from gateway.config import Settings, build_settings
from gateway.latency import MemoryRecorder
from gateway.sim.engine import SimEngine
from gateway.sim.profile import SimProfile
from gateway.sim.server import create_sim_app
from tests.timing import scaled


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test's pytest-timeout limit (its own mark's, else the configured one) is stretched
    for a slow or busy machine, like every other unavoidable deadline (`tests.timing`)."""
    configured = float(config.getini("timeout") or 0)
    for item in items:
        mark = item.get_closest_marker("timeout")
        limit = float(mark.args[0]) if mark is not None and mark.args else configured
        if limit > 0:
            item.add_marker(pytest.mark.timeout(scaled(limit)), append=False)


@asynccontextmanager
async def serve(app: Any) -> AsyncIterator[str]:
    """Run an ASGI app under uvicorn on an ephemeral loopback port; yield its base URL."""
    # IPPROTO_TCP explicitly: only then does asyncio set TCP_NODELAY on accepted connections
    # (without it, Nagle's algorithm stalls keep-alive requests by ~40 ms).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(
        app,
        log_level="warning",
        lifespan="on",
        http="gateway.server.protocol:GuardedHttpToolsProtocol",  # as `tailguard serve` runs
        access_log=False,
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


# --- a throwaway Redis --------------------------------------------------------------------------


def free_port() -> int:
    """A loopback port that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """A throwaway redis-server on loopback that a test can kill and start again on its port."""

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the server (again, after `kill`) on the same port; return once it answers PING."""
        if self.process is not None:
            raise RuntimeError("redis-server is already running")
        self.process = process = subprocess.Popen(
            [
                self.binary,
                *("--port", str(self.port), "--bind", "127.0.0.1"),
                *("--save", "", "--appendonly", "no"),  # nothing written to disk
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + scaled(10)
        while True:  # bounded wait for the server to answer PING
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)

    def kill(self) -> None:
        """Kill the server at once (SIGKILL, as in a crash); what it held is lost."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None

    stop = kill


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A fresh, empty redis-server on a free loopback port, killed when the test ends."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed: the Redis store tests need a real server")
    server = RedisServer(binary)
    server.start()
    try:
        yield server
    finally:
        server.kill()


ACCESS = "tailguard.access"


@pytest.fixture
def access(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """caplog, capturing `tailguard.access` at INFO (even after `configure_logging` stopped it
    propagating to the root logger in this process)."""
    logger = logging.getLogger(ACCESS)
    monkeypatch.setattr(logger, "propagate", True)
    monkeypatch.setattr(logger, "disabled", logger.disabled)  # restored: apps set it
    caplog.set_level(logging.INFO, logger=ACCESS)
    yield caplog

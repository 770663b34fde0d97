"""Shared test harness: real servers on loopback, in the test's own event loop."""

from __future__ import annotations

import asyncio
import logging
import shutil
import socket
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any, Final

import httpx
import pytest
import uvicorn

from gateway.api import create_app
from gateway.config import Settings, build_settings
from gateway.latency import MemoryRecorder
from gateway.sim.engine import SimEngine
from gateway.sim.profile import SimProfile
from gateway.sim.server import create_sim_app
from tests.fakes.otlp_receiver import RecordingApp
from tests.timing import eventually, eventually_sync, scaled


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test's pytest-timeout limit (its own mark's, else the configured one) is stretched
    for a slow or busy machine, like every other unavoidable deadline (`tests.timing`)."""
    configured = float(config.getini("timeout") or 0)
    for item in items:
        mark = item.get_closest_marker("timeout")
        limit = float(mark.args[0]) if mark is not None and mark.args else configured
        if limit > 0:
            item.add_marker(pytest.mark.timeout(scaled(limit)), append=False)


GUARDED_PROTOCOL: Final = "gateway.server.protocol:GuardedHttpToolsProtocol"  # `tailguard serve`'s


@asynccontextmanager
async def serving(
    app: Any,
    *,
    port: int = 0,
    http: str | type[asyncio.Protocol] = GUARDED_PROTOCOL,
    sndbuf: int | None = None,
    grace_s: float | None = None,
    log_level: str = "warning",
) -> AsyncIterator[tuple[str, uvicorn.Server]]:
    """Run an ASGI app under uvicorn on loopback; yield its base URL and the server (a test can
    stop it with `should_exit`, or look at its `server_state`).

    `port` 0 is an ephemeral port; a given one can be served again once the last server on it
    stopped. `http` is uvicorn's protocol class (default: the gateway's own, as `tailguard serve`
    runs). With `sndbuf`, accepted connections have that send buffer (inherited from the
    listening socket). `grace_s` is uvicorn's graceful-shutdown timeout (what `tailguard serve`
    sets from `server.shutdown_grace_s`); without it, shutdown waits for every connection."""
    # IPPROTO_TCP explicitly: only then does asyncio set TCP_NODELAY on accepted connections
    # (without it, Nagle's algorithm stalls keep-alive requests by ~40 ms).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if sndbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    sock.bind(("127.0.0.1", port))
    config = uvicorn.Config(
        app,
        log_level=log_level,
        lifespan="on",
        http=http,
        access_log=False,
        timeout_graceful_shutdown=grace_s,  # type: ignore[arg-type]  # any number of seconds
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        await eventually(
            lambda: server.started or task.done(), within_s=60, what="start-up", every_s=0.002
        )
        if task.done():  # start-up failed: surface the reason
            task.result()
            raise RuntimeError("server stopped during start-up")
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", server
    finally:
        server.should_exit = True
        await task
        sock.close()


@asynccontextmanager
async def serve(app: Any) -> AsyncIterator[str]:
    """Run an ASGI app under uvicorn on an ephemeral loopback port; yield its base URL."""
    async with serving(app) as (url, _):
        yield url


class Upstream:
    """A simulated LLM server running for real on loopback; `recording` keeps each POST's path
    and headers."""

    def __init__(self, engine: SimEngine, url: str, recording: RecordingApp | None = None) -> None:
        self.engine = engine
        self.url = url
        self.base_url = url + "/v1"
        self.recording = recording

    @property
    def stats(self) -> Any:
        return self.engine.stats

    def headers(self) -> list[dict[str, str]]:
        """The headers of each request it was sent, in order."""
        assert self.recording is not None, "an upstream served without recording"
        return self.recording.headers

    def traceparents(self) -> list[str | None]:
        """The `traceparent` each request carried, in order (None: none)."""
        return [headers.get("traceparent") for headers in self.headers()]


@asynccontextmanager
async def simulated() -> AsyncIterator[Upstream]:
    """A zero-delay simulated upstream; tests script it through model names (`m@key=value`)."""
    engine = SimEngine({}, SimProfile(output_tokens=5), seed=1)
    recording = RecordingApp(create_sim_app(engine))
    async with serve(recording) as url:
        yield Upstream(engine, url, recording)


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    """A simulated upstream (see `simulated`)."""
    async with simulated() as up:
        yield up


@pytest.fixture
async def primary() -> AsyncIterator[Upstream]:
    """The upstream of a model's own deployment, where a fallback model has another."""
    async with simulated() as up:
        yield up


@pytest.fixture
async def fallback() -> AsyncIterator[Upstream]:
    """The fallback model's upstream, beside `primary`."""
    async with simulated() as up:
        yield up


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    """A plain HTTP client for the tests' servers (a test module may define its own, with
    other limits)."""
    async with httpx.AsyncClient(timeout=scaled(20)) as http:
        yield http


def gateway_settings(
    providers: dict[str, Any], models: list[dict[str, Any]], **extra: Any
) -> Settings:
    return build_settings({"providers": providers, "models": models, **extra})


class Gateway:
    """An in-process gateway served on loopback."""

    def __init__(self, url: str, recorder: MemoryRecorder, server: uvicorn.Server) -> None:
        self.url = url
        self.base_url = url + "/v1"
        self.port = int(url.rpartition(":")[2])
        self.recorder = recorder  # every finished attempt, besides the gateway's own stores
        self.server = server  # `server.should_exit = True` stops it


GatewayFactory = Callable[[Settings], AbstractAsyncContextManager[Gateway]]


@asynccontextmanager
async def run_gateway(
    settings: Settings,
    *,
    recorder: MemoryRecorder | None = None,
    environ: Mapping[str, str] | None = None,
    config_path: Path | None = None,
    port: int = 0,
    http: str | type[asyncio.Protocol] = GUARDED_PROTOCOL,
    sndbuf: int | None = None,
    grace_s: float | None = None,
    log_level: str = "warning",
) -> AsyncIterator[Gateway]:
    """The gateway app for `settings`, served in this event loop (see `serving` for the server's
    options). `environ` holds the `OTEL_*` variables tracing is configured from (default: the
    process environment); with `config_path` (the file `settings` came from) the config is
    reloaded when it changes. Its lifespan, flushing the spans, is over on exit."""
    recorder = MemoryRecorder() if recorder is None else recorder
    app = create_app(settings, recorder=recorder, environ=environ, config_path=config_path)
    async with serving(
        app, port=port, http=http, sndbuf=sndbuf, grace_s=grace_s, log_level=log_level
    ) as (url, server):
        yield Gateway(url, recorder, server)


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

        def answers() -> bool:
            if process.poll() is not None:
                raise RuntimeError(f"redis-server exited at start on port {self.port}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as conn:
                    conn.sendall(b"PING\r\n")
                    return conn.recv(16).startswith(b"+PONG")
            except OSError:
                return False

        try:
            eventually_sync(answers, what=f"redis-server answering PING on port {self.port}")
        except BaseException:
            self.kill()
            raise

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

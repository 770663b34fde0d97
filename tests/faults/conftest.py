"""The fault suite's harness: every test runs under a loop-stall watchdog and a leak check.

Both are autouse: a test fails if its event loop is blocked for more than 50 ms, or if asyncio
tasks or file descriptors outlive it. Within a test, `settled()` checks each case while the
gateway still runs: the request's tasks are gone and its upstream connections closed.
Upstream providers are of type `openai`, so no background `/metrics` reader adds connections of
its own to what a test counts.
"""

from __future__ import annotations

import asyncio
import importlib
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Any

import httpx
import openai
import pytest

from gateway.config import Settings
from tests.conftest import Gateway, free_port, gateway_settings
from tests.faults.leaks import links, no_leaks, port_of, request_tasks, task_names
from tests.faults.stall import loop_watchdog, pytest_runtest_call
from tests.timing import eventually, scaled

__all__ = [
    "CHAT",
    "MESSAGES",
    "chat",
    "client",
    "http_client",
    "loop_watchdog",
    "no_leaks",
    "pytest_runtest_call",
    "routed",
    "sdk",
    "settled",
]

# Modules the servers and clients import on first use, on the event loop; imported here so a
# test's loop is never charged for a one-off import (the watchdog would rightly flag it).
for _module in (
    "gateway.providers.simulated",
    "jiter",
    "openai.lib.streaming.chat",
    "openai.pagination",
    "openai.resources.chat.completions.completions",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "uvicorn.lifespan.on",
    "uvicorn.protocols.http.httptools_impl",
    "uvicorn.protocols.websockets.auto",
    "watchfiles",
):
    importlib.import_module(_module)


async def _sdk_transport_used() -> None:
    """One request through the official SDK's own HTTP client, to a closed port: whatever its
    HTTP stack imports when its first client is built and first connects (which modules
    depends on the SDK's version) is imported here, not in a test's loop."""
    async with openai.DefaultAsyncHttpxClient(timeout=1) as http:
        with suppress(Exception):  # refused: the point was the imports on the way
            await http.get(f"http://127.0.0.1:{free_port()}/")


asyncio.run(_sdk_transport_used())

CHAT: dict[str, Any] = {"messages": [{"role": "user", "content": "Say something."}]}
MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [
    {"role": "user", "content": "Say something."}
]


def chat(model: str = "m", **extra: Any) -> dict[str, Any]:
    return {"model": model, **CHAT, **extra}


def routed(
    primary: str,
    first: str,
    fallback: str | None = None,
    second: str = "ok",
    *,
    top: dict[str, Any] | None = None,
    **model: Any,
) -> Settings:
    """Model `m` on upstream model `first` at `primary` (a base URL); with `fallback`, falling
    back to model `b` on `second` there (expected TTFT 50 ms until it has statistics)."""
    providers: dict[str, Any] = {"p": {"type": "openai", "base_url": primary}}
    models: list[dict[str, Any]] = [
        {"name": "m", "deployments": [{"provider": "p", "model": first}], **model}
    ]
    if fallback is not None:
        providers["f"] = {"type": "openai", "base_url": fallback}
        models[0]["fallbacks"] = ["b"]
        models.append(
            {
                "name": "b",
                "deployments": [{"provider": "f", "model": second, "prior": {"ttft_ms": 50}}],
            }
        )
    extra = {"server": {"access_log": False}, **(top or {})}
    return gateway_settings(providers, models, **extra)


# Making an HTTP client loads and parses the system's CA bundle (~200 KB): tens of ms holding
# the GIL on whichever thread makes it, so even a client made in a worker thread stalls the
# loop. Every client here speaks plain HTTP on loopback: they share one context, built once at
# import, before any test's loop runs.
LOOPBACK_TLS = ssl.create_default_context()
httpx.AsyncClient(verify=LOOPBACK_TLS)  # the first client made pays ~20 ms of one-off set-up


def http_client(**options: Any) -> httpx.AsyncClient:
    """An httpx client that loads no certificates when it is made."""
    return httpx.AsyncClient(verify=LOOPBACK_TLS, **options)


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with http_client(timeout=scaled(10)) as http:
        yield http


@asynccontextmanager
async def sdk(gw: Gateway) -> AsyncIterator[openai.AsyncOpenAI]:
    """The official client, without its own retries (the gateway's behaviour is under test)."""
    made = openai.AsyncOpenAI(
        base_url=gw.base_url,
        api_key="unused",
        max_retries=0,
        http_client=openai.DefaultAsyncHttpxClient(verify=LOOPBACK_TLS, timeout=scaled(10)),
    )
    async with made as client:
        yield client


async def settled(*upstreams: str, at_most: int = 0, gateway: str | None = None) -> None:
    """Wait until a case has settled: every task a request started has ended (only what the
    servers own is left), and this process (the gateway) holds at most `at_most` connections
    to each upstream, so whatever a fault left open was closed and pooling did not grow. With
    `gateway` (its URL), the gateway must also hold no client connection any more."""
    ports = [port_of(url) for url in upstreams]
    own = port_of(gateway) if gateway is not None else None
    last: dict[str, object] = {}

    async def quiet() -> bool:
        found = await links()
        counts = {port: sum(1 for link in found if link.remote_port == port) for port in ports}
        accepted = sum(1 for k in found if k.local_port == own and k.state != "LISTEN")
        tasks = request_tasks()
        last.update(upstreams=counts, clients=accepted, tasks=task_names(tasks))
        return not tasks and not accepted and all(n <= at_most for n in counts.values())

    await eventually(quiet, what=lambda: f"{last}; at most {at_most} connections per upstream")

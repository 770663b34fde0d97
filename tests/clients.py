"""A running gateway and the SDK clients a test talks to it with: one way to open them.

`open_clients` starts a gateway on loopback for the given providers and models; `Clients` makes
each client on first use (SDK clients are not free) and closes it with the gateway.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anthropic
import httpx
import openai

from tests.conftest import Gateway, gateway_settings, run_gateway

CLIENT_KEY = "sk-client-key-never-forwarded-9876543210"  # what the SDK clients send the gateway
CLIENT_TIMEOUT_S = 10.0


class Clients:
    """A running gateway and clients for it, each made on first use."""

    def __init__(self, gateway: Gateway, stack: AsyncExitStack) -> None:
        self.gateway = gateway
        self._stack = stack

    @functools.cached_property
    def openai(self) -> openai.AsyncOpenAI:
        client = openai.AsyncOpenAI(
            base_url=self.gateway.base_url,
            api_key=CLIENT_KEY,
            max_retries=0,
            timeout=CLIENT_TIMEOUT_S,
        )
        self._stack.push_async_callback(client.close)
        return client

    @functools.cached_property
    def anthropic(self) -> anthropic.AsyncAnthropic:
        client = anthropic.AsyncAnthropic(
            base_url=self.gateway.url,
            api_key=CLIENT_KEY,
            max_retries=0,
            timeout=CLIENT_TIMEOUT_S,
        )
        self._stack.push_async_callback(client.close)
        return client

    @functools.cached_property
    def http(self) -> httpx.AsyncClient:
        """For raw bytes and headers."""
        client = httpx.AsyncClient(base_url=self.gateway.url, timeout=CLIENT_TIMEOUT_S)
        self._stack.push_async_callback(client.aclose)
        return client

    async def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        """Raw bytes of an answer (streamed or not), for the schema checks."""
        return await self.http.post(path, json=body)


@asynccontextmanager
async def open_clients(
    providers: dict[str, Any], models: list[dict[str, Any]], **extra: Any
) -> AsyncIterator[Clients]:
    """A gateway serving `models` over `providers` (config sections as the YAML has them)."""
    async with (
        run_gateway(gateway_settings(providers, models, **extra)) as gateway,
        AsyncExitStack() as stack,
    ):
        yield Clients(gateway, stack)

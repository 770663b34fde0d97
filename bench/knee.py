"""Does routing pile onto a small provider without `/metrics`? The concurrency knee, measured.

One model on two OpenAI-type deployments, each a simulated server on loopback in this process:
a small one (4 batch slots, 20 ms to the first token when a slot is free, ~800 ms a stream),
weighted 9:1 over a big one (64 slots, 80 ms). The gateway is first shown the small one's knee
(three bursts of 12 straight to it), its window (5 s) is let empty, then `--clients` clients
stream `--rounds` requests each through model `m` with a 200 ms TTFT budget. Reported: the most
requests the small one held at once, the share it served, and the share of first tokens within
the budget, with TTFT p50/p99.

    .venv/bin/python bench/knee.py [--clients 16] [--rounds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import httpx
import orjson
import uvicorn

from gateway.api import create_app
from gateway.config import build_settings
from gateway.sim.engine import SimEngine
from gateway.sim.profile import SimProfile
from gateway.sim.server import create_sim_app

SLOTS = 4
SMALL = SimProfile(max_batch=SLOTS, prefill_base_ms=20, tokens_per_s=25, output_tokens=20)
BIG = SimProfile(max_batch=64, prefill_base_ms=80, tokens_per_s=25, output_tokens=20)
BUDGET_MS = 200


@asynccontextmanager
async def serve(app: Any) -> AsyncIterator[str]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:  # noqa: ASYNC110 - uvicorn exposes only a flag
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task


class Counted:
    """A simulated server that counts the chat requests it holds at once, and the most."""

    def __init__(self, profile: SimProfile, seed: int) -> None:
        self.inner = create_sim_app(SimEngine({}, profile, seed=seed))
        self.open = self.most = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        chat = scope["type"] == "http" and scope["path"].endswith("/chat/completions")
        self.open += chat
        self.most = max(self.most, self.open)
        try:
            await self.inner(scope, receive, send)
        finally:
            self.open -= chat


async def ask(client: httpx.AsyncClient, url: str, model: str) -> tuple[str, float | None]:
    body = {"model": model, "stream": True, "messages": [{"role": "user", "content": "Hi."}]}
    started, ttft = time.perf_counter(), None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if ttft is None and line.startswith("data: {"):
                event = orjson.loads(line[6:])
                if any((c.get("delta") or {}).get("content") for c in event.get("choices") or ()):
                    ttft = time.perf_counter() - started
        return resp.headers.get("x-tailguard-deployment", ""), ttft


async def main(clients: int, rounds: int) -> None:
    small, big = Counted(SMALL, 1), Counted(BIG, 2)
    async with AsyncExitStack() as stack:
        small_url = await stack.enter_async_context(serve(small))
        big_url = await stack.enter_async_context(serve(big))
        deployment = {"provider": "small", "model": "s"}
        settings = build_settings(
            {
                "providers": {
                    "small": {"type": "openai", "base_url": small_url + "/v1"},
                    "big": {"type": "openai", "base_url": big_url + "/v1"},
                },
                "models": [
                    {
                        "name": "m",
                        "deployments": [
                            {**deployment, "weight": 9},
                            {"provider": "big", "model": "b"},
                        ],
                        "budget": {"ttft_ms": BUDGET_MS},
                        "on_ttft_miss": "none",
                    },
                    {"name": "only-small", "deployments": [deployment]},
                ],
                "latency": {"window_s": 5, "slice_s": 1},
            }
        )
        url = await stack.enter_async_context(serve(create_app(settings)))
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=100)
        client = await stack.enter_async_context(httpx.AsyncClient(timeout=60, limits=limits))
        for _ in range(3):
            await ask(client, url, "only-small")
        for _ in range(3):
            await asyncio.gather(*(ask(client, url, "only-small") for _ in range(12)))
        await asyncio.sleep(7.0)  # the window (5 s, in 1 s slices) lets go of the bursts
        small.most = small.open

        async def loop() -> list[tuple[str, float | None]]:
            return [await ask(client, url, "m") for _ in range(rounds)]

        answers = [
            a for one in await asyncio.gather(*(loop() for _ in range(clients))) for a in one
        ]
    ttfts = sorted(t * 1000 for _, t in answers if t is not None)
    on_small = sum(d == "small/s" for d, _ in answers)
    within = sum(t <= BUDGET_MS for t in ttfts)
    p99 = ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]
    print(
        f"{len(answers)} requests from {clients} clients: most at once on the small one "
        f"{small.most} (slots {SLOTS}); served there {on_small / len(answers):.0%}; "
        f"TTFT within {BUDGET_MS} ms {within / len(answers):.0%}; "
        f"p50 {statistics.median(ttfts):.0f} ms, p99 {p99:.0f} ms"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    asyncio.run(main(args.clients, args.rounds))

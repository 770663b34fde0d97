"""Recovery after an outage: the gateway against a plain proxy, on one upstream that goes away.

One process, loopback only, bounded (about `--up-s + --down-s + --after-s` seconds): an upstream
that streams a short answer, a gateway with one model on it (one deployment, default cooldowns),
and an open-loop client that sends each request at a fixed rate both straight to the upstream
(what a plain proxy would get) and through the gateway. The upstream refuses connections (its
port closed) for `--down-s`, then is back. Printed per arm: requests, client errors, errors after
the upstream came back, and the recovery time (from the upstream's return to the arm's first
success), plus the gateway's errors by code.

    python bench/recovery.py [--rate 8] [--up-s 2] [--down-s 8] [--after-s 4]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from gateway.tools.stack import Stack, start_gateway

ANSWER = (
    b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"x",'
    b'"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}\n\n'
    b"data: [DONE]\n\n"
)
BODY = orjson.dumps(
    {"model": "m", "stream": True, "messages": [{"role": "user", "content": "Say something."}]}
)


class Upstream:
    """A streaming upstream on a fixed loopback port that can close its port and open it again."""

    def __init__(self) -> None:
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            await reader.readexactly(length)
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n" % len(ANSWER) + ANSWER
            )
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


@asynccontextmanager
async def gateway(upstream_port: int) -> AsyncIterator[str]:
    """`tailguard serve`, as deployed, with one model on the upstream; its base URL."""
    config = {
        "providers": {"p": {"type": "openai", "base_url": f"http://127.0.0.1:{upstream_port}/v1"}},
        "models": [{"name": "m", "deployments": [{"provider": "p", "model": "x"}]}],
        "server": {"access_log": False},
    }
    with tempfile.TemporaryDirectory() as logs:
        stack = Stack(logs=Path(logs))
        try:
            # In a thread: start-up waits on /healthz while this loop serves the upstream.
            port, _ = await asyncio.to_thread(start_gateway, stack, config)
            yield f"http://127.0.0.1:{port}"
        finally:
            stack.stop()


@dataclass
class Arm:
    """What one arm's client saw: (send time, ok, error code) per request."""

    seen: list[tuple[float, bool, str]] = field(default_factory=list)

    def summary(self, back_at: float) -> dict[str, Any]:
        after = [s for s in self.seen if s[0] >= back_at]
        first_ok = min((t for t, ok, _ in after if ok), default=None)
        return {
            "requests": len(self.seen),
            "errors": sum(not ok for _, ok, _ in self.seen),
            "errors_after_back": sum(not ok for _, ok, _ in after),
            "recovery_s": None if first_ok is None else round(first_ok - back_at, 3),
            "codes": dict(Counter(code for _, ok, code in self.seen if not ok)),
        }


async def send(client: httpx.AsyncClient, url: str, arm: Arm, at: float) -> None:
    code = ""
    try:
        answer = await client.post(url, content=BODY, headers={"content-type": "application/json"})
        ok = answer.status_code == 200 and b"[DONE]" in answer.content
        if not ok:
            code = str(answer.status_code)
            if answer.headers.get("content-type", "").startswith("application/json"):
                code += " " + str(answer.json().get("error", {}).get("code"))
    except httpx.HTTPError as error:
        ok, code = False, type(error).__name__
    arm.seen.append((at, ok, code))


async def run(rate: float, up_s: float, down_s: float, after_s: float) -> None:
    upstream = Upstream()
    await upstream.start()
    plain, tailguard = Arm(), Arm()
    async with (
        gateway(upstream.port) as gw,
        httpx.AsyncClient(timeout=10, limits=httpx.Limits(max_connections=200)) as client,
    ):
        direct_url = f"http://127.0.0.1:{upstream.port}/v1/chat/completions"
        gateway_url = gw + "/v1/chat/completions"
        start = time.perf_counter()
        down_at, back_at = start + up_s, start + up_s + down_s
        end = back_at + after_s
        state, tasks, n = "up", [], 0
        while True:
            at = start + n / rate
            if at >= end:
                break
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            now = time.perf_counter()
            if state == "up" and now >= down_at:
                await upstream.stop()
                state = "down"
            elif state == "down" and now >= back_at:
                await upstream.start()
                state = "back"
            tasks.append(asyncio.create_task(send(client, direct_url, plain, now)))
            tasks.append(asyncio.create_task(send(client, gateway_url, tailguard, now)))
            n += 1
        await asyncio.gather(*tasks)
    await upstream.stop()
    print(f"outage: port closed for {down_s:g} s at {rate:g} requests/s ({n} requests per arm)")
    print(f"{'arm':<14}{'requests':>9}{'errors':>8}{'after back':>12}{'recovery s':>12}  codes")
    for name, arm in (("plain proxy", plain), ("tailguard", tailguard)):
        row = arm.summary(back_at)
        print(
            f"{name:<14}{row['requests']:>9}{row['errors']:>8}{row['errors_after_back']:>12}"
            f"{row['recovery_s']!s:>12}  {row['codes']}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=8.0, help="requests per second per arm")
    parser.add_argument("--up-s", type=float, default=2.0, help="seconds before the outage")
    parser.add_argument("--down-s", type=float, default=8.0, help="seconds the port is closed")
    parser.add_argument("--after-s", type=float, default=4.0, help="seconds after it is back")
    args = parser.parse_args()
    asyncio.run(run(args.rate, args.up_s, args.down_s, args.after_s))


if __name__ == "__main__":
    main()

"""What a key is charged for a continued conversation, and how long the gateway's event loop is
held by the largest token-counting bodies.

Setup. A `tailguard sim` upstream whose model writes `--turn-tokens` tokens, and one
`tailguard serve` gateway (an `openai`-type deployment: counting answers with the gateway's own
estimate, so all the counting work is the gateway's), with two keys: `big` (tpm 1,000,000, to
read one charge from `x-ratelimit-remaining-tokens`) and `small` (tpm 20,000, for the burst).

1. Charge. `big` stores a turn, waits for its bucket to refill, then sends
   `{"input": "and?", "previous_response_id": <the turn>, "max_output_tokens": 16}`: the charge
   is the limit less the remaining tokens the answer reports, next to the usage it reports.
2. Burst (skipped with `--quick`). `small` stores a turn, waits 61 s for its bucket to refill,
   then sends ten such continuations at once: how many are admitted, and the tokens they used.
3. Loop. While one body is posted, a client polls `/healthz` back to back: the largest
   `/healthz` latency, per body: `--items` input items (default 250,000, about 8.5 MB) to
   either counting endpoint, the largest count body within the default bound, and a chat body
   of as many messages (the LLM endpoints' bound is the body size alone).

    .venv/bin/python bench/charges.py --quick      # ~15 s
    .venv/bin/python bench/charges.py              # ~80 s

Run it against another checkout by putting that checkout first on PYTHONPATH (the servers are
started with this interpreter and that environment).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from gateway.admission.auth import new_key
from gateway.tools.stack import Stack, start_gateway, start_sim

BIG, BIG_HASH = new_key()
SMALL, SMALL_HASH = new_key()
ITEM = {"role": "user", "content": "hello"}


def config(sim_port: int, turn_tokens: int) -> dict[str, Any]:
    base = f"http://127.0.0.1:{sim_port}/v1"
    return {
        "providers": {"up": {"type": "openai", "base_url": base}},
        "models": [
            {
                "name": "m",
                "deployments": [{"provider": "up", "model": f"m@output_tokens={turn_tokens}"}],
            }
        ],
        "auth": {
            "keys": [
                {"name": "big", "sha256": BIG_HASH, "tpm": 1_000_000},
                {"name": "small", "sha256": SMALL_HASH, "tpm": 20_000},
            ]
        },
        "server": {"access_log": False},
    }


async def respond(
    http: aiohttp.ClientSession, url: str, key: str, **body: Any
) -> tuple[int, dict[str, Any], dict[str, str]]:
    async with http.post(
        url + "/v1/responses",
        json={"model": "m", **body},
        headers={"authorization": f"Bearer {key}"},
    ) as answer:
        return answer.status, await answer.json(), dict(answer.headers)


def used(body: dict[str, Any]) -> int:
    usage = body.get("usage") or {}
    return int(usage.get("input_tokens", 0)) + int(usage.get("output_tokens", 0))


async def charge(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    status, first, _ = await respond(http, url, BIG, input="Tell me a long story.")
    assert status == 200, first
    await asyncio.sleep(2.0)  # 1,000,000 tpm refills ~16,700 tokens a second: full again
    status, second, headers = await respond(
        http, url, BIG, input="and?", previous_response_id=first["id"], max_output_tokens=16
    )
    assert status == 200, second
    limit = int(headers["x-ratelimit-limit-tokens"])
    return {
        "turn_used_tokens": used(first),
        "continuation_charged_tokens": limit - int(headers["x-ratelimit-remaining-tokens"]),
        "continuation_used_tokens": used(second),
    }


async def burst(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    status, first, _ = await respond(http, url, SMALL, input="Tell me a long story.")
    assert status == 200, first
    await asyncio.sleep(61.0)  # the turn's tokens refill
    answers = await asyncio.gather(
        *(
            respond(
                http,
                url,
                SMALL,
                input="and?",
                previous_response_id=first["id"],
                max_output_tokens=16,
            )
            for _ in range(10)
        )
    )
    admitted = [body for status, body, _ in answers if status == 200]
    return {
        "tpm": 20_000,
        "turn_used_tokens": used(first),
        "admitted": len(admitted),
        "refused": [status for status, _, _ in answers if status != 200],
        "admitted_used_tokens": sum(used(body) for body in admitted),
    }


async def held(http: aiohttp.ClientSession, url: str, path: str, body: bytes) -> dict[str, Any]:
    """The largest /healthz latency while `body` is posted to `path`."""
    headers = {"authorization": f"Bearer {BIG}", "content-type": "application/json"}
    started = time.perf_counter()

    async def post() -> tuple[int, float]:
        async with http.post(url + path, data=body, headers=headers) as answer:
            await answer.read()
            return answer.status, time.perf_counter() - started

    task = asyncio.ensure_future(post())
    worst = 0.0
    polls = 0
    while not task.done():
        sent = time.perf_counter()
        async with http.get(url + "/healthz") as health:
            await health.read()
        worst = max(worst, time.perf_counter() - sent)
        polls += 1
    status, took = await task
    return {
        "path": path,
        "body_bytes": len(body),
        "status": status,
        "request_s": round(took, 3),
        "healthz_polls": polls,
        "healthz_max_ms": round(worst * 1000, 1),
    }


async def loop(http: aiohttp.ClientSession, url: str, items: int) -> list[dict[str, Any]]:
    within = 24_000  # 4 commas and colons an item: about the most the default bound allows
    bodies = [
        ("/v1/responses/input_tokens", {"model": "m", "input": [ITEM] * items}),
        ("/v1/messages/count_tokens", {"model": "m", "messages": [ITEM] * items}),
        ("/v1/responses/input_tokens", {"model": "m", "input": [ITEM] * within}),
        ("/v1/messages/count_tokens", {"model": "m", "messages": [ITEM] * within}),
        ("/v1/chat/completions", {"model": "m", "messages": [ITEM] * items, "max_tokens": 1}),
    ]
    return [await held(http, url, path, orjson.dumps(body)) for path, body in bodies]


async def run(args: argparse.Namespace, url: str) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        result: dict[str, Any] = {"charge": await charge(http, url)}
        if not args.quick:
            result["burst"] = await burst(http, url)
        result["loop"] = await loop(http, url, args.items)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip the 61 s burst")
    parser.add_argument("--items", type=int, default=250_000)
    parser.add_argument("--turn-tokens", type=int, default=15_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as logs:
        stack = Stack(Path(logs))
        try:
            sim = start_sim(stack, {})
            port, _ = start_gateway(stack, config(sim, args.turn_tokens))
            result = asyncio.run(run(args, f"http://127.0.0.1:{port}"))
        finally:
            stack.stop()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""The spill benchmark's burst part: does a burst after an idle spell herd onto one server?

Three local "vLLM" servers (`tailguard sim`, `BURST_SLOTS` batch slots each, ~1 s per request)
behind one model, each a provider of type `vllm` read every 0.5 s, in front of their own
`tailguard serve`. A first wave of `2 x total slots` concurrent requests fills them (the gateway
learns their slots and latencies); then nothing, until every server's `/metrics` reads empty and
the gateway has read that (`IDLE_INTERVALS` scrape intervals more); then a burst of the same size,
sent at once, well within one scrape interval. Each request has a prompt of its own (no two share
a prefix for cache-aware routing to follow). Reported per server: its share of each wave, against
its fair share by slots; the burst passes when no server takes more than its share plus
`BURST_SLACK`.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from typing import Any, Final

import aiohttp

from bench._harness import ROOT, stream_chat_body
from bench._spill_setup import KEEPALIVE_S, METRICS_INTERVAL_S, REQUEST_TIMEOUT_S, start_sim
from gateway.latency.vllm import parse_metrics
from gateway.tools.stack import Stack, free_port, start_gateway
from gateway.tools.stream import StreamReader

BURST_MODEL: Final = "pool"
BURST_SERVERS: Final = 3
BURST_SLOTS: Final = 4
BURST_TOKENS: Final = 32
BURST_SLACK: Final = 0.20  # share points a server may take beyond its fair share
IDLE_INTERVALS: Final = 3  # scrape intervals waited once every page reads empty
BURST_PROFILE: Final[dict[str, Any]] = {
    "max_batch": BURST_SLOTS,
    "prefill_base_ms": 40,
    "ttft_tail": "lognormal",
    "ttft_sigma": 0.2,
    "tokens_per_s": 40,
    "output_tokens": BURST_TOKENS,
}


def burst_config(port: int, upstreams: dict[str, int]) -> dict[str, Any]:
    providers = {
        name: {
            "type": "vllm",
            "base_url": f"http://127.0.0.1:{upstream}/v1",
            "metrics_interval_s": METRICS_INTERVAL_S,
        }
        for name, upstream in upstreams.items()
    }
    return {
        "server": {"host": "127.0.0.1", "port": port, "access_log": False},
        "latency": {"store": "memory"},
        "providers": providers,
        "models": [
            {
                "name": BURST_MODEL,
                "deployments": [{"provider": name, "model": "llama"} for name in upstreams],
            }
        ],
    }


async def one(session: aiohttp.ClientSession, url: str, index: int) -> str:
    """One streamed request read to its end; the deployment that served it (or the error)."""
    prompt = f"Request {index} at {time.time_ns()}: why do queues make first tokens late?"
    body = stream_chat_body(BURST_MODEL, BURST_TOKENS, prompt)
    reader = StreamReader(errors_only_after_first=True)
    try:
        async with session.post(
            url, data=body, headers={"content-type": "application/json"}
        ) as response:
            served = response.headers.get("x-tailguard-deployment") or f"status {response.status}"
            async for data in response.content.iter_any():
                reader.feed(data, time.perf_counter())
    except (aiohttp.ClientError, TimeoutError) as exc:
        return f"error {type(exc).__name__}"
    return served if reader.done and reader.error is None else f"error {reader.error}"


async def idle(session: aiohttp.ClientSession, metrics_urls: list[str]) -> None:
    """Until every server's page reads empty, then `IDLE_INTERVALS` intervals for the gateway."""
    while True:
        loads = []
        for url in metrics_urls:
            async with session.get(url) as response:
                loads.append(parse_metrics(await response.text()))
        if all(load.running == 0 and load.waiting == 0 for load in loads):
            break
        await asyncio.sleep(METRICS_INTERVAL_S / 5)
    await asyncio.sleep(IDLE_INTERVALS * METRICS_INTERVAL_S)


async def waves(gateway_url: str, metrics_urls: list[str], n: int) -> list[Counter[str]]:
    """The first wave (to learn from), the idle spell, then the burst: who served each."""
    url = gateway_url + "/v1/chat/completions"
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    out: list[Counter[str]] = []
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for wave in range(2):
            await idle(session, metrics_urls)
            served = await asyncio.gather(*(one(session, url, wave * n + i) for i in range(n)))
            out.append(Counter(served))
    return out


def run_burst(pin: dict[str, list[str]], logs: Path, seed: int) -> dict[str, Any]:
    names = [f"gpu{index}" for index in range(BURST_SERVERS)]
    stack = Stack(logs=logs, pin=pin, cwd=ROOT)
    n = 2 * BURST_SLOTS * BURST_SERVERS
    try:
        ports = {name: free_port() for name in names}
        for index, name in enumerate(names):
            start_sim(stack, name, ports[name], BURST_PROFILE, seed + index)
        gateway_port = free_port()
        config = burst_config(gateway_port, ports)
        start_gateway(stack, config, gateway_port)
        metrics = [f"http://127.0.0.1:{ports[name]}/metrics" for name in names]
        first, burst = asyncio.run(waves(f"http://127.0.0.1:{gateway_port}", metrics, n))
    finally:
        stack.stop()
    fair = 1 / BURST_SERVERS  # equal slots
    return {
        "servers": BURST_SERVERS,
        "slots_each": BURST_SLOTS,
        "requests": n,
        "fair_share": fair,
        "first_wave": {f"{name}/llama": first[f"{name}/llama"] / n for name in names},
        "burst": {f"{name}/llama": burst[f"{name}/llama"] / n for name in names},
        "other_outcomes": {
            key: count
            for wave in (first, burst)
            for key, count in wave.items()
            if not key.endswith("/llama")
        },
        "config": config,
    }


def burst_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    limit = result["fair_share"] + BURST_SLACK
    worst = max(result["burst"].values())
    return [
        {
            "target": f"burst after idle: no server over its share + {BURST_SLACK:.0%} "
            f"(<= {limit:.0%})",
            "value": worst,
            "pass": worst <= limit and not result["other_outcomes"],
        }
    ]


def burst_report(result: dict[str, Any]) -> None:
    fair = result["fair_share"]
    print(
        f"\nburst: {result['servers']} servers x {result['slots_each']} slots, "
        f"{result['requests']} requests at once (first wave, then again after an idle spell)"
    )
    print()
    print("| server | slots | fair share | first wave | burst after idle | verdict |")
    print("|---|---:|---:|---:|---:|---|")
    for server, share in result["burst"].items():
        verdict = "PASS" if share <= fair + BURST_SLACK else "MISS"
        print(
            f"| {server} | {result['slots_each']} | {fair:.1%} "
            f"| {result['first_wave'][server]:.1%} | {share:.1%} | {verdict} |"
        )
    if result["other_outcomes"]:
        print(f"not served by a server: {result['other_outcomes']}")

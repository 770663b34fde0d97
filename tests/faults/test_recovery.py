"""After an outage the gateway is no worse than no gateway.

The breaker routes around a failing deployment; when there is nowhere else to go it does not
refuse: requests go to the deployment one at a time, each as its probe, so the first request after
the upstream is back is served. Each case sends the same request sequence straight to the upstream
(what a plain proxy would get) and through the gateway, and compares the client errors. Recovery
is an event (the upstream's switch flipped), never a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import httpx
import orjson
import pytest

from gateway.config import Settings
from tests.conftest import gateway_settings, run_gateway
from tests.faults.conftest import chat, routed, settled
from tests.faults.wire import DONE, Exchange, RawUpstream, sse_token

Fault = Literal["refused", "503"]
NO_ACCESS_LOG = {"server": {"access_log": False}}


@dataclass
class Switch:
    """Whether the upstream is up; while down it answers 503 (or its port is closed)."""

    up: bool = True


def switched(switch: Switch) -> Any:
    async def script(exchange: Exchange) -> None:
        await exchange.read_request()
        if not switch.up:
            body = orjson.dumps({"error": {"message": "down", "type": "server_error"}})
            await exchange.respond(503, body)
            return
        await exchange.start_stream()
        await exchange.chunk(sse_token("hi"))
        await exchange.chunk(DONE)
        await exchange.end_chunks()

    return script


async def go_down(up: RawUpstream, switch: Switch, fault: Fault) -> None:
    switch.up = False
    if fault == "refused":
        up.stop_listening()


async def come_back(up: RawUpstream, switch: Switch, fault: Fault) -> None:
    switch.up = True
    if fault == "refused":
        await up.listen_again()


async def direct(client: httpx.AsyncClient, up: RawUpstream) -> int:
    """The request sent straight to the upstream, as a plain proxy would: its status, 0 when
    the connection was refused."""
    try:
        answer = await client.post(up.base_url + "/chat/completions", json=chat("x", stream=True))
    except httpx.ConnectError:
        return 0
    return answer.status_code


async def through(client: httpx.AsyncClient, url: str, codes: list[str]) -> int:
    """The request sent through the gateway: its status (error codes are collected)."""
    answer = await client.post(url + "/v1/chat/completions", json=chat(stream=True))
    if answer.status_code != 200:
        codes.append(answer.json()["error"]["code"] or "")
    return answer.status_code


@pytest.mark.parametrize("fault", ["refused", "503"])
async def test_a_single_deployment_recovers_with_no_more_errors_than_a_plain_proxy(
    client: httpx.AsyncClient, fault: Fault
) -> None:
    """Down long enough for the breaker to open (3 failures) and then some, then back: every
    request through the gateway meets the upstream itself (no `deployments_cooling_down`), the
    first one after the upstream is back is served, and the gateway's client errors are no more
    than those of the same requests sent straight to the upstream (the default cooldown, 5 s,
    once refused them all until it ended)."""
    switch = Switch()
    async with RawUpstream(switched(switch)) as up, run_gateway(routed(up.base_url, "x")) as gw:
        plain: list[int] = []
        gateway: list[int] = []
        codes: list[str] = []
        await go_down(up, switch, fault)
        for _ in range(6):
            plain.append(await direct(client, up))
            gateway.append(await through(client, gw.url, codes))
        await come_back(up, switch, fault)
        first_back = await through(client, gw.url, codes)
        plain.append(await direct(client, up))
        gateway.append(first_back)
        for _ in range(2):
            plain.append(await direct(client, up))
            gateway.append(await through(client, gw.url, codes))
        await settled(up.url)
    assert first_back == 200
    assert "deployments_cooling_down" not in codes
    assert sum(s != 200 for s in gateway) <= sum(s != 200 for s in plain) == 6
    assert gateway[6:] == [200, 200, 200]


def two_deployments(one: RawUpstream, two: RawUpstream, **extra: Any) -> Settings:
    """Model `m` on two deployments, `p/x` at `one` and `q/x` at `two`."""
    return gateway_settings(
        {
            "p": {"type": "openai", "base_url": one.base_url},
            "q": {"type": "openai", "base_url": two.base_url},
        },
        [
            {
                "name": "m",
                "deployments": [{"provider": "p", "model": "x"}, {"provider": "q", "model": "x"}],
            }
        ],
        **NO_ACCESS_LOG,
        **extra,
    )


async def test_a_model_whose_every_deployment_is_down_recovers_at_once(
    client: httpx.AsyncClient,
) -> None:
    """A model with two deployments, both down until the breaker opens on each: the requests
    are still sent (each deployment probed, one request at a time), and once one deployment is
    back the next request is served by it."""
    first, second = Switch(up=False), Switch(up=False)
    async with RawUpstream(switched(first)) as one, RawUpstream(switched(second)) as two:
        settings = two_deployments(one, two)
        async with run_gateway(settings) as gw:
            codes: list[str] = []
            outage = [await through(client, gw.url, codes) for _ in range(8)]
            sent = one.requests + two.requests
            await come_back(two, second, "503")
            back = await client.post(gw.url + "/v1/chat/completions", json=chat(stream=True))
            await settled(one.url, two.url)
    assert outage == [503] * 8  # the upstreams' own answer, every time
    assert "deployments_cooling_down" not in codes
    assert sent >= 8  # every request met an upstream
    assert back.status_code == 200
    assert back.headers["x-tailguard-deployment"] == "q/x"


async def test_a_multi_deployment_model_still_routes_around_a_failing_deployment(
    client: httpx.AsyncClient,
) -> None:
    """With a healthy deployment beside it, a failing one is routed around once its breaker
    opens: it is not sent requests (nor probed before its cooldown ends), and every request is
    served by the healthy one."""
    failing, healthy = Switch(up=False), Switch()
    async with RawUpstream(switched(failing)) as one, RawUpstream(switched(healthy)) as two:
        settings = two_deployments(
            one, two, routing={"cooldown": {"failures": 1, "base_s": 60, "probe_interval_s": 60}}
        )
        async with run_gateway(settings) as gw:
            answers = [
                await client.post(gw.url + "/v1/chat/completions", json=chat(stream=True))
                for _ in range(12)
            ]
            await settled(one.url, two.url)
    assert [a.status_code for a in answers] == [200] * 12
    assert {a.headers["x-tailguard-deployment"] for a in answers} == {"q/x"}
    assert one.requests <= 1  # tried at most once (when the weights drew it first), then not
    assert two.requests == 12

"""GET /metrics exposes what `bench/soak.py` watches for leaks: the event loop's task count and
the process's resident memory and open descriptors, all read at scrape time."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import httpx
import pytest

from gateway.telemetry import exposition, make_registry
from tests.conftest import Upstream, one_model, run_gateway
from tests.telemetry.test_metrics import Scrape, scrape, scrape_when
from tests.timing import scaled

TASKS = "tailguard_event_loop_tasks"
RSS = "process_resident_memory_bytes"
FDS = "process_open_fds"
STALLED = 4  # requests held open at the upstream at once

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/status").exists(), reason="the process metrics read /proc"
)


def vm_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


async def test_process_and_task_gauges_have_sane_values(
    upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """The gauges are there, typed as gauges, and agree with /proc: this process's resident
    memory and descriptors (the gateway runs in the test's process) and at least the task
    serving the scrape."""
    async with run_gateway(one_model(upstream.base_url)) as gw:
        found = await scrape(client, gw.url)
        rss_now = vm_rss_bytes()
        fds_now = len(os.listdir("/proc/self/fd"))

    assert found.families[TASKS].type == "gauge"
    assert found.value(TASKS) >= 1
    assert found.families[RSS].type == "gauge"
    assert 0.5 * rss_now <= found.value(RSS) <= 2 * rss_now
    assert found.families[FDS].type == "gauge"
    # A few descriptors may open or close between the scrape and the listing.
    assert abs(found.value(FDS) - fds_now) <= 8
    assert 0 < found.value(FDS) <= found.value("process_max_fds")


async def test_task_gauge_follows_requests_in_flight_and_returns_to_idle(
    upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """Requests held at a stalled upstream raise the task count by at least one each; once
    their clients leave and the upstream has seen them go, it falls back to its idle value."""
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
    async with run_gateway(one_model(upstream.base_url, "m@stall_rate=1")) as gw:
        idle = (await scrape(client, gw.url)).value(TASKS)
        requests = [
            asyncio.create_task(client.post(gw.base_url + "/chat/completions", json=body))
            for _ in range(STALLED)
        ]
        async with asyncio.timeout(scaled(5)):
            await upstream.stats.wait_for(lambda s: s.requests == STALLED)
        busy = (await scrape(client, gw.url)).value(TASKS)
        for request in requests:
            request.cancel()
        await asyncio.gather(*requests, return_exceptions=True)
        async with asyncio.timeout(scaled(5)):
            await upstream.stats.wait_for(lambda s: s.cancelled == STALLED)
        # The gateway ends its request tasks on its own time: poll, within a deadline.
        found = await scrape_when(client, gw.url, lambda s: s.value(TASKS) <= idle)
        rest = found.value(TASKS)

    assert busy >= idle + STALLED
    assert rest <= idle


def test_registry_scraped_outside_an_event_loop_has_no_task_gauge() -> None:
    """A registry made and read with no loop running still exposes the process metrics, and
    simply leaves the task gauge out."""
    found = Scrape(exposition(make_registry()).decode())
    assert TASKS not in found.families
    assert found.value(RSS) > 0

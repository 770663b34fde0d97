"""GET /metrics: the latency store's health in Prometheus format, read at scrape time."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import Upstream, free_port, gateway_settings, run_gateway


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_metrics_show_a_healthy_memory_store(upstream: Upstream) -> None:
    """A memory store is up, with no failures, and in-flight attempts per deployment."""
    settings = gateway_settings(
        {"up": {"type": "vllm", "base_url": upstream.base_url}},
        [{"name": "m", "deployments": [{"provider": "up", "model": "m"}]}],
    )
    async with run_gateway(settings) as gw, httpx.AsyncClient() as client:
        resp = await client.get(gw.url + "/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    found = samples(resp.text)
    assert found[("tailguard_latency_store_up", (("store", "memory"),))] == 1.0
    assert found[("tailguard_latency_store_flush_failures_total", (("store", "memory"),))] == 0.0


async def test_metrics_report_an_unreachable_redis(upstream: Upstream) -> None:
    """With Redis unreachable, the store is reported down and its failures counted; requests
    are still served."""
    settings = gateway_settings(
        {"up": {"type": "vllm", "base_url": upstream.base_url}},
        [{"name": "m", "deployments": [{"provider": "up", "model": "m"}]}],
        latency={"store": "redis", "redis_url": f"redis://127.0.0.1:{free_port()}/0"},
    )
    async with run_gateway(settings) as gw, httpx.AsyncClient() as client:
        served = await client.post(
            gw.base_url + "/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        )
        resp = await client.get(gw.url + "/metrics")
        ready = await client.get(gw.url + "/readyz")
    assert served.status_code == 200
    found = samples(resp.text)
    assert found[("tailguard_latency_store_up", (("store", "redis"),))] == 0.0
    assert found[("tailguard_latency_store_refresh_failures_total", (("store", "redis"),))] >= 1
    assert ready.status_code == 200
    assert ready.json()["latency_store"]["state"] == "degraded"

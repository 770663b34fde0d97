"""Operational faults: the trace collector down or hung, a broken config file, a shutdown with
streams still open. None of them may slow, break or hang what is being served.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

import httpx
import orjson
import pytest

from tests.conftest import Upstream, free_port, gateway_settings, run_gateway
from tests.faults.conftest import chat, routed, settled
from tests.faults.wire import Exchange, RawUpstream
from tests.runtime.test_operations import config, gateway_from, write
from tests.timing import eventually, scaled

# --- the trace collector -------------------------------------------------------------------------


async def served(client: httpx.AsyncClient, url: str, n: int) -> list[float]:
    """`n` streamed and `n` plain requests, alternating; each must succeed. Their durations."""
    durations = []
    for i in range(2 * n):
        stream = i % 2 == 0
        started = time.perf_counter()
        resp = await client.post(url + "/v1/chat/completions", json=chat(stream=stream))
        durations.append(time.perf_counter() - started)
        assert resp.status_code == 200
        assert resp.text.rstrip().endswith("data: [DONE]") if stream else resp.json()["choices"]
    return durations


OTLP_LOGGER = "opentelemetry.exporter.otlp"


async def black_hole(exchange: Exchange) -> None:
    """A collector that accepts connections and never answers."""
    await exchange.until_closed()


@pytest.mark.parametrize("collector", ["closed-port", "black-hole"])
async def test_collector_down_costs_requests_nothing(
    upstream: Upstream,
    client: httpx.AsyncClient,
    caplog: pytest.LogCaptureFixture,
    collector: str,
) -> None:
    """With the OTLP collector's port closed, or a collector that accepts and never answers,
    requests are as fast as without tracing, the loop is never blocked by an export (the
    watchdog), and the gateway still shuts down promptly (the last flush is bounded)."""
    settings = routed(upstream.base_url, "m")
    async with run_gateway(settings, environ={}) as gw:
        untraced = await served(client, gw.url, 10)
    async with RawUpstream(black_hole) as hole:
        port = free_port() if collector == "closed-port" else int(hole.url.rsplit(":", 1)[1])
        environ = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
            "OTEL_EXPORTER_OTLP_TIMEOUT": "300",  # milliseconds
            "OTEL_BSP_SCHEDULE_DELAY": "20",  # export while the requests run
            "TAILGUARD_TRACES_TAIL_RATIO": "1",  # every trace: exports are attempted
        }
        async with run_gateway(settings, environ=environ) as gw:
            traced_durations = await served(client, gw.url, 10)
            # Exports were attempted (and failed) while the gateway was serving.
            if collector == "black-hole":
                await hole.wait_for(lambda h: h.accepted >= 1)
            else:
                await eventually(
                    lambda: any(r.name.startswith(OTLP_LOGGER) for r in caplog.records)
                )
            stopping = time.perf_counter()
        stopped = time.perf_counter() - stopping
    base, now = statistics.median(untraced), statistics.median(traced_durations)
    assert now <= base + 0.025, (untraced, traced_durations)
    assert stopped < 2.0


# --- a broken config file ------------------------------------------------------------------------

BROKEN = {
    "not-yaml": "models: [this is: not valid",
    "fallback-cycle": orjson.dumps(
        {
            "providers": {"sim": {"type": "simulated"}},
            "models": [
                {
                    "name": "a",
                    "deployments": [{"provider": "sim", "model": "a"}],
                    "fallbacks": ["b"],
                },
                {
                    "name": "b",
                    "deployments": [{"provider": "sim", "model": "b"}],
                    "fallbacks": ["a"],
                },
            ],
        }
    ).decode(),  # JSON is YAML
    "deleted": "",
}


@pytest.mark.parametrize("broken", list(BROKEN))
async def test_invalid_config_reload_keeps_the_old_config_serving(
    tmp_path: Path, client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture, broken: str
) -> None:
    """A config file replaced by one that cannot be used (not YAML, a fallback cycle, or gone)
    is rejected: a stream begun before runs to its end, the old models keep answering, and
    nothing of the rejected config is left behind."""
    path = tmp_path / "gateway.yaml"
    first = config("a=a@tokens_per_s=100,output_tokens=20", access_log=False)
    await asyncio.to_thread(write, path, first)
    body = chat("a", stream=True)
    async with gateway_from(path) as url, asyncio.timeout(scaled(10)):
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            lines = resp.aiter_lines()
            assert (await anext(lines)).startswith("data: ")
            if broken == "deleted":
                await asyncio.to_thread(path.unlink)
            else:
                await asyncio.to_thread(write, path, BROKEN[broken])

            async def rejected() -> bool:
                ready = (await client.get(url + "/readyz")).json()
                return bool(ready["config"]["reload_failures"] >= 1)

            await eventually(rejected)
            rest = [line async for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        after = await client.post(url + "/v1/chat/completions", json=chat("a"))
        assert after.status_code == 200
        models = (await client.get(url + "/v1/models")).json()["data"]
        assert [m["id"] for m in models] == ["a"]
        ready = (await client.get(url + "/readyz")).json()["config"]
    assert ready["reloads"] == 0
    assert any("config reload rejected" in r.getMessage() for r in caplog.records)


# --- shutting down with streams open -------------------------------------------------------------


async def test_shutdown_with_open_streams_ends_them_cleanly(
    upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """On shutdown, a stream still running after the grace period ends with an error event (no
    `[DONE]`), a request still waiting for its first token gets a 503, both upstream requests are
    closed, and the server stops within the grace period plus a little: no hang, no leak."""
    settings = gateway_settings(
        {"p": {"type": "openai", "base_url": upstream.base_url}},
        [
            {
                "name": "m",
                "deployments": [
                    {"provider": "p", "model": "long@tokens_per_s=20,output_tokens=400"}
                ],
            },
            {"name": "waiting", "deployments": [{"provider": "p", "model": "mute@stall_rate=1"}]},
        ],
        server={"access_log": False},
    )
    # With uvicorn's graceful-shutdown timeout, as `tailguard serve` sets it from
    # `server.shutdown_grace_s`; the cancelled-tasks message is expected here.
    async with run_gateway(settings, grace_s=0.3, log_level="critical") as gw:
        streaming_started = asyncio.Event()

        async def long_stream() -> list[str]:
            async with client.stream(
                "POST", gw.url + "/v1/chat/completions", json=chat(stream=True)
            ) as resp:
                lines = []
                async for line in resp.aiter_lines():
                    if line:
                        lines.append(line)
                        streaming_started.set()
                return lines

        streaming = asyncio.create_task(long_stream())
        waiting = asyncio.create_task(
            client.post(gw.url + "/v1/chat/completions", json=chat("waiting", stream=True))
        )
        async with asyncio.timeout(scaled(5)):
            await streaming_started.wait()
            await upstream.stats.wait_for(lambda s: s.requests == 2)
            stopping = time.perf_counter()
            gw.server.should_exit = True
            lines, refused = await asyncio.gather(streaming, waiting)
            answered = time.perf_counter() - stopping
            await upstream.stats.wait_for(lambda s: s.cancelled == 2 and s.open_streams == 0)
    stopped = time.perf_counter() - stopping
    assert answered < 0.3 + 1.0
    assert stopped < 0.3 + 1.5
    assert "data: [DONE]" not in lines
    error = orjson.loads(lines[-1].removeprefix("data: "))["error"]
    assert "shutting down" in error["message"]
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "overloaded"
    await settled(upstream.url)

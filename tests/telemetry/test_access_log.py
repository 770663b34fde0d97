"""The access log: one JSON line per LLM request on the `tailguard.access` logger, never a body.

A line is written when the request's handler finishes, just after the last byte went out, right
after the request is counted in /metrics: a test waits (with a deadline) for the count, then reads
the lines.
"""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from gateway.telemetry import semconv as sc
from tests.conftest import ACCESS, Upstream, gateway_settings, one_model, run_gateway
from tests.telemetry.test_metrics import scrape_when

PROMPT = "Tell me a SECRET-PROMPT story."
CHAT = {"messages": [{"role": "user", "content": PROMPT}]}


def lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [orjson.loads(r.getMessage()) for r in caplog.records if r.name == ACCESS]


async def counted(client: httpx.AsyncClient, url: str, n: int) -> None:
    """Wait until `n` requests are counted in /metrics: a request is counted just before its
    access line would be written, so after this no line can still be on its way."""
    await scrape_when(client, url, lambda s: s.value(sc.REQUESTS + "_total") >= n)


async def test_one_line_per_request_with_the_decision_and_no_prompt(
    upstream: Upstream, client: httpx.AsyncClient, access: pytest.LogCaptureFixture
) -> None:
    """A streamed and a whole answer each get one JSON line with the request id, model,
    deployment, route, status, TTFT, total time and tokens; the prompt is in neither."""
    async with run_gateway(one_model(upstream.base_url)) as gw:
        body = {"model": "m", "stream": True, **CHAT}
        async with client.stream(
            "POST",
            gw.base_url + "/chat/completions",
            json=body,
            headers={"x-request-id": "req-stream-1"},
        ) as resp:
            await resp.aread()
        whole = await client.post(
            gw.base_url + "/chat/completions",
            json={"model": "m", **CHAT},
            headers={"x-request-id": "req-whole-1"},
        )
        await counted(client, gw.url, 2)
        streamed, answered = lines(access)
    assert resp.status_code == 200 and whole.status_code == 200
    assert len(lines(access)) == 2
    for line, request_id, stream in (
        (streamed, "req-stream-1", True),
        (answered, "req-whole-1", False),
    ):
        assert line["request_id"] == request_id
        assert line["path"] == "/v1/chat/completions"
        assert line["model"] == "m"
        assert line["stream"] is stream
        assert line["deployment"] == "up/m"
        assert line["route"] == "primary"
        assert line["attempts"] == 1
        assert line["status"] == 200
        assert line["error"] is None
        assert line["input_tokens"] > 0
        assert line["output_tokens"] == 5
        assert line["total_ms"] > 0
    assert 0 < streamed["ttft_ms"] <= streamed["total_ms"]
    for record in access.records:
        assert "SECRET-PROMPT" not in record.getMessage()


async def test_refused_and_failed_requests_get_a_line(
    upstream: Upstream, client: httpx.AsyncClient, access: pytest.LogCaptureFixture
) -> None:
    """An unknown model (404) and an upstream failure (502) are logged too, with their status and
    error, and the model the client asked for, even the unknown one (cut when it is long)."""
    settings = gateway_settings(
        {"up": {"type": "vllm", "base_url": upstream.base_url}},
        [
            {"name": "m", "deployments": [{"provider": "up", "model": "m"}]},
            {"name": "bad", "deployments": [{"provider": "up", "model": "bad@error_500_rate=1"}]},
        ],
    )
    async with run_gateway(settings) as gw:
        unknown = await client.post(
            gw.base_url + "/chat/completions",
            json={"model": "no-such-model", **CHAT},
            headers={"x-request-id": "req-404"},
        )
        failed = await client.post(
            gw.base_url + "/chat/completions",
            json={"model": "bad", **CHAT},
            headers={"x-request-id": "req-502"},
        )
        huge = await client.post(
            gw.base_url + "/chat/completions",
            json={"model": "x" * 100_000, **CHAT},
            headers={"x-request-id": "req-huge"},
        )
        await counted(client, gw.url, 3)
        found = {line["request_id"]: line for line in lines(access)}
    assert (unknown.status_code, failed.status_code, huge.status_code) == (404, 502, 404)
    assert found["req-404"]["status"] == 404
    assert found["req-404"]["error"] == "model_not_found"
    assert found["req-404"]["model"] == ""  # no configured model: nothing in metrics either
    assert found["req-404"]["requested_model"] == "no-such-model"
    assert found["req-huge"]["requested_model"] == "x" * 256
    assert found["req-502"]["status"] == 502
    assert found["req-502"]["model"] == "bad"
    assert found["req-502"]["error"]
    assert found["req-502"]["deployment"] is None
    for record in access.records:
        assert "SECRET-PROMPT" not in record.getMessage()


async def test_access_log_can_be_turned_off(
    upstream: Upstream, client: httpx.AsyncClient, access: pytest.LogCaptureFixture
) -> None:
    """`server.access_log: false` writes no line, for served and refused requests alike."""
    settings = gateway_settings(
        {"up": {"type": "vllm", "base_url": upstream.base_url}},
        [{"name": "m", "deployments": [{"provider": "up", "model": "m"}]}],
        server={"access_log": False},
    )
    async with run_gateway(settings) as gw:
        served = await client.post(gw.base_url + "/chat/completions", json={"model": "m", **CHAT})
        unknown = await client.post(
            gw.base_url + "/chat/completions", json={"model": "nope", **CHAT}
        )
        await counted(client, gw.url, 2)
    assert (served.status_code, unknown.status_code) == (200, 404)
    assert lines(access) == []


async def test_access_log_setting_is_per_app(
    upstream: Upstream, client: httpx.AsyncClient, access: pytest.LogCaptureFixture
) -> None:
    """Two apps in one process: the one with `access_log: false` does not silence the other."""
    providers = {"up": {"type": "vllm", "base_url": upstream.base_url}}
    models = [{"name": "m", "deployments": [{"provider": "up", "model": "m"}]}]
    logged = gateway_settings(providers, models)
    quiet = gateway_settings(providers, models, server={"access_log": False})
    async with run_gateway(logged) as gw, run_gateway(quiet):
        resp = await client.post(gw.base_url + "/chat/completions", json={"model": "m", **CHAT})
        assert resp.status_code == 200
        await counted(client, gw.url, 1)
    assert len(lines(access)) == 1


async def test_a_serving_process_writes_the_lines_to_stdout(tmp_path: Any) -> None:
    """In `tailguard serve` the lines reach stdout through the writer thread (not the logging
    machinery), one JSON object per request, all written out when the process stops."""
    import signal
    import subprocess

    from tests.conftest import free_port
    from tests.runtime.test_operations import CHAT as SAY
    from tests.runtime.test_operations import config, tailguard_serve, write

    path = tmp_path / "gateway.yaml"
    port = free_port()
    write(path, config("m", reload_on_change=False))
    async with tailguard_serve(path, port, stdout=subprocess.PIPE) as process:
        async with httpx.AsyncClient(timeout=10) as http:
            ids = []
            for _ in range(3):
                reply = await http.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions", json={"model": "m", **SAY}
                )
                assert reply.status_code == 200
                ids.append(reply.headers["x-request-id"])
        process.send_signal(signal.SIGTERM)
        assert process.stdout is not None
        out, _ = process.communicate(timeout=20)
    found = [orjson.loads(line) for line in out.splitlines() if line.startswith(b"{")]
    assert [line["request_id"] for line in found] == ids
    assert all(line["status"] == 200 and line["model"] == "m" for line in found)

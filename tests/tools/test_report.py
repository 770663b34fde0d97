"""`tailguard report`: the latency report written from a running gateway's `/admin/latency` and
`/metrics`, and the per-request stage histogram it reads."""

from __future__ import annotations

import asyncio
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families

from gateway.tools.report import build_report, class_quantiles, render_markdown
from tests.conftest import Upstream, free_port, gateway_settings, run_gateway
from tests.timing import eventually, scaled

STAGES = {"overhead", "queue", "connect", "ttft", "decode", "total"}
# 2 ms of fixed prefill plus 0.02 ms per prompt token (~chars/4): a 20,000-character prompt
# (~5,000 tokens, a 20 KB body: the long class) prefills ~100 ms slower than a short one.
# Five tokens at 100 tokens/s: four 10 ms steps of decode.
SIM = "m@prefill_base_ms=2,prefill_ms_per_token=0.02,tokens_per_s=100,output_tokens=5"
SHORT = "Say something."
LONG = "word " * 4000
BUDGET = {"ttft_ms": 300, "total_ms": 1000}
Body = dict[str, Any]


def settings(upstream: Upstream) -> Any:
    return gateway_settings(
        {"up": {"type": "vllm", "base_url": upstream.base_url}},
        [{"name": "chat", "deployments": [{"provider": "up", "model": SIM}], "budget": BUDGET}],
        latency={"min_samples": 5},
    )


async def send(client: httpx.AsyncClient, url: str, text: str, *, stream: bool = True) -> None:
    body = {"model": "chat", "stream": stream, "messages": [{"role": "user", "content": text}]}
    resp = await client.post(url + "/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text


async def settled(client: httpx.AsyncClient, url: str, n: int, *, within_s: float = 5.0) -> Body:
    """`/admin/latency` once model `chat` shows `n` TTFT samples (the snapshot refreshes about
    every second); fails with the last body after `within_s`."""
    last: list[Body] = []

    async def fetched() -> Body | None:
        body: Body = (await client.get(url + "/admin/latency")).json()
        last[:] = [body]
        model = body["models"].get("chat")
        return body if model is not None and model["ttft_ms"]["count"] == n else None

    return await eventually(fetched, within_s=within_s, what=lambda: f"{n} samples: {last}")


def tailguard(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args], capture_output=True, text=True, timeout=scaled(60)
    )


def stage_samples(text: str) -> dict[tuple[str, str], dict[str, float]]:
    """(model, stage) -> {"count": .., "sum": ..} of the stage histogram in an exposition."""
    out: dict[tuple[str, str], dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "tailguard_stage_duration_seconds":
            continue
        assert family.type == "histogram"
        for sample in family.samples:
            for suffix in ("_count", "_sum"):
                if sample.name.endswith(suffix):
                    key = (sample.labels["model"], sample.labels["stage"])
                    out.setdefault(key, {})[suffix[1:]] = sample.value
    return out


def cells(markdown: str, first: str, after: str | None = None) -> list[str]:
    """The cells of the first Markdown table row whose first cell is `first` (after the line
    that contains `after`, if given)."""
    lines = markdown.splitlines()
    if after is not None:
        lines = lines[next(i for i, line in enumerate(lines) if after in line) :]
    for line in lines:
        parts = [part.strip() for part in line.strip().strip("|").split("|")]
        if line.startswith("|") and parts[0] == first:
            return parts
    raise AssertionError(f"no row {first!r} in:\n{markdown}")


def shown(cell: str) -> float:
    """The number in a rendered cell ("105.7", "1,234", "98.5%")."""
    found = re.search(r"[0-9][0-9,]*(\.[0-9]+)?", cell)
    assert found is not None, cell
    return float(found.group().replace(",", ""))


def same(cell: str, value: float) -> bool:
    """The cell shows `value`, to the precision it is rendered with."""
    return math.isclose(shown(cell), value, rel_tol=0.01, abs_tol=0.06)


# --- the stage histogram --------------------------------------------------------------------------


async def test_stage_histogram_is_on_metrics_per_model_and_stage(upstream: Upstream) -> None:
    """Each answered request adds one observation per stage it went through to
    `tailguard_stage_duration_seconds{model, stage}`: a stream all six, a non-streamed answer
    no TTFT or decode; the scripted prefill and decode show in their stages."""
    async with (
        run_gateway(settings(upstream)) as gw,
        httpx.AsyncClient(timeout=scaled(10)) as client,
    ):
        for _ in range(3):
            await send(client, gw.url, SHORT)
        await send(client, gw.url, SHORT, stream=False)
        text = (await client.get(gw.url + "/metrics")).text
    found = stage_samples(text)
    assert {stage for model, stage in found if model == "chat"} == STAGES
    assert {model for model, _ in found} == {"chat"}
    counts = {stage: found["chat", stage]["count"] for stage in STAGES}
    assert counts == {"overhead": 4, "queue": 4, "connect": 4, "total": 4, "ttft": 3, "decode": 3}
    mean = {stage: found["chat", stage]["sum"] / found["chat", stage]["count"] for stage in STAGES}
    assert mean["ttft"] >= 0.002  # the scripted prefill
    assert mean["decode"] >= 0.02  # four 10 ms steps, measured at the gateway
    assert mean["queue"] == 0  # no bulk gate in the way
    assert found["chat", "total"]["sum"] >= found["chat", "ttft"]["sum"]


# --- the report, end to end -----------------------------------------------------------------------


async def test_report_command_writes_the_latency_report_from_a_live_gateway(
    upstream: Upstream, tmp_path: Path
) -> None:
    """Against a gateway that served short and long prompts, `tailguard report` shows per model
    the long class's TTFT above the short one's, every stage with values next to the budget,
    and what the router did; `--format json` carries the same numbers; `--out` writes the file;
    an unreachable gateway is a one-line error with exit code 1."""
    n = 8
    out = tmp_path / "latency_report.md"
    closed = f"http://127.0.0.1:{free_port()}"
    async with (
        run_gateway(settings(upstream)) as gw,
        httpx.AsyncClient(timeout=scaled(10)) as client,
    ):
        await asyncio.gather(*(send(client, gw.url, SHORT) for _ in range(n)))
        await asyncio.gather(*(send(client, gw.url, LONG) for _ in range(n)))
        latency = await settled(client, gw.url, 2 * n)
        # The gateway serves from this event loop: the commands run in threads meanwhile.
        md, js, written, down = await asyncio.gather(
            asyncio.to_thread(tailguard, "report", "--url", gw.url),
            asyncio.to_thread(tailguard, "report", "--url", gw.url, "--format", "json"),
            asyncio.to_thread(tailguard, "report", "--url", gw.url, "--out", str(out)),
            asyncio.to_thread(tailguard, "report", "--url", closed),
        )
    assert md.returncode == 0, md.stderr
    assert js.returncode == 0, js.stderr
    report = orjson.loads(js.stdout)
    chat = report["models"]["chat"]
    short, long = chat["latency"]["short"], chat["latency"]["long"]
    assert (short["requests"], long["requests"]) == (n, n)
    # ~2 ms of prefill against ~100 ms more for ~5,000 prompt tokens: lower bounds and medians,
    # which a busy machine (slower everywhere, with the odd stall) does not upset.
    assert long["ttft_ms"]["p50"] > 80
    assert long["ttft_ms"]["p50"] > short["ttft_ms"]["p50"] + 50
    assert long["total_ms"]["p50"] > short["total_ms"]["p50"]
    assert chat["latency"]["all"]["ttft_ms"]["p99"] == latency["models"]["chat"]["ttft_ms"]["p99"]
    stages = {row["stage"]: row for row in chat["stages"]}
    assert set(stages) == STAGES
    for stage, row in stages.items():
        assert row["count"] == 2 * n, stage
        assert row["p50_ms"] is not None and row["p95_ms"] is not None, stage
    assert stages["ttft"]["budget_ms"] == BUDGET["ttft_ms"]
    assert stages["total"]["budget_ms"] == BUDGET["total_ms"]
    assert stages["ttft"]["p95_ms"] > 80  # half the requests were long
    assert stages["ttft"]["within_budget"] is True
    assert stages["queue"]["p95_ms"] == 0  # no bulk gate: no wait, read as zero
    assert chat["budget"] == {**BUDGET, "tpot_ms": None}
    assert chat["slo"]["ttft"]["judged"] == latency["models"]["chat"]["slo"]["ttft"]["judged"]
    router = chat["router"]
    assert router["routes"] == {"primary": 2 * n}
    assert router["served_by"] == {f"up/{SIM}": 2 * n}
    assert router["client_requests"] == 2 * n
    assert (router["rescues"], router["extra_load"]) == (0, 0.0)
    assert router["wasted"] == {"attempts": 0, "prompt_tokens": 0}
    # Next to attainment: nothing served by a fallback model (it has none).
    assert chat["fallback_served"] == {
        "requests": 2 * n,
        "served": 0,
        "share": 0.0,
        "routes": {},
        "fallbacks": {},
    }

    # The Markdown shows the same numbers.
    text = md.stdout
    assert text.startswith("# Latency report")
    for name, row in (("short", short), ("long", long)):
        got = cells(text, name, after="## chat")
        ttft, total = row["ttft_ms"], row["total_ms"]
        assert int(shown(got[2])) == row["requests"]
        expected = [ttft["p50"], ttft["p95"], ttft["p99"], total["p50"], total["p95"], total["p99"]]
        assert all(same(cell, value) for cell, value in zip(got[3:9], expected, strict=True)), (
            got,
            row,
        )
    for stage in STAGES:
        got = cells(text, stage, after="Stages")
        assert same(got[1], stages[stage]["p50_ms"]) and same(got[2], stages[stage]["p95_ms"])
    assert shown(cells(text, "ttft", after="Stages")[3]) == BUDGET["ttft_ms"]
    assert shown(cells(text, "total", after="Stages")[3]) == BUDGET["total_ms"]
    assert shown(cells(text, "primary", after="What the router did")[1]) == 2 * n
    assert f"Served by a fallback model: 0.0% (0 of {2 * n} requests since start)." in text

    assert written.returncode == 0, written.stderr
    assert written.stdout == ""
    assert out.read_text().startswith("# Latency report")
    assert "## chat" in out.read_text()
    assert down.returncode == 1
    assert down.stdout == ""
    assert len(down.stderr.strip().splitlines()) == 1
    assert closed in down.stderr


# --- the report, from literal inputs --------------------------------------------------------------


def band(number: int, count: int, p50: float | None, p95: float | None, p99: float | None) -> Body:
    quantiles = {"p50": p50, "p90": p95, "p95": p95, "p99": p99}
    cut = any(v is None for v in quantiles.values())
    stats = {**quantiles, "count": count, "censored": count // 2 if cut else 0}
    stats["beyond_ms"] = 700.0 if cut else None
    return {"band": number, "prompt": f"band {number}", **stats, "total_ms": dict(stats)}


def test_a_class_quantile_is_an_upper_bound_tighter_than_the_worst_band() -> None:
    """Bands merge by counts into an upper bound on the class's quantile: a large fast band and a
    small slow one give the fast band's upper quantiles at p50, not the slow band's median, and
    the worst band's value where the slow band decides (p99)."""
    bands = [band(0, 800, 100.0, 125.0, 130.0), band(1, 200, 150.0, 180.0, 200.0)]
    got = class_quantiles(bands)
    assert got["requests"] == 1000
    assert got["ttft_ms"]["p50"] == 125.0  # 95% of the fast band (76% of all) are <= 125 ms
    assert got["ttft_ms"]["p99"] == 200.0
    assert got["ttft_ms"]["beyond_ms"] == {}
    alone = class_quantiles([band(0, 800, 100.0, 125.0, 130.0)])["ttft_ms"]
    assert (alone["p50"], alone["p95"], alone["p99"]) == (100.0, 125.0, 130.0)


def test_a_class_quantile_beyond_every_cut_is_known_only_as_more_than() -> None:
    """A band whose tail was all cut (null quantiles with `beyond_ms`) leaves the class's upper
    quantiles unknown, reported as null with the value they are known to exceed."""
    bands = [band(3, 10, 400.0, None, None), band(4, 10, 500.0, 600.0, 650.0)]
    got = class_quantiles(bands)["ttft_ms"]
    assert got["p50"] == 500.0  # half of each band is at or under 500 ms
    assert (got["p95"], got["p99"]) == (None, None)
    assert got["beyond_ms"] == {"p95": 650.0, "p99": 700.0}


def test_unknown_values_render_as_a_dash_and_cut_tails_as_more_than() -> None:
    """A model with no traffic renders "—" in every cell; a quantile beyond every cut renders as
    "> N ms"; both stay null in the JSON."""
    latency: Body = {
        "window_s": 60,
        "source": "memory",
        "age_s": 0.2,
        "deployments": {},
        "models": {
            "slow": {
                "ttft_ms": {"p50": 400.0, "p90": None, "p95": None, "p99": None, "count": 30},
                "tpot_ms": {"p50": None, "p90": None, "p95": None, "p99": None, "count": 0},
                "total_ms": {"p50": None, "p90": None, "p95": None, "p99": None, "count": 0},
                "slo": {},
                "ttft_by_prompt": [band(3, 30, 400.0, None, None)],
            }
        },
        "config": {
            "models": [
                {"name": "idle", "deployments": ["a/b"], "budget": {"ttft_ms": None}},
                {"name": "slow", "deployments": ["a/c"], "budget": {"ttft_ms": 500}},
            ]
        },
        "counters": {"routes": {}, "hedges": {}, "cooldowns": {}},
    }
    latency["models"]["slow"]["ttft_ms"]["beyond_ms"] = 700.0
    report = build_report(latency, "", source="http://gw")
    assert report["models"]["idle"]["latency"]["short"]["ttft_ms"]["p50"] is None
    assert report["models"]["slow"]["latency"]["all"]["ttft_ms"]["p99"] is None
    assert report["models"]["slow"]["latency"]["all"]["ttft_ms"]["beyond_ms"] == {
        "p95": 700.0,
        "p99": 700.0,
    }
    text = render_markdown(report)
    idle = cells(text, "short", after="## idle")
    assert set(idle[3:]) == {"—"}
    slow = cells(text, "all", after="## slow")
    assert slow[3] == "400"  # p50
    assert slow[5] == "> 700 ms"  # p99
    assert cells(text, "ttft", after="## slow")[1] == "—"  # no stage histogram yet
    assert shown(cells(text, "ttft", after="## slow")[3]) == 500


def test_what_a_fallback_model_served_is_shown_next_to_attainment_with_its_routes() -> None:
    """The counts of `/admin/latency`'s `counters.fallback` reach the JSON as they are and the
    Markdown as a line under the SLO attainment table: the share, then by route and by
    fallback model; a model with no requests shows "—"."""
    fallback = {
        "requests": 125,
        "served": 71,
        "share": 0.568,
        "routes": {"hedge": 11, "budget": 60},
        "fallbacks": {"fast": 71},
    }
    latency: Body = {
        "window_s": 60,
        "source": "memory",
        "age_s": 0.2,
        "deployments": {},
        "models": {},
        "config": {
            "models": [
                {"name": "large", "deployments": ["a/l"], "fallbacks": ["fast"], "budget": {}},
                {"name": "fast", "deployments": ["a/f"], "budget": {}},
            ]
        },
        "counters": {"routes": {}, "hedges": {}, "cooldowns": {}, "fallback": {"large": fallback}},
    }
    report = build_report(latency, "", source="http://gw")
    assert report["models"]["large"]["fallback_served"] == {
        **fallback,
        "routes": {"budget": 60, "hedge": 11},
    }
    assert report["models"]["fast"]["fallback_served"]["share"] is None
    text = render_markdown(report)
    large = text[text.index("## large") : text.index("## fast")]
    assert (
        "Served by a fallback model: 56.8% (71 of 125 requests since start); by route: "
        "budget 60, hedge 11; by fallback: `fast` 71." in large
    )
    assert large.index("### SLO attainment") < large.index("Served by a fallback model")
    assert "Served by a fallback model: — (0 of 0 requests since start)." in text

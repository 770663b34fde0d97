"""`bench/scenarios.py`: its counting upstream on loopback, its recovery figure, and one short
run end to end (the table and the results file, not the targets: those are the benchmark's)."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from bench._scenario_run import Planned, Scenario, Timing, recovery_time
from bench._trace_data import TraceRow, describe, prompt_text, read_trace, synthetic_trace
from bench._trace_report import Outcome as TraceOutcome
from bench._trace_report import paired_overhead, recovery_s, summarize
from bench._trace_report import table as trace_table
from bench._trace_upstream import LatencyModel, TraceUpstream, draw, output_tokens
from bench._upstream import BEHAVIOUR_PATH, STATS_PATH, Upstream, prompt_tokens
from bench.tail import Outcome
from bench.trace import request_body as trace_request_body
from gateway.sim.profile import SimProfile
from tests.conftest import serve
from tests.timing import scaled

ROOT = Path(__file__).resolve().parents[2]


def chat(content: str) -> bytes:
    return orjson.dumps(
        {
            "model": "m",
            "stream": True,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": content}],
        }
    )


def row(stats: dict[str, Any], phase: str, cls: str, behaviour: str) -> dict[str, Any]:
    found = [
        r
        for r in stats["rows"]
        if (r["phase"], r["class"], r["behaviour"]) == (phase, cls, behaviour)
    ]
    assert len(found) == 1, stats
    only: dict[str, Any] = found[0]
    return only


async def test_the_upstream_counts_completed_closed_and_failed_streams_per_behaviour() -> None:
    """A stream read to its end is completed; one the client closes during prefill is wasted
    with its prompt tokens, before its first token; a 500 is neither. Each is counted under
    the phase and class its request id names and the behaviour current when it arrived."""
    upstream = Upstream(
        {
            "normal": SimProfile(),
            "slow": SimProfile(prefill_base_ms=600_000),
            "down": SimProfile(error_500_rate=1.0),
        },
        "normal",
        seed=1,
    )
    long_text = "x" * 4000
    async with serve(upstream) as url, httpx.AsyncClient(base_url=url, timeout=10) as client:
        done = await client.post(
            "/v1/chat/completions", content=chat("hi"), headers={"x-request-id": "sc-ms-000001"}
        )
        assert done.status_code == 200 and done.text.endswith("data: [DONE]\n\n")

        switched = await client.post(BEHAVIOUR_PATH, json={"name": "slow"})
        assert switched.status_code == 200
        async with client.stream(
            "POST",
            "/v1/chat/completions",
            content=chat(long_text),
            headers={"x-request-id": "sc-ml-000002"},
        ) as stalled:
            assert stalled.status_code == 200  # headers come before prefill; then we leave
        async with asyncio.timeout(scaled(5)):
            await upstream.wait_for(
                lambda: upstream.counts[("measure", "long", "slow")]["wasted"] == 1
            )

        await client.post(BEHAVIOUR_PATH, json={"name": "down"})
        failed = await client.post(
            "/v1/chat/completions", content=chat("hi"), headers={"x-request-id": "sc-wl-000003"}
        )
        assert failed.status_code == 500
        assert (await client.post(BEHAVIOUR_PATH, json={"name": "nope"})).status_code == 400
        stats = (await client.get(STATS_PATH)).json()

    normal = row(stats, "measure", "short", "normal")
    assert (normal["requests"], normal["completed"], normal["wasted"], normal["failed"]) == (
        1,
        1,
        0,
        0,
    )
    assert normal["prompt_tokens"] == 1
    slow = row(stats, "measure", "long", "slow")
    assert (slow["requests"], slow["completed"], slow["wasted"]) == (1, 0, 1)
    assert slow["wasted_tokens"] == slow["wasted_before_first_tokens"] == 1000
    assert slow["wasted_before_first"] == 1
    down = row(stats, "warmup", "long", "down")
    assert (down["requests"], down["failed"], down["completed"], down["wasted"]) == (1, 1, 0, 0)
    assert [name for _, name in stats["switches"]] == ["normal", "slow", "down"]


def test_prompt_tokens_count_message_characters_as_the_simulator_does() -> None:
    assert prompt_tokens(chat("x" * 400)) == 100
    assert prompt_tokens(chat("x" * 401)) == 101
    assert prompt_tokens(b"not json") == 0


def drift_scenario() -> Scenario:
    normal: dict[str, dict[str, Any]] = {"normal": {}}
    timing = Timing(0, 10, recovery_s=4)
    return Scenario("t", "t", 10, 0.0, 4, normal, normal, {"ttft_ms": 600}, (), timing, timing)


def served(offsets_and_providers: list[tuple[float, str]]) -> list[tuple[Planned, Outcome]]:
    return [
        (
            Planned(i, offset, "short", 0),
            Outcome(phase="measure", lag_s=0.0, ttft_s=0.1, total_s=0.2, status=200,
                    deployment=f"{provider}/m"),
        )
        for i, (offset, provider) in enumerate(offsets_and_providers)
    ]  # fmt: skip


def test_traffic_is_back_at_the_first_bin_after_which_every_bin_is_mostly_on_the_primary() -> None:
    """Bins of 1 s from the recovery at 4 s: the fallback until 6.5 s, the primary after, but
    for one fallback answer in the 8-9 s bin (3 of 4 on the primary: under 80%): back from the
    9 s bin, 5 s after the recovery."""
    scenario = drift_scenario()
    timing = scenario.full
    traffic = [(t / 4, "fallback") for t in range(16, 26)]  # 4.0 .. 6.25
    traffic += [(t / 4, "primary") for t in range(26, 40)]  # 6.5 .. 9.75
    traffic[16] = (8.0, "fallback")  # one of the 8 s bin's four
    assert recovery_time(scenario, timing, served(traffic)) == 5.0
    # Without the stray answer it is back from the 7 s bin (the 6 s one is half and half).
    traffic[16] = (8.0, "primary")
    assert recovery_time(scenario, timing, served(traffic)) == 3.0
    # Still on the fallback at the end: never back.
    assert recovery_time(scenario, timing, served([(t / 4, "fallback") for t in range(40)])) is None


@pytest.mark.slow
def test_a_short_scenario_run_prints_its_table_and_writes_its_results(tmp_path: Path) -> None:
    """Both configurations of `mixed`, 1 s warm-up + 3 s each, on real processes: one table row
    per configuration and prompt class, a target list, and results in which the plain proxy's
    requests reached the primary exactly once each (counted by the upstreams themselves)."""
    out = tmp_path / "results.json"
    command = [sys.executable, str(ROOT / "bench" / "scenarios.py"), "--quick"]
    command += ["--scenarios", "mixed", "--warmup-s", "1", "--measure-s", "3", "--json", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode in (0, 1), done.stdout + done.stderr  # 2: the run itself failed
    text = done.stdout
    assert "### mixed:" in text
    assert "| config | prompts | requests | TTFT p50 | p99 | p99.9 |" in text
    for config in ("plain proxy", "hedge 0.05"):
        for cls in ("short", "long", "all"):
            assert f"| {config} | {cls} |" in text, text
    assert "targets:" in text and "short prompts on the primary >= 95%" in text

    document = json.loads(out.read_text())
    results = document["scenarios"]["mixed"]["results"]
    assert set(results) == {"plain proxy", "hedge 0.05"}  # 0.25 runs in full mode only
    plain = results["plain proxy"]
    overall, classes = plain["overall"], plain["classes"]
    assert overall["requests"] > 0 and overall["errors"] == 0
    assert classes["short"]["requests"] + classes["long"]["requests"] == overall["requests"]
    assert overall["upstream_requests"] == overall["primary_requests"] == overall["requests"]
    assert overall["extra_upstream_fraction"] == 0.0 and overall["wasted_prompt_tokens"] == 0
    assert overall["share"] == {"primary": 1.0}
    # The same schedule for every configuration.
    assert results["hedge 0.05"]["overall"]["requests"] == overall["requests"]


# --- bench/trace.py: the generated trace, its upstreams and its figures ---------------------------


def test_the_generated_trace_is_seeded_and_has_the_production_shape() -> None:
    """The same seed gives the same requests; the sizes are clipped as the Azure trace's are and
    their means land near its 1,155 prompt and 211 output tokens; `limit` caps the count."""
    rows = synthetic_trace(600.0, seed=3)
    assert rows == synthetic_trace(600.0, seed=3)
    assert rows != synthetic_trace(600.0, seed=4)
    shape = describe(rows)
    assert 6.5 <= shape["rate_per_s"] <= 9.0
    assert 1000 <= shape["context_mean"] <= 1320
    assert 185 <= shape["generated_mean"] <= 240
    assert all(1 <= r.context <= 14_000 and 1 <= r.generated <= 1_000 for r in rows)
    assert all(a.t < b.t for a, b in itertools.pairwise(rows))
    assert len(synthetic_trace(600.0, seed=3, limit=10)) == 10
    assert len(prompt_text(7, 1155)) == 4 * 1155


def test_the_azure_csv_is_read_from_its_first_timestamp_with_outputs_clipped(
    tmp_path: Path,
) -> None:
    path = tmp_path / "AzureLLMInferenceTrace_conv.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,1500\n"
        "2023-11-16 18:16:10.0000000,100,10\n"
    )
    rows = read_trace(path, duration_s=20.0)
    assert [(round(r.t, 4), r.context, r.generated) for r in rows] == [
        (0.0, 374, 44),
        (4.3146, 396, 1000),
    ]
    assert len(read_trace(path, duration_s=60.0, limit=1)) == 1


def test_two_upstreams_with_one_seed_draw_the_same_latency_per_request_and_attempt() -> None:
    model = LatencyModel("large", 150, 40, 6.5, slots=4, stall_rate=0.5)
    draws = [draw(model, 1, f"tr-{i}-10", 0) for i in range(40)]
    assert draws == [draw(model, 1, f"tr-{i}-10", 0) for i in range(40)]
    assert any(stall > 0 for _, stall in draws) and any(stall == 0 for _, stall in draws)
    assert draws != [draw(model, 1, f"tr-{i}-10", 1) for i in range(40)]  # a retry draws anew
    assert output_tokens("tr-3-120", 1000) == 120
    assert output_tokens("tr-3-120", 50) == 50
    assert output_tokens("no-length", 16) == 16


async def post_once(url: str, body: bytes) -> httpx.Response:
    """On a connection of its own: a connection pooled before the outage was reset by it."""
    async with httpx.AsyncClient(timeout=scaled(10)) as client:
        return await client.post(url, content=body)


async def test_a_trace_upstream_streams_refuses_connections_when_down_and_comes_back() -> None:
    """Streams its answer with `[DONE]`, recording the attempt as completed; down, the port is
    closed (a connection error, nothing recorded); back up on the same port, it answers."""
    upstream = TraceUpstream(LatencyModel("small", 1, 0, 0, slots=2, tokens_per_event=3), seed=1)
    await upstream.start()
    body, _ = trace_request_body(0, TraceRow(0.0, 40, 7))
    url = f"http://127.0.0.1:{upstream.port}/v1/chat/completions"
    try:
        answer = await post_once(url, body)
        assert answer.status_code == 200 and answer.text.endswith("data: [DONE]\n\n")
        assert answer.text.count("tok ") == 7
        await upstream.set_state("down")
        try:
            await post_once(url, body)
            raise AssertionError("a closed port answered")
        except httpx.ConnectError:
            pass
        await upstream.set_state("normal")
        assert (await post_once(url, body)).status_code == 200
    finally:
        await upstream.stop()
    assert [(a.key, a.prompt_tokens, a.completed) for a in upstream.attempts] == [
        ("tr-0-7", 40, True),
        ("tr-0-7", 40, True),
    ]


def trace_outcome(index: int, t: float, **fields: Any) -> TraceOutcome:
    return TraceOutcome(index=index, t=t, prompt_tokens=100, **fields)


def test_the_trace_figures_count_attainment_shares_waste_and_recovery() -> None:
    """Four requests: one within both budgets, one over the TTFT budget, one over the total
    budget, one error. Five upstream attempts, one of them cancelled (100 wasted tokens)."""
    outcomes = [
        trace_outcome(0, 0.0, ttft_s=0.2, total_s=2.0, deployment="p/large"),
        trace_outcome(1, 1.0, ttft_s=1.5, total_s=2.0, deployment="f/small"),
        trace_outcome(2, 2.0, ttft_s=0.3, total_s=9.0, deployment="p/large"),
        trace_outcome(3, 3.0, error="status 503"),
    ]
    attempts = [("p/large", 100, True, True)] * 3
    attempts += [("f/small", 100, True, True), ("p/large", 100, False, False)]
    model_of = {"p/large": "chat", "f/small": "chat-fast"}
    r = summarize(outcomes, attempts, model_of, 1.0, 8.0, incident_end=None)
    assert r["attainment"] == 0.25 and r["errors"] == 1
    assert r["served_by_deployment"] == {"f/small": 0.25, "p/large": 0.5}
    assert r["served_by_model"] == {"chat": 0.5, "chat-fast": 0.25}
    assert r["extra_upstream_requests"] == 0.25
    assert r["wasted_prompt_tokens"] == 0.25
    assert r["wasted_by_deployment"] == {
        "p/large": {"attempts": 1, "answered": 0, "prompt_tokens": 100}
    }
    assert r["ttft_ms"]["p50"] == 300.0 and r["ttft_ms"]["p99"] is None  # the error ranks last
    assert r["recovery_s"] is None
    assert r["requested_while_healthy"] == 0.5  # two of four served by `chat`
    assert "| configured | 25.0% | 1 | 300 / - / - |" in trace_table("s", {"configured": r})
    # An incident from 0.5 s to 1.5 s: only the request before it counts (and those 10 s after).
    during = summarize(outcomes, attempts, model_of, 1.0, 8.0, incident_end=1.5, incident_start=0.5)
    assert during["requested_while_healthy"] == 1.0


def test_recovery_is_the_first_bin_from_which_every_bin_is_clean() -> None:
    """2 s bins from the incident's end at 10 s: an error at 13 s keeps the 12-14 s bin dirty, so
    the arm is back from 14 s (4 s after the end); with no trouble after the end, 0."""
    ok = {"ttft_s": 0.2, "total_s": 1.0}
    outcomes = [trace_outcome(i, 10.0 + i / 2, **ok) for i in range(20)]
    assert recovery_s(outcomes, 10.0, 1.0, 8.0) == 0.0
    outcomes[6] = trace_outcome(6, 13.0, error="ConnectionError")
    assert recovery_s(outcomes, 10.0, 1.0, 8.0) == 4.0
    outcomes[-1] = trace_outcome(19, 19.5, ttft_s=3.0, total_s=4.0)
    outcomes[-2] = trace_outcome(18, 19.0, ttft_s=3.0, total_s=4.0)
    assert recovery_s(outcomes, 10.0, 1.0, 8.0) is None  # the last bin misses: not back


def test_the_paired_overhead_subtracts_the_same_request_direct_from_through_the_gateway() -> None:
    direct = [trace_outcome(i, 0.0, ttft_s=0.1 * (i + 1), total_s=1.0) for i in range(4)]
    through = [
        trace_outcome(0, 0.0, ttft_s=0.102, total_s=1.004),
        trace_outcome(1, 0.0, ttft_s=0.199, total_s=0.999),  # faster: a negative difference
        trace_outcome(2, 0.0, error="status 502"),  # not a pair
        trace_outcome(3, 0.0, ttft_s=0.405, total_s=1.01),
    ]
    paired = paired_overhead(direct, through)
    assert paired["pairs"] == 3
    assert [round(paired["ttft_ms"][k], 3) for k in ("p50", "p99")] == [2.0, 5.0]
    assert round(paired["total_ms"]["p50"], 3) == 4.0
    assert round(min(-1.0, paired["ttft_ms"]["p50"] - 3.0), 3) == -1.0


def test_the_paired_overhead_counts_each_copy_from_its_own_send() -> None:
    """The client sends the gateway's copy after the direct one: the wait between the two sends
    is the client's, so it is not charged to the gateway; a copy sent early counts from its
    send as well, never from before it."""
    direct = [
        trace_outcome(0, 0.0, ttft_s=0.100, total_s=1.0, lag_s=0.001),
        trace_outcome(1, 0.0, ttft_s=0.100, total_s=1.0, lag_s=-0.002),  # woken a little early
    ]
    through = [
        # Sent 3 ms after the direct copy, answered 5 ms after it: the gateway added 2 ms.
        trace_outcome(0, 0.0, ttft_s=0.105, total_s=1.005, lag_s=0.004),
        trace_outcome(1, 0.0, ttft_s=0.104, total_s=1.004, lag_s=0.001),
    ]
    paired = paired_overhead(direct, through)
    assert paired["pairs"] == 2
    assert sorted(round(paired["ttft_ms"][k], 3) for k in ("p50", "p99")) == [2.0, 3.0]
    assert sorted(round(paired["total_ms"][k], 3) for k in ("p50", "p99")) == [2.0, 3.0]

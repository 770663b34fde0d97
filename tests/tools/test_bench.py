"""`tailguard bench batching`'s engine: a real run in its shortest form, and the recommendation
logic on made-up numbers; and the benchmarks' load client, run as the scripts run it."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import orjson
import pytest

from bench._load import LoadSpec, run_load
from gateway.tools.bench import BatchingRow, Workload, recommend, run_batching_bench
from tests.conftest import Upstream


@pytest.mark.slow
def test_a_short_run_measures_every_workload_at_every_wait() -> None:
    """A real gateway and simulated upstream, a fraction of a second per cell: six rows that
    all served requests, a recommendation per workload, and JSON that round-trips."""
    lines: list[str] = []
    report = run_batching_bench(duration_s=0.4, progress=lines.append)
    assert len(report.rows) == 6
    assert {(r.workload, r.max_wait_ms) for r in report.rows} == {
        (w, ms) for w in ("interactive", "bulk") for ms in (5, 20, 100)
    }
    for row in report.rows:
        assert row.throughput_rps > 0, row
        assert row.requests > 0 and row.errors == 0, row
        assert 0 < row.p50_ms <= row.p99_ms <= row.max_ms, row
    assert [r.workload for r in report.recommendations] == ["interactive", "bulk"]
    for rec in report.recommendations:
        assert rec.max_wait_ms in (5, 20, 100) and rec.reason
    data = json.loads(json.dumps(report.to_dict()))
    assert len(data["rows"]) == 6 and len(data["recommendations"]) == 2
    assert "embeddings" in data["setup"]["requests"]
    assert any("bulk, max_wait_ms 100" in line for line in lines)
    assert "| interactive | 5 |" in report.markdown()


def row(
    workload: Workload,
    wait: int,
    rps: float,
    p99: float,
    *,
    errors: int = 0,
    mean_batch: float | None = None,
    offered_rps: float | None = None,
) -> BatchingRow:
    return BatchingRow(
        workload=workload,
        max_wait_ms=wait,
        requests=1000,
        errors=errors,
        throughput_rps=rps,
        p50_ms=p99 / 2,
        p99_ms=p99,
        max_ms=p99 * 1.1,
        mean_batch=mean_batch,
        offered_rps=offered_rps,
    )


def test_interactive_takes_the_lowest_p99_and_says_arrivals_set_the_throughput() -> None:
    rows = [
        row("interactive", 5, 20.4, 31.0, offered_rps=20.0, mean_batch=1.1),
        row("interactive", 20, 20.1, 50.0, offered_rps=20.0, mean_batch=1.5),
        row("interactive", 100, 20.3, 125.0, offered_rps=20.0, mean_batch=2.7),
    ]
    rec = recommend("interactive", rows)
    assert rec.max_wait_ms == 5
    assert "31.0 ms vs 50.0 ms at 20 ms, 125 ms at 100 ms" in rec.reason
    assert "+94 ms from 5 to 100 ms" in rec.reason
    assert "set by the arrivals (20 req/s)" in rec.reason
    assert "batches stay small (1.1-2.7 inputs)" in rec.reason


def test_interactive_ties_go_to_the_shorter_wait() -> None:
    """p99s within 10% of the lowest are equal: the shorter wait wins."""
    rows = [row("interactive", 5, 20, 40.0), row("interactive", 20, 20, 37.0)]
    assert recommend("interactive", rows).max_wait_ms == 5
    rows = [row("interactive", 5, 20, 60.0), row("interactive", 20, 20, 37.0)]
    assert recommend("interactive", rows).max_wait_ms == 20


def test_bulk_takes_the_lower_p99_among_throughputs_within_5_percent() -> None:
    """The brief's example: 20 ms is within 5% of 100 ms's throughput with a p99 4x lower."""
    rows = [
        row("bulk", 5, 1000.0, 60.0, mean_batch=20.0),
        row("bulk", 20, 1960.0, 100.0, mean_batch=60.0),
        row("bulk", 100, 2000.0, 400.0, mean_batch=64.0),
    ]
    rec = recommend("bulk", rows)
    assert rec.max_wait_ms == 20
    assert rec.reason.startswith("throughput 1960 req/s, within 5% of the best (2000 at 100 ms)")
    assert "(1000 at 5 ms)" in rec.reason  # not within 5%
    assert "p99 4.0x lower than at 100 ms (100 ms vs 400 ms)" in rec.reason
    assert "60.0 inputs per upstream call" in rec.reason


def test_bulk_takes_a_clear_throughput_winner_and_skips_failing_settings() -> None:
    rows = [
        row("bulk", 5, 3000.0, 80.0),
        row("bulk", 20, 2000.0, 60.0),
        row("bulk", 100, 5000.0, 50.0, errors=100),  # 9% failed: not a candidate
    ]
    rec = recommend("bulk", rows)
    assert rec.max_wait_ms == 5
    assert rec.reason.startswith("highest throughput, 3000 req/s (2000 at 20 ms); p99 80.0 ms")
    assert "passed over for errors: 100 ms" in rec.reason


def test_bulk_with_everything_tied_prefers_the_shorter_wait() -> None:
    rows = [row("bulk", 5, 1500.0, 46.0), row("bulk", 100, 1510.0, 45.0)]
    rec = recommend("bulk", rows)
    assert rec.max_wait_ms == 5
    assert "p99 on a par with 100 ms (46.0 ms vs 45.0 ms)" in rec.reason
    assert "the shorter wait costs less latency" in rec.reason


def test_no_rows_for_the_workload_is_an_error() -> None:
    with pytest.raises(ValueError, match="no rows"):
        recommend("bulk", [row("interactive", 5, 20, 30.0)])


def chat_body(stream: bool) -> str:
    body = {"model": "m", "stream": stream, "messages": [{"role": "user", "content": "Hi"}]}
    return orjson.dumps(body).decode()


async def load(upstream: Upstream, **spec: Any) -> dict[str, Any]:
    """`bench/_load.py` in a process of its own against the (5-token) simulated upstream."""
    port = int(upstream.url.rsplit(":", 1)[1])
    return await asyncio.to_thread(run_load, LoadSpec(port=port, **spec))


async def test_the_load_process_counts_every_answer_in_both_loops(upstream: Upstream) -> None:
    """Closed loop: exactly `requests` answers after the warm-up, and the CPU a process used
    meanwhile; open loop: one request per 1 / rate, streams timed to their first token. Every
    answer carries the tokens expected."""
    closed = await load(
        upstream,
        body=chat_body(False),
        concurrency=4,
        requests=400,  # enough upstream CPU to show in whole clock ticks
        warmup_requests=8,
        expect_tokens=5,
        cpu_pids={"upstream": os.getpid()},  # this process serves the upstream
    )
    assert (closed["requests"], closed["ok"], closed["errors"]) == (400, 400, 0)
    assert closed["cpu_s"]["upstream"] > 0
    assert closed["latency_ms"]["count"] == 400 and closed["throughput_rps"] > 0
    assert upstream.stats.requests == 408  # the warm-up went out too, uncounted
    opened = await load(
        upstream,
        body=chat_body(True),
        stream=True,
        mode="open",
        rate=100,
        duration_s=0.3,
        expect_tokens=5,
    )
    assert (opened["ok"], opened["errors"]) == (30, 0)
    assert 0 < opened["ttft_ms"]["p50"] <= opened["latency_ms"]["p50"]
    assert opened["send_lag_ms"]["count"] == 30


async def test_the_load_process_refuses_answers_short_of_the_expected_tokens(
    upstream: Upstream,
) -> None:
    """A complete stream with fewer content tokens than expected is an error, with a sample."""
    result = await load(
        upstream, body=chat_body(True), stream=True, requests=5, concurrency=1, expect_tokens=6
    )
    assert (result["ok"], result["errors"]) == (0, 5)
    assert result["error_samples"][0] == "5 content tokens, expected 6"

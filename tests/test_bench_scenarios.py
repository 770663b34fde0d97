"""`bench/scenarios.py`: its counting upstream on loopback, its recovery figure, and one short
run end to end (the table and the results file, not the targets: those are the benchmark's)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench._scenario_run import Planned, Scenario, Timing, recovery_time
from bench._upstream import BEHAVIOUR_PATH, STATS_PATH, Upstream, prompt_tokens
from bench.tail import Outcome
from gateway.sim.profile import SimProfile
from tests.conftest import serve
from tests.timing import scaled

ROOT = Path(__file__).resolve().parent.parent


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

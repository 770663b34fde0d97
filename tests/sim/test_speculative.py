"""Speculative decoding in the simulator, on a simulated server served for real on loopback:
tokens per step, decode time, the stream, and vLLM's spec-decode counters under every name."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import httpx
import orjson
import pytest

from gateway.latency.vllm import parse_metrics
from gateway.sim.speculative import Speculation, tokens_per_step
from tests.sim_server import LABELS, chat, sim


def values(page: str, name: str) -> list[float]:
    """Every sample of `name` (exactly that name, any labels), in page order."""
    return [
        float(line.rsplit(" ", 1)[1])
        for line in page.splitlines()
        if line.startswith((name + "{", name + " "))
    ]


def one(page: str, name: str) -> float:
    found = values(page, name)
    assert len(found) == 1, (name, found)
    return found[0]


async def answer(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


@pytest.mark.parametrize(("k", "alpha"), [(4, 0.7), (2, 0.3), (6, 0.9)])
async def test_tokens_per_step_follow_the_acceptance_rate(k: int, alpha: float) -> None:
    """Over a seeded run a target step yields `tokens_per_step(k, alpha)` tokens on average and
    draft position i is accepted about `alpha ** (i + 1)` of the time; the same seed draws the
    same run."""
    profile = {"spec_tokens": k, "spec_acceptance": alpha, "output_tokens": 3000}
    pages = []
    for _ in range(2):
        async with sim(seed=7, **profile) as (_, client):
            reply = await answer(client, chat())
            pages.append((await client.get("/metrics")).text)
        assert reply["usage"]["completion_tokens"] == 3000
    page = pages[0]
    drafts = one(page, "vllm:spec_decode_num_drafts_total")
    accepted = one(page, "vllm:spec_decode_num_accepted_tokens_total")
    # The first token comes from prefill; every other one from a step.
    assert drafts + accepted == 3000 - 1
    assert (drafts + accepted) / drafts == pytest.approx(tokens_per_step(k, alpha), abs=0.15)
    per_pos = values(page, "vllm:spec_decode_num_accepted_tokens_per_pos_total")
    assert len(per_pos) == k
    for i, count in enumerate(per_pos):
        assert count / drafts == pytest.approx(alpha ** (i + 1), abs=0.05)
    assert sum(per_pos) == accepted
    spec = [line for line in page.splitlines() if line.startswith("vllm:spec_decode")]
    assert spec == [line for line in pages[1].splitlines() if line.startswith("vllm:spec_decode")]


async def _decode_s(client: httpx.AsyncClient, model: str) -> float:
    started = time.monotonic()
    reply = await answer(client, chat(model))
    assert reply["usage"]["completion_tokens"] == 60
    return time.monotonic() - started


async def test_a_good_draft_decodes_faster_and_a_bad_one_slower() -> None:
    """60 tokens at 5 ms a step: a draft right 80% of the time needs about a third of the steps,
    each a little dearer; one right 5% of the time (and not free) costs more than it saves."""
    good = "m@spec_tokens=4,spec_acceptance=0.8"
    bad = "m@spec_tokens=4,spec_acceptance=0.05,spec_verify_cost=0.05,spec_draft_cost=0.1"
    assert Speculation(4, 0.8, 0.02, 0.05).speedup > 2
    assert Speculation(4, 0.05, 0.05, 0.1).speedup < 0.7
    async with sim(seed=7, tokens_per_s=200, output_tokens=60) as (engine, client):
        plain_s = await _decode_s(client, "m")
        good_s = await _decode_s(client, good)
        bad_s = await _decode_s(client, bad)
        streamed_s = time.monotonic()
        async with client.stream(
            "POST", "/v1/chat/completions", json=chat(good, stream=True)
        ) as response:
            body = await response.aread()
        streamed_s = time.monotonic() - streamed_s
    assert good_s < plain_s < bad_s
    assert plain_s >= 59 * 0.005  # nothing decodes faster than its steps
    assert streamed_s < plain_s  # the stream takes the same simulated time
    assert body.count(b'"content":"') == 1 + 60  # the role chunk, then a frame per token
    assert engine.stats.generation_tokens == 4 * 60


async def test_a_stream_sends_each_step_s_tokens_back_to_back() -> None:
    """Every token its own frame; the inter-token histogram counts one interval per token
    after the first: a step's first token a step after the last one, the rest at once."""
    profile = {"spec_tokens": 3, "spec_acceptance": 0.6, "tokens_per_s": 40, "output_tokens": 20}
    async with sim(seed=7, **profile) as (_, client):
        async with client.stream(
            "POST", "/v1/chat/completions", json=chat(stream=True, logprobs=True)
        ) as response:
            lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
        page = (await client.get("/metrics")).text
    chunks = [orjson.loads(line[6:]) for line in lines[:-1]]
    tokens = [c for c in chunks if c["choices"][0]["delta"].get("content")]
    assert len(tokens) == 20
    assert all(len(c["choices"][0]["logprobs"]["content"]) == 1 for c in tokens)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    accepted = one(page, "vllm:spec_decode_num_accepted_tokens_total")
    drafts = one(page, "vllm:spec_decode_num_drafts_total")
    assert drafts + accepted == 19
    load = parse_metrics(page)
    assert load.tpot.count == 19
    buckets = dict(load.tpot.buckets)
    assert buckets[0.01] == accepted  # the tokens that came with their step's first
    assert buckets[0.025] == accepted  # a step is 25 ms x 1.21 = 30.25 ms, none came faster
    assert buckets[0.05] == 19


@pytest.mark.parametrize("names", ["current", "legacy", "both"])
async def test_the_counters_under_each_name_agree(names: str) -> None:
    k = 5
    profile = {"spec_tokens": k, "spec_acceptance": 0.6, "output_tokens": 400}
    async with sim(seed=7, metrics_names=names, **profile) as (_, client):
        await asyncio.gather(*(answer(client, chat(n=2)) for _ in range(3)))
        page = (await client.get("/metrics")).text
    current, legacy = names in ("current", "both"), names in ("legacy", "both")
    types = {line.split()[2]: line.split()[3] for line in page.splitlines() if "# TYPE" in line}
    spec_types = {name: kind for name, kind in types.items() if "spec_decode" in name}
    expected = {
        "vllm:spec_decode_num_draft_tokens": "counter",
        "vllm:spec_decode_num_accepted_tokens": "counter",
    }
    if current:
        expected |= {
            "vllm:spec_decode_num_drafts": "counter",
            "vllm:spec_decode_num_accepted_tokens_per_pos": "counter",
        }
    if legacy:
        expected |= {
            "vllm:spec_decode_draft_acceptance_rate": "gauge",
            "vllm:spec_decode_efficiency": "gauge",
            "vllm:spec_decode_num_emitted_tokens": "counter",
        }
    assert spec_types == expected
    draft_tokens = one(page, "vllm:spec_decode_num_draft_tokens_total")
    accepted = one(page, "vllm:spec_decode_num_accepted_tokens_total")
    assert 0 < accepted <= draft_tokens
    generated = 6 * 400
    if current:
        drafts = one(page, "vllm:spec_decode_num_drafts_total")
        assert draft_tokens == k * drafts
        assert drafts + accepted == generated - 6  # each sequence's first token is prefill's
        per_pos = values(page, "vllm:spec_decode_num_accepted_tokens_per_pos_total")
        positions = [
            line.split('position="')[1].split('"')[0]
            for line in page.splitlines()
            if line.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total")
        ]
        assert positions == [str(i) for i in range(k)]
        assert all(a >= b for a, b in itertools.pairwise(per_pos))
        assert per_pos[0] > per_pos[-1] and sum(per_pos) == accepted
    if legacy:
        emitted = one(page, "vllm:spec_decode_num_emitted_tokens_total")
        steps = draft_tokens / k
        assert emitted == accepted + steps == generated - 6
        rate = one(page, "vllm:spec_decode_draft_acceptance_rate")
        assert rate == pytest.approx(accepted / draft_tokens)
        efficiency = one(page, "vllm:spec_decode_efficiency")
        assert efficiency == pytest.approx(emitted / (steps * (k + 1)))
        assert 0 < efficiency < 1


@pytest.mark.parametrize("names", ["current", "legacy", "both"])
async def test_no_spec_decode_series_without_speculation(names: str) -> None:
    async with sim(seed=7, metrics_names=names, tokens_per_s=1000, output_tokens=5) as (_, client):
        await answer(client, chat())
        page = (await client.get("/metrics")).text
    assert "spec_decode" not in page
    assert one(page, f"vllm:num_preemptions_total{{{LABELS}}}") == 0

"""vLLM's prefix-cache and speculative-decoding series: read off `/metrics` pages under the current
and the older names, turned into rates over the latest scrape interval, and shown in
`/admin/latency` and the gateway's `/metrics`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.latency.vllm import (
    ServerLoad,
    ServerState,
    SpecCounters,
    parse_metrics,
    snapshot,
    spec_rates,
)
from gateway.sim.profile import SimProfile
from gateway.telemetry.prometheus import (
    VLLM_PREFIX_HIT,
    VLLM_RUNNING,
    VLLM_SPEC_ACCEPTANCE,
    VLLM_SPEC_POSITION,
    VLLM_SPEC_TOKENS,
    VLLM_UP,
)
from tests.conftest import gateway_settings, run_gateway
from tests.routing.test_vllm_routing import WATCHDOG_S, Sim, ask, served_well, sims, vllm

QUEUE = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
"""


def v1_page(
    drafts: float, accepted: float, per_pos: tuple[float, ...], queries: float, hits: float
) -> str:
    """A V1 page: k = 4 draft tokens per draft, and the prefix cache's token counters."""
    lines = [
        QUEUE,
        "# TYPE vllm:prefix_cache_queries counter",
        f'vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} {queries}',
        "# TYPE vllm:prefix_cache_hits counter",
        f'vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {hits}',
        "# TYPE vllm:spec_decode_num_drafts counter",
        f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {drafts}',
        'vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9',
        "# TYPE vllm:spec_decode_num_draft_tokens counter",
        f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {4 * drafts}',
        "# TYPE vllm:spec_decode_num_accepted_tokens counter",
        f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {accepted}',
        "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter",
        *(
            f"vllm:spec_decode_num_accepted_tokens_per_pos_total"
            f'{{engine="0",model_name="m",position="{i}"}} {n}'
            for i, n in enumerate(per_pos)
        ),
    ]
    return "\n".join(lines) + "\n"


PAGE_V0 = (
    QUEUE
    + """\
# TYPE vllm:gpu_prefix_cache_hit_rate gauge
vllm:gpu_prefix_cache_hit_rate{model_name="m"} 0.375
# TYPE vllm:spec_decode_draft_acceptance_rate gauge
vllm:spec_decode_draft_acceptance_rate{model_name="m"} 0.62
# TYPE vllm:spec_decode_efficiency gauge
vllm:spec_decode_efficiency{model_name="m"} 0.48
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 310.0
# TYPE vllm:spec_decode_num_draft_tokens counter
vllm:spec_decode_num_draft_tokens_total{model_name="m"} 500.0
# TYPE vllm:spec_decode_num_emitted_tokens counter
vllm:spec_decode_num_emitted_tokens_total{model_name="m"} 410.0
"""
)

PAGE_EARLY_V1_PREFIX = (
    QUEUE
    + """\
vllm:gpu_prefix_cache_queries_total{model_name="m"} 200.0
vllm:gpu_prefix_cache_hits_total{model_name="m"} 50.0
"""
)


def state_of(*pages: str) -> ServerState:
    """A server state that scraped `pages`, in order, all fresh."""
    state = ServerState("http://x/metrics", 1.0, clock=lambda: 100.0)
    for page in pages:
        state.scraped(replace(parse_metrics(page), scraped_at=99.9))
    return state


def test_current_names_are_read() -> None:
    """V1: drafts, draft and accepted tokens, per-position acceptance, prefix-cache tokens."""
    load = parse_metrics(v1_page(100, 250, (90, 70, 55, 35), queries=1000, hits=600))
    assert (load.prefix_queries, load.prefix_hits, load.prefix_hit_gauge) == (1000, 600, None)
    assert load.spec == SpecCounters(
        drafts=100, draft_tokens=400, accepted=250, per_position=(90, 70, 55, 35)
    )


def test_legacy_names_are_read() -> None:
    """V0's gauges and counters, and early V1's `gpu_prefix_cache_*` counters."""
    load = parse_metrics(PAGE_V0)
    assert (load.prefix_queries, load.prefix_hits, load.prefix_hit_gauge) == (None, None, 0.375)
    assert load.spec == SpecCounters(
        draft_tokens=500,
        accepted=310,
        emitted=410,
        acceptance_gauge=0.62,
        efficiency_gauge=0.48,
    )
    early = parse_metrics(PAGE_EARLY_V1_PREFIX)
    assert (early.prefix_queries, early.prefix_hits) == (200, 50)
    assert state_of(PAGE_EARLY_V1_PREFIX).prefix_hit_rate() == 0.25


def test_a_page_with_both_names_counts_the_current_ones_once() -> None:
    """A server exporting both spellings counts the same tokens twice: the current name wins."""
    page = v1_page(10, 20, (8, 6, 4, 2), queries=400, hits=100) + PAGE_EARLY_V1_PREFIX.replace(
        QUEUE, ""
    )
    load = parse_metrics(page)
    assert (load.prefix_queries, load.prefix_hits) == (400, 100)


def test_rates_come_from_the_latest_scrape_interval() -> None:
    """Acceptance = accepted / draft tokens, accepted per draft, and per position, from the
    counters' differences between the last two scrapes; tokens per step = 1 + accepted per
    draft. The prefix cache's hit rate likewise."""
    state = state_of(
        v1_page(100, 250, (90, 70, 55, 35), queries=1000, hits=600),
        v1_page(300, 450, (150, 110, 95, 95), queries=3000, hits=1000),
    )
    rates = state.spec_rates()
    assert rates is not None
    assert rates.acceptance == pytest.approx(200 / 800)
    assert rates.accepted_per_draft == pytest.approx(1.0)
    assert rates.tokens_per_step == pytest.approx(2.0)
    assert rates.per_position == pytest.approx((0.3, 0.2, 0.2, 0.3))
    assert state.prefix_hit_rate() == pytest.approx(400 / 2000)
    shown = snapshot({"gpu": state})["gpu"]
    assert shown["prefix_cache_hit_rate"] == 0.2
    assert shown["spec_decode"] == {
        "acceptance_rate": 0.25,
        "accepted_per_draft": 1.0,
        "tokens_per_step": 2.0,
        "per_position": [0.3, 0.2, 0.2, 0.3],
        "efficiency": None,
    }


def test_the_first_scrape_reads_the_counters_since_the_start() -> None:
    state = state_of(v1_page(100, 250, (90, 70, 55, 35), queries=1000, hits=600))
    rates = state.spec_rates()
    assert rates is not None and rates.acceptance == pytest.approx(250 / 400)
    assert rates.tokens_per_step == pytest.approx(3.5)
    assert state.prefix_hit_rate() == pytest.approx(0.6)


def test_a_counter_reset_reads_the_new_values_as_they_are() -> None:
    """A restarted server's counters start again from zero: a negative difference would be
    garbage, so the new counters stand alone."""
    state = state_of(
        v1_page(1000, 3000, (900, 800, 700, 600), queries=9000, hits=9000),
        v1_page(10, 20, (8, 6, 4, 2), queries=100, hits=25),
    )
    rates = state.spec_rates()
    assert rates is not None
    assert rates.acceptance == pytest.approx(20 / 40)
    assert rates.accepted_per_draft == pytest.approx(2.0)
    assert rates.per_position == pytest.approx((0.8, 0.6, 0.4, 0.2))
    assert state.prefix_hit_rate() == pytest.approx(0.25)
    assert spec_rates(SpecCounters(drafts=5), SpecCounters(drafts=9)).accepted_per_draft is None


def test_legacy_gauges_stand_in_when_counters_cannot_say() -> None:
    """V0: acceptance from its token counters (its gauge without them); no drafts counter, so
    no tokens per step; the efficiency and the prefix cache's hit rate are V0's gauges."""
    state = state_of(PAGE_V0)
    rates = state.spec_rates()
    assert rates is not None
    assert rates.acceptance == pytest.approx(310 / 500)
    assert (rates.accepted_per_draft, rates.tokens_per_step, rates.per_position) == (None, None, ())
    assert rates.efficiency == 0.48
    assert state.prefix_hit_rate() == 0.375
    gauge_only = state_of(PAGE_V0.replace("vllm:spec_decode_num_draft_tokens_total", "x"))
    rates = gauge_only.spec_rates()
    assert rates is not None and rates.acceptance == 0.62  # no token counters: the gauge


def test_an_idle_interval_keeps_the_latest_rates() -> None:
    """No draft and no lookup since the scrape before: the latest interval that had some
    stands (an idle server's rates are not unknown, only a server's whose load is)."""
    state = state_of(
        v1_page(100, 250, (90, 70, 55, 35), queries=1000, hits=600),
        v1_page(300, 450, (150, 110, 95, 95), queries=3000, hits=1000),
    )
    busy = state.spec_rates()
    assert busy is not None and state.prefix_hit_rate() == pytest.approx(0.2)
    load = state.load
    assert load is not None
    state.scraped(replace(load))  # the same counters again
    idle = state.spec_rates()
    assert idle is not None and idle is not busy
    assert (idle.acceptance, idle.tokens_per_step, idle.per_position) == (
        busy.acceptance,
        busy.tokens_per_step,
        busy.per_position,
    )
    assert state.prefix_hit_rate() == pytest.approx(0.2)
    state.failures = 1
    assert (state.spec_rates(), state.prefix_hit_rate()) == (None, None)


def test_missing_series_are_unknown_never_an_error() -> None:
    load = parse_metrics(QUEUE)
    assert (load.prefix_queries, load.prefix_hits, load.prefix_hit_gauge, load.spec) == (
        (None,) * 4
    )
    state = state_of(QUEUE)
    assert (state.spec_rates(), state.prefix_hit_rate(), state.recent_tpot_s()) == (None,) * 3
    shown = snapshot({"gpu": state})["gpu"]
    assert shown["spec_decode"] is None and shown["prefix_cache_hit_rate"] is None
    unknown = ServerState("http://x/metrics", 1.0)  # never scraped
    assert (unknown.spec_rates(), unknown.prefix_hit_rate()) == (None, None)


@pytest.mark.parametrize("bad", ["NaN", "-1", "+Inf", "-Inf"])
def test_garbage_values_are_left_out(bad: str) -> None:
    """NaN, negative and infinite values are left out as unreported; a position that is no
    number (or absurdly large) too; a rate above one is clamped."""
    page = QUEUE + "\n".join(
        [
            f'vllm:spec_decode_num_drafts_total{{model_name="m"}} {bad}',
            'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 40.0',
            f'vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} {bad}',
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="x"} 3',
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="999"} 3',
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 3',
            f'vllm:prefix_cache_queries_total{{model_name="m"}} {bad}',
            'vllm:prefix_cache_hits_total{model_name="m"} 5.0',
            'vllm:spec_decode_draft_acceptance_rate{model_name="m"} 7.5',
            f'vllm:gpu_prefix_cache_hit_rate{{model_name="m"}} {bad}',
            "",
        ]
    )
    load = parse_metrics(page)
    assert load.spec == SpecCounters(draft_tokens=40, per_position=(0.0, 3.0), acceptance_gauge=1.0)
    assert (load.prefix_queries, load.prefix_hits, load.prefix_hit_gauge) == (None, 5.0, None)
    state = state_of(page)
    assert state.prefix_hit_rate() is None
    rates = state.spec_rates()
    assert rates is not None and rates.acceptance == 1.0 and rates.tokens_per_step is None


def test_several_models_add_their_counters() -> None:
    """One server serving two models: the counters add up, the rates come from the sums."""
    one = v1_page(100, 200, (60, 40, 30, 20), queries=100, hits=50)
    two = one.replace('model_name="m"', 'model_name="n"')
    load = parse_metrics(one + two)
    assert load.spec is not None and load.spec.drafts == 200
    assert load.spec.per_position == (120, 80, 60, 40)
    assert parse_metrics(one + two, model="n").spec == parse_metrics(one).spec


def test_measured_tpot_is_the_recent_mean_inter_token_latency() -> None:
    """Between the last two scrapes once enough tokens were seen, else the latest interval
    that saw enough, else since the start."""

    def page(count: float, total: float) -> str:
        return QUEUE + (
            f'vllm:inter_token_latency_seconds_count{{model_name="m"}} {count}\n'
            f'vllm:inter_token_latency_seconds_sum{{model_name="m"}} {total}\n'
        )

    assert state_of(page(10, 1.0)).recent_tpot_s() is None  # too few tokens to tell
    assert state_of(page(100, 5.0)).recent_tpot_s() == pytest.approx(0.05)
    assert state_of(page(100, 5.0), page(300, 7.0)).recent_tpot_s() == pytest.approx(0.01)
    # Only a few new tokens: the mean since the start stands, else the interval before's.
    assert state_of(page(100, 5.0), page(104, 5.2)).recent_tpot_s() == pytest.approx(5.2 / 104)
    carried = state_of(page(100, 5.0), page(300, 7.0), page(304, 7.4))
    assert carried.recent_tpot_s() == pytest.approx(0.01)  # 2 s over the 200 tokens before
    state = state_of(page(100, 5.0))
    assert snapshot({"gpu": state})["gpu"]["tpot_ms"] == 50.0


def test_figures_are_computed_once_per_scrape() -> None:
    state = state_of(v1_page(100, 250, (90, 70, 55, 35), queries=1000, hits=600))
    first = state.spec_rates()
    assert state.spec_rates() is first
    load = state.load
    assert isinstance(load, ServerLoad)
    state.scraped(replace(load))
    assert state.spec_rates() is not first


# --- end to end: a gateway in front of simulated vLLM servers -------------------------------------

SPEC = SimProfile(
    tokens_per_s=200,
    output_tokens=24,
    spec_tokens=4,
    spec_acceptance=0.7,
    prefix_cache_tokens=4096,
)
PLAIN = SimProfile(tokens_per_s=200, output_tokens=8)
PROMPT = "The same long system prompt, again and again. " * 40


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=WATCHDOG_S) as http:
        yield http


async def straight(client: httpx.AsyncClient, sim: Sim, n: int, max_tokens: int = 24) -> None:
    """`n` streamed requests sent to the server itself, one after another, each read to its
    end: counters the gateway did not cause, there before it reads the page."""
    body = {
        "model": "m",
        "stream": True,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": PROMPT}],
    }
    for _ in range(n):
        async with client.stream("POST", sim.base_url + "/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            text = "".join([chunk async for chunk in resp.aiter_text()])
        assert text.rstrip().endswith("data: [DONE]")


def exposed(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The gateway's `/metrics`: (sample name, sorted labels) -> value."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_admin_latency_and_metrics_show_what_the_server_counted(
    client: httpx.AsyncClient,
) -> None:
    """A speculating server with a prefix cache and a plain one: `/admin/latency` and the
    gateway's `/metrics` give the first's acceptance, tokens per step, per-position acceptance
    and prefix-cache hit rate as its own counters make them; the second has no speculative
    decoding figures at all (unknown: null, no series), not zeros."""
    async with sims(SPEC, PLAIN) as (spec, plain):
        await straight(client, spec, 4)
        load = parse_metrics(await spec.page(client))
        assert load.spec is not None and load.spec.drafts
        expected = spec_rates(load.spec, None)
        assert load.prefix_queries and load.prefix_hits  # the same prompt: hits after the first
        hit_rate = load.prefix_hits / load.prefix_queries
        settings = gateway_settings(
            {"gpu": vllm(spec), "cpu": vllm(plain)},
            [
                {"name": "m", "deployments": [{"provider": "gpu", "model": "m"}]},
                {"name": "n", "deployments": [{"provider": "cpu", "model": "m"}]},
            ],
        )
        async with run_gateway(settings) as gateway:
            await spec.read_by_gateway()
            await plain.read_by_gateway()
            shown = (await client.get(gateway.url + "/admin/latency")).json()["vllm"]
            page = exposed((await client.get(gateway.url + "/metrics")).text)
    assert expected.acceptance is not None and expected.tokens_per_step is not None
    assert shown["gpu"]["spec_decode"] == {
        "acceptance_rate": round(expected.acceptance, 4),
        "accepted_per_draft": round(expected.accepted_per_draft or -1, 4),
        "tokens_per_step": round(expected.tokens_per_step, 4),
        "per_position": [round(share, 4) for share in expected.per_position],
        "efficiency": None,
    }
    assert 1.0 < expected.tokens_per_step < 5.0 and len(expected.per_position) == 4
    assert shown["gpu"]["prefix_cache_hit_rate"] == round(hit_rate, 4)
    assert shown["cpu"]["spec_decode"] is None and shown["cpu"]["state"] == "ok"

    def gauge(name: str, provider: str, **labels: str) -> float | None:
        key = tuple(sorted({"provider": provider, **labels}.items()))
        return page.get((name, key))

    assert gauge(VLLM_SPEC_ACCEPTANCE, "gpu") == round(expected.acceptance, 4)
    assert gauge(VLLM_SPEC_TOKENS, "gpu") == round(expected.tokens_per_step, 4)
    for i, share in enumerate(expected.per_position):
        assert gauge(VLLM_SPEC_POSITION, "gpu", position=str(i)) == round(share, 4)
    assert gauge(VLLM_PREFIX_HIT, "gpu") == round(hit_rate, 4)
    assert gauge(VLLM_UP, "gpu") == gauge(VLLM_UP, "cpu") == 1.0
    assert gauge(VLLM_SPEC_ACCEPTANCE, "cpu") is None and gauge(VLLM_SPEC_TOKENS, "cpu") is None
    assert gauge(VLLM_RUNNING, "cpu") == 0.0


async def test_legacy_names_reach_the_gateway_too(client: httpx.AsyncClient) -> None:
    """A server exporting V0's names only: the acceptance from its token counters, V0's
    efficiency gauge, no tokens per step (V0 counts no drafts)."""
    async with sims(SPEC.model_copy(update={"metrics_names": "legacy"})) as (spec,):
        await straight(client, spec, 2)
        load = parse_metrics(await spec.page(client))
        assert load.spec is not None and load.spec.drafts is None
        assert load.spec.accepted is not None and load.spec.draft_tokens
        settings = gateway_settings(
            {"gpu": vllm(spec)}, [{"name": "m", "deployments": [{"provider": "gpu", "model": "m"}]}]
        )
        async with run_gateway(settings) as gateway:
            await spec.read_by_gateway()
            shown = (await client.get(gateway.url + "/admin/latency")).json()["vllm"]["gpu"]
    figures = shown["spec_decode"]
    assert figures["acceptance_rate"] == round(load.spec.accepted / load.spec.draft_tokens, 4)
    assert figures["efficiency"] == round(load.spec.efficiency_gauge or -1, 4)
    assert (figures["tokens_per_step"], figures["per_position"]) == (None, [])


async def test_a_total_budget_is_planned_on_the_measured_tpot(client: httpx.AsyncClient) -> None:
    """The operator's nominal prior says 200 ms per token: 30 tokens could never land within a
    3 s budget. The speculating server measures a few ms per token: planned on that, the
    budget fits (route `primary`). A server that has not decoded enough to tell keeps the
    prior (route `budget_unattainable`)."""
    async with sims(SPEC, SPEC) as (warm, cold):
        await straight(client, warm, 2, max_tokens=30)
        prior = {"ttft_ms": 100, "tpot_ms": 200}
        settings = gateway_settings(
            {"warm": vllm(warm), "cold": vllm(cold)},
            [
                {
                    "name": name,
                    "deployments": [{"provider": name, "model": "m", "prior": prior}],
                    "budget": {"total_ms": 3000},
                }
                for name in ("warm", "cold")
            ],
        )
        async with run_gateway(settings) as gateway:
            await warm.read_by_gateway()
            await cold.read_by_gateway()
            shown = (await client.get(gateway.url + "/admin/latency")).json()["vllm"]
            measured = await ask(client, gateway.url, "warm", max_tokens=30)
            nominal = await ask(client, gateway.url, "cold", max_tokens=30)
    tpot_ms = shown["warm"]["tpot_ms"]
    assert tpot_ms is not None and 0.1 + tpot_ms / 1000 * 29 < 3.0
    assert shown["cold"]["tpot_ms"] is None
    assert served_well(measured) and measured.route == "primary"
    assert served_well(nominal) and nominal.route == "budget_unattainable"

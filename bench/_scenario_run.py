"""One configuration of one scenario of `bench/scenarios.py`: processes, client, figures.

A run starts two upstream processes (`bench/_upstream.py`: `primary` and `fallback`), one or
two `tailguard serve` processes, then sends an open-loop Poisson schedule of streaming chat
completions (short and long prompts, drawn once per scenario so every configuration gets the
same requests in the same order), switching upstream behaviours at set times. Everything a
figure needs is measured client-side (TTFT and total from the scheduled send, the deployment
header) or by the upstreams (requests received, streams closed before their end); the gateway's
own `/admin/latency` is kept beside them as a cross-check.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp

from bench._harness import stream_chat_body
from bench._upstream import (
    BEHAVIOUR_PATH,
    REQUEST_ID_PREFIX,
    STATS_PATH,
    prompt_tokens,
    start_upstream,
)
from bench.tail import KEEPALIVE_S, Outcome, get_json, one_request, percentiles_ms
from gateway.tools.load import run_async
from gateway.tools.stack import Stack, free_port, serve

ROOT: Final = Path(__file__).resolve().parent.parent
UPSTREAMS: Final = ("primary", "fallback")
CLASSES: Final = ("short", "long")
# ~100 and ~16,000 prompt tokens at the simulator's ~4 characters a token.
SHORT_PROMPT: Final = ("Explain in a few sentences why tail latency matters for LLM apps. " * 6)[
    :400
]
LONG_PROMPT: Final = ("Here is a long document to summarise, one sentence after another. " * 985)[
    :64_000
]
REQUEST_TIMEOUT_S: Final = 60.0  # past every budget: a hung request shows as an error
RECOVERY_BIN_S: Final = 1.0
RECOVERED_SHARE: Final = 0.8  # a bin with this share on the primary counts as "traffic back"


@dataclass(frozen=True, slots=True)
class Timing:
    """Offsets are seconds from the first request's scheduled time."""

    warmup_s: float
    duration_s: float  # measured, after the warm-up
    events: tuple[tuple[float, str, str], ...] = ()  # (offset, upstream, behaviour)
    periods: tuple[tuple[str, float, float], ...] = ()  # (name, from, to): figures per period
    recovery_s: float | None = None  # when the primary recovers: time for traffic to return

    @property
    def end_s(self) -> float:
        return self.warmup_s + self.duration_s


@dataclass(frozen=True, slots=True)
class Variant:
    """One gateway configuration: `routing` None is the plain proxy (no budget, no fallback)."""

    name: str
    routing: dict[str, Any] | None = None
    full_only: bool = False  # skipped by --quick


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    title: str
    rps: float
    long_share: float
    max_tokens: int
    primary: dict[str, dict[str, Any]]  # behaviour -> SimProfile fields; "normal" first
    fallback: dict[str, dict[str, Any]]
    budget: dict[str, int]  # ttft_ms / total_ms: the gateway's budget and the client's SLO
    variants: tuple[Variant, ...]
    quick: Timing
    full: Timing
    client_model: str = "chat"
    fallback_model: str = "chat-fallback"
    replicas: int = 1
    targets: Callable[[Scenario, Timing, dict[str, dict[str, Any]]], list[dict[str, Any]]] = field(
        default=lambda scenario, timing, results: []
    )

    @property
    def judged_by(self) -> str:
        """The metric the budget is mostly about: `ttft` when there is a TTFT budget."""
        return "ttft" if "ttft_ms" in self.budget else "total"


@dataclass(frozen=True, slots=True)
class Planned:
    index: int
    offset_s: float
    cls: str  # short | long
    replica: int

    @property
    def phase(self) -> str:
        return "warmup" if self.offset_s < 0 else "measure"


def schedule(scenario: Scenario, timing: Timing, seed: int) -> list[Planned]:
    """Poisson arrivals over the run and a prompt class for each, from `seed` alone."""
    rng = random.Random(seed)
    planned: list[Planned] = []
    t = rng.expovariate(scenario.rps)
    while t < timing.end_s:
        cls = "long" if rng.random() < scenario.long_share else "short"
        # Offsets below 0 are the warm-up, so a measured offset reads as seconds into the
        # measured period and `Timing` offsets stay absolute.
        index = len(planned)
        planned.append(Planned(index, t - timing.warmup_s, cls, index % scenario.replicas))
        t += rng.expovariate(scenario.rps)
    return planned


# --- the gateway ---------------------------------------------------------------------------------


def gateway_config(
    scenario: Scenario, variant: Variant, port: int, ports: dict[str, int], redis_url: str | None
) -> dict[str, Any]:
    model: dict[str, Any] = {
        "name": scenario.client_model,
        "deployments": [{"provider": "primary", "model": scenario.client_model}],
    }
    models = [model]
    if variant.routing is not None:
        model |= {"budget": scenario.budget, "fallbacks": [scenario.fallback_model]}
        model |= variant.routing
        fallback = {"provider": "fallback", "model": scenario.fallback_model}
        models.append({"name": scenario.fallback_model, "deployments": [fallback]})
    latency: dict[str, Any] = {"store": "memory"}
    if redis_url is not None:
        latency = {"store": "redis", "redis_url": redis_url}
    return {
        "server": {"host": "127.0.0.1", "port": port, "reload_on_change": False},
        "latency": latency,
        "providers": {
            name: {"type": "openai", "base_url": f"http://127.0.0.1:{ports[name]}/v1"}
            for name in UPSTREAMS
        },
        "models": models,
    }


# --- the client ----------------------------------------------------------------------------------


async def switch_behaviours(
    session: aiohttp.ClientSession,
    urls: dict[str, str],
    events: Sequence[tuple[float, str, str]],
    t0: float,
    end_s: float,
    done: list[tuple[float, str, str]],
) -> None:
    """POST each behaviour switch at its time; `done` gets the time each one took effect."""
    for offset, upstream, behaviour in sorted(events):
        if offset >= end_s:  # a shortened run ends before it
            break
        if (delay := t0 + offset - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        async with session.post(urls[upstream], json={"name": behaviour}) as response:
            response.raise_for_status()
        done.append((time.perf_counter() - t0, upstream, behaviour))


async def drive(
    scenario: Scenario,
    timing: Timing,
    gateway_urls: Sequence[str],
    behaviour_urls: dict[str, str],
    planned: Sequence[Planned],
) -> tuple[list[Outcome], list[tuple[float, str, str]]]:
    """Send every planned request at its time, whatever happened to the earlier ones."""
    bodies = {
        cls: stream_chat_body(scenario.client_model, scenario.max_tokens, prompt)
        for cls, prompt in (("short", SHORT_PROMPT), ("long", LONG_PROMPT))
    }
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    switched: list[tuple[float, str, str]] = []
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks: list[asyncio.Task[Outcome]] = []
        t0 = time.perf_counter() + 0.05
        # The request offsets start at -warmup; the switch times are absolute from t0.
        switcher = asyncio.create_task(
            switch_behaviours(session, behaviour_urls, timing.events, t0, timing.end_s, switched)
        )
        for p in planned:
            due = t0 + timing.warmup_s + p.offset_s
            if (delay := due - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            request_id = f"{REQUEST_ID_PREFIX}{p.phase[0]}{p.cls[0]}-{p.index:06d}"
            url = gateway_urls[p.replica] + "/v1/chat/completions"
            tasks.append(
                asyncio.create_task(
                    one_request(session, url, bodies[p.cls], request_id, p.phase, due)
                )
            )
        outcomes = list(await asyncio.gather(*tasks))
        await switcher  # every event lies inside the run; an error in one surfaces here
    return outcomes, switched


# --- one configuration ---------------------------------------------------------------------------


def run_variant(
    scenario: Scenario,
    variant: Variant,
    timing: Timing,
    seed: int,
    pin: dict[str, list[str]],
    logs: Path,
    redis_url: str | None,
) -> dict[str, Any]:
    """Fresh upstreams and gateway(s), one client run, the figures (see `summarize`)."""
    stack = Stack(logs=logs, pin=pin, cwd=ROOT)  # the upstreams run as `-m bench._upstream`
    planned = schedule(scenario, timing, seed)
    try:
        ports = {name: free_port() for name in UPSTREAMS}
        # The same seeds in every configuration: the upstreams draw their tails in the same
        # order, so configurations differ in what the gateway does, not in luck.
        start_upstream(stack, "primary", ports["primary"], scenario.primary, seed)
        start_upstream(stack, "fallback", ports["fallback"], scenario.fallback, seed + 100)
        shared = redis_url if variant.routing is not None and scenario.replicas > 1 else None
        gateways = []
        for replica in range(scenario.replicas):
            port = free_port()
            config = gateway_config(scenario, variant, port, ports, shared)
            path = logs / f"gateway-{replica}.yaml"
            path.write_text(json.dumps(config, indent=2) + "\n")  # JSON is YAML
            serve(stack, port, path, log_name=f"gateway-{replica}.log")
            gateways.append(f"http://127.0.0.1:{port}")
        behaviour_urls = {n: f"http://127.0.0.1:{ports[n]}{BEHAVIOUR_PATH}" for n in UPSTREAMS}
        started = time.monotonic()
        outcomes, switched = run_async(drive(scenario, timing, gateways, behaviour_urls, planned))
        took = time.monotonic() - started
        upstream = {n: get_json(f"http://127.0.0.1:{ports[n]}{STATS_PATH}") for n in UPSTREAMS}
        views = [get_json(url + "/admin/latency") for url in gateways]
    finally:
        stack.stop()
    result = summarize(scenario, timing, planned, outcomes, upstream)
    result |= {"variant": variant.name, "wall_s": round(took, 1), "switched": switched}
    result["gateway_view"] = [gateway_figures(view) for view in views]
    result["config"] = config
    return result


def gateway_figures(view: dict[str, Any]) -> dict[str, Any]:
    """What `/admin/latency` says of the same run (over its window), kept as a cross-check."""
    keys = ("requests", "errors", "hedges", "client_requests", "extra_load", "slo", "wasted")
    return {
        kind: {name: {k: stats.get(k) for k in keys} for name, stats in view.get(kind, {}).items()}
        for kind in ("models", "deployments")
    }


# --- figures -------------------------------------------------------------------------------------


def met(scenario: Scenario, outcome: Outcome) -> bool:
    """The client's verdict: answered in full within every budget the scenario sets."""
    if outcome.error is not None or outcome.ttft_s is None or outcome.total_s is None:
        return False
    ttft_ms, total_ms = scenario.budget.get("ttft_ms"), scenario.budget.get("total_ms")
    if ttft_ms is not None and outcome.ttft_s * 1000 > ttft_ms:
        return False
    return total_ms is None or outcome.total_s * 1000 <= total_ms


def provider_of(outcome: Outcome) -> str:
    if outcome.deployment is None:
        return f"(status {outcome.status})" if outcome.status else "(no response)"
    return outcome.deployment.partition("/")[0]


def group_figures(scenario: Scenario, rows: Sequence[tuple[Planned, Outcome]]) -> dict[str, Any]:
    """TTFT and total percentiles, attainment, errors and deployment shares of `rows`."""
    n = len(rows)
    outcomes = [o for _, o in rows]
    ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    complete = [o.total_s for o in outcomes if o.total_s is not None and o.error is None]
    met_count = sum(met(scenario, o) for o in outcomes)
    shares = Counter(provider_of(o) for o in outcomes)
    return {
        "requests": n,
        # A request without a first token (or a complete answer) ranks above every other.
        "ttft_ms": percentiles_ms(ttfts, missing=n - len(ttfts)),
        "total_ms": percentiles_ms(complete, missing=n - len(complete)),
        "met": met_count,
        "misses": n - met_count,
        "attainment": met_count / n if n else None,
        "errors": sum(o.error is not None for o in outcomes),
        "error_samples": [o.error for o in outcomes if o.error is not None][:3],
        "share": {name: count / n for name, count in shares.most_common()} if n else {},
    }


def recovery_time(
    scenario: Scenario, timing: Timing, rows: Sequence[tuple[Planned, Outcome]]
) -> float | None:
    """Seconds from the primary's recovery to the first 1 s bin from which every full bin
    serves >= 80% of its requests on the primary; None if that never happens in the run."""
    if timing.recovery_s is None:
        return None
    start = timing.recovery_s - timing.warmup_s  # as a request offset
    end = timing.duration_s
    bins = int((end - start) // RECOVERY_BIN_S)
    good: list[bool] = []
    for k in range(bins):
        lo = start + k * RECOVERY_BIN_S
        hits = [o for p, o in rows if lo <= p.offset_s < lo + RECOVERY_BIN_S]
        on_primary = sum(provider_of(o) == "primary" for o in hits)
        good.append(bool(hits) and on_primary >= RECOVERED_SHARE * len(hits))
    for k in range(bins):
        if all(good[k:]):
            return k * RECOVERY_BIN_S if k < bins else None
    return None


def summarize(
    scenario: Scenario,
    timing: Timing,
    planned: Sequence[Planned],
    outcomes: Sequence[Outcome],
    upstream: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """Figures over the measured period, per prompt class and overall, and per period."""
    pairs = list(zip(planned, outcomes, strict=True))
    measured = [(p, o) for p, o in pairs if p.phase == "measure"]
    by_class = {
        cls: group_figures(scenario, [(p, o) for p, o in measured if p.cls == cls])
        for cls in CLASSES
        if any(p.cls == cls for p, _ in measured)
    }
    sent_tokens = {
        "short": prompt_tokens(stream_chat_body(scenario.client_model, 1, SHORT_PROMPT)),
        "long": prompt_tokens(stream_chat_body(scenario.client_model, 1, LONG_PROMPT)),
    }
    # What the upstreams received for the measured requests, by class and upstream.
    received: dict[str, Counter[str]] = {}
    for name, stats in upstream.items():
        for row in stats["rows"]:
            if row["phase"] != "measure":
                continue
            for key in ("requests", "prompt_tokens", "wasted", "wasted_tokens"):
                received.setdefault(row["class"], Counter())[key] += int(row[key])
                received.setdefault(row["class"], Counter())[f"{name}.{key}"] += int(row[key])
            for key in ("wasted_before_first", "wasted_before_first_tokens"):
                received.setdefault(row["class"], Counter())[key] += int(row[key])

    def upstream_figures(cls: str | None, n: int) -> dict[str, Any]:
        counts: Counter[str] = Counter()
        for name, c in received.items():
            if cls is None or name == cls:
                counts.update(c)
        useful = sum(sent_tokens[c] * by_class[c]["requests"] for c in by_class if cls in (None, c))
        return {
            "upstream_requests": counts["requests"],
            "extra_upstream_fraction": counts["requests"] / n - 1.0 if n else None,
            "primary_requests": counts["primary.requests"],
            "fallback_requests": counts["fallback.requests"],
            "wasted_streams": counts["wasted"],
            "wasted_prompt_tokens": counts["wasted_tokens"],
            "wasted_before_first_token": counts["wasted_before_first_tokens"],
            "client_prompt_tokens": useful,
            "wasted_fraction": counts["wasted_tokens"] / useful if useful else None,
        }

    for cls, figures in by_class.items():
        figures |= upstream_figures(cls, figures["requests"])
    overall = group_figures(scenario, measured) | upstream_figures(None, len(measured))
    periods = {
        name: group_figures(
            scenario,
            [(p, o) for p, o in pairs if lo <= p.offset_s + timing.warmup_s < hi],
        )
        for name, lo, hi in timing.periods
    }
    warm = [o for p, o in pairs if p.phase == "warmup"]
    return {
        "overall": overall,
        "classes": by_class,
        "periods": periods,
        "recovery_s": recovery_time(scenario, timing, measured),
        "send_lag_ms": percentiles_ms([max(o.lag_s, 0.0) for o in outcomes]),
        "warmup": {"requests": len(warm), "errors": sum(o.error is not None for o in warm)},
        "upstream_stats": upstream,
        "timeline": timeline(scenario, timing, pairs),
    }


def timeline(
    scenario: Scenario, timing: Timing, pairs: Sequence[tuple[Planned, Outcome]]
) -> list[dict[str, Any]]:
    """Per second of the run: requests, misses and the share on the primary (for plots)."""
    seconds: dict[int, list[Outcome]] = {}
    for p, o in pairs:
        seconds.setdefault(int(p.offset_s + timing.warmup_s), []).append(o)
    return [
        {
            "t": t,
            "requests": len(os),
            "misses": sum(not met(scenario, o) for o in os),
            "primary": round(sum(provider_of(o) == "primary" for o in os) / len(os), 3),
        }
        for t, os in sorted(seconds.items())
    ]

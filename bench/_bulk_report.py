"""bench/bulk.py's verdicts and its Markdown report."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from bench._bulk_phase import SETTLE_S
from bench._bulk_setup import (
    BATCHING,
    BULK_CHAT_CLIENTS,
    BULK_EMBED_CLIENTS,
    BULK_EMBED_INPUTS,
    BULK_PRIORITY,
    METRICS_INTERVAL_S,
    SIM_PROFILE,
    TTFT_BUDGET_MS,
)
from gateway.latency.sketch import nearest_rank

SPEEDUP_TARGET: Final = 5.0
# Interactive TTFT p99 with bulk on, against alone, per server mode.
TTFT_RATIO_TARGETS: Final[Mapping[str, float]] = {
    "priority": 1.3,
    "priority-preempt": 1.2,
    "fifo": 2.0,
}
# Bulk throughput with interactive traffic vs alone, per server mode that has a target.
BULK_KEPT_TARGETS: Final[Mapping[str, float]] = {"priority": 0.5, "priority-preempt": 0.7}
NOISY_LAG_MS: Final = 10.0

Phases = dict[str, dict[str, Any]]  # by phase name
ModePhases = dict[str, Phases]  # by server mode


def ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def fmt_ms(value: float | None) -> str:
    return "no token" if value is None else f"{value:.1f} ms"


def bulk_rates(phase: Mapping[str, Any]) -> tuple[float | None, float | None]:
    """(embeddings inputs/s, chat requests/s) of a phase's bulk load."""
    bulk = phase.get("bulk_results") or {}
    emb, chat = bulk.get("bulk embeddings"), bulk.get("bulk chat")
    return (
        emb["throughput_rps"] * emb["inputs_per_request"] if emb else None,
        chat["throughput_rps"] if chat else None,
    )


def bulk_kept(phases: Phases) -> tuple[float | None, float | None]:
    """With interactive traffic, the share of bulk alone's throughput (embeddings, chat)."""
    if "with bulk" not in phases or "bulk alone" not in phases:
        return None, None
    loaded, alone = bulk_rates(phases["with bulk"]), bulk_rates(phases["bulk alone"])
    return (
        loaded[0] / alone[0] if loaded[0] is not None and alone[0] else None,
        loaded[1] / alone[1] if loaded[1] is not None and alone[1] else None,
    )


def ttft_ratio(phases: Phases, name: str = "with bulk") -> float | None:
    alone = phases["alone"]["ttft_ms"]["p99"]
    loaded = phases[name]["ttft_ms"]["p99"]
    return loaded / alone if alone and loaded is not None else None


def verdicts(a: dict[str, Any] | None, b: ModePhases | None) -> list[dict[str, Any]]:
    out = []
    if a is not None:
        out.append(
            {
                "target": f"batched throughput >= {SPEEDUP_TARGET:g}x unbatched",
                "value": a["speedup"],
                "limit": SPEEDUP_TARGET,
                "pass": a["speedup"] >= SPEEDUP_TARGET,
            }
        )
    for mode, phases in (b or {}).items():
        limit = TTFT_RATIO_TARGETS[mode]
        ratio = ttft_ratio(phases)
        out.append(
            {
                "target": f"{mode}: interactive TTFT p99 with bulk <= {limit:g}x alone",
                "value": ratio,
                "limit": limit,
                "pass": ratio is not None and ratio <= limit,
            }
        )
        target = BULK_KEPT_TARGETS.get(mode)
        if target is None:
            continue
        alone = bulk_rates(phases["bulk alone"]) if "bulk alone" in phases else (None, None)
        for kind, kept, ran in zip(
            ("embeddings inputs/s", "chat/s"), bulk_kept(phases), alone, strict=True
        ):
            if ran is None:
                continue  # no such bulk load in this run
            out.append(
                {
                    "target": f"{mode}: bulk {kind} with interactive >= {target:.0%} of bulk alone",
                    "value": kept,
                    "limit": target,
                    "pass": kept is not None and kept >= target,
                }
            )
    return out


def _part_a(opts: Any, a: dict[str, Any]) -> None:
    print()
    print(
        f"Part A: {opts.requests} single-input embeddings requests, {opts.workers} clients "
        "back to back"
    )
    print()
    print("| path | throughput (req/s) | p50 | p99 | inputs per upstream call | errors |")
    print("|---|---:|---:|---:|---:|---:|")
    for label in ("unbatched", "batched"):
        r = a[label]
        latency = r["latency_ms"]
        print(
            f"| {label} | {r['throughput_rps']:.0f} | {fmt_ms(latency.get('p50'))} "
            f"| {fmt_ms(latency.get('p99'))} | {r['inputs_per_call']:.1f} | {r['errors']} |"
        )
    print(f"\nspeedup: {a['speedup']:.1f}x")


def _row(mode: str, name: str, phase: dict[str, Any], alone: float | None, kept: str) -> str:
    ttft = phase["ttft_ms"]
    emb, chat = bulk_rates(phase)
    emb_s = "-" if emb is None else f"{emb:.0f}"
    chat_s = "-" if chat is None else f"{chat:.1f}"
    gate = phase["gate"]
    gate_s = (
        f"{gate['limit_min']:.0f} / {gate['limit_median']:.0f} / {gate['limit_max']:.0f}"
        if gate
        else "-"
    )
    cpu = phase["gateway_cpu"]
    cpu_s = "-" if cpu is None else f"{cpu:.0%}"
    gate_s += f" | {phase.get('preemptions', 0):.0f}"
    if ttft is None:  # bulk alone: no interactive traffic
        blank = " - |" * 6
        return f"| {mode} | {name} |{blank} {emb_s} | {chat_s} | {kept} | {gate_s} | {cpu_s} |"
    ratio = f"{ttft['p99'] / alone:.2f}x" if ttft["p99"] is not None and alone else "-"
    settled = phase["ttft_ms_settled"]
    settled_s = fmt_ms(settled["p99"]) + (
        f" ({settled['p99'] / alone:.2f}x)" if settled["p99"] is not None and alone else ""
    )
    if not settled["count"]:
        settled_s = "-"  # the window is shorter than SETTLE_S
    return (
        f"| {mode} | {name} | {fmt_ms(ttft['p50'])} | {fmt_ms(ttft['p90'])} "
        f"| {fmt_ms(ttft['p99'])} | {ratio} | {settled_s} | {phase['interactive']['errors']} "
        f"| {emb_s} | {chat_s} | {kept} | {gate_s} | {cpu_s} |"
    )


def _warnings(mode: str, name: str, phase: dict[str, Any]) -> None:
    shares = phase["cpu_share"]
    side = sum(v or 0.0 for k, v in shares.items() if k != "gateway")
    where = f"{mode}, {name}"
    if side > 0.8:
        print(
            f"{where}: warning: CPU 1 (upstream {shares['upstream'] or 0:.0%}, bulk load "
            f"{shares.get('bulk load') or 0:.0%}) was busy: the upstream's timers may run late"
        )
    interactive = phase["interactive"]
    if interactive is not None:
        lag = (interactive.get("send_lag_ms") or {}).get("p99", 0.0)
        if lag > NOISY_LAG_MS:
            print(f"{where}: warning: the client started requests late (p99 {lag:.1f} ms)")
        if interactive["errors"]:
            print(f"{where}: interactive errors: {interactive['error_samples'][:1]}")
    for load in (phase.get("bulk_results") or {}).values():
        if load["errors"]:
            print(f"{where}: bulk errors {load['errors']}: {load['error_samples'][:1]}")


def report(
    opts: Any, a: dict[str, Any] | None, b: ModePhases | None, checks: list[dict[str, Any]]
) -> None:
    print()
    print(
        "Upstream: one `tailguard sim` per server mode (fifo: `scheduling_policy: fcfs`; "
        "priority: `scheduling_policy: priority`, preempting only for KV room as vLLM V1 does; "
        "priority-preempt: also at a full batch, `priority_preemption: max_num_seqs`; bulk "
        f"sent with `priority` {BULK_PRIORITY}), 4 slots shared by embeddings (20 ms + 0.2 "
        "ms/input) and chat (60 ms + 0.2 ms/token prefill, 10 ms/token); the gateway reads "
        "its /metrics every "
        f"{METRICS_INTERVAL_S:g} s; batching max_batch_size {BATCHING['max_batch_size']}, "
        f"max_wait_ms {BATCHING['max_wait_ms']}, max_inflight {BATCHING['max_inflight']}"
    )
    if a is not None:
        _part_a(opts, a)
    if b:
        print()
        print(
            f"Part B: interactive streaming chat, {opts.rps:g}/s Poisson, {opts.duration_s:g} s "
            f"per phase; TTFT budget {TTFT_BUDGET_MS} ms; bulk = {BULK_CHAT_CLIENTS} clients of "
            f"bulk chat ({BULK_EMBED_CLIENTS} clients x {BULK_EMBED_INPUTS}-input embeddings in "
            "the diagnostics)"
        )
        print()
        print(
            f"| server | phase | TTFT p50 | p90 | p99 | p99 vs alone | p99 after {SETTLE_S:g} s "
            "| errors | bulk embeddings (inputs/s) | bulk chat (req/s) | bulk vs bulk alone "
            "| gate limit min/median/max | bulk preempted | gateway CPU |"
        )
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|")
        for mode, phases in b.items():
            alone = phases["alone"]["ttft_ms"]["p99"]
            emb_kept, chat_kept = bulk_kept(phases)
            for name, phase in phases.items():
                kept = "-"
                if name == "with bulk" and (emb_kept is not None or chat_kept is not None):
                    kept = " / ".join(
                        "-" if k is None else f"{k:.0%}" for k in (emb_kept, chat_kept)
                    )
                print(_row(mode, name, phase, alone, kept))
        for mode, phases in b.items():
            for name, phase in phases.items():
                _warnings(mode, name, phase)
                gate = phase["gate"]
                if gate and "bulk chat" in (phase.get("bulk_results") or {}):
                    print(
                        f"{mode}, {name}: gate limit >= the server's {SIM_PROFILE['max_batch']} "
                        f"slots in {gate['share_at_or_above_slots']:.0%} of samples; bulk "
                        f"waiting at the gate, median {gate['waiting_median']:.0f}"
                    )
                if gate and gate.get("server_preempts_share") is not None:
                    after = gate["distrusted_after_s"]
                    print(
                        f"{mode}, {name}: the gate believed the server preempts bulk in "
                        f"{gate['server_preempts_share']:.0%} of samples"
                        + ("" if after is None else f" (first doubted {after:.2f} s in)")
                    )
        count = next(iter(b.values()))["alone"]["ttft_ms"]["count"]
        if count < 1000:
            k = count - nearest_rank(0.99, count) + 1
            which = "the largest value" if k == 1 else f"the {ordinal(k)} largest value"
            print(f"note: p99 of {count} requests is {which}; run longer for a steadier figure")
    print()
    print("| target | value | verdict |")
    print("|---|---:|---|")
    for check in checks:
        value = "-" if check["value"] is None else f"{check['value']:.2f}"
        if check["value"] is not None and "%" in check["target"]:
            value = f"{check['value']:.0%}"
        elif check["value"] is not None:
            value += "x"
        print(f"| {check['target']} | {value} | {'PASS' if check['pass'] else 'MISS'} |")

"""`tailguard sim` (the simulated LLM server) and `tailguard simulate ...` (offline simulations
of a serving effect)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from gateway.cli.common import err


def sim(
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    profile: Annotated[
        Path | None, typer.Option(help="YAML file with a default profile and named profiles.")
    ] = None,
    seed: Annotated[int | None, typer.Option(help="Seed for reproducible runs.")] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            metavar="FIELD=VALUE",
            help="Override a field of the default profile, e.g. --set tokens_per_s=50 "
            "--set slow_rate=0.08 --set slow_ms=2000-4000 (repeatable).",
        ),
    ] = None,
) -> None:
    """Run the simulated OpenAI-compatible LLM server (prefill, decode, batching, faults)."""
    from gateway.sim.engine import SimEngine
    from gateway.sim.profile import SimProfile, apply_overrides
    from gateway.sim.server import load_profiles, run_sim

    profiles: dict[str, SimProfile] = {}
    default = SimProfile()
    file_seed = None
    if profile is not None:
        try:
            profiles, default, file_seed = load_profiles(str(profile))
        except (OSError, ValueError) as exc:
            err.print(f"error: {profile}: {exc}", highlight=False, markup=False)
            raise typer.Exit(code=2) from None
    if set_:
        try:
            default = apply_overrides(default, ",".join(set_))
        except ValueError as exc:
            err.print(f"error: --set: {exc}", highlight=False, markup=False)
            raise typer.Exit(code=2) from None
    engine = SimEngine(profiles, default, seed=seed if seed is not None else file_seed)
    err.print(f"Simulated LLM server on http://{host}:{port}/v1", highlight=False)
    run_sim(host, port, engine)


simulate_app = typer.Typer(
    name="simulate",
    help="Offline simulations that explain a serving effect (no network, no GPU).",
    no_args_is_help=True,
)


@simulate_app.command("batching")
def simulate_batching(
    requests: Annotated[
        int, typer.Option(min=1, max=1_000_000, help="Requests, all queued at tick 0.")
    ] = 60,
    max_batch: Annotated[int, typer.Option(min=1, help="Sequences decoded at once.")] = 8,
    min_tokens: Annotated[int, typer.Option(min=1, help="Shortest random output length.")] = 10,
    max_tokens: Annotated[int, typer.Option(min=1, help="Longest random output length.")] = 200,
    seed: Annotated[int, typer.Option(help="Seed of the random output lengths.")] = 1,
    json_: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
) -> None:
    """Static vs continuous batching on a simulated GPU, with random then equal output lengths."""
    from gateway.tools.batching import MODES, run_experiment

    if min_tokens > max_tokens:
        err.print(
            f"error: --min-tokens {min_tokens} is above --max-tokens {max_tokens}",
            highlight=False,
            markup=False,
        )
        raise typer.Exit(code=2)
    experiment = run_experiment(requests, max_batch, min_tokens, max_tokens, seed)
    report = experiment.to_json()
    if json_:
        typer.echo(json.dumps(report, indent=2))
        return
    table = Table(
        title=f"Static vs continuous batching: {requests} requests at tick 0, batch {max_batch}, "
        f"seed {seed}",
        title_justify="left",
        caption="Times in ticks. wait: arrival to first token; compl.: arrival to last token; "
        "slot use: decoded tokens / (batch x ticks), idle slots not counted.",
        caption_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    table.add_column("output\nlengths", no_wrap=True)
    table.add_column("\nmode", no_wrap=True)
    for column in ("mean\nwait", "mean\ncompl.", "p50\ncompl.", "p99\ncompl.", "total\nticks"):
        table.add_column(column, justify="right", no_wrap=True)
    table.add_column("slot\nuse", justify="right", no_wrap=True)
    table.add_column("tokens\n/ tick", justify="right", no_wrap=True)
    for key, runs in (("varied", experiment.varied), ("equal", experiment.equal)):
        lengths = report[key]["lengths"]
        if key == "varied":
            labels = (f"{lengths['min']}-{lengths['max']}", f"mean {lengths['mean']:.0f}")
        else:
            labels = ("all equal", f"{lengths['min']} each")
        for label, mode in zip(labels, MODES, strict=True):
            run = runs[mode]
            table.add_row(
                label,
                mode,
                f"{run.mean_wait:.0f}",
                f"{run.mean_completion:.0f}",
                str(run.completion_percentile(0.50)),
                str(run.completion_percentile(0.99)),
                str(run.total_ticks),
                f"{run.utilisation:.0%}",
                f"{run.tokens_per_tick:.2f}",
            )
        table.add_section()
    out = Console()
    out.print(table)
    out.print()
    out.print(report["conclusion"], highlight=False, markup=False)


@simulate_app.command("speculative")
def simulate_speculative(
    k: Annotated[int, typer.Option(min=1, max=64, help="Draft tokens proposed per step.")] = 4,
    acceptance: Annotated[
        str,
        typer.Option(
            metavar="RATE,...",
            help="Acceptance rates to tabulate (the chance each draft token is right), "
            "comma-separated, each in [0, 1].",
        ),
    ] = "0.05,0.2,0.4,0.6,0.8,0.9",
    verify_cost: Annotated[
        float,
        typer.Option(min=0.0, help="Cost of verifying one draft token, in plain decode steps."),
    ] = 0.02,
    draft_cost: Annotated[
        float, typer.Option(min=0.0, help="Cost of drafting one token, in plain decode steps.")
    ] = 0.05,
    steps: Annotated[
        int, typer.Option(min=1, max=10_000_000, help="Simulated steps per acceptance rate.")
    ] = 5000,
    seed: Annotated[int, typer.Option(help="Seed of the simulated drafts.")] = 1,
    json_: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
) -> None:
    """Speculative decoding: tokens per step, step cost and speedup against the acceptance rate,
    from the formula and from simulated drafts."""
    from gateway.tools.speculative import run_experiment

    try:
        rates = [float(part) for part in acceptance.split(",") if part.strip()]
        experiment = run_experiment(
            k, rates, verify_cost=verify_cost, draft_cost=draft_cost, steps=steps, seed=seed
        )
    except ValueError as exc:
        err.print(f"error: --acceptance: {exc}", highlight=False, markup=False)
        raise typer.Exit(code=2) from None
    report = experiment.to_json()
    if json_:
        typer.echo(json.dumps(report, indent=2))
        return
    table = Table(
        title=f"Speculative decoding: {k} draft tokens per step, verify cost {verify_cost:g}, "
        f"draft cost {draft_cost:g} (per token, in plain steps), {steps} steps per rate, "
        f"seed {seed}",
        title_justify="left",
        caption="acceptance: chance each draft token is right; step cost in plain decode steps; "
        "speedup: tokens per step / step cost (below 1: slower); vLLM acc.: accepted / draft "
        "tokens, as vLLM's counters read.",
        caption_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    for column in (
        "accep-\ntance",
        "tokens\n/ step",
        "step\ncost",
        "\nspeedup",
        "measured\ntokens/step",
        "measured\nspeedup",
        "vLLM\nacc.",
    ):
        table.add_column(column, justify="right", no_wrap=True)
    for row in experiment.rows:
        s = row.speculation
        table.add_row(
            f"{s.alpha:g}",
            f"{s.tokens_per_step:.2f}",
            f"{s.step_cost:.2f}",
            f"{s.speedup:.2f}x",
            f"{row.measured_tokens_per_step:.2f}",
            f"{row.measured_speedup:.2f}x",
            f"{row.measured_acceptance:.2f}",
        )
    out = Console()
    out.print(table)
    out.print()
    out.print(report["conclusion"], highlight=False, markup=False)

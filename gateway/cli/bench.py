"""`tailguard bench ...`: benchmarks of a real gateway against a simulated upstream."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from gateway.cli.common import err

bench_app = typer.Typer(
    name="bench",
    help="Benchmarks that run a real gateway against a simulated upstream on this machine.",
    no_args_is_help=True,
)


@bench_app.command("batching")
def bench_batching(
    duration: Annotated[
        float, typer.Option(min=1.0, help="Seconds per (workload, max_wait_ms) step.")
    ] = 10.0,
    json_: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Sweep `max_wait_ms` over 5, 20 and 100 ms for a sparse interactive load and a bulk load;
    print p99 latency and throughput for each, and the setting to use for each workload."""
    from gateway.tools.bench import run_batching_bench

    def progress(line: str) -> None:
        err.print(escape(line), highlight=False)

    report = run_batching_bench(duration_s=duration, progress=None if json_ else progress)
    if json_:
        Console().print_json(report.to_json())
        return
    Console(width=400).print(escape(report.markdown()), highlight=False, soft_wrap=True)

"""`tailguard bench ...`: benchmarks of a real gateway against a simulated upstream."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape

from gateway.cli.common import err, print_wide

if TYPE_CHECKING:
    from gateway.tools.bench import BatchingBenchReport

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
    print_report(report)


def print_report(report: BatchingBenchReport, out: Console | None = None) -> None:
    """The measurements as a table, then the recommendation for each workload."""
    from rich import box
    from rich.table import Table

    from gateway.tools.bench import COLUMNS

    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1))
    for i, column in enumerate(COLUMNS):
        table.add_column(column, justify="left" if i == 0 else "right")
    for row in report.cells():
        table.add_row(*map(escape, row))
    out = out or Console()
    print_wide([table], out)
    for line in report.conclusions():
        out.print(escape(line), highlight=False, soft_wrap=True)

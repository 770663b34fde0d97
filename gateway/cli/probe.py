"""`tailguard probe`: measure any OpenAI-compatible endpoint's TTFT and total time, separating
prefill cost from decode cost."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gateway.cli.common import err


def probe(
    url: Annotated[
        str, typer.Argument(help="OpenAI-compatible base URL, e.g. http://localhost:8080/v1.")
    ],
    model: Annotated[str, typer.Option("--model", "-m", help="Model name to request.")],
    requests: Annotated[int, typer.Option(min=1, help="Requests per condition.")] = 20,
    concurrency: Annotated[
        int, typer.Option(min=1, help="Requests in flight at once (1: one after another).")
    ] = 1,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="TAILGUARD_PROBE_API_KEY", show_default=False, help="Sent as a Bearer token."
        ),
    ] = None,
    header: Annotated[
        list[str] | None,
        typer.Option(
            "--header",
            "-H",
            metavar="'NAME: VALUE'",
            help="Extra header 'name: value', e.g. -H 'x-tailguard-ttft-budget-ms: 800' "
            "(repeatable).",
        ),
    ] = None,
    timeout: Annotated[float, typer.Option(min=0.001, help="Per-request timeout (s).")] = 120.0,
    out: Annotated[
        Path | None, typer.Option(help="Write the Markdown latency report to this file.")
    ] = None,
    json_: Annotated[
        bool, typer.Option("--json", help="Print the summary as JSON instead of a table.")
    ] = False,
) -> None:
    """Measure TTFT and total time: short prompt, ~2-page prompt (prefill), long answer (decode)."""
    import asyncio

    from rich.box import SIMPLE_HEAD
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from gateway.tools.probe import CONDITIONS, run_probe, summarize
    from gateway.tools.probe_report import SUMMARY_COLUMNS, markdown_report, summary_rows

    if not url.startswith(("http://", "https://")):
        err.print(
            f"error: {url}: expected an http:// or https:// URL", highlight=False, markup=False
        )
        raise typer.Exit(code=2)
    extra: dict[str, str] = {}
    for item in header or []:
        name, sep, value = item.partition(":")
        if not sep or not name.strip():
            err.print(f"error: --header {item!r}: expected 'name: value'", markup=False)
            raise typer.Exit(code=2)
        extra[name.strip()] = value.strip()

    # Progress goes to stderr so that `--json` output on stdout stays parseable.
    with Progress(
        TextColumn("{task.description:<12}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
    ) as bar:
        tasks = {name: bar.add_task(name, total=requests) for name in CONDITIONS}

        def progress(condition: str, done: int, total: int) -> None:
            bar.update(tasks[condition], completed=done, total=total)

        results = asyncio.run(
            run_probe(
                url,
                model,
                requests=requests,
                concurrency=concurrency,
                api_key=api_key,
                headers=extra,
                timeout_s=timeout,
                progress=progress,
            )
        )
    summary = summarize(results)
    if out is not None:
        out.write_text(markdown_report(summary, base_url=url, model=model), encoding="utf-8")
        err.print(f"Report written to {out}", highlight=False, markup=False)
    if json_:
        typer.echo(json.dumps(summary, indent=2))
    else:
        table = Table(
            title=escape(f"{model} at {url} (ms)"),
            title_justify="left",
            box=SIMPLE_HEAD,
            pad_edge=False,
            collapse_padding=True,
        )
        for i, column in enumerate(SUMMARY_COLUMNS):
            # One word per header line keeps the table within 80 columns without cutting numbers.
            table.add_column(
                column.replace(" ", "\n"), justify="left" if i == 0 else "right", no_wrap=True
            )
        for row in summary_rows(summary):
            table.add_row(*(escape(cell) for cell in row))
        Console().print(table)
    failed = [r for r in results if not r.ok]
    if failed:
        examples = sorted({r.error or "unknown error" for r in failed})[:3]
        err.print(
            f"{len(failed)} of {len(results)} requests failed: " + "; ".join(examples),
            highlight=False,
            markup=False,
        )
    if len(failed) == len(results):
        raise typer.Exit(code=1)  # nothing was measured

"""`tailguard stats` and `tailguard report`: read a running gateway's latency statistics (its
`/admin/latency` and `/metrics` pages) and show them as tables or as a written report."""

from __future__ import annotations

import json
import os
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gateway.cli.common import ADMIN_KEY_ENV, DEFAULT_GATEWAY_URL, err, redact_url


def stats(
    url: Annotated[str, typer.Option(help="Base URL of a running gateway.")] = DEFAULT_GATEWAY_URL,
    json_: Annotated[
        bool, typer.Option("--json", help="Print the raw JSON of GET /admin/latency.")
    ] = False,
) -> None:
    """Show a running gateway's SLO attainment per model, then its rolling latency percentiles,
    per deployment and per model. With API keys configured, set the admin key in
    $TAILGUARD_ADMIN_KEY."""
    body = _fetch_latency(url, admin_key=os.environ.get(ADMIN_KEY_ENV))
    if json_:
        typer.echo(body.decode(errors="replace"))
        return
    try:
        snapshot = json.loads(body)
        tables = [_attainment_table(snapshot), *_latency_tables(snapshot)]
        header = (
            f"window {snapshot['window_s']:g} s, source {snapshot['source']}, "
            f"snapshot age {snapshot['age_s']:.1f} s; latencies in ms"
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        _unexpected_answer(url, exc)
    out = Console()
    if not out.is_terminal:  # piped: print whole rows rather than squeeze them into 80 columns
        wide = out.options.update_width(10_000)
        out = Console(width=max(out.width, *(out.measure(t, options=wide).maximum for t in tables)))
    out.print(header, highlight=False, markup=False)
    for table in tables:
        out.print(table)


def _unexpected_answer(url: str, exc: Exception) -> NoReturn:
    """The admin page answered, but not with what `stats` and `report` read: say so and exit 1."""
    err.print(
        f"error: {_latency_url(url)}: unexpected answer ({exc!r})",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )
    raise typer.Exit(code=1) from None


def _latency_url(url: str) -> str:
    base = url if "://" in url else "http://" + url
    return base.rstrip("/") + "/admin/latency"


def _fetch_latency(url: str, timeout_s: float = 3.0, *, admin_key: str | None = None) -> bytes:
    """The body of `GET {url}/admin/latency`; a one-line error and exit code 1 if unreachable."""
    try:
        return fetch(url, "/admin/latency", admin_key=admin_key, timeout_s=timeout_s)
    except FetchError as exc:
        err.print(f"error: {exc}", highlight=False, markup=False, soft_wrap=True)
        raise typer.Exit(code=1) from None


def _latency_tables(snapshot: dict[str, Any]) -> list[Table]:
    """One table of deployments and one of model names, a row each; then, for deployments whose
    prompt sizes could be fitted, TTFT as base + slope x size."""
    tables = []
    for title, group in (("Deployments", "deployments"), ("Models", "models")):
        targets: dict[str, dict[str, Any]] = snapshot[group]
        table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=0)
        # Long names fold onto more lines rather than squeeze the numbers out of a narrow terminal.
        longest = max(map(len, targets), default=0)
        table.add_column("\n" + title[:-1].lower(), overflow="fold", min_width=min(longest, 16))
        for column in _STATS_COLUMNS:
            table.add_column(column, justify="right", no_wrap=True)
        table.add_column("\ntrusted", no_wrap=True)
        for name, target in targets.items():
            ttft, tpot, total = target["ttft_ms"], target["tpot_ms"], target["total_ms"]
            table.add_row(
                escape(name),
                *(_quantile(ttft, q) for q in ("p50", "p90", "p99")),
                *(_quantile(tpot, q) for q in ("p50", "p99")),
                *(_quantile(total, q) for q in ("p50", "p99")),
                _n(target["requests"]),
                _n(target["errors"]),
                _n(target["inflight"]),
                "yes" if target["trusted"] else "no",
            )
        tables.append(table)
    return [*tables, *_model_table(snapshot["deployments"])]


def _model_table(deployments: dict[str, dict[str, Any]]) -> list[Table]:
    """TTFT as a function of the prompt's size, per deployment with two trusted size bands."""
    rows = []
    for name, target in deployments.items():
        fitted = target.get("ttft_model") or {}
        cells = [
            f"{line['base_ms']:.0f} ms + {line['ms_per_kib']:.2f} ms/KiB"
            if (line := fitted.get(q))
            else "-"
            for q in ("p50", "p99")
        ]
        if cells != ["-", "-"]:
            rows.append((escape(name), *cells))
    if not rows:
        return []
    table = Table(
        title="TTFT by prompt size (fitted)", title_justify="left", box=box.SIMPLE_HEAD, padding=0
    )
    for column in ("deployment", "p50", "p99"):
        table.add_column(column, no_wrap=column != "deployment", overflow="fold")
    for row in rows:
        table.add_row(*row)
    return [table]


# Two header lines: the metric's name stands above its first percentile only.
_STATS_COLUMNS = (
    "TTFT\np50",
    "\np90",
    "\np99",
    "TPOT\np50",
    "\np99",
    "total\np50",
    "\np99",
    "\nrequests",
    "\nerrors",
    "\ninflight",
)


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if value < 100 else f"{value:,.0f}"


def _n(count: int) -> str:
    """A count as `tailguard report` writes it: 10,000."""
    return f"{count:,}"


def _quantile(metric: dict[str, Any], q: str) -> str:
    """A quantile (ms); one known only to exceed the latest cut (null, with `beyond_ms`) as
    "> that"."""
    value, beyond = metric[q], metric.get("beyond_ms")
    return f"> {_ms(beyond)}" if value is None and beyond is not None else _ms(value)


def _attainment_table(snapshot: dict[str, Any]) -> Table:
    """Per model: the share of requests that met their TTFT, total and TPOT budgets, the p99
    against the configured budget, the extra load (rescues per client request) and the prompt
    tokens of wasted attempts, and the share of its requests a fallback model served with the
    routes that reached it (since start, from the same counter as the metric)."""
    table = Table(title="SLO attainment", title_justify="left", box=box.SIMPLE_HEAD, padding=0)
    models: dict[str, dict[str, Any]] = snapshot["models"]
    configured = {m["name"]: m["budget"] for m in snapshot.get("config", {}).get("models", ())}
    fallback: dict[str, dict[str, Any]] = snapshot.get("counters", {}).get("fallback", {})
    names = [*configured, *(name for name in models if name not in configured)]
    table.add_column("\nmodel", overflow="fold", min_width=min(max(map(len, names), default=0), 16))
    for column in (
        "TTFT\nmet",
        "\np99 / budget",
        "total\nmet",
        "\np99 / budget",
        "TPOT\nmet",
        "extra\nload",
        "wasted\nprompt tokens",
        "fallback\nserved",
    ):
        table.add_column(column, justify="right", no_wrap=True)
    table.add_column("\nwhy (route)", overflow="fold")
    for name in names:
        target = models.get(name)
        budget = configured.get(name, {})
        if target is None:
            table.add_row(escape(name), *["-"] * 7, *_fallback(fallback.get(name)))
            continue
        extra = target.get("extra_load")
        table.add_row(
            escape(name),
            _attained(target["slo"]["ttft"]),
            _against(target["ttft_ms"], budget.get("ttft_ms")),
            _attained(target["slo"]["total"]),
            _against(target["total_ms"], budget.get("total_ms")),
            _attained(target["slo"]["tpot"]),
            "-" if extra is None else f"{extra:.1%}",
            _n(target["wasted"]["prompt_tokens"]),
            *_fallback(fallback.get(name)),
        )
    return table


def _fallback(counts: dict[str, Any] | None) -> tuple[str, str]:
    """`20.0% (1/5)` served by a fallback model, and why: `budget 1, hedge 2`."""
    if not counts or not counts["requests"]:
        return "-", "-"
    served, requests = counts["served"], counts["requests"]
    routes = ", ".join(f"{route} {_n(n)}" for route, n in sorted(counts["routes"].items()))
    return f"{served / requests:.1%} ({_n(served)}/{_n(requests)})", escape(routes) or "-"


def _attained(counts: dict[str, Any]) -> str:
    """`97.5% (39/40)`: met of judged; "-" when no request had that budget."""
    if not counts["judged"]:
        return "-"
    met, judged = counts["met"], counts["judged"]
    return f"{met / judged:.1%} ({_n(met)}/{_n(judged)})"


def _against(metric: dict[str, Any], budget_ms: float | None) -> str:
    """The p99 and the budget (ms), in red when the p99 is over it."""
    p99 = _quantile(metric, "p99")
    if budget_ms is None:
        return f"{p99} / -"
    value = metric["p99"] if metric["p99"] is not None else metric.get("beyond_ms")
    over = value is not None and value > budget_ms
    text = f"{p99} / {_ms(budget_ms)}"
    return f"[red]{escape(text)}[/red]" if over else escape(text)


class ReportFormat(StrEnum):
    markdown = "markdown"
    json = "json"


def report(
    url: Annotated[str, typer.Option(help="Base URL of a running gateway.")] = DEFAULT_GATEWAY_URL,
    format_: Annotated[
        ReportFormat, typer.Option("--format", help="markdown, or json for the same numbers.")
    ] = ReportFormat.markdown,
    out: Annotated[
        Path | None, typer.Option(help="Write the report to this file instead of stdout.")
    ] = None,
    model: Annotated[
        list[str] | None, typer.Option(help="Only this model (repeatable; default: all).")
    ] = None,
    long_from_kib: Annotated[
        int,
        typer.Option(
            help="Request bodies this size or more are long prompts: 2, 4, 8, 16, 32, 64 or 128."
        ),
    ] = 8,
) -> None:
    """Write a running gateway's latency report: per model, TTFT and total p50/p95/p99 for short
    and long prompts, each stage against the budget, SLO attainment and what the router did.
    With API keys configured, set the admin key in $TAILGUARD_ADMIN_KEY."""
    from gateway.tools.report import CLASS_EDGES_KIB, build_report, render_markdown

    if long_from_kib not in CLASS_EDGES_KIB:
        err.print(
            f"error: --long-from-kib must be one of {', '.join(map(str, CLASS_EDGES_KIB))} "
            "(where a prompt-size band starts)",
            highlight=False,
            markup=False,
        )
        raise typer.Exit(code=2)
    admin_key = os.environ.get(ADMIN_KEY_ENV)
    body = _fetch_latency(url, admin_key=admin_key)
    try:
        metrics = fetch(url, "/metrics", admin_key=admin_key).decode(errors="replace")
    except FetchError as exc:
        err.print(f"error: {exc}", highlight=False, markup=False, soft_wrap=True)
        raise typer.Exit(code=1) from None
    try:
        data = build_report(
            json.loads(body),
            metrics,
            source=redact_url(url),
            models=model,
            long_from_kib=long_from_kib,
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        _unexpected_answer(url, exc)
    unknown = sorted(set(model or ()) - set(data["models"]))
    if unknown:
        err.print(
            f"error: the gateway has no model named {', '.join(unknown)}",
            highlight=False,
            markup=False,
        )
        raise typer.Exit(code=2)
    if format_ is ReportFormat.json:
        text = json.dumps(data, indent=2, ensure_ascii=False) + "\n"
    else:
        text = render_markdown(data)
    if out is None:
        typer.echo(text, nl=False)
    else:
        out.write_text(text, encoding="utf-8")
        err.print(f"Report written to {out}", highlight=False, markup=False)


class FetchError(Exception):
    """A page of the gateway could not be read; the message names the URL and why."""


def fetch(base_url: str, path: str, *, admin_key: str | None, timeout_s: float = 5.0) -> bytes:
    """The body of `GET {base_url}{path}`, with the admin key as a bearer token if given.
    Raises FetchError (never with the key in it)."""
    import urllib.error
    import urllib.request

    base = base_url if "://" in base_url else "http://" + base_url
    target = base.rstrip("/") + path
    headers = {"accept": "application/json, text/plain"}
    if admin_key:
        headers["authorization"] = f"Bearer {admin_key}"
    try:
        request = urllib.request.Request(target, headers=headers)
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body: bytes = response.read()
            return body
    except urllib.error.HTTPError as exc:
        reason = f"HTTP {exc.code} {exc.reason}"
    except urllib.error.URLError as exc:
        reason = str(exc.reason)
    except (OSError, ValueError) as exc:  # timeouts, resets, malformed URLs
        reason = str(exc) or type(exc).__name__
    raise FetchError(f"cannot read {target}: {reason}")

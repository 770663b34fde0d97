"""The `tailguard` command: serve the gateway, check a config, run the simulated upstream, show a
running gateway's latency statistics, and probe any OpenAI-compatible endpoint's latency."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gateway.config import CONFIG_PATH_ENV, ConfigError, Settings, config_path, load_settings

app = typer.Typer(
    name="tailguard",
    help="Tailguard: a latency-aware LLM API gateway.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)

ConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--config", "-c", help=f"Config file (default: ${CONFIG_PATH_ENV} or config/gateway.yaml)."
    ),
]


def _load(config: Path | None) -> Settings:
    try:
        return load_settings(config)
    except ConfigError as exc:
        err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
        raise typer.Exit(code=2) from None


@app.command()
def serve(
    config: ConfigOption = None,
    host: Annotated[
        str | None, typer.Option(help="Interface to bind (overrides server.host).")
    ] = None,
    port: Annotated[int | None, typer.Option(help="Port to bind (overrides server.port).")] = None,
    workers: Annotated[
        int | None, typer.Option(help="Worker processes (overrides server.workers).")
    ] = None,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "info",
) -> None:
    """Start the gateway. The config is validated before the port is bound."""
    import uvicorn

    settings = _load(config)
    bind_host = host or settings.server.host
    bind_port = settings.server.port if port is None else port
    count = workers or settings.server.workers
    names = ", ".join(m.name for m in settings.models)
    if settings.auth is not None and settings.auth.keys:
        err.print(
            "[yellow]warning:[/] auth keys are configured but not enforced in this version",
            highlight=False,
        )
    if bind_host not in ("127.0.0.1", "localhost", "::1"):
        err.print(
            f"[yellow]warning:[/] listening on {escape(bind_host)} without authentication: "
            "anyone who can reach this port can use every configured model",
            highlight=False,
        )
    err.print(
        f"Tailguard on http://{bind_host}:{bind_port}  ({count} worker{'s' if count > 1 else ''}; "
        f"latency store: {settings.latency.store}; models: {names})",
        highlight=False,
    )
    options: dict[str, Any] = {
        "host": bind_host,
        "port": bind_port,
        "loop": "uvloop",
        "http": "httptools",
        "lifespan": "on",
        "access_log": False,
        "log_level": log_level,
        "timeout_graceful_shutdown": 30,
        "proxy_headers": False,  # the gateway is the edge; X-Forwarded-* is not trusted blindly
    }
    if count == 1:
        from gateway.api import create_app, tune_gc

        app = create_app(settings)
        tune_gc()
        uvicorn.run(app, **options)
        return
    # Workers are separate processes: each loads the same (already validated) file.
    os.environ[CONFIG_PATH_ENV] = str(config_path(config).resolve())
    uvicorn.run("gateway.api:create_app_from_env", factory=True, workers=count, **options)


@app.command("check-config")
def check_config(config: ConfigOption = None) -> None:
    """Validate a config file and print its models and deployments (secrets masked)."""
    settings = _load(config)
    out = Console()
    providers = Table(title="Providers", title_justify="left")
    for column in ("name", "type", "base_url", "api_key"):
        providers.add_column(column)
    for name, spec in settings.providers.items():
        key = "set (hidden)" if spec.api_key and spec.api_key.get_secret_value() else "-"
        providers.add_row(escape(name), spec.type, escape(_without_userinfo(spec.base_url)), key)
    models = Table(title="Models", title_justify="left")
    for column in ("model", "deployments", "budget", "fallbacks", "on_ttft_miss"):
        models.add_column(column)
    for model in settings.models:
        deployments = "\n".join(
            f"{d.id}" + (f" (weight {d.weight:g})" if len(model.deployments) > 1 else "")
            for d in model.deployments
        )
        budget = ", ".join(
            f"{k} {v} ms"
            for k, v in (("ttft", model.budget.ttft_ms), ("total", model.budget.total_ms))
            if v is not None
        )
        models.add_row(
            escape(model.name),
            escape(deployments),
            budget or "-",
            ", ".join(model.fallbacks) or "-",
            model.on_ttft_miss,
        )
    out.print(providers)
    out.print(models)
    keys = settings.auth is not None and bool(settings.auth.keys)
    auth = "configured (not enforced in this version)" if keys else "off"
    out.print(
        f"server {settings.server.host}:{settings.server.port}, "
        f"latency store {settings.latency.store} (window {settings.latency.window_s} s), "
        f"auth {auth}",
        highlight=False,
    )
    out.print(f"[green]{config_path(config)}: OK[/]")


@app.command()
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
            help="Override a field of the default profile, e.g. --set tokens_per_s=50 "
            "--set slow_rate=0.08 --set slow_ms=2000-4000 (repeatable).",
        ),
    ] = None,
) -> None:
    """Run the simulated OpenAI-compatible LLM server (prefill, decode, batching, faults)."""
    from gateway.sim.engine import SimEngine, SimProfile, apply_overrides
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


DEFAULT_GATEWAY_URL = "http://127.0.0.1:8080"


@app.command()
def stats(
    url: Annotated[str, typer.Option(help="Base URL of a running gateway.")] = DEFAULT_GATEWAY_URL,
    json_: Annotated[
        bool, typer.Option("--json", help="Print the raw JSON of GET /admin/latency.")
    ] = False,
) -> None:
    """Show a running gateway's rolling latency percentiles, per deployment and per model."""
    body = _fetch_latency(url)
    if json_:
        typer.echo(body.decode(errors="replace"))
        return
    try:
        snapshot = json.loads(body)
        tables = _latency_tables(snapshot)
        header = (
            f"window {snapshot['window_s']:g} s, source {snapshot['source']}, "
            f"snapshot age {snapshot['age_s']:.1f} s; latencies in ms"
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        err.print(
            f"error: {_latency_url(url)}: unexpected answer ({exc!r})",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
        raise typer.Exit(code=1) from None
    out = Console()
    if not out.is_terminal:  # piped: print whole rows rather than squeeze them into 80 columns
        wide = out.options.update_width(10_000)
        out = Console(width=max(out.width, *(out.measure(t, options=wide).maximum for t in tables)))
    out.print(header, highlight=False, markup=False)
    for table in tables:
        out.print(table)


def _latency_url(url: str) -> str:
    base = url if "://" in url else "http://" + url
    return base.rstrip("/") + "/admin/latency"


def _fetch_latency(url: str, timeout_s: float = 3.0) -> bytes:
    """The body of `GET {url}/admin/latency`; a one-line error and exit code 1 if unreachable."""
    target = _latency_url(url)
    try:
        request = urllib.request.Request(target, headers={"accept": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body: bytes = response.read()
            return body
    except urllib.error.HTTPError as exc:
        reason = f"HTTP {exc.code} {exc.reason}"
    except urllib.error.URLError as exc:
        reason = str(exc.reason)
    except (OSError, ValueError) as exc:  # timeouts, resets, malformed URLs
        reason = str(exc) or type(exc).__name__
    err.print(
        f"error: cannot read {target}: {reason}", highlight=False, markup=False, soft_wrap=True
    )
    raise typer.Exit(code=1)


def _latency_tables(snapshot: dict[str, Any]) -> list[Table]:
    """One table of deployments and one of model names, a row each."""
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
                *map(_ms, (ttft["p50"], ttft["p90"], ttft["p99"], tpot["p50"], tpot["p99"])),
                *map(_ms, (total["p50"], total["p99"])),
                str(target["requests"]),
                str(target["errors"]),
                str(target["inflight"]),
                "yes" if target["trusted"] else "no",
            )
        tables.append(table)
    return tables


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
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


@app.command()
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

    from gateway.probe import (
        CONDITIONS,
        SUMMARY_COLUMNS,
        markdown_report,
        run_probe,
        summarize,
        summary_rows,
    )

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


def _without_userinfo(url: str | None) -> str:
    """A URL as printable: credentials embedded in it (`user:pass@`) are masked."""
    if url is None:
        return "(in-process)"
    scheme, sep, rest = url.partition("://")
    host, at, path = rest.partition("@")
    if at and "/" not in host:
        return f"{scheme}{sep}***@{path}"
    return url


def main() -> None:
    app()


if __name__ == "__main__":  # pragma: no cover
    main()

"""The `tailguard` command: serve the gateway, check a config, run the simulated upstream, run
offline simulations (`simulate ...`), show a running gateway's latency statistics, and probe any
OpenAI-compatible endpoint's latency."""

from __future__ import annotations

import json
import os
import re
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gateway.auth import exposed_without_keys, is_loopback
from gateway.config import (
    CONFIG_PATH_ENV,
    LOG_LEVEL_ENV,
    ConfigError,
    Settings,
    config_path,
    load_settings,
)
from gateway.models import Endpoint

app = typer.Typer(
    name="tailguard",
    help="Tailguard: a latency-aware LLM API gateway.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)
ADMIN_KEY_ENV = "TAILGUARD_ADMIN_KEY"

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
    allow_unauthenticated: Annotated[
        bool,
        typer.Option(
            "--allow-unauthenticated",
            help="Listen beyond loopback with no API keys (server.allow_unauthenticated).",
        ),
    ] = False,
) -> None:
    """Start the gateway. The config is validated before the port is bound."""
    import uvicorn

    # Who may connect is decided again on every reload, in every worker: the flags that bear on
    # it are passed on as `TAILGUARD_*` overrides, so each later load of the file sees them.
    if host is not None:
        os.environ["TAILGUARD_SERVER__HOST"] = host
    if allow_unauthenticated:
        os.environ["TAILGUARD_SERVER__ALLOW_UNAUTHENTICATED"] = "true"
    settings = _load(config)
    bind_host = settings.server.host
    bind_port = settings.server.port if port is None else port
    count = workers or settings.server.workers
    names = ", ".join(m.name for m in settings.models)
    keys = settings.auth is not None and settings.auth.enabled
    if not keys:
        if exposed_without_keys(settings):
            err.print(
                f"[bold red]error:[/] no API keys are configured, so the gateway only listens on "
                f"loopback, not on {escape(bind_host)}. Configure auth.keys (see `tailguard keys "
                "new`), or pass --allow-unauthenticated if something in front of it "
                "authenticates.",
                highlight=False,
            )
            raise typer.Exit(code=2)
        err.print(
            "[yellow]note:[/] no API keys configured: "
            + (
                "requests are not authenticated"
                if not is_loopback(bind_host)
                else "listening on loopback only"
            ),
            highlight=False,
        )
    err.print(
        f"Tailguard on http://{bind_host}:{bind_port}  ({count} worker{'s' if count > 1 else ''}; "
        f"latency store: {settings.latency.store}; models: {names}; "
        f"API keys: {'required' if keys else 'off'})",
        highlight=False,
    )
    options: dict[str, Any] = {
        "host": bind_host,
        "port": bind_port,
        "loop": "uvloop",
        # uvicorn's httptools protocol plus limits on header size and header read time.
        "http": "gateway.protocol:GuardedHttpToolsProtocol",
        "lifespan": "on",
        "access_log": False,
        "log_level": log_level,
        # Streams still running after this are ended with an error event (see Proxy).
        "timeout_graceful_shutdown": settings.server.shutdown_grace_s,
        "proxy_headers": False,  # the gateway is the edge; X-Forwarded-* is not trusted blindly
    }
    from gateway.telemetry import configure_logging

    configure_logging(log_level)
    if count == 1:
        from gateway.api import create_app, tune_gc

        app = create_app(settings, config_path=config_path(config))
        tune_gc()
        uvicorn.run(app, **options)
        return
    # Workers are separate processes: each loads the same (already validated) file.
    os.environ[CONFIG_PATH_ENV] = str(config_path(config).resolve())
    os.environ[LOG_LEVEL_ENV] = log_level
    uvicorn.run("gateway.api:create_app_from_env", factory=True, workers=count, **options)


@app.command("check-config")
def check_config(
    config: ConfigOption = None,
    explain: Annotated[
        bool,
        typer.Option(
            "--explain",
            help="Print the resolved routing table: each model's candidates in order (fallbacks "
            "expanded), what each can serve, budgets and policies, priors, the routing guards, "
            "the latency store and the providers (secrets masked).",
        ),
    ] = False,
    json_: Annotated[
        bool, typer.Option("--json", help="Print the --explain report as JSON.")
    ] = False,
) -> None:
    """Validate a config file and print its models and deployments (secrets masked)."""
    settings = _load(config)
    path = config_path(config)
    _check_redis_url(settings, path)
    if json_:
        typer.echo(json.dumps(_explain(settings, path), indent=2))
        return
    if explain:
        report = _explain(settings, path)
        _print_wide(_explain_tables(report))
        for line in _explain_lines(report):
            Console().print(line, highlight=False, markup=False, soft_wrap=True)
        Console().print(f"[green]{escape(str(path))}: OK[/]")
        return
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
    keys = settings.auth
    auth = (
        f"{len(keys.keys)} client key(s), {len(keys.admin_keys)} admin key(s)"
        if keys is not None and keys.enabled
        else "off (loopback only unless server.allow_unauthenticated)"
    )
    out.print(
        f"server {settings.server.host}:{settings.server.port}, "
        f"latency store {settings.latency.store} (window {settings.latency.window_s} s), "
        f"auth {auth}",
        highlight=False,
    )
    out.print(f"[green]{escape(str(path))}: OK[/]")


def _check_redis_url(settings: Settings, path: Path) -> None:
    """A Redis URL the store could not use fails the check (the gateway would fail to start)."""
    from gateway.latency import parse_redis_url

    url = settings.latency.redis_url
    if settings.latency.store == "redis" and url is not None:
        try:
            parse_redis_url(url.get_secret_value())
        except ValueError as exc:  # the message never repeats the URL's secrets
            err.print(
                f"error: {path}: latency.redis_url: {exc}",
                highlight=False,
                markup=False,
                soft_wrap=True,
            )
            raise typer.Exit(code=2) from None


# The endpoints a candidate may serve, in the order the report lists them.
_ENDPOINTS: tuple[Endpoint, ...] = ("chat", "messages", "completions", "embeddings")


def _explain(settings: Settings, path: Path) -> dict[str, Any]:
    """The resolved routing table as plain data (what `--json` prints, and `--explain` shows).

    Candidates come from the router's own `fallback_chain` and `candidates` (same de-duplication
    and endpoint rules), once per endpoint, on providers built as `serve` builds them (their HTTP
    pools are created but never connect). The router draws each model's deployments in weighted
    random order per request; here they keep the file's order, with each one's chance to lead.
    """
    import asyncio
    import random
    from contextlib import AsyncExitStack

    from gateway.errors import InvalidRequestError
    from gateway.latency import parse_redis_url
    from gateway.models import Call
    from gateway.providers import can_serve, open_providers
    from gateway.providers.base import Provider
    from gateway.routing import Candidate, candidates, fallback_chain

    async def build() -> dict[str, Provider]:
        async with AsyncExitStack() as stack:
            return await open_providers(settings, stack)

    providers = asyncio.run(build())
    rng = random.Random(0)  # the draw does not matter: each model's group is put back in order
    models: dict[str, Any] = {}
    for spec in settings.models:
        chain = fallback_chain(spec, settings)
        place = {
            (model.name, d.id): (i, j)
            for i, model in enumerate(chain)
            for j, d in enumerate(model.deployments)
        }
        found: dict[str, Candidate] = {}
        serves: dict[str, list[str]] = {}
        for endpoint in _ENDPOINTS:
            call = Call(endpoint=endpoint, model=spec.name, body={}, raw=b"", stream=False)
            try:
                listed = candidates(chain, providers, call, rng)
            except InvalidRequestError:  # no deployment serves this endpoint
                listed = []
            for candidate in listed:
                found.setdefault(candidate.id, candidate)
                serves.setdefault(candidate.id, []).append(endpoint)
        ordered = sorted(found.values(), key=lambda c: place[(c.model, c.id)])
        group_weight: dict[str, float] = {}
        for candidate in ordered:
            weight = candidate.deployment.weight
            group_weight[candidate.model] = group_weight.get(candidate.model, 0.0) + weight
        models[spec.name] = {
            "priority": spec.priority,
            "budget": {"ttft_ms": spec.budget.ttft_ms, "total_ms": spec.budget.total_ms},
            "on_ttft_miss": spec.on_ttft_miss,
            "hedge_max_fraction": spec.hedge_max_fraction,
            "batching": spec.batching.model_dump(mode="json")
            if spec.batching is not None
            else None,
            "fallbacks": list(spec.fallbacks),
            "chain": [model.name for model in chain],
            "candidates": [
                {
                    "deployment": c.id,
                    "model": c.model,
                    "provider": c.deployment.provider,
                    "upstream_model": c.deployment.model,
                    "weight": c.deployment.weight,
                    # Weighted order: the chance to be tried before the model's other deployments.
                    "lead_share": round(c.deployment.weight / group_weight[c.model], 4),
                    "prior": c.deployment.prior.model_dump(mode="json")
                    if c.deployment.prior
                    else None,
                    "endpoints": serves[c.id],
                }
                for c in ordered
            ],
            "unserved_endpoints": [
                e for e in _ENDPOINTS if not any(e in serves[c.id] for c in ordered)
            ],
        }
    latency = settings.latency
    redis: dict[str, Any] | None = None
    if latency.store == "redis" and latency.redis_url is not None:
        url = latency.redis_url.get_secret_value()
        target = parse_redis_url(url)  # checked by _check_redis_url
        redis = {
            "url": _redact_url(url),
            "topology": target.topology,
            "nodes": [f"{host}:{port}" for host, port in target.nodes],
            "service": target.service,
        }
    routing = settings.routing
    auth = settings.auth
    return {
        "config": str(path),
        "server": settings.server.model_dump(mode="json"),
        "latency": {
            "store": latency.store,
            "window_s": latency.window_s,
            "slice_s": latency.slice_s,
            "min_samples": latency.min_samples,
            "redis": redis,
        },
        "routing": {
            "cooldown": routing.cooldown.model_dump(mode="json"),
            "retry_budget": routing.retry_budget.model_dump(mode="json"),
        },
        "providers": {
            name: {
                "type": spec.type,
                "base_url": None if spec.base_url is None else _redact_url(spec.base_url),
                "api_key": "set" if spec.api_key and spec.api_key.get_secret_value() else "not set",
                "headers": sorted(spec.headers),  # names only: the values are secrets
                "endpoints": [e for e in _ENDPOINTS if can_serve(providers[name], e)],
            }
            for name, spec in settings.providers.items()
        },
        "models": models,
        "auth": {
            "keys": len(auth.keys) if auth is not None else 0,
            "admin_keys": len(auth.admin_keys) if auth is not None else 0,
        },
    }


def _explain_tables(report: dict[str, Any]) -> list[Table]:
    """The `--explain` report as tables: providers, candidates, model policies."""
    providers = Table(title="Providers", title_justify="left", box=box.SIMPLE_HEAD)
    for column in ("name", "type", "base_url", "api_key", "headers", "serves"):
        providers.add_column(column)
    for name, provider in report["providers"].items():
        providers.add_row(
            escape(name),
            provider["type"],
            escape(provider["base_url"] or "(in-process)"),
            provider["api_key"],
            escape(", ".join(provider["headers"]) or "-"),
            ", ".join(provider["endpoints"]),
        )
    routes = Table(
        title="Candidates, in the order tried",
        title_justify="left",
        caption="Within a model the order is drawn by weight for each request (leads: the chance "
        "to go first). At request time, deployments cooling down are skipped and the first that "
        "can meet the budget leads.",
        caption_justify="left",
        box=box.SIMPLE_HEAD,
    )
    for column in ("model", "#", "deployment", "weight (leads)", "serves as", "endpoints", "prior"):
        routes.add_column(column, justify="right" if column == "#" else "left")
    policies = Table(title="Model policies", title_justify="left", box=box.SIMPLE_HEAD)
    for column in (
        "model",
        "priority",
        "budget ttft / total",
        "on_ttft_miss",
        "hedge_max_fraction",
        "batching",
        "fallback chain",
    ):
        policies.add_column(column)
    for name, model in report["models"].items():
        rows = model["candidates"]
        for number, c in enumerate(rows, 1):
            prior = c["prior"] or {}
            routes.add_row(
                escape(name) if number == 1 else "",
                str(number),
                escape(c["deployment"]),
                f"{c['weight']:g}" + (f" ({c['lead_share']:.0%})" if c["lead_share"] < 1 else ""),
                escape(c["model"]) + ("" if c["model"] == name else " (fallback)"),
                ", ".join(c["endpoints"]),
                ", ".join(f"{k.removesuffix('_ms')} {v:g} ms" for k, v in prior.items() if v)
                or "-",
            )
        if model["unserved_endpoints"]:
            unserved = ", ".join(model["unserved_endpoints"])
            routes.add_row("", "", "", "", "", f"none for {unserved}")
        routes.add_section()
        budget = model["budget"]
        batching = model["batching"]
        policies.add_row(
            escape(name),
            model["priority"],
            " / ".join("-" if v is None else f"{v} ms" for v in budget.values()),
            model["on_ttft_miss"],
            f"{model['hedge_max_fraction']:g}",
            "-"
            if batching is None
            else "size {max_batch_size}, wait {max_wait_ms} ms, inflight {max_inflight}, "
            "queue {max_queue}".format(**batching),
            escape(" -> ".join(model["chain"][1:])) or "-",
        )
    return [providers, routes, policies]


def _explain_lines(report: dict[str, Any]) -> list[str]:
    cooldown = report["routing"]["cooldown"]
    retry = report["routing"]["retry_budget"]
    latency = report["latency"]
    redis = latency["redis"]
    store = latency["store"]
    if redis is not None:
        nodes = len(redis["nodes"])
        where = f", {nodes} node{'s' if nodes > 1 else ''}" if nodes else ""
        service = f", service {redis['service']}" if redis["service"] else ""
        store += f" at {redis['url']} ({redis['topology']}{where}{service})"
    server = report["server"]
    return [
        f"routing: cooldown after {cooldown['failures']} failures in a row, "
        f"{cooldown['base_s']:g} s doubling to {cooldown['max_s']:g} s; retry budget "
        f"{retry['percent']:g}% of active requests (at least {retry['min_concurrent']})",
        f"latency store: {store}; window {latency['window_s']} s in {latency['slice_s']} s "
        f"slices, trusted from {latency['min_samples']} samples",
        f"server {server['host']}:{server['port']}, {server['workers']} worker(s); "
        f"auth: {report['auth']['keys']} client key(s), {report['auth']['admin_keys']} admin "
        "key(s)",
    ]


def _print_wide(tables: list[Table]) -> None:
    """Print tables; when piped, as wide as their rows rather than folded into 80 columns."""
    out = Console()
    if not out.is_terminal:
        wide = out.options.update_width(10_000)
        out = Console(width=max(out.width, *(out.measure(t, options=wide).maximum for t in tables)))
    for table in tables:
        out.print(table)


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


simulate_app = typer.Typer(
    name="simulate",
    help="Offline simulations that explain a serving effect (no network, no GPU).",
    no_args_is_help=True,
)
app.add_typer(simulate_app)


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
    from gateway.sim.batching import MODES, run_experiment

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


DEFAULT_GATEWAY_URL = "http://127.0.0.1:8080"


@app.command()
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


def _fetch_latency(url: str, timeout_s: float = 3.0, *, admin_key: str | None = None) -> bytes:
    """The body of `GET {url}/admin/latency`; a one-line error and exit code 1 if unreachable."""
    from gateway.report import FetchError, fetch

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
                str(target["requests"]),
                str(target["errors"]),
                str(target["inflight"]),
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
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _quantile(metric: dict[str, Any], q: str) -> str:
    """A quantile (ms); one known only to exceed the latest cut (null, with `beyond_ms`) as
    "> that"."""
    value, beyond = metric[q], metric.get("beyond_ms")
    return f"> {_ms(beyond)}" if value is None and beyond is not None else _ms(value)


def _attainment_table(snapshot: dict[str, Any]) -> Table:
    """Per model: the share of requests that met their TTFT, total and TPOT budgets, the p99
    against the configured budget, the extra load (rescues per client request) and the prompt
    tokens of wasted attempts."""
    table = Table(title="SLO attainment", title_justify="left", box=box.SIMPLE_HEAD, padding=0)
    models: dict[str, dict[str, Any]] = snapshot["models"]
    configured = {m["name"]: m["budget"] for m in snapshot.get("config", {}).get("models", ())}
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
    ):
        table.add_column(column, justify="right", no_wrap=True)
    for name in names:
        target = models.get(name)
        budget = configured.get(name, {})
        if target is None:
            table.add_row(escape(name), *["-"] * 7)
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
            str(target["wasted"]["prompt_tokens"]),
        )
    return table


def _attained(counts: dict[str, Any]) -> str:
    """`97.5% (39/40)`: met of judged; "-" when no request had that budget."""
    if not counts["judged"]:
        return "-"
    return f"{counts['met'] / counts['judged']:.1%} ({counts['met']}/{counts['judged']})"


def _against(metric: dict[str, Any], budget_ms: float | None) -> str:
    """The p99 and the budget (ms), in red when the p99 is over it."""
    p99 = _quantile(metric, "p99")
    if budget_ms is None:
        return f"{p99} / -"
    value = metric["p99"] if metric["p99"] is not None else metric.get("beyond_ms")
    over = value is not None and value > budget_ms
    text = f"{p99} / {_ms(budget_ms)}"
    return f"[red]{escape(text)}[/red]" if over else escape(text)


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
    return "(in-process)" if url is None else _redact_url(url)


_SECRET_PARAMETER = re.compile(r"pass|secret|token|key|auth|sig", re.IGNORECASE)


def _redact_url(url: str) -> str:
    """A URL as printable: the password in its user info (the whole user info when it has no
    password), secret-looking query values and any fragment become `***`. The user info is taken
    to end at the last `@` before the query, so a password with an unencoded `/` is masked too."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "***"
    rest, hash_, _ = rest.partition("#")
    location, question, query = rest.partition("?")
    credentials, at, location = location.rpartition("@")
    if at:
        user, colon, _ = credentials.partition(":")
        location = (f"{user}:***@" if colon and user else "***@") + location
    if question:
        masked = []
        for part in query.split("&"):
            name, equals, _ = part.partition("=")
            masked.append(f"{name}=***" if equals and _SECRET_PARAMETER.search(name) else part)
        location += "?" + "&".join(masked)
    return f"{scheme}://{location}" + ("#***" if hash_ else "")


class ReportFormat(StrEnum):
    markdown = "markdown"
    json = "json"


@app.command()
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
    from gateway.report import CLASS_EDGES_KIB, FetchError, build_report, fetch, render_markdown

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
            source=_redact_url(url),
            models=model,
            long_from_kib=long_from_kib,
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        err.print(
            f"error: {_latency_url(url)}: unexpected answer ({exc!r})",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
        raise typer.Exit(code=1) from None
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


def main() -> None:
    app()


keys_app = typer.Typer(
    name="keys",
    help="Make gateway API keys and the config lines that admit them.",
    no_args_is_help=True,
)
app.add_typer(keys_app)


@keys_app.command("new")
def keys_new(
    name: Annotated[str, typer.Argument(help="The key's name in logs, traces and metrics.")],
    admin: Annotated[
        bool, typer.Option("--admin", help="An admin key (for /admin/* and /dashboard).")
    ] = False,
    models: Annotated[
        str | None, typer.Option(help="Comma-separated models the key may use (default: all).")
    ] = None,
    rpm: Annotated[int | None, typer.Option(min=1, help="Requests per minute.")] = None,
    tpm: Annotated[int | None, typer.Option(min=1, help="Tokens per minute.")] = None,
) -> None:
    """Generate a key. The key goes to stdout once, for the client; stderr gets the line for
    the config (under `auth.keys`, or `auth.admin_keys` with --admin), which holds only its hash."""
    from gateway.auth import new_key
    from gateway.config import KeySpec

    try:
        KeySpec(name=name, sha256="0" * 64)
    except ValueError:
        err.print(
            "[bold red]error:[/] a key name is 1-64 letters, digits, '.', '_' or '-'",
            highlight=False,
        )
        raise typer.Exit(code=2) from None
    key, digest = new_key()
    entry: dict[str, Any] = {"name": name, "sha256": digest}
    if not admin:
        if models:
            entry["models"] = [m.strip() for m in models.split(",") if m.strip()]
        if rpm is not None:
            entry["rpm"] = rpm
        if tpm is not None:
            entry["tpm"] = tpm
    section = "admin_keys" if admin else "keys"
    line = json.dumps(entry, separators=(", ", ": "))
    err.print(f"# add under auth.{section}:\n- {line}", highlight=False, markup=False)
    typer.echo(key)


@keys_app.command("hash")
def keys_hash() -> None:
    """Print the SHA-256 of a key read from stdin (to configure a key made elsewhere)."""
    import sys

    from gateway.auth import hash_key

    key = sys.stdin.readline().strip()
    if not key:
        err.print("[bold red]error:[/] no key on stdin", highlight=False)
        raise typer.Exit(code=2)
    typer.echo(hash_key(key))


bench_app = typer.Typer(
    name="bench",
    help="Benchmarks that run a real gateway against a simulated upstream on this machine.",
    no_args_is_help=True,
)
app.add_typer(bench_app)


@bench_app.command("batching")
def bench_batching(
    duration: Annotated[
        float, typer.Option(min=1.0, help="Seconds per (workload, max_wait_ms) step.")
    ] = 10.0,
    json_: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Sweep `max_wait_ms` over 5, 20 and 100 ms for a sparse interactive load and a bulk load;
    print p99 latency and throughput for each, and the setting to use for each workload."""
    from gateway.bench import run_batching_bench

    def progress(line: str) -> None:
        err.print(escape(line), highlight=False)

    report = run_batching_bench(duration_s=duration, progress=None if json_ else progress)
    if json_:
        Console().print_json(report.to_json())
        return
    Console(width=400).print(escape(report.markdown()), highlight=False, soft_wrap=True)


if __name__ == "__main__":  # pragma: no cover
    main()

"""The `tailguard` command: serve the gateway, check a config, run the simulated upstream."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer
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
    }
    if count == 1:
        from gateway.api import create_app

        uvicorn.run(create_app(settings), **options)
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
        providers.add_row(escape(name), spec.type, escape(spec.base_url or "(in-process)"), key)
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
    out.print(
        f"server {settings.server.host}:{settings.server.port}, "
        f"latency store {settings.latency.store} (window {settings.latency.window_s} s), "
        f"auth {'on' if settings.auth and settings.auth.keys else 'off'}",
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


def main() -> None:
    app()


if __name__ == "__main__":  # pragma: no cover
    main()

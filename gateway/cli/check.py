"""`tailguard check-config`: validate a config file; with `--explain` (or `--json`), the resolved
routing table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gateway.cli.common import (
    ConfigOption,
    auth_summary,
    load_or_exit,
    print_wide,
    redact_url,
    without_userinfo,
)

if TYPE_CHECKING:
    from gateway.config import ProviderSpec, Settings
    from gateway.models import Endpoint


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
    """Validate a config file, listing every problem at once, and print its models and
    deployments (secrets masked)."""
    from gateway.config import config_path

    settings = load_or_exit(config)
    path = config_path(config)
    if json_:
        typer.echo(json.dumps(_explain(settings, path), indent=2))
        return
    if explain:
        report = _explain(settings, path)
        print_wide(_explain_tables(report))
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
        providers.add_row(escape(name), spec.type, escape(without_userinfo(_endpoint(spec))), key)
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
        f"latency store {settings.latency.store} (window {settings.latency.window_s} s)",
        highlight=False,
    )
    out.print(auth_summary(settings), highlight=False, markup=False, soft_wrap=True)
    out.print(f"[green]{escape(str(path))}: OK[/]")


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
    from gateway.models import Call
    from gateway.providers import can_serve, open_providers
    from gateway.redis import parse_redis_url
    from gateway.routing import Candidate, candidates, fallback_chain
    from gateway.upstream import Provider

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
        target = parse_redis_url(url)  # checked by load_or_exit
        redis = {
            "url": redact_url(url),
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
                "base_url": _shown(_endpoint(spec)),
                "api_key": "set" if spec.api_key and spec.api_key.get_secret_value() else "not set",
                "headers": sorted(spec.headers),  # names only: the values are secrets
                "endpoints": [e for e in _ENDPOINTS if can_serve(providers[name], e)],
            }
            | _entra_id(spec)
            for name, spec in settings.providers.items()
        },
        "models": models,
        "auth": {
            "keys": len(auth.keys) if auth is not None else 0,
            "admin_keys": len(auth.admin_keys) if auth is not None else 0,
            "summary": auth_summary(settings),
        },
    }


def _shown(url: str | None) -> str | None:
    return None if url is None else redact_url(url)


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
            escape(provider.get("entra_id") or provider["api_key"]),
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
        f"{report['auth']['summary']}",
    ]


def _entra_id(spec: ProviderSpec) -> dict[str, str]:
    """How an Azure provider without an api_key authenticates: its Entra ID token's source (a
    file's path is no secret; a token is only said to be set)."""
    if spec.azure_ad_token_file:
        return {"entra_id": f"Entra ID token file {spec.azure_ad_token_file}"}
    if spec.azure_ad_token is not None:
        return {"entra_id": "Entra ID token set"}
    return {}


def _endpoint(spec: ProviderSpec) -> str | None:
    """Where the provider's requests go: its `base_url`, else the endpoint its cloud implies."""
    from gateway.config.cloud_bedrock import shown_base_url
    from gateway.config.cloud_google import google_base_url

    return shown_base_url(spec) or google_base_url(spec)

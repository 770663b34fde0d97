"""The deployment files agree with each other and with the gateway: the compose stack, its nginx,
collector, Prometheus and Grafana configs, the dashboard's queries, the Kubernetes manifests and
the Dockerfile. Everything is parsed for real; no container is started and nothing is fetched."""

from __future__ import annotations

import ast
import functools
import inspect
import itertools
import json
import re
import tomllib
from collections.abc import Iterator
from fnmatch import fnmatch
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import uvicorn
import yaml

from gateway.config import Settings, load_settings
from gateway.sim.profile import SimProfile, apply_overrides
from tests.source import parse

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_CONFIG = ROOT / "config" / "compose-gateway.yaml"
DEPLOY = ROOT / "deploy"
NGINX_CONF = DEPLOY / "nginx" / "tailguard.conf"
OTEL_CONF = DEPLOY / "otel-collector.yaml"
PROMETHEUS_CONF = DEPLOY / "prometheus" / "prometheus.yml"
GRAFANA = DEPLOY / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "tailguard.json"
K8S = DEPLOY / "k8s"

GATEWAYS = ("gateway-1", "gateway-2")
LB = "lb"
GATEWAY_CONFIG_PATH = "/etc/tailguard/gateway.yaml"
OTEL_ENV = {
    "OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel-collector:4318",
    "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
    "OTEL_SERVICE_NAME": "tailguard",
    "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
    "OTEL_TRACES_SAMPLER_ARG": "1.0",
}

# What GET /metrics exposes, by family; the exposition adds `_total` to counters and
# `_bucket`/`_sum`/`_count` to histograms.
COUNTERS = {
    "tailguard_requests",
    "tailguard_attempts",
    "tailguard_fallbacks",
    "tailguard_hedges",
    "tailguard_cooldowns",
    "tailguard_retry_budget_exhausted",
    "tailguard_latency_store_flush_failures",
    "tailguard_latency_store_refresh_failures",
    "tailguard_latency_store_dropped_samples",
}
HISTOGRAMS = {
    "gen_ai_client_operation_duration_seconds",
    "gen_ai_client_operation_time_to_first_chunk_seconds",
    "gen_ai_client_operation_time_per_output_chunk_seconds",
    "gen_ai_client_token_usage",
    "gen_ai_server_request_duration_seconds",
    "tailguard_overhead_seconds",
}
GAUGES = {
    "tailguard_latency_store_up",
    "tailguard_latency_store_pending_writes",
    "tailguard_latency_snapshot_age_seconds",
    "tailguard_upstream_inflight",
}
EXPOSED = (
    {f"{name}_total" for name in COUNTERS}
    | {f"{name}{suffix}" for name in HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")}
    | GAUGES
)
# Each of these must be on the dashboard (request rate, errors, TTFT, client-facing duration,
# fallbacks, hedges, cooldowns, attempts, tokens, overhead, latency store, in-flight).
DASHBOARD_MUST_SHOW = {
    "tailguard_requests",
    "tailguard_attempts",
    "tailguard_fallbacks",
    "tailguard_hedges",
    "tailguard_cooldowns",
    "gen_ai_client_operation_time_to_first_chunk_seconds",
    "gen_ai_server_request_duration_seconds",
    "gen_ai_client_token_usage",
    "tailguard_overhead_seconds",
    "tailguard_latency_store_up",
    "tailguard_latency_snapshot_age_seconds",
    "tailguard_upstream_inflight",
}

# Strings that look like real credentials: provider keys, tokens, a password inside a URL.
SECRET_LOOKING = re.compile(
    r"sk-[A-Za-z0-9_-]{16,}|sk-ant-[A-Za-z0-9_-]+|hf_[A-Za-z0-9]{16,}|AKIA[0-9A-Z]{16}"
    r"|gh[pousr]_[A-Za-z0-9]{20,}|xox[abp]-[A-Za-z0-9-]{10,}|://[^/\s:@]*:[^@\s/]+@"
)
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL|REDIS_URL", re.IGNORECASE)


# --- helpers -------------------------------------------------------------------------------------


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


@functools.cache
def compose() -> dict[str, Any]:
    document = load_yaml(COMPOSE)
    assert isinstance(document, dict)
    return document


def services() -> dict[str, dict[str, Any]]:
    found = compose()["services"]
    assert isinstance(found, dict)
    return found


def env_of(service: dict[str, Any]) -> dict[str, str]:
    raw = service.get("environment") or {}
    if isinstance(raw, list):
        return dict(str(item).partition("=")[::2] for item in raw)
    return {str(k): "" if v is None else str(v) for k, v in raw.items()}


def published(service: dict[str, Any]) -> list[tuple[str | None, str, str]]:
    """(host_ip, published port, container port) of every published port."""
    out: list[tuple[str | None, str, str]] = []
    for port in service.get("ports") or []:
        if isinstance(port, dict):
            host_ip = port.get("host_ip")
            out.append((host_ip, str(port.get("published", "")), str(port["target"])))
            continue
        parts = str(port).split("/")[0].rsplit(":", 2)
        if len(parts) == 3:
            out.append((parts[0], parts[1], parts[2]))
        elif len(parts) == 2:
            out.append((None, parts[0], parts[1]))
        else:
            out.append((None, "", parts[0]))
    return out


def bind_mounts(service: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(host path, container path, read-only) of every bind mount; named volumes left out."""
    out: list[tuple[str, str, bool]] = []
    for volume in service.get("volumes") or []:
        if isinstance(volume, dict):
            if volume.get("type") == "bind":
                out.append((volume["source"], volume["target"], bool(volume.get("read_only"))))
            continue
        source, _, rest = str(volume).partition(":")
        target, _, mode = rest.partition(":")
        if source.startswith((".", "/", "~")):
            out.append((source, target, "ro" in mode.split(",")))
    return out


def mount_target(service: dict[str, Any], source: str) -> str:
    for host, container, _ in bind_mounts(service):
        if Path(host) == Path(source):
            return container
    raise AssertionError(f"{source} is not mounted")


def argv(service: dict[str, Any]) -> list[str]:
    command = service.get("command") or []
    return [str(a) for a in command] if isinstance(command, list) else str(command).split()


def flag(args: list[str], name: str) -> str | None:
    """The value of `--name value` or `--name=value` in an argument list."""
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.partition("=")[2]
    return None


def sim_services() -> set[str]:
    """The compose services running `tailguard sim`."""
    return {name for name, service in services().items() if argv(service)[:1] == ["sim"]}


def sim_profile(name: str) -> SimProfile:
    """The simulator profile a sim service's `--set` flags make (raises if one is invalid)."""
    args = argv(services()[name])
    sets = [value for key, value in itertools.pairwise(args) if key == "--set"]
    return apply_overrides(SimProfile(), ",".join(sets))


def image(service: dict[str, Any]) -> str:
    return str(service.get("image", ""))


def service_with_image(prefix: str) -> str:
    names = [name for name, svc in services().items() if image(svc).startswith(prefix)]
    assert len(names) == 1, f"expected one service running {prefix}, found {names}"
    return names[0]


def host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url if "://" in url else f"//{url}")
    assert parts.hostname and parts.port, url
    return parts.hostname, parts.port


def compose_settings() -> Settings:
    redis_url = env_of(services()[GATEWAYS[0]])["REDIS_URL"]
    return load_settings(COMPOSE_CONFIG, environ={"REDIS_URL": redis_url})


def seconds(value: str) -> float:
    """An nginx or compose duration (`900s`, `15m`, `4`, `1h`) in seconds."""
    match = re.fullmatch(r"(\d+)(ms|s|m|h)?", value)
    assert match, value
    scale = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, None: 1}[match.group(2)]
    return int(match.group(1)) * scale


def nginx_statements(text: str) -> list[tuple[str, list[str]]]:
    """Every directive of an nginx file as (name, args), blocks flattened."""
    text = re.sub(r"#[^\n]*", "", text)
    out: list[tuple[str, list[str]]] = []
    for statement in re.split(r"[;{}]", text):
        words = statement.split()
        if words:
            out.append((words[0], words[1:]))
    return out


def nginx_directive(text: str, name: str) -> list[list[str]]:
    return [args for directive, args in nginx_statements(text) if directive == name]


def gateway_setting(name: str) -> float | None:
    """A uvicorn option `tailguard serve` sets (gateway/cli/serve.py), None if left as default."""
    tree = parse((ROOT / "gateway" / "cli" / "serve.py").read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if (
                    isinstance(key, ast.Constant)
                    and key.value == name
                    and isinstance(value, ast.Constant)
                    and isinstance(value.value, int | float)
                ):
                    return float(value.value)
        if (
            isinstance(node, ast.keyword)
            and node.arg == name
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, int | float)
        ):
            return float(node.value.value)
    return None


def shutdown_grace(settings: Settings) -> float | None:
    """How long `tailguard serve` lets open requests finish after SIGTERM."""
    configured = getattr(settings.server, "shutdown_grace_s", None)
    if configured is not None:
        return float(configured)
    return gateway_setting("timeout_graceful_shutdown")


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel of a dashboard, including those inside collapsed rows."""
    for panel in items:
        yield panel
        yield from panels(panel.get("panels") or [])


@functools.cache
def dashboard() -> dict[str, Any]:
    document = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert isinstance(document, dict)
    return document


def dashboard_exprs() -> list[str]:
    return [
        str(target["expr"])
        for panel in panels(dashboard()["panels"])
        for target in panel.get("targets") or []
    ]


def prometheus_datasource_uid() -> str:
    document = load_yaml(GRAFANA / "provisioning" / "datasources" / "datasources.yaml")
    uids = [ds["uid"] for ds in document["datasources"] if ds["type"] == "prometheus"]
    assert len(uids) == 1, uids
    return str(uids[0])


PROMQL_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "offset",
    "and",
    "or",
    "unless",
    "inf",
    "nan",
    "atan2",
}


def promql_metrics(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, labels and keywords left out)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", " ", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", " ", expr)  # ranges and subqueries
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    expr = re.sub(r"\$\{?\w+\}?", " ", expr)  # Grafana variables
    names: set[str] = set()
    for match in re.finditer(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", expr):
        if expr[match.end() :].lstrip().startswith("("):
            continue  # a function or an aggregation
        if match.group().lower() not in PROMQL_KEYWORDS:
            names.add(match.group())
    return names


def family(exposed: str) -> str:
    for suffix in ("_total", "_bucket", "_sum", "_count"):
        if exposed.endswith(suffix) and exposed.removesuffix(suffix) in COUNTERS | HISTOGRAMS:
            return exposed.removesuffix(suffix)
    return exposed


def k8s_documents(path: Path) -> list[dict[str, Any]]:
    docs = [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc]
    assert all(isinstance(doc, dict) for doc in docs), path
    return docs


@functools.cache
def kustomization() -> dict[str, Any]:
    document = load_yaml(K8S / "kustomization.yaml")
    assert isinstance(document, dict)
    return document


def k8s_manifests() -> list[dict[str, Any]]:
    return [doc for name in kustomization()["resources"] for doc in k8s_documents(K8S / name)]


def k8s_object(kind: str, name: str = "tailguard") -> dict[str, Any]:
    """The one manifest of `kind` called `name` (the gateway's, by default; Redis has its own)."""
    found = [
        doc for doc in k8s_manifests() if doc["kind"] == kind and doc["metadata"]["name"] == name
    ]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def k8s_config_variables() -> set[str]:
    """The environment variables deploy/k8s/gateway.yaml refers to as ${VAR}."""
    text = (K8S / "gateway.yaml").read_text(encoding="utf-8")
    return set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", text))


def k8s_settings() -> Settings:
    """deploy/k8s/gateway.yaml loaded by the gateway, with placeholder values for its secrets."""
    environ = {
        name: "redis://redis:6379/0" if name == "REDIS_URL" else "placeholder"
        for name in k8s_config_variables()
    }
    for index, name in enumerate(sorted(n for n in environ if n.endswith("_SHA256"))):
        environ[name] = f"{index:064x}"  # a key's hash: 64 hex digits
    return load_settings(K8S / "gateway.yaml", environ=environ)


def gateway_container() -> dict[str, Any]:
    containers = k8s_object("Deployment")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    container = containers[0]
    assert isinstance(container, dict)
    return container


def container_port(container: dict[str, Any], port: int | str) -> int:
    """A probe's or Service's port (a number or a port name) as the container's port number."""
    for declared in container["ports"]:
        if port in (declared["containerPort"], declared.get("name")):
            return int(declared["containerPort"])
    raise AssertionError(f"port {port!r} is not one of the container's ports")


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    text = re.sub(r"\\\n", " ", text)
    out: list[tuple[str, str]] = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore keeps `path` (or a folder holding it) out of the build context."""
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw.removeprefix("!").strip("/")
        if pattern.startswith("**/"):
            hit = any(fnmatch(p.rsplit("/", 1)[-1], pattern[3:]) for p in prefixes)
        else:
            hit = any(fnmatch(p, pattern) for p in prefixes)
        if hit:
            ignored = not negate
    return ignored


# --- the compose stack ---------------------------------------------------------------------------


def test_compose_services_have_an_image_or_a_build() -> None:
    """Every compose service can be started: an image to pull, or a build context that exists."""
    assert compose()["name"] == "tailguard"
    for name, service in services().items():
        assert service.get("image") or service.get("build"), name
        build = service.get("build")
        if build is not None:
            context = ROOT / (build if isinstance(build, str) else build.get("context", "."))
            dockerfile = (
                build.get("dockerfile", "Dockerfile") if isinstance(build, dict) else "Dockerfile"
            )
            assert (context / dockerfile).is_file(), name
        if service.get("image"):
            # A pinned tag, so the stack does not change under the same file.
            assert ":" in image(service) and not image(service).endswith(":latest"), name


def test_gateway_replicas_share_image_config_and_telemetry() -> None:
    """Both replicas run the same image on the same read-only config, Redis and OTel settings."""
    first, second = (services()[name] for name in GATEWAYS)
    grace = shutdown_grace(compose_settings())
    assert grace is not None
    assert first["build"] == second["build"]
    assert first.get("image") == second.get("image")
    assert first.get("command") == second.get("command")
    for name in GATEWAYS:
        service = services()[name]
        assert ("./config/compose-gateway.yaml", GATEWAY_CONFIG_PATH, True) in bind_mounts(
            service
        ), name
        env = env_of(service)
        for key, value in OTEL_ENV.items():
            assert env.get(key) == value, (name, key)
        redis_host, _ = host_port(env["REDIS_URL"])
        assert image(services()[redis_host]).startswith("redis:"), name
        assert services()[redis_host].get("healthcheck"), "replicas wait for a healthy Redis"
        depends = service.get("depends_on") or {}
        assert depends.get(redis_host, {}).get("condition") == "service_healthy", name
        assert not published(service), f"{name} must be reached through the load balancer only"
        assert seconds(str(service["stop_grace_period"])) > grace, "a stop lets streams drain"
    instances = {env_of(services()[name]).get("OTEL_RESOURCE_ATTRIBUTES") for name in GATEWAYS}
    assert len(instances) == len(GATEWAYS), "each replica names itself in its spans"


def test_compose_config_validates_with_the_redis_store() -> None:
    """config/compose-gateway.yaml loads with the gateway's own loader and shares latency
    through Redis."""
    settings = compose_settings()
    assert settings.latency.store == "redis"
    assert settings.server.host == "0.0.0.0"
    redis_url = settings.latency.redis_url
    assert redis_url is not None
    assert host_port(redis_url.get_secret_value())[0] in services()


def test_compose_models_use_the_sim_services() -> None:
    """Every provider URL names a compose service on its port; models reach the sim upstreams."""
    settings = compose_settings()
    provider_service: dict[str, str] = {}
    for name, provider in settings.providers.items():
        if provider.type == "simulated":
            continue
        assert provider.base_url is not None
        host, port = host_port(provider.base_url)
        assert host in services(), f"provider {name}: no compose service {host!r}"
        assert flag(argv(services()[host]), "--port") == str(port), name
        provider_service[name] = host
    sims = sim_services()
    assert len(sims) >= 2, "two simulated upstreams: one with a stalling tail, one steady"
    used = {provider_service.get(d.provider) for m in settings.models for d in m.deployments}
    assert sims <= used, "every sim service serves a model"
    for model in settings.models:
        services_used = {provider_service.get(d.provider) for d in model.deployments}
        on_profiles = {s for s in services_used if s and services()[s].get("profiles")}
        if on_profiles:
            assert model.fallbacks, f"{model.name} needs a fallback while its profile is off"
        else:
            assert services_used & (sims | {None}), f"{model.name} should use the sim upstreams"


def test_compose_hedges_the_stalling_sim() -> None:
    """The model on the stalling sim hedges, with a cap above its stall rate and a fallback."""
    settings = compose_settings()
    stall_rates = {name: sim_profile(name).slow_rate for name in sim_services()}
    stalling = {name for name, rate in stall_rates.items() if rate > 0}
    assert stalling, "one sim service has a stalling first-token tail"
    hedged = [m for m in settings.models if m.on_ttft_miss == "hedge"]
    assert hedged
    for model in hedged:
        hosts = {
            host_port(settings.providers[d.provider].base_url or "")[0]
            for d in model.deployments
            if settings.providers[d.provider].base_url
        }
        assert hosts & stalling, model.name
        assert model.hedge_max_fraction == pytest.approx(0.10)
        assert model.hedge_max_fraction > max(stall_rates[h] for h in hosts & stalling)
        assert model.fallbacks and model.budget.ttft_ms is not None


def test_sim_services_run_valid_profiles() -> None:
    """Each sim service's --set flags build a valid simulator profile and its healthcheck port."""
    for name in sim_services():
        service = services()[name]
        args = argv(service)
        assert flag(args, "--host") == "0.0.0.0", name
        sim_profile(name)
        check = " ".join(service["healthcheck"]["test"])
        assert f"127.0.0.1:{flag(args, '--port')}/health" in check, name


def test_load_balancer_spreads_over_both_replicas_and_streams() -> None:
    """nginx names both replicas on the gateway's port, unbuffered, with upstream keep-alive."""
    lb = services()[LB]
    assert image(lb).startswith("nginx:")
    target = mount_target(lb, "./deploy/nginx/tailguard.conf")
    assert target.startswith("/etc/nginx/conf.d/") and target.endswith(".conf")
    text = NGINX_CONF.read_text(encoding="utf-8")
    upstream = re.search(r"upstream\s+(\S+)\s*\{(.*?)\}", re.sub(r"#[^\n]*", "", text), re.S)
    assert upstream, "an upstream block"
    servers = {args[0] for name, args in nginx_statements(upstream.group(2)) if name == "server"}
    port = compose_settings().server.port
    assert servers == {f"{name}:{port}" for name in GATEWAYS}
    assert nginx_directive(text, "proxy_pass") == [[f"http://{upstream.group(1)}"]]
    assert nginx_directive(text, "proxy_buffering") == [["off"]]
    assert nginx_directive(text, "proxy_request_buffering") == [["off"]]
    assert nginx_directive(text, "proxy_http_version") == [["1.1"]]
    assert ["Connection", '""'] in nginx_directive(text, "proxy_set_header")
    assert nginx_directive(upstream.group(2), "keepalive"), "keep-alive to the replicas"
    [[listen]] = nginx_directive(text, "listen")
    assert published(lb) == [("127.0.0.1", "8080", listen)]
    depends = lb.get("depends_on") or {}
    for name in GATEWAYS:
        assert depends.get(name, {}).get("condition") == "service_healthy", name
        assert services()[name].get("healthcheck"), name


def test_load_balancer_timeouts_fit_the_gateway() -> None:
    """nginx outwaits the slowest upstream read and drops idle connections before uvicorn does."""
    text = NGINX_CONF.read_text(encoding="utf-8")
    read_timeout = seconds(nginx_directive(text, "proxy_read_timeout")[0][0])
    slowest = max(p.read_timeout_ms for p in compose_settings().providers.values()) / 1000
    assert read_timeout > slowest
    keep_alive = gateway_setting("timeout_keep_alive")
    if keep_alive is None:
        default = inspect.signature(uvicorn.Config).parameters["timeout_keep_alive"].default
        keep_alive = float(default)
    assert seconds(nginx_directive(text, "keepalive_timeout")[0][0]) < keep_alive


def test_published_ports_bind_loopback_only() -> None:
    """No service of the keyless demo is reachable from other machines."""
    count = 0
    for name, service in services().items():
        for host_ip, _, _ in published(service):
            assert host_ip == "127.0.0.1", name
            count += 1
    assert count >= 3, "the load balancer, Grafana and Jaeger are published"


def test_vllm_runs_only_under_the_gpu_profile() -> None:
    """The GPU service stays out of a plain `docker compose up`, and nothing waits for it."""
    vllm = services()["vllm"]
    assert vllm["profiles"] == ["gpu"]
    assert image(vllm).startswith("vllm/vllm-openai:")
    for name, service in services().items():
        if name != "vllm":
            assert not service.get("profiles"), name
            assert "vllm" not in (service.get("depends_on") or {}), name
    devices = vllm["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert env_of(vllm)["HF_TOKEN"].startswith("${HF_TOKEN")
    assert flag(argv(vllm), "--served-model-name") in {
        d.model for m in compose_settings().models for d in m.deployments
    }


def test_vllm_speculative_decoding_example_is_valid() -> None:
    """The commented --speculative-config example is JSON vLLM can read, once uncommented."""
    lines = [line.strip() for line in COMPOSE.read_text(encoding="utf-8").splitlines()]
    found = [i for i, line in enumerate(lines) if line == "# - --speculative-config"]
    assert found
    for i in found:
        value = yaml.safe_load(lines[i + 1].removeprefix("#").strip())[0]
        config = json.loads(value)
        assert config["method"] == "ngram" or "model" in config
        assert int(config["num_speculative_tokens"]) > 0


def test_bind_mounted_files_exist() -> None:
    """Every file or folder the stack mounts is in the repository."""
    for name, service in services().items():
        for host, _, read_only in bind_mounts(service):
            assert (ROOT / host).exists(), f"{name}: {host}"
            assert read_only, f"{name}: {host} should be mounted read-only"


def test_otel_collector_receives_otlp_and_exports_to_jaeger() -> None:
    """OTLP in on gRPC and HTTP, batched, out to Jaeger; the replicas export to its HTTP port."""
    collector_name = service_with_image("otel/opentelemetry-collector-contrib:")
    collector = services()[collector_name]
    config_path = flag(argv(collector), "--config")
    assert config_path == mount_target(collector, "./deploy/otel-collector.yaml")
    config = load_yaml(OTEL_CONF)
    protocols = config["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"] == "0.0.0.0:4317"
    assert protocols["http"]["endpoint"] == "0.0.0.0:4318"
    traces = config["service"]["pipelines"]["traces"]
    assert "otlp" in traces["receivers"]
    assert "batch" in traces["processors"]
    assert set(traces["processors"]) <= set(config["processors"])
    jaeger_name = service_with_image("jaegertracing/all-in-one:")
    assert env_of(services()[jaeger_name])["COLLECTOR_OTLP_ENABLED"] == "true"
    exporters = [config["exporters"][name] for name in traces["exporters"]]
    assert any(host_port(e["endpoint"]) == (jaeger_name, 4317) for e in exporters)
    for name in GATEWAYS:
        endpoint = env_of(services()[name])["OTEL_EXPORTER_OTLP_ENDPOINT"]
        assert host_port(endpoint) == (collector_name, 4318)


def test_prometheus_scrapes_both_replicas() -> None:
    """Prometheus scrapes GET /metrics of each replica by service name on the gateway's port."""
    prometheus = services()[service_with_image("prom/prometheus:")]
    config_path = flag(argv(prometheus), "--config.file")
    assert config_path == mount_target(prometheus, "./deploy/prometheus/prometheus.yml")
    config = load_yaml(PROMETHEUS_CONF)
    port = compose_settings().server.port
    targets: set[str] = set()
    for job in config["scrape_configs"]:
        assert job.get("metrics_path", "/metrics") == "/metrics"
        for static in job.get("static_configs", []):
            targets.update(static["targets"])
    assert targets == {f"{name}:{port}" for name in GATEWAYS}


def test_grafana_provisioning_matches_the_stack() -> None:
    """Grafana loads the dashboard folder it is given and reaches Prometheus by service name."""
    grafana = services()[service_with_image("grafana/grafana:")]
    assert mount_target(grafana, "./deploy/grafana/provisioning") == "/etc/grafana/provisioning"
    dashboards_dir = mount_target(grafana, "./deploy/grafana/dashboards")
    providers = load_yaml(GRAFANA / "provisioning" / "dashboards" / "dashboards.yaml")["providers"]
    assert [p["options"]["path"] for p in providers] == [dashboards_dir]
    sources = load_yaml(GRAFANA / "provisioning" / "datasources" / "datasources.yaml")
    prometheus = next(ds for ds in sources["datasources"] if ds["type"] == "prometheus")
    host, port = host_port(prometheus["url"])
    assert image(services()[host]).startswith("prom/prometheus:") and port == 9090
    env = env_of(grafana)
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"


# --- the dashboard -------------------------------------------------------------------------------


def test_dashboard_reads_the_provisioned_datasource() -> None:
    """The dashboard has its fixed uid and every query goes to the provisioned Prometheus."""
    board = dashboard()
    assert board["uid"] == "tailguard"
    assert board["schemaVersion"] >= 36
    uid = prometheus_datasource_uid()
    queried = 0
    for panel in panels(board["panels"]):
        targets = panel.get("targets") or []
        if not targets:
            assert panel["type"] == "row", panel.get("title")
            continue
        assert panel["datasource"]["uid"] == uid, panel["title"]
        for target in targets:
            assert target["datasource"]["uid"] == uid, panel["title"]
            queried += 1
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            assert variable["datasource"]["uid"] == uid, variable["name"]
    assert queried >= 12
    ids = [panel["id"] for panel in panels(board["panels"])]
    assert len(ids) == len(set(ids)), "panel ids are unique"


def recorded_names() -> set[str]:
    """The series the Prometheus recording rules in deploy/prometheus/rules record."""
    return {
        rule["record"]
        for path in (DEPLOY / "prometheus" / "rules").glob("*.yml")
        for group in load_yaml(path)["groups"]
        for rule in group["rules"]
        if "record" in rule
    }


def test_dashboard_queries_only_metrics_the_gateway_exposes() -> None:
    """A renamed or misspelt metric in a panel or variable fails here, not on a blank graph (a
    recorded series counts: tests/project/test_prometheus_rules.py checks what the rules read)."""
    used: set[str] = set()
    known = EXPOSED | recorded_names()
    for expr in dashboard_exprs():
        names = promql_metrics(expr)
        assert names, expr
        assert names <= known, f"unknown metrics {sorted(names - known)} in {expr}"
        used |= names
    for variable in dashboard()["templating"]["list"]:
        query = variable.get("query")
        text = query.get("query", "") if isinstance(query, dict) else str(query or "")
        match = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", text)
        assert match, text
        assert match.group(1) in EXPOSED, text
    missing = DASHBOARD_MUST_SHOW - {family(name) for name in used}
    assert not missing, f"no panel shows {sorted(missing)}"


def test_dashboard_quantiles_aggregate_buckets_by_le() -> None:
    """Every histogram_quantile runs over rate(..._bucket) summed by `le`, or it is meaningless."""
    quantiles = [expr for expr in dashboard_exprs() if "histogram_quantile" in expr]
    assert quantiles
    for expr in quantiles:
        assert re.search(r"rate\(\w+_bucket(\{[^}]*\})?\[\w+\]\)", expr), expr
        groups = re.findall(r"\bby\s*\(([^)]*)\)", expr)
        assert any("le" in [g.strip() for g in group.split(",")] for group in groups), expr


def test_promql_metric_extraction() -> None:
    """The dashboard check's PromQL reader tells metrics from functions, labels and keywords."""
    expr = (
        'sum by (status) (rate(a_total{model=~"$model", status!~"2.."}[5m])) / ignoring (status)'
        " group_left () sum(rate(a_total[5m] offset 1h)) * on (le) 1e3 + b"
    )
    assert promql_metrics(expr) == {"a_total", "b"}
    assert promql_metrics("histogram_quantile(0.99, sum by (le, m) (rate(h_bucket[5m])))") == {
        "h_bucket"
    }


def test_dashboard_metric_names_match_the_gateway() -> None:
    """Every metric family the dashboard may query is still defined, by that name, in gateway/."""
    defined: set[str] = set()
    for path in (ROOT / "gateway").rglob("*.py"):
        for node in ast.walk(parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and re.fullmatch(r"(tailguard|gen_ai)_[a-z0-9_]+", node.value)
            ):
                defined.add(node.value.removesuffix("_total"))
    expected = COUNTERS | HISTOGRAMS | GAUGES
    assert not expected - defined, f"not defined in gateway/: {sorted(expected - defined)}"


# --- Kubernetes ----------------------------------------------------------------------------------


def test_kustomization_lists_every_manifest() -> None:
    """`kubectl apply -k` applies every manifest in deploy/k8s, except the Secret example."""
    listed = set(kustomization()["resources"])
    generated = {
        file
        for generator in kustomization().get("configMapGenerator", [])
        for file in generator["files"]
    }
    present = {
        path.name
        for path in K8S.iterdir()
        if path.suffix in (".yaml", ".yml") and path.name != "kustomization.yaml"
    }
    examples = {name for name in present if ".example." in name}
    assert examples == {"secret.example.yaml"}
    assert listed | generated == present - examples
    assert not listed & generated
    kinds = {doc["kind"] for doc in k8s_manifests()}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler"} <= kinds
    for doc in k8s_manifests():
        assert doc["apiVersion"] and doc["metadata"]["name"], doc["kind"]


def test_k8s_config_map_holds_a_valid_redis_config() -> None:
    """The ConfigMap's gateway.yaml validates and shares latency through Redis."""
    generators = kustomization()["configMapGenerator"]
    assert [g["files"] for g in generators] == [["gateway.yaml"]]
    variables = k8s_config_variables()
    settings = k8s_settings()
    assert settings.latency.store == "redis"
    assert settings.server.host == "0.0.0.0"
    container = gateway_container()
    assert container_port(container, settings.server.port) == settings.server.port
    env = {e["name"] for e in container.get("env", [])}
    assert variables <= env, f"set no value for {sorted(variables - env)}"


def test_k8s_deployment_probes_config_and_security() -> None:
    """Two replicas, /readyz and /healthz on the container port, config mounted, non-root."""
    deployment = k8s_object("Deployment")
    spec = deployment["spec"]
    pod = spec["template"]["spec"]
    assert spec["replicas"] == 2
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    container = gateway_container()
    assert [p["containerPort"] for p in container["ports"]] == [8080]
    ready = container["readinessProbe"]["httpGet"]
    alive = container["livenessProbe"]["httpGet"]
    assert ready["path"] == "/readyz" and container_port(container, ready["port"]) == 8080
    assert alive["path"] == "/healthz" and container_port(container, alive["port"]) == 8080
    generator = kustomization()["configMapGenerator"][0]["name"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = [
        m
        for m in container["volumeMounts"]
        if volumes[m["name"]].get("configMap", {}).get("name") == generator
    ]
    assert len(mounts) == 1
    mounted = Path(mounts[0]["mountPath"]) / mounts[0].get("subPath", "gateway.yaml")
    args = [str(a) for a in container.get("args", [])]
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    assert GATEWAY_CONFIG_PATH in (flag(args, "--config"), env.get("TAILGUARD_CONFIG"))
    assert str(mounted) == GATEWAY_CONFIG_PATH
    assert flag(args, "--host") == "0.0.0.0"
    assert container["resources"]["requests"]["cpu"], "the HPA's CPU target needs a request"
    assert container["resources"]["limits"]["memory"]
    security = pod.get("securityContext", {}) | container.get("securityContext", {})
    assert security["runAsNonRoot"] is True
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False


def test_k8s_shutdown_outlasts_the_drain() -> None:
    """The pod leaves the Service before SIGTERM and is not killed mid-drain."""
    container = gateway_container()
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pause = float(command[1])
    assert 1 <= pause <= 15
    grace = shutdown_grace(k8s_settings())
    assert grace is not None, "`tailguard serve` bounds its graceful shutdown"
    period = k8s_object("Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert period > pause + grace


def test_k8s_secrets_come_from_secret_key_refs() -> None:
    """Keys and the Redis URL come from the Secret; no literal value looks like a key."""
    secret = k8s_documents(K8S / "secret.example.yaml")[0]
    assert secret["kind"] == "Secret"
    placeholders = secret["stringData"]
    assert all("CHANGE-ME" in str(value) for value in placeholders.values())
    refs = 0
    for env in gateway_container()["env"]:
        source = env.get("valueFrom", {})
        if SECRET_NAME.search(env["name"]):
            ref = source.get("secretKeyRef")
            assert ref, f"{env['name']} must come from a secretKeyRef"
            assert ref["name"] == secret["metadata"]["name"], env["name"]
            assert ref["key"] in placeholders, env["name"]
            refs += 1
        if "value" in env:
            assert not SECRET_LOOKING.search(str(env["value"])), env["name"]
    assert refs >= 2
    settings_text = (K8S / "gateway.yaml").read_text(encoding="utf-8")
    for match in re.finditer(r"^\s*(api_key|redis_url):\s*(\S+)", settings_text, re.M):
        assert match.group(2).startswith("${"), match.group(0)


def test_k8s_service_and_autoscaler_target_the_deployment() -> None:
    """The ClusterIP Service reaches the pods on 8080 and the HPA scales the Deployment on CPU."""
    deployment = k8s_object("Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    service = k8s_object("Service")
    assert service["spec"].get("type", "ClusterIP") == "ClusterIP"
    assert service["spec"]["selector"].items() <= labels.items()
    [port] = service["spec"]["ports"]
    assert port["port"] == 8080
    assert container_port(gateway_container(), port.get("targetPort", port["port"])) == 8080
    hpa = k8s_object("HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert hpa["spec"]["minReplicas"] >= 2
    [metric] = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu"
    assert metric["resource"]["target"]["type"] == "Utilization"


def test_no_literal_secrets_in_deployment_files() -> None:
    """No key, token or password-bearing URL is written into any deployment file."""
    files = [COMPOSE, COMPOSE_CONFIG, *DEPLOY.rglob("*")]
    checked = 0
    for path in files:
        if not path.is_file() or path.suffix not in (".yaml", ".yml", ".json", ".conf"):
            continue
        if path.name == "secret.example.yaml":
            continue  # placeholders, checked above
        found = SECRET_LOOKING.search(path.read_text(encoding="utf-8"))
        assert not found, f"{path.relative_to(ROOT)}: {found.group(0) if found else ''}"
        checked += 1
    assert checked >= 10


# --- the image -----------------------------------------------------------------------------------


def test_dockerfile_keeps_its_entry_point_and_context() -> None:
    """The image still runs `tailguard serve` on the config path compose and Kubernetes mount."""
    instructions = dockerfile_instructions()
    entrypoint = [json.loads(rest) for keyword, rest in instructions if keyword == "ENTRYPOINT"]
    cmd = [json.loads(rest) for keyword, rest in instructions if keyword == "CMD"]
    assert entrypoint[-1] == ["tailguard"]
    assert cmd[-1][0] == "serve"
    assert flag(cmd[-1], "--config") == GATEWAY_CONFIG_PATH
    assert flag(cmd[-1], "--host") == "0.0.0.0"
    assert ("EXPOSE", "8080") in instructions
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"][
        "scripts"
    ]
    assert scripts["tailguard"] == "gateway.cli:main"
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for secret in (".env", ".git", ".venv"):
        assert dockerignored(secret, patterns), f"{secret} must stay out of the build context"
    for keyword, rest in instructions:
        if keyword not in ("COPY", "ADD") or "--from" in rest:
            continue
        sources = [word for word in rest.split() if not word.startswith("--")][:-1]
        for source in sources:
            assert (ROOT / source).exists(), source
            assert not dockerignored(source, patterns), f"{source} is excluded by .dockerignore"

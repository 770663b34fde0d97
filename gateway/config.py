"""Configuration: the YAML file, `${VAR}` secrets and `TAILGUARD_*` overrides, validated at load.

Nothing else in the gateway reads environment variables or files. Precedence, highest first:
explicit overrides (CLI flags) > `TAILGUARD_*` environment variables (nested with `__`, e.g.
`TAILGUARD_SERVER__PORT=9000`) > the YAML file. Unknown keys are errors, and every error names the
file, the field path and the reason, never a secret's value.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from gateway.sim.engine import SimProfile

DEFAULT_CONFIG_PATH = "config/gateway.yaml"
CONFIG_PATH_ENV = "TAILGUARD_CONFIG"
LOG_LEVEL_ENV = "TAILGUARD_LOG_LEVEL"  # how `serve --workers N` passes --log-level on

ProviderType = Literal["openai", "vllm", "anthropic", "simulated"]
Priority = Literal["interactive", "bulk"]
OnTTFTMiss = Literal["failover", "hedge", "none"]

_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$"


class ConfigError(Exception):
    """The configuration cannot be used; the message is safe to print (it holds no secret)."""


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerSpec(_Spec):
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8080
    workers: Annotated[int, Field(ge=1, le=64)] = 1
    max_body_bytes: Annotated[int, Field(gt=0)] = 10 * 1024 * 1024
    access_log: bool = True  # one JSON line per LLM request on stdout
    shutdown_grace_s: Annotated[float, Field(ge=0, le=3600)] = 30.0  # for in-flight streams
    reload_on_change: bool = True  # reload when the config file changes (SIGHUP always does)
    # Limits against abusive clients. A request's headers must arrive within read_timeout_s of
    # its first byte (or of the connection), and its body within read_timeout_s of its headers.
    max_header_bytes: Annotated[int, Field(ge=1024, le=1024 * 1024)] = 64 * 1024
    read_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 30.0
    keepalive_timeout_s: Annotated[
        float,
        Field(
            gt=0,
            le=3600,
            description="How long an idle keep-alive connection stays open, counted from the "
            "end of its last response (bytes that begin no request do not extend it).",
        ),
    ] = 5.0
    readiness_detail: Literal["admin", "public", "none"] = Field(
        "admin",
        description="Who sees /readyz's detail (providers, models, stores, config): `admin` "
        "(an admin key, when keys are configured), `public` (anyone) or `none`. The status "
        "itself is always open.",
    )
    max_concurrent: Annotated[int, Field(gt=0)] | None = 1000  # LLM requests in flight, per worker
    # Without API keys the gateway serves only loopback unless this says otherwise.
    allow_unauthenticated: bool = False


class LatencySpec(_Spec):
    store: Literal["memory", "redis"] = "memory"
    redis_url: SecretStr | None = None
    window_s: Annotated[int, Field(ge=5, le=3600)] = 60
    slice_s: Annotated[int, Field(ge=1, le=600)] = 5
    min_samples: Annotated[int, Field(ge=1)] = 20

    @model_validator(mode="after")
    def _redis_needs_url(self) -> LatencySpec:
        if self.store == "redis" and not self.redis_url:
            raise ValueError("store is 'redis' but redis_url is not set")
        if self.slice_s > self.window_s:
            raise ValueError("slice_s must not exceed window_s")
        return self


class ProviderSpec(_Spec):
    type: ProviderType
    base_url: str | None = None
    api_key: SecretStr | None = None
    headers: dict[str, SecretStr] = Field(
        default_factory=dict, description="Extra headers sent upstream (values are secrets)."
    )
    connect_timeout_ms: Annotated[int, Field(gt=0)] = 5_000
    read_timeout_ms: Annotated[int, Field(gt=0)] = 600_000
    stream_idle_timeout_ms: Annotated[
        int,
        Field(
            gt=0,
            le=3_600_000,
            description="A streamed response that makes no content progress for this long "
            "is given up on, whatever else it sends (keep-alives, a trickle of bytes): before "
            "the first content token the attempt fails (failover, else 504), after it the "
            "stream ends with an error event. Counted from the attempt's start, then from "
            "each content token.",
        ),
    ] = 60_000
    max_precommit_events: Annotated[
        int,
        Field(
            ge=1,
            le=1_000_000,
            description="Events (comments, keep-alives, empty or role-only chunks) an upstream "
            "may send before its first content token; one more fails the attempt.",
        ),
    ] = 1_000
    max_precommit_bytes: Annotated[
        int,
        Field(
            ge=1024,
            le=1024 * 1024 * 1024,
            description="Bytes of events an upstream may send before its first content token "
            "(the gateway holds them until it commits); more fail the attempt.",
        ),
    ] = 1024 * 1024
    max_connections: Annotated[int, Field(ge=1)] = 1_000
    max_keepalive_connections: Annotated[int, Field(ge=0)] = 100
    anthropic_version: str = "2023-06-01"
    # vllm only: the server runs `--scheduling-policy priority`; bulk requests are sent with
    # this `priority` (vLLM serves lower values first; interactive ones keep the default 0).
    bulk_priority: int | None = None
    # vllm only: where its Prometheus metrics are read (default: /metrics beside /v1), how often.
    metrics_url: str | None = None
    metrics_interval_s: Annotated[float, Field(gt=0, le=60)] = 1.0
    # simulated providers only
    profiles: dict[str, SimProfile] = Field(default_factory=dict)
    default_profile: SimProfile | None = None
    seed: int | None = None

    @model_validator(mode="after")
    def _check_kind(self) -> ProviderSpec:
        if self.bulk_priority is not None and self.type != "vllm":
            raise ValueError("bulk_priority is for providers of type vllm")
        if self.metrics_url is not None and self.type != "vllm":
            raise ValueError("metrics_url is for providers of type vllm")
        if self.type == "simulated":
            if self.base_url is not None:
                raise ValueError("a simulated provider runs in-process and takes no base_url")
            return self
        if self.base_url is None:
            raise ValueError(f"base_url is required for a provider of type {self.type!r}")

        parts = urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("base_url must be an http:// or https:// URL with a host")
        if parts.query or parts.fragment:
            raise ValueError("base_url must not carry a query or fragment")
        if self.profiles or self.default_profile is not None or self.seed is not None:
            raise ValueError("profiles, default_profile and seed apply to simulated providers only")
        return self


class PriorSpec(_Spec):
    """What to assume about a deployment until its own statistics are trusted."""

    ttft_ms: Annotated[float, Field(gt=0)] | None = None  # expected p99 time to first token
    tpot_ms: Annotated[float, Field(gt=0)] | None = None  # expected p99 time per output token


class DeploymentSpec(_Spec):
    provider: Annotated[str, Field(pattern=_NAME)]
    model: Annotated[str, Field(min_length=1)]
    weight: Annotated[float, Field(gt=0)] = 1.0
    prior: PriorSpec | None = None

    @property
    def id(self) -> str:
        return f"{self.provider}/{self.model}"


class BudgetSpec(_Spec):
    ttft_ms: Annotated[int, Field(gt=0)] | None = None
    total_ms: Annotated[int, Field(gt=0)] | None = None

    @model_validator(mode="after")
    def _ordered(self) -> BudgetSpec:
        if self.ttft_ms is not None and self.total_ms is not None and self.ttft_ms > self.total_ms:
            raise ValueError("ttft_ms exceeds total_ms")
        return self


class BatchingSpec(_Spec):
    max_batch_size: Annotated[int, Field(ge=1, le=4096)] = 64
    max_wait_ms: Annotated[int, Field(ge=0, le=60_000)] = 20
    max_inflight: Annotated[int, Field(ge=1, le=1024)] = 4
    max_queue: Annotated[int, Field(ge=1)] = 4096


class ModelSpec(_Spec):
    name: Annotated[str, Field(pattern=_NAME)]
    deployments: Annotated[tuple[DeploymentSpec, ...], Field(min_length=1)]
    budget: BudgetSpec = BudgetSpec()
    fallbacks: tuple[str, ...] = ()
    on_ttft_miss: OnTTFTMiss = "failover"
    # Cap on latency rescues (hedges and deadline failovers together), as a share of the
    # model's client requests over the window; over it, a slow attempt is waited for.
    hedge_max_fraction: Annotated[float, Field(ge=0, le=1)] = 0.05
    priority: Priority = "interactive"
    batching: BatchingSpec | None = None

    @model_validator(mode="after")
    def _unique_deployments(self) -> ModelSpec:
        ids = [d.id for d in self.deployments]
        if len(set(ids)) != len(ids):
            raise ValueError("deployments repeat the same provider/model")
        if self.name in self.fallbacks:
            raise ValueError("a model cannot be its own fallback")
        return self


class CooldownSpec(_Spec):
    """The per-deployment circuit breaker."""

    failures: Annotated[int, Field(ge=1)] = 3  # consecutive failures that open it
    base_s: Annotated[float, Field(gt=0)] = 5.0  # first cooldown; doubles each time it reopens
    max_s: Annotated[float, Field(gt=0)] = 60.0  # cap, also on an upstream's retry-after

    @model_validator(mode="after")
    def _ordered(self) -> CooldownSpec:
        if self.base_s > self.max_s:
            raise ValueError("base_s exceeds max_s")
        return self


class RetryBudgetSpec(_Spec):
    """Failovers in flight are capped at `percent` of active requests, but never below
    `min_concurrent` (Envoy's retry budget)."""

    percent: Annotated[float, Field(ge=0, le=100)] = 20.0
    min_concurrent: Annotated[int, Field(ge=0)] = 3


class BulkSpec(_Spec):
    """Admission of bulk chat requests per deployment (see gateway/batching/gate.py)."""

    initial_concurrency: Annotated[int, Field(ge=1)] = 4
    min_concurrency: Annotated[int, Field(ge=1)] = 1
    max_concurrency: Annotated[int, Field(ge=1)] = 64
    backoff_at: Annotated[float, Field(gt=0, le=1)] = 0.8  # interactive TTFT / budget: halve
    grow_below: Annotated[float, Field(gt=0, le=1)] = 0.5  # ... below this: grow by one
    cooldown_s: Annotated[float, Field(ge=0)] = 0.5  # at most one halving per this long
    max_queue: Annotated[int, Field(ge=0)] = 4096  # bulk requests waiting; beyond: 503

    @model_validator(mode="after")
    def _ordered(self) -> BulkSpec:
        if not self.min_concurrency <= self.initial_concurrency <= self.max_concurrency:
            raise ValueError("need min_concurrency <= initial_concurrency <= max_concurrency")
        if self.grow_below > self.backoff_at:
            raise ValueError("grow_below exceeds backoff_at")
        return self


class RoutingSpec(_Spec):
    cooldown: CooldownSpec = CooldownSpec()
    retry_budget: RetryBudgetSpec = RetryBudgetSpec()
    bulk: BulkSpec = BulkSpec()


_SHA256 = r"^[0-9a-f]{64}$"
_KEY_NAME = r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,63}$"


class KeySpec(_Spec):
    """A client key: only its SHA-256 is configured (`tailguard keys new` makes one)."""

    name: Annotated[str, Field(pattern=_KEY_NAME)]
    sha256: Annotated[str, Field(pattern=_SHA256)]
    models: tuple[str, ...] | None = None  # None: every model
    rpm: Annotated[int, Field(gt=0)] | None = None  # requests per minute
    tpm: Annotated[int, Field(gt=0)] | None = None  # tokens per minute (prompt + output)
    max_concurrent: Annotated[int, Field(gt=0)] | None = None  # requests in flight, per worker
    max_n: Annotated[int, Field(gt=0)] | None = None
    max_tokens: Annotated[int, Field(gt=0)] | None = None


class AdminKeySpec(_Spec):
    name: Annotated[str, Field(pattern=_KEY_NAME)]
    sha256: Annotated[str, Field(pattern=_SHA256)]


class RateLimitSpec(_Spec):
    """Where the per-key rpm/tpm counters live, and what happens when that store fails."""

    store: Literal["auto", "memory", "redis"] = "auto"  # auto: redis when latency.store is
    redis_url: SecretStr | None = None  # default: latency.redis_url
    # The one round trip's cap, counted in Redis's time: while this process's event loop is too
    # busy to read the answer, the wait is extended (up to 10x, at most 1 s more).
    timeout_ms: Annotated[int, Field(gt=0, le=5000)] = 50
    # open: each replica enforces the limits on its own meanwhile; closed: refuse with 503.
    on_store_error: Literal["open", "closed"] = "open"
    default_output_tokens: Annotated[
        int,
        Field(
            gt=0,
            le=1_000_000,
            description="Output tokens charged at admission to a request that sets no "
            "max_tokens, on a key without a max_tokens cap, while its model has no observed "
            "outputs (then their mean is charged). The charge is settled with the real usage.",
        ),
    ] = 1024


class AuthSpec(_Spec):
    keys: tuple[KeySpec, ...] = ()
    admin_keys: tuple[AdminKeySpec, ...] = ()
    rate_limits: RateLimitSpec = RateLimitSpec()

    @property
    def enabled(self) -> bool:
        return bool(self.keys or self.admin_keys)

    @model_validator(mode="after")
    def _unique(self) -> AuthSpec:
        names: set[str] = set()
        hashes: set[str] = set()
        every: list[KeySpec | AdminKeySpec] = [*self.keys, *self.admin_keys]
        for key in every:
            if key.name in names:
                raise ValueError(f"auth: the key name {key.name!r} is used twice")
            if key.sha256 in hashes:
                raise ValueError(f"auth: the key {key.name!r} has the same hash as another key")
            names.add(key.name)
            hashes.add(key.sha256)
        return self


_yaml_data: ContextVar[dict[str, Any]] = ContextVar("tailguard_yaml_data")


class _YamlDataSource(PydanticBaseSettingsSource):
    """The already-resolved YAML document, as the lowest-precedence source."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ returns the whole document

    def __call__(self) -> dict[str, Any]:
        return _yaml_data.get({})


class Settings(BaseSettings):
    """The whole validated configuration. Build it with `load_settings`."""

    model_config = SettingsConfigDict(
        env_prefix="TAILGUARD_",
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
        validate_default=True,
    )

    server: ServerSpec = ServerSpec()
    latency: LatencySpec = LatencySpec()
    providers: dict[Annotated[str, Field(pattern=_NAME)], ProviderSpec]
    models: Annotated[tuple[ModelSpec, ...], Field(min_length=1)]
    routing: RoutingSpec = RoutingSpec()
    auth: AuthSpec | None = None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, _YamlDataSource(settings_cls)

    @model_validator(mode="after")
    def _references_resolve(self) -> Settings:
        names = [m.name for m in self.models]
        seen: set[str] = set()
        for name in names:
            if name in seen:
                raise ValueError(f"models: the name {name!r} is used twice")
            seen.add(name)
        for model in self.models:
            for deployment in model.deployments:
                if deployment.provider not in self.providers:
                    raise ValueError(
                        f"models[{model.name}].deployments: unknown provider "
                        f"{deployment.provider!r} (configured: {', '.join(self.providers)})"
                    )
            for fallback in model.fallbacks:
                if fallback not in seen:
                    raise ValueError(f"models[{model.name}].fallbacks: unknown model {fallback!r}")
        cycle = _fallback_cycle({m.name: m.fallbacks for m in self.models})
        if cycle:
            raise ValueError(f"models: fallbacks form a cycle: {' -> '.join(cycle)}")
        if self.auth is not None:
            limits = self.auth.rate_limits
            if limits.store == "redis" and not (limits.redis_url or self.latency.redis_url):
                raise ValueError("auth.rate_limits: store 'redis' needs a redis_url")
            for key in self.auth.keys:
                for name in key.models or ():
                    if name not in seen:
                        raise ValueError(f"auth.keys[{key.name}].models: unknown model {name!r}")
        return self

    def model(self, name: str) -> ModelSpec | None:
        for model in self.models:
            if model.name == name:
                return model
        return None


def _fallback_cycle(graph: Mapping[str, tuple[str, ...]]) -> list[str]:
    """Return one cycle in the fallback graph, or [] if there is none."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if state.get(nxt) is None and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return []

    for node in graph:
        if node not in state and (found := visit(node)):
            return found
    return []


# --- loading -------------------------------------------------------------------------------------

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def resolve_env(value: Any, environ: Mapping[str, str], path: str = "") -> Any:
    """Replace `${VAR}` and `${VAR:-default}` in every string of a YAML document."""
    if isinstance(value, str):

        def substitute(match: re.Match[str]) -> str:
            name, default = match.group(1), match.group(2)
            if name in environ and environ[name] != "":
                return environ[name]
            if default is not None:
                return default
            raise ConfigError(f"{path or '<root>'}: environment variable {name} is not set")

        return _VAR.sub(substitute, value)
    if isinstance(value, dict):
        return {k: resolve_env(v, environ, _join(path, k)) for k, v in value.items()}
    if isinstance(value, list):
        return [
            resolve_env(v, environ, _join(path, _item_label(v, i))) for i, v in enumerate(value)
        ]
    return value


def _join(path: str, key: object) -> str:
    if isinstance(key, int) or (isinstance(key, str) and key.startswith("[")):
        return f"{path}{key}" if isinstance(key, str) else f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


def _item_label(item: object, index: int) -> str:
    if isinstance(item, dict) and isinstance(item.get("name"), str):
        return f"[{item['name']}]"
    return f"[{index}]"


def config_path(path: str | os.PathLike[str] | None = None) -> Path:
    """The file to load: the argument, else `$TAILGUARD_CONFIG`, else config/gateway.yaml."""
    return Path(path or os.environ.get(CONFIG_PATH_ENV) or DEFAULT_CONFIG_PATH)


def load_settings(
    path: str | os.PathLike[str] | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Load, resolve and validate a config file. Raises ConfigError with a printable message."""
    file = config_path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{file}: cannot read the file ({exc.strerror or exc})") from None
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{file}: not valid YAML{where}") from None
    if document is None:
        document = {}
    if not isinstance(document, dict):
        raise ConfigError(f"{file}: the top level must be a mapping")
    try:
        resolved = resolve_env(document, os.environ if environ is None else environ)
    except ConfigError as exc:
        raise ConfigError(f"{file}: {exc}") from None
    return build_settings(resolved, source=str(file), overrides=overrides)


def build_settings(
    document: dict[str, Any],
    *,
    source: str = "<config>",
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Validate an already-resolved document (as loaded from YAML) with env and overrides."""
    with _document(document):
        try:
            return Settings(**dict(overrides or {}))
        except ValidationError as exc:
            lines = [_describe(error, document) for error in exc.errors(include_input=False)]
            raise ConfigError(f"{source}: invalid configuration\n  " + "\n  ".join(lines)) from None


@contextmanager
def _document(document: dict[str, Any]) -> Iterator[None]:
    token = _yaml_data.set(document)
    try:
        yield
    finally:
        _yaml_data.reset(token)


def _describe(error: Any, document: Mapping[str, Any]) -> str:
    """One validation error as `path: reason`, list indexes replaced by model names."""
    path = ""
    node: Any = document
    for part in error["loc"]:
        if isinstance(part, int):
            label = f"[{part}]"
            if isinstance(node, list) and part < len(node):
                node = node[part]
                if isinstance(node, dict) and isinstance(node.get("name"), str):
                    label = f"[{node['name']}]"
            else:
                node = None
            path += label
            continue
        path = _join(path, part)
        node = node.get(part) if isinstance(node, dict) else None
    message = str(error["msg"]).removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        message = "unknown key"
    return f"{path or '<root>'}: {message}"

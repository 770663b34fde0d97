"""Loading the configuration: the YAML file, `${VAR}` secrets and `TAILGUARD_*` overrides.

Nothing else in the gateway reads environment variables or files for settings. Precedence,
highest first: explicit overrides (CLI flags) > `TAILGUARD_*` environment variables (nested with
`__`, e.g. `TAILGUARD_SERVER__PORT=9000`) > the YAML file. Unknown keys are errors, and every
error names the file, the field path and the reason, never a secret's value.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from gateway.config.specs import (
    _NAME,
    CONFIG_PATH_ENV,
    DEFAULT_CONFIG_PATH,
    AuthSpec,
    ConfigError,
    LatencySpec,
    ModelSpec,
    ProviderSpec,
    RoutingSpec,
    ServerSpec,
)

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
        use_attribute_docstrings=True,
    )

    server: ServerSpec = ServerSpec()
    """The HTTP server and its limits."""
    latency: LatencySpec = LatencySpec()
    """The latency statistics and their store."""
    providers: dict[Annotated[str, Field(pattern=_NAME)], ProviderSpec]
    """Upstream endpoints by name."""
    models: Annotated[tuple[ModelSpec, ...], Field(min_length=1)]
    """The model names clients may send."""
    routing: RoutingSpec = RoutingSpec()
    """Cooldowns, the retry budget and bulk admission."""
    auth: AuthSpec | None = None
    """API keys and rate limits (absent: no keys)."""

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


# The embedded defaults ship inside the package, so `tailguard serve` works from any directory.
PACKAGED_CONFIG = Path(__file__).with_name("gateway.yaml")


def config_path(path: str | os.PathLike[str] | None = None) -> Path:
    """The file to load: the argument, else `$TAILGUARD_CONFIG`, else `config/gateway.yaml` in
    the working directory when there is one, else the packaged defaults."""
    chosen = path or os.environ.get(CONFIG_PATH_ENV)
    if chosen:
        return Path(chosen)
    local = Path(DEFAULT_CONFIG_PATH)
    return local if local.is_file() else PACKAGED_CONFIG


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

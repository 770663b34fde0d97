"""Loading the configuration: the YAML file, `${VAR}` secrets and `TAILGUARD_*` overrides.

Nothing else in the gateway reads environment variables or files for settings. Precedence,
highest first: explicit overrides (CLI flags) > `TAILGUARD_*` environment variables (nested with
`__`, e.g. `TAILGUARD_SERVER__PORT=9000`) > the YAML file. Unknown keys are errors. A config
that cannot be used raises one ConfigError listing every problem found (printed by `problems`):
each names the file and line, or the `TAILGUARD_*` variable, the key's path and the reason,
never a secret's value.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, get_origin

from pydantic import Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict
from pydantic_settings.exceptions import SettingsError

from gateway.config.problems import (
    Loc,
    Override,
    Problem,
    annotation_at,
    did_you_mean,
    is_structured,
    label_of,
    parse_yaml,
    related,
    report,
)
from gateway.config.problems import overrides as env_overrides
from gateway.config.specs import (
    _NAME,
    CONFIG_PATH_ENV,
    DEFAULT_CONFIG_PATH,
    AuthSpec,
    ConfigError,
    LatencySpec,
    ModelSpec,
    ProviderSpec,
    ResponsesSpec,
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
    responses: ResponsesSpec = ResponsesSpec()
    """The Responses API's stored responses."""

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
        problems = _reference_problems(self)
        if problems:
            # All of them at once, each with its own path (the loader finds its line in the file).
            summary = "; ".join(f"{label}: {message}" for _, _, label, message in problems)
            raise PydanticCustomError(
                REFERENCES_ERROR, "{summary}", {"summary": summary, "problems": tuple(problems)}
            )
        return self

    @model_validator(mode="after")
    def _responses_store_has_url(self) -> Settings:
        spec = self.responses
        if spec.store == "redis" and not (spec.redis_url or self.latency.redis_url):
            raise ValueError(
                "responses: store 'redis' needs a redis_url (here, or latency.redis_url)"
            )
        return self

    def model(self, name: str) -> ModelSpec | None:
        for model in self.models:
            if model.name == name:
                return model
        return None


REFERENCES_ERROR = "config_references"
"""The error type of broken references between sections; its context lists each one."""

# (where the problem is, where its line is, the path as printed, the reason)
_Reference = tuple[Loc, Loc, str, str]


def _reference_problems(settings: Settings) -> list[_Reference]:
    """Every reference between sections that does not resolve: providers, fallbacks, keys."""
    problems: list[_Reference] = []
    seen: set[str] = set()
    for i, model in enumerate(settings.models):
        if model.name in seen:
            loc: Loc = ("models", i, "name")
            problems.append((loc, loc, "models", f"the name {model.name!r} is used twice"))
        seen.add(model.name)
    aliased: dict[str, str] = {}  # exact aliases (no pattern characters): the model they name
    for i, model in enumerate(settings.models):
        for k, alias in enumerate(model.aliases):
            loc = ("models", i, "aliases")
            if alias in seen:
                message = f"{alias!r} is a model's name: the alias would never apply"
                problems.append((loc, (*loc, k), f"models[{model.name}].aliases", message))
            elif not any(c in alias for c in "*?[") and aliased.setdefault(alias, model.name) != (
                model.name
            ):
                message = f"{alias!r} is already an alias of {aliased[alias]!r}"
                problems.append((loc, (*loc, k), f"models[{model.name}].aliases", message))
    configured = ", ".join(settings.providers)
    known = ", ".join(sorted(seen))
    for i, model in enumerate(settings.models):
        where = f"models[{model.name}]"
        for j, deployment in enumerate(model.deployments):
            if deployment.provider not in settings.providers:
                loc = ("models", i, "deployments")
                problems.append(
                    (
                        loc,
                        (*loc, j, "provider"),
                        f"{where}.deployments",
                        f"unknown provider {deployment.provider!r} (configured: {configured})",
                    )
                )
        for k, fallback in enumerate(model.fallbacks):
            if fallback not in seen:
                loc = ("models", i, "fallbacks")
                problems.append(
                    (
                        loc,
                        (*loc, k),
                        f"{where}.fallbacks",
                        f"unknown model {fallback!r} (models: {known})",
                    )
                )
    cycle = _fallback_cycle({m.name: m.fallbacks for m in settings.models})
    if cycle:
        first = next(i for i, m in enumerate(settings.models) if m.name == cycle[0])
        problems.append(
            (
                ("models",),
                ("models", first, "fallbacks"),
                "models",
                f"fallbacks form a cycle: {' -> '.join(cycle)}",
            )
        )
    auth = settings.auth
    if auth is not None:
        limits = auth.rate_limits
        if limits.store == "redis" and not (limits.redis_url or settings.latency.redis_url):
            loc = ("auth", "rate_limits")
            problems.append(
                (
                    loc,
                    (*loc, "store"),
                    "auth.rate_limits",
                    "store 'redis' needs a redis_url (here, or latency.redis_url)",
                )
            )
        for i, key in enumerate(auth.keys):
            for k, name in enumerate(key.models or ()):
                if name not in seen:
                    loc = ("auth", "keys", i, "models")
                    problems.append(
                        (
                            loc,
                            (*loc, k),
                            f"auth.keys[{key.name}].models",
                            f"unknown model {name!r} (models: {known})",
                        )
                    )
    return problems


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
    """Replace `${VAR}` and `${VAR:-default}` in every string of a YAML document.

    Raises ConfigError naming every reference to an unset (or empty) variable without default,
    one per line as `path: environment variable NAME is not set`, never a value."""
    unset: list[Problem] = []
    resolved = _substitute(value, environ, (), unset)
    if unset:
        lines = []
        for problem in unset:
            label = label_of(problem.loc, value)
            if path and label:
                label = path + label if label.startswith("[") else f"{path}.{label}"
            lines.append(f"{label or path or '<root>'}: {problem.message}")
        raise ConfigError("\n".join(lines))
    return resolved


def _substitute(value: Any, environ: Mapping[str, str], loc: Loc, unset: list[Problem]) -> Any:
    """`resolve_env`'s walk: an unset reference becomes "" and is recorded in `unset`, so that
    all of them are reported at once (and not the errors that the placeholder causes)."""
    if isinstance(value, str):

        def substitute(match: re.Match[str]) -> str:
            name, default = match.group(1), match.group(2)
            if environ.get(name):
                return environ[name]
            if default is not None:
                return default
            state = "is empty" if name in environ else "is not set"
            unset.append(Problem(loc, f"environment variable {name} {state}", env=name))
            return ""

        return _VAR.sub(substitute, value)
    if isinstance(value, dict):
        return {k: _substitute(v, environ, (*loc, k), unset) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute(v, environ, (*loc, i), unset) for i, v in enumerate(value)]
    return value


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
    """Load, resolve and validate a config file. Raises ConfigError with a printable message
    that lists every problem found: a YAML error with its line and column; each unset `${VAR}`
    with the line it is used on; each invalid key with its path and line, or with the
    `TAILGUARD_*` variable that set it."""
    file = config_path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{file}: cannot read the file ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{file}: not UTF-8 text (byte {exc.start})") from None
    try:
        document, root = parse_yaml(text, file)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if document is None:
        document = {}
    if not isinstance(document, dict):
        kind = "a list" if isinstance(document, list) else "a single value"
        raise ConfigError(
            f"{file}:1: the top level must be a mapping of sections (providers:, models:, ...), "
            f"not {kind}"
        )
    unset: list[Problem] = []
    resolved = _substitute(document, os.environ if environ is None else environ, (), unset)
    settings, problems = _validate(resolved, overrides)
    if settings is not None and not unset:
        return settings
    # A placeholder left by an unset variable is not reported again as a bad value.
    problems = [p for p in problems if not any(related(p.loc, u.loc) for u in unset)]
    hints = []
    if unset:
        names = list(dict.fromkeys(p.env for p in unset if p.env))
        hints.append(
            f"set {'it' if len(names) == 1 else 'them'} in the environment (export "
            + " ".join(f"{name}=..." for name in names)
            + f"), or give a default in the file: ${{{names[0]}:-default}}"
        )
    if not text.strip():
        hints.append("the file is empty: see config/examples/ for complete files")
    raise ConfigError(report(str(file), unset + problems, resolved, root, Settings, hints))


def build_settings(
    document: dict[str, Any],
    *,
    source: str = "<config>",
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Validate an already-resolved document (as loaded from YAML) with env and overrides."""
    settings, problems = _validate(document, overrides)
    if settings is None:
        raise ConfigError(report(source, problems, document, None, Settings, []))
    return settings


def _validate(
    document: dict[str, Any], overrides: Mapping[str, Any] | None
) -> tuple[Settings | None, list[Problem]]:
    token = _yaml_data.set(document)
    try:
        return Settings(**dict(overrides or {})), []
    except ValidationError as exc:
        errors = exc.errors(include_input=False)  # an input may be a secret
        # A list too short only because its bad items were dropped is not a problem of its own.
        errors = [e for e in errors if e["type"] != "too_short" or not _holds(e["loc"], errors)]
        return None, [problem for error in errors for problem in _problems_of(error)]
    except SettingsError as exc:  # a TAILGUARD_* value that should be JSON and is not
        return None, _unparsed_overrides(str(exc))
    finally:
        _yaml_data.reset(token)


def _holds(loc: Loc, errors: list[Any]) -> bool:
    """Whether another error lies inside `loc`."""
    return any(
        len(e["loc"]) > len(loc) and tuple(e["loc"][: len(loc)]) == tuple(loc) for e in errors
    )


def _problems_of(error: Any) -> list[Problem]:
    loc: Loc = tuple(error["loc"])
    if error["type"] == REFERENCES_ERROR:
        return [
            Problem(tuple(where), message, label=label, at=tuple(at))
            for where, at, label, message in error["ctx"]["problems"]
        ]
    if error["type"] == "extra_forbidden":
        return [Problem(loc, "unknown key" + did_you_mean(Settings, loc), unknown_key=True)]
    return [Problem(loc, str(error["msg"]).removeprefix("Value error, "))]


def _unparsed_overrides(reason: str) -> list[Problem]:
    """The `TAILGUARD_*` variables behind pydantic-settings' "error parsing value for field":
    those that set a section, list or mapping (decoded as JSON) to something that is not JSON."""
    match = re.search(r'field "([^"]+)"', reason)
    under = [o for o in env_overrides(Settings) if match and o.path[0] == match.group(1)]
    bad = [o for o in under if is_structured(Settings, o.path) and not _is_json(o.value)]
    if not (bad or under):
        return [Problem((), f"a TAILGUARD_* environment variable cannot be read ({reason})")]
    return [Problem(o.path, _json_needed(o), env=o.name) for o in bad or under]


def _json_needed(override: Override) -> str:
    kind = annotation_at(Settings, override.path)
    if get_origin(kind) in (tuple, list):
        return "not valid JSON (this setting is a list: give it as a JSON array, '[...]')"
    name = override.name.upper()
    return (
        "not valid JSON (this setting is a mapping: give it as a JSON object, '{...}', "
        f"or set one key at a time, {name}__<KEY>=...)"
    )


def _is_json(value: str) -> bool:
    try:
        json.loads(value)
    except ValueError:
        return False
    return True

"""The rooms stay separate: imports flow one way, and each library has one owner.

The rules are checked on the package's real import graph, read from the source with `ast`: every
`import` and `from ... import` of a gateway module, at any depth (imports inside functions count:
they run too), plus the parent packages Python executes first (importing `gateway.sim.profile`
runs `gateway/sim/__init__.py`). "Reaches" is the transitive closure of that graph.
"""

from __future__ import annotations

import ast
import warnings
from collections.abc import Iterable
from functools import cache
from pathlib import Path

import pytest

from tests.source import parse

PACKAGE = Path(__file__).resolve().parents[2] / "gateway"

# Which gateway modules or rooms (a package stands for every module in it) may import a
# third-party library, by top-level package name. A library not listed may be imported anywhere;
# every owner listed must exist and import it.
LIBRARY_OWNERS = {
    "fastapi": {"gateway.api"},
    "starlette": {"gateway.api"},
    "uvicorn": {
        "gateway.cli.serve",
        "gateway.sim.server",
        "gateway.server.protocol",
        "gateway.server.handoff",
    },
    "httptools": {"gateway.server.protocol", "gateway.tools.load"},
    "httpx": set(),
    "aiohttp": {
        "gateway.providers.http",
        "gateway.latency.vllm",  # scrapes vLLM's /metrics
        "gateway.providers.bedrock",
        "gateway.providers.gemini",
        "gateway.providers.vertex",
        "gateway.tools.probe",
    },
    "botocore": {"gateway.providers.bedrock", "gateway.providers.bedrock_auth"},
    "yarl": {"gateway.providers.bedrock"},  # a path sent as encoded, untouched
    "google": {"gateway.providers.vertex_auth"},
    "requests": {"gateway.providers.vertex_auth"},
    "redis": {
        "gateway.redis",
        "gateway.latency.redis_store",
        "gateway.admission.ratelimit",
        "gateway.responses",
    },
    "opentelemetry": {"gateway.telemetry.tracing", "gateway.telemetry.tail"},
    "prometheus_client": {
        "gateway.telemetry.prometheus",
        "gateway.telemetry.meters",
        "gateway.telemetry.fallbacks",
        "gateway.telemetry.catalogue",
        "gateway.latency.vllm",  # parses vLLM's /metrics
    },
    "typer": {"gateway.cli"},
    "rich": {"gateway.cli"},
}


def _name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def _sources() -> dict[str, Path]:
    return {_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module of a `from` import (relative imports resolved against `module`)."""
    if node.level == 0:
        return node.module or ""
    is_package = _sources()[module].name == "__init__.py"
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


@cache
def imported_names(module: str) -> frozenset[str]:
    """Every absolute name `module` imports, gateway or not, as written."""
    found: set[str] = set()
    for node in ast.walk(parse(_sources()[module].read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, node)
            found.add(source)
            # `from gateway.sim import engine` imports the module gateway.sim.engine.
            found.update(f"{source}.{alias.name}" for alias in node.names)
    return frozenset(found)


def _with_parents(name: str) -> Iterable[str]:
    parts = name.split(".")
    return (".".join(parts[:i]) for i in range(1, len(parts) + 1))


@cache
def edges(module: str) -> frozenset[str]:
    """The gateway modules importing `module` executes directly (its parents included)."""
    modules = _sources()
    direct = {
        parent
        for name in imported_names(module)
        for parent in _with_parents(name)
        if parent in modules and parent != module
    }
    return frozenset(direct | {p for p in _with_parents(module) if p in modules and p != module})


@cache
def reaches(module: str) -> frozenset[str]:
    """Every gateway module executed, transitively, when `module` is imported."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        for target in edges(todo.pop()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    seen.discard(module)
    return frozenset(seen - {"gateway"})  # the top package is a docstring and a version


def _in(module: str, room: str) -> bool:
    return module == room or module.startswith(room + ".")


def _room(module: str) -> list[str]:
    return [name for name in _sources() if _in(name, module)]


def _is_leaf(module: str) -> bool:
    """Imports nothing of the gateway but packages that themselves import nothing."""
    return all(
        _sources()[target].name == "__init__.py"
        and not any(_in(name, "gateway") for name in imported_names(target))
        for target in reaches(module)
    )


def _violations(rooms: Iterable[str], banned: Iterable[str]) -> list[str]:
    banned = tuple(banned)
    return [
        f"{module} reaches {target}"
        for room in rooms
        for module in _room(room)
        for target in sorted(reaches(module))
        if any(_in(target, b) for b in banned)
    ]


def test_config_and_models_are_the_ground_floor() -> None:
    """`config` and `models` reach nothing of the gateway but leaves that import nothing of it
    (the simulator's profile schema is such a leaf)."""
    for room in ("gateway.config", "gateway.models"):
        for module in _room(room):
            for target in sorted(t for t in reaches(module) if not _in(t, room)):
                assert _is_leaf(target), f"{module} reaches {target}: {sorted(reaches(target))}"


def test_the_simulator_stands_on_config_free_leaves() -> None:
    """The simulator is a separate program: it reaches no config, api, routing or providers."""
    banned = ("gateway.config", "gateway.api", "gateway.routing", "gateway.providers")
    assert _violations(["gateway.sim"], banned) == []


def test_arrows_point_one_way() -> None:
    """api -> routing -> providers; the rooms they use never reach back up."""
    rules = {
        "gateway.providers": ("gateway.routing", "gateway.api"),
        "gateway.routing": ("gateway.api",),
        # What is known of each deployment (statistics, vLLM load) is read by every room above.
        "gateway.latency": (
            "gateway.api",
            "gateway.routing",
            "gateway.providers",
            "gateway.batching",
            "gateway.admission",
            "gateway.responses",
            "gateway.runtime",
        ),
        "gateway.redis": ("gateway.api", "gateway.routing", "gateway.providers", "gateway.latency"),
        "gateway.telemetry": (
            "gateway.api",
            "gateway.routing",
            "gateway.providers",
            "gateway.batching",
            "gateway.runtime",
        ),
        # Batching wraps providers through the interface (`gateway.upstream`) alone.
        "gateway.batching": (
            "gateway.api",
            "gateway.routing",
            "gateway.runtime",
            "gateway.providers",
        ),
        # Admission (keys, rate limits, body checks) is asked by the edge; it asks no room above.
        "gateway.admission": (
            "gateway.api",
            "gateway.routing",
            "gateway.providers",
            "gateway.runtime",
        ),
        "gateway.responses": (
            "gateway.api",
            "gateway.routing",
            "gateway.providers",
            "gateway.latency",
            "gateway.runtime",
        ),
        "gateway.server": (
            "gateway.api",
            "gateway.routing",
            "gateway.providers",
            "gateway.runtime",
        ),
        "gateway.errors": ("gateway.api", "gateway.routing", "gateway.providers", "gateway.config"),
        "gateway.sse": ("gateway.api", "gateway.routing", "gateway.providers", "gateway.config"),
    }
    found = [v for room, banned in rules.items() for v in _violations([room], banned)]
    assert found == []


def test_the_provider_interface_is_a_leaf() -> None:
    """`gateway.upstream` (the provider interface) reaches nothing but the ground floor's
    `models` and leaves, so that every room may import it."""
    found = sorted(
        t for t in reaches("gateway.upstream") if t != "gateway.models" and not _is_leaf(t)
    )
    assert found == []


def _adapters() -> list[str]:
    """The modules of `providers/` defining a concrete adapter: a class with `supports` and an
    async `open` (the `Provider` interface's methods), or one that subclasses such a class."""
    classes: dict[str, tuple[str, set[str], bool]] = {}  # name: module, bases, has both methods
    for module in _room("gateway.providers"):
        for node in ast.walk(parse(_sources()[module].read_text())):
            if isinstance(node, ast.ClassDef):
                methods = {
                    (type(f).__name__, f.name)
                    for f in node.body
                    if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                }
                bases = {b.id if isinstance(b, ast.Name) else ast.unparse(b) for b in node.bases}
                both = {("AsyncFunctionDef", "open"), ("FunctionDef", "supports")} <= methods
                classes[node.name] = (module, bases, both)
    adapters = {name for name, (_, _, both) in classes.items() if both}
    while grown := {n for n, (_, bases, _) in classes.items() if bases & adapters} - adapters:
        adapters |= grown
    return sorted({classes[name][0] for name in adapters})


def test_only_providers_import_a_concrete_adapter() -> None:
    """Concrete adapters sit behind the interface: outside `providers/`, code imports
    `gateway.upstream` (and `gateway.providers.open_providers` builds them), never an adapter."""
    adapters = _adapters()
    assert {
        "gateway.providers.http",
        "gateway.providers.openai",
        "gateway.providers.vllm",
        "gateway.providers.anthropic",
        "gateway.providers.azure",
        "gateway.providers.simulated",
    } <= set(adapters)
    found = [
        f"{module} imports {name}"
        for module in _sources()
        if not _in(module, "gateway.providers")
        for name in imported_names(module)
        if any(_in(name, adapter) for adapter in adapters)
    ]
    assert found == []


def test_tools_use_the_public_api_only() -> None:
    """Product tools (probe, bench, the course exercises) start the gateway through its package
    API, never by importing the edge's internals."""
    found = [
        f"{module} imports {name}"
        for module in _room("gateway.tools")
        for name in imported_names(module)
        if _in(name, "gateway.api") and name != "gateway.api"
    ]
    assert found == []


def test_only_the_cli_imports_the_edge() -> None:
    """The HTTP edge is the top floor: nothing but the command line (and the edge itself)
    imports it."""
    allowed = ("gateway.api", "gateway.cli", "gateway.__main__", "gateway.tools")
    found = [
        f"{module} imports {name}"
        for module in _sources()
        if not any(_in(module, a) for a in allowed)
        for name in imported_names(module)
        if _in(name, "gateway.api")
    ]
    assert found == []


def test_rooms_form_no_cycle() -> None:
    """Between top-level rooms the import graph is acyclic: no room reaches itself."""

    def room_of(module: str) -> str:
        return ".".join(module.split(".")[:2])

    graph: dict[str, set[str]] = {}
    for module in _sources():
        for target in edges(module):
            if target != "gateway" and room_of(target) != room_of(module):
                graph.setdefault(room_of(module), set()).add(room_of(target))

    def reach(start: str) -> set[str]:
        seen: set[str] = set()
        todo = [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    assert [room for room in sorted(graph) if room in reach(room)] == []


@pytest.mark.parametrize("library", sorted(LIBRARY_OWNERS))
def test_each_library_has_its_owners(library: str) -> None:
    """A library listed is imported by its owners and nobody else; every owner exists and uses
    it, so the list cannot go stale."""
    owners = LIBRARY_OWNERS[library]
    users = {
        module
        for module in _sources()
        if any(name.split(".")[0] == library for name in imported_names(module))
    }
    outside = {user for user in users if not any(_in(user, owner) for owner in owners)}
    assert outside == set(), f"{library} imported outside its owners"
    idle = {owner for owner in owners if not any(_in(user, owner) for user in users)}
    assert idle == set(), f"{library} owners that no longer import it"


MODULE_GUIDE, MODULE_LIMIT = 600, 800  # lines: a guide (reported), and a limit (a failure)
CLASS_GUIDE, CLASS_LIMIT = 250, 400


@pytest.mark.filterwarnings("default::UserWarning")  # a report, not a failure
@pytest.mark.parametrize("module", sorted(_sources()))
def test_modules_and_classes_stay_small(module: str) -> None:
    """Sizes are guides: a module past ~600 lines or a class past ~250 is reported (a warning
    in the test summary: a room that may hold several jobs), and only one past 800 or 400 fails.
    Carving code out only to stay under a guide is worse than going over it."""
    source = _sources()[module].read_text()
    lines = source.count("\n")
    assert lines <= MODULE_LIMIT, f"{module}: {lines} lines"
    if lines > MODULE_GUIDE:
        warnings.warn(f"{module}: {lines} lines (guide: {MODULE_GUIDE})", stacklevel=1)
    for node in ast.walk(parse(source)):
        if isinstance(node, ast.ClassDef):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            assert length <= CLASS_LIMIT, f"{module}.{node.name}: {length} lines"
            if length > CLASS_GUIDE:
                warnings.warn(
                    f"{module}.{node.name}: {length} lines (guide: {CLASS_GUIDE})", stacklevel=1
                )


def test_the_relay_writes_what_routing_hands_it() -> None:
    """The per-event work of a committed answer (tally, budgets, idle watch, the store write)
    is routing's `Committed`: `api/relay.py` imports nothing of routing but that, and nothing
    of batching or the stored responses."""
    found = sorted(
        name
        for name in imported_names("gateway.api.relay")
        if (_in(name, "gateway.routing") and not _in(name, "gateway.routing.committed"))
        or _in(name, "gateway.batching")
        or _in(name, "gateway.responses")
    )
    assert found == []

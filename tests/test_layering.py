"""The rooms stay separate: imports flow one way, and each library has one owner."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "gateway"

# Which gateway modules may import a third-party library (by top-level package name).
LIBRARY_OWNERS = {
    "fastapi": {"gateway.api"},
    "starlette": {"gateway.api"},
    "uvicorn": {"gateway.cli", "gateway.sim.server", "gateway.protocol"},
    "httptools": {"gateway.protocol", "gateway.bench"},  # header limits; the bench client
    "httpx": set(),
    "aiohttp": {"gateway.providers.http", "gateway.providers.vllm", "gateway.probe"},
    "redis": {"gateway.latency", "gateway.ratelimit"},
    "opentelemetry": {"gateway.telemetry.tracing"},
    "prometheus_client": {
        "gateway.telemetry.prometheus",
        "gateway.telemetry.meters",
        "gateway.providers.vllm",  # parses vLLM's /metrics
    },
    "typer": {"gateway.cli"},
    "rich": {"gateway.cli"},
}

# A module may not import any of these rooms.
FORBIDDEN = {
    "gateway.config": ("gateway.api", "gateway.routing", "gateway.providers", "gateway.latency"),
    "gateway.models": ("gateway.",),
    "gateway.errors": ("gateway.api", "gateway.routing", "gateway.providers", "gateway.config"),
    "gateway.sse": ("gateway.api", "gateway.routing", "gateway.providers", "gateway.config"),
    "gateway.latency": ("gateway.api", "gateway.routing", "gateway.providers"),
    "gateway.telemetry": ("gateway.api", "gateway.routing", "gateway.providers"),
    "gateway.sim": ("gateway.api", "gateway.routing", "gateway.providers", "gateway.config"),
    "gateway.providers": ("gateway.api", "gateway.routing"),
    "gateway.routing": ("gateway.api", "gateway.batching"),
    "gateway.batching": ("gateway.api", "gateway.routing", "gateway.runtime"),
    "gateway.auth": ("gateway.api", "gateway.routing", "gateway.providers", "gateway.runtime"),
    "gateway.ratelimit": ("gateway.api", "gateway.routing", "gateway.providers", "gateway.runtime"),
    "gateway.protocol": ("gateway.api", "gateway.routing", "gateway.providers"),
}


def modules() -> list[tuple[str, set[str]]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported.add(node.module)
        found.append((name, imported))
    return found


@pytest.mark.parametrize(("module", "imported"), modules(), ids=lambda v: str(v)[:40])
def test_imports_respect_the_rooms(module: str, imported: set[str]) -> None:
    """Libraries are imported only by their owning room, and no room imports a later one."""
    for name in imported:
        library = name.split(".")[0]
        owners = LIBRARY_OWNERS.get(library)
        assert owners is None or module in owners, f"{module} imports {library}"
        for room, banned in FORBIDDEN.items():
            if module == room or module.startswith(room + "."):
                assert not name.startswith(banned), f"{module} imports {name}"
    if module not in ("gateway.cli", "gateway.__main__"):
        assert "gateway.api" not in imported or module == "gateway.api"

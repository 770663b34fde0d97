"""The docs site: its generated reference pages match the code, and it builds with no warning."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, get_args

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel

from gateway.cli import reference
from gateway.config import Settings
from gateway.telemetry.catalogue import catalogue
from tests.conftest import Upstream, one_model, run_gateway

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


@pytest.mark.parametrize("page", sorted(reference.render()))
def test_generated_page_is_current(page: str) -> None:
    """Each generated page on disk is what the generator makes of the code now."""
    path = DOCS / page
    assert path.is_file(), f"{path} is missing: run `{reference.REGENERATE}`"
    assert path.read_text("utf-8") == reference.render()[page], (
        f"{path} is out of date: run `{reference.REGENERATE}` (or `make docs`)"
    )


def test_generation_does_not_depend_on_hash_seed() -> None:
    """Another interpreter, with another string-hash seed, finds the pages current too."""
    env = {**os.environ, "PYTHONHASHSEED": "4242"}
    run = subprocess.run(
        [sys.executable, "-m", "gateway.cli.reference", "--check", "--docs-dir", str(DOCS)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stderr


def test_check_and_write_round_trip(tmp_path: Path) -> None:
    """`--check` fails on missing or edited pages and names them; writing makes them current."""
    assert reference.main(["--docs-dir", str(tmp_path), "--check"]) == 1
    assert reference.main(["--docs-dir", str(tmp_path)]) == 0
    assert reference.main(["--docs-dir", str(tmp_path), "--check"]) == 0
    edited = tmp_path / reference.METRICS_PAGE
    edited.write_text(edited.read_text("utf-8") + "\nby hand\n", "utf-8")
    assert reference.stale(tmp_path) == [reference.METRICS_PAGE]
    assert reference.write(tmp_path) == [reference.METRICS_PAGE]
    assert reference.stale(tmp_path) == []


def _models(model: type[BaseModel]) -> list[type[BaseModel]]:
    """`model` and every model its fields hold, however nested in lists, maps and unions."""
    found = [model]

    def visit(annotation: Any) -> None:
        is_model = isinstance(annotation, type) and issubclass(annotation, BaseModel)
        if is_model and annotation not in found:
            found.append(annotation)
            for field in annotation.model_fields.values():
                visit(field.annotation)
        for arg in get_args(annotation):
            visit(arg)

    for field in model.model_fields.values():
        visit(field.annotation)
    return found


def test_every_config_key_is_described() -> None:
    """The configuration reference has a description for every key: each field documents itself."""
    undocumented = [
        f"{model.__name__}.{name}"
        for model in _models(Settings)
        for name, field in model.model_fields.items()
        if not (field.description or "").strip()
    ]
    assert len(_models(Settings)) > 10  # the walk reached the nested models
    assert undocumented == [], "give these fields a docstring: " + ", ".join(undocumented)


async def test_metrics_page_lists_what_a_gateway_exposes(upstream: Upstream) -> None:
    """The metric families a running gateway serves on /metrics are exactly the catalogued ones."""
    async with run_gateway(one_model(upstream.base_url)) as gateway, httpx.AsyncClient() as client:
        answer = await client.post(
            gateway.base_url + "/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert answer.status_code == 200
        exposition = (await client.get(gateway.url + "/metrics")).text
    served = {
        family.name + ("_total" if family.type == "counter" else "")
        for family in text_string_to_metric_families(exposition)
    }
    assert served == {m.name for m in catalogue()}


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="mkdocs is not installed")
def test_site_builds_strictly(tmp_path: Path) -> None:
    """`mkdocs build --strict` passes: every page in the nav, no broken link or anchor."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "reference" / "config" / "index.html").is_file()
    # Offline-capable: no page loads a script, a stylesheet or a font from another host.
    external = re.compile(r"<(?:script|link)\b[^>]*\b(?:src|href)=\"(?:https?:)?//[^\"]*\"")
    for page in tmp_path.rglob("*.html"):
        assert not external.findall(page.read_text()), page
    for sheet in tmp_path.rglob("*.css"):
        assert "fonts.googleapis" not in sheet.read_text(), sheet


# --- every table is valid Markdown ------------------------------------------------------------

_SEPARATOR = re.compile(r"^\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$")


def _cells(row: str) -> list[str]:
    """A table row's cells, split on the pipes that are not escaped (`\\|`), as GFM does."""
    inner = row.strip().removeprefix("|")
    inner = inner[:-1] if inner.endswith("|") and not inner.endswith("\\|") else inner
    return re.split(r"(?<!\\)\|", inner)


def table_problems(text: str) -> list[str]:
    """What is wrong with the pipe tables of a Markdown page: a table without its separator row,
    a row whose cell count is not the header's, a table not set apart by blank lines (two tables
    run together read as one). Fenced code blocks are skipped."""
    problems: list[str] = []
    lines = text.splitlines()
    fence: str | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.lstrip()
        if fence is not None:
            if stripped.startswith(fence):
                fence = None
            i += 1
            continue
        if stripped.startswith(("```", "~~~")):
            fence = stripped[:3]
            i += 1
            continue
        if not stripped.startswith("|"):
            i += 1
            continue
        start = i
        while i < len(lines) and lines[i].lstrip().startswith("|"):
            i += 1
        block = lines[start:i]
        where = f"line {start + 1}"
        if start > 0 and lines[start - 1].strip():
            problems.append(f"{where}: no blank line before the table")
        if i < len(lines) and lines[i].strip():
            problems.append(f"line {i + 1}: no blank line after the table")
        if len(block) < 2 or not _SEPARATOR.match(block[1]):
            problems.append(f"{where}: the header row has no separator row under it")
            continue
        width = len(_cells(block[0]))
        if len(_cells(block[1])) != width:
            problems.append(f"{where}: the separator row's columns differ from the header's")
        for n, row in enumerate(block[2:], start=start + 3):
            if _SEPARATOR.match(row):
                problems.append(f"line {n}: a second separator: two tables with no blank line")
            elif len(_cells(row)) != width:
                problems.append(f"line {n}: {len(_cells(row))} cells, the header has {width}")
    return problems


@pytest.mark.parametrize(
    "page", sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")), ids=str
)
def test_every_table_is_valid_markdown(page: str) -> None:
    assert table_problems((DOCS / page).read_text()) == []


def test_the_table_check_catches_what_it_is_for() -> None:
    good = "text\n\n| a | b |\n|---|---:|\n| 1 | `x \\| y` |\n\nmore\n"
    assert table_problems(good) == []
    merged = "| a | b |\n|---|---|\n| 1 | 2 |\n| c | d |\n|---|---|\n| 3 | 4 |\n"
    assert table_problems(merged) == ["line 5: a second separator: two tables with no blank line"]
    assert table_problems("| a | b |\n|---|---|\n| 1 |\n") == ["line 3: 1 cells, the header has 2"]
    assert table_problems("| a | b |\n| 1 | 2 |\n") == [
        "line 1: the header row has no separator row under it"
    ]
    assert table_problems("text\n| a |\n|---|\n") == ["line 2: no blank line before the table"]
    assert table_problems("```\n| a |\n```\n") == []


def test_the_site_loads_nothing_from_elsewhere() -> None:
    """No web fonts and no scripts from other hosts: the docs work offline."""
    config = (ROOT / "mkdocs.yml").read_text()
    assert re.search(r"^  font: false\b", config, re.MULTILINE), config
    assert "extra_javascript" not in config and "extra_css" not in config

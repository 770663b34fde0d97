"""Where the gateway's CPU time goes: py-spy samples of a saturated run, sorted into the parts of
a request's path (HTTP parsing, our admission, routing, the upstream client, telemetry, ...).

py-spy is not a project dependency: `--profile` uses it when it is on PATH or in the venv
(`.venv/bin/pip install py-spy`) and says so when it is not. It samples the running process from
outside (`--nonblocking`: the gateway is never paused) and writes collapsed stacks, one line per
distinct stack with its sample count. Only the thread holding the GIL is sampled (`--gil`), so
idle waits drop out and the export and log threads count exactly when they take the CPU from
the event loop; C code that releases the GIL (uvloop's wait for events and its socket reads)
is not seen.

Each sample is charged to one part by its innermost frame (self time: "where the CPU was"; a
standard-library frame counts for the innermost part that called it), and to every part on its
stack (inclusive time: "what it was doing it for"). Time inside C code that
keeps the GIL (httptools, orjson, protobuf, uvloop's writes) shows under the Python frame that
called it.
"""

from __future__ import annotations

import shutil
import subprocess
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

# (part, substrings of a frame's file path); the first match wins, so specific before general.
PARTS: Final[tuple[tuple[str, tuple[str, ...]], ...]] = (
    ("access log", ("gateway/telemetry/access.py",)),
    (
        "telemetry (spans, metrics, export)",
        ("gateway/telemetry/", "opentelemetry/", "gateway/telemetry/semconv.py"),
    ),
    ("latency store (record, flush, refresh)", ("gateway/latency/", "gateway/latency/sketch.py")),
    # The one Redis client: the latency store's flushes and refreshes, the rate-limit checks.
    ("Redis client (redis-py)", ("gateway/redis.py", "redis/")),
    ("routing (plan, guards, attempts)", ("gateway/routing/",)),
    ("auth and rate limits", ("gateway/admission/auth.py", "gateway/admission/ratelimit.py")),
    ("upstream adapter (request, decode)", ("gateway/providers/",)),
    ("our edge: admission, parsing, relay", ("gateway/",)),
    ("aiohttp client", ("aiohttp/", "multidict/", "yarl/", "aiosignal/", "frozenlist/")),
    ("uvicorn + httptools (HTTP server)", ("uvicorn/", "httptools/")),
    ("starlette / fastapi", ("starlette/", "fastapi/")),
    ("pydantic", ("pydantic/", "pydantic_core/")),
    ("event loop, asyncio (uvloop)", ("uvloop/", "asyncio/")),
)
OTHER: Final = "other (stdlib alone)"


def find_py_spy(venv_bin: Path) -> str | None:
    local = venv_bin / "py-spy"
    return str(local) if local.exists() else shutil.which("py-spy")


def start(py_spy: str, pid: int, duration_s: float, out: Path, prefix: Sequence[str]) -> Any:
    """Start sampling `pid` for `duration_s` (returns the py-spy process; `wait` on it)."""
    command = [*prefix, py_spy, "record", "--pid", str(pid), "--duration", f"{duration_s:.0f}"]
    command += ["--rate", "250", "--format", "raw", "--nonblocking", "--gil", "--full-filenames"]
    command += ["--output", str(out)]
    return subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL
    )


def part_of(frame: str) -> str:
    """The part a frame like `send (aiohttp/client.py:123)` belongs to."""
    where = frame.rpartition("(")[2]
    for name, needles in PARTS:
        if any(needle in where for needle in needles):
            return name
    return OTHER


_REPO = str(Path(__file__).resolve().parent.parent)  # this checkout, wherever it lies


def short(frame: str) -> str:
    """`func (…/site-packages/pkg/mod.py:12)` as `func (pkg/mod.py)`."""
    name, _, where = frame.rpartition(" (")
    path = where.rstrip(")").rpartition(":")[0]
    for marker in ("site-packages/", f"{_REPO}/", "lib/python3.11/"):
        if marker in path:
            path = path.rpartition(marker)[2]
            break
    return f"{name} ({path})"


@dataclass(frozen=True, slots=True)
class Profile:
    samples: int
    self_share: dict[str, float]  # part -> share of samples whose innermost frame is in it
    inclusive_share: dict[str, float]  # part -> share of samples with it anywhere on the stack
    top_self: list[tuple[str, float]]  # innermost functions by share
    top_gateway: list[tuple[str, float]]  # our functions by inclusive share

    def as_dict(self) -> dict[str, Any]:
        return {
            "samples": self.samples,
            "self_share": self.self_share,
            "inclusive_share": self.inclusive_share,
            "top_self": self.top_self,
            "top_gateway": self.top_gateway,
        }


def analyse(collapsed: str, top: int = 12) -> Profile:
    """Shares of the samples in py-spy's raw (collapsed) output."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    ours: Counter[str] = Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [f for f in stack.split(";") if f]
        if not frames:
            continue
        total += count
        # py-spy prefixes the thread as a pseudo-frame without a file; skip frames without one.
        real = [f for f in frames if "(" in f] or frames
        # The standard library works for whoever called it (logging for the access log,
        # threading for the export thread): its time goes to the innermost known part.
        own[next((p for f in reversed(real) if (p := part_of(f)) != OTHER), OTHER)] += count
        leaves[short(real[-1])] += count
        for part in {part_of(f) for f in real}:
            inclusive[part] += count
        for name in {short(f) for f in real if "gateway/" in f}:
            ours[name] += count
    if not total:
        return Profile(0, {}, {}, [], [])

    def shares(counter: Counter[str], n: int | None = None) -> list[tuple[str, float]]:
        return [(k, v / total) for k, v in counter.most_common(n)]

    return Profile(
        samples=total,
        self_share=dict(shares(own)),
        inclusive_share=dict(shares(inclusive)),
        top_self=shares(leaves, top),
        top_gateway=shares(ours, top),
    )


def render(title: str, profile: Profile) -> list[str]:
    lines = [f"{title}: {profile.samples} samples"]
    if not profile.samples:
        return [*lines, "  (no samples: py-spy could not read the process?)"]
    lines.append(f"  {'by part':<38} {'self':>6} {'inclusive':>8}")
    for part, share in profile.self_share.items():
        # Standard-library frames sit on nearly every stack: their inclusive share says nothing.
        inclusive = "" if part == OTHER else f"{profile.inclusive_share.get(part, 0.0):8.1%}"
        lines.append(f"  {part:<38} {share:6.1%} {inclusive}")
    lines.append("  hottest functions (self)")
    lines += [f"    {share:6.1%}  {name}" for name, share in profile.top_self]
    lines.append("  our functions (inclusive)")
    lines += [f"    {share:6.1%}  {name}" for name, share in profile.top_gateway]
    return lines

"""What the benchmark scripts share besides `gateway.tools`: CPU pinning, the streaming client,
summaries and results.

Every script starts real processes (`tailguard sim`, `tailguard serve`) with a
`gateway.tools.stack.Stack` started in the repository's root (`ROOT`), pins them with `taskset`
and writes a JSON document; one copy of that keeps the scripts measuring the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, NamedTuple

import aiohttp
import orjson

from gateway.latency.sketch import nearest_rank
from gateway.tools.stream import StreamReader

ROOT: Final = Path(__file__).resolve().parent.parent
VENV_BIN: Final = Path(sys.executable).parent
RESULTS_DIR: Final = ROOT / "bench" / "results"


# --- pinning -------------------------------------------------------------------------------------


def pinning() -> tuple[dict[str, list[str]], str | None]:
    """taskset prefixes per role, and a warning when the processes cannot be pinned.

    The gateway gets CPU 0 to itself; the upstreams (mostly asleep) and this client share CPU 1,
    so the client's parsing never delays the gateway it measures.
    """
    taskset = shutil.which("taskset")
    if taskset is None:
        return {}, "taskset not found: running unpinned"
    if not {0, 1} <= os.sched_getaffinity(0):
        return {}, f"CPUs 0 and 1 are not both available ({sorted(os.sched_getaffinity(0))})"
    return {"gateway": [taskset, "-c", "0"], "upstream": [taskset, "-c", "1"]}, None


def pin_client() -> tuple[dict[str, list[str]], str | None]:
    """`pinning()`, and this process moved to CPU 1 beside the upstreams (or a warning printed)."""
    pin, warning = pinning()
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    elif hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {1})  # the client shares CPU 1 with the upstreams
    return pin, warning


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM as Ctrl-C, so a killed run still stops its children in order."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# --- the client ----------------------------------------------------------------------------------


_NO_HEADERS: Final[Mapping[str, str]] = {}


class Streamed(NamedTuple):
    """What `post_stream` saw: the status (0 when the request failed before an answer), the
    response headers (none then), what went wrong if anything (the failure, a status other than
    200, an error event, a stream that ended without `[DONE]`), and whether the connection
    itself failed."""

    status: int
    headers: Mapping[str, str]
    error: str | None
    broken: bool = False


async def post_stream(
    session: aiohttp.ClientSession,
    url: str,
    data: bytes,
    headers: Mapping[str, str],
    reader: StreamReader,
) -> Streamed:
    """POST `data` and feed a 200 answer's stream to `reader` as it arrives."""
    status: int = 0
    answered: Mapping[str, str] = _NO_HEADERS  # kept when the stream fails after the head
    try:
        async with session.post(url, data=data, headers=headers) as response:
            status, answered = response.status, response.headers
            if status != 200:
                text = await response.read()
                return Streamed(status, answered, f"status {status}: {text[:200]!r}")
            async for chunk in response.content.iter_any():
                reader.feed(chunk, time.perf_counter())
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Streamed(status, answered, f"{type(exc).__name__}: {exc}", broken=True)
    if reader.error is not None:
        return Streamed(status, answered, reader.error)
    if not reader.done:
        return Streamed(status, answered, "stream ended without [DONE]")
    return Streamed(status, answered, None)


def stream_chat_body(model: str, max_tokens: int, prompt: str) -> bytes:
    """One streaming chat completion request, the same bytes for every request of a run."""
    return orjson.dumps(
        {
            "model": model,
            "stream": True,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": prompt}],
        }
    )


# --- figures and results -------------------------------------------------------------------------


def percentiles_ms(
    values_s: Sequence[float],
    missing: int = 0,
    quantiles: Sequence[tuple[str, float]] = (("p50", 0.50), ("p90", 0.90), ("p99", 0.99)),
    with_mean: bool = False,
) -> dict[str, float | None]:
    """count, (mean,) the `quantiles` (nearest rank) and max, in ms.

    `missing` values rank above every measured one: a request that never got a first token
    missed any budget, and leaving it out would flatter the mode that fails the most. A
    percentile that lands on one is None.
    """
    ordered = sorted(v * 1000.0 for v in values_s)
    n = len(ordered) + missing
    result: dict[str, float | None] = {"count": n, "missing": missing}
    if not n:
        return result
    if with_mean:
        result["mean"] = sum(ordered) / len(ordered) if ordered else None
    for label, q in quantiles:
        rank = nearest_rank(q, n)
        result[label] = ordered[rank - 1] if rank <= len(ordered) else None
    result["max"] = None if missing else ordered[-1]
    return result


def parse_modes(parser: argparse.ArgumentParser, text: str, known: Sequence[str]) -> list[str]:
    """`--modes`: a comma-separated subset of `known`, each at most once (else a usage error)."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes or any(m not in known for m in modes) or len(set(modes)) != len(modes):
        parser.error(f"--modes: a comma-separated subset of {', '.join(known)}")
    return modes


def environment() -> dict[str, Any]:
    """What a result depends on besides the code's options: Python, platform, CPUs, commit."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        info["git"] = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        ).stdout.strip()
    return info


def write_results(path: Path, document: dict[str, Any], logs: Path, keep_logs: bool) -> None:
    """Write the results document, say where, and keep or remove the run's logs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")
    print(f"\nresults: {path}")
    if keep_logs:
        print(f"logs: {logs}")
    else:
        shutil.rmtree(logs, ignore_errors=True)

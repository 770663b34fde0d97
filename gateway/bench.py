"""Benchmarks against a real gateway process: the engine of `tailguard bench batching`, and the
harness the scripts in `bench/` share with it.

`run_batching_bench` measures what a micro-batch queue's `max_wait_ms` costs and buys. It starts
a simulated upstream (`python -m gateway sim`) whose embeddings call costs 20 ms + 0.2 ms per
input with at most 4 calls at once, and a gateway (`python -m gateway serve`) with one model per
`max_wait_ms` under test, each batched (64 inputs at most, 4 batches in flight) onto a deployment
of its own. Both workloads send single-input embeddings requests marked
`x-tailguard-priority: bulk`, because embeddings and completions are what the gateway
micro-batches (chat is never batched):

- `interactive`: sparse, latency-sensitive arrivals: an open loop of Poisson arrivals at
  `interactive_rps` (20/s), each request's latency measured from its scheduled send time;
- `bulk`: a backlog: a closed loop of `bulk_concurrency` (256: enough to fill all four batches
  in flight) clients sending back to back.

For each (workload, max_wait_ms) it reports p50/p99 latency, throughput, errors and the mean
inputs per upstream call (from the gateway's `tailguard_batch_size` histogram), and it
recommends a `max_wait_ms` per workload with the reason computed from those numbers
(`recommend`): for interactive traffic the lowest p99 (p99s within 10% count as equal; the
shorter wait wins), for bulk traffic the highest throughput (throughputs within 5% count as
equal; then the lower p99, then the shorter wait). Percentiles are nearest rank.

The load runs in a thread of its own with its own event loop (uvloop when available) and a
minimal HTTP/1.1 client on keep-alive connections (httptools), pinned, like the two server
processes, to its own CPU when there are enough of them. Nothing here prints: progress goes
through the caller's callback. It imports no web framework and not `gateway.api`; the servers
are subprocesses, as in production.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, TypeVar, cast

import httptools
import orjson

from gateway.sketch import nearest_rank

__all__ = [
    "DEFAULT_DURATION_S",
    "BatchingBenchReport",
    "BatchingRow",
    "LoadResult",
    "Recommendation",
    "Request",
    "Stack",
    "Workload",
    "closed_loop",
    "cpu_layout",
    "free_port",
    "metric_samples",
    "open_loop",
    "proc_cpu_s",
    "recommend",
    "run_batching_bench",
    "run_load",
    "start_gateway",
    "start_sim",
    "summary_ms",
    "tailguard_argv",
]

_T = TypeVar("_T")

# --- the scenario of `tailguard bench batching` ---------------------------------------------------

DEFAULT_DURATION_S: Final = 10.0  # measured seconds per (workload, max_wait_ms): ~75 s in all
DEFAULT_WAITS_MS: Final = (5, 20, 100)
SIM_PROFILE: Final[Mapping[str, float | int]] = {
    "embed_base_ms": 20,
    "embed_ms_per_input": 0.2,
    "max_batch": 4,  # upstream calls that run at once; more queue FIFO
    "embedding_dims": 16,
}
BATCHING: Final[Mapping[str, int]] = {"max_batch_size": 64, "max_inflight": 4, "max_queue": 4096}
INTERACTIVE_RPS: Final = 20.0
BULK_CONCURRENCY: Final = 256  # enough to fill every in-flight batch: 4 x 64
BULK_HEADERS: Final[Mapping[str, str]] = {"x-tailguard-priority": "bulk"}
THROUGHPUT_TIE: Final = 0.05  # throughputs within 5% of the best count as equal (bulk)
P99_TIE: Final = 0.10  # p99s within 10% of the lowest count as equal
SMALL_BATCH: Final = 8.0  # mean inputs per upstream call below which batches "stay small"
ARRIVAL_LIMITED: Final = 0.9  # served >= 90% of the offered rate: the arrivals set throughput
LOAD_BOUND: Final = 0.85  # a load generator busier than this may be what limits throughput
MAX_ERROR_SHARE: Final = 0.01  # a setting that failed more requests than this is not recommended

Workload = Literal["interactive", "bulk"]
WORKLOADS: Final[tuple[Workload, ...]] = ("interactive", "bulk")

# --- processes -----------------------------------------------------------------------------------

READY_TIMEOUT_S: Final = 30.0
STOP_TIMEOUT_S: Final = 10.0


def tailguard_argv() -> list[str]:
    """The `tailguard` command of this interpreter's installation."""
    return [sys.executable, "-m", "gateway"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def cpu_layout() -> dict[str, int]:
    """Which CPU each role gets: the gateway one to itself, the upstream and the load the next
    ones (sharing one when there are only two). Empty when fewer than two CPUs are available."""
    if not hasattr(os, "sched_getaffinity"):
        return {}
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return {}
    return {"gateway": cpus[0], "upstream": cpus[1], "load": cpus[2] if len(cpus) > 2 else cpus[1]}


def _pin(pid: int, cpu: int | None) -> None:
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(pid, {cpu})


@dataclass(slots=True)
class Stack:
    """Server processes started for one run, their logs in `logs`; stopped in reverse order."""

    logs: Path
    cpus: dict[str, int] = field(default_factory=dict)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, role: str, argv: Sequence[str], ready_url: str) -> subprocess.Popen[bytes]:
        """Start `argv`, pinned to the role's CPU, and wait until `ready_url` answers 200."""
        log_path = self.logs / f"{role}.log"
        with open(log_path, "ab") as log:
            child = subprocess.Popen(
                list(argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C reaches the caller only; we stop them in order
            )
        self.procs.append(child)
        _pin(child.pid, self.cpus.get(role))
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if child.poll() is not None:
                raise RuntimeError(
                    f"{role} exited ({child.returncode}) before it was ready:\n{_tail(log_path)}"
                )
            with (
                contextlib.suppress(OSError, urllib.error.URLError),
                urllib.request.urlopen(ready_url, timeout=1) as response,
            ):
                if response.status == 200:
                    return child
            time.sleep(0.05)
        raise RuntimeError(f"{role} not ready after {READY_TIMEOUT_S:.0f} s:\n{_tail(log_path)}")

    def stop(self) -> None:
        for child in reversed(self.procs):
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in reversed(self.procs):
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        self.procs.clear()


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def start_sim(stack: Stack, profile: Mapping[str, Any], *, seed: int = 1) -> int:
    """A `tailguard sim` process whose default profile is `profile`; returns its port."""
    port = free_port()
    argv = [*tailguard_argv(), "sim", "--port", str(port), "--seed", str(seed)]
    for key, value in profile.items():
        shown = "-".join(str(v) for v in value) if isinstance(value, list | tuple) else value
        argv += ["--set", f"{key}={shown}"]
    stack.start("upstream", argv, f"http://127.0.0.1:{port}/health")
    return port


def start_gateway(stack: Stack, config: Mapping[str, Any]) -> tuple[int, int]:
    """A `tailguard serve` process for `config` (written as JSON, which is YAML); returns its
    port and pid."""
    port = free_port()
    path = stack.logs / "gateway.yaml"
    path.write_text(json.dumps({**config, "server": {**config.get("server", {}), "port": port}}))
    argv = [*tailguard_argv(), "serve", "--config", str(path), "--port", str(port)]
    child = stack.start("gateway", [*argv, "--log-level", "warning"], _url(port, "/healthz"))
    return port, child.pid


def _url(port: int, path: str) -> str:
    return f"http://127.0.0.1:{port}{path}"


def metric_samples(port: int, name: str) -> dict[str, float]:
    """Every sample of the Prometheus metric `name` on the gateway at `port`, by its label set
    (`{deployment="...",...}` as printed; "" for none)."""
    with urllib.request.urlopen(_url(port, "/metrics"), timeout=5) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            labels, _, value = line[len(name) :].rpartition(" ")
            with contextlib.suppress(ValueError):
                samples[labels.strip()] = float(value)
    return samples


def proc_cpu_s(pid: int) -> float | None:
    """utime + stime of a process, in seconds (Linux); None where /proc is not there."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as file:
            fields = file.read().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --- a minimal HTTP/1.1 load client ---------------------------------------------------------------

REQUEST_TIMEOUT_S: Final = 60.0
MAX_IDLE_S: Final = 2.0  # uvicorn drops idle keep-alive connections after 5 s
MAX_ERROR_SAMPLES: Final = 5

Expect = Literal["embeddings", "chat", "any"]


@dataclass(frozen=True, slots=True)
class Request:
    """One kind of request: where it goes, its body, and what a good answer looks like."""

    path: str
    body: bytes
    stream: bool = False
    headers: Mapping[str, str] = field(default_factory=dict)
    expect: Expect = "any"
    inputs: int = 1  # embeddings: vectors a good answer carries

    @staticmethod
    def embeddings(model: str, text: str = "hello", *, bulk: bool = True) -> Request:
        return Request(
            "/v1/embeddings",
            orjson.dumps({"model": model, "input": text}),
            headers=BULK_HEADERS if bulk else {},
            expect="embeddings",
        )

    @staticmethod
    def chat(
        model: str, *, stream: bool, bulk: bool = False, max_tokens: int = 16, text: str = "Hi"
    ) -> Request:
        body = {
            "model": model,
            "stream": stream,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": text}],
        }
        return Request(
            "/v1/chat/completions",
            orjson.dumps(body),
            stream=stream,
            headers=BULK_HEADERS if bulk else {},
            expect="chat",
        )

    def wire(self, port: int) -> bytes:
        extra = "".join(f"{k}: {v}\r\n" for k, v in self.headers.items())
        accept = "text/event-stream" if self.stream else "application/json"
        return (
            f"POST {self.path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
            f"content-type: application/json\r\naccept: {accept}\r\n{extra}"
            f"content-length: {len(self.body)}\r\n\r\n"
        ).encode() + self.body


class _Exchange:
    """One request and its response: status, when the first content arrived, and the body."""

    __slots__ = (
        "buffer",
        "content",
        "done",
        "error",
        "keep_alive",
        "parts",
        "status",
        "stream",
        "t_end",
        "t_first",
    )

    def __init__(self, stream: bool) -> None:
        self.stream = stream
        self.status = 0
        self.t_first: float | None = None
        self.t_end = 0.0
        self.buffer = b""
        self.parts: list[bytes] = []
        self.content = 0  # streamed events carrying content
        self.done = False
        self.error: str | None = None
        self.keep_alive = False

    def on_body(self, data: bytes) -> None:
        if not self.stream or self.status != 200:
            self.parts.append(data)
            return
        buffer = (self.buffer + data if self.buffer else data).replace(b"\r\n", b"\n")
        start = 0
        while (end := buffer.find(b"\n\n", start)) >= 0:
            self._event(buffer[start:end])
            start = end + 2
        self.buffer = buffer[start:]

    def _event(self, event: bytes) -> None:
        if not event.startswith(b"data:"):
            return  # comments, keep-alives
        payload = event[5:].strip()
        if payload == b"[DONE]":
            self.done = True
            return
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            self.error = f"bad event {payload[:80]!r}"
            return
        if not isinstance(obj, dict) or "error" in obj:
            self.error = f"error event {payload[:200]!r}"
            return
        for choice in obj.get("choices") or ():
            delta = choice.get("delta") if isinstance(choice, dict) else None
            text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if isinstance(text, str) and text:
                self.content += 1
                if self.t_first is None:
                    self.t_first = time.perf_counter()

    def problem(self, request: Request) -> str | None:
        """None when the answer is complete and well formed, else what is wrong with it."""
        if self.status != 200:
            return f"status {self.status}: {b''.join(self.parts)[:200]!r}"
        if self.error is not None:
            return self.error
        if self.stream:
            if not self.content:
                return "stream without content"
            return None if self.done else "stream ended without [DONE]"
        try:
            obj = orjson.loads(b"".join(self.parts))
            if request.expect == "embeddings":
                if len(obj["data"]) != request.inputs or not obj["data"][0]["embedding"]:
                    return f"{len(obj['data'])} vectors, expected {request.inputs}"
            elif request.expect == "chat" and not obj["choices"][0]["message"]["content"]:
                return "empty message content"
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
            return f"bad body ({type(exc).__name__})"
        return None


class _Connection(asyncio.Protocol):
    """One keep-alive connection, one exchange at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.exchange: _Exchange | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.lost = False
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast("asyncio.Transport", transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ConnectionError(f"bad HTTP response: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._fail(ConnectionError("connection closed by the server"))

    def on_headers_complete(self) -> None:
        if self.exchange is not None:
            self.exchange.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if self.exchange is not None:
            self.exchange.on_body(body)

    def on_message_complete(self) -> None:
        if self.exchange is not None:
            self.exchange.t_end = time.perf_counter()
            self.exchange.keep_alive = self.parser.should_keep_alive()
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def send(self, data: bytes, exchange: _Exchange) -> None:
        assert self.transport is not None
        self.exchange = exchange
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        try:
            await self.waiter
        finally:
            self.exchange = None
            self.waiter = None

    def _fail(self, exc: Exception) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()


class _Client:
    """Keep-alive connections to 127.0.0.1:`port`, reused last in, first out."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.idle: list[_Connection] = []

    async def _connection(self) -> _Connection:
        now = time.perf_counter()
        while self.idle:
            conn = self.idle.pop()
            if not conn.lost and now - conn.idle_since < MAX_IDLE_S:
                return conn
            conn.close()
        _, conn = await asyncio.get_running_loop().create_connection(
            _Connection, "127.0.0.1", self.port
        )
        return conn

    async def call(
        self, request: Request, data: bytes, origin: float | None = None
    ) -> tuple[float, float | None, str | None]:
        """Send one request: (latency, time to the first content or None, problem or None),
        in seconds from `origin` (default: now)."""
        started = time.perf_counter()
        origin = started if origin is None else min(origin, started)
        exchange = _Exchange(request.stream)
        conn: _Connection | None = None
        reusable = False
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                conn = await self._connection()
                await conn.send(data, exchange)
            reusable = exchange.keep_alive
            problem = exchange.problem(request)
        except (OSError, TimeoutError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
        finally:
            if conn is not None:
                if reusable and not conn.lost:
                    conn.idle_since = time.perf_counter()
                    self.idle.append(conn)
                else:
                    conn.close()
        first = None if exchange.t_first is None else exchange.t_first - origin
        return exchange.t_end - origin, first, problem

    def close(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle.clear()


@dataclass(slots=True)
class LoadResult:
    """What one load run saw. Latencies and TTFTs are in milliseconds, in completion order."""

    mode: str  # closed | open
    elapsed_s: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    ttfts_ms: list[float] = field(default_factory=list)
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    send_lag_ms: list[float] = field(default_factory=list)  # open loop: how late each went out
    ttft_at_s: list[float] = field(default_factory=list)  # open loop: when each TTFT's request
    # was due, in seconds from the start (aligned with ttfts_ms)
    client_cpu_s: float = 0.0  # CPU time the load generator's thread spent in the window

    @property
    def ok(self) -> int:
        return len(self.latencies_ms)

    @property
    def throughput_rps(self) -> float:
        return self.ok / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def add(
        self,
        latency_s: float,
        ttft_s: float | None,
        problem: str | None,
        at_s: float | None = None,
    ) -> None:
        if problem is not None:
            self.errors += 1
            if len(self.error_samples) < MAX_ERROR_SAMPLES:
                self.error_samples.append(problem)
            return
        self.latencies_ms.append(latency_s * 1000)
        if ttft_s is not None:
            self.ttfts_ms.append(ttft_s * 1000)
            if at_s is not None:
                self.ttft_at_s.append(at_s)

    def summary(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "ok": self.ok,
            "errors": self.errors,
            "error_samples": self.error_samples,
            "elapsed_s": self.elapsed_s,
            "throughput_rps": self.throughput_rps,
            "client_cpu_share": self.client_cpu_s / self.elapsed_s if self.elapsed_s else None,
            "latency_ms": summary_ms(self.latencies_ms),
            "ttft_ms": summary_ms(self.ttfts_ms) if self.ttfts_ms else None,
            "send_lag_ms": summary_ms(self.send_lag_ms) if self.send_lag_ms else None,
        }


def summary_ms(values: Sequence[float]) -> dict[str, float]:
    """count, mean, p50/p90/p99 (nearest rank) and max."""
    if not values:
        return {"count": 0}
    ordered = sorted(values)
    n = len(ordered)
    result = {"count": float(n), "mean": sum(ordered) / n}
    for label, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        result[label] = ordered[nearest_rank(q, n) - 1]
    result["max"] = ordered[-1]
    return result


async def closed_loop(
    port: int,
    request: Request,
    *,
    concurrency: int,
    duration_s: float | None = None,
    requests: int | None = None,
    warmup: int = 0,
    stop: asyncio.Event | None = None,
) -> LoadResult:
    """`concurrency` clients, each on its own connection, send `request` back to back until
    `duration_s` has passed, `requests` have been sent, or `stop` is set. `warmup` requests
    (opening the connections) go first and are not counted."""
    client = _Client(port)
    data = request.wire(port)
    result = LoadResult("closed")
    try:
        left = warmup
        while left > 0:
            batch = min(left, concurrency)
            await asyncio.gather(*(client.call(request, data) for _ in range(batch)))
            left -= batch
        t0, cpu0 = time.perf_counter(), time.thread_time()
        deadline = t0 + duration_s if duration_s is not None else float("inf")
        budget = [requests if requests is not None else 1 << 62]

        async def worker() -> None:
            while budget[0] > 0 and time.perf_counter() < deadline:
                if stop is not None and stop.is_set():
                    return
                budget[0] -= 1
                result.add(*await client.call(request, data))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        result.elapsed_s = time.perf_counter() - t0
        result.client_cpu_s = time.thread_time() - cpu0
    finally:
        client.close()
    return result


def poisson_arrivals(rate: float, duration_s: float, seed: int) -> list[float]:
    """Offsets (s) of a Poisson process of `rate` per second over `duration_s`."""
    rng = random.Random(seed)
    arrivals: list[float] = []
    t = rng.expovariate(rate)
    while t < duration_s:
        arrivals.append(t)
        t += rng.expovariate(rate)
    return arrivals


async def open_loop(
    port: int,
    request: Request,
    *,
    rate: float,
    duration_s: float,
    seed: int = 1,
    warmup: int = 0,
) -> LoadResult:
    """Poisson arrivals at `rate` per second for `duration_s`, whatever happened to the earlier
    requests. Latency and TTFT run from each request's scheduled time (a late start counts
    against it: no coordinated omission). `warmup` requests go first, one by one, uncounted."""
    client = _Client(port)
    data = request.wire(port)
    result = LoadResult("open")
    tasks: set[asyncio.Task[None]] = set()

    async def one(due: float, offset: float) -> None:
        result.add(*await client.call(request, data, due), at_s=offset)

    try:
        for _ in range(warmup):
            await client.call(request, data)
        arrivals = poisson_arrivals(rate, duration_s, seed)
        cpu0 = time.thread_time()
        t0 = time.perf_counter() + 0.01
        for offset in arrivals:
            due = t0 + offset
            if (delay := due - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            result.send_lag_ms.append(max(0.0, time.perf_counter() - due) * 1000)
            task = asyncio.create_task(one(due, offset))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if (delay := t0 + duration_s - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        if tasks:
            await asyncio.wait(tasks)
        # Throughput over the offered period (the tail of the last answers does not dilute it).
        result.elapsed_s = max(duration_s, 1e-9)
        result.client_cpu_s = time.thread_time() - cpu0
    finally:
        client.close()
    return result


def run_load(factory: Callable[[], Awaitable[_T]], *, cpu: int | None = None) -> _T:
    """Run `factory()` to completion on a new event loop (uvloop when available) in a thread of
    its own, pinned to `cpu` when given, and return its result. The caller's thread, affinity
    and event loop (if any) are left alone."""
    box: dict[str, Any] = {}

    def main() -> None:
        if cpu is not None and hasattr(os, "sched_setaffinity"):
            with contextlib.suppress(OSError):  # a thread id pins the thread alone (Linux)
                os.sched_setaffinity(threading.get_native_id(), {cpu})

        async def wrapped() -> _T:
            return await factory()

        try:
            box["result"] = _event_loop_runner()(wrapped())
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=main, name="tailguard-bench-load", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    result: _T = box["result"]
    return result


def _event_loop_runner() -> Callable[[Any], Any]:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop ships with uvicorn[standard]
        return asyncio.run
    return cast("Callable[[Any], Any]", uvloop.run)


# --- tailguard bench batching --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BatchingRow:
    """One (workload, max_wait_ms) measurement. Latencies in milliseconds."""

    workload: Workload
    max_wait_ms: int
    requests: int  # answered correctly
    errors: int
    throughput_rps: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    mean_batch: float | None = None  # inputs per upstream call, from the gateway's metrics
    offered_rps: float | None = None  # open loop: the arrival rate
    gateway_cpu: float | None = None  # share of one CPU the gateway process used meanwhile
    load_cpu: float | None = None  # share of one CPU the load generator used (1.0: it limits)


@dataclass(frozen=True, slots=True)
class Recommendation:
    workload: Workload
    max_wait_ms: int
    reason: str


@dataclass(frozen=True, slots=True)
class BatchingBenchReport:
    rows: tuple[BatchingRow, ...]
    recommendations: tuple[Recommendation, ...]
    setup: Mapping[str, Any]
    notes: tuple[str, ...] = ()

    def row(self, workload: Workload, max_wait_ms: int) -> BatchingRow:
        for row in self.rows:
            if row.workload == workload and row.max_wait_ms == max_wait_ms:
                return row
        raise KeyError((workload, max_wait_ms))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable data."""
        return {
            "benchmark": "batching",
            "setup": dict(self.setup),
            "rows": [asdict(row) for row in self.rows],
            "recommendations": [asdict(r) for r in self.recommendations],
            "notes": list(self.notes),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def markdown(self) -> str:
        """The results as a Markdown table and the recommendations, one per line."""
        lines = [
            "| workload | max_wait_ms | throughput (req/s) | p50 (ms) | p99 (ms) "
            "| inputs per upstream call | gateway CPU | load generator CPU | errors |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in self.rows:
            batch = "-" if r.mean_batch is None else f"{r.mean_batch:.1f}"
            cpu = "-" if r.gateway_cpu is None else f"{r.gateway_cpu:.0%}"
            load = "-" if r.load_cpu is None else f"{r.load_cpu:.0%}"
            lines.append(
                f"| {r.workload} | {r.max_wait_ms} | {r.throughput_rps:.0f} | {r.p50_ms:.1f} "
                f"| {r.p99_ms:.1f} | {batch} | {cpu} | {load} | {r.errors} |"
            )
        lines.append("")
        lines += [f"{r.workload}: {r.max_wait_ms} ms — {r.reason}" for r in self.recommendations]
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


def _usable(rows: Sequence[BatchingRow]) -> list[BatchingRow]:
    """Rows that failed at most MAX_ERROR_SHARE of their requests (all of them if none did)."""
    good = [r for r in rows if r.errors <= MAX_ERROR_SHARE * max(r.requests + r.errors, 1)]
    return good or list(rows)


def _ms(value: float) -> str:
    return f"{value:.1f} ms" if value < 100 else f"{value:.0f} ms"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.1f}x" if b > 0 else "-"


def recommend(workload: Workload, rows: Sequence[BatchingRow]) -> Recommendation:
    """The `max_wait_ms` to use for `workload`, and why, from its measured rows.

    - interactive: the lowest p99; p99s within P99_TIE (10%) of the lowest count as equal and
      the shortest wait among them wins. Latency is what such traffic needs, and sparse
      arrivals, not the batching, set its throughput.
    - bulk: the highest throughput, where throughputs within THROUGHPUT_TIE (5%) of the best
      count as equal; among those the lowest p99 (again within P99_TIE), then the shortest wait.

    Settings that failed more than MAX_ERROR_SHARE of their requests are passed over.
    """
    mine = sorted((r for r in rows if r.workload == workload), key=lambda r: r.max_wait_ms)
    if not mine:
        raise ValueError(f"no rows for workload {workload!r}")
    usable = _usable(mine)
    failed = [r.max_wait_ms for r in mine if r not in usable]
    skipped = f"; passed over for errors: {', '.join(f'{w} ms' for w in failed)}" if failed else ""
    if workload == "interactive":
        best = _lowest_p99(usable)
        low, high = mine[0], mine[-1]
        others = [f"{_ms(r.p99_ms)} at {r.max_wait_ms} ms" for r in usable if r is not best]
        parts = [f"p99 {_ms(best.p99_ms)}" + (f" vs {', '.join(others)}" if others else "")]
        if high is not low and high.max_wait_ms > low.max_wait_ms:
            grew = high.p99_ms - low.p99_ms
            waited = high.max_wait_ms - low.max_wait_ms
            parts.append(
                f"p99 moves {grew:+.0f} ms from {low.max_wait_ms} to {high.max_wait_ms} ms of "
                f"wait ({grew / waited:.2f} ms per ms waited)"
            )
        offered = best.offered_rps
        if offered and all(r.throughput_rps >= ARRIVAL_LIMITED * offered for r in usable):
            tps = [r.throughput_rps for r in usable]
            note = (
                f"throughput ({min(tps):.0f}-{max(tps):.0f} req/s) is set by the arrivals "
                f"({offered:g} req/s), not by batching"
            )
            batches = [r.mean_batch for r in usable if r.mean_batch is not None]
            if batches and max(batches) < SMALL_BATCH:
                note += (
                    f"; batches stay small ({min(batches):.1f}-{max(batches):.1f} inputs), so "
                    "a request mostly waits out the timer"
                )
            parts.append(note)
        return Recommendation(workload, best.max_wait_ms, "; ".join(parts) + skipped)
    top = max(r.throughput_rps for r in usable)
    tied = [r for r in usable if r.throughput_rps >= (1 - THROUGHPUT_TIE) * top]
    best = _lowest_p99(tied)
    fastest = max(usable, key=lambda r: (r.throughput_rps, -r.max_wait_ms))
    if best.throughput_rps >= fastest.throughput_rps:
        reason = f"highest throughput, {best.throughput_rps:.0f} req/s"
    else:
        reason = (
            f"throughput {best.throughput_rps:.0f} req/s, within {THROUGHPUT_TIE:.0%} of the "
            f"best ({fastest.throughput_rps:.0f} at {fastest.max_wait_ms} ms)"
        )
    behind = [r for r in usable if r not in tied]
    if behind:
        reason += (
            " (" + ", ".join(f"{r.throughput_rps:.0f} at {r.max_wait_ms} ms" for r in behind) + ")"
        )
    clauses = []
    safer = False
    for r in tied:
        if r is best:
            continue
        versus = f"{_ms(best.p99_ms)} vs {_ms(r.p99_ms)}"
        if r.p99_ms > best.p99_ms * (1 + P99_TIE):
            clauses.append(
                f"p99 {_ratio(r.p99_ms, best.p99_ms)} lower than at {r.max_wait_ms} ms ({versus})"
            )
        else:
            clauses.append(f"p99 on a par with {r.max_wait_ms} ms ({versus})")
            safer = safer or r.max_wait_ms > best.max_wait_ms
    if clauses:
        reason += "; " + ", ".join(clauses)
    else:
        reason += f"; p99 {_ms(best.p99_ms)}"
    if safer:
        reason += "; the shorter wait costs less latency when bulk traffic thins out"
    if best.mean_batch is not None:
        reason += f"; {best.mean_batch:.1f} inputs per upstream call"
    return Recommendation(workload, best.max_wait_ms, reason + skipped)


def _lowest_p99(rows: Sequence[BatchingRow]) -> BatchingRow:
    """The shortest wait among the rows whose p99 is within P99_TIE of the lowest."""
    floor = min(r.p99_ms for r in rows)
    return min((r for r in rows if r.p99_ms <= floor * (1 + P99_TIE)), key=lambda r: r.max_wait_ms)


def _batching_config(waits_ms: Sequence[int], sim_port: int) -> dict[str, Any]:
    """One model per wait, `embed-w<ms>`, each batched onto a deployment of its own."""
    return {
        "server": {"host": "127.0.0.1", "access_log": False, "reload_on_change": False},
        "latency": {"store": "memory"},
        "providers": {
            "sim": {"type": "openai", "base_url": f"http://127.0.0.1:{sim_port}/v1"},
        },
        "models": [
            {
                "name": f"embed-w{wait}",
                "deployments": [{"provider": "sim", "model": f"emb-w{wait}"}],
                "batching": {**BATCHING, "max_wait_ms": wait},
            }
            for wait in waits_ms
        ],
    }


def _batch_totals(port: int, deployment: str) -> tuple[float, float]:
    """(inputs, upstream calls) batched so far for `deployment`'s embeddings."""
    label = f'deployment="{deployment}"'
    sums = metric_samples(port, "tailguard_batch_size_sum")
    counts = metric_samples(port, "tailguard_batch_size_count")
    inputs = sum(v for k, v in sums.items() if label in k)
    calls = sum(v for k, v in counts.items() if label in k)
    return inputs, calls


def run_batching_bench(
    *,
    duration_s: float,
    waits_ms: Sequence[int] = DEFAULT_WAITS_MS,
    progress: Callable[[str], None] | None = None,
    interactive_rps: float = INTERACTIVE_RPS,
    bulk_concurrency: int = BULK_CONCURRENCY,
    seed: int = 1,
) -> BatchingBenchReport:
    """Measure each workload at each `max_wait_ms` for `duration_s` seconds (each, so the run
    takes about 2 x len(waits_ms) x duration_s plus a few seconds of start-up) and recommend a
    wait per workload. `progress` gets a line of text as each step starts and ends."""
    waits = sorted(set(int(w) for w in waits_ms))
    if not waits or waits[0] < 0:
        raise ValueError("waits_ms: at least one wait, none negative")
    if duration_s <= 0:
        raise ValueError("duration_s must be positive")
    say = progress or (lambda line: None)
    cpus = cpu_layout()
    rows: list[BatchingRow] = []
    logs = Path(tempfile.mkdtemp(prefix="tailguard-bench-"))
    stack = Stack(logs, cpus)
    try:
        say("starting the simulated upstream and the gateway ...")
        sim_port = start_sim(stack, SIM_PROFILE, seed=seed)
        port, gateway_pid = start_gateway(stack, _batching_config(waits, sim_port))
        for workload in WORKLOADS:
            for wait in waits:
                model = f"embed-w{wait}"
                request = Request.embeddings(model)
                before = _batch_totals(port, f"sim/emb-w{wait}")
                cpu0, wall0 = proc_cpu_s(gateway_pid), time.perf_counter()
                if workload == "interactive":
                    say(
                        f"interactive, max_wait_ms {wait}: {interactive_rps:g} req/s (Poisson) "
                        f"for {duration_s:g} s ..."
                    )
                    load = functools.partial(
                        open_loop,
                        port,
                        request,
                        rate=interactive_rps,
                        duration_s=duration_s,
                        seed=seed,
                        warmup=3,
                    )
                else:
                    say(
                        f"bulk, max_wait_ms {wait}: {bulk_concurrency} clients back to back "
                        f"for {duration_s:g} s ..."
                    )
                    load = functools.partial(
                        closed_loop,
                        port,
                        request,
                        concurrency=bulk_concurrency,
                        duration_s=duration_s,
                        warmup=bulk_concurrency,
                    )
                result = run_load(load, cpu=cpus.get("load"))
                cpu1, wall1 = proc_cpu_s(gateway_pid), time.perf_counter()
                after = _batch_totals(port, f"sim/emb-w{wait}")
                calls = after[1] - before[1]
                latency = summary_ms(result.latencies_ms)
                row = BatchingRow(
                    workload=workload,
                    max_wait_ms=wait,
                    requests=result.ok,
                    errors=result.errors,
                    throughput_rps=result.throughput_rps,
                    p50_ms=latency.get("p50", 0.0),
                    p99_ms=latency.get("p99", 0.0),
                    max_ms=latency.get("max", 0.0),
                    # Includes the warm-up requests on both sides: a close enough mean.
                    mean_batch=(after[0] - before[0]) / calls if calls else None,
                    offered_rps=interactive_rps if workload == "interactive" else None,
                    gateway_cpu=(
                        (cpu1 - cpu0) / (wall1 - wall0)
                        if cpu0 is not None and cpu1 is not None
                        else None
                    ),
                    load_cpu=result.client_cpu_s / result.elapsed_s if result.elapsed_s else None,
                )
                rows.append(row)
                errors = (
                    f", {row.errors} errors ({result.error_samples[0][:80]})" if row.errors else ""
                )
                say(
                    f"  {row.throughput_rps:.0f} req/s, p50 {_ms(row.p50_ms)}, "
                    f"p99 {_ms(row.p99_ms)}{errors}"
                )
    finally:
        stack.stop()
        with contextlib.suppress(OSError):
            for path in logs.iterdir():
                path.unlink()
            logs.rmdir()
    recommendations = tuple(recommend(w, rows) for w in WORKLOADS)
    setup = {
        "upstream": {
            **SIM_PROFILE,
            "note": "tailguard sim: an embeddings call costs embed_base_ms + embed_ms_per_input "
            "x inputs; at most max_batch calls run at once, the rest queue FIFO",
        },
        "batching": {**BATCHING, "max_wait_ms": waits},
        "requests": "single-input /v1/embeddings with x-tailguard-priority: bulk (embeddings "
        "and completions are what the gateway micro-batches; chat is never batched)",
        "workloads": {
            "interactive": f"open loop, Poisson arrivals at {interactive_rps:g} req/s; latency "
            "from each request's scheduled send time",
            "bulk": f"closed loop, {bulk_concurrency} clients sending back to back",
        },
        "duration_s": duration_s,
        "percentiles": "nearest rank",
        "pinned": cpus,
    }
    notes: list[str] = []
    if not cpus:
        notes.append("fewer than two CPUs: the gateway, upstream and load share them")
    busy = [r for r in rows if r.load_cpu is not None and r.load_cpu > LOAD_BOUND]
    if busy:
        notes.append(
            "the load generator used most of a CPU in "
            + ", ".join(f"{r.workload} {r.max_wait_ms} ms ({r.load_cpu or 0:.0%})" for r in busy)
            + ": those throughputs are a floor of what the gateway can do"
        )
    return BatchingBenchReport(tuple(rows), recommendations, setup, tuple(notes))

"""A cheap HTTP/1.1 load generator for the benchmarks, run in a process of its own.

It speaks just enough HTTP/1.1 for an OpenAI-style endpoint: pre-built request bytes written on
keep-alive connections, responses parsed by `httptools` (the parser uvicorn uses), on `uvloop`
when available. A request costs the load generator a few tens of microseconds, so on a shared
core it disturbs what it measures far less than an HTTP client library would.

Two ways to drive load:

- closed loop: `concurrency` workers, each with its own connection, send back to back for
  `duration_s` seconds (or until `requests` are done). Measures throughput.
- open loop: one request every `1 / rate` seconds at fixed, precomputed times, whatever happened
  to the previous ones. A request's latency runs from its scheduled time (or from its actual
  start when the timer fired early), so a stall delays the clock of every request queued behind
  it: coordinated omission cannot hide it.

Streams are parsed as server-sent events: TTFT is the time to the first `data:` event whose
`choices[].delta.content` is a non-empty string. Every answer is checked (status 200, the
expected number of content tokens, a final `[DONE]` for streams) and failures are counted.

Around the measured window it reads utime+stime of the given processes from `/proc/<pid>/stat`,
so CPU per request covers exactly the requests in the window.

Run as `python bench/_load.py < spec.json`: the spec is a `LoadSpec` as JSON, the result is one
JSON object on stdout. `run_load` does that from another script (in a pinned subprocess).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import httptools
import orjson

from gateway.sketch import nearest_rank

_CLK_TCK = os.sysconf("SC_CLK_TCK")
_REQUEST_TIMEOUT_S = 30.0
# A connection idle for longer is not reused: uvicorn closes idle ones after 5 s, and a request
# written just as the server closes would fail for reasons that have nothing to do with the test.
_MAX_IDLE_S = 2.0
_MAX_ERRORS_KEPT = 5


@dataclass(slots=True)
class LoadSpec:
    """One load run against one endpoint."""

    port: int
    body: str  # JSON request body
    mode: str = "closed"  # closed | open
    stream: bool = False
    host: str = "127.0.0.1"
    path: str = "/v1/chat/completions"
    concurrency: int = 32  # closed loop: workers; open loop: connection cap
    rate: float = 100.0  # open loop: requests per second
    duration_s: float = 10.0
    requests: int | None = None  # closed loop: stop after this many (default: time only)
    warmup_requests: int = 0  # sent before the window (opens the connections), not measured
    expect_tokens: int | None = None  # content tokens each answer must carry
    cpu_pids: dict[str, int] = field(default_factory=dict)  # name -> pid to charge CPU to
    headers: dict[str, str] = field(default_factory=dict)  # extra request headers (e.g. auth)


# --- measuring -----------------------------------------------------------------------------------


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as file:
        fields = file.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # fields 14 and 15 of stat(5)


def cpu_times() -> dict[str, tuple[int, int]]:
    """Per CPU (`cpu0`, ...): (steal, total) jiffies from `/proc/stat`."""
    times: dict[str, tuple[int, int]] = {}
    with open("/proc/stat", encoding="ascii") as file:
        for line in file:
            name, _, rest = line.partition(" ")
            if name.startswith("cpu") and name != "cpu":
                values = [int(v) for v in rest.split()[:8]]  # user .. steal
                times[name] = (values[7] if len(values) > 7 else 0, sum(values))
    return times


def steal_percent(
    before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]
) -> dict[str, float]:
    """Share of each CPU's time the hypervisor gave to someone else, between two readings."""
    shares: dict[str, float] = {}
    for name, (steal, total) in after.items():
        steal0, total0 = before.get(name, (steal, total))
        shares[name] = 100.0 * (steal - steal0) / max(total - total0, 1)
    return shares


def percentiles(values: Sequence[float]) -> dict[str, float | int]:
    """count, mean, p50/p90/p99/p99.9 (nearest rank) and max, in the unit of `values`."""
    if not values:
        return {"count": 0}
    ordered = sorted(values)
    n = len(ordered)

    def rank(q: float) -> float:
        return ordered[nearest_rank(q, n) - 1]  # the gateway's one definition of nearest rank

    return {
        "count": n,
        "mean": sum(ordered) / n,
        "p50": rank(0.50),
        "p90": rank(0.90),
        "p99": rank(0.99),
        "p999": rank(0.999),
        "max": ordered[-1],
    }


# --- a minimal HTTP/1.1 client -------------------------------------------------------------------


class Exchange:
    """One request/response: timestamps and what the body said."""

    __slots__ = (
        "buffer",
        "content_tokens",
        "done",
        "error",
        "keep_alive",
        "parts",
        "received",
        "status",
        "stream",
        "t_end",
        "t_first",
    )

    def __init__(self, stream: bool) -> None:
        self.stream = stream
        self.status = 0
        self.received = 0  # response bytes, headers included
        self.t_first: float | None = None
        self.t_end = 0.0
        self.buffer = b""
        self.parts: list[bytes] = []
        self.content_tokens = 0
        self.done = False
        self.error: str | None = None
        self.keep_alive = False

    def on_body(self, data: bytes) -> None:
        if not self.stream:
            self.parts.append(data)
            return
        buffer = self.buffer + data if self.buffer else data
        start = 0
        while (end := buffer.find(b"\n\n", start)) >= 0:
            self._event(buffer[start:end])
            start = end + 2
        self.buffer = buffer[start:]

    def _event(self, event: bytes) -> None:
        if not event.startswith(b"data: "):
            return  # comments, keep-alives
        payload = event[6:]
        if payload == b"[DONE]":
            self.done = True
            return
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            self.error = f"bad event {payload[:80]!r}"
            return
        if "error" in obj:
            self.error = f"error event {payload[:200]!r}"
            return
        for choice in obj.get("choices") or ():
            content = (choice.get("delta") or {}).get("content")
            if isinstance(content, str) and content:
                self.content_tokens += 1
                if self.t_first is None:
                    self.t_first = time.perf_counter()

    def check(self, expect_tokens: int | None) -> str | None:
        """None when the answer is complete and well formed, else what is wrong."""
        if self.status != 200:
            body = b"".join(self.parts) or self.buffer
            return f"status {self.status}: {body[:200]!r}"
        if self.error is not None:
            return self.error
        if self.stream:
            if not self.done:
                return "stream ended without [DONE]"
            tokens = self.content_tokens
        else:
            try:
                obj = orjson.loads(b"".join(self.parts))
                tokens = int(obj["usage"]["completion_tokens"])
                if not obj["choices"][0]["message"]["content"]:
                    return "empty message content"
            except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, ValueError) as exc:
                return f"bad body ({type(exc).__name__})"
        if expect_tokens is not None and tokens != expect_tokens:
            return f"{tokens} content tokens, expected {expect_tokens}"
        return None


class Connection(asyncio.Protocol):
    """One keep-alive connection: one exchange at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.exchange: Exchange | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.lost = False
        self.idle_since = 0.0

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast("asyncio.Transport", transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        if self.exchange is not None:
            self.exchange.received += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ConnectionError(f"bad HTTP response: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        exchange = self.exchange
        if exchange is not None:
            self._fail(
                ConnectionError(
                    f"connection closed by the server after {exchange.received} response bytes"
                    + (f" (status {exchange.status})" if exchange.status else "")
                )
            )

    # httptools callbacks
    def on_headers_complete(self) -> None:
        if self.exchange is not None:
            self.exchange.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if self.exchange is not None:
            self.exchange.on_body(body)

    def on_message_complete(self) -> None:
        exchange = self.exchange
        if exchange is not None:
            exchange.t_end = time.perf_counter()
            exchange.keep_alive = self.parser.should_keep_alive()
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    # use
    async def send(self, request: bytes, exchange: Exchange) -> None:
        assert self.transport is not None
        self.exchange = exchange
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
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


class Pool:
    """Keep-alive connections to one address; at most `limit` open, the rest wait (FIFO)."""

    def __init__(self, host: str, port: int, limit: int) -> None:
        self.host = host
        self.port = port
        self.limit = limit
        self.open = 0
        self.idle: list[Connection] = []
        self.waiters: deque[asyncio.Future[Connection | None]] = deque()

    async def acquire(self) -> Connection:
        while True:
            now = time.perf_counter()
            while self.idle:
                conn = self.idle.pop()
                if not conn.lost and now - conn.idle_since < _MAX_IDLE_S:
                    return conn
                conn.close()
                self.open -= 1
            if self.open < self.limit:
                self.open += 1
                try:
                    _, conn = await asyncio.get_running_loop().create_connection(
                        Connection, self.host, self.port
                    )
                except BaseException:
                    self.open -= 1
                    raise
                return conn
            waiter: asyncio.Future[Connection | None] = asyncio.get_running_loop().create_future()
            self.waiters.append(waiter)
            conn_or_none = await waiter
            if conn_or_none is not None:
                return conn_or_none

    def release(self, conn: Connection, reusable: bool) -> None:
        if not reusable or conn.lost:
            conn.close()
            self.open -= 1
            handed: Connection | None = None
        else:
            handed = conn
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(handed)
                return
        if handed is not None:
            handed.idle_since = time.perf_counter()
            self.idle.append(handed)

    def close(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle.clear()


# --- the runs ------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Tally:
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    lags: list[float] = field(default_factory=list)
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    last_end: float = 0.0

    def fail(self, message: str) -> None:
        self.errors += 1
        if len(self.error_samples) < _MAX_ERRORS_KEPT:
            self.error_samples.append(message)


class Runner:
    def __init__(self, spec: LoadSpec) -> None:
        self.spec = spec
        body = spec.body.encode()
        extra = "".join(f"{name}: {value}\r\n" for name, value in spec.headers.items())
        self.request = (
            f"POST {spec.path} HTTP/1.1\r\nhost: {spec.host}:{spec.port}\r\n"
            f"content-type: application/json\r\n{extra}"
            f"accept: {'text/event-stream' if spec.stream else 'application/json'}\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        ).encode() + body
        limit = spec.concurrency if spec.mode == "closed" else max(spec.concurrency, 256)
        self.pool = Pool(spec.host, spec.port, limit)

    async def one(self, tally: _Tally | None, start: float | None = None) -> None:
        """One request; recorded in `tally` (latency from `start`, default: now)."""
        called = time.perf_counter()
        exchange = Exchange(self.spec.stream)
        conn: Connection | None = None
        reusable = False
        try:
            async with asyncio.timeout(_REQUEST_TIMEOUT_S):
                conn = await self.pool.acquire()
                await conn.send(self.request, exchange)
            reusable = exchange.keep_alive
            problem = exchange.check(self.spec.expect_tokens)
        except (OSError, TimeoutError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
        finally:
            if conn is not None:
                self.pool.release(conn, reusable)
        if tally is None:
            return
        if problem is not None:
            tally.fail(problem)
            return
        # Open loop: from the scheduled time, or from the actual start if the timer fired early.
        origin = called if start is None else max(start, called)
        tally.latencies.append(exchange.t_end - origin)
        if exchange.t_first is not None:
            tally.ttfts.append(exchange.t_first - origin)
        tally.last_end = max(tally.last_end, exchange.t_end)

    async def warm_up(self) -> None:
        spec = self.spec
        width = spec.concurrency if spec.mode == "closed" else min(spec.concurrency, 4)
        left = spec.warmup_requests
        while left > 0:
            batch = min(width, left)
            await asyncio.gather(*(self.one(None) for _ in range(batch)))
            left -= batch

    async def closed(self, tally: _Tally) -> float:
        spec = self.spec
        t0 = time.perf_counter()
        deadline = t0 + spec.duration_s
        budget = [spec.requests if spec.requests is not None else 1 << 62]

        async def worker() -> None:
            while time.perf_counter() < deadline and budget[0] > 0:
                budget[0] -= 1
                await self.one(tally)

        await asyncio.gather(*(worker() for _ in range(spec.concurrency)))
        return t0

    async def open(self, tally: _Tally) -> float:
        spec = self.spec
        count = max(1, round(spec.rate * spec.duration_s))
        interval = 1.0 / spec.rate
        tasks: set[asyncio.Task[None]] = set()
        t0 = time.perf_counter() + 0.01
        for i in range(count):
            due = t0 + i * interval
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tally.lags.append(time.perf_counter() - due)
            task = asyncio.create_task(self.one(tally, due))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks)
        return t0

    async def run(self) -> dict[str, Any]:
        spec = self.spec
        await self.warm_up()
        tally = _Tally()
        pids = spec.cpu_pids
        cpu0 = {name: proc_cpu_s(pid) for name, pid in pids.items()}
        self_cpu0 = _self_cpu_s()
        machine0 = cpu_times()
        t0 = await (self.closed(tally) if spec.mode == "closed" else self.open(tally))
        t1 = time.perf_counter()
        cpu = {name: proc_cpu_s(pid) - cpu0[name] for name, pid in pids.items()}
        self_cpu = _self_cpu_s() - self_cpu0
        steal = steal_percent(machine0, cpu_times())
        self.pool.close()
        done = len(tally.latencies)
        sent = done + tally.errors
        elapsed = max(t1 - t0, 1e-9)
        ms = 1000.0
        result: dict[str, Any] = {
            "mode": spec.mode,
            "stream": spec.stream,
            "port": spec.port,
            "concurrency": spec.concurrency,
            "rate": spec.rate if spec.mode == "open" else None,
            "requests": sent,
            "ok": done,
            "errors": tally.errors,
            "error_samples": tally.error_samples,
            "elapsed_s": elapsed,
            "throughput_rps": done / elapsed,
            "latency_ms": percentiles([x * ms for x in tally.latencies]),
            "ttft_ms": percentiles([x * ms for x in tally.ttfts]) if spec.stream else None,
            "send_lag_ms": percentiles([x * ms for x in tally.lags]) if tally.lags else None,
            "cpu_s": cpu,
            "cpu_ms_per_request": {name: s * ms / max(sent, 1) for name, s in cpu.items()},
            "loadgen_cpu_ms_per_request": self_cpu * ms / max(sent, 1),
            "steal_percent": steal,
        }
        return result


def _self_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _event_loop_runner() -> Any:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop ships with uvicorn[standard]
        return asyncio.run
    return uvloop.run


def main() -> None:
    spec = LoadSpec(**json.loads(sys.stdin.read()))
    result = _event_loop_runner()(Runner(spec).run())
    sys.stdout.write(json.dumps(result) + "\n")


# --- for the benchmark scripts -------------------------------------------------------------------


def run_load(
    spec: LoadSpec,
    *,
    prefix: Sequence[str] = (),
    procs: list[subprocess.Popen[bytes]] | None = None,
) -> dict[str, Any]:
    """Run `spec` in a fresh process started under `prefix` (e.g. `taskset -c 1`).

    The child is appended to `procs` while it runs, so a caller's cleanup can stop it.
    """
    command = [*prefix, sys.executable, os.path.abspath(__file__)]
    child = subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    if procs is not None:
        procs.append(child)
    try:
        timeout = spec.duration_s + 60 + spec.warmup_requests * 0.05
        out, err = child.communicate(json.dumps(asdict(spec)).encode(), timeout=timeout)
    except BaseException:
        child.kill()
        child.wait()
        raise
    finally:
        if procs is not None:
            with contextlib.suppress(ValueError):
                procs.remove(child)
    if child.returncode != 0:
        raise RuntimeError(
            f"load generator failed ({child.returncode}): {err.decode(errors='replace')[-2000:]}"
        )
    result: dict[str, Any] = json.loads(out)
    return result


if __name__ == "__main__":
    main()

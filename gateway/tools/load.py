"""The benchmarks' one load client: raw HTTP/1.1 on keep-alive connections, in closed or open loop.

It speaks just enough HTTP/1.1 for an OpenAI-style endpoint: pre-built request bytes written on
keep-alive connections, responses parsed by `httptools` (the parser uvicorn uses), on `uvloop`
when available. A request costs the client a few tens of microseconds, so on a shared core it
disturbs what it measures far less than an HTTP client library would.

Two ways to drive load:

- `closed_loop`: `concurrency` workers, each on its own connection, send back to back until a
  duration has passed, a number of requests have been sent, or a stop event is set. Measures
  throughput.
- `open_loop`: one request at each precomputed arrival time (`poisson_arrivals` or
  `even_arrivals`), whatever happened to the earlier ones. A request's latency runs from its
  scheduled time (or from its actual start when the timer fired early), so a stall delays the
  clock of every request queued behind it: coordinated omission cannot hide it. (Or, on request,
  from when it went out, the client's own lag reported apart.)

Streams are read by `gateway.tools.stream.StreamReader` (the gateway's own SSE parser beneath):
TTFT is the time to the first event carrying content (`choices[].delta.content`, or
`choices[].text` for completions). Every answer is checked against its `Request` (status 200,
the expected body, the expected number of content tokens when given, a final `[DONE]` for
streams); failures are counted and a few kept as samples.

A warm-up (`Client.warm_up`) goes before a loop and is not counted, so a caller that measures
something else over the run (another process's CPU) measures exactly the loop. `run_load` runs a
loop on an event loop of its own in a thread, pinned to a CPU when asked; `bench/_load.py` runs
one in a process of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeVar, cast

import httptools
import orjson

from gateway.latency.sketch import nearest_rank
from gateway.tools.stream import StreamReader

__all__ = [
    "BULK_HEADERS",
    "Client",
    "LoadResult",
    "Request",
    "closed_loop",
    "even_arrivals",
    "open_loop",
    "poisson_arrivals",
    "run_async",
    "run_load",
    "summary_ms",
]

_T = TypeVar("_T")

REQUEST_TIMEOUT_S: Final = 60.0
# A connection idle for longer is not reused: uvicorn closes idle ones after 5 s, and a request
# written just as the server closes would fail for reasons that have nothing to do with the test.
MAX_IDLE_S: Final = 2.0
MAX_ERROR_SAMPLES: Final = 5
BULK_HEADERS: Final[Mapping[str, str]] = {"x-tailguard-priority": "bulk"}

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
    tokens: int | None = None  # content tokens a good answer carries (None: any number)

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

    def wire(self, host: str, port: int) -> bytes:
        extra = "".join(f"{k}: {v}\r\n" for k, v in self.headers.items())
        accept = "text/event-stream" if self.stream else "application/json"
        return (
            f"POST {self.path} HTTP/1.1\r\nhost: {host}:{port}\r\n"
            f"content-type: application/json\r\naccept: {accept}\r\n{extra}"
            f"content-length: {len(self.body)}\r\n\r\n"
        ).encode() + self.body


class _Exchange:
    """One request and its response: status, its stream as read so far, and the body."""

    __slots__ = ("keep_alive", "parts", "received", "status", "stream", "t_end")

    def __init__(self, stream: bool) -> None:
        self.stream = StreamReader() if stream else None
        self.status = 0
        self.received = 0  # response bytes, headers included
        self.t_end = 0.0
        self.parts: list[bytes] = []
        self.keep_alive = False

    def on_body(self, data: bytes) -> None:
        if self.stream is None or self.status != 200:
            self.parts.append(data)
        else:
            self.stream.feed(data, time.perf_counter())

    def problem(self, request: Request) -> str | None:
        """None when the answer is complete and well formed, else what is wrong with it."""
        if self.status != 200:
            return f"status {self.status}: {b''.join(self.parts)[:200]!r}"
        stream = self.stream
        if stream is not None:
            if stream.error is not None:
                return stream.error
            if not stream.done:
                return "stream ended without [DONE]"
            if not stream.content and request.tokens is None:
                return "stream without content"
            tokens = stream.content
        else:
            try:
                obj = orjson.loads(b"".join(self.parts))
                if request.expect == "embeddings":
                    if len(obj["data"]) != request.inputs or not obj["data"][0]["embedding"]:
                        return f"{len(obj['data'])} vectors, expected {request.inputs}"
                elif request.expect == "chat" and not obj["choices"][0]["message"]["content"]:
                    return "empty message content"
                tokens = 0 if request.tokens is None else int(obj["usage"]["completion_tokens"])
            except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, ValueError) as exc:
                return f"bad body ({type(exc).__name__})"
        if request.tokens is not None and tokens != request.tokens:
            return f"{tokens} content tokens, expected {request.tokens}"
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


class Client:
    """Keep-alive connections to one address, reused last in, first out; with `limit`, at most
    that many open and the other requests wait for one (first in, first out).

    Use it on one event loop, as `async with Client(port) as client:` (closing it closes the
    idle connections)."""

    def __init__(
        self,
        port: int,
        *,
        host: str = "127.0.0.1",
        limit: int | None = None,
        timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        self.host = host
        self.port = port
        self.limit = limit
        self.timeout_s = timeout_s
        self.open = 0
        self.idle: list[_Connection] = []
        self.waiters: deque[asyncio.Future[_Connection | None]] = deque()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def wire(self, request: Request) -> bytes:
        """The bytes of `request` to this client's address (build once, send many times)."""
        return request.wire(self.host, self.port)

    async def call(
        self, request: Request, data: bytes, origin: float | None = None
    ) -> tuple[float, float | None, str | None]:
        """Send one request (`data`: its `wire` bytes): (latency, time to the first content or
        None, problem or None), in seconds from `origin` (default: now; the actual start when
        that came earlier)."""
        started = time.perf_counter()
        origin = started if origin is None else min(origin, started)
        exchange = _Exchange(request.stream)
        conn: _Connection | None = None
        reusable = False
        try:
            async with asyncio.timeout(self.timeout_s):
                conn = await self._acquire()
                await conn.send(data, exchange)
            reusable = exchange.keep_alive
            problem = exchange.problem(request)
        except (OSError, TimeoutError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
        finally:
            if conn is not None:
                self._release(conn, reusable)
        t_first = None if exchange.stream is None else exchange.stream.t_first
        first = None if t_first is None else t_first - origin
        return exchange.t_end - origin, first, problem

    async def warm_up(self, request: Request, count: int, width: int = 1) -> None:
        """Send `count` requests, `width` at a time, and forget them: it opens the connections
        (and warms the server) before a measured loop."""
        data = self.wire(request)
        left = count
        while left > 0:
            batch = min(width, left)
            await asyncio.gather(*(self.call(request, data) for _ in range(batch)))
            left -= batch

    async def _acquire(self) -> _Connection:
        while True:
            now = time.perf_counter()
            while self.idle:
                conn = self.idle.pop()
                if not conn.lost and now - conn.idle_since < MAX_IDLE_S:
                    return conn
                conn.close()
                self.open -= 1
            if self.limit is None or self.open < self.limit:
                self.open += 1
                try:
                    _, conn = await asyncio.get_running_loop().create_connection(
                        _Connection, self.host, self.port
                    )
                except BaseException:
                    self.open -= 1
                    raise
                return conn
            waiter: asyncio.Future[_Connection | None] = asyncio.get_running_loop().create_future()
            self.waiters.append(waiter)
            handed = await waiter
            if handed is not None:
                return handed

    def _release(self, conn: _Connection, reusable: bool) -> None:
        handed: _Connection | None = conn
        if not reusable or conn.lost:
            conn.close()
            self.open -= 1
            handed = None  # a waiter wakes up to open a connection of its own
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


@dataclass(slots=True)
class LoadResult:
    """What one load run saw. Latencies and TTFTs are in milliseconds, in completion order."""

    mode: str  # closed | open
    elapsed_s: float = 0.0  # what throughput is over: the run (closed), the offered period (open)
    wall_s: float = 0.0  # from the start to the last answer
    latencies_ms: list[float] = field(default_factory=list)
    ttfts_ms: list[float] = field(default_factory=list)
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    send_lag_ms: list[float] = field(default_factory=list)  # open loop: how late each went out
    ttft_at_s: list[float] = field(default_factory=list)  # open loop: when each TTFT's request
    # was due, in seconds from the start (aligned with ttfts_ms)
    client_cpu_s: float = 0.0  # CPU time the load generator's thread spent in the run

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
    client: Client,
    request: Request,
    *,
    concurrency: int,
    duration_s: float | None = None,
    requests: int | None = None,
    stop: asyncio.Event | None = None,
) -> LoadResult:
    """`concurrency` workers, each on a connection of its own, send `request` back to back until
    `duration_s` has passed, `requests` have been sent, or `stop` is set."""
    data = client.wire(request)
    result = LoadResult("closed")
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
    result.elapsed_s = result.wall_s = time.perf_counter() - t0
    result.client_cpu_s = time.thread_time() - cpu0
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


def even_arrivals(rate: float, duration_s: float) -> list[float]:
    """Offsets (s) one `1 / rate` apart from 0, `rate * duration_s` of them (at least one)."""
    return [i / rate for i in range(max(1, round(rate * duration_s)))]


async def open_loop(
    client: Client,
    request: Request,
    arrivals: Sequence[float],
    *,
    duration_s: float,
    from_schedule: bool = True,
) -> LoadResult:
    """Send `request` at each offset of `arrivals` (seconds from now), whatever happened to the
    earlier ones, and wait for every answer. Latency and TTFT run from each request's scheduled
    time (a late start counts against it: no coordinated omission); with `from_schedule` off,
    from when it went out, which leaves the client's own timer lag (in `send_lag_ms`) out of a
    comparison of two paths measured with the same client. Throughput is over the offered
    period, `duration_s`, so the tail of the last answers does not dilute it."""
    data = client.wire(request)
    result = LoadResult("open")
    tasks: set[asyncio.Task[None]] = set()

    async def one(due: float, offset: float) -> None:
        origin = due if from_schedule else None
        result.add(*await client.call(request, data, origin), at_s=offset)

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
    result.elapsed_s = max(duration_s, 1e-9)
    result.wall_s = time.perf_counter() - t0
    result.client_cpu_s = time.thread_time() - cpu0
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
            box["result"] = run_async(wrapped())
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=main, name="tailguard-bench-load", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    result: _T = box["result"]
    return result


def run_async(main: Coroutine[Any, Any, _T]) -> _T:
    """Run `main` on a new event loop in this thread: uvloop's when available."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop ships with uvicorn[standard]
        return asyncio.run(main)
    return uvloop.run(main)

"""Soak: a steady mixed load for minutes, with injected faults; the gateway must not leak.

Scenario. Two simulated upstreams (`tailguard sim`, each a process of its own; one behind a
provider of type `openai`, the other of type `vllm`, whose `/metrics` the gateway scrapes every
second), a throwaway `redis-server` as the shared latency store (the local Redis on an empty
database when `redis-server` is not installed), and a real `tailguard serve` on a config written
to a temporary file. Clean models sit on both upstreams; the fault models sit on the first one
only and fall back to the clean `chat`:

- `chat-flaky`: 4% 500, 2% 429, 3% resets before headers, 3% in-band errors; failed over.
- `chat-stall`: 8% of streams stall before their first token; cut at the first-token deadline
  and hedged or failed over.
- `chat-cut`: 30% of streams drop the connection half way; after the first token nothing is
  retried, so the client gets an error event and no `[DONE]` (the expected outcome).

Load. Open loop, Poisson arrivals at `--rps` (50), seeded; each request draws its kind: streaming
and non-streaming chat, completions and embeddings, Anthropic `/v1/messages` (streaming or not),
bulk chat, bulk (micro-batched) embeddings and completions, requests to the fault models, clients
that disconnect after the first content event, and clients that give up on a non-streaming answer
after 50 ms. Every answer is checked (status, shape, content, `[DONE]` or `message_stop`).

Outcomes. `ok` (a complete, well-formed answer, whether or not the gateway failed over), and the
expected outcomes of injected faults: `cut` (a `chat-cut` stream ended by an error event with
code `upstream_stream_error` after content), `disconnected` and `abandoned` (the client left on
purpose). Anything else is unexpected and printed with samples.

Resources. Every `--duration / 120` s (1-5 s) it reads the gateway's RSS from
`/proc/<pid>/status`, its open descriptors from `/proc/<pid>/fd`, and `tailguard_event_loop_tasks`
from `/metrics`. Warm-up is the first 20% of the run, at least 15 s. The comparison windows are
the `window` seconds right after the warm-up and the last `window` seconds of the load (10% of
the run, at least 10 s); a window's median stands for it. Pass criteria, printed at the end:

- zero unexpected outcomes;
- RSS: end median under 5% above the post-warm-up median;
- open descriptors and event-loop tasks: end median no more than the in-flight jitter above the
  post-warm-up median (see `growth_allowance`);
- after the load, nothing left in flight: no upstream attempt at the gateway, no running or
  waiting sequence at the upstreams;
- back to idle, 6 s later (the upstreams close connections idle for 5 s): event-loop tasks no
  more than 3 above their count before the load; no client connection still open and no socket
  its peer closed but the gateway did not (CLOSE_WAIT); descriptors other than TCP connections
  (files, pipes, the listening socket, the event loop's own) no more than 3 above their count
  before the load. Pooled keep-alive connections to the upstreams and Redis are reported, not
  judged: the vLLM metrics scrape keeps a few warm. Under load a small leak hides in the
  in-flight jitter; at rest there is none, so a leak of a handful shows.

Exit status: 0 when every criterion passes, 1 when one fails, 2 when the run itself failed.
Results go to `bench/results/soak-<timestamp>.json`.

    .venv/bin/python bench/soak.py                   # 10 minutes
    .venv/bin/python bench/soak.py --duration 60     # what CI runs
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final, Literal
from urllib.parse import urlsplit

if not __package__:  # `python bench/<script>.py`: `bench` is imported from the root
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import aiohttp
import orjson
import redis
from prometheus_client.parser import text_string_to_metric_families

from bench._harness import (
    RESULTS_DIR,
    ROOT,
    VENV_BIN,
    environment,
    pin_client,
    sigterm_as_interrupt,
    write_results,
)
from bench._harness import percentiles_ms as _percentiles_ms
from gateway.admission.auth import hash_key
from gateway.latency.sketch import nearest_rank
from gateway.tools.load import run_async
from gateway.tools.stack import Stack, free_port, start_gateway
from gateway.tools.stream import StreamReader

SOAK_KEY = "tg-soak-key"

RSS_GROWTH_LIMIT: Final = 0.05
WARMUP_SHARE: Final = 0.20
MIN_WARMUP_S: Final = 15.0
WINDOW_SHARE: Final = 0.10
MIN_WINDOW_S: Final = 10.0
# The smallest growth in descriptors or tasks that counts, whatever the jitter measured: at a
# scrape, the periodic jobs (latency flush and refresh, the vLLM scrape) may hold one each.
MIN_ALLOWANCE: Final = 3
REQUEST_TIMEOUT_S: Final = 30.0  # far past any answer here: a hung request shows as an error
ABANDON_AFTER_S: Final = 0.05  # mid-generation for a non-streaming chat answer (~0.2 s)
# Below uvicorn's 5 s idle timeout, so the client never reuses a connection the server closes.
KEEPALIVE_S: Final = 2.0
DRAIN_TIMEOUT_S: Final = 15.0
# The simulators (uvicorn) close idle keep-alive connections after 5 s: after this long with
# nothing running, the gateway holds no connection a request opened.
IDLE_CLOSE_S: Final = 6.0
MAX_SAMPLES_SHOWN: Final = 5
PROMPTS: Final = (
    "Explain in one sentence why tail latency matters.",
    "List three causes of slow first tokens in LLM serving.",
    "What does a circuit breaker protect against?",
    "Summarise continuous batching for a new engineer in two sentences.",
)

# Decode at 150 tokens/s with 8-40 output tokens: streams last ~0.07-0.3 s, so ~10-15 requests
# are in flight at 50 requests/s, and a stream is many network reads, not one.
CLEAN: Final[dict[str, Any]] = {
    "prefill_base_ms": 20,
    "tokens_per_s": 150,
    "output_tokens": [8, 40],
    "embed_base_ms": 5,
    "embed_ms_per_input": 0.5,
    "embedding_dims": 64,
}
SIM_PROFILES: Final[dict[str, Any]] = {
    "default": CLEAN,
    "profiles": {
        "chat": CLEAN,
        "text": CLEAN,
        "embed": CLEAN,
        "flaky": {
            **CLEAN,
            "error_500_rate": 0.04,
            "error_429_rate": 0.02,
            "retry_after_s": 1,
            "reset_rate": 0.03,
            "inband_error_rate": 0.03,
        },
        "stall": {**CLEAN, "stall_rate": 0.08},  # stalls for an hour unless the gateway closes it
        "cut": {**CLEAN, "cut_rate": 0.30},
    },
}

Wire = Literal["chat", "completion", "embedding", "messages"]
Fault = Literal["none", "cut", "disconnect", "abandon"]


@dataclass(frozen=True, slots=True)
class Kind:
    """One kind of request in the mix."""

    name: str
    weight: int  # share of the load, in percent
    wire: Wire
    model: str
    stream: bool = False
    bulk: bool = False
    fault: Fault = "none"  # the expected outcome besides a complete answer, if any

    @property
    def path(self) -> str:
        return {
            "chat": "/v1/chat/completions",
            "completion": "/v1/completions",
            "embedding": "/v1/embeddings",
            "messages": "/v1/messages",
        }[self.wire]


MIX: Final = (
    Kind("chat stream", 22, "chat", "chat", stream=True),
    Kind("chat", 12, "chat", "chat"),
    Kind("completion", 6, "completion", "text"),
    Kind("completion stream", 4, "completion", "text", stream=True),
    Kind("embeddings", 8, "embedding", "embed"),
    Kind("messages stream", 6, "messages", "chat", stream=True),
    Kind("messages", 4, "messages", "chat"),
    Kind("bulk chat", 4, "chat", "chat", bulk=True),
    Kind("bulk embeddings", 6, "embedding", "embed", bulk=True),
    Kind("bulk completion", 3, "completion", "text", bulk=True),
    Kind("flaky stream", 6, "chat", "chat-flaky", stream=True),
    Kind("flaky", 4, "chat", "chat-flaky"),
    Kind("stall stream", 5, "chat", "chat-stall", stream=True),
    Kind("cut stream", 4, "chat", "chat-cut", stream=True, fault="cut"),
    Kind("disconnect stream", 4, "chat", "chat", stream=True, fault="disconnect"),
    Kind("disconnect messages", 1, "messages", "chat", stream=True, fault="disconnect"),
    Kind("abandon", 1, "chat", "chat", fault="abandon"),
)
EXPECTED: Final = ("ok", "cut", "disconnected", "abandoned")


# --- processes -----------------------------------------------------------------------------------


def start_sim(
    stack: Stack, name: str, port: int, seed: int, profiles: Path
) -> subprocess.Popen[bytes]:
    command = [str(VENV_BIN / "tailguard"), "sim", "--port", str(port), "--seed", str(seed)]
    command += ["--profile", str(profiles)]
    return stack.start_ready("upstream", command, f"{name}.log", f"http://127.0.0.1:{port}/health")


def redis_answers(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5) as s:
        s.sendall(b"PING\r\n")
        return s.recv(16).startswith(b"+PONG")
    return False


@dataclass(slots=True)
class RedisTarget:
    url: str
    shared_db: int | None = None  # a borrowed database of the local Redis: keys deleted after


def start_redis(stack: Stack) -> RedisTarget:
    """A throwaway redis-server; else an empty database of the local Redis (6379)."""
    binary = shutil.which("redis-server")
    if binary is not None:
        port = free_port()
        command = [binary, "--port", str(port), "--bind", "127.0.0.1"]
        stack.start("upstream", [*command, "--save", "", "--appendonly", "no"], "redis.log")
        deadline = time.monotonic() + 10
        while not redis_answers(port):
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)
        return RedisTarget(f"redis://127.0.0.1:{port}/0")
    if not redis_answers(6379):
        raise RuntimeError("no redis-server binary and no Redis at 127.0.0.1:6379")
    for db in range(15, 0, -1):  # the high ones are the least likely to be in use
        with redis.Redis(port=6379, db=db) as client:
            if client.dbsize() == 0:
                return RedisTarget(f"redis://127.0.0.1:6379/{db}", shared_db=db)
    raise RuntimeError("the local Redis has no empty database to borrow")


def release_redis(target: RedisTarget) -> None:
    if target.shared_db is None:
        return
    with redis.Redis(port=6379, db=target.shared_db) as client:
        keys = [*client.scan_iter(match="tg:lat:*", count=1000)]
        keys += client.scan_iter(match="tg:rl:*", count=1000)
        if keys:
            client.delete(*keys)


def gateway_config(port: int, ports: dict[str, int], redis_url: str) -> dict[str, Any]:
    """Clean models on both upstreams, fault models on `a` falling back to `chat`."""
    batching = {"max_batch_size": 32, "max_wait_ms": 10, "max_inflight": 4, "max_queue": 4096}

    def both(model: str) -> list[dict[str, Any]]:
        return [{"provider": "up-a", "model": model}, {"provider": "up-b", "model": model}]

    return {
        "server": {"host": "127.0.0.1", "port": port, "reload_on_change": False},
        "latency": {"store": "redis", "redis_url": redis_url},
        "providers": {
            "up-a": {"type": "openai", "base_url": f"http://127.0.0.1:{ports['up-a']}/v1"},
            "up-b": {"type": "vllm", "base_url": f"http://127.0.0.1:{ports['up-b']}/v1"},
        },
        "models": [
            {"name": "chat", "deployments": both("chat")},
            {"name": "text", "deployments": both("text"), "batching": batching},
            {"name": "embed", "deployments": both("embed"), "batching": batching},
            {
                "name": "chat-flaky",
                "deployments": [{"provider": "up-a", "model": "flaky"}],
                "fallbacks": ["chat"],
            },
            {
                "name": "chat-stall",
                "deployments": [{"provider": "up-a", "model": "stall"}],
                "budget": {"ttft_ms": 600, "total_ms": 20_000},
                "on_ttft_miss": "hedge",
                "hedge_max_fraction": 0.15,
                "fallbacks": ["chat"],
            },
            {
                "name": "chat-cut",
                "deployments": [{"provider": "up-a", "model": "cut"}],
                "fallbacks": ["chat"],  # while its breaker is open, `chat` serves
            },
        ],
        # The soak checks that the faults are failed over and leave nothing behind, so the
        # retry budget must never be what answers a fault (it would at a burst of faults).
        "routing": {"retry_budget": {"percent": 100, "min_concurrent": 100}},
        # Every request authenticates and is charged to rpm/tpm buckets in the same Redis (one
        # round trip each), with limits far above the load: the soak covers that path too.
        "auth": {
            "keys": [{"name": "soak", "sha256": hash_key(SOAK_KEY), "rpm": 1_000_000, "tpm": 10**9}]
        },
    }


# --- the client ----------------------------------------------------------------------------------


@dataclass(slots=True)
class Outcome:
    """One client request, as the client saw it."""

    kind: str
    request_id: str
    sent_s: float  # from the start of the load
    verdict: str = "unexpected"  # ok | cut | disconnected | abandoned | unexpected
    status: int = 0
    attempts: int | None = None
    route: str | None = None
    latency_s: float | None = None
    detail: str | None = None


def request_body(kind: Kind, rng: random.Random) -> tuple[bytes, int]:
    """The body of one request, and how many embeddings it asks for (0 for the others)."""
    prompt = rng.choice(PROMPTS)
    if kind.wire == "embedding":
        inputs = [f"{rng.choice(PROMPTS)} #{rng.randrange(1000)}" for _ in range(rng.randint(1, 4))]
        return orjson.dumps({"model": kind.model, "input": inputs}), len(inputs)
    body: dict[str, Any] = {"model": kind.model, "max_tokens": 64}
    if kind.wire == "completion":
        body["prompt"] = prompt
    else:
        body["messages"] = [{"role": "user", "content": prompt}]
    if kind.stream:
        body["stream"] = True
    return orjson.dumps(body), 0


def check_body(kind: Kind, body: bytes, inputs: int) -> str | None:
    """None when a non-streaming answer is complete and well formed, else what is wrong."""
    try:
        obj = orjson.loads(body)
        if kind.wire == "embedding":
            data = obj["data"]
            if len(data) != inputs or not all(item["embedding"] for item in data):
                return f"{len(data)} embeddings for {inputs} inputs"
        elif kind.wire == "messages":
            if obj["type"] != "message" or not obj["content"][0]["text"]:
                return "no text in the message"
        elif kind.wire == "completion":
            if not obj["choices"][0]["text"]:
                return "empty completion"
        elif not obj["choices"][0]["message"]["content"]:
            return "empty message content"
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
        return f"bad body ({type(exc).__name__}): {body[:160]!r}"
    return None


async def one_request(
    session: aiohttp.ClientSession, url: str, kind: Kind, outcome: Outcome, rng: random.Random
) -> None:
    body, inputs = request_body(kind, rng)
    headers = {
        "content-type": "application/json",
        "x-request-id": outcome.request_id,
        "authorization": f"Bearer {SOAK_KEY}",
    }
    if kind.bulk:
        headers["x-tailguard-priority"] = "bulk"
    if kind.wire == "messages":
        headers["anthropic-version"] = "2023-06-01"
    started = time.perf_counter()
    events = StreamReader()
    try:
        async with (
            asyncio.timeout(ABANDON_AFTER_S if kind.fault == "abandon" else None),
            session.post(url + kind.path, data=body, headers=headers) as response,
        ):
            outcome.status = response.status
            outcome.route = response.headers.get("x-tailguard-route")
            with contextlib.suppress(ValueError):
                outcome.attempts = int(response.headers.get("x-tailguard-attempts", ""))
            if response.status != 200:
                text = await response.read()
                outcome.detail = f"status {response.status}: {text[:200]!r}"
                return
            if not kind.stream:
                outcome.detail = check_body(kind, await response.read(), inputs)
            else:
                async for data in response.content.iter_any():
                    events.feed(data, time.perf_counter())
                    if kind.fault == "disconnect" and events.content and not events.done:
                        response.close()  # the client leaves mid-stream
                        outcome.verdict = "disconnected"
                        return
                outcome.detail = stream_problem(kind, events)
                if outcome.detail is None and events.error is not None:
                    outcome.verdict = "cut"
                    return
            if outcome.detail is None:
                outcome.verdict = "ok"
                outcome.latency_s = time.perf_counter() - started
    except TimeoutError:
        if kind.fault == "abandon":
            outcome.verdict = "abandoned"  # the session closes the connection it was using
        else:
            outcome.detail = "TimeoutError"
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        outcome.detail = f"{type(exc).__name__}: {exc}"


def stream_problem(kind: Kind, events: StreamReader) -> str | None:
    """None when a stream ended as it may: complete, or (`chat-cut`) cut after content."""
    if events.error is not None:
        if kind.fault == "cut" and events.content and events.error_code == "upstream_stream_error":
            return None
        return events.error
    if not events.content:
        return "no content in the stream"
    if not events.done:
        return "stream ended without its end marker"
    return None


# --- resources -----------------------------------------------------------------------------------


@dataclass(slots=True)
class Sample:
    t_s: float  # from the start of the load
    rss_bytes: int
    fds: int
    tasks: float | None  # tailguard_event_loop_tasks (None: the scrape failed)
    inflight: int  # client requests not yet answered, when the sample was taken
    # The same two from the gateway's own /metrics (process_*), as a cross-check.
    metrics_rss_bytes: float | None = None
    metrics_fds: float | None = None


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as file:
        for line in file:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"no VmRSS for pid {pid}")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Every sample of an exposition, labels folded: name -> sum over its series."""
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as response:
        text = await response.text()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


_LISTEN: Final = "0A"  # TCP states in /proc/net/tcp
_CLOSE_WAIT: Final = "08"


def tcp_sockets() -> dict[int, tuple[int, str]]:
    """inode -> (local port, state) of every TCP socket of this network namespace."""
    table: dict[int, tuple[int, str]] = {}
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(path, encoding="ascii") as file:
            next(file)  # the header
            for line in file:
                fields = line.split()
                table[int(fields[9])] = (int(fields[1].rsplit(":", 1)[1], 16), fields[3])
    return table


@dataclass(slots=True)
class AtRest:
    """The gateway with no request running: its tasks, and its descriptors by kind."""

    tasks: float
    clients: int  # connections accepted from clients
    half_closed: int  # closed by the peer, never by the gateway (CLOSE_WAIT)
    outbound: int  # connections to the upstreams and Redis (pooled)
    other: int  # the listening socket, files, pipes, the event loop's own


def descriptors(pid: int, port: int, tasks: float) -> AtRest:
    sockets = tcp_sockets()
    rest = AtRest(tasks, 0, 0, 0, 0)
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed since the listing
        local, state = 0, _LISTEN  # not a TCP socket: counted with the others
        if target.startswith("socket:["):
            local, state = sockets.get(int(target[8:-1]), (local, state))
        if state == _CLOSE_WAIT:
            rest.half_closed += 1
        elif state == _LISTEN:
            rest.other += 1  # also unix sockets: absent from the TCP tables
        elif local == port:
            rest.clients += 1
        else:
            rest.outbound += 1
    return rest


async def at_rest(url: str, pid: int, port: int) -> AtRest:
    """The least of a few readings of each kind, since a periodic job (latency flush or
    refresh, the vLLM scrape) may hold a task or a connection at any one of them. Each scrape
    has a connection of its own, closed before the descriptors are listed."""
    readings = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        for _ in range(5):
            tasks = (await scrape(session, url))["tailguard_event_loop_tasks"]
            await asyncio.sleep(0.2)  # for the gateway to close its side of that connection
            readings.append(descriptors(pid, port, tasks))
    return AtRest(
        *(min(getattr(r, name) for r in readings) for name in AtRest.__dataclass_fields__)
    )


# --- the run -------------------------------------------------------------------------------------


@dataclass(slots=True)
class Options:
    duration_s: float
    rps: float
    seed: int
    json_path: Path
    keep_logs: bool

    @property
    def warmup_s(self) -> float:
        return max(MIN_WARMUP_S, WARMUP_SHARE * self.duration_s)

    @property
    def window_s(self) -> float:
        return max(MIN_WINDOW_S, WINDOW_SHARE * self.duration_s)

    @property
    def interval_s(self) -> float:
        return min(5.0, max(1.0, self.duration_s / 120))


@dataclass(slots=True)
class Run:
    outcomes: list[Outcome] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    idle: AtRest = field(default_factory=lambda: AtRest(0.0, 0, 0, 0, 0))  # before the load
    rest: AtRest = field(default_factory=lambda: AtRest(0.0, 0, 0, 0, 0))  # after, drained
    rest_inflight: dict[str, float] = field(default_factory=dict)
    drain_s: float = 0.0
    wall_s: float = 0.0
    late_p99_ms: float = 0.0  # how late the client started requests


def schedule(opts: Options) -> list[tuple[float, Kind]]:
    rng = random.Random(opts.seed)
    weights = [kind.weight for kind in MIX]
    arrivals: list[tuple[float, Kind]] = []
    t = rng.expovariate(opts.rps)
    while t < opts.duration_s:
        arrivals.append((t, rng.choices(MIX, weights)[0]))
        t += rng.expovariate(opts.rps)
    return arrivals


async def drive(opts: Options, gateway: str, gateway_pid: int, upstreams: Sequence[str]) -> Run:
    run = Run()
    metrics_url = gateway + "/metrics"
    port = urlsplit(gateway).port
    assert port is not None
    arrivals = schedule(opts)
    rng = random.Random(opts.seed + 1)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    inflight: set[asyncio.Task[None]] = set()
    lags: list[float] = []
    async with aiohttp.ClientSession() as probe:
        run.idle = await at_rest(metrics_url, gateway_pid, port)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            t0 = time.perf_counter() + 0.05

            async def sampler() -> None:
                due = t0
                next_report = t0 + max(10.0, opts.duration_s / 20)
                while True:
                    due += opts.interval_s
                    await asyncio.sleep(max(0.0, due - time.perf_counter()))
                    try:
                        page = await scrape(probe, metrics_url)
                    except (aiohttp.ClientError, TimeoutError):
                        page = {}
                    now = time.perf_counter()
                    sample = Sample(
                        now - t0,
                        rss_bytes(gateway_pid),
                        open_fds(gateway_pid),
                        page.get("tailguard_event_loop_tasks"),
                        len(inflight),
                        page.get("process_resident_memory_bytes"),
                        page.get("process_open_fds"),
                    )
                    run.samples.append(sample)
                    if now >= next_report:
                        next_report += max(10.0, opts.duration_s / 20)
                        report_progress(run, sample)

            sampling = asyncio.create_task(sampler())
            try:
                for index, (offset, kind) in enumerate(arrivals):
                    due = t0 + offset
                    if (delay := due - time.perf_counter()) > 0:
                        await asyncio.sleep(delay)
                    lags.append(time.perf_counter() - due)
                    outcome = Outcome(kind.name, f"soak-{index:07d}", offset)
                    run.outcomes.append(outcome)
                    task = asyncio.create_task(one_request(session, gateway, kind, outcome, rng))
                    inflight.add(task)
                    task.add_done_callback(inflight.discard)
                if (rest := t0 + opts.duration_s - time.perf_counter()) > 0:
                    await asyncio.sleep(rest)  # the last window runs to the end of the load
            finally:
                sampling.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sampling
            if inflight:
                await asyncio.wait(inflight)
            run.wall_s = time.perf_counter() - t0
        drained = time.perf_counter()
        run.rest_inflight = await drain(probe, metrics_url, upstreams)
        run.drain_s = time.perf_counter() - drained
        await asyncio.sleep(IDLE_CLOSE_S)
        run.rest = await at_rest(metrics_url, gateway_pid, port)
    lag = _percentiles_ms(lags, quantiles=(("p99", 0.99),))["p99"]
    run.late_p99_ms = max(0.0, lag or 0.0)
    return run


async def drain(
    session: aiohttp.ClientSession, metrics_url: str, upstreams: Sequence[str]
) -> dict[str, float]:
    """Wait until nothing is in flight: upstream attempts at the gateway (its snapshot lags by
    up to a second), and running or waiting sequences at each upstream. Returns what is left."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while True:
        left = {
            "gateway upstream attempts": (await scrape(session, metrics_url)).get(
                "tailguard_upstream_inflight", 0.0
            )
        }
        for name, url in zip(("up-a", "up-b"), upstreams, strict=True):
            page = await scrape(session, url + "/metrics")
            left[f"{name} sequences"] = page.get("vllm:num_requests_running", 0.0) + page.get(
                "vllm:num_requests_waiting", 0.0
            )
        if not any(left.values()) or time.monotonic() > deadline:
            return left
        await asyncio.sleep(0.25)


def report_progress(run: Run, sample: Sample) -> None:
    unexpected = sum(o.verdict == "unexpected" and o.detail is not None for o in run.outcomes)
    tasks = "-" if sample.tasks is None else f"{sample.tasks:.0f}"
    print(
        f"  {sample.t_s:5.0f} s: {len(run.outcomes)} sent, {unexpected} unexpected, "
        f"RSS {sample.rss_bytes / 2**20:.1f} MiB, {sample.fds} fds, {tasks} tasks, "
        f"{sample.inflight} in flight",
        flush=True,
    )


# --- verdicts ------------------------------------------------------------------------------------


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def spread(values: Sequence[float]) -> float:
    """p90 - p10 (nearest rank): how far the samples of one window wander."""
    if not values:
        return 0.0
    ordered = sorted(values)
    n = len(ordered)
    return ordered[nearest_rank(0.9, n) - 1] - ordered[nearest_rank(0.1, n) - 1]


def growth_allowance(before: Sequence[float], after: Sequence[float]) -> float:
    """How far the end median may sit above the post-warm-up one without counting as growth.

    Descriptors (client and upstream connections) and tasks (one or more per request) rise and
    fall with the requests in flight, which wander with the Poisson arrivals. The spread of
    the two windows' samples (p90 - p10, the larger) measures that wander on this run; medians
    move far less than single samples, so a shift in the median beyond a whole spread is not
    in-flight noise. A leak of one per thousand requests exceeds it in a 10-minute run; the
    back-to-idle checks catch smaller ones.
    """
    return max(float(MIN_ALLOWANCE), spread(before), spread(after))


def windows(run: Run, opts: Options) -> tuple[list[Sample], list[Sample]]:
    start, end = opts.warmup_s, opts.duration_s
    before = [s for s in run.samples if start <= s.t_s < start + opts.window_s]
    after = [s for s in run.samples if end - opts.window_s <= s.t_s <= end + opts.interval_s]
    return before, after


def resource_checks(run: Run, opts: Options) -> list[dict[str, Any]]:
    before, after = windows(run, opts)
    checks: list[dict[str, Any]] = []
    if len(before) < 3 or len(after) < 3:
        checks.append(
            {"check": "enough resource samples", "pass": False, "value": [len(before), len(after)]}
        )
        return checks
    rss0 = median([s.rss_bytes for s in before])
    rss1 = median([s.rss_bytes for s in after])
    growth = rss1 / rss0 - 1.0
    checks.append(
        {
            "check": "RSS growth after warm-up",
            "before": rss0,
            "after": rss1,
            "growth": growth,
            "limit": RSS_GROWTH_LIMIT,
            "pass": growth < RSS_GROWTH_LIMIT,
        }
    )
    series: dict[str, tuple[list[float], list[float]]] = {
        "open descriptors": ([s.fds for s in before], [s.fds for s in after]),
        "event-loop tasks": (
            [s.tasks for s in before if s.tasks is not None],
            [s.tasks for s in after if s.tasks is not None],
        ),
    }
    for name, (b, a) in series.items():
        allowed = growth_allowance(b, a)
        grew = median(a) - median(b)
        checks.append(
            {
                "check": f"{name}: no growth",
                "before": median(b),
                "after": median(a),
                "growth": grew,
                "limit": allowed,
                "pass": len(b) >= 3 and len(a) >= 3 and grew <= allowed,
            }
        )
    left = {name: value for name, value in run.rest_inflight.items() if value}
    checks.append(
        {
            "check": "nothing in flight after the load",
            "value": run.rest_inflight,
            "pass": not left,
        }
    )
    # With no request running, the gateway holds what it held before the load, give or take
    # its pooled keep-alive connections: a leaked task or descriptor stays and shows here.
    idle, rest = run.idle, run.rest
    for name, was, now in (
        ("event-loop tasks back to idle", idle.tasks, rest.tasks),
        ("other descriptors back to idle", float(idle.other), float(rest.other)),
    ):
        checks.append(
            {
                "check": name,
                "before": was,
                "after": now,
                "growth": now - was,
                "limit": float(MIN_ALLOWANCE),
                "pass": now - was <= MIN_ALLOWANCE,
            }
        )
    checks.append(
        {
            "check": "no connection left behind",
            "value": {"client connections": rest.clients, "half-closed sockets": rest.half_closed},
            "pass": rest.clients == 0 and rest.half_closed == 0,
        }
    )
    return checks


def summarize(run: Run, opts: Options) -> dict[str, Any]:
    by_kind: dict[str, dict[str, Any]] = {}
    for kind in MIX:
        mine = [o for o in run.outcomes if o.kind == kind.name]
        verdicts = Counter(o.verdict for o in mine)
        ok = [o for o in mine if o.verdict == "ok"]
        by_kind[kind.name] = {
            "requests": len(mine),
            "verdicts": dict(verdicts),
            "failed_over": sum(
                (o.attempts or 1) > 1 or o.route not in (None, "primary") for o in ok
            ),
            "latency_ms": _percentiles_ms([o.latency_s for o in ok if o.latency_s is not None]),
        }
    unexpected = [o for o in run.outcomes if o.verdict not in EXPECTED or o.detail is not None]
    problems = Counter(f"{o.kind}: {problem_class(o.detail)}" for o in unexpected)
    before, after = windows(run, opts)
    return {
        "requests": len(run.outcomes),
        "rps": len(run.outcomes) / opts.duration_s,
        "verdicts": dict(Counter(o.verdict for o in run.outcomes)),
        "by_kind": by_kind,
        "unexpected": len(unexpected),
        "unexpected_classes": dict(problems.most_common()),
        "unexpected_samples": [asdict(o) for o in unexpected[:MAX_SAMPLES_SHOWN]],
        "checks": resource_checks(run, opts),
        "windows_s": {
            "warmup": opts.warmup_s,
            "before": [opts.warmup_s, opts.warmup_s + opts.window_s],
            "after": [opts.duration_s - opts.window_s, opts.duration_s],
            "samples": [len(before), len(after)],
        },
        "samples": [asdict(s) for s in run.samples],
        "idle": asdict(run.idle),
        "rest": asdict(run.rest),
        "drain_s": run.drain_s,
        "wall_s": run.wall_s,
        "send_late_p99_ms": run.late_p99_ms,
    }


def problem_class(detail: str | None) -> str:
    if detail is None:
        return "no verdict"
    return detail.split(":")[0][:60]


# --- the report ----------------------------------------------------------------------------------


def mib(value: float) -> str:
    return f"{value / 2**20:.1f} MiB"


def series_line(values: Sequence[float], points: int = 11) -> str:
    """`points` evenly spaced values of a series (start to end)."""
    if not values:
        return "-"
    picks = [values[round(i * (len(values) - 1) / (points - 1))] for i in range(points)]
    return " ".join(f"{v:.1f}" for v in picks)


def report(result: dict[str, Any], opts: Options) -> bool:
    print()
    print(
        f"{opts.duration_s:g} s at {opts.rps:g} requests/s (open loop, Poisson): "
        f"{result['requests']} requests; warm-up {opts.warmup_s:g} s; windows of "
        f"{opts.window_s:g} s after it and at the end; a sample every {opts.interval_s:g} s"
    )
    print()
    print("| kind | requests | ok | failed over | expected faults | unexpected | p50 | p99 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, row in result["by_kind"].items():
        verdicts = row["verdicts"]
        expected = sum(verdicts.get(v, 0) for v in ("cut", "disconnected", "abandoned"))
        latency = row["latency_ms"]
        p50 = "-" if latency.get("p50") is None else f"{latency['p50']:.0f} ms"
        p99 = "-" if latency.get("p99") is None else f"{latency['p99']:.0f} ms"
        print(
            f"| {name} | {row['requests']} | {verdicts.get('ok', 0)} | {row['failed_over']} "
            f"| {expected} | {verdicts.get('unexpected', 0)} | {p50} | {p99} |"
        )
    verdicts = result["verdicts"]
    print(
        f"| **all** | {result['requests']} | {verdicts.get('ok', 0)} "
        f"| {sum(r['failed_over'] for r in result['by_kind'].values())} "
        f"| {sum(verdicts.get(v, 0) for v in ('cut', 'disconnected', 'abandoned'))} "
        f"| {result['unexpected']} | | |"
    )
    print(
        "\nfailed over: complete answers after more than one attempt or off the primary route; "
        "expected faults: cut = a `chat-cut` stream ended by an error event after content, "
        "disconnected / abandoned = the client left on purpose"
    )

    samples = result["samples"]
    rss = [s["rss_bytes"] / 2**20 for s in samples]
    fds = [float(s["fds"]) for s in samples]
    tasks = [float(s["tasks"]) for s in samples if s["tasks"] is not None]
    print(f"\nseries over the load ({len(samples)} samples; 11 points, start to end):")
    print(f"  RSS MiB: {series_line(rss)}  (min {min(rss):.1f}, max {max(rss):.1f})")
    print(f"  open fds: {series_line(fds)}  (min {min(fds):.0f}, max {max(fds):.0f})")
    if tasks:
        print(f"  tasks: {series_line(tasks)}  (min {min(tasks):.0f}, max {max(tasks):.0f})")

    print("\n| check | before | after | change | limit | |")
    print("|---|---:|---:|---:|---:|---|")
    for check in result["checks"]:
        verdict = "PASS" if check["pass"] else "**FAIL**"
        name = check["check"]
        if name.startswith("RSS"):
            print(
                f"| {name} | {mib(check['before'])} | {mib(check['after'])} "
                f"| {check['growth']:+.1%} | < {check['limit']:.0%} | {verdict} |"
            )
        elif "before" in check:
            print(
                f"| {name} | {check['before']:.0f} | {check['after']:.0f} "
                f"| {check['growth']:+.0f} | <= {check['limit']:.0f} | {verdict} |"
            )
        else:
            value = check.get("value")
            shown = (
                ", ".join(f"{k} {v:.0f}" for k, v in value.items())
                if isinstance(value, dict)
                else str(value)
            )
            print(f"| {name} | | {shown} | | | {verdict} |")
    print(
        f"| unexpected outcomes | | {result['unexpected']} | | 0 "
        f"| {'PASS' if not result['unexpected'] else '**FAIL**'} |"
    )
    print(
        "\nno growth: medians of the window after the warm-up (before) and of the last one "
        "(after); the limit is the in-flight jitter (p90 - p10 of a window's samples, the "
        f"larger, at least {MIN_ALLOWANCE}). back to idle: before the load vs {IDLE_CLOSE_S:g} s "
        f"after it ended and nothing was left in flight (which took {result['drain_s']:.1f} s)."
    )
    idle, rest = result["idle"], result["rest"]
    print(
        f"pooled connections to the upstreams and Redis at rest: {idle['outbound']} before the "
        f"load, {rest['outbound']} after (not judged: the pools bound them)"
    )
    crossed = [s for s in samples if s["metrics_rss_bytes"] and s["metrics_fds"] is not None]
    if crossed:
        rss_off = max(abs(s["metrics_rss_bytes"] / s["rss_bytes"] - 1) for s in crossed)
        fds_off = max(abs(s["metrics_fds"] - s["fds"]) for s in crossed)
        print(
            f"/metrics vs /proc over {len(crossed)} samples: process_resident_memory_bytes "
            f"within {rss_off:.1%}, process_open_fds within {fds_off:.0f}"
        )
    if result["unexpected"]:
        print("\nunexpected outcomes by class:")
        for name, count in result["unexpected_classes"].items():
            print(f"  {count:6d}  {name}")
        print("samples:")
        for sample in result["unexpected_samples"]:
            print(
                f"  {sample['request_id']} {sample['kind']} at {sample['sent_s']:.1f} s: "
                f"status {sample['status']}, attempts {sample['attempts']}, "
                f"route {sample['route']}: {sample['detail']}"
            )
    if result["send_late_p99_ms"] > 50:
        print(
            f"warning: the client started requests late (p99 {result['send_late_p99_ms']:.0f} ms)"
        )
    passed = not result["unexpected"] and all(check["pass"] for check in result["checks"])
    print(f"\nsoak: {'PASS' if passed else 'FAIL'}")
    return passed


# --- entry point ---------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> Options:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load (600)")
    parser.add_argument("--rps", type=float, default=50.0, help="mean arrival rate (50)")
    parser.add_argument("--seed", type=int, default=1, help="arrivals, kinds and upstream draws")
    parser.add_argument(
        "--json", type=Path, default=None, help="results file (bench/results/soak-<time>.json)"
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the configs and logs")
    args = parser.parse_args(argv)
    if args.rps <= 0:
        parser.error("--rps must be > 0")
    # The two windows must not overlap: warm-up, then two windows, fit in the run.
    if args.duration < MIN_WARMUP_S + 2 * MIN_WINDOW_S:
        parser.error(f"--duration must be at least {MIN_WARMUP_S + 2 * MIN_WINDOW_S:g} s")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Options(
        duration_s=args.duration,
        rps=args.rps,
        seed=args.seed,
        json_path=args.json or RESULTS_DIR / f"soak-{stamp}.json",
        keep_logs=args.keep_logs,
    )


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    pin, warning = pin_client()
    logs = Path(tempfile.mkdtemp(prefix="tailguard-soak-"))
    stack = Stack(logs=logs, pin=pin, cwd=ROOT)
    target: RedisTarget | None = None
    try:
        with sigterm_as_interrupt():
            try:
                target = start_redis(stack)
                ports = {"up-a": free_port(), "up-b": free_port(), "gateway": free_port()}
                profiles = logs / "sim-profiles.yaml"
                profiles.write_text(json.dumps(SIM_PROFILES, indent=2) + "\n")  # JSON is YAML
                start_sim(stack, "up-a", ports["up-a"], opts.seed, profiles)
                start_sim(stack, "up-b", ports["up-b"], opts.seed + 1, profiles)
                config = gateway_config(ports["gateway"], ports, target.url)
                _, gateway = start_gateway(stack, config, ports["gateway"])
                upstreams = [f"http://127.0.0.1:{ports[name]}" for name in ("up-a", "up-b")]
                print(
                    f"soak: {opts.duration_s:g} s at {opts.rps:g} requests/s "
                    f"(warm-up {opts.warmup_s:g} s) ...",
                    flush=True,
                )
                run = run_async(
                    drive(opts, f"http://127.0.0.1:{ports['gateway']}", gateway.pid, upstreams)
                )
                if gateway.poll() is not None:
                    raise RuntimeError(f"the gateway exited ({gateway.returncode})")
            finally:
                stack.stop()
                if target is not None:
                    release_redis(target)
    except (
        KeyboardInterrupt,
        RuntimeError,
        OSError,
        KeyError,  # /metrics without tailguard_event_loop_tasks
        aiohttp.ClientError,
        redis.RedisError,
    ) as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        print(f"logs kept in {logs}", file=sys.stderr)
        return 2
    result = summarize(run, opts)
    passed = report(result, opts)
    document = {
        "benchmark": "soak",
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "options": {
            "duration_s": opts.duration_s,
            "rps": opts.rps,
            "seed": opts.seed,
            "warmup_s": opts.warmup_s,
            "window_s": opts.window_s,
            "interval_s": opts.interval_s,
            "pinned": warning is None,
            "redis": "throwaway" if target is None or target.shared_db is None else "local",
        },
        "mix": [asdict(kind) for kind in MIX],
        "profiles": SIM_PROFILES,
        "config": config,
        "environment": environment(),
        "result": result,
        "pass": passed,
    }
    write_results(opts.json_path, document, logs, opts.keep_logs or not passed)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())

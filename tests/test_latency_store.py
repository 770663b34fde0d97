"""Windowed latency stores: the in-process one, and the Redis one shared by replicas."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from redis.asyncio import Redis

from gateway.latency import (
    TTFT_DEADLINE,
    LatencyStore,
    MemoryLatencyStore,
    RedisLatencyStore,
    Sample,
    Sketch,
    Snapshot,
    TargetStats,
    connect_redis,
    run_store,
)


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def ok(deployment: str = "d1", model: str = "m", *, ttft_ms: float = 100.0) -> Sample:
    return Sample(
        deployment=deployment,
        model=model,
        ok=True,
        total_s=ttft_ms * 3 / 1000,
        ttft_s=ttft_ms / 1000,
        tpot_s=0.02,
    )


def failed(deployment: str = "d1", model: str = "m", *, error: str = "upstream_5xx") -> Sample:
    return Sample(deployment=deployment, model=model, ok=False, total_s=0.05, error=error)


def stats(store: MemoryLatencyStore, deployment: str = "d1") -> TargetStats:
    return store.local_snapshot().deployments[deployment]


# --- memory store ------------------------------------------------------------------------------


def test_samples_older_than_the_window_stop_counting() -> None:
    """A sample counts for at most window_s, and for at least window_s - slice_s."""
    clock = Clock(1_000_000.0)  # a slice boundary
    store = MemoryLatencyStore(window_s=60, slice_s=5, clock=clock)
    store.record(ok(ttft_ms=100))
    clock.now += 30
    store.record(ok(ttft_ms=400))
    assert stats(store).ttft.count == 2
    clock.now += 25  # 55 s after the first sample
    assert stats(store).ttft.count == 2
    clock.now += 5  # 60 s: the first slice has left the window
    assert stats(store).ttft.count == 1
    assert stats(store).ttft.p50 == pytest.approx(400, rel=0.02)
    clock.now += 60
    gone = stats(store)
    assert (gone.ttft.count, gone.requests, gone.ttft.p99) == (0, 0, None)


def test_errors_are_counted_not_timed() -> None:
    """A failed attempt adds to errors and requests but to no latency metric."""
    store = MemoryLatencyStore(clock=Clock())
    store.record(ok())
    store.record(failed())
    store.record(failed())
    d1 = stats(store)
    assert (d1.requests, d1.errors) == (3, 2)
    assert (d1.ttft.count, d1.tpot.count, d1.total.count) == (1, 1, 1)


def test_a_ttft_deadline_miss_is_a_censored_ttft_sample() -> None:
    """A deadline miss is an error that adds its time-to-deadline to TTFT: a stall looks slow."""
    store = MemoryLatencyStore(min_samples=1, clock=Clock())
    store.record(ok(ttft_ms=100))
    store.record(failed(error=TTFT_DEADLINE))  # total_s=0.05 is the deadline
    store.record(Sample("d1", "m", ok=False, total_s=2.0, error=TTFT_DEADLINE))
    d1 = stats(store)
    assert (d1.requests, d1.errors, d1.ttft.count, d1.total.count) == (3, 2, 3, 1)
    assert d1.ttft.p99 == pytest.approx(2000, rel=0.02)


def test_trust_needs_min_samples() -> None:
    """A metric is trusted once it has min_samples samples in the window."""
    store = MemoryLatencyStore(min_samples=3, clock=Clock())
    store.record(ok())
    store.record(ok())
    assert not stats(store).ttft.trusted
    assert not stats(store).trusted
    store.record(ok())
    assert stats(store).ttft.trusted
    assert stats(store).trusted


def test_models_aggregate_their_deployments() -> None:
    """Per-model numbers merge every deployment that served the model name."""
    store = MemoryLatencyStore(clock=Clock())
    for _ in range(10):
        store.record(ok("fast", "chat", ttft_ms=50))
    for _ in range(10):
        store.record(ok("slow", "chat", ttft_ms=900))
    store.record(failed("slow", "chat"))
    store.record(ok("other", "embed", ttft_ms=10))
    snapshot = store.local_snapshot()
    assert set(snapshot.deployments) == {"fast", "slow", "other"}
    assert set(snapshot.models) == {"chat", "embed"}
    chat = snapshot.models["chat"]
    assert (chat.requests, chat.errors, chat.ttft.count) == (21, 1, 20)
    assert chat.ttft.p50 == pytest.approx(50, rel=0.02)
    assert chat.ttft.p90 == pytest.approx(900, rel=0.02)


def test_inflight_gauge_counts_started_minus_finished() -> None:
    """started/finished move the in-flight gauge, per deployment and (when given) per model."""
    store = MemoryLatencyStore(clock=Clock())
    store.started("d1", "m")
    store.started("d1", "m")
    store.started("d2")
    store.finished("d1", "m")
    snapshot = store.local_snapshot()
    assert snapshot.deployments["d1"].inflight == 1
    assert snapshot.deployments["d2"].inflight == 1
    assert snapshot.models["m"].inflight == 1
    store.finished("d1", "m")
    store.finished("d1", "m")  # an extra finish never goes negative
    assert "d1" not in store.local_snapshot().deployments


async def test_refresh_swaps_an_immutable_snapshot_with_the_admin_shape() -> None:
    """refresh() replaces the snapshot; as_dict() is the JSON of GET /admin/latency."""
    clock = Clock()
    store = MemoryLatencyStore(window_s=60, slice_s=5, min_samples=1, clock=clock)
    before = store.snapshot
    store.record(ok(ttft_ms=100))
    assert store.snapshot is before
    after = await store.refresh()
    assert store.snapshot is after
    assert after.source == "memory"
    with pytest.raises(TypeError):
        after.deployments["x"] = after.deployments["d1"]  # type: ignore[index]
    clock.now += 2
    body = after.as_dict(clock.now)
    d1 = body["deployments"]["d1"]
    assert body["window_s"] == 60
    assert body["age_s"] == 2.0
    assert set(body["models"]) == {"m"}
    assert d1["ttft_ms"]["count"] == 1
    assert d1["ttft_ms"]["p99"] == pytest.approx(100, rel=0.02)
    assert d1["tpot_ms"]["p50"] == pytest.approx(20, rel=0.02)
    assert d1["total_ms"]["p90"] == pytest.approx(300, rel=0.02)
    assert (d1["errors"], d1["inflight"], d1["cooldown_until"]) == (0, 0, None)


class FlakyStore(MemoryLatencyStore):
    """A memory store whose second refresh fails; it signals once a later refresh succeeded."""

    def __init__(self) -> None:
        super().__init__(clock=Clock())
        self.refreshes = 0
        self.recovered = asyncio.Event()

    async def refresh(self) -> Snapshot:
        self.refreshes += 1
        if self.refreshes == 2:
            raise RuntimeError("one bad round")
        if self.refreshes >= 3:
            self.recovered.set()
        return await super().refresh()


async def test_run_store_refreshes_in_the_background_and_stops_cleanly() -> None:
    """run_store refreshes on entry and in a loop that survives a failing round, then stops."""
    store = FlakyStore()
    store.record(ok())
    before = set(asyncio.all_tasks())
    async with asyncio.timeout(10), run_store(store, flush_every_s=0.01, refresh_every_s=0.01):
        assert store.snapshot.deployments["d1"].ttft.count == 1  # the refresh on entry
        await store.recovered.wait()
    assert set(asyncio.all_tasks()) == before


# --- Redis store --------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """A throwaway redis-server on loopback that a test can stop and start again."""

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                self.binary,
                *("--port", str(self.port), "--bind", "127.0.0.1"),
                *("--save", "", "--appendonly", "no"),  # nothing written to disk
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:  # bounded wait for the server to answer PING
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed: the Redis store tests need a real server")
    server = RedisServer(binary)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@asynccontextmanager
async def client(url: str) -> AsyncIterator[Redis]:
    redis = connect_redis(url)
    try:
        yield redis
    finally:
        await redis.aclose()


def replica(redis: Redis, clock: Clock, **kwargs: Any) -> RedisLatencyStore:
    return RedisLatencyStore(redis, window_s=60, slice_s=5, min_samples=5, clock=clock, **kwargs)


def same_numbers(shared: Snapshot, local: Snapshot) -> None:
    """Shared and local snapshots agree on every count and percentile (in-flight is local)."""
    assert set(shared.deployments) == set(local.deployments)
    assert set(shared.models) == set(local.models)
    for mine, theirs in ((shared.deployments, local.deployments), (shared.models, local.models)):
        for name, stats_ in mine.items():
            other = theirs[name]
            assert (stats_.ttft, stats_.tpot, stats_.total) == (other.ttft, other.tpot, other.total)
            assert (stats_.requests, stats_.errors) == (other.requests, other.errors)


async def test_a_replica_sees_what_another_flushed(redis_server: RedisServer) -> None:
    """Samples recorded only in replica A reach replica B through Redis with identical numbers."""
    clock = Clock()
    async with client(redis_server.url) as ra, client(redis_server.url) as rb:
        a, b = replica(ra, clock), replica(rb, clock)
        for i in range(200):
            a.record(ok("d1", "chat", ttft_ms=50 + i * 5))
            a.record(ok("d2", "chat", ttft_ms=300))
        a.record(failed("d1", "chat"))
        a.record(Sample("d2", "chat", ok=False, total_s=1.5, error=TTFT_DEADLINE))
        clock.now += 7  # into the next slice: the window spans two slices
        a.record(ok("d1", "chat", ttft_ms=80))
        await a.flush()
        assert a.pending_fields == 0
        shared = await b.refresh()
        assert (shared.source, b.state, a.state) == ("redis", "ok", "ok")
        assert shared.deployments["d1"].requests == 202
        assert shared.deployments["d2"].ttft.count == 201
        assert shared.models["chat"].errors == 2
        same_numbers(shared, a.local_snapshot())


async def test_flush_batches_one_hincrby_per_touched_field(redis_server: RedisServer) -> None:
    """1,000 samples of one deployment cost one HINCRBY per touched field, in one flush."""
    clock = Clock()
    async with client(redis_server.url) as redis:
        store = replica(redis, clock)
        for i in range(1000):
            store.record(ok("d1", "chat", ttft_ms=100 + (i % 200)))
        touched = store.pending_fields
        assert touched < 200  # ~20 TTFT buckets, ~30 total buckets, 1 TPOT, 1 counter; x2 tags
        await redis.config_resetstat()
        await store.flush()
        commands = await redis.info("commandstats")
        assert commands["cmdstat_hincrby"]["calls"] == touched
        assert commands["cmdstat_expire"]["calls"] == 2 * (3 + 1) + 1  # 2 tags x 4 keys + index
        shared = await store.refresh()
        assert shared.deployments["d1"].requests == 1000


async def test_redis_down_falls_back_fast_and_recovers(redis_server: RedisServer) -> None:
    """With Redis killed, flush/refresh return at once with local numbers; after the backoff the
    store reconnects by itself and the counts kept during the outage arrive."""
    clock = Clock()
    async with client(redis_server.url) as ra, client(redis_server.url) as rb:
        a = replica(ra, clock, backoff_min_s=0.5, backoff_max_s=4.0)
        b = replica(rb, clock)
        for _ in range(20):
            a.record(ok("d1", "chat", ttft_ms=100))
        await a.flush()
        assert (await a.refresh()).source == "redis"

        redis_server.stop()
        for _ in range(30):
            a.record(ok("d1", "chat", ttft_ms=700))
        for _ in range(3):  # the first call fails fast; the next ones skip Redis (breaker open)
            async with asyncio.timeout(1.0):
                await a.flush()
            async with asyncio.timeout(1.0):
                snapshot = await a.refresh()
            clock.now += 0.1
        assert a.state == "degraded"
        assert a.last_error is not None
        assert a.flush_failures == 1
        assert snapshot.source == "local-fallback"
        assert snapshot.deployments["d1"].ttft.count == 50
        assert a.health()["state"] == "degraded"
        pending = a.pending_fields
        assert pending > 0

        redis_server.start()
        async with asyncio.timeout(1.0):
            await a.flush()  # still inside the backoff: Redis is left alone
        assert (a.state, a.pending_fields) == ("degraded", pending)
        clock.now += 4.0 * 1.2  # past the longest jittered backoff
        await a.flush()
        assert a.health()["state"] == "ok"
        assert a.last_ok_at == clock.now
        assert a.pending_fields == 0
        assert (await a.refresh()).source == "redis"
        shared = await b.refresh()  # the restarted server lost what it held before; not ours
        assert shared.deployments["d1"].ttft.count == 30
        assert shared.deployments["d1"].ttft.p50 == pytest.approx(700, rel=0.02)
        assert a.dropped_samples == 0


async def test_pending_counts_are_capped_while_redis_is_down(redis_server: RedisServer) -> None:
    """Past max_pending_fields new samples are no longer buffered for Redis, and are counted."""
    clock = Clock()
    async with client(redis_server.url) as redis:
        store = replica(redis, clock, max_pending_fields=20)
        redis_server.stop()
        for i in range(100):
            store.record(ok("d1", "chat", ttft_ms=10 + i * 10))
        assert store.pending_fields < 40  # the cap plus at most one sample's fields
        assert store.dropped_samples > 50
        async with asyncio.timeout(1.0):
            await store.flush()
        assert store.state == "degraded"
        # Local numbers still have everything.
        assert (await store.refresh()).deployments["d1"].ttft.count == 100


async def test_aclose_flushes_what_is_pending(redis_server: RedisServer) -> None:
    """aclose() makes a final flush, even while the breaker would otherwise wait."""
    clock = Clock()
    async with client(redis_server.url) as ra, client(redis_server.url) as rb:
        a, b = replica(ra, clock), replica(rb, clock)
        redis_server.stop()
        a.record(ok())
        await a.flush()
        redis_server.start()
        await a.aclose()
        assert a.state == "ok"
        assert (await b.refresh()).deployments["d1"].ttft.count == 1


async def test_run_store_flushes_on_exit(redis_server: RedisServer) -> None:
    """Leaving run_store stops the loops and flushes what is pending, whatever the period."""
    clock = Clock()
    async with client(redis_server.url) as ra, client(redis_server.url) as rb:
        a, b = replica(ra, clock), replica(rb, clock)
        store: LatencyStore = a  # the Redis store satisfies the protocol
        async with run_store(store, flush_every_s=3600, refresh_every_s=3600):
            a.record(ok())
            assert a.pending_fields > 0
        assert a.pending_fields == 0
        assert (await b.refresh()).deployments["d1"].ttft.count == 1


def test_sketch_is_reexported() -> None:
    """The sketch is reachable from the latency module, where the stores live."""
    assert Sketch().alpha == 0.02

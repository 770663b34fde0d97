"""Windowed latency stores: the in-process one, and the Redis one shared by replicas."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from redis.asyncio import Redis

from gateway.latency import (
    CANCELLED,
    HEDGE_LOST,
    TTFT_DEADLINE,
    LatencyStore,
    MemoryLatencyStore,
    RedisLatencyStore,
    Sample,
    Snapshot,
    TargetStats,
    run_store,
)
from gateway.latency.sketch import Sketch
from gateway.redis import connect_redis
from tests.conftest import RedisServer
from tests.timing import scaled


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def ok(
    deployment: str = "d1",
    model: str = "m",
    *,
    ttft_ms: float = 100.0,
    prompt_bytes: int | None = None,
) -> Sample:
    return Sample(
        deployment=deployment,
        model=model,
        ok=True,
        total_s=ttft_ms * 3 / 1000,
        ttft_s=ttft_ms / 1000,
        tpot_s=0.02,
        prompt_bytes=prompt_bytes,
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
    """A deadline miss is an error whose TTFT is known only to exceed its time-to-deadline: it
    raises the tail above the cut instead of capping it there (a stall looks slow, never fast)."""
    store = MemoryLatencyStore(min_samples=1, clock=Clock())
    store.record(ok(ttft_ms=100))
    store.record(failed(error=TTFT_DEADLINE))  # total_s=0.05 is the deadline
    store.record(Sample("d1", "m", ok=False, total_s=2.0, error=TTFT_DEADLINE))
    d1 = stats(store)
    assert (d1.requests, d1.errors, d1.ttft.count, d1.total.count) == (3, 2, 3, 1)
    assert d1.ttft.censored == 2
    # The cut at 50 ms left two at risk; one ended at 100 ms; the other is "more than 2 s".
    assert d1.ttft.p50 == pytest.approx(100, rel=0.02)
    assert d1.ttft.p99 == math.inf
    assert d1.ttft.beyond == pytest.approx(2000, rel=0.02)


def test_hedges_count_for_the_requested_model_and_losing_is_no_error() -> None:
    """A hedge counts against the model the client asked for (whose cap it spends), a lost race
    and a cancelled attempt are censored TTFT samples but no errors, and successful attempts
    give the mean output length."""
    store = MemoryLatencyStore(min_samples=1, clock=Clock())
    store.record(Sample("d1", "chat", ok=False, total_s=0.4, error=HEDGE_LOST))
    store.record(
        Sample("d2", "backup", ok=True, total_s=1.0, ttft_s=0.3, output_tokens=30, hedge_for="chat")
    )
    store.record(Sample("d2", "backup", ok=False, total_s=0.1, error=CANCELLED, hedge_for="chat"))
    store.record(Sample("d2", "backup", ok=True, total_s=1.0, ttft_s=0.3, output_tokens=10))
    snapshot = store.local_snapshot()
    chat, backup, d1 = snapshot.models["chat"], snapshot.models["backup"], stats(store)
    assert (chat.requests, chat.hedges, chat.errors) == (1, 2, 0)
    assert (backup.requests, backup.hedges, backup.errors) == (3, 0, 0)
    assert (d1.ttft.count, d1.ttft.censored) == (1, 1)
    assert d1.ttft.p99 == math.inf  # its one observation: "more than 400 ms"
    assert backup.output_tokens == 20
    d2 = snapshot.deployments["d2"]
    assert (d2.ttft.count, d2.ttft.censored) == (3, 1)
    assert d2.ttft.p99 == pytest.approx(300, rel=0.02)  # cut at 100 ms, before the others ended


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
    async with (
        asyncio.timeout(scaled(10)),
        run_store(store, flush_every_s=0.01, refresh_every_s=0.01),
    ):
        assert store.snapshot.deployments["d1"].ttft.count == 1  # the refresh on entry
        await store.recovered.wait()
    assert set(asyncio.all_tasks()) == before


# --- Redis store --------------------------------------------------------------------------------


@asynccontextmanager
async def client(url: str) -> AsyncIterator[Redis]:
    # The gateway's short timeouts, stretched on a busy machine: these tests count what the
    # store sends, and a command that waited on the CPU is not a Redis failure.
    redis = connect_redis(url, timeout_s=scaled(0.25))
    assert isinstance(redis, Redis)  # a redis:// URL: one server
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
            assert (stats_.hedges, stats_.output_tokens) == (other.hedges, other.output_tokens)


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
        a.record(Sample("d3", "alt", ok=True, total_s=0.5, output_tokens=9, hedge_for="chat"))
        clock.now += 7  # into the next slice: the window spans two slices
        a.record(ok("d1", "chat", ttft_ms=80))
        await a.flush()
        assert a.pending_fields == 0
        shared = await b.refresh()
        assert (shared.source, b.state, a.state) == ("redis", "ok", "ok")
        assert shared.deployments["d1"].requests == 202
        assert shared.deployments["d2"].ttft.count == 201
        assert shared.deployments["d2"].ttft.censored == 1  # the deadline miss, still censored
        assert shared.models["chat"].errors == 2
        assert (shared.models["chat"].hedges, shared.models["alt"].output_tokens) == (1, 9)
        same_numbers(shared, a.local_snapshot())


async def test_flush_costs_commands_per_hash_not_per_sample(redis_server: RedisServer) -> None:
    """1,000 samples of one deployment cost one HSET and one EXPIRE per touched hash, in one
    flush: Redis work grows with deployments and slices, not with requests."""
    clock = Clock()
    # The counting is read with a client of its own, patient on a busy machine: the store's
    # client keeps its short timeouts.
    admin = Redis.from_url(redis_server.url, socket_timeout=scaled(5.0))
    async with client(redis_server.url) as redis, admin:
        store = replica(redis, clock)
        for i in range(1000):
            store.record(ok("d1", "chat", ttft_ms=100 + (i % 200)))
        assert store.pending_fields == 2  # one slice of the deployment and one of the model
        await admin.config_resetstat()
        await store.flush()
        commands = await admin.info("commandstats")
        assert commands["cmdstat_hset"]["calls"] == 2
        assert commands["cmdstat_expire"]["calls"] == 2 + 1  # both hashes and the index
        assert "cmdstat_hincrby" not in commands
        await store.flush()  # nothing new: nothing sent
        assert (await admin.info("commandstats"))["cmdstat_hset"]["calls"] == 2
        shared = await store.refresh()
        assert shared.deployments["d1"].requests == 1000


async def test_repeated_flushes_never_count_twice(redis_server: RedisServer) -> None:
    """A replica rewrites its own running totals, so flushing again (or retrying) adds nothing."""
    clock = Clock()
    async with client(redis_server.url) as ra, client(redis_server.url) as rb:
        a, b = replica(ra, clock), replica(rb, clock)
        for _ in range(10):
            a.record(ok("d1", "chat", ttft_ms=100))
            await a.flush()
            await a.flush()
        assert (await b.refresh()).deployments["d1"].requests == 10


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

        redis_server.kill()
        for _ in range(30):
            a.record(ok("d1", "chat", ttft_ms=700))
        for _ in range(3):  # the first call fails fast; the next ones skip Redis (breaker open)
            async with asyncio.timeout(scaled(1.0)):
                await a.flush()
            async with asyncio.timeout(scaled(1.0)):
                snapshot = await a.refresh()
            clock.now += 0.1
        assert a.state == "degraded"
        assert a.last_error is not None
        assert a.flush_failures == 1
        assert snapshot.source == "local-fallback"
        assert snapshot.deployments["d1"].ttft.count == 50
        assert a.health()["state"] == "degraded"
        pending = a.pending_fields
        assert pending == 2  # the slice of d1 and of its model, waiting for Redis

        redis_server.start()
        async with asyncio.timeout(scaled(1.0)):
            await a.flush()  # still inside the backoff: Redis is left alone
        assert (a.state, a.pending_fields) == ("degraded", pending)
        clock.now += 4.0 * 1.2  # past the longest jittered backoff
        await a.flush()
        assert a.health()["state"] == "ok"
        assert a.last_ok_at == clock.now
        assert a.pending_fields == 0
        assert (await a.refresh()).source == "redis"
        # The restarted server came back empty; A rewrote its running totals for the slice,
        # so what it recorded before the outage is shared again too.
        shared = await b.refresh()
        assert shared.deployments["d1"].ttft.count == 50
        assert shared.deployments["d1"].ttft.p50 == pytest.approx(700, rel=0.02)
        assert a.dropped_samples == 0


async def test_slices_that_leave_the_window_unshared_are_counted(
    redis_server: RedisServer,
) -> None:
    """Samples whose slice left the window before Redis came back are counted as dropped (from
    sharing only: local numbers still had them while they were in the window)."""
    clock = Clock()
    async with client(redis_server.url) as redis:
        store = replica(redis, clock)
        redis_server.kill()
        for i in range(100):
            store.record(ok("d1", "chat", ttft_ms=10 + i * 10))
        async with asyncio.timeout(scaled(1.0)):
            await store.flush()
        assert store.state == "degraded"
        assert (await store.refresh()).deployments["d1"].ttft.count == 100
        redis_server.start()
        clock.now += 61  # a minute later the slice is out of the window
        await store.refresh()  # refreshing prunes the old slice locally: the count must survive
        await store.flush()
        state: str = store.state  # a property: mypy would keep the narrowing from above
        assert state == "ok"
        assert store.dropped_samples == 200  # each sample counted once per tag it was shared under


async def test_aclose_flushes_what_is_pending(redis_server: RedisServer) -> None:
    """aclose() makes a final flush, even while the breaker would otherwise wait."""
    clock = Clock()
    async with client(redis_server.url) as ra, client(redis_server.url) as rb:
        a, b = replica(ra, clock), replica(rb, clock)
        redis_server.kill()
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


def test_ttft_is_kept_per_prompt_size_and_fitted_against_it() -> None:
    """TTFT is also counted per prompt-size band, with the bands' mean sizes, and the admin view
    fits base + slope x size through the trusted bands: 100 ms + 10 ms per KiB here."""
    store = MemoryLatencyStore(min_samples=5, clock=Clock())
    for kib, ttft_ms in ((1, 110), (20, 300), (60, 700)):
        for _ in range(6):
            store.record(ok(ttft_ms=ttft_ms, prompt_bytes=kib * 1024))
    d1 = stats(store)
    assert sorted(d1.bands) == [0, 4, 5]
    assert d1.bands[5].mean_bytes == 60 * 1024
    assert d1.bands[4].ttft.p50 == pytest.approx(300, rel=0.02)
    model = d1.ttft_model()["p50"]
    assert model is not None
    assert model["base_ms"] == pytest.approx(100, rel=0.05)
    assert model["ms_per_kib"] == pytest.approx(10, rel=0.05)
    view = d1.as_dict()
    assert [row["prompt"] for row in view["ttft_by_prompt"]] == ["<2 KiB", "16-32 KiB", "32-64 KiB"]

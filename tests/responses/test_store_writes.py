"""The response store's writes when Redis fails: kept and tried again in order, dropped only at
a bound and then counted (in stats and `/metrics`); a replica never answers "not found" for an
id whose write may be pending elsewhere; deleting a response makes its descendants unreadable.
On a real redis-server (the failover itself, on Sentinel and Cluster: test_responses_failover)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry
from redis.asyncio import Redis

from gateway.config.specs import ResponsesSpec
from gateway.errors import StoreUnavailableError
from gateway.redis import connect_redis
from gateway.responses.ids import minted_at, new_response_id
from gateway.responses.store import (
    KEY_PREFIX,
    MAX_ATTEMPTS,
    RETRY_S,
    ResponseGoneError,
    ResponseStore,
    StoredResponse,
)
from gateway.telemetry import exposition
from gateway.telemetry.prometheus import ResponsesStoreCollector
from tests.conftest import RedisServer, free_port
from tests.responses.test_store import (  # noqa: F401 (black_hole: a fixture)
    NOW,
    Clock,
    black_hole,
    memory_store,
    redis_store,
    response,
)
from tests.timing import eventually, scaled


@pytest.fixture
async def raw(redis_server: RedisServer) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_server.url)
    try:
        yield client
    finally:
        await client.aclose()


def dead_url() -> str:
    return f"redis://127.0.0.1:{free_port()}/0"


async def until_readable(store: ResponseStore, rid: str, owner: str = "team-a") -> StoredResponse:
    """Poll another replica's store (Redis's state) until it reads `rid`; a "not found" on the
    way fails at once (it may only say "unavailable, try again")."""

    async def read() -> StoredResponse | None:
        try:
            found = await store.get(rid, owner)
        except StoreUnavailableError:
            return None
        assert found is not None, f"{rid} read as not found while its write was pending"
        return found

    return await eventually(read, within_s=30, what=f"{rid} readable")


def test_ids_say_when_they_were_made() -> None:
    """A stored response's id carries its minute of birth; an id for `store: false` does not."""
    rid = new_response_id(now=NOW)
    assert rid.startswith("resp_") and len(rid) == len("resp_") + 33
    assert minted_at(rid) == NOW
    assert minted_at(new_response_id(stored=False)) is None
    assert minted_at("resp_0123456789abcdef0123456789abcdef") is None


async def test_a_failed_write_is_tried_again_once_redis_is_back(
    redis_server: RedisServer,
) -> None:
    """Redis down: the write fails and stays queued (counted as retried, not dropped); Redis
    back: the writer itself writes it after the breaker's wait, and another replica reads it."""
    one, two = redis_store(redis_server.url), redis_store(redis_server.url)
    try:
        redis_server.kill()
        rid = new_response_id()
        stored = response(rid)
        one.put(stored)
        await one.flush()
        stats = one.stats()
        assert (stats["writes"], stats["retried_writes"], stats["dropped_writes"]) == (0, 1, 0)
        assert one.health()["pending_writes"] == 1
        redis_server.start()
        assert await until_readable(two, rid) == stored
        assert one.stats()["dropped_writes"] == 0
    finally:
        await one.aclose()
        await two.aclose()


async def test_retried_writes_keep_their_order_and_the_newest_version(
    redis_server: RedisServer, raw: Redis
) -> None:
    """A failed batch goes back to the front of the queue in its order; a version put while it
    waited replaces the failed one."""
    store = redis_store(redis_server.url)
    try:
        redis_server.kill()
        store.put(response("resp_a"))
        store.put(response("resp_b"))
        await store.flush()
        newer = response("resp_b", size=300)
        store.put(newer)
        redis_server.start()
        await store.flush()
        assert store.stats()["pending_writes"] == 0
        assert await raw.hget(KEY_PREFIX + "resp_b", "response") == newer.response
        assert await raw.exists(KEY_PREFIX + "resp_a") == 1
    finally:
        await store.aclose()


async def test_a_write_still_failing_after_the_retry_window_is_dropped_and_counted() -> None:
    """Retries are bounded: a write older than RETRY_S when it fails again is dropped, counted,
    and no longer pending."""
    clock = Clock()
    store = ResponseStore(ResponsesSpec(store="redis"), connect_redis(dead_url()), clock=clock)
    try:
        store.put(response(created_at=NOW))
        await store.flush()
        assert store.stats()["pending_writes"] == 1
        clock.now += RETRY_S + 1
        await store.flush()
        stats = store.stats()
        assert (stats["pending_writes"], stats["dropped_writes"]) == (0, 1)
    finally:
        await store.aclose()


async def test_a_write_failing_max_attempts_times_is_dropped_and_counted() -> None:
    """Retries are bounded in number too: the MAX_ATTEMPTS-th failure drops the write."""
    store = redis_store(dead_url())
    try:
        store.put(response())
        for _ in range(MAX_ATTEMPTS - 1):
            await store.flush()  # one try each, whatever the breaker says
        assert store.stats()["pending_writes"] == 1
        await store.flush()
        stats = store.stats()
        assert (stats["pending_writes"], stats["dropped_writes"]) == (0, 1)
        assert stats["retried_writes"] == MAX_ATTEMPTS - 1
    finally:
        await store.aclose()


async def test_a_pending_write_reads_as_unavailable_on_another_replica(
    redis_server: RedisServer,
) -> None:
    """Replica one cannot reach Redis, replica two can: two answers 503 `store_unavailable`
    (try again), not "not found", for one's recent id; an old or unmarked id is not found."""
    one, two = redis_store(dead_url()), redis_store(redis_server.url)
    try:
        rid = new_response_id()
        one.put(response(rid))
        await one.flush()
        assert one.stats()["pending_writes"] == 1
        with pytest.raises(StoreUnavailableError) as raised:
            await two.get(rid, "team-a")
        assert (raised.value.status, raised.value.code) == (503, "store_unavailable")
        old = new_response_id(now=time.time() - RETRY_S - 60)
        assert await two.get(old, "team-a") is None
        assert await two.get(new_response_id(stored=False), "team-a") is None
    finally:
        await one.aclose()
        await two.aclose()


async def test_drops_are_counted_in_stats_health_and_metrics(redis_server: RedisServer) -> None:
    """A write dropped (queue full) shows in stats, health and the metrics exposition."""
    store = ResponseStore(
        ResponsesSpec(store="redis"), connect_redis(redis_server.url), max_pending=1
    )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ResponsesStoreCollector(lambda: store))
    try:
        store.put(response("resp_a"))
        store.put(response("resp_b"))  # the writer has not run yet: the queue is full
        assert store.stats()["dropped_writes"] == store.health()["dropped_writes"] == 1
        text = exposition(registry).decode()
        assert 'tailguard_responses_store_writes_total{result="dropped",store="redis"} 1.0' in text
        assert 'tailguard_responses_store_pending_writes{store="redis"} 1.0' in text
        assert 'tailguard_responses_store_up{store="redis"} 1.0' in text
    finally:
        await store.aclose()


def lineage(store: ResponseStore) -> tuple[StoredResponse, StoredResponse, StoredResponse]:
    """Three turns of one conversation: r1, r2 continuing r1, r3 continuing r2."""
    r1 = response("resp_r1")
    r2 = replace(response("resp_r2"), ancestors=("resp_r1",))
    r3 = replace(response("resp_r3"), ancestors=("resp_r2", "resp_r1"))
    for stored in (r1, r2, r3):
        assert store.put(stored) is True
    return r1, r2, r3


async def test_deleting_a_response_makes_its_descendants_unreadable_in_memory() -> None:
    """Memory store: after deleting r1, r2 and r3 (which carry r1's content) read as gone,
    saying why; r1 itself is not found; another conversation is untouched."""
    store = memory_store(Clock(time.time()))
    lineage(store)
    other = response("resp_other")
    store.put(other)
    assert await store.delete("resp_r1", "team-a") is True
    assert await store.get("resp_r1", "team-a") is None
    for rid in ("resp_r2", "resp_r3"):
        with pytest.raises(ResponseGoneError) as raised:
            await store.get(rid, "team-a")
        assert "continues a response that was deleted" in raised.value.reason
    assert await store.get("resp_other", "team-a") == other
    assert await store.delete("resp_r1", "team-a") is False


async def test_deleting_a_response_makes_its_descendants_unreadable_on_every_replica(
    redis_server: RedisServer, raw: Redis
) -> None:
    """Redis store: replica two has read r3 (held in its memory); replica one deletes r1; two
    then refuses r3 and r2, and Redis keeps a tombstone for r1 with no content."""
    one, two = redis_store(redis_server.url), redis_store(redis_server.url)
    try:
        lineage(one)
        await one.flush()
        assert (await two.get("resp_r3", "team-a")) is not None
        assert await one.delete("resp_r1", "team-a") is True
        for rid in ("resp_r3", "resp_r2"):
            with pytest.raises(ResponseGoneError):
                await two.get(rid, "team-a")
        assert await two.get("resp_r1", "team-a") is None
        assert await raw.hgetall(KEY_PREFIX + "resp_r1") == {
            b"owner": b"team-a",
            b"gone": b"deleted",
        }
        assert await raw.ttl(KEY_PREFIX + "resp_r1") > 0
        assert await two.delete("resp_r1", "team-a") is False  # deleted once only
    finally:
        await one.aclose()
        await two.aclose()


async def test_warm_is_bounded_on_a_silent_redis(black_hole: str) -> None:  # noqa: F811
    """warm() gives up within its bound on a Redis that never answers (start-up goes on)."""
    store = redis_store(black_hole)
    try:
        started = time.monotonic()
        assert await store.warm(timeout_s=0.3) is False
        assert time.monotonic() - started < scaled(5.0)
        assert store.health()["state"] == "ok"  # a slow start-up does not open the breaker
    finally:
        await store.aclose()

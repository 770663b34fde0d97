"""The Responses API's store: the memory tier (LRU, TTL, owners) and Redis behind it (shared by
replicas, written off the request path, failing open on writes and loudly on reads), on a real
redis-server."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from redis.asyncio import Redis

from gateway.config import ConfigError, build_settings, load_settings
from gateway.config.specs import ResponsesSpec
from gateway.errors import StoreUnavailableError
from gateway.redis import connect_redis
from gateway.responses.store import (
    KEY_PREFIX,
    ResponseGoneError,
    ResponseStore,
    StoredResponse,
    open_response_store,
)
from gateway.runtime import Runtime
from tests.conftest import RedisServer, free_port
from tests.timing import eventually

NOW = 1_750_000_000


def response(
    rid: str = "resp_1", owner: str = "team-a", *, size: int = 100, created_at: int | None = None
) -> StoredResponse:
    """A stored response whose blobs hold `size` bytes in all."""
    body = b'{"id":"' + rid.encode() + b'","output":"' + b"x" * max(0, size - 40) + b'"}'
    items = b"[" + b" " * max(0, size - len(body) - 2) + b"]"
    return StoredResponse(
        id=rid,
        owner=owner,
        response=body,
        items=items,
        created_at=int(time.time()) if created_at is None else created_at,
    )


class Clock:
    """Unix time that moves only when told to."""

    def __init__(self, now: float = NOW) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def memory_store(clock: Clock | None = None, **spec: Any) -> ResponseStore:
    return ResponseStore(ResponsesSpec(store="memory", **spec), None, clock=clock or Clock())


def redis_store(url: str, **spec: Any) -> ResponseStore:
    """A store on the Redis at `url`, built the way the gateway builds it."""
    settings = build_settings(
        {
            "providers": {"sim": {"type": "simulated"}},
            "models": [{"name": "m", "deployments": [{"provider": "sim", "model": "m"}]}],
            "responses": {"store": "redis", "redis_url": url, **spec},
        }
    )
    return open_response_store(settings)


@pytest.fixture
async def raw(redis_server: RedisServer) -> AsyncIterator[Redis]:
    """A plain client of the test's redis-server, to look at the keys themselves."""
    client = Redis.from_url(redis_server.url)
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
def black_hole() -> Iterator[str]:
    """A Redis URL whose server accepts connections and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    try:
        yield f"redis://127.0.0.1:{sock.getsockname()[1]}/0"
    finally:
        sock.close()


# --- the memory tier -----------------------------------------------------------------------------


async def test_a_stored_response_reads_back_as_it_was_put() -> None:
    """put, then get by its owner, gives the same response and conversation bytes."""
    store = memory_store()
    stored = response(created_at=NOW)
    assert store.put(stored) is True
    assert await store.get("resp_1", "team-a") == stored
    stats = store.stats()
    assert (stats["entries"], stats["bytes"], stats["stored"]) == (1, 100, 1)
    assert store.store == "memory"


async def test_another_owner_neither_reads_nor_deletes_it() -> None:
    """Another key's response is not found, and deleting it fails and leaves it in place."""
    store = memory_store()
    store.put(response(created_at=NOW))
    assert await store.get("resp_1", "team-b") is None
    assert await store.get("resp_1", "") is None
    assert await store.delete("resp_1", "team-b") is False
    assert await store.get("resp_1", "team-a") is not None


async def test_a_deleted_response_is_gone() -> None:
    """delete by its owner succeeds once; afterwards the response is not found."""
    store = memory_store()
    store.put(response(created_at=NOW))
    assert await store.delete("resp_1", "team-a") is True
    assert await store.get("resp_1", "team-a") is None
    assert await store.delete("resp_1", "team-a") is False
    assert store.stats()["entries"] == store.stats()["bytes"] == 0


async def test_a_response_expires_ttl_s_after_its_creation() -> None:
    """The memory tier checks the TTL on read, against the response's created_at."""
    clock = Clock()
    store = memory_store(clock, ttl_s=60)
    store.put(response(created_at=NOW))
    clock.now = NOW + 59.9
    assert await store.get("resp_1", "team-a") is not None
    clock.now = NOW + 60
    assert await store.get("resp_1", "team-a") is None
    assert store.stats()["expired"] == 1
    assert store.stats()["entries"] == 0
    assert store.put(response("resp_old", created_at=NOW - 60)) is False  # expired already


async def test_the_least_recently_used_goes_beyond_max_entries() -> None:
    """With room for two, a third response pushes out the one read longest ago."""
    store = memory_store(max_entries=2)
    store.put(response("resp_a", created_at=NOW))
    store.put(response("resp_b", created_at=NOW))
    assert await store.get("resp_a", "team-a") is not None  # a is now the most recent
    store.put(response("resp_c", created_at=NOW))
    assert await store.get("resp_b", "team-a") is None
    assert await store.get("resp_a", "team-a") is not None
    assert await store.get("resp_c", "team-a") is not None
    assert store.stats()["evictions"] == 1


async def test_the_least_recently_used_goes_beyond_max_bytes() -> None:
    """Bytes bound the tier too: three 1000-byte responses fit 3000 bytes, a fourth evicts."""
    store = memory_store(max_bytes=3000, max_bytes_per_response=1024)
    for name in ("a", "b", "c"):
        store.put(response(f"resp_{name}", size=1000, created_at=NOW))
    assert store.stats()["bytes"] == 3000
    store.put(response("resp_d", size=1000, created_at=NOW))
    assert await store.get("resp_a", "team-a") is None
    assert store.stats()["bytes"] == 3000
    assert store.stats()["evictions"] == 1


async def test_a_response_over_max_bytes_per_response_is_not_stored() -> None:
    """put refuses a response larger than the cap (False), and a read of its id says why,
    naming the limit (to its owner only)."""
    store = memory_store(max_bytes_per_response=1024)
    assert store.put(response(size=1025, created_at=NOW)) is False
    assert store.put(response("resp_fits", size=1024, created_at=NOW)) is True
    with pytest.raises(ResponseGoneError) as raised:
        await store.get("resp_1", "team-a")
    assert "responses.max_bytes_per_response (1024 bytes)" in raised.value.reason
    assert await store.get("resp_1", "team-b") is None
    assert store.stats()["too_large"] == 1


async def test_the_store_off_stores_nothing() -> None:
    """`store: off`: put says not stored, get finds nothing, delete deletes nothing."""
    store = ResponseStore(ResponsesSpec(store="off"), None)
    assert store.enabled is False
    assert store.put(response()) is False
    assert await store.get("resp_1", "team-a") is None
    assert await store.delete("resp_1", "team-a") is False


async def test_an_overlong_id_is_not_looked_up() -> None:
    """An id no gateway could have made is simply not found."""
    store = memory_store()
    assert await store.get("resp_" + "x" * 10_000, "team-a") is None


# --- Redis ---------------------------------------------------------------------------------------


async def test_replicas_read_each_others_responses(redis_server: RedisServer, raw: Redis) -> None:
    """Two stores on one Redis (two replicas): once the writer has flushed, the other finds it,
    bytes for bytes, in one hash that expires ttl_s after the response's creation."""
    one, two = redis_store(redis_server.url), redis_store(redis_server.url)
    try:
        stored = response()
        assert one.put(stored) is True
        assert await one.get("resp_1", "team-a") == stored  # at once, from memory
        await one.flush()
        assert await two.get("resp_1", "team-a") == stored
        assert one.stats()["writes"] == 1
        assert one.stats()["pending_writes"] == 0
        key = KEY_PREFIX + "resp_1"
        assert await raw.hget(key, "owner") == b"team-a"
        assert await raw.expiretime(key) == stored.created_at + 30 * 86_400
    finally:
        await one.aclose()
        await two.aclose()


async def test_owners_are_scoped_across_replicas(redis_server: RedisServer) -> None:
    """Through Redis, another owner reads nothing and cannot delete; the owner's delete on one
    replica makes the response unreadable on the other, though it still held it in memory."""
    one, two = redis_store(redis_server.url), redis_store(redis_server.url)
    try:
        one.put(response())
        await one.flush()
        assert await two.get("resp_1", "team-b") is None
        assert await two.delete("resp_1", "team-b") is False
        assert await one.get("resp_1", "team-a") is not None
        assert await two.delete("resp_1", "team-a") is True
        assert await one.get("resp_1", "team-a") is None
        assert await two.get("resp_1", "team-a") is None
        assert await one.delete("resp_1", "team-a") is False
    finally:
        await one.aclose()
        await two.aclose()


async def test_redis_expires_a_response_ttl_s_after_its_creation(
    redis_server: RedisServer, raw: Redis
) -> None:
    """A response created ttl_s - 1 seconds ago is gone from Redis within about a second, and a
    replica that never held it does not find it."""
    one = redis_store(redis_server.url, ttl_s=60)
    fresh = redis_store(redis_server.url, ttl_s=60)
    try:
        one.put(response(created_at=int(time.time()) - 59))
        await one.flush()
        assert one.stats()["writes"] == 1
        key = KEY_PREFIX + "resp_1"

        async def expired() -> bool:  # Redis's own expiry, polled within a bound
            return not await raw.exists(key)

        await eventually(expired, within_s=5, what="the key to expire", every_s=0.05)
        assert await fresh.get("resp_1", "team-a") is None
    finally:
        await one.aclose()
        await fresh.aclose()


async def test_a_response_pushed_out_of_memory_is_read_from_redis(
    redis_server: RedisServer,
) -> None:
    """The memory tier's bound does not lose a response that Redis holds."""
    store = redis_store(redis_server.url, max_entries=1)
    try:
        store.put(response("resp_a"))
        store.put(response("resp_b"))
        await store.flush()
        assert store.stats()["entries"] == 1
        found = await store.get("resp_a", "team-a")
        assert found is not None and found.id == "resp_a"
    finally:
        await store.aclose()


async def test_a_response_deleted_before_its_write_never_reaches_redis(
    redis_server: RedisServer, raw: Redis
) -> None:
    """Deleting a response whose write is still queued takes the write back: only its
    tombstone (owner and `gone`, no content) is written."""
    store = redis_store(redis_server.url)
    try:
        store.put(response())
        assert await store.delete("resp_1", "team-a") is True
        await store.flush()
        assert await raw.hgetall(KEY_PREFIX + "resp_1") == {
            b"owner": b"team-a",
            b"gone": b"deleted",
        }
        assert store.stats()["writes"] == 1
    finally:
        await store.aclose()


async def test_a_full_write_queue_drops_the_write_and_counts_it(redis_server: RedisServer) -> None:
    """Beyond the queue's bound a write is dropped (the response still served from memory)."""
    store = ResponseStore(
        ResponsesSpec(store="redis"), connect_redis(redis_server.url), max_pending=1
    )
    try:
        assert store.put(response("resp_a")) is True
        assert store.put(response("resp_b")) is True  # the writer has not run yet: queue full
        assert store.stats()["dropped_writes"] == 1
        assert await store.get("resp_b", "team-a") is not None
        await store.flush()
        assert store.stats()["writes"] == 1
    finally:
        await store.aclose()


async def test_aclose_flushes_the_queued_writes(redis_server: RedisServer) -> None:
    """Closing a store writes what it still had queued; afterwards it stores nothing."""
    one, two = redis_store(redis_server.url), redis_store(redis_server.url)
    try:
        stored = response()
        one.put(stored)
        await one.aclose()
        assert one.stats()["writes"] == 1
        assert one.put(response("resp_late")) is False
        assert await two.get("resp_1", "team-a") == stored
    finally:
        await two.aclose()


async def test_put_never_raises_when_redis_is_down() -> None:
    """A Redis that refuses connections: put stores in memory and answers at once, the write
    stays queued to be tried again, and a read memory cannot answer is a 503
    `store_unavailable`."""
    store = redis_store(f"redis://127.0.0.1:{free_port()}/0")
    try:
        assert store.put(response()) is True
        await store.flush()
        stats = store.stats()
        assert (stats["writes"], stats["dropped_writes"], stats["store_errors"]) == (0, 0, 1)
        assert (stats["retried_writes"], stats["pending_writes"]) == (1, 1)
        assert await store.get("resp_1", "team-a") is not None  # memory still serves it
        with pytest.raises(StoreUnavailableError) as raised:
            await store.get("resp_other", "team-a")
        assert (raised.value.status, raised.value.code) == (503, "store_unavailable")
        assert store.health()["state"] == "degraded"
        assert await store.delete("resp_1", "team-a") is True  # never written: memory only
    finally:
        await store.aclose()


async def test_a_silent_redis_fails_a_read_within_the_timeout(black_hole: str) -> None:
    """A Redis that never answers: get raises StoreUnavailableError after redis_timeout_ms, and
    while the breaker is open the next read fails at once."""
    store = redis_store(black_hole, redis_timeout_ms=200)
    try:
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError):
            await store.get("resp_1", "team-a")
        took = time.monotonic() - started
        assert 0.19 <= took < 1.0
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError):
            await store.delete("resp_1", "team-a")
        assert time.monotonic() - started < 0.1
    finally:
        await store.aclose()


async def test_memory_serves_while_redis_is_down_and_reads_recover(
    redis_server: RedisServer,
) -> None:
    """With Redis killed, a response this replica holds is still served; once Redis is back
    (after the breaker's backoff) reads answer again."""
    store = redis_store(redis_server.url)
    try:
        store.put(response())
        await store.flush()
        redis_server.kill()
        assert await store.get("resp_1", "team-a") is not None
        with pytest.raises(StoreUnavailableError):
            await store.get("resp_other", "team-a")
        redis_server.start()

        async def answered() -> bool:
            try:
                assert await store.get("resp_other", "team-a") is None
            except StoreUnavailableError:
                return False
            return True

        # The breaker's jittered backoff decides when Redis is asked again.
        await eventually(answered, within_s=15, what="reads to recover", every_s=0.05)
        assert store.health()["state"] == "ok"
    finally:
        await store.aclose()


# --- config and wiring ---------------------------------------------------------------------------


def settings_with(**sections: Any) -> Any:
    return build_settings(
        {
            "providers": {"sim": {"type": "simulated"}},
            "models": [{"name": "m", "deployments": [{"provider": "sim", "model": "m"}]}],
            **sections,
        }
    )


async def test_the_store_follows_the_latency_store_unless_told_otherwise(
    redis_server: RedisServer,
) -> None:
    """`auto` is Redis when the latency store is (its URL) or a URL is set here, else memory."""
    redis_latency = {"store": "redis", "redis_url": redis_server.url}
    cases = [
        ({}, "memory"),
        ({"latency": redis_latency}, "redis"),
        ({"latency": redis_latency, "responses": {"store": "memory"}}, "memory"),
        ({"latency": redis_latency, "responses": {"store": "off"}}, "off"),
        ({"responses": {"redis_url": redis_server.url}}, "redis"),
    ]
    for sections, expected in cases:
        store = open_response_store(settings_with(**sections))
        try:
            assert store.store == expected, sections
        finally:
            await store.aclose()


def test_config_errors_name_the_responses_section() -> None:
    """A Redis store without a URL, or a per-response cap over the tier's, is refused."""
    with pytest.raises(ConfigError, match=r"responses: store 'redis' needs a redis_url"):
        settings_with(responses={"store": "redis"})
    with pytest.raises(ConfigError, match=r"responses: max_bytes_per_response exceeds max_bytes"):
        settings_with(responses={"max_bytes": 2048, "max_bytes_per_response": 4096})
    with pytest.raises(ConfigError, match=r"responses\.ttl_s"):
        settings_with(responses={"ttl_s": 59})


async def test_a_reload_keeps_the_stored_responses_unless_their_config_changes(
    tmp_path: Path,
) -> None:
    """Services carry the store; a reload that leaves `responses` alone hands the same store on
    (nothing stored is lost), one that changes it opens a new store and closes the old one once
    the old config has drained."""
    path = tmp_path / "gateway.yaml"
    doc: dict[str, Any] = {
        "server": {"reload_on_change": False},
        "providers": {"sim": {"type": "simulated"}},
        "models": [{"name": "m", "deployments": [{"provider": "sim", "model": "m"}]}],
    }
    path.write_text(yaml.safe_dump(doc))
    runtime = Runtime(load_settings(path), recorder=None, environ={}, config_path=path)
    async with runtime:
        first = runtime.services.responses
        first.put(response())
        doc["models"].append({"name": "n", "deployments": [{"provider": "sim", "model": "n"}]})
        path.write_text(yaml.safe_dump(doc))
        assert await runtime.reload() is True
        await asyncio.gather(*runtime._draining)  # the old config's drain, done
        assert runtime.services.responses is first
        assert await first.get("resp_1", "team-a") is not None
        assert first.put(response("resp_2")) is True  # still open

        doc["responses"] = {"ttl_s": 3600}
        path.write_text(yaml.safe_dump(doc))
        assert await runtime.reload() is True
        await asyncio.gather(*runtime._draining)
        second = runtime.services.responses
        assert second is not first
        assert first.put(response("resp_3")) is False  # closed with the config that held it
        assert second.put(response("resp_3")) is True
    assert second.put(response("resp_4")) is False  # closed with the runtime

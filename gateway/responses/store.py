"""The Responses API's stored responses: what `GET /v1/responses/{id}` and `previous_response_id`
read, kept by the gateway itself so that a conversation can move between providers.

Two tiers. Memory (this process's) drops the least recently used entries beyond `max_entries` or
`max_bytes`, and an entry past its TTL when it is read. With Redis (shared by replicas) `put` also
queues a write, which a writer task sends in pipelines (`redis_tier`); a write that fails is
tried again after the breaker's wait, never failing a request. Reads look in memory first, then
in Redis.

A memory entry also in Redis is served once Redis confirms the key still holds it, so a
response deleted through another replica is gone everywhere (while Redis fails, memory serves
without asking). After a Redis failure a breaker leaves Redis alone for a jittered, doubling
backoff (0.5 s to 10 s), then lets one read probe it (`gateway.redis.Breaker`): reads that
memory cannot answer meanwhile raise `StoreUnavailableError` at once.

A response id made by the gateway says when (`gateway.responses.ids`): one that Redis does not
hold, made less than `RETRY_S` ago, may be a write still pending on another replica, so a read of
it raises `StoreUnavailableError` (503, try again) rather than answering "not found".

Deleting a response also makes every response that continues it unreadable: each stored response
lists its ancestors, and a deleted one leaves a tombstone (in Redis, and in this process's memory)
that outlives them. A response too large to store leaves a tombstone that says so.

Stored content is never logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from gateway.config import Settings
from gateway.config.specs import ResponsesSpec
from gateway.errors import StoreUnavailableError
from gateway.redis import RedisClient, connect_redis
from gateway.responses.ids import minted_at
from gateway.responses.redis_tier import (
    KEY_PREFIX,
    MAX_ATTEMPTS,
    RETRY_S,
    WRITE_TIMEOUT_FACTOR,
    RedisTier,
    StoredResponse,
    Tombstone,
    size_of,
    unavailable,
)

__all__ = [
    "KEY_PREFIX",
    "MAX_ATTEMPTS",
    "RETRY_S",
    "ResponseGoneError",
    "ResponseStore",
    "StoredResponse",
    "open_response_store",
    "size_of",
]

MAX_ID_CHARS = 256  # a longer id was never made by the gateway: not looked up at all
DELETED = "deleted"


class ResponseGoneError(Exception):
    """The owner's response is not there, for a reason the owner may be told: it continues a
    deleted response, or it was too large to store. (A deleted one is simply not found.)"""

    def __init__(self, response_id: str, reason: str) -> None:
        super().__init__(reason)
        self.response_id = response_id
        self.reason = reason


@dataclass(slots=True)
class _Entry:
    stored: StoredResponse
    size: int
    persisted: bool  # a version of this response is in Redis


class _MemoryTier:
    """This process's responses: least recently used out beyond either bound, TTL on read; and
    its tombstones, as many as `max_entries`, each until it expires."""

    def __init__(
        self, *, max_entries: int, max_bytes: int, ttl_s: int, clock: Callable[[], float]
    ) -> None:
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._gone: OrderedDict[str, Tombstone] = OrderedDict()
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._ttl_s = ttl_s
        self._clock = clock
        self.bytes = 0
        self.evictions = 0  # pushed out by the bounds
        self.expired = 0  # found past their TTL when read

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> _Entry | None:
        """The live entry (now the most recently used), or None; an expired one is dropped."""
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        if self._clock() >= entry.stored.created_at + self._ttl_s:
            self.pop(response_id)
            self.expired += 1
            return None
        self._entries.move_to_end(response_id)
        return entry

    def put(self, stored: StoredResponse, size: int, *, persisted: bool) -> None:
        old = self.pop(stored.id)
        persisted = persisted or (old is not None and old.persisted)
        self._entries[stored.id] = _Entry(stored, size, persisted)
        self.bytes += size
        # Never the entry just added: the config keeps one response within max_bytes.
        while len(self._entries) > 1 and (
            len(self._entries) > self._max_entries or self.bytes > self._max_bytes
        ):
            _, evicted = self._entries.popitem(last=False)
            self.bytes -= evicted.size
            self.evictions += 1

    def pop(self, response_id: str) -> _Entry | None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.bytes -= entry.size
        return entry

    def mark_persisted(self, stored: StoredResponse) -> None:
        entry = self._entries.get(stored.id)
        if entry is not None and entry.stored is stored:
            entry.persisted = True

    def bury(self, tombstone: Tombstone) -> None:
        self._gone[tombstone.id] = tombstone
        self._gone.move_to_end(tombstone.id)
        while len(self._gone) > self._max_entries:
            self._gone.popitem(last=False)

    def gone(self, response_id: str) -> Tombstone | None:
        tombstone = self._gone.get(response_id)
        if tombstone is not None and self._clock() >= tombstone.expires_at:
            del self._gone[response_id]
            return None
        return tombstone

    def latest(self, response_id: str, owner: str) -> StoredResponse | None:
        if self.gone(response_id) is not None:
            return None
        entry = self.get(response_id)
        return entry.stored if entry is not None and entry.stored.owner == owner else None

    async def reread(self, redis: RedisTier, held: StoredResponse) -> StoredResponse | None:
        """Redis's version of an entry held here (written there already), now held here."""
        try:
            found = await redis.read(held.id)
        except StoreUnavailableError:
            return held  # while Redis fails, memory serves
        if redis.queue.waiting(held.id) is not None:  # written here meanwhile: that is newer
            entry = self.get(held.id)
            return entry.stored if entry is not None else None
        if not isinstance(found, StoredResponse) or found.owner != held.owner:
            self.pop(held.id)  # deleted, or expired, through another replica
            return None
        self.put(found, size_of(found), persisted=True)
        return found

    def any_deleted(self, ids: tuple[str, ...]) -> bool:
        return any((t := self.gone(i)) is not None and t.reason == DELETED for i in ids)


class ResponseStore:
    """The stored responses of one config: a memory tier, and Redis behind it when `redis` is
    given. Owns `redis` (closed by `aclose`); `open_response_store` builds one from settings.

    Every method is scoped to an owner: another owner's response is not found, never refused,
    so that its existence is not revealed. Nothing raises on `put`; reads and deletes that need
    Redis raise `StoreUnavailableError` when it fails or takes over `redis_timeout_ms`, and reads
    raise `ResponseGoneError` for a response continuing one the owner deleted, or one too large
    to store.
    """

    def __init__(
        self,
        spec: ResponsesSpec,
        redis: RedisClient | None,
        *,
        clock: Callable[[], float] = time.time,
        max_pending: int = 1024,
        max_pending_bytes: int | None = None,
        close_timeout_s: float = 2.0,
    ) -> None:
        self.store: Literal["memory", "redis", "off"] = (
            "off" if spec.store == "off" else "memory" if redis is None else "redis"
        )
        self._ttl_s = spec.ttl_s
        self._max_per_response = spec.max_bytes_per_response
        self._clock = clock
        self._memory = _MemoryTier(
            max_entries=spec.max_entries, max_bytes=spec.max_bytes, ttl_s=spec.ttl_s, clock=clock
        )
        self._redis: RedisTier | None = None
        if redis is not None:
            self._redis = RedisTier(
                redis,
                ttl_s=spec.ttl_s,
                timeout_s=spec.redis_timeout_ms / 1000,
                clock=clock,
                pending=(max_pending, max_pending_bytes or spec.max_bytes),
                written=self._memory.mark_persisted,
            )
        self.spec = spec
        self._close_timeout_s = close_timeout_s
        self._holders = 1
        self._closed = False
        self._stored = 0
        self._too_large = 0

    @property
    def enabled(self) -> bool:
        """Whether responses are stored at all (`responses.store` is not `off`)."""
        return self.store != "off"

    def share(self) -> ResponseStore:
        """This store for one more holder (a reloaded config that keeps it); every holder
        calls `aclose` once."""
        self._holders += 1
        return self

    async def warm(self, timeout_s: float = 5.0) -> bool:
        """Connect to Redis now (for a Cluster, read its slot map), so that the first read does
        not pay for it within `redis_timeout_ms`. Bounded by `timeout_s`; False when Redis did
        not answer (start-up goes on)."""
        if self._redis is None or self._closed:
            return True
        return await self._redis.warm(timeout_s)

    def put(self, stored: StoredResponse) -> bool:
        """Store a response (replacing one with its id); never blocks, never raises. With Redis
        the write is queued; the response is readable here at once. False when it is not stored:
        larger than `max_bytes_per_response` (then a read of its id says so), already past its
        TTL, the store `off`, or closed."""
        if self._closed or not self.enabled or stored.created_at + self._ttl_s <= self._clock():
            return False
        size = size_of(stored)
        if size > self._max_per_response:
            self._too_large += 1
            reason = (
                f"it was not stored: with its conversation it takes {size} bytes, over "
                f"responses.max_bytes_per_response ({self._max_per_response} bytes)"
            )
            tombstone = Tombstone(stored.id, stored.owner, reason, stored.created_at + self._ttl_s)
            self._memory.bury(tombstone)
            if self._redis is not None:
                self._redis.queue.enqueue(tombstone)
            return False
        self._memory.put(stored, size, persisted=False)
        self._stored += 1
        if self._redis is not None:
            self._redis.queue.enqueue(stored)
        return True

    async def get(
        self, response_id: str, owner: str, *, fresh: bool = False
    ) -> StoredResponse | None:
        """The owner's live response, or None (unknown, expired, or another owner's). Raises
        ResponseGoneError (see the class), and StoreUnavailableError when only Redis could
        answer and it failed or timed out, or when the id is recent enough for its write to be
        pending on another replica. `fresh`: an entry that changes (a conversation) is read
        from Redis even when memory holds it, as another replica may have written it since
        (while Redis fails, memory serves)."""
        if not self.enabled or len(response_id) > MAX_ID_CHARS:
            return None
        redis = None if self._closed else self._redis  # closed: memory only
        tombstone = self._memory.gone(response_id)
        if tombstone is not None:
            _raise_if_gone(tombstone, owner)
            return None
        entry = self._memory.get(response_id)
        if entry is not None:
            stored = entry.stored
            if stored.owner != owner:
                return None
            if fresh and redis and entry.persisted and redis.queue.waiting(response_id) is None:
                return await self._memory.reread(redis, stored)  # a newer one may be in Redis
            self._check_ancestors(stored)
            if redis is not None:
                asked = response_id if entry.persisted else None
                live, deleted = await redis.check(asked, stored.ancestors)
                if not live:
                    self._memory.pop(response_id)  # deleted through another replica
                    return None
                if deleted:
                    raise _continues_deleted(response_id)
            return stored
        if redis is None:
            return None
        waiting = redis.queue.waiting(response_id)
        if waiting is not None:  # pushed out of memory before its write
            if isinstance(waiting, Tombstone):
                _raise_if_gone(waiting, owner)
                return None
            return waiting if waiting.owner == owner else None
        found = await redis.read(response_id)
        if found is None:
            made = minted_at(response_id)
            if made is not None and self._clock() - made < RETRY_S:
                raise unavailable("read")  # its write may be pending on another replica
            return None
        if found.owner != owner:
            return None
        if isinstance(found, Tombstone):
            _raise_if_gone(found, owner)
            return None
        if self._clock() >= found.created_at + self._ttl_s:
            return None  # Redis's clock is behind ours: expired all the same
        self._check_ancestors(found)
        if found.ancestors and (await redis.check(None, found.ancestors))[1]:
            raise _continues_deleted(response_id)
        self._memory.put(found, size_of(found), persisted=True)
        return found

    def latest(self, response_id: str, owner: str) -> StoredResponse | None:
        """The owner's entry as this process last wrote or read it, from memory only (never
        waits): what a read-modify-write of a conversation starts from. None: not held here."""
        return self._memory.latest(response_id, owner) if self.enabled else None

    def _check_ancestors(self, stored: StoredResponse) -> None:
        if stored.ancestors and self._memory.any_deleted(stored.ancestors):
            raise _continues_deleted(stored.id)

    async def delete(self, response_id: str, owner: str) -> bool:
        """Delete the owner's response everywhere, leaving a tombstone that makes every response
        continuing it unreadable too; False when there is none (or it is another owner's).
        Raises StoreUnavailableError when Redis holds it and cannot be reached."""
        if not self.enabled or len(response_id) > MAX_ID_CHARS:
            return False
        redis = self._redis
        if self._closed and redis is not None:
            raise unavailable("delete")  # the Redis copy cannot be reached any more
        if self._memory.gone(response_id) is not None:
            return False  # deleted already, or never stored
        entry = self._memory.get(response_id)
        local = entry.stored if entry is not None else None
        if local is None and redis is not None:
            waiting = redis.queue.waiting(response_id)
            local = waiting if isinstance(waiting, StoredResponse) else None
        if local is not None and local.owner != owner:
            return False
        tombstone = Tombstone(response_id, owner, DELETED, int(self._clock()) + self._ttl_s)
        if redis is None:
            self._memory.pop(response_id)
            if local is not None:
                self._memory.bury(tombstone)
            return local is not None
        in_flight = redis.queue.unqueue(response_id)
        if local is not None and not in_flight and not (entry is not None and entry.persisted):
            # Never written to Redis: its tombstone is written off the request path.
            self._memory.pop(response_id)
            self._memory.bury(tombstone)
            redis.queue.enqueue(tombstone)
            return True
        deleted = await redis.delete(response_id, owner, held=local is not None)
        self._memory.pop(response_id)
        if local is not None or deleted:
            self._memory.bury(tombstone)
        return local is not None or deleted

    async def flush(self) -> None:
        """Try every queued write now, whatever the breaker says; return once each is written
        or a batch failed (the rest stay queued, tried again later). The caller bounds the
        wait (each batch has its own timeout)."""
        if self._redis is not None:
            await self._redis.queue.flush()

    def stats(self) -> dict[str, int]:
        """Counters for `/admin`, `/metrics` and tests: what memory holds, and what happened to
        writes."""
        redis = self._redis
        return {
            "entries": len(self._memory),
            "bytes": self._memory.bytes,
            "stored": self._stored,  # responses accepted by put
            "too_large": self._too_large,  # refused by put: over max_bytes_per_response
            "evictions": self._memory.evictions,
            "expired": self._memory.expired,
            "writes": redis.queue.writes if redis else 0,  # written to Redis (tombstones too)
            "retried_writes": redis.queue.retried_writes if redis else 0,  # failed, queued again
            "dropped_writes": redis.queue.dropped_writes
            if redis
            else 0,  # lost: queue full, too old
            "pending_writes": redis.queue.pending if redis else 0,
            "store_errors": redis.errors if redis else 0,  # failed Redis calls
        }

    def health(self) -> dict[str, Any]:
        """The store's part of `/readyz`: `degraded` while Redis fails (this replica answers
        from memory, other reads get 503), and the writes not yet in Redis or lost."""
        redis = self._redis
        return {
            "store": self.store,
            "state": redis.breaker.state if redis else "ok",
            "last_error": redis.breaker.last_error if redis else None,
            "pending_writes": redis.queue.pending if redis else 0,
            "dropped_writes": redis.queue.dropped_writes if redis else 0,
        }

    async def aclose(self) -> None:
        """Write what is queued (within `close_timeout_s`), stop the writer, close the client.
        Afterwards `put` stores nothing and reads find only what memory holds. With holders
        added by `share`, only the last one's call closes it."""
        self._holders -= 1
        redis = self._redis
        if self._holders > 0 or self._closed:
            return
        self._closed = True
        if redis is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._close_timeout_s):
                    await redis.queue.flush()
            await redis.aclose()


def _raise_if_gone(tombstone: Tombstone | None, owner: str) -> None:
    """A deleted response is simply not found; one too large to store says why."""
    if tombstone is not None and tombstone.owner == owner and tombstone.reason != DELETED:
        raise ResponseGoneError(tombstone.id, tombstone.reason)


def _continues_deleted(response_id: str) -> ResponseGoneError:
    return ResponseGoneError(
        response_id,
        "it continues a response that was deleted (deleting a response deletes "
        "every response that continues it)",
    )


def open_response_store(settings: Settings) -> ResponseStore:
    """The config's store, on Redis when `responses.store` says so (`auto`: when `latency.store`
    is redis, or `responses.redis_url` is set). Nothing is connected yet (`warm` does); the
    caller must `aclose()` it."""
    spec = settings.responses
    url = spec.redis_url or settings.latency.redis_url
    use_redis = spec.store == "redis" or (
        spec.store == "auto" and (spec.redis_url is not None or settings.latency.store == "redis")
    )
    redis = None
    if use_redis and url is not None:
        # The store's own deadlines decide; redis-py's socket timeouts only back them up.
        redis = connect_redis(
            url.get_secret_value(),
            timeout_s=spec.redis_timeout_ms / 1000 * WRITE_TIMEOUT_FACTOR,
            max_connections=16,
            wait_for_connection=True,
        )
    return ResponseStore(spec, redis, clock=time.time)

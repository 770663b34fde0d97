"""The Responses API's stored responses: what `GET /v1/responses/{id}` and `previous_response_id`
read, kept by the gateway itself so that a conversation can move between providers.

Two tiers. Memory (this process's) drops the least recently used entries beyond `max_entries` or
`max_bytes`, and an entry past its TTL when it is read. With Redis (shared by replicas) `put` also
queues a write, which a writer task sends in pipelines; a full queue or a Redis fault drops the
write and counts it, never failing a request. Reads look in memory first, then in Redis.

Redis layout: one hash per response, `tailguard:resp:<id>`, with the fields `owner`,
`created_at`, `response` and `items`, expiring `ttl_s` after the response's creation (`EXPIREAT`,
so every replica agrees on when). One key per command, so a Redis Cluster needs no hash tags.

A memory entry also in Redis is served once Redis confirms the key still exists (`EXISTS`), so a
response deleted through another replica is gone everywhere (while Redis fails, memory serves
without asking). After a Redis failure a breaker leaves Redis alone for a jittered, doubling
backoff (0.5 s to 10 s): reads that memory cannot answer raise `StoreUnavailableError` at once.

Stored content is never logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from redis.asyncio.cluster import RedisCluster
from redis.typing import EncodableT, FieldT

from gateway.config import Settings
from gateway.config.specs import ResponsesSpec
from gateway.errors import StoreUnavailableError
from gateway.redis import RedisClient, connect_redis

__all__ = ["ResponseStore", "StoredResponse", "open_response_store"]

log = logging.getLogger("tailguard")

KEY_PREFIX = "tailguard:resp:"
MAX_ID_CHARS = 256  # a longer id was never made by the gateway: not looked up at all
_FIELDS = ("owner", "created_at", "response", "items")
_BATCH_ENTRIES = 64  # responses per write pipeline
_BATCH_BYTES = 4 * 1024 * 1024  # ... or this many bytes of them (at least one response)
_WRITE_TIMEOUT_FACTOR = 4  # a write pipeline carries megabytes: it gets longer than a read
_BACKOFF_MIN_S, _BACKOFF_MAX_S = 0.5, 10.0  # the breaker's first and longest wait

# Deletes only the owner's response: one round trip, and no other key's existence is revealed.
_DELETE = """
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One stored response, as the client got it, with the conversation that led to it."""

    id: str  # "resp_..."
    owner: str  # the name of the key that created it ("" when auth is off)
    response: bytes  # the Response object as JSON bytes
    items: bytes  # JSON array: the conversation's input items up to and including this
    # response's own input (not its output, which is inside `response`)
    created_at: int  # unix seconds


def _size(stored: StoredResponse) -> int:
    return len(stored.response) + len(stored.items)


@dataclass(slots=True)
class _Entry:
    stored: StoredResponse
    size: int
    persisted: bool  # a version of this response is in Redis


class _MemoryTier:
    """This process's responses: least recently used out beyond either bound, TTL on read."""

    def __init__(
        self, *, max_entries: int, max_bytes: int, ttl_s: int, clock: Callable[[], float]
    ) -> None:
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
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


class _Breaker:
    """Whether Redis may be called now: after a failure it is left alone until a jittered,
    doubling backoff expires; a success closes the breaker again."""

    def __init__(self) -> None:
        self._failures_in_row = 0
        self._retry_at = -math.inf
        self.last_error: str | None = None

    @property
    def state(self) -> Literal["ok", "degraded"]:
        return "ok" if self._failures_in_row == 0 else "degraded"

    def wait_s(self) -> float:
        """Seconds until Redis may be called again (0: now)."""
        return max(0.0, self._retry_at - time.monotonic())

    def failed(self, exc: BaseException) -> None:
        if self._failures_in_row == 0:
            log.warning(
                "responses store: Redis failed (%s); serving from memory", type(exc).__name__
            )
        self._failures_in_row += 1
        self.last_error = type(exc).__name__
        delay = min(_BACKOFF_MAX_S, _BACKOFF_MIN_S * 2 ** (self._failures_in_row - 1))
        self._retry_at = time.monotonic() + delay * random.uniform(0.8, 1.2)

    def succeeded(self) -> None:
        if self._failures_in_row:
            log.warning("responses store: Redis is back after %d failures", self._failures_in_row)
        self._failures_in_row = 0
        self._retry_at = -math.inf


class ResponseStore:
    """The stored responses of one config: a memory tier, and Redis behind it when `redis` is
    given. Owns `redis` (closed by `aclose`); `open_response_store` builds one from settings.

    Every method is scoped to an owner: another owner's response is not found, never refused,
    so that its existence is not revealed. Nothing raises on `put`; reads and deletes that need
    Redis raise `StoreUnavailableError` when it fails or takes over `redis_timeout_ms`.
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
        self._redis: _RedisTier | None = None
        if redis is not None:
            pending = (max_pending, max_pending_bytes or spec.max_bytes)
            self._redis = _RedisTier(redis, spec, clock, pending, self._memory.mark_persisted)
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

    def put(self, stored: StoredResponse) -> bool:
        """Store a response (replacing one with its id); never blocks, never raises. With Redis
        the write is queued; the response is readable here at once. False when it is not stored:
        larger than `max_bytes_per_response`, already past its TTL, the store `off`, or closed."""
        if self._closed or not self.enabled or stored.created_at + self._ttl_s <= self._clock():
            return False
        size = _size(stored)
        if size > self._max_per_response:
            self._too_large += 1
            return False
        self._memory.put(stored, size, persisted=False)
        self._stored += 1
        if self._redis is not None:
            self._redis.enqueue(stored, size)
        return True

    async def get(self, response_id: str, owner: str) -> StoredResponse | None:
        """The owner's live response, or None (unknown, expired, deleted or another owner's).
        Raises StoreUnavailableError when only Redis could answer and it failed or timed out."""
        if not self.enabled or len(response_id) > MAX_ID_CHARS:
            return None
        redis = None if self._closed else self._redis  # closed: memory only
        entry = self._memory.get(response_id)
        if entry is not None:
            if entry.stored.owner != owner:
                return None
            if entry.persisted and redis is not None and not await redis.exists(response_id):
                self._memory.pop(response_id)  # deleted through another replica
                return None
            return entry.stored
        if redis is None:
            return None
        waiting = redis.waiting(response_id)
        if waiting is not None:  # pushed out of memory before its write
            return waiting if waiting.owner == owner else None
        stored = await redis.read(response_id)
        if stored is None or stored.owner != owner:
            return None
        if self._clock() >= stored.created_at + self._ttl_s:
            return None  # Redis's clock is behind ours: expired all the same
        self._memory.put(stored, _size(stored), persisted=True)
        return stored

    async def delete(self, response_id: str, owner: str) -> bool:
        """Delete the owner's response everywhere; False when there is none (or it is another
        owner's). Raises StoreUnavailableError when Redis holds it and cannot be reached."""
        if not self.enabled or len(response_id) > MAX_ID_CHARS:
            return False
        redis = self._redis
        if self._closed and redis is not None:
            raise _unavailable("delete")  # the Redis copy cannot be reached any more
        entry = self._memory.get(response_id)
        local = entry.stored if entry is not None else None
        if local is None and redis is not None:
            local = redis.waiting(response_id)
        if local is not None and local.owner != owner:
            return False
        if redis is None:
            self._memory.pop(response_id)
            return local is not None
        in_flight = redis.unqueue(response_id)
        if local is not None and not in_flight and not (entry is not None and entry.persisted):
            self._memory.pop(response_id)  # never written to Redis: nothing to delete there
            return True
        deleted = await redis.delete(response_id, owner)
        self._memory.pop(response_id)
        return local is not None or deleted

    async def flush(self) -> None:
        """Write every queued response to Redis now, whatever the breaker says; return once each
        is written or dropped. The caller bounds the wait (each batch has its own timeout)."""
        if self._redis is not None:
            await self._redis.flush()

    def stats(self) -> dict[str, int]:
        """Counters for `/admin` and tests: what memory holds, and what happened to writes."""
        redis = self._redis
        return {
            "entries": len(self._memory),
            "bytes": self._memory.bytes,
            "stored": self._stored,  # responses accepted by put
            "too_large": self._too_large,  # refused by put: over max_bytes_per_response
            "evictions": self._memory.evictions,
            "expired": self._memory.expired,
            "writes": redis.writes if redis else 0,  # written to Redis
            "dropped_writes": redis.dropped_writes if redis else 0,  # lost: queue full, fault
            "pending_writes": redis.pending if redis else 0,
            "store_errors": redis.errors if redis else 0,  # failed Redis calls
        }

    def health(self) -> dict[str, Any]:
        """The store's part of `/readyz`."""
        redis = self._redis
        return {
            "store": self.store,
            "state": redis.breaker.state if redis else "ok",
            "last_error": redis.breaker.last_error if redis else None,
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
                    await redis.flush()
            await redis.aclose()


class _RedisTier:
    """The Redis side: reads and deletes on the request path (bounded, behind the breaker), and
    the queue of writes with the task that sends them. Owns the client."""

    def __init__(
        self,
        redis: RedisClient,
        spec: ResponsesSpec,
        clock: Callable[[], float],
        pending: tuple[int, int],  # bounds of the write queue: responses, bytes
        written: Callable[[StoredResponse], None],
    ) -> None:
        self._redis = redis
        self._delete_script = redis.register_script(_DELETE)
        self._ttl_s = spec.ttl_s
        self._timeout_s = spec.redis_timeout_ms / 1000
        self._write_timeout_s = self._timeout_s * _WRITE_TIMEOUT_FACTOR
        self._clock = clock
        self._on_written = written
        self.breaker = _Breaker()
        # Writes waiting, oldest first, and the batch being written.
        self._queued: OrderedDict[str, StoredResponse] = OrderedDict()
        self._queued_bytes = 0
        self._max_pending, self._max_pending_bytes = pending
        self._inflight: dict[str, StoredResponse] = {}
        self._batch_done = asyncio.Event()  # set when no batch is being written
        self._batch_done.set()
        self._nudge = asyncio.Event()  # wakes a writer waiting out the breaker
        self._writer: asyncio.Task[None] | None = None
        self._flushes = 0  # flush() calls waiting: the writer ignores the breaker meanwhile
        self.writes = 0
        self.dropped_writes = 0
        self.errors = 0

    @property
    def pending(self) -> int:
        return len(self._queued) + len(self._inflight)

    def waiting(self, response_id: str) -> StoredResponse | None:
        """A response queued or being written."""
        return self._queued.get(response_id) or self._inflight.get(response_id)

    def unqueue(self, response_id: str) -> bool:
        """Take a response's queued write back; True when its write is under way already."""
        queued = self._queued.pop(response_id, None)
        if queued is not None:
            self._queued_bytes -= _size(queued)
        return response_id in self._inflight

    # -- the request path --

    async def read(self, response_id: str) -> StoredResponse | None:
        """Raises StoreUnavailableError."""
        key = _key(response_id)
        fields = await self._call("read", lambda: self._redis.hmget(key, list(_FIELDS)))
        return _parse(response_id, fields)

    async def exists(self, response_id: str) -> bool:
        """Whether the key is still there; True while Redis is failing (memory serves)."""
        try:
            return bool(await self._call("read", lambda: self._redis.exists(_key(response_id))))
        except StoreUnavailableError:
            return True

    async def delete(self, response_id: str, owner: str) -> bool:
        """Delete the owner's key. Raises StoreUnavailableError."""
        if response_id in self._inflight:
            # Its write must land first, or it would bring the response back after the DEL.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._write_timeout_s):
                    await self._batch_done.wait()
        script = self._delete_script
        keys = [_key(response_id)]
        return bool(await self._call("delete", lambda: script(keys=keys, args=[owner])))

    async def _call(self, action: str, command: Callable[[], Awaitable[Any]]) -> Any:
        """One command, bounded by `redis_timeout_ms`; not sent while the breaker is open."""
        if self.breaker.wait_s() > 0:
            raise _unavailable(action)
        try:
            async with asyncio.timeout(self._timeout_s):
                result = await command()
        except Exception as exc:  # redis, socket and timeout errors alike: the store is down
            self.errors += 1
            self.breaker.failed(exc)
            await self._forget_topology()
            raise _unavailable(action) from exc
        self.breaker.succeeded()
        return result

    # -- the writer --

    def enqueue(self, stored: StoredResponse, size: int) -> None:
        self.unqueue(stored.id)  # a newer version replaces a queued one
        if len(self._queued) >= self._max_pending or (
            self._queued_bytes + size > self._max_pending_bytes
        ):
            self.dropped_writes += 1  # still served from memory, by this replica only
            return
        self._queued[stored.id] = stored
        self._queued_bytes += size
        self._start_writer()

    def _start_writer(self) -> None:
        if not self._queued or (self._writer is not None and not self._writer.done()):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop yet: the next put or flush() starts it
        self._writer = loop.create_task(self._drain(), name="responses-store-writer")

    async def _drain(self) -> None:
        """Write queued responses until none is left, waiting out the breaker (unless a flush
        is waiting)."""
        while self._queued:
            wait_s = self.breaker.wait_s()
            if wait_s > 0 and not self._flushes:
                self._nudge.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait_s):
                        await self._nudge.wait()
                continue
            await self._write(self._take_batch())

    def _take_batch(self) -> list[StoredResponse]:
        batch: list[StoredResponse] = []
        size = 0
        while self._queued and len(batch) < _BATCH_ENTRIES and (not batch or size < _BATCH_BYTES):
            _, stored = self._queued.popitem(last=False)
            self._queued_bytes -= _size(stored)
            size += _size(stored)
            batch.append(stored)
            self._inflight[stored.id] = stored
        return batch

    async def _write(self, batch: list[StoredResponse]) -> None:
        self._batch_done.clear()
        now = self._clock()
        live = [s for s in batch if s.created_at + self._ttl_s > now]
        try:
            if live:
                async with (
                    asyncio.timeout(self._write_timeout_s),
                    self._redis.pipeline(transaction=False) as pipe,
                ):
                    for stored in live:
                        key = _key(stored.id)
                        pipe.hset(key, mapping=_fields(stored))
                        pipe.expireat(key, stored.created_at + self._ttl_s)
                    await pipe.execute()
        except Exception as exc:  # fail open: a lost write never fails a request
            self.errors += 1
            self.dropped_writes += len(live)
            self.breaker.failed(exc)
            await self._forget_topology()
        else:
            if live:
                self.breaker.succeeded()
            self.writes += len(live)
            for stored in live:
                self._on_written(stored)
        finally:
            for stored in batch:
                if self._inflight.get(stored.id) is stored:
                    del self._inflight[stored.id]
            self._batch_done.set()

    async def _forget_topology(self) -> None:
        """Cluster only: closed, the client re-reads the slot map on its next call (without
        retries it never does so by itself, and would keep calling a failed primary)."""
        if isinstance(self._redis, RedisCluster):
            try:
                async with asyncio.timeout(self._timeout_s):
                    await self._redis.aclose()
            except Exception as exc:  # the next call tries again anyway
                log.debug("responses store: closing the cluster client failed (%s)", exc)

    async def flush(self) -> None:
        self._flushes += 1
        try:
            self._nudge.set()
            self._start_writer()
            writer = self._writer
            if writer is not None and not writer.done():
                await asyncio.shield(writer)  # a cancelled flush leaves the writer running
        finally:
            self._flushes -= 1

    async def aclose(self) -> None:
        """Stop the writer (what is still queued is dropped and counted), close the client."""
        writer = self._writer
        if writer is not None:
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)
        self.dropped_writes += self.pending
        self._queued.clear()
        self._queued_bytes = 0
        self._inflight.clear()
        await self._redis.aclose()


def open_response_store(settings: Settings) -> ResponseStore:
    """The config's store, on Redis when `responses.store` says so (`auto`: when `latency.store`
    is redis, or `responses.redis_url` is set). Nothing is connected yet; the caller must
    `aclose()` it."""
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
            timeout_s=spec.redis_timeout_ms / 1000 * _WRITE_TIMEOUT_FACTOR,
            max_connections=16,
            wait_for_connection=True,
        )
    return ResponseStore(spec, redis)


def _key(response_id: str) -> str:
    return KEY_PREFIX + response_id


def _fields(stored: StoredResponse) -> dict[FieldT, EncodableT]:
    values = (stored.owner, stored.created_at, stored.response, stored.items)
    return dict(zip(_FIELDS, values, strict=True))


def _parse(response_id: str, fields: list[Any]) -> StoredResponse | None:
    """A response from its hash fields (`_FIELDS` order); None when missing or malformed."""
    owner, created_at, response, items = fields
    if owner is None or created_at is None or response is None or items is None:
        return None
    try:
        return StoredResponse(
            id=response_id,
            owner=owner.decode() if isinstance(owner, bytes) else str(owner),
            response=bytes(response),
            items=bytes(items),
            created_at=int(created_at),
        )
    except (TypeError, ValueError, UnicodeDecodeError):
        log.warning("responses store: ignoring a malformed entry in Redis")
        return None


def _unavailable(action: str) -> StoreUnavailableError:
    what = {"read": "read", "delete": "deleted"}.get(action, "written")
    return StoreUnavailableError(
        f"Stored responses cannot be {what} right now (the response store is unavailable); "
        "try again shortly."
    )

"""The Redis side of the stored responses: reads and deletes on the request path (bounded,
behind a breaker), and the queue of writes with the task that sends them.

Redis layout: one hash per response, `tailguard:resp:<id>`, with the fields `owner`,
`created_at`, `response`, `items` and `ancestors` (the ids of the earlier responses of its
conversation, nearest first, space-separated), expiring `ttl_s` after the response's creation
(`EXPIREAT`, so every replica agrees on when). A deleted response, or one too large to store,
leaves a tombstone in its place: `owner` and `gone` (why) only. One key per command, so a Redis
Cluster needs no hash tags.

A write that fails stays queued, in order, and is tried again once the breaker lets Redis be
called (for a Cluster, after the slot map is read again): it is dropped, and counted, only when
the queue is full, it is older than `RETRY_S`, or it failed `MAX_ATTEMPTS` times.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.typing import EncodableT, FieldT

from gateway.errors import StoreUnavailableError
from gateway.redis import Breaker, RedisClient

log = logging.getLogger("tailguard")

KEY_PREFIX = "tailguard:resp:"
RETRY_S = 300  # a failed write is tried again for this long after its response was made
MAX_ATTEMPTS = 40  # ... and at most this many times (the breaker's backoff spaces them)
_FIELDS = ("owner", "created_at", "response", "items", "ancestors", "gone")
_BATCH_ENTRIES = 64  # responses per write pipeline
_BATCH_BYTES = 4 * 1024 * 1024  # ... or this many bytes of them (at least one response)
WRITE_TIMEOUT_FACTOR = 4  # a write pipeline carries megabytes: it gets longer than a read

# Deletes only the owner's response, leaving a tombstone that outlives every response that
# continues it (ARGV[2] seconds); ARGV[3] == "1": the caller holds it, not yet in Redis. One
# round trip, and no other key's existence is revealed.
_DELETE = """
local owner = redis.call('HGET', KEYS[1], 'owner')
if owner == false then
  if ARGV[3] ~= '1' then return 0 end
elseif owner ~= ARGV[1] or redis.call('HEXISTS', KEYS[1], 'gone') == 1 then
  return 0
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'gone', 'deleted')
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 1
"""


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One stored response, as the client got it, with the conversation that led to it."""

    id: str  # "resp_..."
    owner: str  # the identity of the key that created it ("" when auth is off)
    response: bytes  # the Response object as JSON bytes
    items: bytes  # JSON array: the conversation's input items up to and including this
    # response's own input (not its output, which is inside `response`)
    created_at: int  # unix seconds
    ancestors: tuple[str, ...] = ()  # the earlier responses it continues, nearest first


@dataclass(frozen=True, slots=True)
class Tombstone:
    """Where a response is not, and why: `deleted`, or a reason a client may be told."""

    id: str
    owner: str
    reason: str
    expires_at: int  # unix seconds


Write = StoredResponse | Tombstone


def size_of(stored: StoredResponse) -> int:
    return len(stored.response) + len(stored.items)


def _write_size(write: Write) -> int:
    return size_of(write) if isinstance(write, StoredResponse) else 64


class RedisTier:
    """Reads and deletes on one Redis client, which it owns, and its queue of writes."""

    def __init__(
        self,
        redis: RedisClient,
        *,
        ttl_s: int,
        timeout_s: float,
        clock: Callable[[], float],
        pending: tuple[int, int],  # bounds of the write queue: responses, bytes
        written: Callable[[StoredResponse], None],
    ) -> None:
        self.client = redis
        self._delete_script = redis.register_script(_DELETE)
        self._ttl_s = ttl_s
        self._timeout_s = timeout_s
        self.breaker = Breaker("responses store", fallback="serving from memory")
        self.errors = 0  # failed Redis calls
        self.queue = WriteQueue(self, ttl_s, timeout_s * WRITE_TIMEOUT_FACTOR, clock, pending)
        self.queue.on_written = written

    # -- the request path --

    async def warm(self, timeout_s: float) -> bool:
        """Connect now (for a Cluster: read the slot map), within `timeout_s`; False when Redis
        did not answer (logged; the breaker is left closed)."""
        try:
            async with asyncio.timeout(timeout_s):
                await self.client.ping()
        except Exception as exc:  # start-up goes on: reads will try again
            log.warning(
                "responses store: Redis did not answer at start-up (%s)", type(exc).__name__
            )
            return False
        return True

    async def read(self, response_id: str) -> StoredResponse | Tombstone | None:
        """Raises StoreUnavailableError."""
        key = KEY_PREFIX + response_id
        fields = await self._call("read", lambda: self.client.hmget(key, list(_FIELDS)))
        return _parse(response_id, fields)

    async def check(self, response_id: str | None, ancestors: tuple[str, ...]) -> tuple[bool, bool]:
        """In one round trip: whether `response_id` (None: not asked) is still stored, and
        whether any of `ancestors` was deleted. While Redis fails: (True, False), memory serves.
        """
        ids = ([response_id] if response_id is not None else []) + list(ancestors)
        if not ids:
            return True, False

        async def ask() -> list[Any]:
            async with self.client.pipeline(transaction=False) as pipe:
                if response_id is not None:
                    pipe.hexists(KEY_PREFIX + response_id, "response")
                for ancestor in ancestors:
                    pipe.hexists(KEY_PREFIX + ancestor, "gone")
                return list(await pipe.execute())

        try:
            found = await self._call("read", ask)
        except StoreUnavailableError:
            return True, False
        live = bool(found[0]) if response_id is not None else True
        return live, any(found[1 if response_id is not None else 0 :])

    async def delete(self, response_id: str, owner: str, *, held: bool) -> bool:
        """Delete the owner's key, leaving a tombstone (also when `held`: this replica has it
        and its write may not have landed). Raises StoreUnavailableError."""
        if self.queue.waiting(response_id) is not None:
            # Its write must land first, or it would bring the response back after the DEL.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._timeout_s * WRITE_TIMEOUT_FACTOR):
                    await self.queue.batch_done.wait()
        script = self._delete_script
        keys = [KEY_PREFIX + response_id]
        args: list[EncodableT] = [owner, self._ttl_s, "1" if held else "0"]
        return bool(await self._call("delete", lambda: script(keys=keys, args=args)))

    async def _call(self, action: str, command: Callable[[], Awaitable[Any]]) -> Any:
        """One command, bounded by `redis_timeout_ms`; not sent while the breaker is open, or
        half-open with another call probing."""
        ticket = self.breaker.ask()
        if ticket is None:
            raise unavailable(action)
        try:
            async with asyncio.timeout(self._timeout_s):
                result = await command()
        except Exception as exc:  # redis, socket and timeout errors alike: the store is down
            self.errors += 1
            self.breaker.failed(ticket, exc)
            await self.forget_topology()
            raise unavailable(action) from exc
        except BaseException:
            self.breaker.abandoned(ticket)
            raise
        self.breaker.succeeded(ticket)
        return result

    async def forget_topology(self) -> None:
        """Cluster only: closed, the client re-reads the slot map on its next call (without
        retries it never does so by itself, and would keep calling a failed primary)."""
        if isinstance(self.client, RedisCluster):
            try:
                async with asyncio.timeout(self._timeout_s):
                    await self.client.aclose()
            except Exception as exc:  # the next call tries again anyway
                log.debug("responses store: closing the cluster client failed (%s)", exc)

    async def aclose(self) -> None:
        """Stop the writer (what is still queued is dropped and counted), close the client."""
        await self.queue.stop()
        await self.client.aclose()


class WriteQueue:
    """The writes waiting for Redis, oldest first, and the task that sends them in pipelines.
    A failed batch goes back to the front, in order, and is tried again after the breaker's
    wait; a write is dropped (and counted) when the queue is full or it is too old."""

    def __init__(
        self,
        tier: RedisTier,
        ttl_s: int,
        write_timeout_s: float,
        clock: Callable[[], float],
        pending: tuple[int, int],
    ) -> None:
        self._tier = tier
        self._ttl_s = ttl_s
        self._write_timeout_s = write_timeout_s
        self._clock = clock
        self.on_written: Callable[[StoredResponse], None] = lambda stored: None
        # The batch being written, how often each write was tried, and in-flight writes taken
        # back meanwhile (not tried again).
        self._queued: OrderedDict[str, Write] = OrderedDict()
        self._queued_bytes = 0
        self._max_pending, self._max_pending_bytes = pending
        self._inflight: dict[str, Write] = {}
        self._attempts: dict[str, int] = {}
        self._taken_back: set[str] = set()
        self.batch_done = asyncio.Event()  # set when no batch is being written
        self.batch_done.set()
        self._nudge = asyncio.Event()  # wakes a writer waiting out the breaker
        self._writer: asyncio.Task[None] | None = None
        self._flushes = 0  # flush() calls waiting: the writer ignores the breaker meanwhile
        self._flush_failed = False  # a batch failed during the current flush: it is over
        self.writes = 0
        self.retried_writes = 0
        self.dropped_writes = 0

    @property
    def pending(self) -> int:
        return len(self._queued) + len(self._inflight)

    def waiting(self, response_id: str) -> Write | None:
        """A write queued or being written."""
        return self._queued.get(response_id) or self._inflight.get(response_id)

    def unqueue(self, response_id: str) -> bool:
        """Take a response's queued write back; True when its write is under way already (it
        is then not tried again if it fails)."""
        queued = self._queued.pop(response_id, None)
        if queued is not None:
            self._queued_bytes -= _write_size(queued)
            self._attempts.pop(response_id, None)
        if response_id in self._inflight:
            self._taken_back.add(response_id)
            return True
        return False

    def enqueue(self, write: Write) -> None:
        self.unqueue(write.id)  # a newer version replaces a queued one
        size = _write_size(write)
        if len(self._queued) >= self._max_pending or (
            self._queued_bytes + size > self._max_pending_bytes
        ):
            self.dropped_writes += 1  # still served from memory, by this replica only
            log.warning("responses store: the write queue is full; a response was not written")
            return
        self._queued[write.id] = write
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
        """Write queued responses until none is left, waiting out the breaker between tries
        (unless a flush is waiting and no batch of it has failed yet)."""
        while self._queued:
            if self._flushes and self._flush_failed:
                return  # flush() restarts the writer when it is done
            wait_s = self._tier.breaker.wait_s()
            if wait_s > 0 and not self._flushes:
                self._nudge.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait_s):
                        await self._nudge.wait()
                continue
            if not await self._write(self._take_batch()) and self._flushes:
                self._flush_failed = True

    def _take_batch(self) -> list[Write]:
        batch: list[Write] = []
        size = 0
        while self._queued and len(batch) < _BATCH_ENTRIES and (not batch or size < _BATCH_BYTES):
            _, write = self._queued.popitem(last=False)
            self._queued_bytes -= _write_size(write)
            size += _write_size(write)
            batch.append(write)
            self._inflight[write.id] = write
        return batch

    def _expiry(self, write: Write) -> int:
        if isinstance(write, Tombstone):
            return write.expires_at
        return write.created_at + self._ttl_s

    async def _write(self, batch: list[Write]) -> bool:
        """One pipeline; False when it failed (its writes then go back to the queue's front,
        unless too old or taken back)."""
        self.batch_done.clear()
        now = self._clock()
        live = [w for w in batch if self._expiry(w) > now]
        ticket = self._tier.breaker.force()  # sent after the breaker's wait, or by a flush
        try:
            if live:
                async with (
                    asyncio.timeout(self._write_timeout_s),
                    self._tier.client.pipeline(transaction=False) as pipe,
                ):
                    for write in live:
                        key = KEY_PREFIX + write.id
                        if isinstance(write, Tombstone):
                            pipe.delete(key)
                        pipe.hset(key, mapping=_fields(write))
                        pipe.expireat(key, self._expiry(write))
                    await pipe.execute()
        except Exception as exc:  # fail open: a write is tried again, never fails a request
            self._tier.errors += 1
            self._tier.breaker.failed(ticket, exc)
            self._requeue(live, now)
            await self._tier.forget_topology()
            return False
        else:
            if live:
                self._tier.breaker.succeeded(ticket)
            self.writes += len(live)
            for write in live:
                self._attempts.pop(write.id, None)
                if isinstance(write, StoredResponse):
                    self.on_written(write)
            return True
        finally:
            for write in batch:
                if self._inflight.get(write.id) is write:
                    del self._inflight[write.id]
                self._taken_back.discard(write.id)
            self.batch_done.set()

    def _requeue(self, failed: list[Write], now: float) -> None:
        """Put a failed batch back at the front of the queue, in its order: each write that was
        not taken back, replaced meanwhile, or made more than RETRY_S ago."""
        for write in reversed(failed):
            if write.id in self._taken_back or write.id in self._queued:
                continue
            made = self._expiry(write) - self._ttl_s  # when it was made (or deleted)
            attempts = self._attempts.pop(write.id, 0) + 1
            if now - made > RETRY_S or attempts >= MAX_ATTEMPTS:
                self.dropped_writes += 1
                log.warning("responses store: a write failed %d times; dropped", attempts)
                continue
            self._attempts[write.id] = attempts
            self.retried_writes += 1
            self._queued[write.id] = write
            self._queued.move_to_end(write.id, last=False)
            self._queued_bytes += _write_size(write)

    async def flush(self) -> None:
        """Try every queued write now, whatever the breaker says, until none is left or a batch
        fails (what is left stays queued, tried again after the breaker's wait)."""
        if not self._flushes:
            self._flush_failed = False
        self._flushes += 1
        try:
            self._nudge.set()
            self._start_writer()
            writer = self._writer
            if writer is not None and not writer.done():
                await asyncio.shield(writer)  # a cancelled flush leaves the writer running
        finally:
            self._flushes -= 1
            if not self._flushes:
                self._flush_failed = False
                self._start_writer()  # back to waiting out the breaker for what is left

    async def stop(self) -> None:
        """Stop the writer; what is still queued is dropped and counted."""
        writer = self._writer
        if writer is not None:
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)
        self.dropped_writes += self.pending
        self._queued.clear()
        self._queued_bytes = 0
        self._inflight.clear()


def _fields(write: Write) -> dict[FieldT, EncodableT]:
    if isinstance(write, Tombstone):
        return {"owner": write.owner, "gone": write.reason}
    fields: dict[FieldT, EncodableT] = {
        "owner": write.owner,
        "created_at": write.created_at,
        "response": write.response,
        "items": write.items,
    }
    if write.ancestors:
        fields["ancestors"] = " ".join(write.ancestors)
    return fields


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _parse(response_id: str, fields: list[Any]) -> StoredResponse | Tombstone | None:
    """A response or a tombstone from its hash fields (`_FIELDS` order); None when missing or
    malformed."""
    owner, created_at, response, items, ancestors, gone = fields
    try:
        if owner is not None and gone is not None:
            return Tombstone(response_id, _text(owner), _text(gone), 0)
        if owner is None or created_at is None or response is None or items is None:
            return None
        return StoredResponse(
            id=response_id,
            owner=_text(owner),
            response=bytes(response),
            items=bytes(items),
            created_at=int(created_at),
            ancestors=tuple(_text(ancestors).split()) if ancestors else (),
        )
    except (TypeError, ValueError, UnicodeDecodeError):
        log.warning("responses store: ignoring a malformed entry in Redis")
        return None


def unavailable(action: str) -> StoreUnavailableError:
    what = {"read": "read", "delete": "deleted"}.get(action, "written")
    return StoreUnavailableError(
        f"Stored responses cannot be {what} right now (the response store is unavailable); "
        "try again shortly."
    )

"""The latency store shared by replicas through Redis, and its packing of a slice's totals.

`RedisLatencyStore` keeps the memory store's window (the request path and the fallback) and adds
the sharing: `_SharedSlices` is the Redis side (key layout, the write of this replica's totals,
the read of every replica's), `gateway.redis.Breaker` decides when Redis may be called again
after a failure, and `_pack` / `_unpack_into` are the format of one replica's totals in a hash
field.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

import orjson
from redis.asyncio.cluster import RedisCluster

from gateway.latency.memory import MemoryLatencyStore
from gateway.latency.samples import METRICS, Sample
from gateway.latency.sketch import DEFAULT_ALPHA
from gateway.latency.snapshot import Snapshot, Source, build_snapshot
from gateway.latency.window import MODEL_TAG, RECENT_SLICES, Counts, Windows, tags_of
from gateway.redis import Breaker, RedisClient, Ticket

logger = logging.getLogger(__name__)


class RedisLatencyStore(MemoryLatencyStore):
    """Latency shared by every replica through Redis, failing open to this process's own numbers.

    Layout: one hash per deployment (or model name) and time slice,
    `tg:lat:{<tag>}:<slice start>`, with one field per replica holding that replica's running
    totals for the slice (bucket counts of each metric, requests, errors), packed as JSON. The tag
    is the deployment name or `model:<name>`; the `{...}` hash tag keeps each deployment's keys on
    one Redis Cluster node. A replica only ever overwrites its own field with its latest totals, so
    a write is idempotent (a retried or repeated flush cannot count twice), merging is addition over
    the fields, and Redis work grows with deployments and slices, not with requests: one `HSET`
    and `EXPIRE` per touched hash per flush (a `HINCRBY` per bucket would cost one command per
    distinct bucket per flush, several per request at a few hundred requests a second). Tags
    written in the last window are listed in the sorted set `tg:lat:index`, so replicas learn
    each other's deployments.

    `record` only touches memory (the local window, which is also the fallback). `flush` writes
    the slices touched since the last flush in one pipeline; `refresh` reads the window back,
    re-reading only the two newest slices once older ones are closed, and uses this replica's own
    totals fresh from memory. A Redis failure opens a breaker (`gateway.redis.Breaker`): Redis is
    left alone until a jittered, doubling backoff expires, then one call probes it; meanwhile
    `refresh` serves the local window
    (`source="local-fallback"`). Touched slices stay marked until a flush succeeds; a slice that
    leaves the window before then is counted in `dropped_samples` (still counted locally).

    Every command names one key and the pipelines are not transactions, so on a Redis Cluster
    the client splits each pipeline by node and no command crosses slots; the index is one key.

    The store borrows `redis` (see `gateway.redis.connect_redis`: a standalone, Sentinel-managed
    or cluster client); the caller closes it after `aclose()`.
    """

    _source: Source = "local-fallback"  # until the first successful read

    def __init__(
        self,
        redis: RedisClient,
        *,
        window_s: float = 60.0,
        slice_s: float = 5.0,
        min_samples: int = 20,
        alpha: float = DEFAULT_ALPHA,
        clock: Callable[[], float] = time.time,
        timeout_s: float = 0.5,
        backoff_min_s: float = 0.5,
        backoff_max_s: float = 10.0,
        prefix: str = "tg",
        rng: random.Random | None = None,
        replica: str | None = None,
    ) -> None:
        super().__init__(
            window_s=window_s, slice_s=slice_s, min_samples=min_samples, alpha=alpha, clock=clock
        )
        self._shared = _SharedSlices(
            redis,
            replica=replica or os.urandom(8).hex(),
            prefix=prefix,
            window_s=window_s,
            slice_s=slice_s,
            timeout_s=timeout_s,
        )
        self._breaker = Breaker(
            "latency store",
            fallback="using local statistics",
            backoff_min_s=backoff_min_s,
            backoff_max_s=backoff_max_s,
            clock=clock,
            rng=rng,
        )
        # (tag, slice) -> samples recorded there since its last successful flush
        self._dirty: dict[tuple[str, int], int] = {}
        self.flush_failures = 0
        self.refresh_failures = 0
        self.dropped_samples = 0
        self.last_ok_at: float | None = None  # clock time of the latest successful Redis call

    # -- request path --

    def record(self, sample: Sample) -> None:
        index = self._windows.slice_of(self._clock())
        self._record_local(sample, index)
        dirty = self._dirty
        for tag in tags_of(sample):
            place = (tag, index)
            dirty[place] = dirty.get(place, 0) + 1
        if sample.hedge_for is not None:
            place = (MODEL_TAG + sample.hedge_for, index)
            dirty[place] = dirty.get(place, 0)

    def arrived(self, model: str) -> None:
        super().arrived(model)
        place = (MODEL_TAG + model, self._windows.slice_of(self._clock()))
        self._dirty[place] = self._dirty.get(place, 0)

    def _judged(self, tags: list[str], index: int) -> None:
        for tag in tags:
            self._dirty[(tag, index)] = self._dirty.get((tag, index), 0)

    @property
    def pending_fields(self) -> int:
        """Hashes (deployment or model, slice) waiting for the next flush (one `HSET` each)."""
        return len(self._dirty)

    # -- state --

    @property
    def replica(self) -> str:
        """This replica's field name in every hash."""
        return self._shared.replica

    @property
    def state(self) -> Literal["ok", "degraded"]:
        return self._breaker.state

    @property
    def last_error(self) -> str | None:
        """The exception type of the latest Redis failure."""
        return self._breaker.last_error

    # -- background --

    async def flush(self) -> None:
        """Write this replica's totals of every touched slice in one pipeline."""
        if not self._dirty:
            return
        ticket = self._breaker.ask()
        if ticket is None:
            return
        now = self._clock()
        window = self._windows.window(now)
        dirty, self._dirty = self._dirty, {}
        writes: list[tuple[str, int, bytes]] = []
        for (tag, index), samples in dirty.items():
            counts = self._windows.peek(tag, index)
            if index < window.start or counts is None:
                self.dropped_samples += samples  # the slice left the window before Redis was back
                continue
            writes.append((tag, index, _pack(counts)))
        if not writes:
            self._breaker.abandoned(ticket)
            return
        try:
            await self._shared.write(writes, now)
        except Exception as exc:  # fail open: whatever went wrong, requests must not notice
            self.flush_failures += 1
            self._breaker.failed(ticket, exc)
            for tag, index, _ in writes:
                place = (tag, index)
                self._dirty[place] = self._dirty.get(place, 0) + dirty[place]
            await self._shared.forget_topology()
        except BaseException:
            self._breaker.abandoned(ticket)
            raise
        else:
            self._succeeded(ticket)

    async def refresh(self) -> Snapshot:
        """Swap in a snapshot of the shared window, or of the local one while Redis is failing."""
        ticket = self._breaker.ask()
        if ticket is not None:
            try:
                self._snapshot = await self._read()
            except Exception as exc:  # fail open, as in flush
                self.refresh_failures += 1
                self._breaker.failed(ticket, exc)
                await self._shared.forget_topology()
            except BaseException:
                self._breaker.abandoned(ticket)
                raise
            else:
                self._succeeded(ticket)
                return self._snapshot
        self._snapshot = self.local_snapshot("local-fallback")
        return self._snapshot

    def _succeeded(self, ticket: Ticket) -> None:
        self._breaker.succeeded(ticket)
        self.last_ok_at = self._clock()

    async def _read(self) -> Snapshot:
        now = self._clock()
        merged, recent = await self._shared.read(now, self._windows, self._inflight)
        return build_snapshot(
            merged,
            self._inflight,
            window_s=self.window_s,
            min_samples=self.min_samples,
            now=now,
            source="redis",
            alpha=self.alpha,
            recent=recent,
        )

    def health(self) -> dict[str, Any]:
        return {
            "type": "redis",
            "state": self.state,
            "last_error": self.last_error,
            "last_ok_at": self.last_ok_at,
            "flush_failures": self.flush_failures,
            "refresh_failures": self.refresh_failures,
            "dropped_samples": self.dropped_samples,
            "pending_fields": self.pending_fields,
            "snapshot_source": self._snapshot.source,
            "snapshot_age_s": self._age(),
        }

    async def aclose(self) -> None:
        """A last best-effort flush, bounded by the store's timeout; ignores the breaker."""
        self._breaker.retry_now()
        await self.flush()


class _SharedSlices:
    """Every replica's slices in Redis: the key layout, the write of this replica's totals, and
    the read of the window (closed slices read once and kept). Borrows the client."""

    def __init__(
        self,
        redis: RedisClient,
        *,
        replica: str,
        prefix: str,
        window_s: float,
        slice_s: float,
        timeout_s: float,
    ) -> None:
        self._redis = redis
        self.replica = replica
        self._prefix = prefix
        self._slice_s = slice_s
        self._ttl_s = math.ceil(window_s + 2 * slice_s)
        self._timeout_s = timeout_s
        self._index_key = f"{prefix}:lat:index"
        self._closed: dict[tuple[str, int], Counts] = {}  # merged slices no replica still writes

    def _key(self, tag: str, index: int) -> str:
        return f"{self._prefix}:lat:{{{tag}}}:{int(index * self._slice_s)}"

    async def write(self, writes: list[tuple[str, int, bytes]], now: float) -> None:
        """Overwrite this replica's field of each (tag, slice) with its packed totals."""
        async with (
            asyncio.timeout(self._timeout_s),
            self._redis.pipeline(transaction=False) as pipe,
        ):
            for tag, index, packed in writes:
                key = self._key(tag, index)
                pipe.hset(key, self.replica, packed)
                # Every write sets the TTL again: a Redis that restarted empty (or was
                # flushed) must not be left with keys that never expire.
                pipe.expire(key, self._ttl_s)
            pipe.zadd(self._index_key, dict.fromkeys({tag for tag, _, _ in writes}, now))
            pipe.zremrangebyscore(self._index_key, "-inf", now - self._ttl_s)
            pipe.expire(self._index_key, self._ttl_s)
            await pipe.execute()

    async def read(
        self, now: float, local: Windows, inflight: Mapping[str, int]
    ) -> tuple[dict[str, Counts], dict[str, Counts]]:
        """Every tag's counts over the window and over its recent slices: the other replicas'
        from Redis, this one's fresh from `local`."""
        alpha = local.alpha
        window = local.window(now)
        # Replicas flush every fraction of a second: a slice two slices old gets no more writes,
        # so it is read once and kept.
        open_from = window.stop - 2
        self._closed = {k: v for k, v in self._closed.items() if k[1] >= window.start}
        async with asyncio.timeout(self._timeout_s):
            listed = await self._redis.zrangebyscore(self._index_key, now - self._ttl_s, "+inf")
            tags = sorted(
                local.tags()
                | inflight.keys()
                | {_text(t) for t in listed if isinstance(t, str | bytes)}
            )
            wanted = [
                (tag, index)
                for tag in tags
                for index in window
                if index >= open_from or (tag, index) not in self._closed
            ]
            async with self._redis.pipeline(transaction=False) as pipe:
                for tag, index in wanted:
                    pipe.hgetall(self._key(tag, index))
                replies = await pipe.execute()
        fresh: dict[tuple[str, int], Counts] = {}
        for place, fields in zip(wanted, replies, strict=True):
            others = Counts(alpha)  # every replica but this one, whose totals are in memory
            for replica, packed in fields.items():
                if _text(replica) != self.replica:
                    _unpack_into(others, packed)
            if place[1] < open_from:
                self._closed[place] = others
            else:
                fresh[place] = others
        merged: dict[str, Counts] = {}
        recent: dict[str, Counts] = {}
        recent_from = window.stop - RECENT_SLICES
        for tag in tags:
            total = merged[tag] = Counts(alpha)
            latest = recent[tag] = Counts(alpha)
            for index in window:
                for found in (
                    (self._closed if index < open_from else fresh).get((tag, index)),
                    local.peek(tag, index),
                ):
                    if found is not None:
                        total.merge(found)
                        if index >= recent_from:
                            latest.merge(found)
        return merged, recent

    async def forget_topology(self) -> None:
        """Cluster only: make the next call re-read the slot map. A cluster client that does not
        retry never does so by itself, so after a failover it would keep calling the dead primary;
        closed, it drops its connections and rediscovers nodes and slots on its next call."""
        if isinstance(self._redis, RedisCluster):
            try:
                async with asyncio.timeout(self._timeout_s):
                    await self._redis.aclose()
            except Exception as exc:  # the next call tries again anyway
                logger.debug("latency store: closing the cluster client failed (%r)", exc)


def _pack(counts: Counts) -> bytes:
    """A replica's totals for one slice, as stored in its hash field."""
    return orjson.dumps(
        {
            "r": counts.requests,
            "e": counts.errors,
            "h": counts.hedges,
            "c": counts.clients,
            "s": counts.slo,
            "w": [counts.wasted, counts.wasted_tokens],
            "o": counts.output_tokens,
            "on": counts.outputs,
            **{metric: sketch.buckets for metric, sketch in counts.sketches.items()},
            # Censored observations ("more than t"), by metric; absent when there are none, so
            # replicas that predate them read the field unchanged.
            **{
                f"{metric}>": sketch.censored_buckets
                for metric, sketch in counts.sketches.items()
                if sketch.censored_count
            },
            # TTFT by prompt-size band: exact and censored buckets, and the sizes summed.
            "b": {
                band: [
                    counts_.sketch.buckets,
                    counts_.sketch.censored_buckets,
                    counts_.bytes,
                    counts_.total.buckets,
                    counts_.total.censored_buckets,
                ]
                for band, counts_ in counts.bands.items()
            },
        },
        option=orjson.OPT_NON_STR_KEYS,
    )


def _unpack_into(counts: Counts, packed: str | bytes) -> None:
    try:
        data = orjson.loads(packed)
        counts.requests += int(data.get("r", 0))
        counts.errors += int(data.get("e", 0))
        counts.hedges += int(data.get("h", 0))
        counts.clients += int(data.get("c", 0))
        slo = [*(data.get("s") or ()), 0, 0, 0, 0, 0, 0][:6]
        counts.slo = [a + int(b) for a, b in zip(counts.slo, slo, strict=True)]
        wasted, wasted_tokens = data.get("w") or (0, 0)
        counts.wasted += int(wasted)
        counts.wasted_tokens += int(wasted_tokens)
        counts.output_tokens += int(data.get("o", 0))
        counts.outputs += int(data.get("on", 0))
        for metric in METRICS:
            sketch = counts.sketches[metric]
            for key, n in (data.get(metric) or {}).items():
                sketch.add_key(int(key), int(n))
            for key, n in (data.get(f"{metric}>") or {}).items():
                sketch.add_censored_key(int(key), int(n))
        for band, (exact, cut, size, *total) in (data.get("b") or {}).items():
            into = counts.band(int(band))
            into.bytes += int(size)
            for sketch, (exact_, cut_) in ((into.sketch, (exact, cut)), (into.total, total)):
                for key, n in exact_.items():
                    sketch.add_key(int(key), int(n))
                for key, n in cut_.items():
                    sketch.add_censored_key(int(key), int(n))
    except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError):
        logger.warning("latency store: ignoring a malformed entry in Redis")


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value

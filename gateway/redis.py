"""Redis connections, and when to call Redis, shared by the latency store, the rate limiter and
the stored responses.

`parse_redis_url` checks a URL and says which topology it names (a standalone Redis, a
Sentinel-managed one or a Redis Cluster); `connect_redis` builds a client for it with short
timeouts, no retries and a small pool. `Breaker` decides when Redis may be called after a
failure, and `Deadline` when a call has waited long enough. Nothing here talks to Redis: the
callers own what their commands mean and what to do without them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal
from urllib.parse import parse_qsl, unquote

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import BlockingConnectionPool, parse_url
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff

__all__ = [
    "Breaker",
    "Deadline",
    "RedisClient",
    "RedisTarget",
    "RedisTopology",
    "Ticket",
    "connect_redis",
    "max_wait_s",
    "parse_redis_url",
]

log = logging.getLogger(__name__)

RedisClient = Redis | RedisCluster
"""What the callers talk to: a standalone or Sentinel-managed Redis, or a Redis Cluster."""

RedisTopology = Literal["standalone", "sentinel", "cluster"]
_STANDALONE_SCHEMES = ("redis", "rediss", "unix")
_SENTINEL_SCHEME = "redis+sentinel"
_CLUSTER_SCHEME = "redis+cluster"
_SCHEMES = "redis://, rediss://, unix://, redis+sentinel:// or redis+cluster://"


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """A parsed Redis URL (see `parse_redis_url`); `repr` leaves the credentials out."""

    topology: RedisTopology
    nodes: tuple[tuple[str, int], ...] = ()  # the sentinels, or the cluster's startup nodes
    service: str | None = None  # the master's name at the sentinels
    db: int = 0
    username: str | None = field(default=None, repr=False)
    password: str | None = field(default=None, repr=False)
    sentinel_password: str | None = field(default=None, repr=False)


def parse_redis_url(url: str) -> RedisTarget:
    """Check a Redis URL and say which topology it names. Accepted forms:

    - `redis://[[user]:password@]host[:port][/db]`, `rediss://...` (TLS), `unix://[[user]:
      password@]/path.sock[?db=N]`: one Redis server (redis-py's own URL syntax, query included);
    - `redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db]
      [?sentinel_password=password]`: the master that the Sentinels at `host:port` (default port
      26379) know as `service`; the credentials are the master's, `sentinel_password` (if the
      Sentinels themselves require one) the Sentinels';
    - `redis+cluster://[[user]:password@]host[:port][,host[:port]...][/]`: a Redis Cluster
      discovered from these startup nodes (default port 6379); database 0 only.

    User names and passwords are percent-decoded (encode `@`, `:`, `/`, `,` and `%` in them). An
    IPv6 host is written in brackets, `[::1]:26379`. Raises ValueError with a message that never
    repeats the URL or any part of its credentials.
    """
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in (*_STANDALONE_SCHEMES, _SENTINEL_SCHEME, _CLUSTER_SCHEME):
        raise ValueError(f"Redis URL: unsupported scheme; expected {_SCHEMES}")
    if scheme in _STANDALONE_SCHEMES:
        try:
            parse_url(url)
        except ValueError as exc:
            raise ValueError(f"Redis URL: {_safe_reason(exc, rest)}") from None
        return RedisTarget("standalone")
    # The host list holds commas, which urlsplit's port parsing would reject: split by hand.
    location, _, query = rest.partition("?")
    location, hash_, _ = location.partition("#")
    if hash_:
        raise ValueError("Redis URL: a fragment (#...) is not allowed")
    credentials, at, location = location.rpartition("@")
    hosts, slash, path = location.partition("/")
    if at and "/" in credentials:
        raise ValueError("Redis URL: percent-encode '/' in the user name or password (%2F)")
    username, colon, password = credentials.partition(":")
    options = _query(query, allowed=("sentinel_password",) if scheme == _SENTINEL_SCHEME else ())
    default_port = 26379 if scheme == _SENTINEL_SCHEME else 6379
    target = RedisTarget(
        "standalone",  # replaced below
        nodes=_nodes(hosts, default_port),
        username=unquote(username) or None,
        password=unquote(password) if colon and password else None,
        sentinel_password=options.get("sentinel_password") or None,
    )
    parts = [unquote(p) for p in path.split("/")] if slash else []
    if parts and not parts[-1]:
        parts.pop()  # a trailing slash
    if scheme == _CLUSTER_SCHEME:
        if parts not in ([], ["0"]):
            raise ValueError("Redis URL: a Redis Cluster has database 0 only; leave the path empty")
        return replace(target, topology="cluster")
    if not parts or not parts[0]:
        raise ValueError(
            "Redis URL: name the master after the sentinels, redis+sentinel://host:port/<service>"
        )
    if len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise ValueError(
            "Redis URL: the path after the sentinels is /<service>[/<db>], db a number"
        )
    db = int(parts[1]) if len(parts) == 2 else 0
    return replace(target, topology="sentinel", service=parts[0], db=db)


def _nodes(hosts: str, default_port: int) -> tuple[tuple[str, int], ...]:
    """`host[:port],...` as pairs. Errors name the node by position: text around an unencoded
    special character in a password could end up here, so none of it is repeated."""
    found: list[tuple[str, int]] = []
    items = hosts.split(",")
    for number, item in enumerate(items, 1):
        where = f"node {number} of {len(items)}"
        if item.startswith("["):  # [IPv6]:port
            host, closed, after = item[1:].partition("]")
            if not closed or (after and not after.startswith(":")):
                raise ValueError(f"Redis URL: {where}: expected [IPv6 address]:port")
            port_text = after[1:]
        else:
            host, _, port_text = item.partition(":")
            if ":" in port_text:
                raise ValueError(f"Redis URL: {where}: write an IPv6 address in brackets")
        if not host:
            raise ValueError(f"Redis URL: {where}: no host (expected host:port,host:port)")
        if port_text and not (port_text.isdigit() and 0 < int(port_text) < 65536):
            raise ValueError(f"Redis URL: {where}: the port is not a number from 1 to 65535")
        found.append((host, int(port_text) if port_text else default_port))
    return tuple(found)


def _query(query: str, allowed: tuple[str, ...]) -> dict[str, str]:
    options = dict(parse_qsl(query, keep_blank_values=True))
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        accepted = f"only {', '.join(allowed)} is accepted" if allowed else "none is accepted"
        raise ValueError(f"Redis URL: unknown query parameter {unknown[0]!r} ({accepted})")
    return options


def _safe_reason(exc: ValueError, rest: str) -> str:
    """redis-py's reason for rejecting a URL, unless it might quote part of the credentials."""
    reason = str(exc)
    credentials = rest.partition("?")[0].rpartition("@")[0]
    if any(piece and piece in reason for piece in re.split(r"[:/]", credentials)):
        return "cannot parse it (percent-encode special characters in the password)"
    return reason


class _SentinelMaster(Redis):
    """The master's client from `Sentinel.master_for`. The clients it asks for the master's
    address have connections of their own: closing the master's client closes them too."""

    sentinels: tuple[Redis, ...] = ()

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        try:
            await super().aclose(close_connection_pool)
        finally:
            for sentinel in self.sentinels:
                await sentinel.aclose()


def connect_redis(
    url: str,
    *,
    timeout_s: float = 0.25,
    max_connections: int = 4,
    wait_for_connection: bool = False,
) -> RedisClient:
    """A client suited to the latency store and the rate limiter: short timeouts, no retries
    (the caller's breaker decides when to try again) and a small pool (per node, for a
    cluster), so an outage cannot cause a connection storm. The URL picks the topology: see
    `parse_redis_url`.

    Nothing is connected yet. The caller owns the client and must `await client.aclose()`.
    Raises ValueError (a message without the URL's secrets) when the URL is not usable.
    With `wait_for_connection`, a call finding every pooled connection busy waits (up to
    `timeout_s`) for one instead of failing at once: for callers on the request path.
    """
    target = parse_redis_url(url)
    if target.topology == "standalone" and wait_for_connection:
        pool = BlockingConnectionPool.from_url(
            url,
            timeout=timeout_s,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            max_connections=max_connections,
            retry=Retry(NoBackoff(), 0),
        )
        return Redis.from_pool(pool)  # the client closes its pool
    if target.topology == "standalone":
        return Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            max_connections=max_connections,
            retry=Retry(NoBackoff(), 0),
        )
    if target.topology == "cluster":
        # Without retries the client never re-reads the slot map by itself after a failover;
        # the latency store closes it after a failure so that the next call does.
        return RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in target.nodes],
            username=target.username,
            password=target.password,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            max_connections=max_connections,
            retry=Retry(NoBackoff(), 0),
        )
    assert target.service is not None  # parse_redis_url requires it
    timeouts: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": Retry(NoBackoff(), 0),
        "max_connections": max_connections,
    }
    sentinel = Sentinel(  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
        target.nodes,
        sentinel_kwargs={**timeouts, "password": target.sentinel_password},
        username=target.username,
        password=target.password,
        db=target.db,
        **timeouts,
    )
    # A master's connection asks the sentinels where the master is whenever it (re)connects, so
    # a failover is followed on the first call after the caller's breaker lets it try again.
    master = sentinel.master_for(target.service, redis_class=_SentinelMaster)
    assert isinstance(master, _SentinelMaster)
    master.sentinels = tuple(sentinel.sentinels)
    return master


def max_wait_s(timeout_s: float) -> float:
    """The longest a check may wait on Redis while the loop is late: 10x the timeout, at most
    1 s more than it."""
    return timeout_s + min(9 * timeout_s, 1.0)


class Deadline:
    """Expires an `asyncio.timeout` scope once Redis has had `timeout_s` to answer, counted
    while this process's event loop could have read the answer.

    A plain timeout counts the loop's own lag: on a saturated or briefly blocked loop the timer
    fires after Redis's answer arrived but before the loop read it (and redis-py's
    socket_timeout is the same kind of asyncio timer, so it cannot tell them apart either). A
    timer that fires more than a tenth of the timeout late says the loop, not Redis, was slow:
    since that loop turn has already polled the sockets, an answer that arrived meanwhile is
    being read, so the wait is extended by the timeout, counted from now, up to `max_wait_s`.
    A timer that fires on time expires the scope on the loop's next turn, so that an answer
    read on this one still wins.
    """

    __slots__ = ("_due", "_give_up_at", "_handle", "_loop", "_scope", "_timeout_s", "extended")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, scope: asyncio.Timeout, timeout_s: float
    ) -> None:
        now = loop.time()
        self._loop = loop
        self._scope = scope
        self._timeout_s = timeout_s
        self._due = now + timeout_s
        self._give_up_at = now + max_wait_s(timeout_s)
        self._handle = loop.call_at(self._due, self._fire)
        self.extended = 0

    def _fire(self) -> None:
        now = self._loop.time()
        if now - self._due > self._timeout_s / 10 and self._due < self._give_up_at:
            self.extended += 1
            self._due = min(now + self._timeout_s, self._give_up_at)
            self._handle = self._loop.call_at(self._due, self._fire)
        else:
            self._scope.reschedule(now)

    def cancel(self) -> None:
        self._handle.cancel()


class Ticket:
    """One call to Redis the breaker let through; hand it back with how the call went."""

    __slots__ = ("outage", "probe")

    def __init__(self, outage: int, probe: bool) -> None:
        self.outage = outage  # the breaker's openings when the call began
        self.probe = probe  # the half-open breaker's one probe


class Breaker:
    """Whether Redis may be called now. Every caller of Redis (the latency store, the rate
    limiter, the stored responses) asks it before a call and tells it how the call went.

    Closed, every call goes. A failure opens it for a jittered back-off that starts at
    `backoff_min_s` and doubles with each opening, up to `backoff_max_s`. It opens once per
    outage: a failure of a call begun before the latest opening is the same outage (calls in
    flight when Redis stops answering fail together), and a success of such a call proves
    nothing about now. Once the back-off is over the breaker is half-open: one call probes Redis
    while the others are turned away at once; a probe that fails opens it again for twice as
    long, one that succeeds closes it.

    What differs between the callers is a parameter: the back-off's bounds, the jitter (a
    factor drawn from `jitter` multiplies each back-off, so that replicas which failed together
    do not come back in the same instant), and what the log says the caller does meanwhile
    (`fallback`). Each opening is logged with the exception's type only (a message could quote
    an address or credentials), and the recovery once.
    """

    __slots__ = (
        "_backoff_s",
        "_clock",
        "_failures",
        "_jitter",
        "_max_s",
        "_min_s",
        "_probing",
        "_retry_at",
        "_ticket",
        "_uniform",
        "fallback",
        "last_error",
        "name",
        "outages",
    )

    def __init__(
        self,
        name: str,
        *,
        fallback: str,
        backoff_min_s: float = 0.5,
        backoff_max_s: float = 10.0,
        jitter: tuple[float, float] = (0.8, 1.2),
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.name = name  # who calls Redis, as the log names it
        self.fallback = fallback  # what it does while the breaker is open
        self._min_s = backoff_min_s
        self._max_s = backoff_max_s
        self._jitter = jitter
        self._clock = clock
        self._uniform = (rng or random).uniform
        self._backoff_s = 0.0  # 0: closed
        self._retry_at = -math.inf
        self._probing = False
        self._failures = 0  # failed calls in this outage
        self.outages = 0  # times the breaker opened
        self.last_error: str | None = None  # the exception type of the latest failure
        self._ticket = Ticket(0, False)  # every call's while closed: none is a probe

    @property
    def degraded(self) -> bool:
        """From an opening until a call finds Redis answering again."""
        return self._backoff_s > 0

    @property
    def state(self) -> Literal["ok", "degraded"]:
        return "degraded" if self._backoff_s > 0 else "ok"

    def wait_s(self) -> float:
        """Seconds until the next probe may go (0: now, or closed)."""
        return max(0.0, self._retry_at - self._clock()) if self._backoff_s > 0 else 0.0

    def ask(self) -> Ticket | None:
        """A ticket for one call now, or None: leave Redis alone (open, or a probe is out)."""
        if not self._backoff_s:
            return self._ticket
        if self._probing or self._clock() < self._retry_at:
            return None
        self._probing = True
        return Ticket(self.outages, True)

    def force(self) -> Ticket:
        """A ticket for a call made whatever the breaker says (an explicit or final flush); it is
        not the probe, but its success closes the breaker all the same."""
        return self._ticket

    def retry_now(self) -> None:
        """End the back-off: the next call probes (the state is unchanged)."""
        self._retry_at = -math.inf

    def failed(self, ticket: Ticket, exc: BaseException) -> None:
        """The call failed: opens the breaker, unless this outage opened it already."""
        if ticket.probe:
            self._probing = False
        self._failures += 1
        self.last_error = type(exc).__name__
        if ticket.outage != self.outages:
            return
        self.outages += 1
        self._ticket = Ticket(self.outages, False)
        self._backoff_s = min(self._max_s, max(self._min_s, self._backoff_s * 2))
        wait_s = self._backoff_s * self._uniform(*self._jitter)
        self._retry_at = self._clock() + wait_s
        log.warning(
            "%s: Redis failed (%s); %s for %.1f s",
            self.name,
            self.last_error,
            self.fallback,
            wait_s,
        )

    def succeeded(self, ticket: Ticket) -> None:
        """The call succeeded: closes the breaker, unless it opened while the call was out."""
        if ticket.probe:
            self._probing = False
        if self._backoff_s and ticket.outage == self.outages:
            log.warning("%s: Redis is back (%d failed calls)", self.name, self._failures)
            self._backoff_s = 0.0
            self._retry_at = -math.inf
            self._failures = 0

    def abandoned(self, ticket: Ticket) -> None:
        """The call ended neither way (cancelled): the probe is free for the next call."""
        if ticket.probe:
            self._probing = False

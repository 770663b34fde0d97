"""The shared latency store on every Redis topology `latency.redis_url` can name: a standalone
server, a Sentinel-managed master and a Redis Cluster, each started for real on loopback."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest
import redis
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import SSLConnection, UnixDomainSocketConnection
from redis.crc import key_slot

from gateway.latency import TTFT_DEADLINE, RedisLatencyStore, Sample
from gateway.redis import RedisClient, connect_redis, parse_redis_url
from tests.conftest import free_port
from tests.latency.test_store import Clock, failed, ok, same_numbers
from tests.timing import eventually_sync, scaled

PASSWORD = "tg-Data-Pa55"  # what the test servers require
SENTINEL_PASSWORD = "tg-Sentinel-Pa55"
SECRET = "hunter2-SECRET-pw"  # a wrong password


# --- real servers -------------------------------------------------------------------------------


def binary(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed: the Redis topology tests need real servers")
    return found


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """Poll `check` until it holds; fail naming `what` after `timeout_s`."""

    def holds() -> bool:
        try:
            return check()
        except (redis.RedisError, OSError):
            return False  # not up yet

    eventually_sync(holds, within_s=timeout_s, what=what)


def sync_client(port: int, password: str = PASSWORD) -> redis.Redis:
    return redis.Redis(port=port, password=password, socket_timeout=1.0, decode_responses=True)


class Processes:
    """Servers started by one fixture, each terminated and waited for at the end."""

    def __init__(self) -> None:
        self.running: dict[int, subprocess.Popen[bytes]] = {}
        self._dir = tempfile.TemporaryDirectory(prefix="tg-redis-")
        self.dir = Path(self._dir.name)

    def start(self, port: int, *args: str, password: str = PASSWORD) -> None:
        self.running[port] = subprocess.Popen(
            [binary("redis-server"), *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        process = self.running[port]

        def up() -> bool:
            if process.poll() is not None:
                raise AssertionError(f"redis-server on port {port} exited ({process.returncode})")
            with sync_client(port, password) as client:
                return bool(client.ping())

        wait_for(up, f"redis-server on port {port}")

    def kill(self, port: int) -> None:
        """SIGKILL, as in a crash."""
        process = self.running.pop(port)
        process.kill()
        process.wait(timeout=10)

    def close(self) -> None:
        for process in self.running.values():
            process.terminate()
        for process in self.running.values():
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        self.running.clear()
        self._dir.cleanup()


def cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) exists and is free too."""
    while True:
        port = free_port()
        if port + 10000 <= 65535:
            try:
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
            return port


def start_cluster_node(processes: Processes, port: int) -> None:
    processes.start(
        port,
        *("--port", str(port), "--bind", "127.0.0.1", "--dir", str(processes.dir)),
        *("--cluster-enabled", "yes"),
        *("--cluster-config-file", str(processes.dir / f"nodes-{port}.conf")),
        # Short, so that a killed primary's replica takes over within a test's time.
        *("--cluster-node-timeout", "500"),
        *("--requirepass", PASSWORD, "--masterauth", PASSWORD),
        *("--save", "", "--appendonly", "no", "--daemonize", "no"),
    )


def cluster_ok(port: int) -> bool:
    with sync_client(port) as client:
        return bool(client.execute_command("CLUSTER INFO")["cluster_state"] == "ok")


@dataclass
class Cluster:
    processes: Processes
    ports: list[int]

    @property
    def url(self) -> str:
        return f"redis+cluster://:{PASSWORD}@" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def owner(self, key: str, via: int | None = None) -> int:
        """The port of the primary that serves `key`'s slot, as node `via` sees it."""
        slot = key_slot(key.encode())
        with sync_client(self.ports[0] if via is None else via) as client:
            for start, end, primary, *_ in client.execute_command("CLUSTER SLOTS"):
                if start <= slot <= end:
                    return int(primary[1])
        raise AssertionError(f"no node serves slot {slot}")

    def keys_by_node(self, pattern: str) -> dict[int, int]:
        counts = {}
        for port in self.ports:
            if port in self.processes.running:
                with sync_client(port) as client:
                    counts[port] = sum(1 for _ in client.scan_iter(match=pattern))
        return counts


def create_cluster(processes: Processes, ports: list[int]) -> Cluster:
    """Three primaries, no replicas, joined by `redis-cli --cluster create`."""
    for port in ports:
        start_cluster_node(processes, port)
    subprocess.run(
        [
            binary("redis-cli"),
            *("--cluster", "create", *(f"127.0.0.1:{p}" for p in ports)),
            *("--cluster-replicas", "0", "--cluster-yes"),
        ],
        check=True,
        capture_output=True,
        timeout=30,
        env={**os.environ, "REDISCLI_AUTH": PASSWORD},
    )
    for port in ports:
        wait_for(partial(cluster_ok, port), f"cluster_state:ok on {port}")
    return Cluster(processes, ports)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A 3-primary Redis Cluster shared by the tests that do not break it (each uses its own key
    prefix)."""
    binary("redis-server")
    processes = Processes()
    try:
        yield create_cluster(processes, [cluster_port() for _ in range(3)])
    finally:
        processes.close()


@pytest.fixture
def cluster_with_replica() -> Iterator[tuple[Cluster, int, int]]:
    """A cluster whose primary for `{d1}` has a replica: (cluster, primary, replica ports)."""
    binary("redis-server")
    processes = Processes()
    try:
        made = create_cluster(processes, [cluster_port() for _ in range(3)])
        primary = made.owner("tg:lat:{d1}:0")
        yield made, primary, add_replica(processes, primary)
    finally:
        processes.close()


def add_replica(processes: Processes, primary: int) -> int:
    """A new cluster node made `primary`'s replica, once it has synced: its port."""
    replica = cluster_port()
    start_cluster_node(processes, replica)
    with sync_client(primary) as client:
        primary_id = client.execute_command("CLUSTER MYID")
    with sync_client(replica) as client:
        client.execute_command("CLUSTER MEET", "127.0.0.1", str(primary))
        wait_for(lambda: primary_id in client.execute_command("CLUSTER", "NODES"), "the meet")
        client.execute_command("CLUSTER REPLICATE", primary_id)
        wait_for(
            lambda: client.info("replication")["master_link_status"] == "up",
            "the replica to sync",
        )
    return replica


@dataclass
class SentinelSetup:
    processes: Processes
    master: int
    sentinel: int

    @property
    def url(self) -> str:
        return (
            f"redis+sentinel://:{PASSWORD}@127.0.0.1:{self.sentinel}/mymaster"
            f"?sentinel_password={SENTINEL_PASSWORD}"
        )


@pytest.fixture(scope="module")
def sentinel() -> Iterator[SentinelSetup]:
    """One master and one Sentinel monitoring it (quorum 1) as `mymaster`."""
    binary("redis-server")
    processes = Processes()
    try:
        master, port = free_port(), free_port()
        processes.start(
            master,
            *("--port", str(master), "--bind", "127.0.0.1", "--dir", str(processes.dir)),
            *("--save", "", "--appendonly", "no", "--requirepass", PASSWORD),
        )
        conf = processes.dir / "sentinel.conf"  # a Sentinel rewrites its file: a fresh one
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {processes.dir}\n"
            f"requirepass {SENTINEL_PASSWORD}\n"
            f"sentinel monitor mymaster 127.0.0.1 {master} 1\n"
            f"sentinel auth-pass mymaster {PASSWORD}\n"
        )
        processes.start(port, str(conf), "--sentinel", password=SENTINEL_PASSWORD)

        def knows_master() -> bool:
            with sync_client(port, SENTINEL_PASSWORD) as client:
                state = client.sentinel_master("mymaster")
                return bool(state["is_master"] and not state["is_sdown"])

        wait_for(knows_master, "the sentinel to see the master")
        yield SentinelSetup(processes, master, port)
    finally:
        processes.close()


@asynccontextmanager
async def connected(url: str) -> AsyncIterator[RedisClient]:
    client = connect_redis(url)
    try:
        yield client
    finally:
        await client.aclose()


def replica(client: RedisClient, clock: Clock, prefix: str) -> RedisLatencyStore:
    return RedisLatencyStore(
        client, window_s=60, slice_s=5, min_samples=5, clock=clock, prefix=prefix
    )


async def share_between_replicas(url: str, prefix: str) -> None:
    """What `test_a_replica_sees_what_another_flushed` checks on a standalone Redis: samples
    recorded only in replica A reach replica B with identical numbers."""
    clock = Clock()
    async with connected(url) as ra, connected(url) as rb:
        # Warm both clients first (for a cluster: discover the slot map): the store's short
        # timeouts are for a warm client, and a loaded machine can take longer to discover.
        async with asyncio.timeout(scaled(10)):
            await ra.ping()
            await rb.ping()
        a, b = replica(ra, clock, prefix), replica(rb, clock, prefix)
        for i in range(200):
            a.record(ok("d1", "chat", ttft_ms=50 + i * 5))
            a.record(ok("d2", "chat", ttft_ms=300))
        a.record(failed("d1", "chat"))
        a.record(Sample("d2", "chat", ok=False, total_s=1.5, error=TTFT_DEADLINE))
        a.record(Sample("d3", "alt", ok=True, total_s=0.5, output_tokens=9, hedge_for="chat"))
        clock.now += 7  # into the next slice: the window spans two slices
        a.record(ok("d1", "chat", ttft_ms=80))
        await a.flush()
        assert (a.state, a.last_error, a.pending_fields) == ("ok", None, 0)
        shared = await b.refresh()
        assert (shared.source, b.state) == ("redis", "ok")
        assert shared.deployments["d1"].requests == 202
        assert shared.deployments["d2"].ttft.count == 201
        assert shared.models["chat"].errors == 2
        assert (shared.models["chat"].hedges, shared.models["alt"].output_tokens) == (1, 9)
        same_numbers(shared, a.local_snapshot())


# --- Redis Cluster ------------------------------------------------------------------------------


async def test_cluster_replicas_share_samples_across_nodes(cluster: Cluster) -> None:
    """Through `redis+cluster://`, two replicas share samples exactly as on one server, with the
    per-deployment hashes and the index spread over several primaries."""
    async with connected(cluster.url) as client:
        assert isinstance(client, RedisCluster)
    await share_between_replicas(cluster.url, "share")
    holding = {port: n for port, n in cluster.keys_by_node("share:lat:*").items() if n}
    assert len(holding) >= 2, holding
    # 3 deployments and 2 model names, 2 slices each, and the index
    # d1 and `chat` got samples in two slices, d2, d3 and `alt` in one; and the index
    assert sum(holding.values()) == 7 + 1


async def test_cluster_client_is_built_from_the_url_alone(cluster: Cluster) -> None:
    """One startup node is enough: the others are discovered."""
    await share_between_replicas(
        f"redis+cluster://:{PASSWORD}@127.0.0.1:{cluster.ports[-1]}", "one-node"
    )


async def test_cluster_failover_is_followed_without_client_retries(
    cluster_with_replica: tuple[Cluster, int, int], caplog: pytest.LogCaptureFixture
) -> None:
    """The client does not retry, so it never re-reads the slot map by itself: after a primary
    dies and its replica takes over, the store must still find the new primary once its breaker
    lets it try again (it closes the client after a failure so the topology is rediscovered)."""
    made, primary, promoted = cluster_with_replica
    clock = Clock()
    async with connected(made.url) as ra, connected(made.url) as rb:
        a, b = replica(ra, clock, "tg"), replica(rb, clock, "tg")
        a.record(ok("d1", "chat"))
        await a.flush()
        assert a.state == "ok"

        made.processes.kill(primary)
        a.record(ok("d1", "chat"))
        started = time.monotonic()
        await a.flush()
        assert time.monotonic() - started < scaled(1.0)  # short timeouts, no retries
        assert (a.state, a.flush_failures) == ("degraded", 1)

        def every_node_sees_the_new_primary() -> bool:
            survivors = [*made.processes.running]
            return all(
                cluster_ok(port) and made.owner("tg:lat:{d1}:0", via=port) == promoted
                for port in survivors
            )

        wait_for(every_node_sees_the_new_primary, "the replica to take over")
        for _ in range(4):  # past the longest jittered backoff each time; all within the window
            clock.now += 10.0 * 1.2
            await a.flush()
            if a.state == "ok":
                break
        assert (a.state, a.pending_fields) == ("ok", 0)
        for _ in range(4):  # a read a busy machine timed out opens b's breaker: wait it out
            shared = (await b.refresh()).deployments.get("d1")
            if shared is not None:
                break
            clock.now += 10.0 * 1.2
        assert shared is not None and shared.requests == 2
        assert "Redis failed" in caplog.text
        assert PASSWORD not in caplog.text + repr(a.health())


async def test_cluster_password_stays_out_of_logs_and_health(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """A refused password (these nodes have none) degrades the store; neither the log, nor
    `last_error`, nor the health report repeats it."""
    url = f"redis+cluster://:{SECRET}@127.0.0.1:{cluster.ports[0]}"
    caplog.set_level(logging.DEBUG)
    async with connected(url) as client:
        store = replica(client, Clock(), "secret")
        store.record(ok())
        await store.flush()
        await store.refresh()
        assert store.state == "degraded"
        shown = repr(store.health()) + str(store.last_error) + caplog.text + repr(client)
        assert caplog.text  # the failure was logged...
        assert SECRET not in shown  # ...without the password


# --- Sentinel -----------------------------------------------------------------------------------


async def test_sentinel_replicas_share_samples_through_the_master(
    sentinel: SentinelSetup,
) -> None:
    """Through `redis+sentinel://`, the store finds the master via the Sentinel and two replicas
    share samples exactly as on one server."""
    async with connected(sentinel.url) as client:
        assert isinstance(client, Redis)
        assert await client.ping()
    await share_between_replicas(sentinel.url, "sentinel")
    with sync_client(sentinel.master) as client:
        assert client.zcard("sentinel:lat:index") == 5


@pytest.mark.parametrize(
    ("master_password", "sentinel_password"),
    [(SECRET, SENTINEL_PASSWORD), (PASSWORD, SECRET)],
    ids=["wrong-master-password", "wrong-sentinel-password"],
)
async def test_sentinel_passwords_stay_out_of_logs_and_health(
    sentinel: SentinelSetup,
    caplog: pytest.LogCaptureFixture,
    master_password: str,
    sentinel_password: str,
) -> None:
    """A password the master or the Sentinel refuses degrades the store; neither that password
    nor the other one is repeated in the log, `last_error` or the health report."""
    url = (
        f"redis+sentinel://user:{master_password}@127.0.0.1:{sentinel.sentinel}/mymaster"
        f"?sentinel_password={sentinel_password}"
    )
    caplog.set_level(logging.DEBUG)
    async with connected(url) as client:
        store = replica(client, Clock(), "secret")
        store.record(ok())
        await store.flush()
        await store.refresh()
        assert (store.state, store.flush_failures, store.refresh_failures) == ("degraded", 1, 0)
        shown = repr(store.health()) + str(store.last_error) + caplog.text + repr(client)
        assert caplog.text  # the failure was logged...
        for secret in (SECRET, PASSWORD, SENTINEL_PASSWORD):
            assert secret not in shown  # ...without a password


async def test_unknown_sentinel_service_degrades_fast(sentinel: SentinelSetup) -> None:
    """A service the Sentinel does not know fails open, within the store's timeout."""
    url = f"redis+sentinel://127.0.0.1:{sentinel.sentinel}/nosuchmaster"
    async with connected(url) as client:
        store = replica(client, Clock(), "nomaster")
        store.record(ok())
        started = time.monotonic()
        await store.flush()
        assert time.monotonic() - started < 1.0
        assert (store.state, store.last_error) == ("degraded", "MasterNotFoundError")


# --- URLs ---------------------------------------------------------------------------------------


async def test_each_scheme_builds_its_client() -> None:
    """Standalone schemes keep redis-py's parser; Sentinel and Cluster URLs get their clients,
    all with the same short timeouts and no retries. Nothing connects yet."""
    made: list[RedisClient] = []
    try:
        for url, connection_class in (
            ("redis://127.0.0.1:6390/2", None),
            ("rediss://:pw@example.com:6390/0", SSLConnection),
            ("unix:///tmp/redis.sock?db=1", UnixDomainSocketConnection),
        ):
            client = connect_redis(url)
            made.append(client)
            assert isinstance(client, Redis)
            kwargs = client.connection_pool.connection_kwargs
            assert (kwargs["socket_timeout"], kwargs["socket_connect_timeout"]) == (0.25, 0.25)
            assert kwargs["retry"].get_retries() == 0
            if connection_class is not None:
                assert client.connection_pool.connection_class is connection_class

        client = connect_redis("redis+sentinel://u:p%40ss@10.0.0.1,10.0.0.2:26380/mymaster/3")
        made.append(client)
        assert isinstance(client, Redis)
        pool = client.connection_pool
        assert pool.service_name == "mymaster"  # type: ignore[attr-defined]
        kwargs = pool.connection_kwargs
        assert (kwargs["username"], kwargs["password"], kwargs["db"]) == ("u", "p@ss", 3)
        assert (kwargs["socket_timeout"], kwargs["retry"].get_retries()) == (0.25, 0)
        sentinels = [
            s.connection_pool.connection_kwargs
            for s in pool.sentinel_manager.sentinels  # type: ignore[attr-defined]
        ]
        assert [(s["host"], s["port"]) for s in sentinels] == [
            ("10.0.0.1", 26379),
            ("10.0.0.2", 26380),
        ]
        assert all(s["socket_timeout"] == 0.25 and s["password"] is None for s in sentinels)

        client = connect_redis("redis+cluster://:pw@10.0.0.1:7000,10.0.0.2")
        made.append(client)
        assert isinstance(client, RedisCluster)
        assert [n.name for n in client.startup_nodes] == ["10.0.0.1:7000", "10.0.0.2:6379"]
        assert client.retry.get_retries() == 0
        kwargs = client.connection_kwargs
        assert (kwargs["password"], kwargs["socket_timeout"], kwargs["max_connections"]) == (
            "pw",
            0.25,
            4,
        )
    finally:
        for client in made:
            await client.aclose()


def test_url_forms_parse() -> None:
    """Default ports, IPv6 in brackets, percent-decoded credentials, a trailing slash."""
    target = parse_redis_url("redis+sentinel://[::1],h2:1/my%20master/")
    assert (target.topology, target.nodes) == ("sentinel", (("::1", 26379), ("h2", 1)))
    assert (target.service, target.db, target.password) == ("my master", 0, None)
    target = parse_redis_url(f"redis+sentinel://:{SECRET}@h/m?sentinel_password=s%2Fp")
    assert (target.password, target.sentinel_password, target.username) == (SECRET, "s/p", None)
    assert SECRET not in repr(target)
    target = parse_redis_url("REDIS+CLUSTER://a:7001,[fe80::1]:7002/0")
    assert (target.topology, target.nodes) == ("cluster", (("a", 7001), ("fe80::1", 7002)))
    assert parse_redis_url("rediss://:x@h:1/0").topology == "standalone"


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        (f"http://:{SECRET}@host:6379", "unsupported scheme"),
        (f"{SECRET}", "unsupported scheme"),
        (f"redis+sentinel://:{SECRET}@h1:26379", "name the master"),
        (f"redis+sentinel://:{SECRET}@h1:26379/", "name the master"),
        (f"redis+sentinel://:{SECRET}@h1:26379/m/notadb", "/<service>[/<db>]"),
        (f"redis+sentinel://:{SECRET}@h1:26379/m/1/2", "/<service>[/<db>]"),
        (f"redis+sentinel://:{SECRET}@h1:port/m", "node 1 of 1: the port"),
        (f"redis+sentinel://:{SECRET}@h1,h2:99999/m", "node 2 of 2: the port"),
        (f"redis+sentinel://:{SECRET}@h1,,h2/m", "node 2 of 3: no host"),
        (f"redis+sentinel://:{SECRET}@h1/m?password={SECRET}", "unknown query parameter"),
        (f"redis+cluster://:{SECRET}@::1:7000", "IPv6 address in brackets"),
        (f"redis+cluster://:{SECRET}@[::1:7000", "[IPv6 address]:port"),
        (f"redis+cluster://:{SECRET}@", "no host"),
        (f"redis+cluster://:{SECRET}@h:7000/3", "database 0 only"),
        (f"redis+cluster://:{SECRET}@h:7000?cluster=true", "unknown query parameter"),
        (f"redis+cluster://:{SECRET}@h:7000#frag", "fragment"),
        (f"redis+cluster://:{SECRET}/x@h:7000", "percent-encode '/'"),
        ("redis://:sec/ret-pw@h:6379/0", "percent-encode special characters"),
        (f"redis://:{SECRET}@h:6379/0?db=x", "Invalid value for 'db'"),
    ],
)
def test_bad_urls_are_refused_without_echoing_secrets(url: str, reason: str) -> None:
    """Every refusal says what is wrong and repeats no part of the credentials."""
    with pytest.raises(ValueError) as caught:
        connect_redis(url)
    message = str(caught.value)
    assert message.startswith("Redis URL: ")
    assert reason in message
    for secret in (SECRET, "sec/ret", "ret-pw"):
        assert secret not in message

"""Stored responses through a real Redis failover: a Redis Cluster whose primary is killed and a
Sentinel-managed master that is killed, each with three store replicas. Responses made by one
replica during or after the failover become readable on the others, which meanwhile answer
"unavailable, try again" (503) and never "not found" (404)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager

import pytest

from gateway.responses.ids import new_response_id
from gateway.responses.store import KEY_PREFIX, ResponseStore
from tests.conftest import free_port
from tests.latency.test_redis_topologies import (
    PASSWORD,
    SENTINEL_PASSWORD,
    Cluster,
    Processes,
    add_replica,
    binary,
    cluster_ok,
    cluster_port,
    create_cluster,
    sync_client,
    wait_for,
)
from tests.responses.test_store import redis_store, response
from tests.responses.test_store_writes import until_readable

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]  # Redis failovers, each seconds long

RESPONSES = 24  # made by replica A after the kill


@asynccontextmanager
async def replicas(url: str, count: int = 3) -> AsyncIterator[list[ResponseStore]]:
    """`count` stores on `url`, as gateway replicas build them, connected (warmed)."""
    async with AsyncExitStack() as stack:
        stores = []
        for _ in range(count):
            store = redis_store(url)
            stack.push_async_callback(store.aclose)
            assert await store.warm(timeout_s=10.0)
            stores.append(store)
        yield stores


async def readable_everywhere(made: list[str], readers: list[ResponseStore]) -> int:
    """How many of `made` each reader finds (a "not found" on the way fails the test)."""
    found = 0
    for store in readers:
        for rid in made:
            assert (await until_readable(store, rid)).id == rid
            found += 1
    return found


# --- Redis Cluster ------------------------------------------------------------------------------


@pytest.fixture
def cluster_and_replica() -> Iterator[tuple[Cluster, int, int]]:
    """A 3-primary cluster whose first primary has a replica: (cluster, primary, replica)."""
    binary("redis-server")
    processes = Processes()
    try:
        made = create_cluster(processes, [cluster_port() for _ in range(3)])
        primary = made.ports[0]
        yield made, primary, add_replica(processes, primary)
    finally:
        processes.close()


def ids_on(made: Cluster, primary: int, count: int) -> list[str]:
    """Fresh response ids, at least half of them in the slots `primary` serves."""
    ids: list[str] = []
    on_primary = 0
    while len(ids) < count:
        rid = new_response_id()
        mine = made.owner(KEY_PREFIX + rid, via=primary) == primary
        if mine or on_primary >= count // 2:
            ids.append(rid)
            on_primary += mine
    return ids


async def test_cluster_responses_made_after_a_primary_dies_reach_every_replica(
    cluster_and_replica: tuple[Cluster, int, int],
) -> None:
    """The primary dies and its replica takes over. Replica A, whose client still has the old
    slot map, then stores responses: its first batch goes to the dead primary and fails, and is
    written again after the slot map is read again. B and C read every one of them, never
    answering "not found" while they wait."""
    made, primary, promoted = cluster_and_replica
    async with replicas(made.url) as (a, b, c):
        a.put(response(new_response_id()))
        await a.flush()  # every replica has used the old slot map
        probe = next(k for n in range(10_000) if made.owner(k := f"{KEY_PREFIX}{n}") == primary)
        made.processes.kill(primary)

        def taken_over() -> bool:
            survivors = [*made.processes.running]
            return all(
                cluster_ok(port) and made.owner(probe, via=port) == promoted for port in survivors
            )

        wait_for(taken_over, "the replica to take over", timeout_s=30)
        ids = ids_on(made, promoted, RESPONSES)
        started = time.monotonic()
        for rid in ids:
            assert a.put(response(rid)) is True
        found = await readable_everywhere(ids, [b, c])
        took = time.monotonic() - started
        stats = a.stats()
        print(  # the figure the docs quote (pytest -s)
            f"cluster: {found}/{2 * len(ids)} reads of responses made after the failover "
            f"succeeded on the other replicas, all within {took:.1f} s; A retried "
            f"{stats['retried_writes']} writes, dropped {stats['dropped_writes']}"
        )
        assert found == 2 * len(ids)
        assert stats["dropped_writes"] == 0
        assert stats["retried_writes"] >= 1  # the batch sent to the dead primary


# --- Sentinel -----------------------------------------------------------------------------------


@pytest.fixture
def sentinel_with_replica() -> Iterator[tuple[Processes, int, int, str]]:
    """A master with a replica, watched by one Sentinel (quorum 1, down after 500 ms):
    (processes, master, replica, url)."""
    binary("redis-server")
    processes = Processes()
    try:
        master, replica, port = free_port(), free_port(), free_port()
        common = ("--bind", "127.0.0.1", "--dir", str(processes.dir), "--save", "")
        auth = ("--requirepass", PASSWORD, "--masterauth", PASSWORD, "--appendonly", "no")
        processes.start(master, "--port", str(master), *common, *auth)
        processes.start(
            replica, "--port", str(replica), *common, *auth, "--replicaof", "127.0.0.1", str(master)
        )
        with sync_client(replica) as client:
            wait_for(
                lambda: client.info("replication")["master_link_status"] == "up",
                "the replica to sync",
            )
        conf = processes.dir / "sentinel.conf"
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {processes.dir}\n"
            f"requirepass {SENTINEL_PASSWORD}\n"
            f"sentinel monitor mymaster 127.0.0.1 {master} 1\n"
            f"sentinel auth-pass mymaster {PASSWORD}\n"
            "sentinel down-after-milliseconds mymaster 500\n"
            "sentinel failover-timeout mymaster 5000\n"
        )
        processes.start(port, str(conf), "--sentinel", password=SENTINEL_PASSWORD)

        def knows_replica() -> bool:
            with sync_client(port, SENTINEL_PASSWORD) as client:
                return int(client.sentinel_master("mymaster")["num-slaves"]) >= 1

        wait_for(knows_replica, "the sentinel to see the replica", timeout_s=30)
        url = (
            f"redis+sentinel://:{PASSWORD}@127.0.0.1:{port}/mymaster"
            f"?sentinel_password={SENTINEL_PASSWORD}"
        )
        yield processes, master, replica, url
    finally:
        processes.close()


async def test_sentinel_responses_made_during_a_failover_reach_every_replica(
    sentinel_with_replica: tuple[Processes, int, int, str],
) -> None:
    """The master dies; replica A stores responses while the Sentinel promotes the replica (its
    writes fail and wait). B and C answer 503 for them meanwhile, never 404, and read every
    one once the new master has them."""
    processes, master, replica, url = sentinel_with_replica
    async with replicas(url) as (a, b, c):
        processes.kill(master)
        ids = [new_response_id() for _ in range(RESPONSES)]
        started = time.monotonic()
        for rid in ids:
            assert a.put(response(rid)) is True
        await a.flush()  # the dead master: every write fails and stays queued
        assert a.stats()["pending_writes"] == len(ids)
        found = await readable_everywhere(ids, [b, c])
        took = time.monotonic() - started
        with sync_client(replica) as client:
            assert client.info("replication")["role"] == "master"
        stats = a.stats()
        print(
            f"sentinel: {found}/{2 * len(ids)} reads of responses made during the failover "
            f"succeeded on the other replicas, all within {took:.1f} s; A retried "
            f"{stats['retried_writes']} writes, dropped {stats['dropped_writes']}"
        )
        assert found == 2 * len(ids)
        assert stats["dropped_writes"] == 0

"""`tailguard serve --workers 2` on real processes: connections dealt out evenly by the supervisor
(by the connections each worker holds open), and SIGTERM, SIGHUP and a worker's death handled
for every worker.

Which worker holds a connection is read from the kernel (the worker process whose file table
holds the server end of the connection, found through `/proc/net/tcp`); what a worker served is
cross-checked against its own counters (`/admin/latency`, per process).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml

from tests.conftest import free_port
from tests.timing import eventually, eventually_sync, scaled

TAILGUARD = Path(sys.executable).parent / "tailguard"
WORKERS = 2
CHAT = {"messages": [{"role": "user", "content": "Say something."}]}
START_S = 30.0  # two workers importing the app, on a quiet machine (then scaled)


@pytest.fixture(scope="module")
def sim() -> Iterator[str]:
    """`tailguard sim` on loopback (the upstream of every gateway here); its `/v1` URL."""
    port = free_port()
    process = subprocess.Popen(
        [str(TAILGUARD), "sim", "--port", str(port), "--seed", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def up() -> bool:
            assert process.poll() is None, "the simulator exited"
            with suppress(httpx.TransportError):
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
            return False

        eventually_sync(up, within_s=START_S, what="the simulator answering", every_s=0.05)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        process.terminate()
        process.wait(timeout=10)


def write_config(path: Path, sim: str, *models: str, **server: Any) -> None:
    """A config of models (`name` or `name=upstream model`) on the simulator, replacing the file
    whole as editors do; the file is not watched, so only SIGHUP reloads it."""
    entries = []
    for model in models:
        name, _, upstream = model.partition("=")
        entries.append(
            {"name": name, "deployments": [{"provider": "sim", "model": upstream or name}]}
        )
    doc = {
        "server": {"host": "127.0.0.1", "reload_on_change": False, **server},
        "providers": {"sim": {"type": "vllm", "base_url": sim}},
        "models": entries,
    }
    temporary = path.with_suffix(".tmp")
    temporary.write_text(yaml.safe_dump(doc))
    temporary.replace(path)


@dataclass
class Gateway:
    process: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def workers(self) -> set[int]:
        """The supervisor's worker processes (not multiprocessing's resource tracker); a worker
        stays listed until the supervisor has reaped it."""
        found = set()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with suppress(OSError):
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
                ppid = int(stat.rpartition(")")[2].split()[1])
                if ppid == self.process.pid and b"spawn_main" in cmdline:
                    found.add(int(entry.name))
        return found

    def owners(self, client_ports: list[int]) -> list[int | None]:
        """The worker that holds the server end of the connection from each client port."""
        inodes = {}
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()
            local, remote = fields[1].split(":"), fields[2].split(":")
            if int(local[1], 16) == self.port and fields[9] != "0":  # 0: TIME_WAIT
                inodes[int(remote[1], 16)] = f"socket:[{fields[9]}]"
        holders = {}
        for pid in self.workers():
            with suppress(OSError):
                for fd in Path(f"/proc/{pid}/fd").iterdir():
                    with suppress(OSError):
                        holders[os.readlink(fd)] = pid
        return [holders.get(inodes.get(port, "")) for port in client_ports]

    def owner(self, client_port: int) -> int | None:
        return self.owners([client_port])[0]

    def held(self) -> int:
        """How many client connections a process of the gateway still holds open."""
        held = 0
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()
            local, remote = fields[1].split(":"), fields[2].split(":")
            if int(local[1], 16) == self.port and int(remote[1], 16) != 0 and fields[9] != "0":
                held += 1
        return held

    async def settled(self) -> None:
        """Wait until no connection of an earlier test is held: the supervisor's counts are
        then all zero."""

        async def idle() -> bool:
            return self.held() == 0

        await eventually(idle, what="no connection held from before")

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@contextmanager
def serve(config: Path) -> Iterator[Gateway]:
    """`tailguard serve --workers 2`, once the supervisor logs that every worker is ready."""
    log, port = config.parent / "gateway.log", free_port()
    with open(log, "wb") as stderr:
        process = subprocess.Popen(
            [
                *(str(TAILGUARD), "serve", "--config", str(config)),
                *("--workers", str(WORKERS), "--port", str(port), "--log-level", "info"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    gateway = Gateway(process, port, log)
    workers: set[int] = set()
    try:

        def started() -> bool:
            assert process.poll() is None, gateway.log_text()
            return f"{WORKERS} workers (pids" in gateway.log_text()

        eventually_sync(started, within_s=START_S, what="the workers starting", every_s=0.05)
        workers = gateway.workers()
        yield gateway
    finally:
        workers |= gateway.workers()
        if process.poll() is None:
            process.terminate()
        try:
            process.wait(timeout=scaled(15))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        for pid in workers:  # a failed test may leave one behind; each is ours, by pid
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def shared(sim: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, Path]]:
    """One gateway (and its config file) for the tests that leave both workers running: only
    the even-split test sends requests for model `a`, only the SIGHUP test edits the file."""
    path = tmp_path_factory.mktemp("shared") / "gateway.yaml"
    write_config(path, sim, "a")
    with serve(path) as gateway:
        yield gateway, path


def one_connection() -> httpx.AsyncClient:
    return httpx.AsyncClient(
        limits=httpx.Limits(max_connections=1, max_keepalive_connections=1), timeout=10
    )


def client_port(response: httpx.Response) -> int:
    port: int = response.extensions["network_stream"].get_extra_info("client_addr")[1]
    return port


@asynccontextmanager
async def per_worker(gateway: Gateway) -> AsyncIterator[dict[int, httpx.AsyncClient]]:
    """A kept-alive connection on every worker: new ones are opened, and all kept open, until
    each worker holds one."""
    async with AsyncExitStack() as stack:
        found: dict[int, httpx.AsyncClient] = {}

        async def next_one() -> bool:
            client = await stack.enter_async_context(one_connection())
            response = await client.get(f"{gateway.url}/healthz")
            assert response.status_code == 200
            pid = gateway.owner(client_port(response))
            if pid is not None:
                found.setdefault(pid, client)
            return set(found) == gateway.workers()

        await eventually(next_one, what="a connection on every worker")
        yield found


async def chat(client: httpx.AsyncClient, url: str, model: str) -> httpx.Response:
    return await client.post(f"{url}/v1/chat/completions", json={"model": model, **CHAT})


async def test_connections_are_dealt_out_evenly(shared: tuple[Gateway, Path]) -> None:
    """32 keep-alive connections opened at once are split evenly between the two workers, so
    each serves half the requests (on one shared listening socket, one worker took most)."""
    gateway, _ = shared
    await gateway.settled()
    per_connection, connections = 10, 32
    async with AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(one_connection()) for _ in range(connections)]

        async def load(client: httpx.AsyncClient) -> int:
            ports = set()
            for _ in range(per_connection):
                response = await chat(client, gateway.url, "a")
                assert response.status_code == 200, response.text
                ports.add(client_port(response))
            (port,) = ports  # kept alive: one connection throughout
            return port

        ports = await asyncio.gather(*(load(client) for client in clients))
        owners = gateway.owners(ports)
        # Dealt by open connections from all-zero counts: exactly half each (uvicorn's shared
        # socket gave 19/13, 16/16 and 24/8 in three runs on an idle machine).
        assert sorted(Counter(owners).values()) == [connections // WORKERS] * WORKERS
        served = Counter({pid: n * per_connection for pid, n in Counter(owners).items()})
        assert set(served) == gateway.workers()
        half = connections * per_connection / WORKERS
        for count in served.values():
            assert 0.8 * half <= count <= 1.2 * half, served

        # Each worker's own counters agree (they are per process), asked on one of its
        # connections; a request is counted just after its answer is sent.
        for pid, count in served.items():
            client = clients[owners.index(pid)]

            async def counted(client: httpx.AsyncClient = client, count: int = count) -> bool:
                view = (await client.get(f"{gateway.url}/admin/latency")).json()
                routes: dict[str, int] = view["counters"]["routes"].get("a", {})
                return sum(routes.values()) == count

            await eventually(counted, what=f"worker {pid} counts {count} requests")


async def opened(client: httpx.AsyncClient, url: str) -> int:
    """Open the client's connection (a request on it); its local port."""
    response = await client.get(f"{url}/healthz")
    assert response.status_code == 200
    return client_port(response)


async def test_closed_connections_are_counted_out(shared: tuple[Gateway, Path]) -> None:
    """Connections go by how many each worker holds open now, not by turns: once one worker's
    connections have closed, every new one goes to that worker until both hold as many."""
    gateway, _ = shared
    await gateway.settled()
    async with AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(one_connection()) for _ in range(8)]
        owners = gateway.owners(await asyncio.gather(*(opened(c, gateway.url) for c in clients)))
        counts = Counter(owners)
        assert None not in counts
        assert sorted(counts.values()) == [4, 4]
        emptied = owners[0]
        for client, owner in zip(clients, owners, strict=True):
            if owner == emptied:
                await client.aclose()

        async def released() -> bool:
            return gateway.held() == 4  # the emptied worker has closed its ends

        await eventually(released, what="the closed connections released")
        fresh = [await stack.enter_async_context(one_connection()) for _ in range(4)]
        ports = await asyncio.gather(*(opened(c, gateway.url) for c in fresh))
        assert gateway.owners(ports) == [emptied] * 4


async def test_sigterm_drains_every_worker_and_exits_0(sim: str, tmp_path: Path) -> None:
    """SIGTERM to the supervisor refuses new connections at once; a short stream finishes, a
    long one ends with the shutting-down error event after the grace, and the supervisor
    exits 0."""
    path = tmp_path / "gateway.yaml"
    grace_s = 1.0
    write_config(
        path,
        sim,
        "short=short@tokens_per_s=20,output_tokens=12",
        "long=long@tokens_per_s=5,output_tokens=500",
        shutdown_grace_s=grace_s,
    )

    async def stream(
        client: httpx.AsyncClient, url: str, model: str, started: asyncio.Event
    ) -> list[str]:
        body = {"model": model, "stream": True, **CHAT}
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            lines = []
            async for line in response.aiter_lines():
                if line:
                    lines.append(line)
                    started.set()
            return lines

    with serve(path) as gateway:
        async with one_connection() as first, one_connection() as second:
            short_started, long_started = asyncio.Event(), asyncio.Event()
            short = asyncio.create_task(stream(first, gateway.url, "short", short_started))
            long = asyncio.create_task(stream(second, gateway.url, "long", long_started))
            await asyncio.wait_for(
                asyncio.gather(short_started.wait(), long_started.wait()), scaled(10)
            )
            stopping = time.monotonic()
            gateway.process.send_signal(signal.SIGTERM)

            async def refused() -> bool:
                async with httpx.AsyncClient(timeout=2) as fresh:
                    try:
                        await fresh.get(f"{gateway.url}/healthz")
                    except httpx.ConnectError:
                        return True
                return False

            await eventually(refused, what="new connections refused", within_s=5)
            assert not long.done()  # refused while the streams still run
            short_lines, long_lines = await asyncio.wait_for(
                asyncio.gather(short, long), scaled(15)
            )
        status = await asyncio.to_thread(gateway.process.wait, scaled(15))
        took = time.monotonic() - stopping
    assert short_lines[-1] == "data: [DONE]"
    assert "data: [DONE]" not in long_lines
    error = orjson.loads(long_lines[-1].removeprefix("data: "))["error"]
    assert "shutting down" in error["message"]
    assert status == 0
    assert took < grace_s + scaled(5)  # the grace, plus the workers' own shutdown


async def test_sighup_reloads_every_worker(sim: str, shared: tuple[Gateway, Path]) -> None:
    """SIGHUP to the supervisor reaches every worker: each serves the model added to the file,
    and none is replaced."""
    gateway, path = shared
    await gateway.settled()
    workers = gateway.workers()
    write_config(path, sim, "a", "b")
    async with per_worker(gateway) as clients:
        for client in clients.values():
            assert (await chat(client, gateway.url, "b")).status_code == 404  # not yet
        gateway.process.send_signal(signal.SIGHUP)
        for pid, client in clients.items():

            async def serves_b(client: httpx.AsyncClient = client) -> bool:
                return (await chat(client, gateway.url, "b")).status_code == 200

            await eventually(serves_b, what=f"worker {pid} serves the new model")
    assert gateway.workers() == workers
    assert gateway.process.poll() is None


async def test_a_killed_worker_is_replaced(sim: str, tmp_path: Path) -> None:
    """A worker killed with SIGKILL is replaced; the other answers meanwhile, on its open
    connection and on new ones, and the replacement then takes connections too."""
    path = tmp_path / "gateway.yaml"
    write_config(path, sim, "a")
    with serve(path) as gateway:
        async with per_worker(gateway) as clients:
            victim, survivor = sorted(clients)
            os.kill(victim, signal.SIGKILL)

            async def reaped() -> bool:
                return victim not in gateway.workers()

            await eventually(reaped, what="the dead worker reaped")
            assert (await chat(clients[survivor], gateway.url, "a")).status_code == 200
            for _ in range(4):
                async with one_connection() as fresh:
                    assert (await chat(fresh, gateway.url, "a")).status_code == 200

            async def replaced() -> set[int]:
                return gateway.workers() - {survivor}

            started: set[int] = await eventually(replaced, what="a replacement worker")
            (replacement,) = started
            assert replacement != victim

            async def served_by_replacement() -> bool:
                async with one_connection() as fresh:
                    response = await chat(fresh, gateway.url, "a")
                    assert response.status_code == 200
                    owner = gateway.owner(client_port(response))
                    return owner == replacement

            await eventually(
                served_by_replacement, what="a connection served by the replacement", within_s=20
            )
        assert f"worker {victim} died (signal SIGKILL)" in gateway.log_text()
        assert f"replaced by worker {replacement}" in gateway.log_text()

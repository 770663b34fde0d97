"""Operations: config hot reload (file change and SIGHUP) and graceful shutdown, on real servers."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml

from gateway.config import load_settings
from tests.conftest import free_port, run_gateway
from tests.timing import eventually, scaled

TAILGUARD = Path(sys.executable).parent / "tailguard"
CHAT = {"messages": [{"role": "user", "content": "Say something."}]}


def config(*models: str, **server: Any) -> dict[str, Any]:
    """A config with one in-process simulated provider and a model per name (`name` or
    `name=upstream-model`)."""
    entries = []
    for model in models:
        name, _, upstream = model.partition("=")
        entries.append(
            {"name": name, "deployments": [{"provider": "sim", "model": upstream or name}]}
        )
    return {
        "server": {"host": "127.0.0.1", **server},
        "providers": {
            "sim": {"type": "simulated", "seed": 1, "default_profile": {"output_tokens": 5}}
        },
        "models": entries,
    }


def write(path: Path, doc: dict[str, Any] | str) -> None:
    """Replace the file whole, as editors and config management do."""
    text = doc if isinstance(doc, str) else yaml.safe_dump(doc)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(text)
    temporary.replace(path)


@asynccontextmanager
async def gateway_from(path: Path) -> AsyncIterator[str]:
    """A gateway serving the config file at `path`, reloading it when it changes."""
    async with run_gateway(load_settings(path), config_path=path) as gw:
        yield gw.url


async def models(client: httpx.AsyncClient, url: str) -> set[str]:
    return {m["id"] for m in (await client.get(url + "/v1/models")).json()["data"]}


# --- hot reload ----------------------------------------------------------------------------------


async def test_changed_file_is_served_without_dropping_a_stream(tmp_path: Path) -> None:
    """A valid new file replaces the config: new models answer, removed ones are gone, and a
    stream that began under the old config runs to its end."""
    path = tmp_path / "gateway.yaml"
    write(path, config("a=a@tokens_per_s=20,output_tokens=20"))
    async with httpx.AsyncClient(timeout=10) as client, gateway_from(path) as url:
        body = {"model": "a", "stream": True, **CHAT}
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            lines = resp.aiter_lines()
            first = await anext(lines)  # the stream has begun (about a second of tokens left)
            write(path, config("b"))
            await eventually(lambda: _has(client, url, {"b"}))
            rest = [line async for line in lines]
        assert first.startswith("data: ")
        assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]"
        assert (
            await client.post(url + "/v1/chat/completions", json={"model": "b", **CHAT})
        ).status_code == 200
        gone = await client.post(url + "/v1/chat/completions", json={"model": "a", **CHAT})
        assert gone.status_code == 404
        ready = (await client.get(url + "/readyz")).json()
        assert ready["config"]["reloads"] == 1


async def _has(client: httpx.AsyncClient, url: str, names: set[str]) -> bool:
    return await models(client, url) == names


async def test_invalid_file_is_rejected_and_the_old_config_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A broken file is logged and changes nothing; fixing it is picked up."""
    path = tmp_path / "gateway.yaml"
    write(path, config("a"))
    async with httpx.AsyncClient(timeout=10) as client, gateway_from(path) as url:
        write(path, "models: [this is: not valid")

        async def failed() -> bool:
            ready = (await client.get(url + "/readyz")).json()
            return bool(ready["config"]["reload_failures"] == 1)

        await eventually(failed)
        assert await models(client, url) == {"a"}
        assert (
            await client.post(url + "/v1/chat/completions", json={"model": "a", **CHAT})
        ).status_code == 200
        assert any("config reload rejected" in r.getMessage() for r in caplog.records)
        write(path, config("a", "c"))
        await eventually(lambda: _has(client, url, {"a", "c"}))


# --- real processes: SIGHUP and SIGTERM -------------------------------------------------------


@contextmanager
def tailguard_process(
    path: Path, port: int, *, stdout: int = subprocess.DEVNULL
) -> Iterator[subprocess.Popen[bytes]]:
    """`tailguard serve` of the config at `path` on `port`, killed and reaped at the end."""
    process = subprocess.Popen(
        [str(TAILGUARD), "serve", "--config", str(path), "--port", str(port)],
        stdout=stdout,
        stderr=subprocess.PIPE,
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)
        for pipe in (process.stdout, process.stderr):
            if pipe is not None:
                pipe.close()


@asynccontextmanager
async def tailguard_serve(
    path: Path, port: int, *, stdout: int = subprocess.DEVNULL
) -> AsyncIterator[subprocess.Popen[bytes]]:
    """`tailguard_process`, once it answers /healthz."""
    with tailguard_process(path, port, stdout=stdout) as process:
        async with httpx.AsyncClient(timeout=1) as http:

            async def healthy() -> bool:
                assert process.poll() is None, (
                    process.stderr.read().decode() if process.stderr else ""
                )
                try:
                    return (await http.get(f"http://127.0.0.1:{port}/healthz")).status_code == 200
                except httpx.TransportError:
                    return False

            await eventually(healthy, within_s=20, what="the gateway to start", every_s=0.05)
        yield process


async def test_sighup_reloads_the_config(tmp_path: Path) -> None:
    """With file watching off, a changed file is served only once the process gets SIGHUP."""
    path = tmp_path / "gateway.yaml"
    port = free_port()
    write(path, config("a", reload_on_change=False))
    url = f"http://127.0.0.1:{port}"
    async with tailguard_serve(path, port) as process, httpx.AsyncClient(timeout=10) as client:
        write(path, config("a", "b", reload_on_change=False))
        assert await models(client, url) == {"a"}  # not watched: nothing happens yet
        process.send_signal(signal.SIGHUP)
        await eventually(lambda: _has(client, url, {"a", "b"}))
        assert process.poll() is None  # SIGHUP did not end the process


async def test_shutdown_lets_streams_finish_then_ends_them_with_an_error_event(
    tmp_path: Path,
) -> None:
    """On SIGTERM the gateway stops accepting, lets a short stream finish, and ends a stream
    still running after the grace period with an error event instead of cutting it."""
    path = tmp_path / "gateway.yaml"
    port = free_port()
    write(
        path,
        config(
            "short=short@tokens_per_s=20,output_tokens=12",
            "long=long@tokens_per_s=5,output_tokens=500",
            shutdown_grace_s=1.5,
        ),
    )
    url = f"http://127.0.0.1:{port}/v1/chat/completions"

    async def stream(client: httpx.AsyncClient, model: str, started: asyncio.Event) -> list[str]:
        body = {"model": model, "stream": True, **CHAT}
        async with client.stream("POST", url, json=body) as resp:
            lines = []
            async for line in resp.aiter_lines():
                if line:
                    lines.append(line)
                    started.set()
            return lines

    async with tailguard_serve(path, port) as process:
        async with httpx.AsyncClient(timeout=20) as client:
            short_started, long_started = asyncio.Event(), asyncio.Event()
            short = asyncio.create_task(stream(client, "short", short_started))
            long = asyncio.create_task(stream(client, "long", long_started))
            await asyncio.wait_for(asyncio.gather(short_started.wait(), long_started.wait()), 10)
            stopping = time.monotonic()
            process.send_signal(signal.SIGTERM)
            short_lines, long_lines = await asyncio.wait_for(
                asyncio.gather(short, long), scaled(15)
            )
            with pytest.raises(httpx.TransportError):  # no longer accepting
                await client.post(url, json={"model": "short", **CHAT})
        await asyncio.to_thread(process.wait, scaled(15))
        took = time.monotonic() - stopping
    assert short_lines[-1] == "data: [DONE]"
    assert "data: [DONE]" not in long_lines
    error = orjson.loads(long_lines[-1].removeprefix("data: "))["error"]
    assert "shutting down" in error["message"]
    assert took < scaled(10)
    # uvicorn re-raises the signal once it has shut down cleanly: "terminated by SIGTERM".
    assert process.returncode in (0, -signal.SIGTERM)

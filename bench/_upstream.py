"""A simulated upstream for the scenario benchmark: behaviours switched at run time, and counts.

One process serves one upstream. It holds one `SimEngine` per named behaviour (`normal`,
`slow`, `down`, ...) and sends each chat request to the behaviour current when it arrives;
`POST /_bench/behaviour {"name": ...}` switches, so a scenario can make a deployment drift,
recover or fail at set times without the gateway knowing. A request in flight stays on the
engine that took it.

It counts what it receives, by the forwarded `x-request-id` (`<prefix><phase><class>-<n>`:
phase `w` warm-up or `m` measured, class `s` short or `l` long) and by behaviour: requests,
their prompt tokens (~characters / 4, as the simulator counts them), the failed ones (not
answered 200), the completed streams and the *wasted* ones: 200 streams that ended before the
response was complete because the gateway closed them (a hedge's loser, an attempt cut at a
deadline or by the total budget). `before_first` says the close came before any content byte,
during queueing or prefill. `GET /_bench/stats` serves the counts as rows.

    python -m bench._upstream --port P --behaviours '{"normal": {...}, "slow": {...}}' --seed 1

`start_upstream` starts one from a benchmark script (in a `Stack` that runs in the repository's
root, so `-m bench._upstream` is found).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any, Final

import orjson

from gateway.sim.engine import SimEngine
from gateway.sim.profile import SimProfile
from gateway.sim.server import create_sim_app
from gateway.tools.stack import Stack

STATS_PATH: Final = "/_bench/stats"
BEHAVIOUR_PATH: Final = "/_bench/behaviour"
REQUEST_ID_PREFIX: Final = "sc-"
PHASES: Final = {"w": "warmup", "m": "measure"}
CLASSES: Final = {"s": "short", "l": "long"}
# What each request is counted under; one Counter per key.
COUNTS: Final = (
    "requests",
    "prompt_tokens",
    "completed",
    "failed",
    "wasted",
    "wasted_tokens",
    "wasted_before_first",
    "wasted_before_first_tokens",
)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGI = Callable[[Scope, Receive, Send], Awaitable[None]]


def prompt_tokens(body: bytes) -> int:
    """Prompt tokens of a chat body as the simulator counts them: message characters / 4."""
    try:
        request = orjson.loads(body)
    except orjson.JSONDecodeError:
        return 0
    chars = 0
    messages = request.get("messages") if isinstance(request, dict) else None
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            chars += len(content)
    return max(1, (chars + 3) // 4)


def request_tags(headers: Sequence[tuple[bytes, bytes]]) -> tuple[str, str]:
    """(phase, class) from `x-request-id`, or ("untagged", "untagged")."""
    prefix = REQUEST_ID_PREFIX.encode()
    for name, value in headers:
        if name == b"x-request-id" and value.startswith(prefix) and len(value) > len(prefix) + 1:
            code = value[len(prefix) : len(prefix) + 2].decode(errors="replace")
            return PHASES.get(code[0], "untagged"), CLASSES.get(code[1], "untagged")
    return "untagged", "untagged"


class Upstream:
    """The engines, the current behaviour and the counters of one upstream process."""

    def __init__(self, behaviours: dict[str, SimProfile], initial: str, seed: int) -> None:
        if initial not in behaviours:
            raise ValueError(f"initial behaviour {initial!r} is not one of {sorted(behaviours)}")
        # Each behaviour draws from its own seeded RNG, so a switch does not reshuffle the others.
        self.apps = {
            name: create_sim_app(SimEngine({}, profile, seed=seed + i))
            for i, (name, profile) in enumerate(sorted(behaviours.items()))
        }
        self.current = initial
        self.switches: list[tuple[float, str]] = [(time.time(), initial)]
        self.counts: dict[tuple[str, str, str], Counter[str]] = {}
        self._waiters: list[tuple[Callable[[], bool], asyncio.Future[None]]] = []

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Return once `predicate()` holds; checked each time a chat request has been counted."""
        if predicate():
            return
        entry = (predicate, asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        try:
            await entry[1]
        finally:
            self._waiters.remove(entry)

    def _changed(self) -> None:
        for predicate, future in self._waiters:
            if not future.done() and predicate():
                future.set_result(None)

    def stats(self) -> dict[str, Any]:
        rows = [
            {"phase": phase, "class": cls, "behaviour": behaviour, **{k: c[k] for k in COUNTS}}
            for (phase, cls, behaviour), c in sorted(self.counts.items())
        ]
        return {"rows": rows, "switches": self.switches, "current": self.current}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.apps[self.current](scope, receive, send)  # lifespan
            return
        path = scope["path"]
        if path == STATS_PATH:
            await _reply(send, 200, orjson.dumps(self.stats()))
            return
        if path == BEHAVIOUR_PATH and scope["method"] == "POST":
            await self._switch(receive, send)
            return
        if scope["method"] != "POST" or path != "/v1/chat/completions":
            await self.apps[self.current](scope, receive, send)
            return
        await self._chat(scope, receive, send)

    async def _switch(self, receive: Receive, send: Send) -> None:
        body = await _read_body(receive)
        try:
            name = orjson.loads(body)["name"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            name = None
        if name not in self.apps:
            await _reply(send, 400, orjson.dumps({"error": f"unknown behaviour {name!r}"}))
            return
        self.current = name
        self.switches.append((time.time(), name))
        await _reply(send, 200, orjson.dumps({"current": name}))

    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        phase, cls = request_tags(scope["headers"])
        behaviour = self.current
        counts = self.counts.setdefault((phase, cls, behaviour), Counter())
        body = await _read_body(receive)
        tokens = prompt_tokens(body)
        counts["requests"] += 1
        counts["prompt_tokens"] += tokens
        replayed = False
        status = 0
        content_sent = finished = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        async def watch(message: Message) -> None:
            nonlocal status, content_sent, finished
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body":
                content_sent = content_sent or bool(message.get("body"))
                finished = finished or not message.get("more_body", False)
            await send(message)

        try:
            await self.apps[behaviour](scope, replay, watch)
        finally:
            if status != 200:  # an error answer (or a reset): no stream was started
                counts["failed"] += 1
            elif finished:
                counts["completed"] += 1
            else:  # a stream the gateway closed before its end
                counts["wasted"] += 1
                counts["wasted_tokens"] += tokens
                if not content_sent:
                    counts["wasted_before_first"] += 1
                    counts["wasted_before_first_tokens"] += tokens
            self._changed()


async def _read_body(receive: Receive) -> bytes:
    parts = bytearray()
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return bytes(parts)
        parts += message.get("body", b"")
        if not message.get("more_body"):
            return bytes(parts)


async def _reply(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def start_upstream(
    stack: Stack, name: str, port: int, behaviours: dict[str, dict[str, Any]], seed: int
) -> None:
    """One upstream process, once it answers; the first of `behaviours` serves first."""
    command = [sys.executable, "-m", "bench._upstream", "--port", str(port), "--seed", str(seed)]
    command += ["--behaviours", json.dumps(behaviours), "--initial", next(iter(behaviours))]
    stack.start_ready("upstream", command, f"{name}.log", f"http://127.0.0.1:{port}/health")


def main(argv: Sequence[str] | None = None) -> int:
    import uvicorn

    parser = argparse.ArgumentParser(prog="python -m bench._upstream")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--behaviours", required=True, help="JSON: name -> SimProfile")
    parser.add_argument("--initial", default="normal")
    parser.add_argument("--seed", type=int, required=True)
    args = parser.parse_args(argv)
    raw = json.loads(args.behaviours)
    behaviours = {name: SimProfile.model_validate(spec) for name, spec in raw.items()}
    uvicorn.run(
        Upstream(behaviours, args.initial, args.seed),
        host="127.0.0.1",
        port=args.port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        log_level="warning",
        server_header=False,
        timeout_graceful_shutdown=2,  # a stalled stream must not hold the next run up
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What cache-aware routing adds to one decision, in microseconds of CPU (`--overhead`).

Times `prefix_chain` alone and a whole steering (`Affinity.steer` then `Steering.settle`)
between three servers, for a short single prompt and for conversations of growing history
(the body already parsed, as the gateway has it), the best of several repeats of many calls.
"""

from __future__ import annotations

import timeit
from typing import Any, cast

import orjson

from gateway.config import AffinitySpec, DeploymentSpec
from gateway.latency.vllm import Histogram, ServerLoad
from gateway.models import Call
from gateway.routing.affinity import Affinity, prefix_chain
from gateway.routing.plan import Candidate, Plan
from gateway.upstream import Provider

SYSTEM = {"role": "system", "content": "You are a helpful assistant. " * 70}


class _Server:
    load = ServerLoad(1, 0, None, Histogram(), Histogram(), 0.0)

    def current(self) -> ServerLoad:
        return self.load

    def prefix_hit_rate(self) -> float | None:
        return 0.9


def _call(turns: int) -> Call:
    messages: list[dict[str, Any]] = [SYSTEM]
    for i in range(turns):
        messages.append({"role": "user", "content": f"question {i} about queues " * 90})
        messages.append({"role": "assistant", "content": f"answer {i} on tails " * 20})
    messages.append({"role": "user", "content": "and then?"})
    body = {"model": "m", "stream": True, "messages": messages}
    raw = orjson.dumps(body)
    return Call("chat", "m", orjson.loads(raw), raw, stream=True)


def _best_us(fn: Any, number: int = 2000, repeat: int = 5) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def measure() -> list[dict[str, Any]]:
    provider = cast(Provider, object())
    found = [
        Candidate("m", DeploymentSpec(provider=p, model="x"), provider, predicted_ttft_s=0.1)
        for p in "abc"
    ]
    servers = {p: _Server() for p in "abc"}
    rows = []
    for turns in (0, 4, 12, 24):
        call = _call(turns)
        affinity = Affinity(AffinitySpec())

        def steer(call: Call = call, affinity: Affinity = affinity) -> None:
            steering = affinity.steer(found, call, servers, lambda d: 0)
            steering.settle(Plan(steering.found, "primary"))

        steer()  # the table now holds this prompt: the timed calls are hits
        rows.append(
            {
                "turns": turns,
                "body_bytes": len(call.raw),
                "chain_us": _best_us(lambda call=call: prefix_chain(call, 64 * 1024)),
                "steer_us": _best_us(steer),
                "parse_us": _best_us(lambda call=call: orjson.loads(call.raw)),
            }
        )
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print("| history turns | body bytes | prefix chain us | steer + settle us | body parse us |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['turns']} | {r['body_bytes']} | {r['chain_us']:.1f} | {r['steer_us']:.1f} "
            f"| {r['parse_us']:.1f} |"
        )

"""What a request body costs the gateway's request path, in microseconds of CPU per request.

Times, for production-sized chat bodies (already read, as the gateway holds them), each step
that touches the whole body: the parse with its depth and duplicate-key checks (`parse_call`,
and `orjson.loads` alone as the floor), the cache-affinity prefix chain (models with several
vLLM servers only), and the upstream body on the native route (`prepare`: forwarded as read,
or rewritten when the upstream model name differs or usage must be asked for). The best of
several repeats of many calls; no servers, no network, a few seconds in all.

    .venv/bin/python bench/body_cost.py
"""

from __future__ import annotations

import argparse
import json
import timeit
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, cast

import orjson

from gateway.admission.validate import parse_call
from gateway.providers.request import prepare
from gateway.routing.affinity import prefix_chain
from gateway.upstream import Provider

_WORDS = "the queue drains when the tail latency budget allows another request through "


def _text(tokens: int) -> str:
    """About `tokens` tokens of English-like text (about four bytes a token)."""
    return (_WORDS * (tokens * 4 // len(_WORDS) + 1))[: tokens * 4]


def bodies() -> dict[str, bytes]:
    system = {"role": "system", "content": _text(150)}
    turns: list[dict[str, Any]] = [system]
    for i in range(20):
        turns.append({"role": "user", "content": f"question {i}: " + _text(120)})
        turns.append({"role": "assistant", "content": f"answer {i}: " + _text(280)})
    shapes = {
        "1.2k tokens": [system, {"role": "user", "content": _text(1_000)}],
        "14k tokens": [system, {"role": "user", "content": _text(14_000)}],
        "41 messages": [*turns[:40], {"role": "user", "content": "and then?"}],
    }
    # Clients differ: compact as JavaScript and httpx send it, or spaced and ASCII-escaped as
    # Python's json.dumps (older SDKs, requests) does; a curly quote makes the escapes real.
    out = {}
    for name, messages in shapes.items():
        last = {**messages[-1], "content": messages[-1]["content"] + " \u2019"}
        body = {"model": "m", "stream": True, "max_tokens": 256, "messages": [*messages[:-1], last]}
        out[f"{name}, compact"] = orjson.dumps(body)
        out[f"{name}, spaced"] = json.dumps(body).encode()
    return out


def _best_us(fn: Any, number: int, repeat: int = 5) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def measure(number: int) -> list[dict[str, Any]]:
    provider = cast(Provider, SimpleNamespace(name="p", wire="openai", bulk_priority=None))
    rows = []
    for name, raw in bodies().items():
        call = parse_call("chat", raw)
        usage = replace(call, include_usage=True)  # nothing to add: forwarded as read
        rows.append(
            {
                "body": name,
                "bytes": len(raw),
                "loads_us": _best_us(lambda raw=raw: orjson.loads(raw), number),
                "parse_call_us": _best_us(lambda raw=raw: parse_call("chat", raw), number),
                "chain_us": _best_us(lambda call=call: prefix_chain(call, 64 * 1024), number),
                "forward_us": _best_us(
                    lambda usage=usage: prepare(usage, provider, "m", {}), number
                ),
                "rename_us": _best_us(
                    lambda call=call: prepare(call, provider, "org/m", {}), number
                ),
            }
        )
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        "| body | bytes | orjson.loads us | parse_call us | prefix chain us "
        "| prepare, as read us | prepare, renamed + usage us |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['body']} | {r['bytes']} | {r['loads_us']:.1f} | {r['parse_call_us']:.1f} "
            f"| {r['chain_us']:.1f} | {r['forward_us']:.1f} | {r['rename_us']:.1f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--number", type=int, default=500, help="calls per timed repeat")
    print_table(measure(max(1, parser.parse_args().number)))


if __name__ == "__main__":
    main()

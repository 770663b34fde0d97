"""The load of `bench/affinity.py`: multi-turn conversations, or independent single prompts.

Conversations: `users` simulated users, each running conversations of 6 to 16 turns back to
back. A conversation opens with a system prompt shared by everyone (~1k tokens) and a document
of its own (~500 to ~1.5k tokens) with a first question; each later turn sends the whole history
plus a new question of ~50 to ~200 tokens, reads the streamed answer and thinks (exponential,
mean `think_s`) before the next. Histories grow from ~2k to ~6k tokens in 90 s. The answer
appended to the history is text of the answer's length drawn here, not the answer itself: the
simulated server caches prompts only (as vLLM caches what it prefilled), so its content does
not matter, and the client then parses only the first content event and errors. A user's
turns wait for each other, as a chat's do; nothing else waits: users start spread over the
first seconds and never wait for one another (TTFT runs from each turn's send).

Independent: Poisson arrivals at `rate`, each a fresh single question of 1k to 8k tokens that
shares no prefix with any other (its first words are its own number).

Every random draw comes from `seed`, so every mode is sent the same questions.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import aiohttp
import orjson

from bench._harness import post_stream
from gateway.tools.stream import StreamReader

WORDS: Final = (
    "queue",
    "batch",
    "token",
    "prefill",
    "decode",
    "cache",
    "latency",
    "tail",
    "budget",
    "replica",
    "server",
    "request",
    "prompt",
    "answer",
    "stream",
    "model",
    "gateway",
    "router",
    "slot",
    "kernel",
    "memory",
    "block",
    "hash",
    "chain",
    "window",
    "sketch",
    "percentile",
    "median",
    "hedge",
    "failover",
    "spill",
    "local",
    "hosted",
    "metric",
    "scrape",
    "counter",
    "gauge",
)
SYSTEM_CHARS: Final = 4_000  # ~1k tokens, the same for every user
DOCUMENT_CHARS: Final = (2_000, 6_000)  # ~500 to ~1.5k tokens, a conversation's own
QUESTION_CHARS: Final = (200, 800)  # ~50 to ~200 tokens a later turn
TURNS: Final = (6, 16)
SINGLE_CHARS: Final = (4_000, 32_000)  # ~1k to ~8k tokens
REQUEST_TIMEOUT_S: Final = 120.0
KEEPALIVE_S: Final = 2.0


def text(rng: random.Random, chars: int, lead: str = "") -> str:
    out = [lead] if lead else []
    size = len(lead)
    while size < chars:
        word = rng.choice(WORDS)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)


SYSTEM: Final = text(random.Random(0), SYSTEM_CHARS, "You are a helpful assistant for ops.")


@dataclass(slots=True)
class Outcome:
    """One request as the client saw it."""

    sent: float  # perf_counter
    prompt_chars: int
    turn: int  # 0 for the first turn of a conversation (or an independent prompt)
    ttft_s: float | None = None
    status: int = 0
    deployment: str | None = None
    affinity: str | None = None
    error: str | None = None
    conversation: str = ""  # "<user>.<conversation>"


async def one(session: aiohttp.ClientSession, url: str, body: dict[str, Any], turn: int) -> Outcome:
    """Send one streamed chat request, read it to its end."""
    data = orjson.dumps(body)
    outcome = Outcome(time.perf_counter(), len(data), turn)
    reader = StreamReader(errors_only_after_first=True)
    outcome.status, headers, outcome.error, _ = await post_stream(
        session, url, data, {"content-type": "application/json"}, reader
    )
    outcome.deployment = headers.get("x-tailguard-deployment")
    for entry in headers.get("server-timing", "").split(", "):
        if entry.startswith("affinity;"):
            outcome.affinity = entry.partition('desc="')[2].rstrip('"')
    if reader.t_first is not None:
        outcome.ttft_s = reader.t_first - outcome.sent
    return outcome


def session() -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
    return aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    )


async def conversations(
    url: str, model: str, *, users: int, duration_s: float, think_s: float, max_tokens: int,
    seed: int,
) -> list[Outcome]:  # fmt: skip
    """Run the conversation workload for `duration_s` (turns in flight then finish)."""
    outcomes: list[Outcome] = []
    deadline = time.perf_counter() + duration_s

    async def user(index: int, http: aiohttp.ClientSession) -> None:
        rng = random.Random(seed * 1000 + index)
        await asyncio.sleep(rng.uniform(0, min(5.0, duration_s / 4)))
        conversation = 0
        while time.perf_counter() < deadline:
            messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
            for turn in range(rng.randint(*TURNS)):
                lead = f"User {index} conversation {conversation} question {turn}:"
                size = rng.randint(*(DOCUMENT_CHARS if turn == 0 else QUESTION_CHARS))
                messages.append({"role": "user", "content": text(rng, size, lead)})
                body = {"model": model, "stream": True, "max_tokens": max_tokens}
                outcome = await one(http, url, {**body, "messages": messages}, turn)
                outcome.conversation = f"{index}.{conversation}"
                outcomes.append(outcome)
                if outcome.error is not None:
                    break
                answer = text(rng, max_tokens * 4)  # as long as the answer (see above)
                messages.append({"role": "assistant", "content": answer})
                pause = min(rng.expovariate(1 / think_s), 4 * think_s)
                if time.perf_counter() + pause >= deadline:
                    return
                await asyncio.sleep(pause)
            conversation += 1

    async with session() as http:
        await asyncio.gather(*(user(i, http) for i in range(users)))
    return outcomes


async def independent(
    url: str, model: str, *, rate: float, duration_s: float, max_tokens: int, seed: int
) -> list[Outcome]:
    """Open-loop Poisson arrivals of prompts that share nothing, for `duration_s`."""
    rng = random.Random(seed)
    arrivals: list[float] = []
    t = rng.expovariate(rate)
    while t < duration_s:
        arrivals.append(t)
        t += rng.expovariate(rate)
    bodies = [
        {
            "model": model,
            "stream": True,
            "max_tokens": max_tokens,
            "messages": [
                {"role": "user", "content": text(rng, rng.randint(*SINGLE_CHARS), f"Prompt {i}:")}
            ],
        }
        for i in range(len(arrivals))
    ]
    async with session() as http:
        start = time.perf_counter() + 0.05
        tasks = []
        for offset, body in zip(arrivals, bodies, strict=True):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(http, url, body, 0)))
        return list(await asyncio.gather(*tasks))


async def sim_prefix(urls: Sequence[str]) -> list[tuple[float, float]]:
    """(hits, queries) of each server's prefix cache, from its own `/metrics`, in tokens."""
    out = []
    async with aiohttp.ClientSession() as http:
        for url in urls:
            hits = queries = 0.0
            with contextlib.suppress(aiohttp.ClientError, ValueError):
                async with http.get(url) as response:
                    page = await response.text()
                for line in page.splitlines():
                    if line.startswith("vllm:prefix_cache_hits_total"):
                        hits += float(line.rsplit(" ", 1)[1])
                    elif line.startswith("vllm:prefix_cache_queries_total"):
                        queries += float(line.rsplit(" ", 1)[1])
            out.append((hits, queries))
    return out

"""Micro-batching of bulk embeddings and completions, and bulk admission, end to end: a real
gateway in front of a real simulated upstream whose received bodies are recorded."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.sim.engine import SimEngine
from gateway.sim.profile import SimProfile
from gateway.sim.server import create_sim_app
from tests.conftest import Upstream, gateway_settings, run_gateway, serve
from tests.timing import eventually

BULK = {"x-tailguard-priority": "bulk"}


class BodyRecorder:
    """Passes requests on to `app`, keeping each one's path and JSON body."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app
        self.bodies: list[tuple[str, dict[str, Any]]] = []

    def of(self, path: str) -> list[dict[str, Any]]:
        return [body for p, body in self.bodies if p == path]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        messages: list[Message] = []
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request" or not message.get("more_body"):
                break
        raw = b"".join(m.get("body", b"") for m in messages)
        if raw:
            self.bodies.append((scope["path"], orjson.loads(raw)))
        replay = iter(messages)

        async def again() -> Message:
            return next(replay, None) or await receive()

        await self._app(scope, again, send)


@asynccontextmanager
async def recorded_sim(**profile: Any) -> AsyncIterator[tuple[Upstream, BodyRecorder]]:
    engine = SimEngine({}, SimProfile(**{"output_tokens": 5, **profile}), seed=3)
    recorder = BodyRecorder(create_sim_app(engine))
    async with serve(recorder) as url:
        yield Upstream(engine, url), recorder


def batched(upstream: Upstream, **batching: Any) -> Any:
    """Model `e` on the upstream with micro-batching configured."""
    return gateway_settings(
        {"up": {"type": "vllm", "base_url": upstream.base_url}},
        [
            {
                "name": "e",
                "deployments": [{"provider": "up", "model": "emb"}],
                "batching": {"max_batch_size": 4, "max_wait_ms": 10_000, **batching},
            }
        ],
    )


async def embed(
    client: httpx.AsyncClient, url: str, text: Any, headers: dict[str, str] | None = None
) -> httpx.Response:
    return await client.post(
        url + "/v1/embeddings",
        json={"model": "e", "input": text},
        headers=BULK if headers is None else headers,
    )


async def queued(client: httpx.AsyncClient, url: str, inputs: int) -> None:
    """Wait until `inputs` inputs are waiting in the batch queue (read from /metrics)."""
    line = f'tailguard_batch_queue_depth{{deployment="up/emb"}} {float(inputs)}'

    async def shown() -> bool:  # the queue is only visible through /metrics: poll it
        return line in (await client.get(url + "/metrics")).text

    await eventually(shown, within_s=5, what=f"{inputs} inputs queued", every_s=0.01)


# --- when batches leave ---------------------------------------------------------------------------


async def test_a_full_batch_leaves_at_once(client: httpx.AsyncClient) -> None:
    """Four bulk requests fill a batch of four: it is sent without waiting out max_wait_ms."""
    async with recorded_sim() as (upstream, recorder), run_gateway(batched(upstream)) as gw:
        started = time.perf_counter()
        responses = await asyncio.gather(*(embed(client, gw.url, f"text {i}") for i in range(4)))
        elapsed = time.perf_counter() - started
    assert [r.status_code for r in responses] == [200] * 4
    assert elapsed < 5  # max_wait_ms is 10 s: a full batch does not wait for it
    (sent,) = recorder.of("/v1/embeddings")
    assert sorted(sent["input"]) == [f"text {i}" for i in range(4)]


async def test_a_lone_request_leaves_after_max_wait(client: httpx.AsyncClient) -> None:
    """A batch that does not fill up is sent once its oldest request has waited max_wait_ms."""
    async with (
        recorded_sim() as (upstream, recorder),
        run_gateway(batched(upstream, max_wait_ms=150)) as gw,
    ):
        started = time.perf_counter()
        resp = await embed(client, gw.url, "alone")
        elapsed = time.perf_counter() - started
    assert resp.status_code == 200
    assert 0.15 <= elapsed < 5
    assert [b["input"] for b in recorder.of("/v1/embeddings")] == [["alone"]]
    timing = resp.headers["server-timing"]
    assert "attempt1" in timing


async def test_batches_run_concurrently_up_to_max_inflight(client: httpx.AsyncClient) -> None:
    """With batches of one and two in flight, four slow calls take about two call times."""
    async with (
        recorded_sim(embed_base_ms=300, max_batch=8) as (upstream, _),
        run_gateway(batched(upstream, max_batch_size=1, max_inflight=2)) as gw,
    ):
        started = time.perf_counter()
        responses = await asyncio.gather(*(embed(client, gw.url, f"t{i}") for i in range(4)))
        elapsed = time.perf_counter() - started
    assert all(r.status_code == 200 for r in responses)
    assert 0.6 <= elapsed < 1.15  # two rounds of two; one at a time would take 1.2 s


async def test_a_full_queue_answers_503_with_retry_after(client: httpx.AsyncClient) -> None:
    """Past max_queue waiting inputs, a request is refused at once with retry-after."""
    async with (
        recorded_sim(embed_base_ms=400) as (upstream, _),
        run_gateway(batched(upstream, max_batch_size=1, max_inflight=1, max_queue=2)) as gw,
    ):
        responses = await asyncio.gather(*(embed(client, gw.url, f"t{i}") for i in range(6)))
    statuses = sorted(r.status_code for r in responses)
    assert statuses.count(200) >= 3 and 503 in statuses
    refused = next(r for r in responses if r.status_code == 503)
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["code"] == "overloaded"


async def test_a_caller_that_leaves_is_not_sent(client: httpx.AsyncClient) -> None:
    """A request whose client disconnects before its batch leaves is taken out of it."""
    async with (
        recorded_sim() as (upstream, recorder),
        run_gateway(batched(upstream, max_wait_ms=400)) as gw,
    ):
        leaving = asyncio.create_task(embed(client, gw.url, "leaves"))
        staying = [asyncio.create_task(embed(client, gw.url, f"stays {i}")) for i in range(2)]
        await queued(client, gw.url, 3)
        leaving.cancel()
        responses = await asyncio.gather(*staying)
    assert all(r.status_code == 200 for r in responses)
    (sent,) = recorder.of("/v1/embeddings")
    assert sorted(sent["input"]) == ["stays 0", "stays 1"]


async def test_a_poisoned_input_fails_alone(client: httpx.AsyncClient) -> None:
    """The upstream refuses a batch because one input is too long: each request is then sent
    on its own, so only that one gets the 400 and the others get their vectors."""
    async with (
        recorded_sim(max_input_tokens=20) as (upstream, recorder),
        run_gateway(batched(upstream)) as gw,
    ):
        texts = ["short one", "x " * 200, "short two", "short three"]
        responses = await asyncio.gather(*(embed(client, gw.url, t) for t in texts))
    assert [r.status_code for r in responses] == [200, 400, 200, 200]
    assert responses[1].json()["error"]["code"] in ("context_length_exceeded", "upstream_rejected")
    sent = recorder.of("/v1/embeddings")
    assert len(sent[0]["input"]) == 4 and len(sent) == 5  # the batch, then each on its own


# --- what each caller gets ------------------------------------------------------------------------


async def test_each_caller_gets_its_own_vectors_in_order_with_usage(
    client: httpx.AsyncClient,
) -> None:
    """Batched answers equal unbatched ones: each caller's vectors, in its input order,
    re-indexed from 0, and usage apportioned so the parts add up to the upstream's total."""
    inputs: list[Any] = [["a b c", "d"], "efgh ijkl mnop", ["q", "r s", "t u v w"], "x"]
    async with (
        recorded_sim() as (upstream, recorder),
        run_gateway(batched(upstream, max_batch_size=7)) as gw,
    ):
        together = await asyncio.gather(*(embed(client, gw.url, i) for i in inputs))
        alone = [await embed(client, gw.url, i, headers={}) for i in inputs]  # interactive
    sent = recorder.of("/v1/embeddings")
    assert len(sent) == 1 + len(inputs)  # one batch, then each interactive request alone
    upstream_tokens = 0
    for batched_resp, alone_resp, given in zip(together, alone, inputs, strict=True):
        mine, theirs = batched_resp.json(), alone_resp.json()
        count = len(given) if isinstance(given, list) else 1
        assert [d["index"] for d in mine["data"]] == list(range(count))
        assert [d["embedding"] for d in mine["data"]] == [d["embedding"] for d in theirs["data"]]
        assert mine["usage"]["total_tokens"] == mine["usage"]["prompt_tokens"]
        upstream_tokens += mine["usage"]["prompt_tokens"]
    assert upstream_tokens == sum(r.json()["usage"]["prompt_tokens"] for r in alone)


async def test_completions_prompts_share_a_call_and_map_back(client: httpx.AsyncClient) -> None:
    """Bulk completions with the same parameters become one call with a prompt list; each
    caller gets its own choice(s), the same text it gets alone, and its share of usage."""
    async with recorded_sim() as (upstream, recorder):
        config = gateway_settings(
            {"up": {"type": "vllm", "base_url": upstream.base_url}},
            [
                {
                    "name": "c",
                    "deployments": [{"provider": "up", "model": "gen"}],
                    "batching": {"max_batch_size": 3, "max_wait_ms": 10_000},
                }
            ],
        )
        prompts = ["first prompt", "the second prompt", "third"]

        async def complete(prompt: str, headers: dict[str, str]) -> httpx.Response:
            body = {"model": "c", "prompt": prompt, "max_tokens": 8, "seed": 11}
            return await client.post(gw.url + "/v1/completions", json=body, headers=headers)

        async with run_gateway(config) as gw:
            together = await asyncio.gather(*(complete(p, BULK) for p in prompts))
            alone = [await complete(p, {}) for p in prompts]
    batch = recorder.of("/v1/completions")[0]
    assert sorted(batch["prompt"]) == sorted(prompts)
    total_prompt = 0
    for mine, theirs in zip(together, alone, strict=True):
        assert mine.status_code == 200
        (choice,) = mine.json()["choices"]
        assert choice["index"] == 0
        assert choice["text"] == theirs.json()["choices"][0]["text"]
        usage = mine.json()["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        total_prompt += usage["prompt_tokens"]
    assert total_prompt == sum(r.json()["usage"]["prompt_tokens"] for r in alone)


async def test_interactive_and_streaming_requests_are_not_batched(
    client: httpx.AsyncClient,
) -> None:
    """Only bulk, non-streaming requests wait for a batch: interactive ones go straight
    through (a batch of one, at once), and so do streamed completions."""
    async with recorded_sim() as (upstream, recorder), run_gateway(batched(upstream)) as gw:
        started = time.perf_counter()
        resp = await embed(client, gw.url, "now", headers={})
        assert resp.status_code == 200
        body = {"model": "e", "prompt": "hi", "stream": True, "max_tokens": 3}
        async with client.stream(
            "POST", gw.url + "/v1/completions", json=body, headers=BULK
        ) as streamed:
            await streamed.aread()
        elapsed = time.perf_counter() - started
    assert elapsed < 5  # neither waited out the 10 s max_wait_ms
    assert recorder.of("/v1/embeddings") == [{"model": "emb", "input": "now"}]
    assert recorder.of("/v1/completions")[0]["prompt"] == "hi"


async def test_an_invalid_priority_header_is_a_400(client: httpx.AsyncClient) -> None:
    """x-tailguard-priority takes interactive or bulk; anything else is named in a 400."""
    async with recorded_sim() as (upstream, _), run_gateway(batched(upstream)) as gw:
        resp = await embed(client, gw.url, "x", headers={"x-tailguard-priority": "urgent"})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "x-tailguard-priority"


async def test_batch_metrics(client: httpx.AsyncClient) -> None:
    """Batch sizes and waits are histograms per deployment; queue depth and refusals too."""
    async with recorded_sim() as (upstream, _), run_gateway(batched(upstream)) as gw:
        await asyncio.gather(*(embed(client, gw.url, f"m{i}") for i in range(4)))
        text = (await client.get(gw.url + "/metrics")).text
    assert 'tailguard_batch_size_count{deployment="up/emb",endpoint="embeddings"} 1.0' in text
    assert 'tailguard_batch_size_sum{deployment="up/emb",endpoint="embeddings"} 4.0' in text
    assert (
        'tailguard_batch_wait_seconds_count{deployment="up/emb",endpoint="embeddings"} 4.0' in text
    )
    assert 'tailguard_batch_queue_depth{deployment="up/emb"} 0.0' in text
    assert 'tailguard_batch_rejected_total{deployment="up/emb"} 0.0' in text


# --- bulk chat and vLLM priority ----------------------------------------------------------------


async def test_bulk_chat_waits_for_a_slot_and_vllm_gets_its_priority(
    client: httpx.AsyncClient,
) -> None:
    """Bulk chat beyond the deployment's bulk concurrency waits (server-timing `queue`), and a
    vLLM provider with `bulk_priority` receives it as the request's `priority`."""
    async with recorded_sim(tokens_per_s=50, output_tokens=10, scheduling_policy="priority") as (
        upstream,
        recorder,
    ):
        settings = gateway_settings(
            {"up": {"type": "vllm", "base_url": upstream.base_url, "bulk_priority": 7}},
            [{"name": "chat", "deployments": [{"provider": "up", "model": "m"}]}],
            routing={"bulk": {"initial_concurrency": 1, "min_concurrency": 1}},
        )
        body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
        async with run_gateway(settings) as gw:
            first, second = await asyncio.gather(
                *(
                    client.post(gw.url + "/v1/chat/completions", json=body, headers=BULK)
                    for _ in range(2)
                )
            )
            interactive = await client.post(gw.url + "/v1/chat/completions", json=body)
    assert first.status_code == second.status_code == interactive.status_code == 200
    queued = [
        float(part.split("dur=")[1])
        for r in (first, second)
        for part in r.headers["server-timing"].split(", ")
        if part.startswith("queue;")
    ]
    assert len(queued) == 2 and max(queued) > 100  # one waited for the other (~200 ms)
    chats = recorder.of("/v1/chat/completions")
    assert [c.get("priority") for c in chats] == [7, 7, None]

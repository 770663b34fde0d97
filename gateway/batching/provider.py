"""A provider that coalesces bulk embeddings and completions requests into batched upstream calls.

It wraps a deployment's provider and keeps its shape, so the attempt loop (failover, deadlines,
statistics, traces) treats a batched request like any other: `open` returns the caller's own
answer once its batch has come back.

- `/v1/embeddings`: the inputs of many requests become one call; each caller gets its vectors,
  re-indexed from 0.
- `/v1/completions`: the prompts of requests with identical parameters (everything but the
  prompt) become one call with a prompt list; choice `i * n + j` belongs to prompt `i`.
- Usage is apportioned: prompt tokens by each caller's share of the input (characters of text,
  or tokens of token arrays), completion tokens by each caller's share of the generated text;
  rounded so the parts add up to the upstream's totals exactly.
- If the upstream refuses a batch as a bad request (400/413/422), one input spoiled it: every
  request is then sent on its own, so only the bad one gets the error.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson

from gateway.batching.gate import BulkGate
from gateway.batching.preempt import BulkWork
from gateway.batching.queue import BatchQueue, Item, settle
from gateway.config import BatchingSpec
from gateway.errors import OverloadedError, ProviderError, ProviderRejectedError, inband_error
from gateway.models import Chunk, Endpoint, UpstreamRequest, Wire
from gateway.numbers import count as token_count
from gateway.upstream import Counter, Provider, TokenQuery, UpstreamStream

BATCHED_ENDPOINTS: tuple[Endpoint, ...] = ("embeddings", "completions")
_PARTS = {"embeddings": "input", "completions": "prompt"}

BodyDecoder = Callable[[bytes], Chunk]
"""The wrapped provider's reading of a whole OpenAI answer (with its scrubber): batching imports
no adapter, so whoever builds the batcher hands it this."""

Observer = Callable[[str, str, int, list[float]], None]
"""Called when a batch leaves: (deployment, endpoint, inputs, each request's wait in seconds)."""


class _Part:
    """One caller's request: its body without the batched field, and the inputs it adds."""

    __slots__ = ("body", "inputs", "weights")

    def __init__(self, body: dict[str, Any], inputs: list[Any]) -> None:
        self.body = body
        self.inputs = inputs
        self.weights = [_weight(i) for i in inputs]


class _Answer:
    __slots__ = ("body", "upstream_request_id")

    def __init__(self, body: bytes, upstream_request_id: str | None) -> None:
        self.body = body
        self.upstream_request_id = upstream_request_id


class BatchingProvider:
    """`inner` (an OpenAI-compatible provider) with micro-batching for one deployment."""

    def __init__(
        self,
        inner: Provider,
        deployment: str,
        spec: BatchingSpec,
        *,
        decode: BodyDecoder,
        observer: Observer | None = None,
        gate: BulkGate | None = None,
    ) -> None:
        self.inner = inner
        self._gate = gate
        self.deployment = deployment
        self.spec = spec
        self.name = inner.name
        self.wire: Wire = inner.wire
        self.system = inner.system
        self.address = inner.address
        self.scrub = inner.scrub
        self.bulk_priority = inner.bulk_priority
        self.limits = inner.limits
        self._decode = decode
        self._observer = observer
        self._queues: dict[tuple[str, bytes], BatchQueue[_Part, _Answer]] = {}
        self.rejected = 0  # requests refused because their queue was full

    def supports(self, endpoint: Endpoint) -> bool:
        return self.inner.supports(endpoint)

    def counter(
        self, deployment: str, upstream_model: str, query: TokenQuery, headers: Mapping[str, str]
    ) -> Counter | None:
        return self.inner.counter(deployment, upstream_model, query, headers)

    @property
    def waiting(self) -> int:
        """Inputs queued, not yet sent."""
        return sum(q.waiting for q in self._queues.values())

    async def open(self, deployment: str, request: UpstreamRequest) -> UpstreamStream:
        if request.stream or request.endpoint not in BATCHED_ENDPOINTS or self.wire != "openai":
            return await self.inner.open(deployment, request)
        body = orjson.loads(request.body)
        field = _PARTS[request.endpoint]
        inputs = _as_list(request.endpoint, body.pop(field, None))
        if not inputs:
            return await self.inner.open(deployment, request)
        part = _Part(body, inputs)
        # Only requests that differ in nothing but their inputs can share a call.
        key = (request.endpoint, orjson.dumps(body, option=orjson.OPT_SORT_KEYS))
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = self._new_queue(key, request)
        try:
            answer = await queue.submit(part, len(inputs))
        except OverloadedError:
            self.rejected += 1
            raise
        return _Answered(answer, self._decode)

    def _new_queue(
        self, key: tuple[str, bytes], request: UpstreamRequest
    ) -> BatchQueue[_Part, _Answer]:
        endpoint = request.endpoint
        headers = {k: v for k, v in request.headers.items() if k != "traceparent"}

        async def send(batch: list[Item[_Part, _Answer]]) -> None:
            await self._send(endpoint, headers, batch)

        def sent(batch: list[Item[_Part, _Answer]]) -> None:
            if self._observer is not None:
                waits = [(item.sent or item.queued) - item.queued for item in batch]
                self._observer(self.deployment, endpoint, sum(i.size for i in batch), waits)

        def idle() -> None:
            queue = self._queues.get(key)
            if queue is not None and not queue.waiting and not queue.inflight:
                del self._queues[key]

        return BatchQueue(self.spec, send, on_sent=sent, on_idle=idle)

    async def _send(
        self, endpoint: Endpoint, headers: Mapping[str, str], batch: list[Item[_Part, _Answer]]
    ) -> None:
        parts = [item.payload for item in batch]
        gate = self._gate
        if gate is None:
            await self._send_parts(endpoint, headers, batch, parts)
            return
        # A batch is bulk work on the deployment: it takes the slot-equivalents its inputs ask
        # of the server, so batches yield to interactive traffic the way bulk chat does (and
        # may be preempted and sent again whole, until one of its callers has an answer).
        inputs = sum(len(p.inputs) for p in parts)
        n = parts[0].body.get("n")
        weight = gate.batch_weight(endpoint, inputs, n if isinstance(n, int) else 1)
        work = BulkWork(gate, self.deployment, weight)
        await work.acquire()
        try:
            await work.run(
                lambda _: self._send_parts(endpoint, headers, batch, parts),
                committed=lambda: any(_answered(item) for item in batch),
            )
        finally:
            work.release()

    async def _send_parts(
        self,
        endpoint: Endpoint,
        headers: Mapping[str, str],
        batch: list[Item[_Part, _Answer]],
        parts: list[_Part],
    ) -> None:
        try:
            answers = await self._call(endpoint, headers, parts)
        except ProviderRejectedError as error:
            if len(batch) == 1:
                raise
            # One input spoiled the batch: each request on its own, so only that one fails,
            # no more of them at once than batches may be in flight.
            del error
            limit = asyncio.Semaphore(self.spec.max_inflight)

            async def alone(part: _Part) -> list[_Answer]:
                async with limit:
                    return await self._call(endpoint, headers, [part])

            results = await asyncio.gather(*(alone(p) for p in parts), return_exceptions=True)
            for item, result in zip(batch, results, strict=True):
                settle(item, result[0] if isinstance(result, list) else result)
            return
        for item, answer in zip(batch, answers, strict=True):
            settle(item, answer)

    async def _call(
        self, endpoint: Endpoint, headers: Mapping[str, str], parts: Sequence[_Part]
    ) -> list[_Answer]:
        field = _PARTS[endpoint]
        merged = dict(parts[0].body)
        merged[field] = [i for part in parts for i in part.inputs]
        request = UpstreamRequest(
            endpoint,
            orjson.dumps(merged),
            False,
            {**headers, "x-request-id": "batch_" + os.urandom(8).hex()},
        )
        stream = await self.inner.open(self.deployment, request)
        try:
            chunks = await stream.read()
        finally:
            await stream.aclose()
        chunk = chunks[0] if chunks else None
        data = chunk.data if chunk is not None else None
        if chunk is not None and chunk.error is not None:
            raise inband_error(self.deployment, chunk.error)
        if not isinstance(data, dict):
            raise ProviderError(
                "the batched response was not a JSON object",
                deployment=self.deployment,
                kind="invalid_response",
            )
        split = _split_embeddings if endpoint == "embeddings" else _split_completions
        try:
            bodies = split(data, parts, int(merged.get("n") or 1))
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ProviderError(
                f"the batched response could not be split: {type(exc).__name__}",
                deployment=self.deployment,
                kind="invalid_response",
            ) from None
        upstream_id = stream.upstream_request_id
        return [_Answer(orjson.dumps(body), upstream_id) for body in bodies]


class _Answered:
    """The caller's own slice of a batched response, as a one-chunk upstream stream."""

    streaming = False
    status = 200

    def __init__(self, answer: _Answer, decode: BodyDecoder) -> None:
        self._decode = decode
        self._body: bytes | None = answer.body
        self.upstream_request_id = answer.upstream_request_id

    async def read(self) -> list[Chunk] | None:
        body, self._body = self._body, None
        return None if body is None else [self._decode(body)]

    async def aclose(self) -> None:
        self._body = None


def _answered(item: Item[_Part, _Answer]) -> bool:
    return item.future.done() and not item.future.cancelled()


# --- merging and splitting ------------------------------------------------------------------------


def _as_list(endpoint: str, value: Any) -> list[Any]:
    """A request's inputs as a list of single inputs (a string, or one token array)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(v, int) for v in value):
            return [value]  # one token array
        return list(value)
    return []


def _weight(value: Any) -> int:
    return len(value) if isinstance(value, str | list) else 1


def _usage(data: dict[str, Any]) -> dict[str, int]:
    """The batch's token counts; one that is not a count (negative, a string...) is 0."""
    usage = data.get("usage")
    if not isinstance(usage, dict):
        return {}
    return {
        name: token_count(usage.get(name)) or 0 for name in ("prompt_tokens", "completion_tokens")
    }


def _split_embeddings(data: dict[str, Any], parts: Sequence[_Part], n: int) -> list[dict[str, Any]]:
    vectors = sorted(data["data"], key=lambda d: d["index"])
    total = sum(len(p.inputs) for p in parts)
    if len(vectors) != total:
        raise ValueError("vector count")
    usage = _usage(data)
    prompt = _apportion(usage.get("prompt_tokens", 0), [sum(p.weights) for p in parts])
    bodies = []
    start = 0
    for part, tokens in zip(parts, prompt, strict=True):
        mine = vectors[start : start + len(part.inputs)]
        start += len(part.inputs)
        body = {k: v for k, v in data.items() if k not in ("data", "usage")}
        body["data"] = [{**v, "index": i} for i, v in enumerate(mine)]
        body["usage"] = {"prompt_tokens": tokens, "total_tokens": tokens}
        bodies.append(body)
    return bodies


def _split_completions(
    data: dict[str, Any], parts: Sequence[_Part], n: int
) -> list[dict[str, Any]]:
    choices = sorted(data["choices"], key=lambda c: c["index"])
    total = sum(len(p.inputs) for p in parts) * n
    if len(choices) != total:
        raise ValueError("choice count")
    usage = _usage(data)
    prompt = _apportion(usage.get("prompt_tokens", 0), [sum(p.weights) for p in parts])
    groups = []
    start = 0
    for part in parts:
        count = len(part.inputs) * n
        groups.append(choices[start : start + count])
        start += count
    generated = [sum(len(c.get("text") or "") for c in group) or len(group) for group in groups]
    completion = _apportion(usage.get("completion_tokens", 0), generated)
    bodies = []
    for group, p_tokens, c_tokens in zip(groups, prompt, completion, strict=True):
        body = {k: v for k, v in data.items() if k not in ("choices", "usage")}
        body["choices"] = [{**c, "index": i} for i, c in enumerate(group)]
        body["usage"] = {
            "prompt_tokens": p_tokens,
            "completion_tokens": c_tokens,
            "total_tokens": p_tokens + c_tokens,
        }
        bodies.append(body)
    return bodies


def _apportion(total: int, weights: Sequence[int]) -> list[int]:
    """Split `total` in proportion to `weights`, in whole numbers that add up to `total`
    (largest remainder)."""
    weight = sum(weights)
    if weight <= 0:
        weights, weight = [1] * len(weights), len(weights)
    exact = [total * w / weight for w in weights]
    shares = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: exact[i] - shares[i], reverse=True)
    for i in order[: total - sum(shares)]:
        shares[i] += 1
    return shares

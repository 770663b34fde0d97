"""The simulated LLM upstream: an OpenAI-compatible server modelled well enough to study latency.

Time to first token is queueing (for one of `max_batch` slots, first come first served or by
vLLM's request `priority`, with preemption; optionally for room in the KV cache) plus prefill
(a base cost plus a cost per prompt token, optionally with a heavy tail). Decoding runs at
`tokens_per_s`, each step slower as the batch fills (continuous batching), optionally
speculative (`gateway.sim.decode`). A completions request with several prompts (or `n` > 1)
runs one sequence per choice, each in its own slot, as vLLM does. Faults and every other random
choice are drawn by the planner (`gateway.sim.planner`) from one seeded RNG.

Every parameter a client sends is honoured (`n`, `stop`, `logprobs`, `tools` and `tool_choice`,
`response_format`, `seed`, `max_tokens`, ...), accepted as a hint that changes nothing in a
simulation (`temperature`, `user`, ...) or refused with a 400 naming it (`gateway.sim.request`).
A profile can add reasoning tokens before the answer and a prefix cache per model name.

The engine speaks bytes in and bytes out (`SimEngine.handle`), so the in-process provider and the
standalone server (`gateway.sim.server`) share one implementation. It reads a request
(`gateway.sim.request`), has it planned and its output drawn (`gateway.sim.planner`,
`gateway.sim.output`), lets simulated time pass on the batch slots (`gateway.sim.timeline`) and
has the reply written (`gateway.sim.writer`). With every delay at zero it never sleeps, and a
streamed token of plain text costs one bytes concatenation (and a few counter updates).

`GET /metrics` serves vLLM's Prometheus metrics, driven by the engine's real state
(`gateway.sim.metrics`); it can be made to fail.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import orjson

from gateway.sim import request as requests
from gateway.sim import wire
from gateway.sim.metrics import MetricsPage
from gateway.sim.output import prompt_logprobs
from gateway.sim.planner import Deployments, Plan, Planner, seeded
from gateway.sim.profile import MetricsFault, MetricsNames, SimProfile
from gateway.sim.scheduler import SimStats
from gateway.sim.timeline import Timeline
from gateway.sim.tokens import block_hashes, pieces, text_tokens, token_ids
from gateway.sim.wire import (
    INBAND_ERROR,
    SSE_HEADERS,
    BadRequestError,
    SimReply,
    json_reply,
)
from gateway.sim.writer import Frames, ReplyWriter, StreamHead, embeddings_body, request_usage

__all__ = ["SimEngine"]


class SimEngine:
    """A simulated OpenAI-compatible server: named profiles, a default, one seeded RNG."""

    def __init__(
        self,
        profiles: Mapping[str, SimProfile] | None = None,
        default: SimProfile | None = None,
        *,
        seed: int | None = None,
    ) -> None:
        self.profiles: dict[str, SimProfile] = dict(profiles or {})
        self.default = default if default is not None else SimProfile()
        self.stats = SimStats()
        self._planner = Planner(seed, self.stats)
        self._writer = ReplyWriter(self._planner.id_prefix)
        self._timeline = Timeline(self.stats)
        names = list(self.profiles) or ["default"]
        self._page = MetricsPage(names, self.default.metrics_names, self.default.metrics_fault)
        self._deployments = Deployments(self.profiles, self.default, self.stats, self._page)
        self._models_body = orjson.dumps(
            {
                "object": "list",
                "data": [
                    {"id": name, "object": "model", "created": 0, "owned_by": "tailguard-sim"}
                    for name in names
                ],
            }
        )
        self._routes: dict[tuple[str, str], Callable[[dict[str, Any]], Awaitable[SimReply]]] = {
            ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/v1/completions"): self._completions,
            ("POST", "/v1/embeddings"): self._embeddings,
            ("POST", "/tokenize"): self._tokenize,
        }

    @property
    def metrics_names(self) -> MetricsNames:
        """The names `/metrics` serves (from the default profile; may be changed while running)."""
        return self._page.names

    @metrics_names.setter
    def metrics_names(self, value: MetricsNames) -> None:
        self._page.names = value

    @property
    def metrics_fault(self) -> MetricsFault:
        """How `/metrics` fails (from the default profile; may be changed while running)."""
        return self._page.fault

    @metrics_fault.setter
    def metrics_fault(self, value: MetricsFault) -> None:
        self._page.fault = value

    def metrics_page(self) -> str:
        """vLLM's Prometheus text for every model name served or requested so far."""
        return self._page.render()

    async def handle(self, method: str, path: str, body: bytes) -> SimReply:
        """Answer one request. Raises `SimConnectionReset` for a reset before headers."""
        route = self._routes.get((method, path))
        try:
            if route is not None:
                request = wire.parse_body(body)
                reply: SimReply = await route(request)
                return reply
            if path == "/v1/models" and method == "GET":
                return json_reply(200, self._models_body)
            if path == "/health" and method == "GET":
                return SimReply(200, {}, b"")
            if path == "/metrics" and method == "GET":
                return self._page.reply()
            if path in ("/v1/models", "/health", "/metrics") or any(
                p == path for _, p in self._routes
            ):
                raise BadRequestError(f"method {method} not allowed on {path}", status=405)
            raise BadRequestError(f"no such endpoint: {method} {path}", status=404)
        except BadRequestError as exc:
            return json_reply(
                exc.status,
                wire.error_body(exc.message, "invalid_request_error", exc.param, exc.code),
            )

    def _faults(self, profile: SimProfile, stream: bool) -> SimReply | None:
        """The faults that answer before any work (a reset raises), then an in-band error."""
        if (early := self._planner.early_fault(profile)) is not None:
            return early
        if not self._planner.inband(profile):
            return None
        if stream:
            return SimReply(
                200, dict(SSE_HEADERS), stream=self._timeline.error_stream(INBAND_ERROR)
            )
        return json_reply(200, INBAND_ERROR)

    def count_tokens(self, body: dict[str, Any]) -> int:
        """Prompt tokens of a chat body (`messages`, and `tools` if any) or a completions body
        (`prompt`: text, token ids, or a list of them, summed), as `usage.prompt_tokens` counts
        them; other keys are ignored. Raises `wire.BadRequestError` for a body without either."""
        if body.get("messages") is None and isinstance(body.get("prompt"), list):
            return sum(tokens for _, tokens in requests.prompt_pieces(body["prompt"], "prompt"))
        return _count(requests.read_tokenize(body, strict=False))

    async def _tokenize(self, request: dict[str, Any]) -> SimReply:
        """vLLM's `POST /tokenize`: `{count, max_model_len, tokens}` (and `token_strs` if asked)."""
        prompt = requests.read_tokenize(request)
        model = request.get("model")
        profile = self.default
        if isinstance(model, str) and model:
            profile = self._deployments.resolve(model).profile
        tokens = token_ids(prompt)
        body: dict[str, Any] = {
            "count": len(tokens),
            "max_model_len": profile.max_input_tokens or profile.kv_tokens_per_seq,
            "tokens": tokens,
        }
        if request.get("return_token_strs") is True:
            body["token_strs"] = pieces(prompt) if isinstance(prompt, str) else None
        return json_reply(200, orjson.dumps(body))

    async def _chat(self, request: dict[str, Any]) -> SimReply:
        """Each of the `n` choices is a sequence of its own; under an integer `seed` choice `j`'s
        output is a function of (seed, messages, j)."""
        model = wire.model_name(request)
        target = self._deployments.resolve(model)
        chat = requests.read_chat(request, target.profile)
        if (fault := self._faults(target.profile, chat.stream)) is not None:
            return fault
        key = orjson.dumps(chat.messages) if chat.seed is not None else b""
        blocks = block_hashes(chat.prompt) if target.cache is not None else None
        plans: list[Plan] = []
        for j in range(chat.n):
            text = None if chat.seed is None else seeded(chat.seed, key, j)
            first = plans[0] if plans else None
            plan = self._planner.plan(
                target, chat.prompt_tokens, chat.max_tokens, text=text, request=first
            )
            self._planner.compose(plan, chat.generation, chat.max_tokens, text=text)
            plan.blocks = blocks
            plan.priority = chat.priority
            plans.append(plan)
        if chat.stream:
            frames, head = self._writer.chat_frames(plans, include_usage=chat.include_usage)
            return self._stream(plans, frames, head, chat.prompt_tokens)
        await self._timeline.generate(plans, chat.prompt_tokens)
        body = self._writer.chat_body(model, plans, request_usage(plans, chat.prompt_tokens))
        return json_reply(200, body)

    async def _completions(self, request: dict[str, Any]) -> SimReply:
        """Each prompt, and each of its `n` choices, is a sequence of its own (as in vLLM).

        Choice `index` is `prompt * n + j`. Under an integer `seed` a choice's text is a function
        of (seed, prompt, j), so a prompt reads the same alone or among others. Faults are drawn
        once for the whole request.
        """
        model = wire.model_name(request)
        target = self._deployments.resolve(model)
        completions = requests.read_completions(request, target.profile)
        if (fault := self._faults(target.profile, completions.stream)) is not None:
            return fault
        seed, max_tokens = completions.seed, completions.max_tokens
        generation = completions.generation
        plans: list[Plan] = []
        for (key, tokens), prompt in zip(completions.prompts, completions.texts, strict=True):
            blocks = block_hashes(prompt) if target.cache is not None else None
            for j in range(completions.per_prompt):
                text = None if seed is None else seeded(seed, key, j)
                first = plans[0] if plans else None
                plan = self._planner.plan(target, tokens, max_tokens, text=text, request=first)
                self._planner.compose(plan, generation, max_tokens, text=text, reasoning=False)
                if plan.output is not None and generation.echo and isinstance(prompt, str):
                    plan.output.echo = prompt
                    if generation.logprobs is not None:
                        rng = self._planner.rng if text is None else text
                        plan.output.echo_logprobs = prompt_logprobs(
                            prompt, generation.logprobs, rng
                        )
                plan.blocks = blocks
                plan.priority = completions.priority
                plans.append(plan)
        # Prompt tokens count once per prompt, whatever n is.
        prompt_tokens = sum(tokens for _, tokens in completions.prompts)
        if completions.stream:
            frames, head = self._writer.completion_frames(
                plans, include_usage=completions.include_usage
            )
            return self._stream(
                plans, frames, head, prompt_tokens, completions.per_prompt, chat=False
            )
        await self._timeline.generate(plans, prompt_tokens)
        usage = request_usage(plans, prompt_tokens, completions.per_prompt, chat=False)
        return json_reply(200, self._writer.completions_body(model, plans, usage))

    def _stream(
        self,
        plans: Sequence[Plan],
        frames: Sequence[Frames],
        head: StreamHead,
        prompt_tokens: int,
        per_prompt: int = 1,
        *,
        chat: bool = True,
    ) -> SimReply:
        usage_head = head.usage_head

        def usage() -> bytes:
            assert usage_head is not None
            counted = request_usage(plans, prompt_tokens, per_prompt, chat=chat)
            return usage_head + orjson.dumps(counted) + b"}\n\n"

        stream = self._timeline.stream(
            plans, frames, None if usage_head is None else usage, prompt_tokens
        )
        return SimReply(200, dict(SSE_HEADERS), stream=stream)

    async def _embeddings(self, request: dict[str, Any]) -> SimReply:
        model = wire.model_name(request)
        target = self._deployments.resolve(model)
        embeddings = requests.read_embeddings(request, target.profile)
        profile = target.profile
        if (fault := self._faults(profile, stream=False)) is not None:
            return fault
        stall_s, cut = self._planner.stall_and_cut(profile)
        inputs = embeddings.inputs
        work_s = (profile.embed_base_ms + profile.embed_ms_per_input * len(inputs)) / 1000
        tokens = sum(t for _, t in inputs)
        await self._timeline.work(
            target.pool, stall_s, work_s, cut, prompt_tokens=tokens, priority=embeddings.priority
        )
        body = embeddings_body(model, inputs, embeddings.dims, b64=embeddings.base64, tokens=tokens)
        return json_reply(200, body)


def _count(prompt: str | list[int]) -> int:
    return len(prompt) if isinstance(prompt, list) else text_tokens(len(prompt))

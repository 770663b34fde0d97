"""The request planner: model names resolved to a deployment, and every random draw of a request.

Faults (429, 500, resets, stalls, cut streams, in-band errors) are drawn per request at the
profile's rates, and each sequence's length, prefill and first word before any time passes.
Every draw comes from one seeded RNG in arrival order, so a run is reproducible; a request's own
integer `seed` makes each choice's output a function of (seed, prompt, choice) alone.
"""

from __future__ import annotations

import functools
import hashlib
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

import orjson

from gateway.sim.metrics import MetricsPage, SpecCounters
from gateway.sim.options import Generation
from gateway.sim.output import Output, compose
from gateway.sim.prefix import PrefixCache
from gateway.sim.profile import SimProfile, apply_overrides
from gateway.sim.scheduler import Pool, PriorityPool, SimStats
from gateway.sim.schema import SchemaError
from gateway.sim.speculative import Speculation
from gateway.sim.text import TOKENS
from gateway.sim.wire import (
    BadRequestError,
    SimConnectionReset,
    SimReply,
    rate_limited_reply,
    server_error_reply,
)

__all__ = ["Deployments", "Plan", "Planner", "Target", "seeded"]

_OVERRIDE_CACHE_SIZE: Final = 1024


@dataclass(slots=True, frozen=True)
class Target:
    """A model name resolved once: its profile and the deployment (batch pool) it runs on."""

    profile: SimProfile
    pool: Pool
    model_json: bytes  # the model name as a JSON string, ready to splice into chunks
    prefill_base_s: float
    prefill_per_token_s: float
    step_s: float  # one decode step with the batch empty; 0: no decode delay
    cache: PrefixCache | None  # the model name's prefix cache; None: off
    speculation: Speculation | None = None  # None: plain decoding
    # Decoded step by step (`gateway.sim.decode`): priority scheduling, a KV-cache limit or
    # speculation is on.
    stepwise: bool = False

    def prefill_s(self, tokens: int, factor: float) -> float:
        """The prefill of `tokens` prompt tokens, its tail factor applied."""
        return (self.prefill_base_s + tokens * self.prefill_per_token_s) * factor


@dataclass(slots=True)
class Plan:
    """Everything drawn for one generated sequence, before any time passes.

    A request generates one sequence per choice (several for a list of prompts, or `n` > 1); each
    takes its own batch slot. `stall_s` and `cut` belong to the request: its sequences share them.
    The prefix cache is looked up when the sequence is scheduled, which may shorten its prefill.
    """

    target: Target
    prompt_tokens: int
    n: int  # output tokens
    finish_reason: str
    offset: int  # first word of the pseudo-text
    stall_s: float
    prefill_s: float  # prefill of the whole prompt, tail included
    slow_s: float  # a slow request's extra TTFT
    cut: bool
    arrived: float  # time.monotonic() when the request was read: TTFT and e2e run from here
    natural: int  # the drawn answer length, before max_tokens
    factor: float = 1.0  # the prefill's tail factor
    blocks: list[bytes] | None = None  # the prompt's block hashes, when the model caches
    cached_tokens: int = 0  # prompt tokens found in the prefix cache
    output: Output | None = None  # None: plain pseudo-text of `n` tokens from `offset`
    priority: int = 0  # the request's (vLLM's) priority: lower is served first
    spec_rng: random.Random | None = None  # the draft acceptances, when the model speculates

    @property
    def ttft_s(self) -> float:
        """Prefill (with tail) plus any slow-request stall, before any prefix cache hit."""
        return self.prefill_s + self.slow_s


class Deployments:
    """Model names resolved to targets: one simulated deployment per name, batch size,
    scheduling policy and KV-cache limit.

    `name@key=value,key=lo-hi` runs `name`'s profile (or the default) with fields replaced; a
    name is resolved once (up to a cache size), and its first use adds it to the metrics page.
    """

    def __init__(
        self,
        profiles: Mapping[str, SimProfile],
        default: SimProfile,
        stats: SimStats,
        page: MetricsPage,
    ) -> None:
        self._profiles = profiles
        self._default = default
        self._stats = stats
        self._page = page
        self._pools: dict[tuple[str, int, str, int | None, bool], Pool] = {}
        self._caches: dict[tuple[str, int], PrefixCache] = {}
        self.resolve = functools.lru_cache(maxsize=_OVERRIDE_CACHE_SIZE)(self._resolve_uncached)

    def _resolve_uncached(self, model: str) -> Target:
        """`name` or `name@key=value,key=lo-hi`: a profile, with fields replaced for this name."""
        name, _, spec = model.rpartition("@")
        if not name or "=" not in spec:  # an "@" without overrides belongs to the name
            name, spec = model, ""
        profile = self._profiles.get(name, self._default)
        if spec:
            try:
                profile = apply_overrides(profile, spec)
            except ValueError as exc:
                raise BadRequestError(f"bad override in model {model!r}: {exc}", "model") from None
        policy, kv_limit = profile.scheduling_policy, profile.kv_cache_tokens
        slots_preempt = policy == "priority" and profile.priority_preemption == "max_num_seqs"
        pool_key = (name, profile.max_batch, policy, kv_limit, slots_preempt)
        pool = self._pools.get(pool_key)
        metrics = self._page.model(name)
        if pool is None:
            if policy == "priority" or kv_limit is not None:  # fcfs: every priority is 0
                pool = PriorityPool(
                    profile.max_batch,
                    self._stats,
                    metrics,
                    profile.kv_tokens_per_seq,
                    kv_limit,
                    preempt_for_slots=slots_preempt,
                )
            else:
                pool = Pool(profile.max_batch, self._stats, metrics, profile.kv_tokens_per_seq)
            self._pools[pool_key] = pool
        speculation = None
        if profile.spec_tokens:
            speculation = Speculation(
                profile.spec_tokens,
                profile.spec_acceptance,
                profile.spec_verify_cost,
                profile.spec_draft_cost,
            )
            if metrics.spec is None:
                metrics.spec = SpecCounters(profile.spec_tokens)
            metrics.spec.widen(profile.spec_tokens)
        cache = None
        if profile.prefix_cache_tokens:
            cache_key = (name, profile.prefix_cache_tokens)
            cache = self._caches.get(cache_key)
            if cache is None:
                cache = self._caches[cache_key] = PrefixCache(profile.prefix_cache_tokens)
        return Target(
            profile=profile,
            pool=pool,
            model_json=orjson.dumps(model),
            prefill_base_s=profile.prefill_base_ms / 1000,
            prefill_per_token_s=profile.prefill_ms_per_token / 1000,
            step_s=1 / profile.tokens_per_s if profile.tokens_per_s else 0.0,
            cache=cache,
            speculation=speculation,
            stepwise=speculation is not None or policy == "priority" or kv_limit is not None,
        )


def seeded(seed: int, key: bytes, choice: int) -> random.Random:
    """The RNG of one choice's output under a request seed: a function of (seed, prompt, choice).

    It draws the output length, the first word and the rest of the output (reasoning, JSON, tool
    calls, log probabilities), so a prompt gets the same answer alone or inside a batch of
    prompts, whatever else the engine has drawn before.
    """
    digest = hashlib.blake2b(b"%d\x00%d\x00" % (seed, choice) + key, digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "little"))


class Planner:
    """The engine's one seeded RNG, and every draw made from it.

    The fault draws also count the request and its fault in the engine's `stats`.
    """

    def __init__(self, seed: int | None, stats: SimStats) -> None:
        self._rng = random.Random(seed)
        self._stats = stats
        # The first draw: response ids differ between engines (and between seeds).
        self.id_prefix = f"{self._rng.getrandbits(32):08x}"

    @property
    def rng(self) -> random.Random:
        """The engine's RNG, for the draws of a request without a seed of its own."""
        return self._rng

    def _hit(self, rate: float) -> bool:
        return rate > 0 and self._rng.random() < rate

    def early_fault(self, profile: SimProfile) -> SimReply | None:
        """Draw the faults that answer at once; raise for a reset. Counts the request."""
        stats = self._stats
        stats.requests += 1
        stats.changed()
        if self._hit(profile.reset_rate):
            stats.faults += 1
            stats.changed()
            raise SimConnectionReset("simulated connection reset before headers")
        if self._hit(profile.error_429_rate):
            stats.faults += 1
            return rate_limited_reply(profile.retry_after_s)
        if self._hit(profile.error_500_rate):
            stats.faults += 1
            return server_error_reply()
        return None

    def inband(self, profile: SimProfile) -> bool:
        """Draw whether the request answers 200 with an error object (counted as a fault)."""
        if not self._hit(profile.inband_error_rate):
            return False
        self._stats.faults += 1
        return True

    def stall_and_cut(self, profile: SimProfile) -> tuple[float, bool]:
        """The request's stall (s, or 0) and whether its connection is cut."""
        stall_s = profile.stall_ms / 1000 if self._hit(profile.stall_rate) else 0.0
        return stall_s, self._hit(profile.cut_rate)

    def _ms(self, value: float | tuple[float, float]) -> float:
        if isinstance(value, tuple):
            return self._rng.uniform(*value)
        return value

    def plan(
        self,
        target: Target,
        prompt_tokens: int,
        max_tokens: int | None,
        *,
        text: random.Random | None = None,
        request: Plan | None = None,
    ) -> Plan:
        """Draw one sequence. `text` (a seeded RNG) draws its length and words instead of the
        engine; `request` is the request's first sequence, whose stall and cut it shares."""
        profile, rng = target.profile, self._rng
        words = rng if text is None else text
        natural = profile.output_tokens
        if isinstance(natural, tuple):
            natural = words.randint(*natural)
        n, finish = natural, "stop"
        if max_tokens is not None and max_tokens < natural:
            n, finish = max_tokens, "length"
        factor = 1.0
        prefill_s = target.prefill_s(prompt_tokens, 1.0)
        if prefill_s and profile.ttft_tail == "lognormal" and profile.ttft_sigma:
            factor = rng.lognormvariate(0.0, profile.ttft_sigma)
            prefill_s *= factor
        slow_s = self._ms(profile.slow_ms) / 1000 if self._hit(profile.slow_rate) else 0.0
        if request is None:
            stall_s = profile.stall_ms / 1000 if self._hit(profile.stall_rate) else 0.0
            cut = self._hit(profile.cut_rate)
        else:
            stall_s, cut = request.stall_s, request.cut
        offset = words.randrange(len(TOKENS))
        arrived = time.monotonic() if request is None else request.arrived
        plan = Plan(
            target,
            prompt_tokens,
            n,
            finish,
            offset,
            stall_s,
            prefill_s,
            slow_s,
            cut,
            arrived,
            natural,
            factor,
        )
        if target.speculation is not None:  # its own RNG: acceptances do not shift other draws
            plan.spec_rng = random.Random(rng.getrandbits(64))
        return plan

    def compose(
        self,
        plan: Plan,
        generation: Generation,
        max_tokens: int | None,
        *,
        text: random.Random | None = None,
        reasoning: bool = True,
    ) -> None:
        """Draw the choice's output, unless it is plain pseudo-text (the fast path), and set
        its length and finish reason. `reasoning`: the endpoint has a place for reasoning
        tokens (chat). Raises BadRequestError for a schema that fails on this draw."""
        profile = plan.target.profile
        reasoning_tokens = profile.reasoning_tokens if reasoning else 0
        if not reasoning_tokens and generation.plain():
            return
        try:
            output = compose(
                generation,
                self._rng if text is None else text,
                reasoning_tokens=reasoning_tokens,
                natural=plan.natural,
                offset=plan.offset,
                max_tokens=max_tokens,
                tool_call_rate=profile.tool_call_rate,
                most_calls=profile.parallel_tool_calls,
            )
        except SchemaError as exc:
            raise BadRequestError(
                f"the simulator cannot generate a value for a schema: {exc}",
                "tools" if generation.tools else "response_format",
                code="unsupported_parameter",
            ) from None
        plan.output = output
        plan.n = output.tokens
        plan.finish_reason = output.finish_reason

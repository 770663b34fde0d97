"""The simulator's profile schema: how one simulated model behaves, and `key=value` overrides.

A leaf: it imports pydantic and nothing of the gateway, so `gateway.config` can embed profiles in
a provider's spec without depending on the simulator itself.
"""

from __future__ import annotations

from typing import Annotated, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

__all__ = ["MetricsFault", "MetricsNames", "SchedulingPolicy", "SimProfile", "apply_overrides"]


def _split_range(value: object) -> object:
    """Accept `"2000-4000"` (CLI flags, model-name overrides) as well as `[2000, 4000]`."""
    if isinstance(value, str):
        lo, sep, hi = value.strip().partition("-")
        if sep and lo:  # a leading "-" is a (rejected) negative number, not a range
            return (lo, hi)
    return value


_R = TypeVar("_R", int, float, tuple[int, int], tuple[float, float])


def _check_range(value: _R) -> _R:
    if isinstance(value, tuple):
        lo, hi = value
        if lo < 0 or hi < lo:
            raise ValueError("a range must be [lo, hi] with 0 <= lo <= hi")
    elif value < 0:
        raise ValueError("must be >= 0")
    return value


MsRange = Annotated[
    float | tuple[float, float], BeforeValidator(_split_range), AfterValidator(_check_range)
]
"""Milliseconds: a fixed value, or `[lo, hi]` drawn uniformly per request."""

TokenRange = Annotated[
    int | tuple[int, int], BeforeValidator(_split_range), AfterValidator(_check_range)
]
"""A token count: a fixed value, or `[lo, hi]` drawn uniformly (inclusive) per request."""

Rate = Annotated[float, Field(ge=0, le=1)]
NonNegative = Annotated[float, Field(ge=0)]


def _none_word(value: object) -> object:
    """Accept `none` / `null` (CLI flags, model-name overrides) for an unset optional field."""
    if isinstance(value, str) and value.strip().lower() in ("none", "null"):
        return None
    return value


MetricsNames = Literal["current", "legacy", "both"]
"""The names `GET /metrics` serves: vLLM's current ones, the deprecated ones, or both."""
SchedulingPolicy = Literal["fcfs", "priority"]
"""vLLM's `--scheduling-policy`: first come first served, or by the request's `priority`."""
PriorityPreemption = Literal["kv_cache", "max_num_seqs"]
"""When a priority server preempts a running sequence for a better one: only when KV-cache blocks
run out (vLLM V1 today), or also when every batch slot is taken (vLLM's open proposals)."""
MetricsFault = Literal["none", "error", "garbage"]
"""How `GET /metrics` fails: `error` answers 500, `garbage` 200 with non-Prometheus text."""


class SimProfile(BaseModel):
    """How one simulated model behaves. Every delay and fault defaults to zero / off."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    # Time to first token.
    prefill_base_ms: NonNegative = Field(0.0, description="Fixed prefill cost per request (ms).")
    prefill_ms_per_token: NonNegative = Field(
        0.0, description="Prefill cost per prompt token (ms); prompt tokens are ~chars/4."
    )
    ttft_tail: Literal["none", "lognormal"] = Field(
        "none", description="Heavy tail on prefill: `lognormal` multiplies it by a median-1 factor."
    )
    ttft_sigma: NonNegative = Field(
        0.0, description="Sigma of the lognormal prefill factor (0.5 gives p99 ~3.2x the median)."
    )
    slow_rate: Rate = Field(0.0, description="Share of requests (0..1) whose TTFT gets `slow_ms`.")
    slow_ms: MsRange = Field(
        0.0, description="Extra TTFT for slow requests (ms), or a [lo, hi] uniform range."
    )
    # Context limit.
    max_input_tokens: Annotated[int | None, BeforeValidator(_none_word)] = Field(
        None,
        ge=1,
        description="Longest input accepted, in prompt tokens as counted here (~chars/4, or the "
        "length of a token array): one longer embeddings input, completions prompt or chat "
        "conversation fails the whole request with a 400 `invalid_request_error`, code "
        "`context_length_exceeded`, param `input`/`prompt`/`messages`, as OpenAI and vLLM do. "
        "Checked before any fault is drawn. None (`none` in an override): no limit.",
    )
    # Decode.
    tokens_per_s: NonNegative = Field(
        0.0, description="Decode speed of one sequence alone; 0 means no decode delay."
    )
    max_batch: int = Field(
        256,
        ge=1,
        description="Sequences decoded at once; more requests queue for a slot (see "
        "`scheduling_policy`).",
    )
    batch_slowdown: NonNegative = Field(
        0.0, description="Extra step time at a full batch, as a fraction (1.0: twice as slow)."
    )
    scheduling_policy: SchedulingPolicy = Field(
        "fcfs",
        description="vLLM's `--scheduling-policy`: `fcfs` queues first come, first served and "
        "refuses a non-zero request `priority` with a 400, as vLLM does; `priority` queues by "
        "(priority, arrival), a lower value first. When a running sequence is preempted for a "
        "better one: `priority_preemption`. A preempted sequence goes back to its place in the "
        "queue and, scheduled again, prefills its prompt and the tokens it generated (vLLM's "
        "recompute) before going on; counted in `vllm:num_preemptions_total`.",
    )
    priority_preemption: PriorityPreemption = Field(
        "kv_cache",
        description="Under `scheduling_policy: priority`, when a better request preempts a "
        "running one. `kv_cache` (vLLM V1 as released): only when KV-cache blocks run out "
        "(`kv_cache_tokens`), by a running sequence that grows into a full cache; a waiting "
        "request never preempts, so when every slot (`max_batch`, vLLM's `max_num_seqs`) is "
        "taken a better request waits at the head of the queue until a running one ends "
        "(vllm-project/vllm issue #40004). `max_num_seqs` (as vLLM's open pull requests #45558, "
        "#45561 and #54530 propose): a request that finds every slot taken also preempts the "
        "running sequence of the lowest priority (the latest arrival among equals) if that is "
        "strictly lower than its own, and under `kv_cache_tokens` running sequences of strictly "
        "lower priority when that makes room for it in the cache.",
    )
    output_tokens: TokenRange = Field(
        16,
        description="Natural output length, or a [lo, hi] range; the request's max_tokens caps it.",
    )
    reasoning_tokens: TokenRange = Field(
        0,
        description="Reasoning tokens generated before the answer, or a [lo, hi] range: streamed "
        "as `delta.reasoning_content` (vLLM's field), `message.reasoning_content` in a whole "
        "body, counted in `usage.completion_tokens_details.reasoning_tokens`. They take decode "
        "time like any token, and the request's max_tokens caps reasoning and answer together.",
    )
    # Speculative decoding.
    spec_tokens: int = Field(
        0,
        ge=0,
        le=64,
        description="Speculative decoding: draft tokens proposed per decode step (vLLM's "
        "`num_speculative_tokens`); 0 turns it off. Each step then costs `1 + spec_tokens x "
        "(spec_verify_cost + spec_draft_cost)` plain steps and yields one token plus the "
        "accepted run of the draft, streamed back to back; TTFT is unchanged.",
    )
    spec_acceptance: Rate = Field(
        0.7,
        description="Chance that each draft token agrees with the target (independently); the "
        "first that does not ends the step's accepted run.",
    )
    spec_verify_cost: NonNegative = Field(
        0.02,
        description="Extra cost of verifying one draft token, as a fraction of a plain decode "
        "step (a forward pass over k + 1 positions costs little more than over one).",
    )
    spec_draft_cost: NonNegative = Field(
        0.05,
        description="Cost of drafting one token, as a fraction of a plain decode step (a small "
        "draft model; an EAGLE-style head costs less).",
    )
    # Tool calls and the prefix cache.
    tool_call_rate: Rate = Field(
        1.0,
        description="Share of chat requests with `tools` and `tool_choice: auto` (the default) "
        "that answer with tool calls, drawn per request. Only when the last message is not a "
        "tool result: after one the model answers in text, so an agent loop ends.",
    )
    parallel_tool_calls: int = Field(
        1,
        ge=1,
        le=128,
        description="Most tool calls in one answer when the request allows parallel calls "
        "(`parallel_tool_calls` true, the default); the count is drawn from 1 to this, each "
        "call's tool from the request's tools. `parallel_tool_calls: false` makes it one.",
    )
    prefix_cache_tokens: int = Field(
        0,
        ge=0,
        description="Capacity of the model name's prefix cache, in prompt tokens (whole "
        "16-token blocks, least recently used evicted); 0 turns it off. A prompt that starts "
        "with cached blocks prefills only the rest, reports them in "
        "`usage.prompt_tokens_details.cached_tokens`, and counts them in `/metrics` "
        "(`vllm:prefix_cache_queries`, `vllm:prefix_cache_hits`).",
    )
    # Embeddings.
    embed_base_ms: NonNegative = Field(0.0, description="Fixed cost of one embeddings call (ms).")
    embed_ms_per_input: NonNegative = Field(0.0, description="Cost per embedded input (ms).")
    embedding_dims: int = Field(
        16, ge=1, le=65536, description="Vector length (a request's `dimensions` overrides it)."
    )
    # Faults, each drawn per request.
    error_429_rate: Rate = Field(0.0, description="Share of requests answered 429.")
    retry_after_s: NonNegative = Field(1.0, description="`retry-after` header of a 429 (s).")
    error_500_rate: Rate = Field(0.0, description="Share of requests answered 500.")
    reset_rate: Rate = Field(
        0.0, description="Share of requests whose connection is reset before any header."
    )
    stall_rate: Rate = Field(
        0.0, description="Share of requests that stall before queueing (holding no batch slot)."
    )
    stall_ms: NonNegative = Field(
        3_600_000.0, description="Length of a stall (ms); the default is effectively forever."
    )
    cut_rate: Rate = Field(
        0.0,
        description="Share of requests cut after about half their tokens (connection dropped).",
    )
    inband_error_rate: Rate = Field(
        0.0, description="Share of requests answered 200 with an error object in the body/stream."
    )
    # vLLM's /metrics.
    kv_tokens_per_seq: int = Field(
        2048,
        ge=1,
        description="KV-cache room per batch slot, in tokens: without `kv_cache_tokens` the "
        "simulated cache holds max_batch x this, and `kv_cache_usage_perc` is the prompt plus "
        "generated tokens of the running sequences over it (an approximation: vLLM counts "
        "allocated blocks).",
    )
    kv_cache_tokens: Annotated[int | None, BeforeValidator(_none_word)] = Field(
        None,
        ge=1,
        description="The KV cache's capacity in tokens, as a limit (`kv_cache_usage_perc` is "
        "then over it): a waiting sequence is scheduled once a slot is free and its prompt, "
        "plus the token its prefill makes, fits in the free KV, in queue order (the head that "
        "does not fit holds back those behind it, as in vLLM); each generated token takes one "
        "more, and a token that finds the cache full preempts the running sequence of the "
        "lowest priority, the latest arrival among equals (under `fcfs`: the latest arrival), "
        "maybe its own, by recompute; with `priority_preemption: max_num_seqs` an arrival that "
        "does not fit also preempts running sequences of strictly lower priority when that "
        "makes room. Counted in "
        "`vllm:num_preemptions_total`. None (`none` in an override): only the slots limit.",
    )
    metrics_names: MetricsNames = Field(
        "current",
        description="Names on `GET /metrics`: `current` (kv_cache_usage_perc, "
        "inter_token_latency_seconds), `legacy` (the deprecated gpu_cache_usage_perc, "
        "time_per_output_token_seconds, as vLLM before 0.10/0.11 served them) or `both`. "
        "The server's page: read from the default profile.",
    )
    metrics_fault: MetricsFault = Field(
        "none",
        description="`GET /metrics` fails: `error` answers 500, `garbage` 200 with a body that is "
        "not Prometheus text. Read from the default profile.",
    )


def apply_overrides(profile: SimProfile, spec: str) -> SimProfile:
    """`profile` with fields replaced from `key=value,key=lo-hi`. Raises ValueError."""
    overrides: dict[str, str] = {}
    for pair in spec.split(","):
        key, eq, value = pair.partition("=")
        key = key.strip()
        if not eq or not key or key in overrides:
            raise ValueError(f"bad override {pair!r}")
        overrides[key] = value.strip()
    try:
        return SimProfile.model_validate(profile.model_dump() | overrides)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        raise ValueError(problems) from None

"""The simulated LLM upstream: an OpenAI-compatible server modelled well enough to study latency.

Time to first token is queueing (waiting FIFO for one of `max_batch` slots) plus prefill (a base
cost plus a cost per prompt token, optionally with a heavy tail). Decoding runs at `tokens_per_s`,
each step slower as the batch fills (continuous batching). A completions request with several
prompts (or `n` > 1) runs one sequence per choice, each in its own slot, as vLLM does. Faults (429,
500, resets, stalls, cut streams, in-band errors) are drawn per request at configured rates. Every
draw comes from one seeded RNG in arrival order, so a run is reproducible; a request's own integer
`seed` makes each choice's text a function of (seed, prompt) alone.

The engine speaks bytes in and bytes out (`SimEngine.handle`), so the in-process provider and the
standalone server (`gateway.sim.server`) share one implementation. With every delay at zero it
never sleeps, and a streamed token costs one bytes concatenation (and a few counter updates).

`GET /metrics` serves vLLM's Prometheus metrics, driven by the engine's real state (see
`SimEngine.metrics_page`): the queue gauges, an approximate KV-cache usage, the TTFT, inter-token
and end-to-end histograms with vLLM's buckets, and the token and finished-request counters, per
model name, under the current or the older (deprecated) names; it can be made to fail.
"""

from __future__ import annotations

import asyncio
import base64
import bisect
import functools
import hashlib
import itertools
import math
import random
import struct
import time
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Final, Literal, TypeVar

import orjson
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

__all__ = [
    "METRICS_CONTENT_TYPE",
    "SimConnectionReset",
    "SimEngine",
    "SimProfile",
    "SimReply",
    "SimStats",
    "apply_overrides",
]


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
        256, ge=1, description="Sequences decoded at once; more requests queue FIFO for a slot."
    )
    batch_slowdown: NonNegative = Field(
        0.0, description="Extra step time at a full batch, as a fraction (1.0: twice as slow)."
    )
    output_tokens: TokenRange = Field(
        16,
        description="Natural output length, or a [lo, hi] range; the request's max_tokens caps it.",
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
        description="KV-cache room per batch slot, in tokens: the simulated cache holds max_batch "
        "x this, and `kv_cache_usage_perc` is the prompt plus generated tokens of the running "
        "sequences over it (an approximation: vLLM counts allocated blocks).",
    )
    metrics_names: Literal["current", "legacy", "both"] = Field(
        "current",
        description="Names on `GET /metrics`: `current` (kv_cache_usage_perc, "
        "inter_token_latency_seconds), `legacy` (the deprecated gpu_cache_usage_perc, "
        "time_per_output_token_seconds, as vLLM before 0.10/0.11 served them) or `both`. "
        "The server's page: read from the default profile.",
    )
    metrics_fault: Literal["none", "error", "garbage"] = Field(
        "none",
        description="`GET /metrics` fails: `error` answers 500, `garbage` 200 with a body that is "
        "not Prometheus text. Read from the default profile.",
    )


class SimConnectionReset(Exception):  # noqa: N818 - the name is the public contract
    """The simulated server drops the connection (before headers, or mid-stream)."""


@dataclass(slots=True)
class SimReply:
    """One response: a complete JSON `body`, or a `stream` of SSE frames (never both).

    `stream` is an async generator of complete SSE events. It may raise `SimConnectionReset` part
    way (a cut stream). Whoever abandons it early must `aclose()` it: that frees its batch slot
    and counts it as cancelled.
    """

    status: int
    headers: dict[str, str]
    body: bytes | None = None
    stream: AsyncGenerator[bytes, None] | None = None


@dataclass(slots=True)
class SimStats:
    """Live counters of one engine. `wait_for` lets a test await a state instead of sleeping.

    `requests` counts inference requests that parsed (chat, completions, embeddings); each ends
    as exactly one of `completed`, `cancelled` (the client left first) or `faults` (a simulated
    429, 500, reset, cut or in-band error). `running` holds batch slots, `waiting` queues for one.
    """

    requests: int = 0
    running: int = 0
    waiting: int = 0
    completed: int = 0
    cancelled: int = 0
    faults: int = 0
    open_streams: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    _waiters: list[tuple[Callable[[SimStats], bool], asyncio.Future[None]]] = field(
        default_factory=list, repr=False, compare=False
    )

    def changed(self) -> None:
        """Wake the waiters whose predicate now holds. Called after every change."""
        if not self._waiters:  # the common case costs one check
            return
        for predicate, future in self._waiters:
            if not future.done() and predicate(self):
                future.set_result(None)

    async def wait_for(self, predicate: Callable[[SimStats], bool]) -> None:
        """Return once `predicate(stats)` holds (at once if it already does)."""
        if predicate(self):
            return
        entry = (predicate, asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        try:
            await entry[1]
        finally:
            self._waiters.remove(entry)


# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py), in seconds.
TTFT_BUCKETS: Final = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS: Final = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS: Final = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
FINISHED_REASONS: Final = ("stop", "length", "abort")
METRICS_CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"


class _Histogram:
    """A Prometheus histogram: per-bucket counts (made cumulative when written), count, sum."""

    __slots__ = ("bounds", "count", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.count = 0
        self.total = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        if times <= 0:
            return
        index = bisect.bisect_left(self.bounds, value)  # the first bound >= value: `le`
        if index < len(self.bounds):
            self.counts[index] += times
        self.count += times
        self.total += value * times

    def write(self, out: list[str], name: str, labels: str) -> None:
        running = 0
        for bound, n in zip(self.bounds, self.counts, strict=True):
            running += n
            out.append(f'{name}_bucket{{{labels},le="{bound}"}} {float(running)}')
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {float(self.count)}')
        out.append(f"{name}_count{{{labels}}} {float(self.count)}")
        out.append(f"{name}_sum{{{labels}}} {self.total!r}")


class _ModelMetrics:
    """vLLM's series for one served model name (over every batch pool of that name)."""

    __slots__ = ("e2e", "finished", "generation_tokens", "itl", "pools", "prompt_tokens", "ttft")

    def __init__(self) -> None:
        self.pools: list[_Pool] = []
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished = dict.fromkeys(FINISHED_REASONS, 0)
        self.ttft = _Histogram(TTFT_BUCKETS)
        self.itl = _Histogram(ITL_BUCKETS)
        self.e2e = _Histogram(E2E_BUCKETS)

    def first_token(self, arrived: float, prompt_tokens: int) -> None:
        """A sequence's prefill is done and its first token out."""
        self.ttft.observe(time.monotonic() - arrived)
        self.prompt_tokens += prompt_tokens

    def done(self, arrived: float, reason: str) -> None:
        """A sequence finished: `stop`, `length` or `abort` (the client left, or a cut)."""
        self.finished[reason] += 1
        if reason != "abort":
            self.e2e.observe(time.monotonic() - arrived)


class _Pool:
    """The batch slots of one simulated deployment, handed out first come, first served.

    Besides the engine-wide `stats`, it counts its own waiters and the tokens its running
    sequences hold in the (simulated) KV cache, for `/metrics`.
    """

    __slots__ = (
        "capacity",
        "kv_capacity",
        "kv_tokens",
        "metrics",
        "running",
        "stats",
        "waiters",
        "waiting",
    )

    def __init__(
        self,
        capacity: int,
        stats: SimStats,
        metrics: _ModelMetrics | None = None,
        kv_tokens_per_seq: int = 2048,
    ) -> None:
        self.capacity = capacity
        self.running = 0
        self.waiting = 0
        self.kv_tokens = 0
        self.kv_capacity = capacity * kv_tokens_per_seq
        self.stats = stats
        self.metrics = metrics if metrics is not None else _ModelMetrics()
        self.metrics.pools.append(self)
        self.waiters: deque[asyncio.Future[None]] = deque()

    async def acquire(self) -> None:
        stats = self.stats
        if self.running < self.capacity and not self.waiters:
            self.running += 1
            stats.running += 1
            stats.changed()
            return
        future = asyncio.get_running_loop().create_future()
        self.waiters.append(future)
        self.waiting += 1
        stats.waiting += 1
        stats.changed()
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release()  # a slot was handed over just as we were cancelled: pass it on
            elif future in self.waiters:  # `release` may have dropped it already (it was done)
                self.waiters.remove(future)
            raise
        finally:
            self.waiting -= 1
            stats.waiting -= 1
            stats.changed()

    def release(self) -> None:
        while self.waiters:
            future = self.waiters.popleft()
            if not future.done():
                future.set_result(None)  # the slot passes on; `running` is unchanged
                return
        self.running -= 1
        self.stats.running -= 1
        self.stats.changed()

    def step_s(self, base_step_s: float, slowdown: float) -> float:
        if not slowdown:
            return base_step_s
        return base_step_s * (1 + slowdown * (self.running - 1) / max(1, self.capacity - 1))


@dataclass(slots=True, frozen=True)
class _Target:
    """A model name resolved once: its profile and the deployment (batch pool) it runs on."""

    profile: SimProfile
    pool: _Pool
    model_json: bytes  # the model name as a JSON string, ready to splice into chunks
    prefill_base_s: float
    prefill_per_token_s: float
    step_s: float  # one decode step with the batch empty; 0: no decode delay


class _BadRequestError(Exception):
    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        *,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code


# Pseudo-text: a cycle over a fixed word list, each request starting at a seeded offset.
# fmt: off
_WORDS: Final = (
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven",
    "tired", "engineers", "measure", "tail", "latency", "of", "every", "streamed", "token",
    "under", "heavy", "load", "and", "note", "how", "queues", "grow", "when", "batches", "fill",
    "up", "so", "they", "route", "slow", "requests", "elsewhere", "before", "budgets", "run",
    "out", "then", "hedge", "once", "more", "because", "p99", "matters", "far", "beyond", "any",
    "mean",
)
# fmt: on
_TOKENS: Final = tuple(word + " " for word in _WORDS)
_CYCLE: Final = "".join(_TOKENS)
_STARTS: Final = tuple(itertools.accumulate((len(t) for t in _TOKENS), initial=0))

_JSON: Final = {"content-type": "application/json"}
_SSE: Final = {"content-type": "text/event-stream", "cache-control": "no-cache"}
_DONE: Final = b"data: [DONE]\n\n"
_CHOICE_TAIL: Final = b',"logprobs":null,"finish_reason":null}]'
_VECTOR_CACHE_SIZE: Final = 4096
_OVERRIDE_CACHE_SIZE: Final = 1024


def _text(offset: int, n: int) -> str:
    """`n` tokens of pseudo-text starting at word `offset` (the same text the stream sends)."""
    q, r = divmod(offset + n, len(_TOKENS))
    return (_CYCLE * q + _CYCLE[: _STARTS[r]])[_STARTS[offset] :]


def _error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}
    )


def _json_reply(status: int, body: bytes, headers: Mapping[str, str] = _JSON) -> SimReply:
    return SimReply(status, dict(headers), body)


def _text_tokens(chars: int) -> int:
    return max(1, (chars + 3) // 4)


def _message_chars(messages: object) -> int:
    if not isinstance(messages, list) or not messages:
        raise _BadRequestError("'messages' must be a non-empty array of messages", "messages")
    chars = 0
    for message in messages:
        if not isinstance(message, dict):
            raise _BadRequestError("each message must be an object", "messages")
        content = message.get("content")
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(text := part.get("text"), str):
                    chars += len(text)
        elif content is not None:
            raise _BadRequestError("a message's 'content' must be a string or an array", "messages")
    return chars


def _pieces(value: object, param: str) -> list[tuple[bytes, int]]:
    """Prompts or embedding inputs as (key, tokens): a string, strings, token array(s).

    The key identifies the text (it hashes embedding vectors and seeded completions): a string's
    UTF-8 bytes, or a NUL byte and the JSON of a token array.
    """
    if isinstance(value, str):
        return [(value.encode(), _text_tokens(len(value)))]
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return [(v.encode(), _text_tokens(len(v))) for v in value]
        if all(isinstance(v, int) for v in value):
            return [(b"\x00" + orjson.dumps(value), len(value))]
        if all(isinstance(v, list) and v and all(isinstance(t, int) for t in v) for v in value):
            return [(b"\x00" + orjson.dumps(v), len(v)) for v in value]
    raise _BadRequestError(
        f"'{param}' must be a string, an array of strings or an array of token arrays", param
    )


def _check_context(limit: int | None, tokens: Sequence[int], param: str) -> None:
    """Reject the whole request when any one input is longer than the profile's limit."""
    if limit is None:
        return
    for i, count in enumerate(tokens):
        if count > limit:
            where = f"{param} {i}" if len(tokens) > 1 else f"the {param}"
            raise _BadRequestError(
                f"This model's maximum context length is {limit} tokens, however you requested "
                f"{count} tokens ({count} in {where}). Please reduce the length of the {param}.",
                param,
                code="context_length_exceeded",
            )


def _seed(request: dict[str, Any]) -> int | None:
    seed = request.get("seed")
    if seed is None:
        return None
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise _BadRequestError("'seed' must be an integer", "seed")
    return seed


_MAX_N: Final = 128  # OpenAI's limit


def _choices_per_prompt(request: dict[str, Any]) -> int:
    n = request.get("n")
    if n is None:
        return 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= _MAX_N:
        raise _BadRequestError(f"'n' must be an integer in [1, {_MAX_N}]", "n")
    return n


def _seeded(seed: int, key: bytes, choice: int) -> random.Random:
    """The RNG of one choice's text under a request seed: a function of (seed, prompt, choice).

    It draws the output length and the first word, so a prompt gets the same text alone or inside
    a batch of prompts, whatever else the engine has drawn before.
    """
    digest = hashlib.blake2b(b"%d\x00%d\x00" % (seed, choice) + key, digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "little"))


@functools.lru_cache(maxsize=_VECTOR_CACHE_SIZE)
def _vector(key: bytes, dims: int) -> tuple[tuple[float, ...], str]:
    """A unit vector derived from the input alone, as floats and as base64 float32 (LE)."""
    raw = struct.unpack(f"<{dims}H", hashlib.shake_128(key).digest(2 * dims))
    centred = [v - 32767.5 for v in raw]  # never all zero: each |v| >= 0.5
    norm = math.sqrt(math.fsum(v * v for v in centred))
    packed = struct.pack(f"<{dims}f", *(v / norm for v in centred))
    # Both encodings carry the same float32 values.
    return struct.unpack(f"<{dims}f", packed), base64.b64encode(packed).decode()


def _max_tokens(request: dict[str, Any]) -> int | None:
    for name in ("max_completion_tokens", "max_tokens"):
        value = request.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise _BadRequestError(f"'{name}' must be an integer >= 1", name)
        return value
    return None


def _include_usage(request: dict[str, Any]) -> bool:
    options = request.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise _BadRequestError("'stream_options' must be an object", "stream_options")
    return options.get("include_usage") is True


def _stream_flag(request: dict[str, Any]) -> bool:
    stream = request.get("stream", False)
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise _BadRequestError("'stream' must be a boolean", "stream")
    return stream


@dataclass(slots=True)
class _Plan:
    """Everything drawn for one generated sequence, before any time passes.

    A request generates one sequence per choice (several for a list of prompts, or `n` > 1); each
    takes its own batch slot. `stall_s` and `cut` belong to the request: its sequences share them.
    """

    target: _Target
    prompt_tokens: int
    n: int  # output tokens
    finish_reason: str
    offset: int  # first word of the pseudo-text
    stall_s: float
    ttft_s: float  # prefill (with tail) plus any slow-request stall
    cut: bool
    arrived: float  # time.monotonic() when the request was read: TTFT and e2e run from here


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
        self._rng = random.Random(seed)
        self._ids = itertools.count(1)
        self._id_prefix = f"{self._rng.getrandbits(32):08x}"
        self._pools: dict[tuple[str, int], _Pool] = {}
        self._resolve = functools.lru_cache(maxsize=_OVERRIDE_CACHE_SIZE)(self._resolve_uncached)
        names = list(self.profiles) or ["default"]
        # /metrics: the served names from the start (as vLLM's --served-model-name), then every
        # name requested. The page's names and whether it fails can be changed while running.
        self._metrics: dict[str, _ModelMetrics] = {name: _ModelMetrics() for name in names}
        self.metrics_names: Literal["current", "legacy", "both"] = self.default.metrics_names
        self.metrics_fault: Literal["none", "error", "garbage"] = self.default.metrics_fault
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
        }

    async def handle(self, method: str, path: str, body: bytes) -> SimReply:
        """Answer one request. Raises `SimConnectionReset` for a reset before headers."""
        route = self._routes.get((method, path))
        try:
            if route is not None:
                request = self._parse(body)
                reply: SimReply = await route(request)
                return reply
            if path == "/v1/models" and method == "GET":
                return _json_reply(200, self._models_body)
            if path == "/health" and method == "GET":
                return SimReply(200, {}, b"")
            if path == "/metrics" and method == "GET":
                return self._metrics_reply()
            if path in ("/v1/models", "/health", "/metrics") or any(
                p == path for _, p in self._routes
            ):
                raise _BadRequestError(f"method {method} not allowed on {path}", status=405)
            raise _BadRequestError(f"no such endpoint: {method} {path}", status=404)
        except _BadRequestError as exc:
            return _json_reply(
                exc.status, _error_body(exc.message, "invalid_request_error", exc.param, exc.code)
            )

    # vLLM's /metrics.

    def _metrics_reply(self) -> SimReply:
        if self.metrics_fault == "error":
            body = b"simulated failure of the metrics exporter\n"
            return SimReply(500, {"content-type": "text/plain; charset=utf-8"}, body)
        if self.metrics_fault == "garbage":
            body = b"<html><body><h1>502 Bad Gateway</h1></body></html>\n"
            return SimReply(200, {"content-type": METRICS_CONTENT_TYPE}, body)
        return SimReply(200, {"content-type": METRICS_CONTENT_TYPE}, self.metrics_page().encode())

    def metrics_page(self) -> str:
        """vLLM's Prometheus text for every model name served or requested so far.

        Labelled `model_name` and `engine="0"`, as one vLLM engine labels them. `running` holds
        batch slots, `waiting` queues for one; `kv_cache_usage_perc` is the prompt plus generated
        tokens of the running sequences over `max_batch x kv_tokens_per_seq` (capped at 1). TTFT
        runs from the request's arrival to its first token, per sequence; the inter-token
        histogram takes one decode step per token after the first; e2e, arrival to the last token
        of a finished (not aborted) sequence. `request_success_total{finished_reason}` counts
        `stop`, `length` and `abort` (a client that left, a cut stream); prompt tokens are
        counted at prefill, generated ones as they are made.
        """
        current = self.metrics_names in ("current", "both")
        legacy = self.metrics_names in ("legacy", "both")
        series = [
            (f'model_name="{_label_value(name)}",engine="0"', m)
            for name, m in self._metrics.items()
        ]
        out: list[str] = []

        def head(name: str, kind: str, text: str) -> None:
            out.append(f"# HELP {name} {text}")
            out.append(f"# TYPE {name} {kind}")

        def gauges(name: str, text: str, value: Callable[[_ModelMetrics], float]) -> None:
            head(name, "gauge", text)
            out.extend(f"{name}{{{labels}}} {float(value(m))!r}" for labels, m in series)

        def kv_usage(m: _ModelMetrics) -> float:
            capacity = sum(p.kv_capacity for p in m.pools)
            return min(1.0, sum(p.kv_tokens for p in m.pools) / capacity) if capacity else 0.0

        gauges(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            lambda m: sum(p.running for p in m.pools),
        )
        gauges(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            lambda m: sum(p.waiting for p in m.pools),
        )
        if legacy:
            gauges(
                "vllm:gpu_cache_usage_perc",
                "GPU KV-cache usage. 1 means 100 percent usage."
                "DEPRECATED: Use vllm:kv_cache_usage_perc instead.",
                kv_usage,
            )
        if current:
            gauges(
                "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv_usage
            )
        for name, text, attr in (
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens"),
            (
                "vllm:generation_tokens",
                "Number of generation tokens processed.",
                "generation_tokens",
            ),
        ):
            head(name, "counter", text)
            out.extend(
                f"{name}_total{{{labels}}} {float(getattr(m, attr))!r}" for labels, m in series
            )
        head("vllm:request_success", "counter", "Count of successfully processed requests.")
        for labels, m in series:
            out.extend(
                f'vllm:request_success_total{{{labels},finished_reason="{reason}"}} {float(n)!r}'
                for reason, n in m.finished.items()
            )
        histograms: list[tuple[str, str, Callable[[_ModelMetrics], _Histogram]]] = [
            (
                "vllm:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                lambda m: m.ttft,
            ),
        ]
        if legacy:
            histograms.append(
                (
                    "vllm:time_per_output_token_seconds",
                    "Histogram of time per output token in seconds."
                    "DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
                    lambda m: m.itl,
                )
            )
        if current:
            histograms.append(
                (
                    "vllm:inter_token_latency_seconds",
                    "Histogram of inter-token latency in seconds.",
                    lambda m: m.itl,
                )
            )
        histograms.append(
            (
                "vllm:e2e_request_latency_seconds",
                "Histogram of e2e request latency in seconds.",
                lambda m: m.e2e,
            )
        )
        for name, text, pick in histograms:
            head(name, "histogram", text)
            for labels, m in series:
                pick(m).write(out, name, labels)
        out.append("")
        return "\n".join(out)

    # Parsing and resolution.

    @staticmethod
    def _parse(body: bytes) -> dict[str, Any]:
        try:
            request = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise _BadRequestError(f"the body is not valid JSON: {exc}") from None
        if not isinstance(request, dict):
            raise _BadRequestError("the body must be a JSON object")
        return request

    def _target(self, request: dict[str, Any]) -> _Target:
        model = request.get("model")
        if not isinstance(model, str) or not model:
            raise _BadRequestError("'model' must be a non-empty string", "model")
        return self._resolve(model)

    def _resolve_uncached(self, model: str) -> _Target:
        """`name` or `name@key=value,key=lo-hi`: a profile, with fields replaced for this name."""
        name, _, spec = model.rpartition("@")
        if not name or "=" not in spec:  # an "@" without overrides belongs to the name
            name, spec = model, ""
        profile = self.profiles.get(name, self.default)
        if spec:
            try:
                profile = apply_overrides(profile, spec)
            except ValueError as exc:
                raise _BadRequestError(f"bad override in model {model!r}: {exc}", "model") from None
        pool_key = (name, profile.max_batch)  # one simulated deployment per name and batch size
        pool = self._pools.get(pool_key)
        if pool is None:
            metrics = self._metrics.get(name)
            if metrics is None:
                metrics = self._metrics[name] = _ModelMetrics()
            pool = self._pools[pool_key] = _Pool(
                profile.max_batch, self.stats, metrics, profile.kv_tokens_per_seq
            )
        return _Target(
            profile=profile,
            pool=pool,
            model_json=orjson.dumps(model),
            prefill_base_s=profile.prefill_base_ms / 1000,
            prefill_per_token_s=profile.prefill_ms_per_token / 1000,
            step_s=1 / profile.tokens_per_s if profile.tokens_per_s else 0.0,
        )

    # Fault draws, shared by every endpoint.

    def _hit(self, rate: float) -> bool:
        return rate > 0 and self._rng.random() < rate

    def _early_fault(self, profile: SimProfile) -> SimReply | None:
        """Draw the faults that answer at once; raise for a reset. Counts the request."""
        stats = self.stats
        stats.requests += 1
        stats.changed()
        if self._hit(profile.reset_rate):
            stats.faults += 1
            stats.changed()
            raise SimConnectionReset("simulated connection reset before headers")
        if self._hit(profile.error_429_rate):
            stats.faults += 1
            retry = profile.retry_after_s
            body = _error_body(
                "Rate limit reached (simulated).", "rate_limit_error", None, "rate_limit_exceeded"
            )
            retry_text = str(int(retry)) if retry == int(retry) else str(retry)
            return _json_reply(429, body, {**_JSON, "retry-after": retry_text})
        if self._hit(profile.error_500_rate):
            stats.faults += 1
            body = _error_body(
                "The server had an error while processing your request (simulated).",
                "server_error",
            )
            return _json_reply(500, body)
        return None

    def _ms(self, value: float | tuple[float, float]) -> float:
        if isinstance(value, tuple):
            return self._rng.uniform(*value)
        return value

    def _plan(
        self,
        target: _Target,
        prompt_tokens: int,
        max_tokens: int | None,
        *,
        text: random.Random | None = None,
        request: _Plan | None = None,
    ) -> _Plan:
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
        ttft_s = target.prefill_base_s + prompt_tokens * target.prefill_per_token_s
        if ttft_s and profile.ttft_tail == "lognormal" and profile.ttft_sigma:
            ttft_s *= rng.lognormvariate(0.0, profile.ttft_sigma)
        if self._hit(profile.slow_rate):
            ttft_s += self._ms(profile.slow_ms) / 1000
        if request is None:
            stall_s = profile.stall_ms / 1000 if self._hit(profile.stall_rate) else 0.0
            cut = self._hit(profile.cut_rate)
        else:
            stall_s, cut = request.stall_s, request.cut
        offset = words.randrange(len(_TOKENS))
        arrived = time.monotonic() if request is None else request.arrived
        return _Plan(target, prompt_tokens, n, finish, offset, stall_s, ttft_s, cut, arrived)

    def _inband(self, profile: SimProfile) -> bytes | None:
        if not self._hit(profile.inband_error_rate):
            return None
        self.stats.faults += 1
        return _error_body(
            "The model failed to generate a response (simulated in-band error).",
            "server_error",
            None,
            "inband_error",
        )

    def _inband_reply(self, error: bytes, stream: bool) -> SimReply:
        if stream:
            return SimReply(200, dict(_SSE), stream=self._error_stream(error))
        return _json_reply(200, error)

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}{self._id_prefix}{next(self._ids):08x}"

    # Endpoints.

    async def _chat(self, request: dict[str, Any]) -> SimReply:
        target = self._target(request)
        messages = request.get("messages")
        prompt_tokens = _text_tokens(_message_chars(messages))
        _check_context(target.profile.max_input_tokens, (prompt_tokens,), "messages")
        max_tokens = _max_tokens(request)
        stream = _stream_flag(request)
        usage = _include_usage(request)
        seed = _seed(request)
        if (early := self._early_fault(target.profile)) is not None:
            return early
        if (inband := self._inband(target.profile)) is not None:
            return self._inband_reply(inband, stream)
        text = None if seed is None else _seeded(seed, orjson.dumps(messages), 0)
        plan = self._plan(target, prompt_tokens, max_tokens, text=text)
        if stream:
            head = (
                b'data: {"id":"'
                + self._new_id("chatcmpl-").encode()
                + b'","object":"chat.completion.chunk","created":'
                + str(int(time.time())).encode()
                + b',"model":'
                + target.model_json
                + b',"system_fingerprint":null,"choices":'
            )
            tail = b',"usage":null}\n\n' if usage else b"}\n\n"
            role = head + b'[{"index":0,"delta":{"role":"assistant","content":""}' + _CHOICE_TAIL
            return SimReply(
                200,
                dict(_SSE),
                stream=self._token_stream(
                    plan,
                    first=role + tail,
                    token_head=head + b'[{"index":0,"delta":{"content":',
                    token_tails=_CHAT_TAILS[usage],
                    finish=head
                    + b'[{"index":0,"delta":{},"logprobs":null,"finish_reason":"'
                    + plan.finish_reason.encode()
                    + b'"}]'
                    + tail,
                    usage_head=head + b'[],"usage":' if usage else None,
                ),
            )
        await self._generate((plan,), plan.prompt_tokens)
        completion = {
            "id": self._new_id("chatcmpl-"),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": request["model"],
            "system_fingerprint": None,
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": _text(plan.offset, plan.n),
                        "refusal": None,
                    },
                    "logprobs": None,
                    "finish_reason": plan.finish_reason,
                }
            ],
            "usage": _usage(plan.prompt_tokens, plan.n),
        }
        return _json_reply(200, orjson.dumps(completion))

    async def _completions(self, request: dict[str, Any]) -> SimReply:
        """Each prompt, and each of its `n` choices, is a sequence of its own (as in vLLM).

        Choice `index` is `prompt * n + j`. Under an integer `seed` a choice's text is a function
        of (seed, prompt, j), so a prompt reads the same alone or among others. Faults are drawn
        once for the whole request.
        """
        target = self._target(request)
        prompts = _pieces(request.get("prompt"), "prompt")
        _check_context(target.profile.max_input_tokens, [t for _, t in prompts], "prompt")
        max_tokens = _max_tokens(request)
        stream = _stream_flag(request)
        usage = _include_usage(request)
        seed = _seed(request)
        per_prompt = _choices_per_prompt(request)
        if stream and len(prompts) > 1:
            raise _BadRequestError("streaming supports a single prompt only", "prompt")
        if stream and per_prompt > 1:
            raise _BadRequestError("streaming supports n = 1 only", "n")
        if (early := self._early_fault(target.profile)) is not None:
            return early
        if (inband := self._inband(target.profile)) is not None:
            return self._inband_reply(inband, stream)
        plans: list[_Plan] = []
        for key, tokens in prompts:
            for j in range(per_prompt):
                text = None if seed is None else _seeded(seed, key, j)
                first = plans[0] if plans else None
                plans.append(self._plan(target, tokens, max_tokens, text=text, request=first))
        plan = plans[0]
        if stream:
            head = (
                b'data: {"id":"'
                + self._new_id("cmpl-").encode()
                + b'","object":"text_completion","created":'
                + str(int(time.time())).encode()
                + b',"model":'
                + target.model_json
                + b',"choices":'
            )
            tail = b',"usage":null}\n\n' if usage else b"}\n\n"
            return SimReply(
                200,
                dict(_SSE),
                stream=self._token_stream(
                    plan,
                    first=None,
                    token_head=head + b'[{"index":0,"text":',
                    token_tails=_TEXT_TAILS[usage],
                    finish=head
                    + b'[{"index":0,"text":"","logprobs":null,"finish_reason":"'
                    + plan.finish_reason.encode()
                    + b'"}]'
                    + tail,
                    usage_head=head + b'[],"usage":' if usage else None,
                ),
            )
        prompt_tokens = sum(tokens for _, tokens in prompts)  # once per prompt, whatever n is
        await self._generate(plans, prompt_tokens)
        completion = {
            "id": self._new_id("cmpl-"),
            "object": "text_completion",
            "created": int(time.time()),
            "model": request["model"],
            "choices": [
                {
                    "index": i,
                    "text": _text(p.offset, p.n),
                    "logprobs": None,
                    "finish_reason": p.finish_reason,
                }
                for i, p in enumerate(plans)
            ],
            "usage": _usage(prompt_tokens, sum(p.n for p in plans)),
        }
        return _json_reply(200, orjson.dumps(completion))

    async def _embeddings(self, request: dict[str, Any]) -> SimReply:
        target = self._target(request)
        inputs = _pieces(request.get("input"), "input")
        _check_context(target.profile.max_input_tokens, [t for _, t in inputs], "input")
        encoding = request.get("encoding_format") or "float"
        if encoding not in ("float", "base64"):
            raise _BadRequestError(
                "'encoding_format' must be 'float' or 'base64'", "encoding_format"
            )
        dims = request.get("dimensions") or target.profile.embedding_dims
        if not isinstance(dims, int) or isinstance(dims, bool) or not 1 <= dims <= 65536:
            raise _BadRequestError("'dimensions' must be an integer in [1, 65536]", "dimensions")
        profile = target.profile
        if (early := self._early_fault(profile)) is not None:
            return early
        if (inband := self._inband(profile)) is not None:
            return _json_reply(200, inband)
        stall_s = profile.stall_ms / 1000 if self._hit(profile.stall_rate) else 0.0
        cut = self._hit(profile.cut_rate)
        work_s = (profile.embed_base_ms + profile.embed_ms_per_input * len(inputs)) / 1000
        tokens = sum(t for _, t in inputs)
        await self._work(target.pool, stall_s, work_s, cut, prompt_tokens=tokens)
        b64 = encoding == "base64"
        data = [
            {"object": "embedding", "index": i, "embedding": _vector(key, dims)[b64]}
            for i, (key, _) in enumerate(inputs)
        ]
        body = {
            "object": "list",
            "data": data,
            "model": request["model"],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        return _json_reply(200, orjson.dumps(body))

    # Time.

    async def _work(
        self, pool: _Pool, stall_s: float, work_s: float, cut: bool, *, prompt_tokens: int
    ) -> None:
        """A non-generating request: stall, queue, hold a slot for `work_s`, then finish."""
        stats, metrics = self.stats, pool.metrics
        arrived = time.monotonic()
        try:
            if stall_s:
                await asyncio.sleep(stall_s)
            try:
                await pool.acquire()
            except asyncio.CancelledError:
                metrics.done(arrived, "abort")
                raise
            pool.kv_tokens += prompt_tokens
            reason = "abort"
            try:
                if work_s:
                    await asyncio.sleep(work_s)
                metrics.prompt_tokens += prompt_tokens
                reason = "stop"
            finally:
                pool.release()
                pool.kv_tokens -= prompt_tokens
                metrics.done(arrived, reason)
        except asyncio.CancelledError:
            stats.cancelled += 1
            stats.changed()
            raise
        stats.prompt_tokens += prompt_tokens
        self._finish(cut)

    def _finish(self, cut: bool) -> None:
        stats = self.stats
        if cut:  # the work was done, then the connection dropped instead of the answer
            stats.faults += 1
            stats.changed()
            raise SimConnectionReset("simulated connection drop before the response")
        stats.completed += 1
        stats.changed()

    async def _generate(self, plans: Sequence[_Plan], prompt_tokens: int) -> None:
        """A non-streaming generation: the same timeline as a stream, without the frames.

        The request stalls once, then its sequences run concurrently, each in its own batch slot
        (queueing FIFO for one like any other request); it answers when the last one is done.
        """
        stats = self.stats
        try:
            if plans[0].stall_s:
                await asyncio.sleep(plans[0].stall_s)
            if len(plans) == 1:
                await self._sequence(plans[0])
            else:  # cancelling the request cancels every sequence and waits for their slots
                await asyncio.gather(*(self._sequence(plan) for plan in plans))
        except asyncio.CancelledError:
            stats.cancelled += 1
            stats.changed()
            raise
        stats.prompt_tokens += prompt_tokens
        stats.generation_tokens += sum(plan.n for plan in plans)
        self._finish(plans[0].cut)

    async def _sequence(self, plan: _Plan) -> None:
        """One sequence: a batch slot, held through prefill and decode (sending nothing)."""
        target = plan.target
        pool, metrics = target.pool, target.pool.metrics
        try:
            await pool.acquire()
        except asyncio.CancelledError:
            metrics.done(plan.arrived, "abort")
            raise
        held = plan.prompt_tokens  # in the simulated KV cache
        pool.kv_tokens += held
        reason = "abort"
        try:
            if plan.ttft_s:
                await asyncio.sleep(plan.ttft_s)
            metrics.first_token(plan.arrived, plan.prompt_tokens)
            pool.kv_tokens += 1
            held += 1
            metrics.generation_tokens += 1
            steps, step_s = plan.n - 1, target.step_s
            slowdown = target.profile.batch_slowdown
            if steps > 0 and step_s and slowdown:
                loop = asyncio.get_running_loop()
                due = loop.time()
                for _ in range(steps):  # the batch may fill or drain between any two steps
                    step = pool.step_s(step_s, slowdown)
                    due += step
                    if (delay := due - loop.time()) > 0:
                        await asyncio.sleep(delay)
                    metrics.itl.observe(step)
                    pool.kv_tokens += 1
                    held += 1
                    metrics.generation_tokens += 1
            elif steps > 0:  # constant step time: one sleep
                if step_s:
                    await asyncio.sleep(steps * step_s)
                metrics.itl.observe(step_s, steps)
                pool.kv_tokens += steps
                held += steps
                metrics.generation_tokens += steps
            reason = plan.finish_reason
        finally:
            pool.release()
            pool.kv_tokens -= held
            metrics.done(plan.arrived, reason)

    async def _token_stream(
        self,
        plan: _Plan,
        *,
        first: bytes | None,
        token_head: bytes,
        token_tails: tuple[bytes, ...],
        finish: bytes,
        usage_head: bytes | None,
    ) -> AsyncGenerator[bytes, None]:
        stats, target = self.stats, plan.target
        pool = target.pool
        metrics = pool.metrics
        stats.open_streams += 1
        stats.changed()
        queued = acquired = done = cut = False
        sent = held = 0  # tokens sent; tokens held in the simulated KV cache
        step_s = target.step_s
        slowdown = target.profile.batch_slowdown if step_s else 0.0
        try:
            if plan.stall_s:
                await asyncio.sleep(plan.stall_s)
            queued = True
            await pool.acquire()
            acquired = True
            held = plan.prompt_tokens
            pool.kv_tokens += held
            if plan.ttft_s:
                await asyncio.sleep(plan.ttft_s)
            metrics.first_token(plan.arrived, plan.prompt_tokens)
            if first is not None:
                yield first
            n, offset, words = plan.n, plan.offset, len(token_tails)
            limit = min(n, max(1, n // 2)) if plan.cut else n
            if step_s:
                loop = asyncio.get_running_loop()
                due = loop.time()
            for i in range(limit):
                if step_s and i:
                    # A virtual clock: a slow reader gets a burst, not a slower model.
                    step = pool.step_s(step_s, slowdown)
                    due += step
                    if slowdown:
                        metrics.itl.observe(step)
                    if (delay := due - loop.time()) > 0:
                        await asyncio.sleep(delay)
                sent = i + 1
                pool.kv_tokens += 1
                held += 1
                metrics.generation_tokens += 1
                yield token_head + token_tails[(offset + i) % words]
            if plan.cut:
                cut = True
                raise SimConnectionReset("simulated connection drop mid-stream")
            yield finish
            if usage_head is not None:
                yield usage_head + orjson.dumps(_usage(plan.prompt_tokens, n)) + b"}\n\n"
            done = True
            yield _DONE
        finally:
            if acquired:
                pool.release()
                pool.kv_tokens -= held
            if not slowdown and sent > 1:  # constant step time: every interval was one step
                metrics.itl.observe(step_s, sent - 1)
            if queued:
                metrics.done(plan.arrived, plan.finish_reason if done else "abort")
            stats.open_streams -= 1
            stats.generation_tokens += sent
            if done:
                stats.prompt_tokens += plan.prompt_tokens
                stats.completed += 1
            elif cut:
                stats.faults += 1
            else:
                stats.cancelled += 1
            stats.changed()

    async def _error_stream(self, error: bytes) -> AsyncGenerator[bytes, None]:
        """A 200 stream whose first event is an error object (counted as a fault already)."""
        self.stats.open_streams += 1
        self.stats.changed()
        try:
            yield b"data: " + error + b"\n\n"
            yield _DONE
        finally:
            self.stats.open_streams -= 1
            self.stats.changed()


def _label_value(value: str) -> str:
    """A Prometheus label value, escaped (backslash, double quote, newline)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _tails(choice_tail: bytes) -> dict[bool, tuple[bytes, ...]]:
    """Per word, the bytes after the chunk head, with and without `"usage":null`."""
    return {
        usage: tuple(
            orjson.dumps(token) + choice_tail + (b',"usage":null}\n\n' if usage else b"}\n\n")
            for token in _TOKENS
        )
        for usage in (False, True)
    }


_CHAT_TAILS: Final = _tails(b"}" + _CHOICE_TAIL)  # closes the delta object first
_TEXT_TAILS: Final = _tails(_CHOICE_TAIL)

"""Per-key requests-per-minute and tokens-per-minute limits, shared by replicas through Redis.

Each limit is a token bucket that holds a minute's allowance and refills continuously, so a key
can burst up to its limit and then goes at the limit's rate. With Redis, both of a key's buckets
are checked and charged by one Lua script: one round trip, atomic across replicas, timed by
Redis's own clock. A request is charged its estimated tokens when admitted; `settle` corrects
the charge with the tokens the upstream reported, in the background.

When Redis fails or is slower than `timeout_ms`, a breaker stops asking it for a while (1 s,
doubling to 30 s) and the policy decides: `open` enforces the same limits in this process alone,
`closed` refuses the request with 503. No request waits longer than the timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from redis.exceptions import RedisError

from gateway.auth import Principal
from gateway.config import RateLimitSpec, Settings
from gateway.errors import KeyRateLimitedError, OverloadedError
from gateway.latency import RedisClient, connect_redis
from gateway.models import Wire

log = logging.getLogger("tailguard")

_WINDOW_MS = 60_000

# KEYS: the requests bucket, the tokens bucket. ARGV: rpm, tpm (0: no limit), the request and
# token costs, and 1 to check before charging (0: charge unconditionally, to settle a charge).
# Returns: allowed, then per bucket: remaining, ms until full, ms until the cost would have fit.
_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local limit = {tonumber(ARGV[1]), tonumber(ARGV[2])}
local cost = {tonumber(ARGV[3]), tonumber(ARGV[4])}
local level, wait = {}, {}
local allowed = 1
for i = 1, 2 do
  if limit[i] > 0 then
    local v = redis.call('HMGET', KEYS[i], 'l', 't')
    local l, at = tonumber(v[1]), tonumber(v[2])
    if l == nil or at == nil then l, at = limit[i], now end
    l = math.min(limit[i], l + math.max(0, now - at) * limit[i] / 60000)
    level[i] = l
    wait[i] = 0
    if l < cost[i] then
      wait[i] = math.ceil((cost[i] - l) * 60000 / limit[i])
      if ARGV[5] == '1' then allowed = 0 end
    end
  end
end
local out = {allowed}
for i = 1, 2 do
  if limit[i] > 0 then
    local l = level[i]
    if allowed == 1 then l = math.max(-limit[i], math.min(limit[i], l - cost[i])) end
    redis.call('HSET', KEYS[i], 'l', tostring(l), 't', now)
    redis.call('PEXPIRE', KEYS[i], 120000)
    out[#out + 1] = math.floor(l)
    out[#out + 1] = math.ceil((limit[i] - l) * 60000 / limit[i])
    out[#out + 1] = wait[i]
  else
    out[#out + 1] = 0
    out[#out + 1] = 0
    out[#out + 1] = 0
  end
end
return out
"""


@dataclass(frozen=True, slots=True)
class Bucket:
    """One limit's state after a decision, as the `x-ratelimit-*` headers report it."""

    limit: int
    remaining: int
    reset_s: float  # until the bucket is full again
    wait_s: float  # until the request's cost would have fit (0: it did)


@dataclass(frozen=True, slots=True)
class Verdict:
    allowed: bool
    requests: Bucket | None
    tokens: Bucket | None
    source: str  # redis | local

    def headers(self, wire: Wire = "openai") -> list[tuple[bytes, bytes]]:
        """The rate-limit headers of every response to a limited key, as the client's API
        spells them: OpenAI's `x-ratelimit-*` (reset as a duration), or Anthropic's
        `anthropic-ratelimit-*` (reset as an RFC 3339 time)."""
        out: list[tuple[bytes, bytes]] = []
        now = time.time()
        for kind, bucket in (("requests", self.requests), ("tokens", self.tokens)):
            if bucket is None:
                continue
            remaining = str(max(0, bucket.remaining)).encode()
            if wire == "anthropic":
                prefix = b"anthropic-ratelimit-" + kind.encode()
                reset = datetime.fromtimestamp(math.ceil(now + bucket.reset_s), UTC)
                out += [
                    (prefix + b"-limit", str(bucket.limit).encode()),
                    (prefix + b"-remaining", remaining),
                    (prefix + b"-reset", reset.strftime("%Y-%m-%dT%H:%M:%SZ").encode()),
                ]
            else:
                out += [
                    (b"x-ratelimit-limit-" + kind.encode(), str(bucket.limit).encode()),
                    (b"x-ratelimit-remaining-" + kind.encode(), remaining),
                    (b"x-ratelimit-reset-" + kind.encode(), duration(bucket.reset_s).encode()),
                ]
        return out

    def refusal(self, principal: Principal, wire: Wire = "openai") -> KeyRateLimitedError:
        """The 429 for a refused request: which limit, and when to try again."""
        kind, bucket = "requests", self.requests
        if (
            self.tokens is not None
            and self.tokens.wait_s > 0
            and (bucket is None or bucket.wait_s == 0)
        ):
            kind, bucket = "tokens", self.tokens
        assert bucket is not None
        unit = "RPM" if kind == "requests" else "TPM"
        wait = max(bucket.wait_s, 0.001)
        headers = {k.decode(): v.decode() for k, v in self.headers(wire)}
        headers["retry-after"] = str(max(1, math.ceil(wait)))
        headers["retry-after-ms"] = str(max(1, math.ceil(wait * 1000)))
        return KeyRateLimitedError(
            f"Rate limit reached for key '{principal.name}' on {kind} per min ({unit}): "
            f"Limit {bucket.limit}. Please try again in {duration(wait)}.",
            kind=kind,
            headers=headers,
        )


def duration(seconds: float) -> str:
    """A duration as OpenAI's reset headers spell it: `120ms`, `1.5s`, `6m0s`."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    tenths = math.ceil(seconds * 10) / 10
    if tenths < 60:
        return f"{tenths:g}s"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s"


class LocalBuckets:
    """The same buckets in this process's memory: the store when there is no Redis, and the
    `open` policy's fallback while Redis is unreachable."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._levels: dict[tuple[str, int], tuple[float, float]] = {}

    def take(self, name: str, limits: tuple[int, int], costs: tuple[int, int], check: bool) -> Any:
        now = self._clock()
        levels: list[float] = []
        waits: list[float] = []
        allowed = True
        for i, (limit, cost) in enumerate(zip(limits, costs, strict=True)):
            if limit <= 0:
                levels.append(0.0)
                waits.append(0.0)
                continue
            level, at = self._levels.get((name, i), (float(limit), now))
            level = min(float(limit), level + max(0.0, now - at) * limit / 60)
            wait = (cost - level) * 60 / limit if level < cost else 0.0
            if wait > 0 and check:
                allowed = False
            levels.append(level)
            waits.append(wait)
        out: list[Any] = [1 if allowed else 0]
        for i, (limit, cost) in enumerate(zip(limits, costs, strict=True)):
            if limit <= 0:
                out += [0, 0, 0]
                continue
            level = levels[i]
            if allowed:
                level = max(-limit, min(limit, level - cost))
            self._levels[(name, i)] = (level, now)
            out += [math.floor(level), (limit - level) * _WINDOW_MS / limit, waits[i] * 1000]
        return out


class RateLimiter:
    """Decides whether a key may send one more request now. One per process."""

    def __init__(
        self,
        spec: RateLimitSpec,
        redis: RedisClient | None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._redis = redis
        self._timeout_s = spec.timeout_ms / 1000
        self._fail_open = spec.on_store_error == "open"
        self._clock = clock
        self._local = LocalBuckets(clock)
        self._script = redis.register_script(_SCRIPT) if redis is not None else None
        self._retry_at = 0.0  # while Redis is in its breaker's cooldown
        self._backoff_s = 0.0
        self._settling: set[asyncio.Task[None]] = set()
        self.store_errors = 0
        self.refused: dict[tuple[str, str], int] = {}  # by (key name, requests | tokens)

    @property
    def store(self) -> str:
        return "redis" if self._redis is not None else "memory"

    def health(self) -> dict[str, Any]:
        degraded = self._redis is not None and self._clock() < self._retry_at
        return {
            "store": self.store,
            "degraded": degraded,
            "on_store_error": "open" if self._fail_open else "closed",
            "store_errors": self.store_errors,
        }

    async def take(self, principal: Principal, tokens: int, wire: Wire = "openai") -> Verdict:
        """Charge one request and `tokens` to the key, or refuse. Raises KeyRateLimitedError,
        or OverloadedError when the store is down and the policy is `closed`."""
        limits = (principal.rpm or 0, principal.tpm or 0)
        if principal.tpm is not None and tokens > principal.tpm:
            self._count(principal.name, "tokens")
            raise KeyRateLimitedError(
                f"Request too large for key '{principal.name}': it needs about {tokens} tokens "
                f"and the limit is {principal.tpm} tokens per min (TPM). Send a shorter prompt "
                "or a lower max_tokens.",
                kind="tokens",
                headers={"x-should-retry": "false"},
            )
        out, source = await self._call(principal.name, limits, (1, tokens), check=True)
        verdict = _verdict(out, limits, source)
        if not verdict.allowed:
            refusal = verdict.refusal(principal, wire)
            self._count(principal.name, refusal.type)
            raise refusal
        return verdict

    def _count(self, name: str, kind: str) -> None:
        self.refused[(name, kind)] = self.refused.get((name, kind), 0) + 1

    def settle(self, principal: Principal, delta: int) -> None:
        """Correct a request's token charge once its real usage is known (not awaited)."""
        if principal.tpm is None or delta == 0:
            return
        limits = (0, principal.tpm)
        if self._redis is None:
            self._local.take(principal.name, limits, (0, delta), check=False)
            return
        task = asyncio.create_task(self._settle(principal.name, limits, delta))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _settle(self, name: str, limits: tuple[int, int], delta: int) -> None:
        # The store down under `closed`: the correction is lost, never a request.
        with contextlib.suppress(OverloadedError):
            await self._call(name, limits, (0, delta), check=False)

    async def _call(
        self, name: str, limits: tuple[int, int], costs: tuple[int, int], *, check: bool
    ) -> tuple[list[Any], str]:
        if self._script is None or self._clock() < self._retry_at:
            return self._fallback(name, limits, costs, check)
        keys = [f"tg:rl:{{{name}}}:requests", f"tg:rl:{{{name}}}:tokens"]
        args = [limits[0], limits[1], costs[0], costs[1], 1 if check else 0]
        try:
            async with asyncio.timeout(self._timeout_s):
                out = await self._script(keys=keys, args=args)
        except (RedisError, OSError, TimeoutError) as exc:
            self._trip(exc)
            return self._fallback(name, limits, costs, check)
        self._backoff_s = 0.0
        return [int(v) for v in out], "redis"

    def _fallback(
        self, name: str, limits: tuple[int, int], costs: tuple[int, int], check: bool
    ) -> tuple[list[Any], str]:
        if self._redis is not None and not self._fail_open:
            raise OverloadedError(
                "Rate limits cannot be checked right now; the request was not sent.",
                retry_after_s=max(1.0, self._retry_at - self._clock()),
            )
        return self._local.take(name, limits, costs, check), "local"

    def _trip(self, exc: BaseException) -> None:
        self.store_errors += 1
        self._backoff_s = min(30.0, max(1.0, self._backoff_s * 2))
        # Jitter, so replicas that failed together do not all come back in the same instant.
        self._retry_at = self._clock() + self._backoff_s * random.uniform(0.8, 1.0)
        log.warning(
            "rate-limit store unreachable (%s); %s for %.0f s",
            type(exc).__name__,
            "enforcing limits per replica" if self._fail_open else "refusing limited keys",
            self._backoff_s,
        )

    async def aclose(self) -> None:
        for task in list(self._settling):
            task.cancel()
        await asyncio.gather(*self._settling, return_exceptions=True)
        if self._redis is not None:
            await self._redis.aclose()


def _verdict(out: list[Any], limits: tuple[int, int], source: str) -> Verdict:
    buckets: list[Bucket | None] = []
    for i, limit in enumerate(limits):
        if limit <= 0:
            buckets.append(None)
            continue
        remaining, full_ms, wait_ms = out[1 + 3 * i : 4 + 3 * i]
        buckets.append(Bucket(limit, int(remaining), full_ms / 1000, wait_ms / 1000))
    return Verdict(bool(out[0]), buckets[0], buckets[1], source)


def open_rate_limiter(settings: Settings) -> RateLimiter:
    """The process's limiter, on Redis when the config says so (see `RateLimitSpec.store`)."""
    auth = settings.auth
    spec = auth.rate_limits if auth is not None else RateLimitSpec()
    limited = auth is not None and any(k.rpm or k.tpm for k in auth.keys)
    url = spec.redis_url or settings.latency.redis_url
    use_redis = spec.store == "redis" or (
        spec.store == "auto" and (spec.redis_url is not None or settings.latency.store == "redis")
    )
    redis = None
    if limited and use_redis and url is not None:
        redis = connect_redis(
            url.get_secret_value(),
            timeout_s=spec.timeout_ms / 1000,
            max_connections=32,
            wait_for_connection=True,
        )
    return RateLimiter(spec, redis)


def estimate_tokens(raw_body: bytes, max_tokens: int | None, n: int) -> tuple[int, int]:
    """The prompt tokens, and all the tokens, a request is charged when admitted, before its
    usage is known: about four bytes of JSON per prompt token (over-counting the JSON around the
    prompt), plus every output token it may ask for."""
    prompt = max(1, len(raw_body) // 4)
    return prompt, prompt + (max_tokens or 0) * max(1, n)


class Admission:
    """LLM requests in flight in this process, overall and per key; beyond a cap, a 503."""

    def __init__(self, max_concurrent: int | None) -> None:
        self.max_concurrent = max_concurrent
        self.active = 0
        self.by_key: dict[str, int] = {}
        self.refused: dict[str, int] = {"gateway": 0, "key": 0}  # by which cap

    def enter(self, principal: Principal | None) -> None:
        if self.max_concurrent is not None and self.active >= self.max_concurrent:
            self.refused["gateway"] += 1
            raise _busy(
                f"The gateway is serving its limit of {self.max_concurrent} concurrent requests.",
                "overloaded",
            )
        if principal is not None and principal.max_concurrent is not None:
            held = self.by_key.get(principal.name, 0)
            if held >= principal.max_concurrent:
                self.refused["key"] += 1
                raise _busy(
                    f"The key '{principal.name}' has its limit of {principal.max_concurrent} "
                    "concurrent requests in flight.",
                    "too_many_concurrent_requests",
                )
            self.by_key[principal.name] = held + 1
        self.active += 1

    def leave(self, principal: Principal | None) -> None:
        self.active -= 1
        if principal is not None and principal.max_concurrent is not None:
            held = self.by_key[principal.name] - 1
            if held:
                self.by_key[principal.name] = held
            else:
                del self.by_key[principal.name]


def _busy(message: str, code: str) -> OverloadedError:
    error = OverloadedError(message, retry_after_s=1.0)
    error.code = code
    return error

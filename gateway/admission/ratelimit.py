"""Per-key requests-per-minute and tokens-per-minute limits, shared by replicas through Redis.

Each limit is a token bucket that holds a minute's allowance and refills continuously, so a key
can burst up to its limit and then goes at the limit's rate. With Redis, both of a key's buckets
are checked and charged by one Lua script: one round trip, atomic across replicas, timed by
Redis's own clock; the checks of one key made in the same turn of the event loop go in one call,
applied in order. A request is charged its estimated tokens when admitted (what it may write:
its max_tokens, else what its model is expected to write); `settle` corrects the charge with the
tokens the upstream reported, in the background: corrections are summed per key and sent every
100 ms, so a busy key costs one round trip per request, not two. Usage beyond the charge is
owed: the bucket goes below zero and the key is refused until it has refilled, however long
that takes.

When Redis fails or is slower than `timeout_ms`, a breaker (`gateway.redis.Breaker`) stops
asking it for a while and the policy decides: `open` enforces the same limits in this process
alone, `closed` refuses the request with 503. The breaker opens once per outage (the checks that
fail together are one failure), for 1 s, doubling with each failed probe to 30 s; after the
cooldown one check probes Redis while the others are decided without it, and a probe that
succeeds closes the breaker. The timeout counts Redis's time, not this process's: see
`gateway.redis.Deadline`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from redis.exceptions import RedisError

from gateway.admission.auth import Principal
from gateway.config import RateLimitSpec, Settings
from gateway.errors import KeyRateLimitedError, OverloadedError
from gateway.latency import LatencyStore
from gateway.models import Call, Wire
from gateway.redis import Breaker, Deadline, RedisClient, connect_redis, max_wait_s

_WINDOW_MS = 60_000

# KEYS: the requests bucket, the tokens bucket. ARGV: five per check, in order: rpm, tpm (0: no
# limit), the request and token costs, and 1 to check before charging (0: charge
# unconditionally, to settle a charge). The checks are applied one after the other, as separate
# calls would be. Returns, per check: allowed, then per bucket: remaining, ms until full, ms
# until the cost would have fit.
_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
for base = 0, #ARGV - 5, 5 do
  local limit = {tonumber(ARGV[base + 1]), tonumber(ARGV[base + 2])}
  local cost = {tonumber(ARGV[base + 3]), tonumber(ARGV[base + 4])}
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
        if ARGV[base + 5] == '1' then allowed = 0 end
      end
    end
  end
  out[#out + 1] = allowed
  for i = 1, 2 do
    if limit[i] > 0 then
      local l = level[i]
      if allowed == 1 then l = math.min(limit[i], l - cost[i]) end
      local full = math.ceil((limit[i] - l) * 60000 / limit[i])
      redis.call('HSET', KEYS[i], 'l', tostring(l), 't', now)
      -- A missing bucket is a full one: keep this one until it is, so that no debt is forgiven.
      redis.call('PEXPIRE', KEYS[i], full + 1000)
      out[#out + 1] = math.floor(l)
      out[#out + 1] = full
      out[#out + 1] = wait[i]
    else
      out[#out + 1] = 0
      out[#out + 1] = 0
      out[#out + 1] = 0
    end
  end
end
return out
"""
_OUT = 7  # values the script returns per check
_Check = tuple[tuple[int, int], tuple[int, int], bool]  # limits, costs, check before charging
# A check waiting for its batch: limits, costs, and where its answer goes.
_Waiting = tuple[tuple[int, int], tuple[int, int], "asyncio.Future[tuple[list[Any], str]]"]


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
                level = min(float(limit), level - cost)  # below zero: owed, never forgiven
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
        self._default_output = spec.default_output_tokens
        self._local = LocalBuckets(clock)
        self._script = redis.register_script(_SCRIPT) if redis is not None else None
        self._breaker = Breaker(
            "rate-limit store",
            fallback="enforcing limits per replica" if self._fail_open else "refusing limited keys",
            backoff_min_s=1.0,
            backoff_max_s=30.0,
            # Never longer than the back-off: a refusal's retry-after promises it.
            jitter=(0.8, 1.0),
            clock=clock,
        )
        self._settling: set[asyncio.Task[None]] = set()
        self._owed: dict[tuple[str, int], int] = {}  # (key name, tpm) -> tokens not yet settled
        self._settle_timer: asyncio.TimerHandle | None = None
        # Checks made in this turn of the event loop, per key, sent together on the next.
        self._batches: dict[str, list[_Waiting]] = {}
        self.store_errors = 0  # checks the store failed to answer
        self.loop_lag_waits = 0  # checks given more time because this process's loop was late
        self.refused: dict[tuple[str, str], int] = {}  # by (key name, requests | tokens)

    @property
    def store(self) -> str:
        return "redis" if self._redis is not None else "memory"

    @property
    def outages(self) -> int:
        """Times the breaker opened: one per failure episode."""
        return self._breaker.outages

    @property
    def degraded(self) -> bool:
        """Whether limits are decided without Redis (per replica, or refused): from the
        breaker's opening until a probe finds Redis answering again."""
        return self._redis is not None and self._breaker.degraded

    def health(self) -> dict[str, Any]:
        """The rate-limit part of `/readyz`."""
        retry_in = None
        if self.degraded:
            retry_in = round(self._breaker.wait_s(), 3)
        return {
            "store": self.store,
            "degraded": self.degraded,
            "on_store_error": "open" if self._fail_open else "closed",
            "store_errors": self.store_errors,
            "outages": self.outages,
            "retry_in_s": retry_in,  # until the next probe of Redis (0: the next check probes)
            "loop_lag_waits": self.loop_lag_waits,
        }

    def estimate(
        self, principal: Principal, call: Call, latency: LatencyStore, *, known_prompt: int = 0
    ) -> tuple[int, int]:
        """What `call` is charged when admitted: see `estimate_charge`."""
        return estimate_charge(principal, call, latency, self._default_output, known_prompt)

    async def take(
        self,
        principal: Principal,
        tokens: int,
        wire: Wire = "openai",
        *,
        requests: bool = True,
        tpm: bool = True,
    ) -> Verdict:
        """Charge one request and `tokens` to the key, or refuse. Raises KeyRateLimitedError,
        or OverloadedError when the store is down and the policy is `closed`. With `tpm`
        false the request is held to the key's rpm alone (it generates nothing: token
        counting), and its tokens bucket is neither checked nor charged; with `requests`
        false, to its tpm alone (the request was charged already)."""
        limits = ((principal.rpm or 0) if requests else 0, (principal.tpm or 0) if tpm else 0)
        if limits == (0, 0):
            return Verdict(True, None, None, "local")
        if limits[1] and principal.tpm is not None and tokens > principal.tpm:
            raise self._counted(
                principal.name,
                KeyRateLimitedError(
                    f"Request too large for key '{principal.name}': it needs about {tokens} tokens "
                    f"and the limit is {principal.tpm} tokens per min (TPM). Send a shorter prompt "
                    "or a lower max_tokens.",
                    kind="tokens",
                    headers={"x-should-retry": "false"},
                ),
            )
        out, source = await self._check(principal.name, limits, (1, tokens))
        verdict = _verdict(out, limits, source)
        if not verdict.allowed:
            # Raised unnamed: a local naming it would be held by its own traceback (a cycle).
            raise self._counted(principal.name, verdict.refusal(principal, wire))
        return verdict

    def _counted(self, name: str, refusal: KeyRateLimitedError) -> KeyRateLimitedError:
        self.refused[(name, refusal.type)] = self.refused.get((name, refusal.type), 0) + 1
        return refusal

    def settle(self, principal: Principal, delta: int) -> None:
        """Correct a request's token charge once its real usage is known (not awaited)."""
        if principal.tpm is None or delta == 0:
            return
        limits = (0, principal.tpm)
        if self._redis is None:
            self._local.take(principal.name, limits, (0, delta), check=False)
            return
        place = (principal.name, principal.tpm)
        self._owed[place] = self._owed.get(place, 0) + delta
        if self._settle_timer is None:
            loop = asyncio.get_running_loop()
            self._settle_timer = loop.call_later(SETTLE_EVERY_S, self._settle_owed)

    def _settle_owed(self) -> None:
        owed, self._owed, self._settle_timer = self._owed, {}, None
        for (name, tpm), delta in owed.items():
            if delta:
                task = asyncio.create_task(self._settle(name, (0, tpm), delta))
                self._settling.add(task)
                task.add_done_callback(self._settling.discard)

    async def _settle(self, name: str, limits: tuple[int, int], delta: int) -> None:
        # The store down under `closed`: the correction is lost, never a request.
        with contextlib.suppress(OverloadedError):
            await self._call(name, [(limits, (0, delta), False)])

    async def _check(
        self, name: str, limits: tuple[int, int], costs: tuple[int, int]
    ) -> tuple[list[Any], str]:
        """One check, sent with the other checks of the same key made in this turn of the event
        loop: one script call, one round trip, for all of them."""
        if self._script is None:
            return self._fallback(name, [(limits, costs, True)])[0][0], "local"
        loop = asyncio.get_running_loop()
        waiting = self._batches.get(name)
        if waiting is None:
            waiting = self._batches[name] = []
            loop.call_soon(self._send_batch, name)
        answer: asyncio.Future[tuple[list[Any], str]] = loop.create_future()
        waiting.append((limits, costs, answer))
        return await answer

    def _send_batch(self, name: str) -> None:
        batch = self._batches.pop(name, [])
        task = asyncio.create_task(self._answer_batch(name, batch))
        self._settling.add(task)  # held until done, like a settle
        task.add_done_callback(self._settling.discard)

    async def _answer_batch(self, name: str, batch: list[_Waiting]) -> None:
        if self._breaker.degraded and len(batch) > 1:
            # The breaker is open or half-open: at most one check probes Redis; the others are
            # decided now, not after the probe's timeout.
            _answer_now(batch[1:], lambda checks: self._fallback(name, checks))
            batch = batch[:1]
        try:
            outs, source = await self._call(name, [(lim, cost, True) for lim, cost, _ in batch])
        except asyncio.CancelledError:
            for _, _, answer in batch:
                answer.cancel()
            raise
        except Exception as exc:  # every waiting check gets the error (the policy's 503)
            for _, _, answer in batch:
                if not answer.done():
                    answer.set_exception(exc)
            return
        for (_, _, answer), out in zip(batch, outs, strict=True):
            if not answer.done():  # a request that left meanwhile was charged all the same
                answer.set_result((out, source))

    async def _call(self, name: str, checks: list[_Check]) -> tuple[list[list[Any]], str]:
        """Apply `checks` (limits, costs, check first) to one key in order, in one round trip."""
        if self._script is None:
            return self._fallback(name, checks)
        ticket = self._breaker.ask()
        if ticket is None:
            return self._fallback(name, checks)
        keys = [f"tg:rl:{{{name}}}:requests", f"tg:rl:{{{name}}}:tokens"]
        args = [
            value
            for limits, costs, check in checks
            for value in (limits[0], limits[1], costs[0], costs[1], 1 if check else 0)
        ]
        try:
            out = await self._run(keys, args)
        except (RedisError, OSError, TimeoutError) as exc:
            self.store_errors += len(checks)
            self._breaker.failed(ticket, exc)  # opens it, once per outage
            return self._fallback(name, checks)
        except BaseException:
            self._breaker.abandoned(ticket)
            raise
        self._breaker.succeeded(ticket)
        values = [int(v) for v in out]
        return [values[i : i + _OUT] for i in range(0, len(values), _OUT)], "redis"

    async def _run(self, keys: list[str], args: list[int]) -> Any:
        """The script's round trip, given `timeout_ms` of Redis's time (see `Deadline`)."""
        script = self._script
        assert script is not None
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(None) as scope:
            deadline = Deadline(loop, scope, self._timeout_s)
            try:
                return await script(keys=keys, args=args)
            finally:
                deadline.cancel()
                self.loop_lag_waits += deadline.extended

    def _fallback(self, name: str, checks: list[_Check]) -> tuple[list[list[Any]], str]:
        if self._redis is not None and not self._fail_open:
            raise OverloadedError(
                "Rate limits cannot be checked right now; the request was not sent.",
                retry_after_s=max(1.0, self._breaker.wait_s()),
            )
        return [self._local.take(name, lim, cost, check) for lim, cost, check in checks], "local"

    async def aclose(self) -> None:
        if self._settle_timer is not None:  # send what is owed (each call is bounded)
            self._settle_timer.cancel()
            self._settle_owed()
        if self._settling:
            await asyncio.wait(set(self._settling), timeout=1.0)
        for task in list(self._settling):
            task.cancel()
        await asyncio.gather(*self._settling, return_exceptions=True)
        if self._redis is not None:
            await self._redis.aclose()


SETTLE_EVERY_S = 0.1  # corrections of token charges are summed per key and sent this often


def _answer_now(
    batch: list[_Waiting],
    decide: Callable[[list[_Check]], tuple[list[list[Any]], str]],
) -> None:
    try:
        outs, source = decide([(lim, cost, True) for lim, cost, _ in batch])
    except Exception as exc:
        for _, _, answer in batch:
            answer.set_exception(exc)
        return
    for (_, _, answer), out in zip(batch, outs, strict=True):
        answer.set_result((out, source))


def _verdict(out: list[Any], limits: tuple[int, int], source: str) -> Verdict:
    buckets: list[Bucket | None] = []
    for i, limit in enumerate(limits):
        if limit <= 0:
            buckets.append(None)
            continue
        remaining, full_ms, wait_ms = out[1 + 3 * i : 4 + 3 * i]
        buckets.append(Bucket(limit, int(remaining), full_ms / 1000, wait_ms / 1000))
    return Verdict(bool(out[0]), buckets[0], buckets[1], source)


def open_rate_limiter(
    settings: Settings, *, clock: Callable[[], float] = time.monotonic
) -> RateLimiter:
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
        # The limiter's own deadline decides when a check has waited too long; redis-py's
        # timeouts (asyncio timers too, blind to the loop's lag) only back it up.
        timeout_s = spec.timeout_ms / 1000
        redis = connect_redis(
            url.get_secret_value(),
            timeout_s=max_wait_s(timeout_s) + timeout_s,
            max_connections=32,
            wait_for_connection=True,
        )
    return RateLimiter(spec, redis, clock=clock)


def estimate_charge(
    principal: Principal, call: Call, latency: LatencyStore, default_output: int, known_prompt: int
) -> tuple[int, int]:
    """The prompt tokens, and all the tokens, `call` is charged when admitted (see
    `estimate_tokens`): its body as sent upstream (a stored conversation already expanded),
    or `known_prompt` when larger (what the upstream billed for the conversation so far, plus
    the new input). Without a max_tokens (the key's cap is set on the call already), its model
    is expected to write the mean output length in the latency window, else `default_output`;
    that expectation is capped so that the request alone fits the key's tpm (a guess must not
    refuse a request for good: the excess is owed instead)."""
    size = max(len(call.raw), known_prompt * 4)
    if call.endpoint == "embeddings":
        return estimate_tokens(size, 0, 1, expected_output=0)
    if call.max_tokens is not None:
        return estimate_tokens(size, call.max_tokens, call.n, expected_output=0)
    stats = latency.snapshot.models.get(call.model)
    seen = stats.output_tokens if stats is not None else None
    expected = math.ceil(seen) if seen else default_output
    if principal.tpm is not None:
        prompt = estimate_tokens(size, 0, 1, expected_output=0)[0]
        expected = min(expected, max(1, (principal.tpm - prompt) // max(1, call.n)))
    return estimate_tokens(size, None, call.n, expected_output=expected)


def estimate_tokens(
    body_bytes: int, max_tokens: int | None, n: int, *, expected_output: int
) -> tuple[int, int]:
    """The prompt tokens, and all the tokens, a request is charged when admitted, before its
    usage is known: about four bytes of JSON per prompt token (over-counting the JSON around the
    prompt), plus for every choice the output tokens it may ask for, or without a max_tokens,
    `expected_output` (at least one: a request that may write is never charged nothing)."""
    prompt = max(1, body_bytes // 4)
    output = max(1, expected_output) if max_tokens is None else max_tokens
    return prompt, prompt + output * max(1, n)


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

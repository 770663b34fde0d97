"""What a vLLM server says about its own load, read from its Prometheus `/metrics`.

Scraped by a background task per server (never on the request path), every
`metrics_interval_s`, on a `Scraper`'s HTTP session of its own. A server whose last good scrape
is older than three intervals, or whose metrics cannot be read, is *unknown* (not idle): routing
then relies on the latency statistics alone. Both the current and the older metric names are
read (`kv_cache_usage_perc` / `gpu_cache_usage_perc`, `inter_token_latency_seconds` /
`time_per_output_token_seconds`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from contextlib import AsyncExitStack, suppress
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from gateway import numbers
from gateway.config import ProviderSpec
from gateway.errors import scrub

logger = logging.getLogger(__name__)

STALE_INTERVALS = 3  # a scrape older than this many intervals is not trusted
_MAX_VALUE = 1e12  # larger counts and gauges are clamped (no server holds that many requests)

_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"
_KV = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_TTFT = "vllm:time_to_first_token_seconds"
_TPOT = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
# The families read; every other line of a page is skipped before parsing. A real server's page
# is mostly families nobody here reads, and the parser is pure Python.
_READ = (_RUNNING, _WAITING, *_KV, _TTFT, *_TPOT)


@dataclass(frozen=True, slots=True)
class Histogram:
    """Cumulative bucket counts (upper bound -> count), as Prometheus exposes them."""

    buckets: tuple[tuple[float, float], ...] = ()
    count: float = 0.0
    total: float = 0.0

    def since(self, earlier: Histogram | None) -> Histogram:
        """The observations made after `earlier` (a counter reset keeps the new values)."""
        if earlier is None or self.count < earlier.count:
            return self
        before = dict(earlier.buckets)
        return Histogram(  # clamped: a server's counts may go down without a reset
            tuple((le, max(0.0, n - before.get(le, 0.0))) for le, n in self.buckets),
            self.count - earlier.count,
            max(0.0, self.total - earlier.total),
        )

    def quantile(self, q: float) -> float | None:
        """The upper bound of the bucket holding the q-quantile (nearest rank), or None."""
        if self.count <= 0:
            return None
        rank = max(1.0, q * self.count)
        for le, n in self.buckets:
            if n >= rank:
                return le if le != float("inf") else None
        return None


@dataclass(frozen=True, slots=True)
class ServerLoad:
    """One scrape of one vLLM server (summed over its models when it serves several)."""

    running: float
    waiting: float
    kv_usage: float | None
    ttft: Histogram
    tpot: Histogram
    scraped_at: float  # monotonic


def parse_metrics(text: str, model: str | None = None) -> ServerLoad:
    """Read a vLLM `/metrics` page. `model` restricts to one `model_name` label when given.

    Raises ValueError when the page is not Prometheus text or lacks the queue gauges, or when a
    queue gauge is no finite, non-negative number. Other values that are not (`NaN`, `+Inf`,
    `-1`, a bucket bound that is no number) are left out; values are clamped to 1e12, the cache
    usage to [0, 1].
    """
    running = waiting = 0.0
    seen_queue = False
    kv: dict[str, float] = {}
    ttft: dict[float, float] = {}
    ttft_count = ttft_sum = 0.0
    tpot: dict[str, dict[float, float]] = {}
    tpot_count: dict[str, float] = {}
    tpot_sum: dict[str, float] = {}
    wanted = "\n".join(line for line in text.splitlines() if line.startswith(_READ))
    for family in text_string_to_metric_families(wanted):
        for sample in family.samples:
            labels = sample.labels
            if model is not None and labels.get("model_name", model) != model:
                continue
            name = sample.name
            # A value or bound that is NaN, infinite, negative or no number is left out, as if
            # the server had not reported it: it would poison the predictions made from it.
            value = numbers.gauge(float(sample.value), ceiling=_MAX_VALUE)
            if value is None:
                if name in (_RUNNING, _WAITING):  # the queue itself is unknown, not empty
                    raise ValueError(f"{name} is {sample.value}")
                continue
            if name in _KV:
                value = min(value, 1.0)  # a fraction of the cache
            le = 0.0
            if name.endswith("_bucket"):
                upper = numbers.bound(labels.get("le"))
                if upper is None:
                    continue
                le = upper
            if name == _RUNNING:
                running += value
                seen_queue = True
            elif name == _WAITING:
                waiting += value
                seen_queue = True
            elif name in _KV:
                kv[name] = max(kv.get(name, 0.0), value)
            elif name == _TTFT + "_bucket":
                ttft[le] = ttft.get(le, 0.0) + value
            elif name == _TTFT + "_count":
                ttft_count += value
            elif name == _TTFT + "_sum":
                ttft_sum += value
            else:
                for base in _TPOT:
                    if name == base + "_bucket":
                        tpot.setdefault(base, {})[le] = tpot.get(base, {}).get(le, 0.0) + value
                    elif name == base + "_count":
                        tpot_count[base] = tpot_count.get(base, 0.0) + value
                    elif name == base + "_sum":
                        tpot_sum[base] = tpot_sum.get(base, 0.0) + value
    if not seen_queue:
        raise ValueError("no vllm:num_requests_running / num_requests_waiting on the page")
    kv_usage = next((kv[name] for name in _KV if name in kv), None)
    tpot_name = next((base for base in _TPOT if base in tpot), _TPOT[0])
    return ServerLoad(
        running=running,
        waiting=waiting,
        kv_usage=kv_usage,
        ttft=Histogram(tuple(sorted(ttft.items())), ttft_count, ttft_sum),
        tpot=Histogram(
            tuple(sorted(tpot.get(tpot_name, {}).items())),
            tpot_count.get(tpot_name, 0.0),
            tpot_sum.get(tpot_name, 0.0),
        ),
        scraped_at=time.monotonic(),
    )


def metrics_url(base_url: str) -> str:
    """vLLM serves `/metrics` at the root, beside `/v1`."""
    parts = urlsplit(base_url)
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[:-3]
    return urlunsplit((parts.scheme, parts.netloc, path + "/metrics", "", ""))


@dataclass(slots=True)
class ServerState:
    """The latest known load of one server, and how fresh it is."""

    url: str
    interval_s: float
    load: ServerLoad | None = None
    previous: ServerLoad | None = None  # the scrape before, for recent histogram deltas
    failures: int = 0
    last_error: str | None = None
    scrapes: int = 0
    # The server's batch slots, learned: the most requests it ran while others still waited (a
    # server queues only once it is full). None until it has been seen full.
    slots: float | None = None
    clock: Callable[[], float] = field(default=time.monotonic)
    # recent_ttft_p50's answer and the scrape it belongs to: computed once per scrape, not per
    # request (a histogram difference and a quantile cost ~15 us).
    _median: float | None = field(default=None, repr=False)
    _median_of: ServerLoad | None = field(default=None, repr=False)

    def current(self) -> ServerLoad | None:
        """The load, or None when unknown (never scraped, failing, or stale)."""
        load = self.load
        if load is None or self.failures:
            return None
        if self.clock() - load.scraped_at > STALE_INTERVALS * self.interval_s:
            return None
        return load

    def recent_ttft(self) -> Histogram | None:
        """TTFTs vLLM observed between the last two scrapes (None when unknown)."""
        load = self.current()
        if load is None:
            return None
        return load.ttft.since(self.previous.ttft if self.previous is not None else None)

    def recent_ttft_p50(self) -> float | None:
        """The median of `recent_ttft` (seconds), once per scrape."""
        load = self.current()
        if load is None:
            return None
        if self._median_of is not load:
            recent = self.recent_ttft()
            self._median = recent.quantile(0.5) if recent is not None else None
            self._median_of = load
        return self._median


async def scrape_forever(
    state: ServerState, session: aiohttp.ClientSession, secrets: tuple[str, ...] = ()
) -> None:
    """Refresh `state` every interval until cancelled; errors mark the server unknown."""
    timeout = aiohttp.ClientTimeout(total=max(0.5, state.interval_s))
    while True:
        try:
            async with session.get(state.url, timeout=timeout) as response:
                if response.status != 200:
                    raise ValueError(f"HTTP {response.status}")
                text = await response.text()
            # A page runs to tens of kilobytes: parsed off the event loop.
            load = await asyncio.to_thread(parse_metrics, text)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            state.failures += 1
            state.last_error = scrub(f"{type(exc).__name__}: {exc}", secrets)[:200]
            if state.failures == 1:
                logger.warning("vLLM metrics unavailable at %s: %s", state.url, state.last_error)
        else:
            if state.failures:
                logger.info("vLLM metrics back at %s", state.url)
            state.previous, state.load = state.load, load
            if load.waiting > 0 and load.running > (state.slots or 0.0):
                state.slots = load.running
            state.failures = 0
            state.last_error = None
            state.scrapes += 1
        await asyncio.sleep(state.interval_s)


class Scraper:
    """The readers of vLLM servers' `/metrics`, on one HTTP session of their own.

    It lives as long as the runtime: `async with Scraper()` opens the session and closes it at
    the end. Each config generation starts a reader per vLLM provider with `watch`, stopped when
    that generation's pools close; the session outlives the generations. A scrape sends no
    credentials (vLLM serves `/metrics` without them).
    """

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None  # while entered

    async def __aenter__(self) -> Scraper:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ttl_dns_cache=60),
            trust_env=False,  # a proxy in the path would be read instead of the server
            raise_for_status=False,
            skip_auto_headers=("User-Agent",),
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def watch(
        self, name: str, spec: ProviderSpec, secrets: tuple[str, ...], stack: AsyncExitStack
    ) -> ServerState:
        """Start reading the metrics of provider `name` (type vllm) in the background; the
        reader stops when `stack` closes. `secrets` are scrubbed from the errors it keeps."""
        if self._session is None:
            raise RuntimeError("the scraper is not open")
        assert spec.base_url is not None  # checked by the config
        state = ServerState(spec.metrics_url or metrics_url(spec.base_url), spec.metrics_interval_s)
        task = asyncio.create_task(
            scrape_forever(state, self._session, secrets), name=f"vllm-{name}"
        )
        stack.push_async_callback(_stop, task)
        return state


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with suppress(asyncio.CancelledError):
        await task


def snapshot(states: Mapping[str, ServerState]) -> dict[str, dict[str, object]]:
    """Per provider, what `/admin/latency` and the metrics show."""
    out: dict[str, dict[str, object]] = {}
    for name, state in states.items():
        load = state.current()
        out[name] = {
            "state": "ok" if load is not None else "unknown",
            "running": load.running if load else None,
            "waiting": load.waiting if load else None,
            "kv_cache_usage": load.kv_usage if load else None,
            "last_error": state.last_error,
        }
    return out

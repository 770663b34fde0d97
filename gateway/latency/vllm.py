"""What a vLLM server says about its own load, read from its Prometheus `/metrics`.

Scraped by a background task per server (never on the request path), every
`metrics_interval_s`, on a `Scraper`'s HTTP session of its own. A server whose last good scrape
is older than three intervals, or whose metrics cannot be read, is *unknown* (not idle): routing
then relies on the latency statistics alone. Both the current and the older metric names are
read (`kv_cache_usage_perc` / `gpu_cache_usage_perc`, `inter_token_latency_seconds` /
`time_per_output_token_seconds`, `prefix_cache_*` / `gpu_prefix_cache_*`, and speculative
decoding's V1 counters beside V0's gauges). A series the server does not export is unknown.
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
from gateway.latency.vllm_spec import SpecCounters, SpecRates, ratio, spec_rates
from gateway.scrubbing import Scrubber

__all__ = [
    "Histogram",
    "Scraper",
    "ServerLoad",
    "ServerState",
    "SpecCounters",
    "SpecRates",
    "beside_v1",
    "metrics_url",
    "parse_metrics",
    "snapshot",
    "spec_rates",
]

logger = logging.getLogger(__name__)

STALE_INTERVALS = 3  # a scrape older than this many intervals is not trusted
_MAX_VALUE = 1e12  # larger counts and gauges are clamped (no server holds that many requests)

_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"
_KV = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_TTFT = "vllm:time_to_first_token_seconds"
_TPOT = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
# Prefix-cache counters (tokens; `gpu_` in early V1), and V0's hit-rate gauge (blocks).
_PREFIX_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
_PREFIX_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
_PREFIX_RATE = "vllm:gpu_prefix_cache_hit_rate"
# Speculative decoding: V1's counters (drafts only in V1, per position labelled `position`);
# V0 had the token counters too, an emitted-token counter and two gauges.
_SPEC_DRAFTS = "vllm:spec_decode_num_drafts_total"
_SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
_SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
_SPEC_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
_SPEC_EMITTED = "vllm:spec_decode_num_emitted_tokens_total"
_SPEC_RATE = "vllm:spec_decode_draft_acceptance_rate"
_SPEC_EFFICIENCY = "vllm:spec_decode_efficiency"
_PREEMPTIONS = "vllm:num_preemptions_total"
_COUNTERS = (
    _PREEMPTIONS,
    *_PREFIX_QUERIES,
    *_PREFIX_HITS,
    _SPEC_DRAFTS,
    _SPEC_DRAFT_TOKENS,
    _SPEC_ACCEPTED,
    _SPEC_EMITTED,
)
_RATES = (_PREFIX_RATE, _SPEC_RATE, _SPEC_EFFICIENCY)  # gauges in [0, 1]
_MAX_POSITIONS = 64  # more draft positions than any configuration: a larger label is garbage
# The families read; every other line of a page is skipped before parsing. A real server's page
# is mostly families nobody here reads, and the parser is pure Python.
_READ = (_RUNNING, _WAITING, *_KV, _TTFT, *_TPOT, *_COUNTERS, _SPEC_PER_POS, *_RATES)
_TPOT_EVIDENCE = 16  # inter-token observations a measured mean TPOT is taken from


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
    prefix_queries: float | None = None  # prompt tokens looked up in the prefix cache, cumulative
    prefix_hits: float | None = None  # of which were found there
    prefix_hit_gauge: float | None = None  # V0's hit-rate gauge, when the counters are missing
    spec: SpecCounters | None = None  # None: the server does not speculate (or says nothing)
    preemptions: float | None = None  # sequences the server preempted, cumulative


def parse_metrics(text: str, model: str | None = None) -> ServerLoad:
    """Read a vLLM `/metrics` page. `model` restricts to one `model_name` label when given.

    Raises ValueError when the page is not Prometheus text or lacks the queue gauges, or when a
    queue gauge is no finite, non-negative number. Other values that are not (`NaN`, `+Inf`,
    `-1`, a bucket bound or draft position that is no number) are left out; values are clamped
    to 1e12, the cache usage and the rates to [0, 1].
    """
    running = waiting = 0.0
    seen_queue = False
    kv: dict[str, float] = {}
    ttft: dict[float, float] = {}
    ttft_count = ttft_sum = 0.0
    tpot: dict[str, dict[float, float]] = {}
    tpot_count: dict[str, float] = {}
    tpot_sum: dict[str, float] = {}
    counters: dict[str, float] = {}
    rates: dict[str, list[float]] = {}
    positions: dict[int, float] = {}
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
            if name in _KV or name in _RATES:
                value = min(value, 1.0)  # a fraction
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
            elif name in _COUNTERS:
                counters[name] = counters.get(name, 0.0) + value
            elif name in _RATES:
                rates.setdefault(name, []).append(value)
            elif name == _SPEC_PER_POS:
                position = _position(labels.get("position"))
                if position is not None:
                    positions[position] = positions.get(position, 0.0) + value
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
        # The current name first: a server exporting both counts the same tokens twice.
        prefix_queries=next((counters[n] for n in _PREFIX_QUERIES if n in counters), None),
        prefix_hits=next((counters[n] for n in _PREFIX_HITS if n in counters), None),
        prefix_hit_gauge=_mean(rates.get(_PREFIX_RATE)),
        spec=_spec_counters(counters, rates, positions),
        preemptions=counters.get(_PREEMPTIONS),
    )


def _position(text: str | None) -> int | None:
    """A draft position label (`0`, `1`, ...); None when it is not one."""
    if text is None or not text.isdigit() or len(text) > 2:
        return None
    position = int(text)
    return position if position < _MAX_POSITIONS else None


def _mean(values: list[float] | None) -> float | None:
    """A gauge over the models of a server: their mean (a rate does not add up)."""
    return sum(values) / len(values) if values else None


def _spec_counters(
    counters: Mapping[str, float], rates: Mapping[str, list[float]], positions: Mapping[int, float]
) -> SpecCounters | None:
    spec = SpecCounters(
        drafts=counters.get(_SPEC_DRAFTS),
        draft_tokens=counters.get(_SPEC_DRAFT_TOKENS),
        accepted=counters.get(_SPEC_ACCEPTED),
        emitted=counters.get(_SPEC_EMITTED),
        # A position the page skipped accepted nothing there.
        per_position=tuple(positions.get(i, 0.0) for i in range(max(positions) + 1))
        if positions
        else (),
        acceptance_gauge=_mean(rates.get(_SPEC_RATE)),
        efficiency_gauge=_mean(rates.get(_SPEC_EFFICIENCY)),
    )
    return None if spec == SpecCounters() else spec


def beside_v1(base_url: str, path: str) -> str:
    """A path vLLM serves at its root, beside `/v1` (`/metrics`, `/tokenize`)."""
    parts = urlsplit(base_url)
    root = parts.path.rstrip("/")
    if root.endswith("/v1"):
        root = root[:-3]
    return urlunsplit((parts.scheme, parts.netloc, root + path, "", ""))


def metrics_url(base_url: str) -> str:
    """Where a vLLM server's Prometheus metrics are read, given its OpenAI base URL."""
    return beside_v1(base_url, "/metrics")


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
    # The same for the prefix-cache, speculative-decoding and TPOT figures.
    _recent: _Recent | None = field(default=None, repr=False)

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

    def scraped(self, load: ServerLoad) -> None:
        """A good scrape: `load` is the latest, the one before is kept for differences."""
        self.previous, self.load = self.load, load
        if load.waiting > 0 and load.running > (self.slots or 0.0):
            self.slots = load.running
        self.failures = 0
        self.last_error = None
        self.scrapes += 1
        self._recent_figures()  # every interval's, so that an idle one can carry the last

    def prefix_hit_rate(self) -> float | None:
        """The share of prompt tokens found in the prefix cache between the last two scrapes
        (the latest interval with lookups, when this one had none; V0's block hit-rate gauge as
        it is); None when unknown or nothing was ever looked up."""
        recent = self._recent_figures()
        return recent.prefix_hit_rate if recent is not None else None

    def spec_rates(self) -> SpecRates | None:
        """Speculative decoding between the last two scrapes (the latest interval with drafts,
        when this one had none); None when the server says nothing of it, or its load is
        unknown."""
        recent = self._recent_figures()
        return recent.spec if recent is not None else None

    def recent_tpot_s(self) -> float | None:
        """The mean time between output tokens the server measured (seconds): between the last
        two scrapes, else in the latest interval that saw enough tokens, else since it started;
        None until enough tokens were seen."""
        recent = self._recent_figures()
        return recent.tpot_s if recent is not None else None

    def _recent_figures(self) -> _Recent | None:
        load = self.current()
        if load is None:
            return None
        recent = self._recent
        if recent is None or recent.of is not load:
            recent = self._recent = _recent(load, self.previous, recent)
        return recent


@dataclass(frozen=True, slots=True)
class _Recent:
    of: ServerLoad
    prefix_hit_rate: float | None
    spec: SpecRates | None
    tpot_s: float | None


def _recent(load: ServerLoad, previous: ServerLoad | None, last: _Recent | None) -> _Recent:
    """The figures of the interval ending at `load`. One in which the server looked nothing up,
    drafted or decoded nothing keeps those of `last`, the interval before: an idle server's
    latest rates stand (they are unknown only while its load is)."""
    hit_rate = None
    queries, hits = load.prefix_queries, load.prefix_hits
    if queries is not None and hits is not None:
        before_q = previous.prefix_queries if previous is not None else None
        before_h = previous.prefix_hits if previous is not None else None
        if before_q is not None and before_h is not None and before_q <= queries:
            queries, hits = queries - before_q, max(0.0, hits - before_h)
        hit_rate = ratio(hits, queries)
        if hit_rate is None and last is not None:
            hit_rate = last.prefix_hit_rate
    else:
        hit_rate = load.prefix_hit_gauge
    spec = None
    if load.spec is not None:
        spec = spec_rates(load.spec, previous.spec if previous is not None else None)
        if last is not None and last.spec is not None:
            spec = SpecRates(
                acceptance=_first(spec.acceptance, last.spec.acceptance),
                accepted_per_draft=_first(spec.accepted_per_draft, last.spec.accepted_per_draft),
                per_position=spec.per_position or last.spec.per_position,
                efficiency=spec.efficiency,
            )
    recent = load.tpot.since(previous.tpot if previous else None)
    tpot_s = None
    if recent.count >= _TPOT_EVIDENCE:
        tpot_s = recent.total / recent.count
    elif last is not None and last.tpot_s is not None:
        tpot_s = last.tpot_s
    elif load.tpot.count >= _TPOT_EVIDENCE:
        tpot_s = load.tpot.total / load.tpot.count
    return _Recent(load, hit_rate, spec, tpot_s)


def _first(value: float | None, otherwise: float | None) -> float | None:
    return value if value is not None else otherwise


async def scrape_forever(
    state: ServerState, session: aiohttp.ClientSession, scrub: Scrubber = Scrubber.GENERIC
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
            state.last_error = scrub.bounded(f"{type(exc).__name__}: {exc}", 200)
            if state.failures == 1:
                logger.warning("vLLM metrics unavailable at %s: %s", state.url, state.last_error)
        else:
            if state.failures:
                logger.info("vLLM metrics back at %s", state.url)
            state.scraped(load)
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
        self, name: str, spec: ProviderSpec, scrub: Scrubber, stack: AsyncExitStack
    ) -> ServerState:
        """Start reading the metrics of provider `name` (type vllm) in the background; the
        reader stops when `stack` closes. `scrub` (the provider's) cleans the errors it keeps."""
        if self._session is None:
            raise RuntimeError("the scraper is not open")
        assert spec.base_url is not None  # checked by the config
        state = ServerState(spec.metrics_url or metrics_url(spec.base_url), spec.metrics_interval_s)
        task = asyncio.create_task(scrape_forever(state, self._session, scrub), name=f"vllm-{name}")
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
        spec = state.spec_rates()
        tpot_s = state.recent_tpot_s()
        out[name] = {
            "state": "ok" if load is not None else "unknown",
            "running": load.running if load else None,
            "waiting": load.waiting if load else None,
            "kv_cache_usage": load.kv_usage if load else None,
            "prefix_cache_hit_rate": _round(state.prefix_hit_rate()),
            "tpot_ms": round(tpot_s * 1000, 3) if tpot_s is not None else None,
            "spec_decode": None
            if spec is None
            else {
                "acceptance_rate": _round(spec.acceptance),
                "accepted_per_draft": _round(spec.accepted_per_draft),
                "tokens_per_step": _round(spec.tokens_per_step),
                "per_position": [round(share, 4) for share in spec.per_position],
                "efficiency": _round(spec.efficiency),
            },
            "last_error": state.last_error,
        }
    return out


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)

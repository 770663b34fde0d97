"""What a running gateway holds, and how a new config replaces it without dropping a request.

`Runtime` owns the parts that live as long as the process (latency store, tracing, metrics
registry, admission and rate limits, the vLLM metrics scraper's session) and the current
`Services`: everything a request needs that the config decides (models, provider connection
pools, guards). A request reads `runtime.services` once, when it is admitted, and keeps that
object to its end. A reload builds a complete new `Services` first and swaps the pointer; the old
one's connection pools are closed once its last request has ended.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import signal
import time
from collections.abc import Mapping
from contextlib import AsyncExitStack, suppress
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from gateway.admission.auth import KeyRing, exposed_without_keys
from gateway.admission.ratelimit import Admission, RateLimiter, open_rate_limiter
from gateway.batching import BatchingProvider, BulkGate
from gateway.batching.gate import Upstream
from gateway.config import (
    AffinitySpec,
    ConfigError,
    ModelNames,
    ModelSpec,
    RateLimitSpec,
    Settings,
    load_settings,
)
from gateway.latency import (
    FanOutRecorder,
    LatencyStore,
    MemoryLatencyStore,
    Recorder,
    RedisLatencyStore,
    run_store,
)
from gateway.providers import open_providers
from gateway.providers.base import decode_body
from gateway.providers.vllm import Scraper, ServerState
from gateway.redis import connect_redis
from gateway.responses.store import ResponseStore, open_response_store
from gateway.routing import Affinity, Guards, TTFTPredictor, fallback_chain
from gateway.telemetry import (
    AccessLog,
    BatchingCollector,
    BatchingState,
    ExtraLoadCollector,
    GuardsCollector,
    LatencyStoreCollector,
    LimitsCollector,
    LimitsState,
    Meters,
    Registry,
    Tracing,
    make_registry,
    tracing_from_env,
)
from gateway.telemetry.prometheus import (
    AffinityCollector,
    BulkPreemptionsCollector,
    ResponsesStoreCollector,
)
from gateway.upstream import Provider

log = logging.getLogger("tailguard")

# The response store connects at start-up (a Cluster reads its slot map) within this, so that
# the first read is not slowed by it; a Redis that does not answer delays start-up no longer.
_WARM_TIMEOUT_S = 3.0


@dataclass(slots=True, eq=False)
class Services:
    """Everything a request needs, as one config decided it."""

    settings: Settings
    models: dict[str, ModelSpec]  # by name
    chains: dict[str, list[ModelSpec]]  # by name: the model, then its fallbacks, transitively
    providers: dict[str, Provider]
    latency: LatencyStore  # rolling percentiles; read through its snapshot, never awaited
    recorder: Recorder  # where finished attempts go: the latency store, metrics (and a test's)
    guards: Guards  # cooldowns, retry budget, hedge cap
    meters: Meters  # the request path's metrics
    tracing: Tracing  # spans, or no-ops when exporting is off
    access: AccessLog
    rng: random.Random
    started_at: float
    metrics: Registry  # what GET /metrics exposes
    responses: ResponseStore  # stored responses (a reload that keeps `responses` shares them)
    batchers: dict[str, BatchingProvider] = field(default_factory=dict)  # by deployment id
    servers: dict[str, ServerState] = field(default_factory=dict)  # vLLM load, by provider
    predictor: TTFTPredictor = field(default_factory=TTFTPredictor)
    affinity: Affinity = field(default_factory=lambda: Affinity(AffinitySpec()))
    gate: BulkGate | None = None  # admission of bulk chat requests
    keyring: KeyRing = field(default_factory=lambda: KeyRing(None))  # empty: no authentication
    active: int = 0  # requests admitted under these services and not yet finished
    retired: bool = False  # a reload replaced these services
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # retired and no request left
    _pools: AsyncExitStack = field(default_factory=AsyncExitStack)  # the providers' sessions
    # By the name requested: a model's own, or one of its aliases (derived from `models`).
    names: ModelNames = field(init=False)

    def __post_init__(self) -> None:
        self.names = ModelNames(self.models.values())

    def enter(self) -> None:
        self.active += 1

    def leave(self) -> None:
        self.active -= 1
        if self.active == 0 and self.retired:
            self.idle.set()


class Runtime:
    """The gateway's state for one app lifespan. Use `async with Runtime(...)`: entering it
    opens the lifespan's parts and the first `Services`, leaving it closes them."""

    def __init__(
        self,
        settings: Settings,
        *,
        recorder: Recorder | None,
        environ: Mapping[str, str],
        config_path: Path | None,
    ) -> None:
        self.config_path = config_path
        self.reloads = 0  # successful reloads
        self.reload_failures = 0
        self.last_failure: str | None = None  # why the latest reload was refused, if it was
        self.loaded_at = time.time()
        self._initial = settings
        self._extra_recorder = recorder
        self._environ = environ
        self._stack = AsyncExitStack()
        self.predictor = TTFTPredictor()  # learned from traffic: kept across reloads
        self._draining: set[asyncio.Task[Any]] = set()  # referenced until done
        self._reload_lock = asyncio.Lock()
        # Per process, not per config: counters in flight must survive a reload.
        self.admission = Admission(settings.server.max_concurrent)
        self.scraper = Scraper()  # its session opens and closes with the lifespan
        # Opened by __aenter__, for the lifespan:
        self.latency: LatencyStore
        self.limiter: RateLimiter
        self.tracing: Tracing
        self.registry: Registry
        self.meters: Meters
        self.services: Services

    async def __aenter__(self) -> Runtime:
        stack = self._stack
        await stack.__aenter__()
        try:
            settings = self._initial
            self.latency = await _open_latency_store(settings, stack)
            await stack.enter_async_context(self.scraper)  # closed after every config's readers
            self.limiter = open_rate_limiter(settings)
            stack.push_async_callback(self.limiter.aclose)
            # Off the loop: the SDK's resource detectors block while they run.
            self.tracing = await asyncio.to_thread(tracing_from_env, self._environ)
            # Flushes what is queued, bounded by the exporter's timeout, off the event loop.
            stack.push_async_callback(asyncio.to_thread, self.tracing.shutdown)
            self.registry = make_registry(
                LatencyStoreCollector(
                    self.latency.health,
                    lambda: {d: s.inflight for d, s in self.latency.snapshot.deployments.items()},
                ),
                GuardsCollector(
                    lambda: _cooldowns_opened(self.services),
                    lambda: self.services.guards.hedges.counts,
                    lambda: self.services.guards.retries.denied,
                    lambda: self.tracing.dropped,
                    lambda: self.tracing.decisions,
                ),
                BatchingCollector(lambda: _batching_state(self.services)),
                LimitsCollector(lambda: _limits_state(self.limiter, self.admission)),
                ExtraLoadCollector(
                    lambda: self.latency.snapshot,
                    lambda: (m.name for m in self.services.settings.models),
                ),
                AffinityCollector(lambda: self.services.affinity.counts),
                BulkPreemptionsCollector(
                    lambda: _preemptions(self.services), lambda: _server_preempts(self.services)
                ),
                ResponsesStoreCollector(lambda: self.services.responses),
            )
            self.meters = Meters(self.registry, {})
            self.services = await self._build(settings, guards=None)
            stack.push_async_callback(self._close_all)
            if self.config_path is not None:
                self._watch(stack)
        except BaseException:
            await stack.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.__aexit__(None, None, None)

    async def _build(
        self, settings: Settings, guards: Guards | None, kept: ResponseStore | None = None
    ) -> Services:
        pools = AsyncExitStack()
        providers = await open_providers(settings, pools)
        self.meters.describe(
            {
                d.id: (providers[d.provider].system, d.model)
                for m in settings.models
                for d in m.deployments
            }
        )
        recorders: list[Recorder] = [self.latency, self.meters]
        if self._extra_recorder is not None:
            recorders.append(self._extra_recorder)
        servers = {
            name: self.scraper.watch(name, spec, providers[name].scrub, pools)
            for name, spec in settings.providers.items()
            if spec.type == "vllm"
        }
        gate = BulkGate(settings.routing.bulk, servers=_upstreams(settings, providers, servers))
        batchers = _batchers(settings, providers, self.meters, gate)
        return Services(
            settings=settings,
            models={m.name: m for m in settings.models},
            chains={m.name: fallback_chain(m, settings) for m in settings.models},
            providers=providers,
            latency=self.latency,
            recorder=FanOutRecorder(*recorders),
            guards=guards or Guards(settings.routing.cooldown, settings.routing.retry_budget),
            meters=self.meters,
            tracing=self.tracing,
            access=AccessLog(settings.server.access_log),
            rng=random.Random(),
            started_at=time.time(),
            metrics=self.registry,
            batchers=batchers,
            gate=gate,
            keyring=KeyRing(settings.auth),
            servers=servers,
            predictor=self.predictor,
            affinity=_affinity(getattr(self, "services", None), settings),
            responses=await _response_store(settings, kept, pools),  # last: the rest cannot fail
            _pools=pools,
        )

    # -- reloading --

    async def reload(self) -> bool:
        """Load the config file again and, if it is valid, serve it from the next request on.

        An invalid file is logged and the running config kept. `server` and `latency` changes
        need a restart: they are kept as they were, with a warning. A file without API keys is
        refused, as at start-up, while the gateway listens beyond loopback and
        `server.allow_unauthenticated` is off: a reload never turns authentication off there.
        """
        if self.config_path is None:
            return False
        async with self._reload_lock:
            old = self.services
            try:
                settings = await asyncio.to_thread(load_settings, self.config_path)
            except ConfigError as exc:
                self._failed(str(exc))
                log.error("config reload rejected, the running config is kept: %s", exc)
                return False
            fixed: dict[str, Any] = {}
            for part in ("server", "latency"):
                if getattr(settings, part) != getattr(old.settings, part):
                    log.warning("config reload: `%s` changes need a restart; kept as it was", part)
                    fixed[part] = getattr(old.settings, part)
            if _rate_limit_store(settings) != _rate_limit_store(old.settings):
                # Keys and their limits reload; where the counters live does not.
                log.warning("config reload: `auth.rate_limits` changes need a restart")
            if fixed:
                settings = settings.model_copy(update=fixed)
            if exposed_without_keys(settings):
                reason = (
                    f"the new config has no API keys and the gateway listens on "
                    f"{settings.server.host}, beyond loopback, without "
                    "server.allow_unauthenticated: authentication stays on"
                )
                self._failed(reason)
                log.error("config reload refused, the running config is kept: %s", reason)
                return False
            if old.keyring.enabled and not KeyRing(settings.auth).enabled:
                log.warning(
                    "config reload: the new config has no API keys, authentication is now off "
                    "(listening on %s)",
                    settings.server.host,
                )
            same_routing = settings.routing == old.settings.routing
            try:
                guards = old.guards if same_routing else None
                new = await self._build(settings, guards, old.responses)
            except Exception as exc:
                self._failed(f"the new config could not be opened ({type(exc).__name__})")
                log.exception("config reload failed, the running config is kept")
                return False
            self.services = new
            self.reloads += 1
            self.last_failure = None
            self.loaded_at = time.time()
            log.info(
                "config reloaded from %s: %d models, %d providers",
                self.config_path,
                len(settings.models),
                len(settings.providers),
            )
            task = asyncio.create_task(_drain(old), name="drain-old-config")
            self._draining.add(task)
            task.add_done_callback(self._draining.discard)
            return True

    def _failed(self, reason: str) -> None:
        self.reload_failures += 1
        self.last_failure = reason

    def _watch(self, stack: AsyncExitStack) -> None:
        """Reload on SIGHUP and whenever the config file changes."""
        loop = asyncio.get_running_loop()
        with suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread
            loop.add_signal_handler(signal.SIGHUP, self._reload_soon)
            stack.callback(loop.remove_signal_handler, signal.SIGHUP)
        if self._initial.server.reload_on_change:
            assert self.config_path is not None
            watcher = asyncio.create_task(
                self._watch_file(_digest(self.config_path)), name="config-watch"
            )
            stack.push_async_callback(_cancel, watcher)

    def health(self) -> dict[str, Any]:
        """The config part of `/readyz`."""
        return {
            "path": str(self.config_path) if self.config_path is not None else None,
            "loaded_at": round(self.loaded_at, 3),
            "reloads": self.reloads,
            "reload_failures": self.reload_failures,
            "last_failure": self.last_failure,  # null once a reload has succeeded
        }

    def _reload_soon(self) -> None:
        task = asyncio.create_task(self.reload(), name="config-reload")
        self._draining.add(task)  # keeps a reference until done
        task.add_done_callback(self._draining.discard)

    async def _watch_file(self, seen: bytes | None) -> None:
        from watchfiles import awatch

        assert self.config_path is not None
        path = self.config_path
        # Watch the directory: editors and Kubernetes ConfigMap updates replace the file (or a
        # symlink to it) rather than write it. Only a change of content reloads; the content is
        # also checked every 5 s, so a change made before the watch began is not missed.
        async for _ in awatch(
            path.parent, debounce=200, step=50, rust_timeout=5000, yield_on_timeout=True
        ):
            digest = await asyncio.to_thread(_digest, path)
            if digest != seen:
                seen = digest
                await self.reload()

    async def _close_all(self) -> None:
        for task in list(self._draining):
            task.cancel()
        await asyncio.gather(*self._draining, return_exceptions=True)
        await self.services._pools.aclose()


async def _drain(old: Services) -> None:
    """Close the replaced config's connection pools once its last request has ended (or
    the lifespan ends first: its metrics readers must stop before the scraper closes)."""
    old.retired = True
    try:
        if old.active > 0:
            await old.idle.wait()
    finally:
        await old._pools.aclose()


async def _response_store(
    settings: Settings, kept: ResponseStore | None, pools: AsyncExitStack
) -> ResponseStore:
    """The previous config's store when `responses` is unchanged (stored responses outlive the
    reload; `latency` cannot change without a restart), else a new one, connected (never
    raises). Each config's pools release their hold: the store closes after the last config
    using it has drained."""
    if kept is not None and kept.spec == settings.responses:
        store = kept.share()
    else:
        store = open_response_store(settings)
        await store.warm(_WARM_TIMEOUT_S)
    pools.push_async_callback(store.aclose)
    return store


def _batchers(
    settings: Settings, providers: Mapping[str, Provider], meters: Meters, gate: BulkGate
) -> dict[str, BatchingProvider]:
    """One micro-batcher per deployment of a model with `batching` (OpenAI wire only)."""
    batchers: dict[str, BatchingProvider] = {}
    for model in settings.models:
        if model.batching is None:
            continue
        for d in model.deployments:
            provider = providers[d.provider]
            if d.id not in batchers and provider.wire == "openai":
                batchers[d.id] = BatchingProvider(
                    provider,
                    d.id,
                    model.batching,
                    decode=partial(decode_body, "openai", scrub=provider.scrub),
                    observer=meters.batch,
                    gate=gate,
                )
    return batchers


def _affinity(running: Services | None, settings: Settings) -> Affinity:
    """The running config's prefix table, kept by a reload that leaves `routing.affinity` as
    it was (what it learned still holds); a new one otherwise."""
    if running is not None and running.affinity.spec == settings.routing.affinity:
        return running.affinity
    return Affinity(settings.routing.affinity)


def _upstreams(
    settings: Settings, providers: Mapping[str, Provider], servers: Mapping[str, ServerState]
) -> dict[str, Upstream]:
    """The vLLM server behind each deployment whose metrics are read, for bulk admission."""
    return {
        d.id: Upstream(servers[d.provider], providers[d.provider].bulk_priority is not None)
        for m in settings.models
        for d in m.deployments
        if d.provider in servers
    }


def _preemptions(services: Services) -> dict[str, int]:
    return dict(services.gate.preemptions) if services.gate is not None else {}


def _server_preempts(services: Services) -> dict[str, bool]:
    return services.gate.server_preempts() if services.gate is not None else {}


def _batching_state(services: Services) -> BatchingState:
    gate = services.gate
    return BatchingState(
        waiting={d: b.waiting for d, b in services.batchers.items()},
        rejected={d: b.rejected for d, b in services.batchers.items()},
        bulk_limits=gate.limits() if gate is not None else {},
        bulk_waiting=gate.waiting() if gate is not None else {},
        bulk_rejected=gate.rejected if gate is not None else 0,
    )


def _limits_state(limiter: RateLimiter, admission: Admission) -> LimitsState:
    return LimitsState(
        rate_limited=limiter.refused,
        store_errors=limiter.store_errors,
        store_outages=limiter.outages,
        store_degraded=limiter.degraded,
        concurrency_refused=admission.refused,
        in_flight=admission.active,
    )


def _rate_limit_store(settings: Settings) -> Any:
    # No auth section: the defaults, as `open_rate_limiter` takes them.
    return settings.auth.rate_limits if settings.auth is not None else RateLimitSpec()


def _digest(path: Path) -> bytes | None:
    try:
        return hashlib.sha256(path.read_bytes()).digest()
    except OSError:
        return None  # mid-replacement: the next event will see the new file


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with suppress(asyncio.CancelledError):
        await task


async def _open_latency_store(settings: Settings, stack: AsyncExitStack) -> LatencyStore:
    """The configured store, with its flush and refresh tasks running until `stack` closes."""
    spec = settings.latency
    store: LatencyStore
    if spec.store == "redis":
        assert spec.redis_url is not None  # checked by the config
        redis = connect_redis(spec.redis_url.get_secret_value())
        stack.push_async_callback(redis.aclose)  # after the store's final flush
        store = RedisLatencyStore(
            redis, window_s=spec.window_s, slice_s=spec.slice_s, min_samples=spec.min_samples
        )
    else:
        store = MemoryLatencyStore(
            window_s=spec.window_s, slice_s=spec.slice_s, min_samples=spec.min_samples
        )
    await stack.enter_async_context(run_store(store))
    return store


def _cooldowns_opened(services: Services) -> dict[str, int]:
    """Times each configured deployment's breaker opened, 0 for those that never did: a series
    from the start, so that `increase()` sees the first opening too."""
    opened = dict.fromkeys((d.id for m in services.settings.models for d in m.deployments), 0)
    return opened | services.guards.cooldowns.opened

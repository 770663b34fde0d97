"""Composition: how one config becomes the `Services` a request uses, and the parts a lifespan
opens once (the latency store).

`build_services` opens a config's providers and their connection pools, the vLLM scrapes, the
bulk gate, the micro-batchers and the stored responses, and wires them with what the lifespan
holds (latency store, metrics, tracing, the learned predictor). A reload calls it again; nothing
here reads a file or swaps anything.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from functools import partial

from gateway.admission.auth import KeyRing
from gateway.batching import BatchingProvider, BulkGate
from gateway.batching.gate import Upstream
from gateway.config import AffinitySpec, ModelNames, ModelSpec, Settings
from gateway.latency import (
    FanOutRecorder,
    LatencyStore,
    MemoryLatencyStore,
    Recorder,
    RedisLatencyStore,
    run_store,
)
from gateway.latency.vllm import Scraper, ServerState
from gateway.providers import open_providers
from gateway.providers.base import decode_body
from gateway.redis import connect_redis
from gateway.responses.store import ResponseStore, open_response_store
from gateway.routing import Affinity, Guards, TTFTPredictor, fallback_chain
from gateway.telemetry import AccessLog, Meters, Registry, Tracing
from gateway.upstream import Provider

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


@dataclass(frozen=True, slots=True)
class Lifespan:
    """What every config's services share for one app lifespan."""

    latency: LatencyStore
    meters: Meters
    tracing: Tracing
    registry: Registry
    scraper: Scraper
    predictor: TTFTPredictor
    recorder: Recorder | None  # one more place finished attempts go (a test's)


async def build_services(
    lifespan: Lifespan,
    settings: Settings,
    guards: Guards | None,
    kept: ResponseStore | None = None,
    running: Services | None = None,
) -> Services:
    """The services of `settings`: `guards` and `kept` (the stored responses) carried over
    from `running` by a reload that leaves their config as it was."""
    pools = AsyncExitStack()
    providers = await open_providers(settings, pools)
    meters = lifespan.meters
    meters.describe(
        {
            d.id: (providers[d.provider].system, d.model)
            for m in settings.models
            for d in m.deployments
        }
    )
    recorders: list[Recorder] = [lifespan.latency, meters]
    if lifespan.recorder is not None:
        recorders.append(lifespan.recorder)
    servers = {
        name: lifespan.scraper.watch(name, spec, providers[name].scrub, pools)
        for name, spec in settings.providers.items()
        if spec.type == "vllm"
    }
    gate = BulkGate(settings.routing.bulk, servers=_upstreams(settings, providers, servers))
    batchers = _batchers(settings, providers, meters, gate)
    return Services(
        settings=settings,
        models={m.name: m for m in settings.models},
        chains={m.name: fallback_chain(m, settings) for m in settings.models},
        providers=providers,
        latency=lifespan.latency,
        recorder=FanOutRecorder(*recorders),
        guards=guards or Guards(settings.routing.cooldown, settings.routing.retry_budget),
        meters=meters,
        tracing=lifespan.tracing,
        access=AccessLog(settings.server.access_log),
        rng=random.Random(),
        started_at=time.time(),
        metrics=lifespan.registry,
        batchers=batchers,
        gate=gate,
        keyring=KeyRing(settings.auth),
        servers=servers,
        predictor=lifespan.predictor,
        affinity=_affinity(running, settings),
        responses=await _response_store(settings, kept, pools),  # last: the rest cannot fail
        _pools=pools,
    )


async def open_latency_store(settings: Settings, stack: AsyncExitStack) -> LatencyStore:
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

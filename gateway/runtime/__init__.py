"""What a running gateway holds, and how a new config replaces it without dropping a request.

`Runtime` owns the parts that live as long as the process (latency store, tracing, metrics
registry, admission and rate limits, the vLLM metrics scraper's session) and the current
`Services`: everything a request needs that the config decides (models, provider connection
pools, guards). A request reads `runtime.services` once, when it is admitted, and keeps that
object to its end. A reload builds a complete new `Services` first (`compose`) and swaps the
pointer; the old one's connection pools are closed once its last request has ended. The metrics
read at scrape time are wired in `wiring`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import signal
import time
from collections.abc import Mapping
from contextlib import AsyncExitStack, suppress
from pathlib import Path
from typing import Any

from gateway.admission.auth import KeyRing, exposed_without_keys
from gateway.admission.ratelimit import Admission, RateLimiter, open_rate_limiter
from gateway.config import ConfigError, RateLimitSpec, Settings, load_settings
from gateway.latency import LatencyStore, Recorder
from gateway.latency.vllm import Scraper
from gateway.responses.store import ResponseStore
from gateway.routing import Guards, TTFTPredictor
from gateway.runtime.compose import Lifespan, Services, build_services, open_latency_store
from gateway.runtime.wiring import metrics_registry
from gateway.telemetry import Meters, Registry, Tracing, tracing_from_env

__all__ = ["Runtime", "Services"]

log = logging.getLogger("tailguard")


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
        self._lifespan: Lifespan
        self.services: Services

    async def __aenter__(self) -> Runtime:
        stack = self._stack
        await stack.__aenter__()
        try:
            settings = self._initial
            self.latency = await open_latency_store(settings, stack)
            await stack.enter_async_context(self.scraper)  # closed after every config's readers
            self.limiter = open_rate_limiter(settings)
            stack.push_async_callback(self.limiter.aclose)
            # Off the loop: the SDK's resource detectors block while they run.
            self.tracing = await asyncio.to_thread(tracing_from_env, self._environ)
            # Flushes what is queued, bounded by the exporter's timeout, off the event loop.
            stack.push_async_callback(asyncio.to_thread, self.tracing.shutdown)
            self.registry = metrics_registry(
                lambda: self.services, self.latency, self.limiter, self.admission, self.tracing
            )
            self.meters = Meters(self.registry, {})
            self._lifespan = Lifespan(
                self.latency,
                self.meters,
                self.tracing,
                self.registry,
                self.scraper,
                self.predictor,
                self._extra_recorder,
            )
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
        running = getattr(self, "services", None)
        return await build_services(self._lifespan, settings, guards, kept, running)

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

"""What is known of each deployment's speed and load: the latency statistics every request hands
over when it ends, where they are kept, and what vLLM servers say of their own load.

`Recorder.record` is called on the request path, so it only touches memory. The stores keep, per
deployment and per model name, one sketch per metric (`ttft`, `tpot`, `total`) and per time slice;
the window is the sum of its slices. `refresh()` swaps in an immutable `Snapshot` for the router.
`MemoryLatencyStore` serves one process; `RedisLatencyStore` shares the slices between replicas
(through a standalone Redis, a Sentinel-managed one or a Redis Cluster: see `gateway.redis`) and
falls back to its own numbers while Redis is unreachable. `run_store` owns their background
flush and refresh tasks.

Modules: `samples` (the sample, recorders, observations), `window` (counts per slice),
`snapshot` (the stats types and the snapshot built from counts), `memory` (the store protocol
and the in-process store), `redis_store` (the shared store and its wire format), `tasks`
(`run_store`), `sketch` and `prompt_size` (the histogram and the prompt-size bands), `vllm` and
`vllm_spec` (a vLLM server's `/metrics`, scraped in the background by a `Scraper`). This package
re-exports what the other rooms use of the statistics.
"""

from __future__ import annotations

from gateway.latency.memory import LatencyStore, MemoryLatencyStore
from gateway.latency.redis_store import RedisLatencyStore
from gateway.latency.samples import (
    BYTES_PER_TOKEN,
    CANCELLED,
    HEDGE_LOST,
    METRICS,
    NOT_FAILURES,
    TOTAL_DEADLINE,
    TTFT_DEADLINE,
    FanOutRecorder,
    MemoryRecorder,
    Recorder,
    Sample,
    observations,
)
from gateway.latency.snapshot import BandStats, MetricStats, SLOStats, Snapshot, TargetStats
from gateway.latency.tasks import run_store

__all__ = [
    "BYTES_PER_TOKEN",
    "CANCELLED",
    "HEDGE_LOST",
    "METRICS",
    "NOT_FAILURES",
    "TOTAL_DEADLINE",
    "TTFT_DEADLINE",
    "BandStats",
    "FanOutRecorder",
    "LatencyStore",
    "MemoryLatencyStore",
    "MemoryRecorder",
    "MetricStats",
    "Recorder",
    "RedisLatencyStore",
    "SLOStats",
    "Sample",
    "Snapshot",
    "TargetStats",
    "observations",
    "run_store",
]

"""vLLM's Prometheus `/metrics` page, driven by the simulator's real state.

The queue gauges, an approximate KV-cache usage, the TTFT, inter-token, prefill and end-to-end
histograms with vLLM's buckets, the token, prefix-cache, preemption, speculative-decoding and
finished-request counters, per model name, under the current or the older (deprecated) names;
the page can be made to fail.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable
from typing import Final, Protocol

from gateway.sim.profile import MetricsFault, MetricsNames
from gateway.sim.wire import SimReply

__all__ = ["METRICS_CONTENT_TYPE", "MetricsPage", "ModelMetrics", "SpecCounters"]


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


class Histogram:
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


class PoolGauges(Protocol):
    """What the page reads from a batch pool."""

    running: int
    waiting: int
    kv_tokens: int
    kv_capacity: int


class SpecCounters:
    """Speculative decoding's counters of one model name (vLLM's, per target step)."""

    __slots__ = ("accepted", "draft_tokens", "drafts", "emitted", "per_pos")

    def __init__(self, k: int) -> None:
        self.drafts = 0  # target steps that verified a draft
        self.draft_tokens = 0
        self.accepted = 0
        self.emitted = 0  # tokens the steps yielded: the accepted ones plus one each
        self.per_pos = [0] * k  # steps whose draft position i was accepted

    def widen(self, k: int) -> None:
        """Room for drafts of `k` tokens (another override of the name drafts more)."""
        if k > len(self.per_pos):
            self.per_pos.extend([0] * (k - len(self.per_pos)))

    def step(self, k: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += k
        self.accepted += accepted
        self.emitted += accepted + 1
        per_pos = self.per_pos
        for i in range(accepted):
            per_pos[i] += 1


class ModelMetrics:
    """vLLM's series for one served model name (over every batch pool of that name)."""

    __slots__ = (
        "e2e",
        "finished",
        "generation_tokens",
        "itl",
        "pools",
        "preemptions",
        "prefill",
        "prefix_hits",
        "prefix_queries",
        "prompt_tokens",
        "spec",
        "ttft",
    )

    def __init__(self) -> None:
        self.pools: list[PoolGauges] = []
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which were found there
        self.preemptions = 0
        self.spec: SpecCounters | None = None  # None: no speculative decoding, no series
        self.finished = dict.fromkeys(FINISHED_REASONS, 0)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.prefill = Histogram(E2E_BUCKETS)  # vLLM's buckets for it are the e2e ones

    def first_token(self, arrived: float, prompt_tokens: int) -> None:
        """A sequence's prefill is done and its first token out."""
        self.ttft.observe(time.monotonic() - arrived)
        self.prompt_tokens += prompt_tokens

    def done(self, arrived: float, reason: str) -> None:
        """A sequence finished: `stop`, `length` or `abort` (the client left, or a cut); the
        API's `tool_calls` is the engine's `stop`, as in vLLM."""
        self.finished[reason if reason in self.finished else "stop"] += 1
        if reason != "abort":
            self.e2e.observe(time.monotonic() - arrived)


class MetricsPage:
    """The page of one engine: a series per model name, served or requested so far.

    The served names come first (as vLLM's --served-model-name), then every name requested, in
    the order first seen. `names` and `fault` start from the default profile and can be changed
    while running.
    """

    def __init__(self, served: Iterable[str], names: MetricsNames, fault: MetricsFault) -> None:
        self.models: dict[str, ModelMetrics] = {name: ModelMetrics() for name in served}
        self.names: MetricsNames = names
        self.fault: MetricsFault = fault

    def model(self, name: str) -> ModelMetrics:
        """The series of `name`, added to the page the first time it is asked for."""
        metrics = self.models.get(name)
        if metrics is None:
            metrics = self.models[name] = ModelMetrics()
        return metrics

    def reply(self) -> SimReply:
        if self.fault == "error":
            body = b"simulated failure of the metrics exporter\n"
            return SimReply(500, {"content-type": "text/plain; charset=utf-8"}, body)
        if self.fault == "garbage":
            body = b"<html><body><h1>502 Bad Gateway</h1></body></html>\n"
            return SimReply(200, {"content-type": METRICS_CONTENT_TYPE}, body)
        return SimReply(200, {"content-type": METRICS_CONTENT_TYPE}, self.render().encode())

    def render(self) -> str:
        """vLLM's Prometheus text for every model name served or requested so far.

        Labelled `model_name` and `engine="0"`, as one vLLM engine labels them. `running` holds
        batch slots, `waiting` queues for one; `kv_cache_usage_perc` is the prompt plus generated
        tokens of the running sequences over `kv_cache_tokens`, or `max_batch x
        kv_tokens_per_seq` without it (capped at 1). TTFT runs from the request's arrival to its
        first token, per sequence; the inter-token histogram takes one decode step per token
        after the first; e2e, arrival to the last token
        of a finished (not aborted) sequence. `request_success_total{finished_reason}` counts
        `stop`, `length` and `abort` (a client that left, a cut stream); prompt tokens are
        counted at prefill, generated ones as they are made. `prefix_cache_queries` and
        `prefix_cache_hits` count prompt tokens looked up in the prefix cache and found there
        (the legacy names: the `gpu_prefix_cache_hit_rate` gauge); the prefill histogram takes
        each sequence's simulated prefill time (what the cache did not hold), not a wall clock.
        `num_preemptions_total` counts preempted sequences; the spec-decode series show only for
        the model names that speculate (`_spec`).
        """
        current = self.names in ("current", "both")
        legacy = self.names in ("legacy", "both")
        series = [
            (f'model_name="{_label_value(name)}",engine="0"', m) for name, m in self.models.items()
        ]
        out: list[str] = []

        def head(name: str, kind: str, text: str) -> None:
            out.append(f"# HELP {name} {text}")
            out.append(f"# TYPE {name} {kind}")

        def gauges(name: str, text: str, value: Callable[[ModelMetrics], float]) -> None:
            head(name, "gauge", text)
            out.extend(f"{name}{{{labels}}} {float(value(m))!r}" for labels, m in series)

        def kv_usage(m: ModelMetrics) -> float:
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
        if legacy:
            gauges(
                "vllm:gpu_prefix_cache_hit_rate",
                "GPU prefix cache block hit rate.",
                lambda m: m.prefix_hits / m.prefix_queries if m.prefix_queries else 0.0,
            )
        counters = [
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens"),
            (
                "vllm:generation_tokens",
                "Number of generation tokens processed.",
                "generation_tokens",
            ),
        ]
        if current:
            counters += [
                (
                    "vllm:prefix_cache_queries",
                    "Prefix cache queries, in terms of number of queried tokens.",
                    "prefix_queries",
                ),
                (
                    "vllm:prefix_cache_hits",
                    "Prefix cache hits, in terms of number of cached tokens.",
                    "prefix_hits",
                ),
            ]
        for name, text, attr in counters:
            head(name, "counter", text)
            out.extend(
                f"{name}_total{{{labels}}} {float(getattr(m, attr))!r}" for labels, m in series
            )
        head("vllm:num_preemptions", "counter", "Cumulative number of preemption from the engine.")
        out.extend(
            f"vllm:num_preemptions_total{{{labels}}} {float(m.preemptions)!r}"
            for labels, m in series
        )
        _spec(out, head, series, current=current, legacy=legacy)
        head("vllm:request_success", "counter", "Count of successfully processed requests.")
        for labels, m in series:
            out.extend(
                f'vllm:request_success_total{{{labels},finished_reason="{reason}"}} {float(n)!r}'
                for reason, n in m.finished.items()
            )
        histograms: list[tuple[str, str, Callable[[ModelMetrics], Histogram]]] = [
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
        histograms.append(
            (
                "vllm:request_prefill_time_seconds",
                "Histogram of time spent in PREFILL phase for request.",
                lambda m: m.prefill,
            )
        )
        for name, text, pick in histograms:
            head(name, "histogram", text)
            for labels, m in series:
                pick(m).write(out, name, labels)
        out.append("")
        return "\n".join(out)


def _spec(
    out: list[str],
    head: Callable[[str, str, str], None],
    series: list[tuple[str, ModelMetrics]],
    *,
    current: bool,
    legacy: bool,
) -> None:
    """Speculative decoding's series, for the model names that speculate (none: no series).

    The current (V1) names count drafts, draft tokens, accepted tokens and accepted tokens per
    draft position; the legacy (V0) ones add the acceptance rate and the system efficiency
    (emitted tokens over the most the steps could have emitted, k + 1 each) as gauges, and the
    emitted tokens. The accepted and draft token counters have the same name in both.
    """
    specs = [(labels, m.spec) for labels, m in series if m.spec is not None]
    if not specs:
        return

    def counter(name: str, text: str, value: Callable[[SpecCounters], int]) -> None:
        head(name, "counter", text)
        out.extend(f"{name}_total{{{labels}}} {float(value(c))!r}" for labels, c in specs)

    def gauge(name: str, text: str, value: Callable[[SpecCounters], float]) -> None:
        head(name, "gauge", text)
        out.extend(f"{name}{{{labels}}} {float(value(c))!r}" for labels, c in specs)

    if legacy:
        gauge(
            "vllm:spec_decode_draft_acceptance_rate",
            "Speculative token acceptance rate.",
            lambda c: c.accepted / c.draft_tokens if c.draft_tokens else 0.0,
        )
        gauge(
            "vllm:spec_decode_efficiency",
            "Speculative decoding system efficiency.",
            lambda c: c.emitted / (c.drafts * (len(c.per_pos) + 1)) if c.drafts else 0.0,
        )
    if current:
        counter(
            "vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", lambda c: c.drafts
        )
    counter(
        "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", lambda c: c.draft_tokens
    )
    counter(
        "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", lambda c: c.accepted
    )
    if current:
        name = "vllm:spec_decode_num_accepted_tokens_per_pos"
        head(name, "counter", "Accepted tokens per draft position.")
        out.extend(
            f'{name}_total{{{labels},position="{i}"}} {float(n)!r}'
            for labels, c in specs
            for i, n in enumerate(c.per_pos)
        )
    if legacy:
        counter(
            "vllm:spec_decode_num_emitted_tokens", "Number of emitted tokens.", lambda c: c.emitted
        )


def _label_value(value: str) -> str:
    """A Prometheus label value, escaped (backslash, double quote, newline)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

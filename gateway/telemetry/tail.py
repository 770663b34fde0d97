"""Tail-aware trace sampling: keep whole traces of the requests worth looking at.

Head sampling decides when a request arrives, before anyone knows whether it will fail, fall
back, hedge or run slow: exactly the requests a tail-latency gateway exists for. `TailSampler`
sits in front of the batch processor instead. It holds the ended spans of each trace (bounded)
until the trace's local root span (the request's SERVER span) ends, reads that span's final
attributes, then forwards the whole trace to the batch processor or drops it.

Kept, by the first reason that applies: an error (`error`), a stream cut after a 200 (`cut`), a
hedge (`hedge`), any other route than `primary` or more than one attempt (`fallback`), a budget
missed (`slo_miss`), slower than the deployment's p99 (`slow`), a client `traceparent` with the
sampled flag (`sampled_parent`), else a fixed share of the rest chosen by the trace id (`share`),
so every replica that sees a trace decides alike. Everything else is dropped (`rest`); spans
beyond the bounds drop their trace (`overflow`).

A trace here is one request's part of it: a client may send many requests in one trace, and
each is decided on its own. Spans are grouped under their parent, so the request's attempts
(direct children of its SERVER span, the only spans the gateway makes below it) travel with it.

The policy needs no SDK: spans are read through the small protocols below, and
`gateway.telemetry.tracing` makes the sampler the SDK's span processor.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from enum import Enum
from typing import Any, Final, Protocol

from gateway import semconv as sc

EXPORTED: Final = "exported"
DROPPED: Final = "dropped"
# Every (decision, reason) pair the sampler counts: a fixed vocabulary for /metrics labels.
DECISIONS: Final = (
    *((EXPORTED, reason) for reason in sc.TRACE_KEEP_REASONS),
    (DROPPED, "rest"),
    (DROPPED, "overflow"),
)


class SpanIds(Protocol):
    """What is read of a span context (the SDK's `SpanContext`)."""

    @property
    def trace_id(self) -> int: ...
    @property
    def span_id(self) -> int: ...
    @property
    def is_remote(self) -> bool: ...
    @property
    def trace_flags(self) -> Flags: ...


class Flags(Protocol):
    @property
    def sampled(self) -> bool: ...


class SpanStatus(Protocol):
    @property
    def status_code(self) -> Enum: ...


class EndedSpan(Protocol):
    """What is read of an ended span (the SDK's `EndedSpan`)."""

    @property
    def context(self) -> SpanIds | None: ...
    @property
    def parent(self) -> SpanIds | None: ...
    @property
    def attributes(self) -> Mapping[str, Any] | None: ...
    @property
    def status(self) -> SpanStatus: ...


class Downstream(Protocol):
    """Where kept spans go: the batch processor."""

    def on_start(self, span: Any, parent_context: Any = None) -> None: ...
    def on_end(self, span: Any) -> None: ...
    def shutdown(self) -> None: ...
    def force_flush(self, timeout_millis: int = 30000) -> bool: ...


_SLO_MET = (sc.TG_SLO_TTFT_MET, sc.TG_SLO_TOTAL_MET, sc.TG_SLO_TPOT_MET)
_LOW_64 = (1 << 64) - 1


def keep_reason(root: EndedSpan, children: list[EndedSpan], ratio: float) -> str | None:
    """Why the trace whose local root is `root` should be exported, or None to drop it."""
    attributes: Mapping[str, Any] = root.attributes or {}
    status = attributes.get(sc.HTTP_RESPONSE_STATUS_CODE)
    failed = root.status.status_code.name == "ERROR" or sc.ERROR_TYPE in attributes
    if failed and isinstance(status, int) and status < 400:
        return "cut"  # the status was spent before the stream failed
    if failed or (isinstance(status, int) and status >= 400):
        return "error"
    route = attributes.get(sc.TG_ROUTE)
    if route == "hedge" or any((s.attributes or {}).get(sc.TG_ATTEMPT_HEDGE) for s in children):
        return "hedge"
    attempts = attributes.get(sc.TG_ATTEMPTS)
    if (route and route != "primary") or (isinstance(attempts, int) and attempts > 1):
        return "fallback"
    if any(attributes.get(name) is False for name in _SLO_MET):
        return "slo_miss"
    if attributes.get(sc.TG_SLOW) is True:
        return "slow"
    parent = root.parent
    if parent is not None and parent.is_remote and parent.trace_flags.sampled:
        return "sampled_parent"
    trace_id = root.context.trace_id if root.context is not None else 0
    # As TraceIdRatioBased: the low 64 bits of the id, which W3C asks to be random.
    if (trace_id & _LOW_64) < round(ratio * (1 << 64)):
        return "share"
    return None


class TailSampler:
    """Holds each trace's ended spans until its local root ends, then forwards the trace to
    `downstream` (the batch processor) or drops it. At most `max_traces` traces and `max_spans`
    spans are held: beyond either, the oldest held trace is dropped (`overflow`). `counts` has
    the traces decided per (decision, reason); it is read at scrape time."""

    def __init__(
        self,
        downstream: Downstream,
        *,
        ratio: float,
        max_traces: int = 4096,
        max_spans: int = 16384,
    ) -> None:
        self.downstream = downstream
        self.ratio = min(1.0, max(0.0, ratio))
        self.max_traces = max(1, max_traces)
        self.max_spans = max(1, max_spans)
        self.counts: dict[tuple[str, str], int] = dict.fromkeys(DECISIONS, 0)
        self._lock = threading.Lock()  # spans may end on any thread
        # Keyed by (trace id, local root's span id); oldest first.
        self._held: OrderedDict[tuple[int, int], list[EndedSpan]] = OrderedDict()
        self._spans = 0
        # Recent decisions, for a span that ends after its root did (bounded like `_held`).
        self._decided: OrderedDict[tuple[int, int], bool] = OrderedDict()

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        self.downstream.on_start(span, parent_context=parent_context)

    def on_end(self, span: EndedSpan) -> None:
        context = span.context
        if context is None:
            return
        parent = span.parent
        root = parent is None or parent.is_remote
        key = (context.trace_id, context.span_id if root or parent is None else parent.span_id)
        with self._lock:
            decided = self._decided.get(key)
            if decided is not None:  # a straggler: its trace was already decided
                forward = [span] if decided else []
            elif root:
                children = self._held.pop(key, [])
                self._spans -= len(children)
                reason = keep_reason(span, children, self.ratio)
                self.counts[(EXPORTED, reason) if reason else (DROPPED, "rest")] += 1
                self._remember(key, reason is not None)
                forward = [*children, span] if reason else []
            else:
                self._hold(key, span)
                forward = []
        for ended in forward:  # outside the lock: the batch processor takes its own
            self.downstream.on_end(ended)

    def _hold(self, key: tuple[int, int], span: EndedSpan) -> None:
        held = self._held.get(key)
        if held is None:
            while len(self._held) >= self.max_traces:
                self._evict_oldest()
            held = self._held[key] = []
        held.append(span)
        self._spans += 1
        while self._spans > self.max_spans:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        key, spans = self._held.popitem(last=False)
        self._spans -= len(spans)
        self.counts[(DROPPED, "overflow")] += 1
        self._remember(key, False)  # its later spans, root included, go too

    def _remember(self, key: tuple[int, int], exported: bool) -> None:
        self._decided[key] = exported
        if len(self._decided) > self.max_traces:
            self._decided.popitem(last=False)

    def held(self) -> tuple[int, int]:
        """(traces, spans) held now."""
        with self._lock:
            return len(self._held), self._spans

    def shutdown(self) -> None:
        """Drop what is still held (no root ended for it) and shut the batch processor down."""
        with self._lock:
            self._held.clear()
            self._spans = 0
        self.downstream.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.downstream.force_flush(timeout_millis)

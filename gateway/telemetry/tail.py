"""Tail-aware trace sampling: keep whole traces of the requests worth looking at.

Head sampling decides when a request arrives, before anyone knows whether it will fail, fall
back, hedge or run slow: exactly the requests a tail-latency gateway exists for. Here every
request records its spans, and the decision is made when the request ends, from how it ended.

Recording is cheap on purpose: a `TailTrace` keeps its spans as plain records (a name, ids,
times, an attribute dict) on the request itself, and only a kept trace becomes SDK spans,
handed to the batch processor. A dropped trace, most of them, costs a few small objects: no
SDK span, no lock, no attribute checks, no processor call.

Kept, by the first reason that applies: an error (`error`), a stream cut after a 200 (`cut`), a
hedge (`hedge`), any other route than `primary` or more than one attempt (`fallback`), a budget
missed (`slo_miss`), slower than the deployment's p99 (`slow`), a client `traceparent` with the
sampled flag (`sampled_parent`), else a fixed share of the rest chosen by the trace id (`share`),
so every replica that sees a trace decides alike. Everything else is dropped (`rest`).

A trace here is one request's part of it: a client may send many requests in one trace, and
each is decided on its own. An attempt that ends after its request did (a hedge's loser being
closed) follows the request's decision.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final, Protocol

import orjson
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from gateway.models import AttemptEnd
from gateway.telemetry import semconv as sc

EXPORTED: Final = "exported"
DROPPED: Final = "dropped"
# Every (decision, reason) pair the sampler counts: a fixed vocabulary for /metrics labels.
DECISIONS: Final = (*((EXPORTED, reason) for reason in sc.TRACE_KEEP_REASONS), (DROPPED, "rest"))

_SLO_MET = (sc.TG_SLO_TTFT_MET, sc.TG_SLO_TOTAL_MET, sc.TG_SLO_TPOT_MET)
_LOW_64 = (1 << 64) - 1
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_ERROR = Status(StatusCode.ERROR)
_UNSET = Status(StatusCode.UNSET)


def keep_reason(
    attributes: Mapping[str, Any],
    *,
    failed: bool,
    attempts: Iterable[Mapping[str, Any]],
    sampled_parent: bool,
    trace_id: int,
    ratio: float,
) -> str | None:
    """Why a request's trace should be exported, or None to drop it: `attributes` are its
    SERVER span's final ones, `failed` its error status, `attempts` its attempt spans'."""
    status = attributes.get(sc.HTTP_RESPONSE_STATUS_CODE)
    failed = failed or sc.ERROR_TYPE in attributes
    if failed and isinstance(status, int) and status < 400:
        return "cut"  # the status was spent before the stream failed
    if failed or (isinstance(status, int) and status >= 400):
        return "error"
    route = attributes.get(sc.TG_ROUTE)
    if route == "hedge" or any(a.get(sc.TG_ATTEMPT_HEDGE) for a in attempts):
        return "hedge"
    count = attributes.get(sc.TG_ATTEMPTS)
    if (route and route != "primary") or (isinstance(count, int) and count > 1):
        return "fallback"
    if any(attributes.get(name) is False for name in _SLO_MET):
        return "slo_miss"
    if attributes.get(sc.TG_SLOW) is True:
        return "slow"
    if sampled_parent:
        return "sampled_parent"
    # As TraceIdRatioBased: the low 64 bits of the id, which W3C asks to be random.
    if (trace_id & _LOW_64) < round(ratio * (1 << 64)):
        return "share"
    return None


class Downstream(Protocol):
    """Where kept spans go: the batch processor."""

    def on_end(self, span: ReadableSpan) -> None: ...


class TailSampler:
    """The decisions and where kept traces go. `counts` has the traces decided per (decision,
    reason); it is read at scrape time. Used from the event loop only."""

    def __init__(
        self,
        downstream: Downstream,
        *,
        ratio: float,
        resource: Resource | None = None,
        capture_content: bool = False,
    ) -> None:
        self.downstream = downstream
        self.ratio = min(1.0, max(0.0, ratio))
        self.resource = resource if resource is not None else Resource.get_empty()
        self.scope = InstrumentationScope("tailguard")
        self.capture_content = capture_content
        self.counts: dict[tuple[str, str], int] = dict.fromkeys(DECISIONS, 0)

    def request(
        self, name: str, *, parent: SpanContext | None, start_ns: int, attributes: Mapping[str, Any]
    ) -> TailTrace:
        return TailTrace(self, name, parent, start_ns, attributes)

    def export(self, trace: TailTrace, records: Sequence[Record]) -> None:
        parent = trace.parent
        root_context = trace.root.context(trace)
        for record in records:
            self.downstream.on_end(
                ReadableSpan(
                    record.name,
                    context=record.context(trace),
                    parent=parent if record is trace.root else root_context,
                    resource=self.resource,
                    attributes={k: v for k, v in record.attributes.items() if v is not None},
                    kind=record.kind,
                    status=_ERROR if record.failed else _UNSET,
                    start_time=record.start_ns,
                    end_time=record.end_ns,
                    instrumentation_scope=self.scope,
                )
            )


class Record:
    """A span not (yet) exported: what the SDK span would hold."""

    __slots__ = ("attributes", "end_ns", "failed", "kind", "name", "span_id", "start_ns")

    def __init__(self, name: str, kind: SpanKind, start_ns: int, attributes: dict[str, Any]):
        self.name = name
        self.kind = kind
        self.span_id = random.getrandbits(64) or 1
        self.start_ns = start_ns
        self.end_ns: int | None = None
        self.attributes = attributes
        self.failed = False

    def context(self, trace: TailTrace) -> SpanContext:
        state = trace.parent.trace_state if trace.parent is not None else None
        return SpanContext(trace.id, self.span_id, False, _SAMPLED, state)


class TailTrace:
    """One request's SERVER span and its attempts' CLIENT spans, recorded as `Record`s until
    the request ends and the sampler decides."""

    __slots__ = ("_attempts", "_kept", "_sampler", "id", "parent", "root")

    def __init__(
        self,
        sampler: TailSampler,
        name: str,
        parent: SpanContext | None,
        start_ns: int,
        attributes: Mapping[str, Any],
    ) -> None:
        self._sampler = sampler
        self.parent = parent if parent is not None and parent.is_valid else None
        self.id = self.parent.trace_id if self.parent is not None else random.getrandbits(128) or 1
        self.root = Record(name, SpanKind.SERVER, start_ns, dict(attributes))
        self._attempts: list[Record] = []
        self._kept: bool | None = None  # None until the request ends

    @property
    def trace_id(self) -> str:
        return format(self.id, "032x")

    def attempt(
        self, *, operation: str, model: str, provider: str, address: str | None, hedge: bool
    ) -> tuple[Record, str]:
        attributes = attempt_attributes(operation, model, provider, address, hedge)
        record = Record(f"{operation} {model}", SpanKind.CLIENT, time.time_ns(), attributes)
        self._attempts.append(record)
        # Recorded whatever is decided later: the upstream may sample its part on this flag.
        return record, f"00-{self.id:032x}-{record.span_id:016x}-01"

    def capture_prompt(self, span: Record, body: Mapping[str, Any]) -> None:
        if self._sampler.capture_content:
            text = prompt_text(body)
            if text is not None:
                span.attributes[sc.GEN_AI_INPUT_MESSAGES] = text

    def end_attempt(self, span: Record, end: AttemptEnd) -> None:
        span.attributes.update(ended_attempt_attributes(end))
        span.failed = bool(end.error_type)
        span.end_ns = time.time_ns()
        if self._kept:  # ended after its request: it follows the request's decision
            self._sampler.export(self, [span])

    def end(self, *, status: int, attributes: Mapping[str, Any], error_type: str | None) -> None:
        root, sampler = self.root, self._sampler
        root.attributes.update(attributes)
        root.attributes[sc.HTTP_RESPONSE_STATUS_CODE] = status
        if error_type:
            root.attributes[sc.ERROR_TYPE] = error_type
            root.failed = True
        root.end_ns = time.time_ns()
        parent = self.parent
        reason = keep_reason(
            root.attributes,
            failed=root.failed,
            attempts=(a.attributes for a in self._attempts),
            sampled_parent=parent is not None and parent.trace_flags.sampled,
            trace_id=self.id,
            ratio=sampler.ratio,
        )
        sampler.counts[(EXPORTED, reason) if reason else (DROPPED, "rest")] += 1
        self._kept = reason is not None
        if reason is not None:
            ended = [a for a in self._attempts if a.end_ns is not None]
            sampler.export(self, [*ended, root])
        self._attempts = []  # the ones still open hold their own records


# --- shared with the SDK-backed trace ----------------------------------------------------------

_MAX_CONTENT = 8192  # characters of a captured prompt
_MAX_REASONS = 16  # finish reasons recorded on an attempt span (one per choice)
_MAX_LABEL = 64  # characters of a finish reason


def attempt_attributes(
    operation: str, model: str, provider: str, address: str | None, hedge: bool
) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        sc.GEN_AI_OPERATION_NAME: operation,
        sc.GEN_AI_PROVIDER_NAME: provider,
        sc.GEN_AI_REQUEST_MODEL: model,
        sc.TG_ATTEMPT_HEDGE: hedge,
    }
    if address:
        attributes[sc.SERVER_ADDRESS] = address
    return attributes


def prompt_text(body: Mapping[str, Any]) -> str | None:
    messages = body.get("messages", body.get("prompt", body.get("input")))
    return None if messages is None else orjson.dumps(messages).decode()[:_MAX_CONTENT]


def ended_attempt_attributes(end: AttemptEnd) -> dict[str, Any]:
    """How an attempt ended and what the upstream reported (a count it did not report is left
    out; the cache counts are part of `input_tokens`)."""
    attributes: dict[str, Any] = {sc.TG_ATTEMPT_OUTCOME: end.outcome}
    usage = end.usage
    if end.ttft_s is not None:
        attributes[sc.TG_TTFT_MS] = round(end.ttft_s * 1000, 3)
    if usage is not None and usage.input_tokens is not None:
        attributes[sc.GEN_AI_USAGE_INPUT_TOKENS] = usage.input_tokens
    if end.output_tokens is not None:
        attributes[sc.GEN_AI_USAGE_OUTPUT_TOKENS] = end.output_tokens
    if usage is not None:
        if usage.cached_tokens is not None:
            attributes[sc.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] = usage.cached_tokens
        if usage.cache_write_tokens is not None:
            attributes[sc.GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS] = usage.cache_write_tokens
        if usage.upstream_latency_ms is not None:
            attributes[sc.TG_UPSTREAM_LATENCY_MS] = usage.upstream_latency_ms
    finish_reasons, response_model, error_type = (
        end.finish_reasons,
        end.response_model,
        end.error_type,
    )
    if finish_reasons:
        # The upstream's words: a few, each bounded (and a string, whatever it sent).
        attributes[sc.GEN_AI_RESPONSE_FINISH_REASONS] = [
            str(reason)[:_MAX_LABEL] for reason in finish_reasons[:_MAX_REASONS]
        ]
    if response_model:
        attributes[sc.GEN_AI_RESPONSE_MODEL] = response_model
    if error_type:
        attributes[sc.ERROR_TYPE] = error_type
    return attributes

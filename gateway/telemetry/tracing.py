"""OpenTelemetry traces: a SERVER span per client request and a CLIENT span per upstream attempt,
named and attributed per the GenAI semantic conventions (names in `gateway.telemetry.semconv`).

Configured from the standard `OTEL_*` environment variables and off unless an OTLP endpoint (or
`OTEL_TRACES_EXPORTER`) is set. Sampling is tail-aware unless `OTEL_TRACES_SAMPLER` is set: every
request is recorded and `TailSampler` keeps the traces worth keeping (see `gateway.telemetry.tail`);
with a head sampler, spans are the SDK's own (`HeadTrace`).
Spans are exported by a batch processor from its own thread with a bounded queue: an unreachable
collector costs dropped spans (counted), never a slower request.
Nothing a client sent is recorded except, with content capture explicitly enabled, the prompt.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any, Protocol
from urllib.parse import unquote

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace import sampling as samplers
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.models import AttemptEnd
from gateway.telemetry import semconv as sc
from gateway.telemetry.tail import (
    TailSampler,
    attempt_attributes,
    ended_attempt_attributes,
    prompt_text,
)

logger = logging.getLogger(__name__)
_PROPAGATOR = TraceContextTextMapPropagator()


class _CountingProcessor(BatchSpanProcessor):
    """A batch processor that counts the spans it had to drop because its queue was full."""

    def __init__(
        self,
        exporter: SpanExporter,
        *,
        max_queue_size: int,
        schedule_delay_millis: float,
        max_export_batch_size: int,
        export_timeout_millis: float,
    ) -> None:
        super().__init__(
            exporter,
            max_queue_size=max_queue_size,
            schedule_delay_millis=schedule_delay_millis,
            max_export_batch_size=max_export_batch_size,
            export_timeout_millis=export_timeout_millis,
        )
        self.max_queue_size = max_queue_size
        self.dropped = 0

    def on_end(self, span: ReadableSpan) -> None:
        queue = getattr(getattr(self, "_batch_processor", None), "_queue", None)
        if queue is not None and len(queue) >= self.max_queue_size:
            self.dropped += 1
        super().on_end(span)


class RequestTrace(Protocol):
    """The spans of one request: its SERVER span and a CLIENT span per upstream attempt."""

    @property
    def trace_id(self) -> str: ...

    def attempt(
        self, *, operation: str, model: str, provider: str, address: str | None, hedge: bool
    ) -> tuple[Any, str]:
        """Start a span for an upstream attempt; returns it and the `traceparent` to send
        upstream (this span as the parent: the upstream's spans nest under the attempt)."""
        ...

    def capture_prompt(self, span: Any, body: Mapping[str, Any]) -> None:
        """Record the prompt on an attempt span, only when content capture is enabled."""
        ...

    def end_attempt(self, span: Any, end: AttemptEnd) -> None:
        """End an attempt's span with how it ended (see `ended_attempt_attributes`)."""
        ...

    def end(self, *, status: int, attributes: Mapping[str, Any], error_type: str | None) -> None:
        """End the request's span with its final attributes."""
        ...


class Tracing:
    """The app's tracer, or nothing: when `provider` is None every method is a cheap no-op.
    With `tail`, requests are recorded and decided by the tail sampler; else by the SDK's
    (head) sampler."""

    def __init__(
        self,
        provider: TracerProvider | None = None,
        processor: _CountingProcessor | None = None,
        *,
        capture_content: bool = False,
        tail: TailSampler | None = None,
    ) -> None:
        self.provider = provider
        self._processor = processor
        self.tail = tail  # None: head sampling (or tracing off)
        self._tracer = provider.get_tracer("tailguard") if provider is not None else None
        self.capture_content = capture_content

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    @property
    def dropped(self) -> int:
        return self._processor.dropped if self._processor is not None else 0

    @property
    def decisions(self) -> Mapping[tuple[str, str], int]:
        """Traces the tail sampler decided, per (decision, reason); empty when it is off."""
        return dict(self.tail.counts) if self.tail is not None else {}

    def request(
        self,
        name: str,
        *,
        traceparent: str | None,
        arrived: float,
        attributes: Mapping[str, Any],
    ) -> RequestTrace | None:
        """A SERVER span for one client request, continuing the client's trace if it sent one.
        `arrived` is the request's `time.perf_counter()` arrival time."""
        if self._tracer is None:
            return None
        parent = _PROPAGATOR.extract({"traceparent": traceparent}) if traceparent else None
        start_ns = time.time_ns() - int((time.perf_counter() - arrived) * 1e9)
        if self.tail is not None:
            remote = trace.get_current_span(parent).get_span_context() if parent else None
            return self.tail.request(name, parent=remote, start_ns=start_ns, attributes=attributes)
        span = self._tracer.start_span(
            name,
            context=parent,
            kind=SpanKind.SERVER,
            attributes=dict(attributes),
            start_time=start_ns,
        )
        return HeadTrace(self, span)

    def shutdown(self) -> None:
        """Flush what is queued (bounded by the exporter's timeout) and stop the export thread."""
        if self.provider is not None:
            self.provider.shutdown()


class HeadTrace:
    """A request's spans as the SDK's own, sampled at the head."""

    __slots__ = ("_tracing", "span")

    def __init__(self, tracing: Tracing, span: Span) -> None:
        self._tracing = tracing
        self.span = span

    @property
    def trace_id(self) -> str:
        return format(self.span.get_span_context().trace_id, "032x")

    def attempt(
        self, *, operation: str, model: str, provider: str, address: str | None, hedge: bool
    ) -> tuple[Span, str]:
        tracer = self._tracing._tracer
        assert tracer is not None
        span = tracer.start_span(
            f"{operation} {model}",
            context=trace.set_span_in_context(self.span, otel_context.Context()),
            kind=SpanKind.CLIENT,
            attributes=attempt_attributes(operation, model, provider, address, hedge),
        )
        # W3C traceparent of this span, written directly: the propagator's context round trip
        # costs more than the span itself on this path.
        context = span.get_span_context()
        traceparent = (
            f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
            if context.is_valid
            else ""
        )
        return span, traceparent

    def capture_prompt(self, span: Span, body: Mapping[str, Any]) -> None:
        if self._tracing.capture_content:
            text = prompt_text(body)
            if text is not None:
                span.set_attribute(sc.GEN_AI_INPUT_MESSAGES, text)

    def end_attempt(self, span: Span, end: AttemptEnd) -> None:
        if end.error_type:
            span.set_status(Status(StatusCode.ERROR))
        # One set_attributes call: each set_attribute takes the span's lock.
        span.set_attributes(ended_attempt_attributes(end))
        span.end()

    def end(self, *, status: int, attributes: Mapping[str, Any], error_type: str | None) -> None:
        span = self.span
        final = {**attributes, sc.HTTP_RESPONSE_STATUS_CODE: status}
        if error_type:
            final[sc.ERROR_TYPE] = error_type
            span.set_status(Status(StatusCode.ERROR))
        span.set_attributes(final)
        span.end()


# --- configuration from the environment -----------------------------------------------------------


def tracing_from_env(environ: Mapping[str, str]) -> Tracing:
    """Tracing as the standard `OTEL_*` variables describe it; disabled unless an OTLP endpoint
    or `OTEL_TRACES_EXPORTER=otlp|console` is set, or when `OTEL_SDK_DISABLED=true`. Without
    `OTEL_TRACES_SAMPLER`, sampling is tail-aware, keeping `TAILGUARD_TRACES_TAIL_RATIO` (default
    0.05) of the traces no rule keeps."""
    capture = _truthy(environ.get("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"))
    if _truthy(environ.get("OTEL_SDK_DISABLED")):
        return Tracing(capture_content=capture)
    exporter_name = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if exporter_name == "none" or (not endpoint and exporter_name not in ("otlp", "console")):
        return Tracing(capture_content=capture)
    exporter = _exporter(environ, exporter_name)
    resource = _resource(environ)
    # An explicit head sampler is the operator's choice; otherwise record all, decide at the end.
    tail_on = not environ.get("OTEL_TRACES_SAMPLER", "").strip()
    sampler = samplers.ALWAYS_ON if tail_on else _sampler(environ)
    provider = TracerProvider(resource=resource, sampler=sampler)
    queue = max(1, int(_number(environ.get("OTEL_BSP_MAX_QUEUE_SIZE"), 2048)))
    processor = _CountingProcessor(
        exporter,
        max_queue_size=queue,
        schedule_delay_millis=max(1.0, _number(environ.get("OTEL_BSP_SCHEDULE_DELAY"), 5000)),
        # The SDK refuses a batch larger than the queue.
        max_export_batch_size=min(
            queue, max(1, int(_number(environ.get("OTEL_BSP_MAX_EXPORT_BATCH_SIZE"), 512)))
        ),
        export_timeout_millis=_number(environ.get("OTEL_BSP_EXPORT_TIMEOUT"), 30_000),
    )
    tail = None
    if tail_on:
        ratio = _tail_ratio(environ.get("TAILGUARD_TRACES_TAIL_RATIO"))
        tail = TailSampler(processor, ratio=ratio, resource=resource, capture_content=capture)
    provider.add_span_processor(processor)  # the provider's shutdown flushes it
    # The batch processor logs one warning per dropped span; drops are counted in /metrics.
    logging.getLogger("opentelemetry.sdk._shared_internal").setLevel(logging.ERROR)
    return Tracing(provider, processor, capture_content=capture, tail=tail)


def _exporter(environ: Mapping[str, str], name: str) -> SpanExporter:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    protocol = (
        environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    headers = _headers(
        environ.get("OTEL_EXPORTER_OTLP_TRACES_HEADERS")
        or environ.get("OTEL_EXPORTER_OTLP_HEADERS")
        or ""
    )
    # Milliseconds, as the specification says.
    timeout = (
        _number(
            environ.get("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT")
            or environ.get("OTEL_EXPORTER_OTLP_TIMEOUT"),
            10_000,
        )
        / 1000
    )
    signal_endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    base = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        target = signal_endpoint or base or "http://localhost:4317"
        insecure = target.startswith("http://") or _truthy(
            environ.get("OTEL_EXPORTER_OTLP_INSECURE")
        )
        return GrpcExporter(
            endpoint=target, headers=headers, timeout=timeout, insecure=insecure or None
        )
    if protocol != "http/protobuf":
        raise ValueError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL: {protocol!r} is not supported "
            "(use http/protobuf or grpc)"
        )
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    # Per the spec, only the generic endpoint gets the signal path appended.
    url = signal_endpoint or (base or "http://localhost:4318").rstrip("/") + "/v1/traces"
    return HttpExporter(endpoint=url, headers=headers, timeout=timeout)


def _headers(text: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        if sep and name.strip():
            found[unquote(name.strip()).lower()] = unquote(value.strip())
    return found


def _resource(environ: Mapping[str, str]) -> Resource:
    attributes: dict[str, Any] = {"service.name": "tailguard"}
    for part in environ.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","):
        name, sep, value = part.partition("=")
        if sep and name.strip():
            attributes[unquote(name.strip())] = unquote(value.strip())
    if environ.get("OTEL_SERVICE_NAME"):
        attributes["service.name"] = environ["OTEL_SERVICE_NAME"]
    return Resource.create(attributes)


def _sampler(environ: Mapping[str, str]) -> samplers.Sampler:
    name = environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower()
    try:
        ratio = float(environ.get("OTEL_TRACES_SAMPLER_ARG", "1.0") or 1.0)
    except ValueError:
        ratio = 1.0
    ratio = min(1.0, max(0.0, ratio))
    choices: dict[str, samplers.Sampler] = {
        "always_on": samplers.ALWAYS_ON,
        "always_off": samplers.ALWAYS_OFF,
        "traceidratio": samplers.TraceIdRatioBased(ratio),
        "parentbased_always_on": samplers.ParentBased(samplers.ALWAYS_ON),
        "parentbased_always_off": samplers.ParentBased(samplers.ALWAYS_OFF),
        "parentbased_traceidratio": samplers.ParentBased(samplers.TraceIdRatioBased(ratio)),
    }
    if name not in choices:
        raise ValueError(f"OTEL_TRACES_SAMPLER: {name!r} is not one of {', '.join(choices)}")
    return choices[name]


def _tail_ratio(value: str | None) -> float:
    """The share of unremarkable traces kept: a number from 0 to 1, default 0.05."""
    if value is None or not value.strip():
        return 0.05
    try:
        ratio = float(value)
    except ValueError:
        ratio = -1.0
    if not 0.0 <= ratio <= 1.0:  # NaN fails this too
        raise ValueError(f"TAILGUARD_TRACES_TAIL_RATIO: {value[:40]!r} is not a number from 0 to 1")
    return ratio


def _number(value: str | None, default: float) -> float:
    try:
        return float(value) if value else default
    except ValueError:
        logger.warning("ignoring a malformed OTEL_* number: %r", value[:40] if value else value)
        return default


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")

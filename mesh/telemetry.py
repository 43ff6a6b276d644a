"""Metrics and traces for every pdmesh service.

Metrics: ``ServiceMetrics`` makes Prometheus metrics named ``pdmesh_<service>_<what>_<unit>`` on a
per-process registry; ``start_metrics_server`` serves ``/metrics`` on its own port and
``metrics_handler`` serves it from an existing aiohttp app (the router's HTTP server).

Traces: ``setup_tracing`` installs an OpenTelemetry tracer provider exporting over OTLP/gRPC, into
memory (tests) and/or as JSON lines to a file that several processes append to (tests across
processes). ``inject_metadata`` / ``extract_context`` carry W3C trace context over gRPC metadata, so
one request is one trace across router, prefill and decode. Tracing is off unless an exporter is
asked for; context still passes through a service that exports nothing.

This module reads no environment variables: callers map ``PDMESH_OTLP_ENDPOINT`` and
``PDMESH_TRACE_FILE`` (their config) onto ``setup_tracing``'s arguments.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.exposition import choose_encoder

# --- metrics ----------------------------------------------------------------------------------------

_NAME_PART = re.compile(r"^[a-z](?:[a-z0-9_]*[a-z0-9])?$")


def metric_name(service: str, what: str, unit: str) -> str:
    """``pdmesh_<service>_<what>_<unit>``; each part lower snake case.

    Counters use their unit too (``tokens``, ``bytes``), or ``total`` for plain counts; Prometheus
    adds ``_total`` to a counter's samples either way (``pdmesh_router_requests_total``).
    """
    for label, part in (("service", service), ("what", what), ("unit", unit)):
        if not _NAME_PART.match(part):
            raise ValueError(f"metric {label} {part!r} must be lower snake case ([a-z][a-z0-9_]*)")
    return f"pdmesh_{service}_{what}_{unit}"


def new_registry(process_metrics: bool = True) -> CollectorRegistry:
    """A registry for one process, with the process collector (CPU, memory, fds) when asked."""
    registry = CollectorRegistry()
    if process_metrics:
        ProcessCollector(registry=registry)
    return registry


class ServiceMetrics:
    """One service's metric factory: every metric it makes is named by ``metric_name`` and lives on
    ``registry``. Asking twice for the same metric returns the same object."""

    def __init__(self, service: str, registry: CollectorRegistry | None = None) -> None:
        metric_name(service, "x", "x")  # validates the service part
        self.service = service
        self.registry = registry if registry is not None else new_registry()
        self._made: dict[str, Any] = {}

    def _make(
        self, cls: type, what: str, unit: str, description: str, labelnames: Sequence[str], **kwargs: Any
    ) -> Any:
        name = metric_name(self.service, what, unit)
        existing = self._made.get(name)
        if existing is not None:
            if not isinstance(existing, cls):
                raise ValueError(f"metric {name} already exists as a {type(existing).__name__}")
            return existing
        metric = cls(name, description, labelnames=tuple(labelnames), registry=self.registry, **kwargs)
        self._made[name] = metric
        return metric

    def counter(self, what: str, unit: str, description: str, labelnames: Sequence[str] = ()) -> Counter:
        return self._make(Counter, what, unit, description, labelnames)

    def gauge(self, what: str, unit: str, description: str, labelnames: Sequence[str] = ()) -> Gauge:
        return self._make(Gauge, what, unit, description, labelnames)

    def histogram(
        self,
        what: str,
        unit: str,
        description: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] | None = None,
    ) -> Histogram:
        kwargs = {"buckets": tuple(buckets)} if buckets is not None else {}
        return self._make(Histogram, what, unit, description, labelnames, **kwargs)


def metrics_handler(registry: CollectorRegistry) -> Callable[[web.Request], Awaitable[web.Response]]:
    """An aiohttp handler serving ``registry`` in the format the scraper asks for (text or OpenMetrics)."""

    async def handle(request: web.Request) -> web.Response:
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(body=encoder(registry), headers={"Content-Type": content_type})

    return handle


_metrics_runners: dict[int, web.AppRunner] = {}


async def start_metrics_server(registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0) -> int:
    """Serve ``GET /metrics`` on ``host:port`` (``port=0``: a free one); return the bound port."""
    app = web.Application()
    app.router.add_get("/metrics", metrics_handler(registry))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as exc:
        await runner.cleanup()
        raise OSError(exc.errno, f"cannot serve metrics on {host}:{port}: {exc.strerror}") from exc
    bound = runner.addresses[0][1]
    _metrics_runners[bound] = runner
    return bound


async def stop_metrics_server(port: int) -> None:
    """Stop the metrics server ``start_metrics_server`` started on ``port``."""
    runner = _metrics_runners.pop(port, None)
    if runner is not None:
        await runner.cleanup()


# --- tracing ----------------------------------------------------------------------------------------

_PROPAGATOR = TraceContextTextMapPropagator()
_provider: TracerProvider | None = None


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """A finished span as one flat JSON-able record (the JSON-lines format)."""
    ctx = span.get_span_context()
    return {
        "trace_id": format(ctx.trace_id, "032x"),
        "span_id": format(ctx.span_id, "016x"),
        "parent_id": format(span.parent.span_id, "016x") if span.parent is not None else None,
        "name": span.name,
        "service": span.resource.attributes.get(SERVICE_NAME),
        "kind": span.kind.name,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
    }


class JsonlSpanExporter(SpanExporter):
    """Appends each finished span as one JSON line; several processes may share the file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        data = "".join(json.dumps(span_record(s), default=str) + "\n" for s in spans).encode()
        # One O_APPEND write per batch keeps lines from different processes whole.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def read_spans_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The span records a ``JsonlSpanExporter`` wrote (empty if the file does not exist yet)."""
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


@dataclass
class Tracing:
    """What ``setup_tracing`` installed. ``provider`` is None when tracing is off."""

    service_name: str
    provider: TracerProvider | None
    memory: InMemorySpanExporter | None = None

    def finished_spans(self) -> list[ReadableSpan]:
        """Spans the in-memory exporter holds (``in_memory=True`` only)."""
        if self.memory is None:
            raise ValueError("setup_tracing(..., in_memory=True) keeps spans in memory; this setup did not")
        return list(self.memory.get_finished_spans())

    def shutdown(self) -> None:
        """Flush and stop the exporters."""
        if self.provider is not None:
            self.provider.shutdown()


def setup_tracing(
    service_name: str,
    otlp_endpoint: str | None = None,
    in_memory: bool = False,
    jsonl_path: str | os.PathLike[str] | None = None,
) -> Tracing:
    """Install tracing for this process as ``service_name``; off when no exporter is asked for.

    ``otlp_endpoint`` (``http://host:4317``; plain ``host:port`` is taken as insecure) exports in
    batches over OTLP/gRPC. ``in_memory`` and ``jsonl_path`` export each span as it ends (tests).
    ``get_tracer`` follows the latest call; the OpenTelemetry global provider is the first one set.
    """
    global _provider
    if otlp_endpoint is None and not in_memory and jsonl_path is None:
        return Tracing(service_name, None)
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
    memory = None
    if otlp_endpoint is not None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        insecure = not otlp_endpoint.startswith("https://")
        provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint, insecure=insecure))
        )
    if in_memory:
        memory = InMemorySpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(memory))
    if jsonl_path is not None:
        provider.add_span_processor(SimpleSpanProcessor(JsonlSpanExporter(jsonl_path)))
    _provider = provider
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        trace.set_tracer_provider(provider)
    return Tracing(service_name, provider, memory)


def get_tracer(name: str) -> trace.Tracer:
    """A tracer from the provider ``setup_tracing`` installed last (a no-op one when tracing is off)."""
    if _provider is not None:
        return _provider.get_tracer(name)
    return trace.get_tracer(name)


def inject_metadata(ctx: otel_context.Context | None = None) -> list[tuple[str, str]]:
    """gRPC metadata carrying the current (or given) trace context: ``traceparent``/``tracestate``."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=ctx)
    return list(carrier.items())


def extract_context(invocation_metadata: Iterable[tuple[str, Any]] | None) -> otel_context.Context:
    """The caller's trace context from a servicer's ``context.invocation_metadata()``.

    Pass it as ``tracer.start_as_current_span(name, context=ctx)``; with no trace context in the
    metadata the span starts a new trace.
    """
    carrier = {key: value for key, value in (invocation_metadata or ()) if isinstance(value, str)}
    return _PROPAGATOR.extract(carrier)


@contextmanager
def server_span(
    name: str,
    invocation_metadata: Iterable[tuple[str, Any]] | None,
    attributes: dict[str, Any] | None = None,
    tracer: trace.Tracer | None = None,
) -> Iterator[trace.Span]:
    """A SERVER span for one RPC, child of the caller's span: ``with server_span("Worker/Prefill",
    context.invocation_metadata()) as span:``."""
    tracer = tracer or get_tracer("pdmesh")
    with tracer.start_as_current_span(
        name, context=extract_context(invocation_metadata), kind=trace.SpanKind.SERVER, attributes=attributes
    ) as span:
        yield span

"""Traces as OpenTelemetry spans (Triton's ``opentelemetry`` trace mode), exported over
OTLP/HTTP by the SDK's batch span processor.

The spans are Triton's: a request that came through a frontend gets a top-level
``InferRequest`` span (its HTTP_* / GRPC_* stamps as events); under it, one span per model
(named after it, with the REQUEST_START ... REQUEST_END stamps as events and Triton's
``triton.*`` attributes), and under that a ``compute`` span with the COMPUTE_* events. An
ensemble's steps and a BLS call made with ``trace=request.trace()`` get their model span
under the caller's. A W3C ``traceparent`` sent by the client makes the top-level span its
child, and such a request is traced whatever the rate and count, as in Triton.

OpenTelemetry wants wall-clock times; the stamps are ``time.monotonic_ns``, so each trace
converts them with the clocks' offset taken when it began.

Needs ``opentelemetry-sdk`` and ``opentelemetry-exporter-otlp-proto-http``
(``pip install kiln-serve[otel]``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kiln.core.trace import Trace

DEFAULT_URL = "http://localhost:4318/v1/traces"
#: OTLP's transports: Triton's (HTTP, the default) and gRPC (vLLM's default)
PROTOCOLS = ("http/protobuf", "grpc")
#: Longest wait for one export (and for the last one, as the server stops)
EXPORT_TIMEOUT_S = 5
_COMPUTE = ("COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END")


class OtelUnavailable(RuntimeError):
    """The OpenTelemetry packages are not installed."""


@dataclass(slots=True)
class OtelOptions:
    """``--trace-config opentelemetry,...`` (Triton's names; batch span processor settings
    default to Triton's)."""

    url: str = DEFAULT_URL
    protocol: str = "http/protobuf"
    resource: dict[str, str] = field(
        default_factory=lambda: {"service.name": "kiln"}
    )  # fmt: skip
    bsp_max_queue_size: int = 2048
    bsp_schedule_delay: int = 5000  # ms
    bsp_max_export_batch_size: int = 512

    @staticmethod
    def endpoint(url: str) -> str:
        """Triton takes ``host:port[/path]``: a scheme and ``/v1/traces`` are added when
        missing."""
        if "://" not in url:
            url = "http://" + url
        scheme, rest = url.split("://", 1)
        if "/" not in rest:
            rest += "/v1/traces"
        return f"{scheme}://{rest}"


def _exporter(options: OtelOptions) -> tuple[str, Any]:
    """(the collector's URL, the OTLP span exporter of ``options.protocol``); each export
    bounded, so that a collector that is down cannot hold a stopping server for the SDK's
    default 30 s."""
    try:
        if options.protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GrpcExporter,
            )

            # host:port, as vLLM takes it; plaintext unless the URL says https
            url = options.url if "://" in options.url else "http://" + options.url
            secure = url.startswith("https://")
            return url, GrpcExporter(endpoint=url, insecure=not secure, timeout=EXPORT_TIMEOUT_S)
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        raise OtelUnavailable(
            f"OpenTelemetry trace mode needs OTLP's {options.protocol} exporter ({exc.name} "
            "is missing): pip install 'kiln-serve[otel]'"
        ) from None
    url = OtelOptions.endpoint(options.url)
    return url, OTLPSpanExporter(endpoint=url, timeout=EXPORT_TIMEOUT_S)


@dataclass(slots=True)
class Spans:
    """One trace's open spans."""

    offset: int  # wall-clock ns - monotonic ns when the trace began
    model: Any
    root: Any = None  # the InferRequest span of a frontend's request


class OtelSink:
    """Where a tracer in ``opentelemetry`` mode sends its traces."""

    def __init__(self, options: OtelOptions) -> None:
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace import SpanKind, set_span_in_context
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
        except ImportError as exc:
            raise OtelUnavailable(
                f"OpenTelemetry trace mode needs the OpenTelemetry SDK ({exc.name} is "
                "missing): pip install 'kiln-serve[otel]'"
            ) from None
        self.url, exporter = _exporter(options)
        self.provider = TracerProvider(resource=Resource.create(dict(options.resource)))
        self.provider.add_span_processor(
            BatchSpanProcessor(
                exporter,
                max_queue_size=options.bsp_max_queue_size,
                schedule_delay_millis=options.bsp_schedule_delay,
                max_export_batch_size=options.bsp_max_export_batch_size,
                export_timeout_millis=EXPORT_TIMEOUT_S * 1000,
            )
        )
        self.tracer = self.provider.get_tracer("kiln")
        self._in_context = set_span_in_context
        self._server_kind = SpanKind.SERVER
        self._propagator = TraceContextTextMapPropagator()

    def remote(self, carrier: dict[str, str]) -> Any:
        """The client's context from its W3C ``traceparent`` / ``tracestate``, or None."""
        if "traceparent" not in carrier:
            return None
        from opentelemetry.trace import get_current_span

        context = self._propagator.extract(carrier)
        return context if get_current_span(context).get_span_context().is_valid else None

    def start(self, trace: Trace, parent: Trace | None, root_start_ns: int, remote: Any) -> None:
        """Open the trace's spans as it begins (a child's parent must exist first):
        under ``parent``'s model span, or under a new InferRequest span starting at
        ``root_start_ns`` (a frontend's request; 0: none) below the client's ``remote``
        context."""
        offset = time.time_ns() - time.monotonic_ns()
        root = None
        if parent is not None and isinstance(parent.otel, Spans):
            context = self._in_context(parent.otel.model)
        else:
            context = remote
            if root_start_ns:
                root = self.tracer.start_span(
                    "InferRequest", context=context, kind=self._server_kind,
                    start_time=root_start_ns + offset,
                )  # fmt: skip
                context = self._in_context(root)
        received = trace.stamps[0][1] if trace.stamps else time.monotonic_ns()
        attributes: dict[str, Any] = {
            "triton.model_name": trace.model_name,
            "triton.model_version": int(trace.model_version)
            if trace.model_version.isdigit()
            else -1,
            "triton.trace_id": trace.id,
            "triton.trace_parent_id": trace.parent_id,
        }
        if trace.request_id:
            attributes["triton.request_id"] = trace.request_id
        model = self.tracer.start_span(
            trace.model_name, context=context, start_time=received + offset,
            attributes=attributes,
        )  # fmt: skip
        trace.otel = Spans(offset, model, root)
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=self._in_context(model))
        trace.context = json.dumps(carrier)  # a Python model's request.trace().get_context()

    def add(self, trace: Trace) -> None:
        """The trace is over: its stamps become events, and its spans end."""
        spans = trace.otel
        if not isinstance(spans, Spans):
            return
        off = spans.offset
        stamps = sorted(trace.stamps, key=lambda s: s[1])
        by_name = dict(stamps)
        for name, ns in stamps:
            if name.startswith(("HTTP_", "GRPC_")):
                if spans.root is not None:
                    spans.root.add_event(name, timestamp=ns + off)
            elif name not in _COMPUTE:
                spans.model.add_event(name, timestamp=ns + off)
        if "COMPUTE_START" in by_name:
            compute = self.tracer.start_span(
                "compute", context=self._in_context(spans.model),
                start_time=by_name["COMPUTE_START"] + off,
            )  # fmt: skip
            for name in _COMPUTE:
                if name in by_name:
                    compute.add_event(name, timestamp=by_name[name] + off)
            compute.end(end_time=by_name.get("COMPUTE_END", by_name["COMPUTE_START"]) + off)
        if trace.attributes:
            spans.model.set_attributes(trace.attributes)
        last = stamps[-1][1] if stamps else time.monotonic_ns()
        spans.model.end(end_time=by_name.get("REQUEST_END", last) + off)
        if spans.root is not None:
            spans.root.end(end_time=last + off)

    def close(self) -> None:
        """Export what is queued (the server stops)."""
        self.provider.shutdown()

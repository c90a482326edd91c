"""OpenTelemetry traces: one span per request, named and attributed by the gen_ai semantic
conventions, with child spans for queue, prefill (each prompt chunk an event) and decode.

Switched on by the standard environment variables: ``OTEL_TRACES_EXPORTER=otlp`` or an
``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT`` (the OTLP/HTTP exporter reads the rest: headers,
timeout, ``OTEL_SERVICE_NAME``...). An incoming W3C ``traceparent`` header makes the request
span a child of the caller's trace. Without tracing the server uses ``NoTracing``, whose spans
do nothing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from opentelemetry import propagate
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context

from kvgate.engine.request import Request
from kvgate.engine.stats import RequestMetrics

#: gen_ai.operation.name of each endpoint.
CHAT, TEXT_COMPLETION = "chat", "text_completion"


def tracer_provider_from_env(environ: Mapping[str, str] = os.environ) -> TracerProvider | None:
    """A provider exporting over OTLP/HTTP when the OTEL_* variables ask for traces."""
    exporter = environ.get("OTEL_TRACES_EXPORTER", "")
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if exporter == "none" or environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return None
    if "otlp" not in exporter.split(",") and not endpoint:
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    service = environ.get("OTEL_SERVICE_NAME", "kvgate")
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider


class RequestSpan(Protocol):
    def finish(
        self,
        metrics: Sequence[RequestMetrics | None],
        *,
        response_id: str,
        finish_reasons: Sequence[str | None],
        input_tokens: int,
        output_tokens: int,
        cached_tokens: int,
        error: str | None = None,
    ) -> None: ...


class _NoSpan:
    def finish(self, *args: Any, **kwargs: Any) -> None:
        pass


class NoTracing:
    def start(self, *args: Any, **kwargs: Any) -> RequestSpan:
        return _NoSpan()


class Tracing:
    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("kvgate")

    def start(
        self,
        headers: Mapping[str, str],
        *,
        operation: str,
        model: str,
        tenant: str,
        request_id: str,
        requests: Sequence[Request],
        model_version: str | None = None,
    ) -> RequestSpan:
        parent = propagate.extract(dict(headers))
        p = requests[0].params
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": "kvgate",
            "gen_ai.request.model": model,
            "gen_ai.request.max_tokens": p.max_tokens,
            "gen_ai.request.temperature": p.temperature,
            "gen_ai.request.top_p": p.top_p,
            "gen_ai.request.frequency_penalty": p.frequency_penalty,
            "gen_ai.request.presence_penalty": p.presence_penalty,
            "gen_ai.request.choice.count": len(requests),
            "kvgate.tenant": tenant,
            "kvgate.request_id": request_id,
        }
        if model_version is not None:
            attributes["kvgate.model_version"] = model_version
        if p.top_k > 0:
            attributes["gen_ai.request.top_k"] = p.top_k
        if p.seed is not None:
            attributes["gen_ai.request.seed"] = p.seed
        if p.stop:
            attributes["gen_ai.request.stop_sequences"] = list(p.stop)
        # The whole tree is stamped from time.monotonic() through one offset taken here, so
        # the children nest inside the request span exactly: the wall clock a KVM guest's NTP
        # slews can move by milliseconds between this instant and finish(). The span starts
        # at the first choice's arrival (the requests are built before the span).
        to_ns = _wall_clock_ns()
        start = min([time.monotonic(), *(r.arrival_time for r in requests)])
        span = self.tracer.start_span(
            f"{operation} {model}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes=attributes,
            start_time=to_ns(start),
        )
        return _Span(self.tracer, span, to_ns)


class _Span:
    def __init__(self, tracer: Any, span: Span, to_ns: Callable[[float], int]) -> None:
        self.tracer = tracer
        self.span = span
        self.to_ns = to_ns
        self.done = False

    def finish(
        self,
        metrics: Sequence[RequestMetrics | None],
        *,
        response_id: str,
        finish_reasons: Sequence[str | None],
        input_tokens: int,
        output_tokens: int,
        cached_tokens: int,
        error: str | None = None,
    ) -> None:
        if self.done:
            return
        self.done = True
        span = self.span
        span.set_attributes(
            {
                "gen_ai.response.id": response_id,
                "gen_ai.response.finish_reasons": [r or "" for r in finish_reasons],
                "gen_ai.usage.input_tokens": input_tokens,
                "gen_ai.usage.output_tokens": output_tokens,
                "kvgate.cached_tokens": cached_tokens,
            }
        )
        context = set_span_in_context(span)
        for i, m in enumerate(metrics):
            if m is not None:
                self._phases(context, i, m)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=self.to_ns(time.monotonic()))

    def _phases(self, context: Any, choice: int, m: RequestMetrics) -> None:
        """queue / prefill / decode spans from one choice's timeline."""
        to_ns = self.to_ns
        end = m.finished_time if m.finished_time is not None else time.monotonic()
        scheduled, first_token = m.first_scheduled_time, m.first_token_time
        attrs = {"kvgate.choice": choice}
        phases = [("queue", m.arrival_time, scheduled if scheduled is not None else end)]
        if scheduled is not None:
            phases.append(("prefill", scheduled, first_token if first_token is not None else end))
        if first_token is not None:
            phases.append(("decode", first_token, end))
        for name, start, stop in phases:
            child = self.tracer.start_span(
                name, context=context, start_time=to_ns(start), attributes=attrs
            )
            if name == "prefill":
                for at, tokens in m.prefill_chunks:
                    child.add_event("chunk", {"kvgate.tokens": tokens}, timestamp=to_ns(at))
                child.set_attribute("kvgate.preemptions", m.num_preemptions)
            if name == "decode":
                child.set_attribute("kvgate.peak_kv_blocks", m.peak_kv_blocks)
            child.end(end_time=to_ns(stop))


def _wall_clock_ns() -> Callable[[float], int]:
    """time.monotonic() instants -> wall-clock nanoseconds (what spans are stamped with)."""
    offset = time.time_ns() - int(time.monotonic() * 1e9)
    return lambda t: int(t * 1e9) + offset

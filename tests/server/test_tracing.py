"""Traces: the span tree and gen_ai attributes of one request, exported in memory; the
caller's traceparent is the parent; the OTEL_* switch."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from kvgate.launch.server import engine_loader
from kvgate.server.app import build_app
from kvgate.server.config import ServerConfig
from kvgate.server.tracing import tracer_provider_from_env
from tests.server.conftest import _free_port, tiny_engine_config

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def traced(tiny_llama_dir: Path) -> Iterator[tuple[InMemorySpanExporter, httpx.Client]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    config = tiny_engine_config(tiny_llama_dir, max_num_batched_tokens=16)  # chunked prefill
    app = build_app(
        ServerConfig(served_model_name="tiny"), engine_loader(config, 8), tracer_provider=provider
    )
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    deadline = time.monotonic() + 30
    while True:
        try:
            if http.get("/health").status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.05)
    yield exporter, http
    http.close()
    server.should_exit = True
    thread.join(10)


def test_request_span_tree(traced: tuple[InMemorySpanExporter, httpx.Client]) -> None:
    exporter, http = traced
    exporter.clear()
    r = http.post(
        "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "tell me a long story " * 3}],
            "max_tokens": 6,
            "temperature": 0,
            "seed": 3,
            "ignore_eos": True,
        },
        headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
    )
    assert r.status_code == 200
    spans = {s.name: s for s in exporter.get_finished_spans()}
    root = spans["chat tiny"]
    assert root.kind == SpanKind.SERVER
    # The caller's trace continues: same trace id, its span as our parent.
    assert format(root.context.trace_id, "032x") == TRACE_ID
    assert root.parent is not None and format(root.parent.span_id, "016x") == PARENT_ID
    attrs = dict(root.attributes or {})
    usage = r.json()["usage"]
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.model"] == "tiny"
    assert attrs["gen_ai.request.max_tokens"] == 6 and attrs["gen_ai.request.seed"] == 3
    assert attrs["gen_ai.response.id"] == r.json()["id"]
    assert tuple(attrs["gen_ai.response.finish_reasons"]) == ("length",)
    assert attrs["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attrs["gen_ai.usage.output_tokens"] == 6
    assert attrs["kvgate.tenant"] == "default"
    for phase in ("queue", "prefill", "decode"):
        child = spans[phase]
        assert child.parent is not None and child.parent.span_id == root.context.span_id
        assert child.start_time is not None and child.end_time is not None
        assert root.start_time is not None and root.end_time is not None
        assert root.start_time <= child.start_time  # one clock for the whole tree
        assert child.end_time <= root.end_time
    assert spans["queue"].end_time == spans["prefill"].start_time
    assert spans["prefill"].end_time == spans["decode"].start_time
    # The prompt is longer than the 16-token budget: one event per prefill chunk.
    chunks = [e for e in spans["prefill"].events if e.name == "chunk"]
    assert len(chunks) == -(-usage["prompt_tokens"] // 16)
    assert sum(dict(e.attributes or {})["kvgate.tokens"] for e in chunks) == usage["prompt_tokens"]


def test_streamed_request_is_traced_when_it_ends(
    traced: tuple[InMemorySpanExporter, httpx.Client],
) -> None:
    exporter, http = traced
    exporter.clear()
    with http.stream(
        "POST", "/v1/completions", json={"prompt": "abc", "max_tokens": 4, "stream": True}
    ) as r:
        body = r.read()
    assert body.endswith(b"data: [DONE]\n\n")
    # The span ends when the response closes, just after the client has read the last byte.
    deadline = time.monotonic() + 5
    while len(exporter.get_finished_spans()) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    names = sorted(s.name for s in exporter.get_finished_spans())
    assert names == ["decode", "prefill", "queue", "text_completion tiny"]


def test_the_otel_environment_switch() -> None:
    assert tracer_provider_from_env({}) is None
    assert tracer_provider_from_env({"OTEL_TRACES_EXPORTER": "none"}) is None
    on = tracer_provider_from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    assert isinstance(on, TracerProvider)
    on.shutdown()
    off = tracer_provider_from_env(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318", "OTEL_SDK_DISABLED": "true"}
    )
    assert off is None

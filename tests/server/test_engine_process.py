"""The server with its engine in a process of its own (``--engine-process on``): the engine
process killed -9 mid-stream ends the stream with an error event, ``/health`` says 503
while a fresh engine loads, and the server serves again without a restart of its own.

(The rest of the server suite runs this way too when ``KVGATE_ENGINE_PROCESS=on``.)"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvgate.engine.core_client import EngineClient
from kvgate.server.config import ServerConfig
from tests.conftest import tiny_engine_config
from tests.server.conftest import MODEL, LiveServer, scrape_metrics, start_server

#: Outside the fast tier (scripts/test.sh --fast): engines in processes of their own.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def split(tiny_llama_dir: Path) -> Iterator[LiveServer]:
    live = start_server(
        tiny_engine_config(tiny_llama_dir),
        ServerConfig(served_model_name=MODEL, engine_process=True),
    )
    yield live
    live.stop()


def _client(live: LiveServer) -> EngineClient:
    serving = live.state.serving
    assert serving is not None and isinstance(serving.engine, EngineClient)
    return serving.engine


def test_it_serves_with_the_engine_in_another_process(split: LiveServer) -> None:
    engine = _client(split)
    assert engine.pid is not None and engine.pid != os.getpid()
    r = httpx.post(f"{split.api_url}/completions", json={"prompt": "hi", "max_tokens": 5})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    metrics = scrape_metrics(split)  # gathered from the engine process's steps
    assert metrics['vllm:generation_tokens_total{model_name="tiny"}'] >= 5
    assert any(k.startswith("kvgate:build_info{") for k in metrics)


def test_a_killed_engine_process_ends_the_stream_with_an_error_and_comes_back(
    split: LiveServer,
) -> None:
    engine = _client(split)
    first = engine.pid
    assert first is not None
    body = {"prompt": "a long story", "max_tokens": 400, "stream": True, "ignore_eos": True}
    texts, errors = 0, []
    with httpx.stream("POST", f"{split.api_url}/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                errors.append(event["error"])
            elif event["choices"][0].get("text"):
                texts += 1
                if texts == 3:
                    os.kill(first, signal.SIGKILL)
    assert 3 <= texts < 400
    assert errors and errors[0]["code"] == "engine_dead", errors
    # Ready again once the fresh engine has loaded; 503 (restarting) until then.
    seen: set[int] = set()
    deadline = time.monotonic() + 60
    while True:
        health = httpx.get(f"{split.base_url}/health")
        seen.add(health.status_code)
        if health.status_code == 200:
            break
        assert health.json()["status"] == "restarting"
        assert time.monotonic() < deadline, "the engine never came back"
        time.sleep(0.05)
    assert 503 in seen, "the restart was never visible to /health"
    assert health.json()["engine_restarts"] == 1
    assert httpx.get(f"{split.base_url}/health/live").status_code == 200
    assert engine.pid != first
    r = httpx.post(f"{split.api_url}/completions", json={"prompt": "hi", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4

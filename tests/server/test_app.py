"""App behaviour around the engine: loading, load failure, overload, disconnects, error shapes."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from kvgate.engine.async_llm import AsyncLLM
from kvgate.engine.policy import SchedulingPolicy
from kvgate.engine.stats import StatsListener
from kvgate.errors import ModelNotFound
from kvgate.launch.server import engine_loader
from kvgate.server.app import build_app
from kvgate.server.config import ServerConfig
from tests.server.conftest import (
    API_KEY,
    LiveServer,
    aborted_requests,
    start_server,
    tiny_engine_config,
    wait_idle,
)


def test_health_is_503_until_the_model_is_ready(tiny_llama_dir: Path) -> None:
    release = threading.Event()
    load = engine_loader(tiny_engine_config(tiny_llama_dir), max_queue_len=8)

    def slow_loader(
        listeners: Sequence[StatsListener], policy: SchedulingPolicy | None
    ) -> AsyncLLM:
        release.wait(30)
        return load(listeners, policy)

    app = build_app(ServerConfig(served_model_name="tiny"), slow_loader)
    with TestClient(app) as http:
        health = http.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "loading"
        models = http.get("/v1/models")
        assert models.status_code == 503 and models.headers["retry-after"] == "5"
        assert models.json()["error"]["code"] == "model_loading"
        gc.unfreeze()
        release.set()
        deadline = time.monotonic() + 30
        while http.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert http.get("/v1/models").json()["data"][0]["id"] == "tiny"
        # Once loaded, the long-lived heap is frozen out of the garbage collector (a full
        # collection over it paused serving ~120 ms at a time).
        assert gc.get_freeze_count() > 10_000


def test_a_model_that_fails_to_load_is_reported(tmp_path: Path) -> None:
    failures: list[BaseException] = []

    def failing(_: Sequence[StatsListener], __: SchedulingPolicy | None) -> AsyncLLM:
        raise ModelNotFound(f"no model at {tmp_path / 'nope'}", path=str(tmp_path / "nope"))

    app = build_app(ServerConfig(), failing, on_load_error=failures.append)
    with TestClient(app) as http:
        deadline = time.monotonic() + 10
        while not failures:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        health = http.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "unhealthy"
        r = http.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503
        assert (
            r.json()["error"]["code"] == "engine_dead"
            and "no model at" in r.json()["error"]["message"]
        )


def test_unknown_route_and_method_use_the_error_shape(live_server: LiveServer) -> None:
    key = {"authorization": f"Bearer {API_KEY}"}
    r = httpx.get(f"{live_server.base_url}/v1/nothing", headers=key)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(f"{live_server.api_url}/completions", headers=key)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    # Without a key the API says only that: 401, whatever the path.
    assert httpx.get(f"{live_server.base_url}/v1/nothing").status_code == 401


@pytest.fixture(scope="module")
def single_slot_server(tiny_llama_dir: Path) -> LiveServer:
    """One running sequence and no queue: a second concurrent request must be refused."""
    live = start_server(
        tiny_engine_config(tiny_llama_dir, max_num_seqs=1),
        ServerConfig(served_model_name="tiny", max_queue_len=0),
    )
    yield live  # type: ignore[misc]
    live.stop()


def test_full_queue_is_a_503_with_retry_after(single_slot_server: LiveServer) -> None:
    live = single_slot_server
    client = openai.OpenAI(base_url=live.api_url, api_key="none", max_retries=0)
    stream = client.completions.create(
        model="tiny", prompt="a", max_tokens=400, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))  # the first request is now running
    try:
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model="tiny", prompt="b", max_tokens=2)
        assert info.value.status_code == 503
        assert info.value.response.headers["retry-after"] == "1"
        err = info.value.body
        assert isinstance(err, dict) and err["code"] == "server_is_overloaded"
    finally:
        stream.close()
    wait_idle(live)
    ok = client.completions.create(model="tiny", prompt="b", max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_non_streamed_request_is_aborted_when_the_client_leaves(live_server: LiveServer) -> None:
    wait_idle(live_server)

    async def leave_early() -> None:
        async with httpx.AsyncClient(timeout=0.3) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.post(
                    f"{live_server.api_url}/completions",
                    json={"prompt": "x", "max_tokens": 500, "ignore_eos": True},
                    headers={"Authorization": "Bearer sk-test-key-a"},
                )

    aborted_before = aborted_requests(live_server)
    asyncio.run(leave_early())
    wait_idle(live_server, timeout=1.0)  # its blocks freed, too
    assert aborted_requests(live_server) == aborted_before + 1  # ended by the abort, not by length


def test_a_burst_cannot_overfill_the_queue(single_slot_server: LiveServer) -> None:
    """Capacity is counted at admission, so requests that arrive together (none of them yet
    streaming in the engine) cannot all slip past a one-slot, no-queue server."""
    live = single_slot_server
    wait_idle(live)

    async def burst() -> list[int]:
        async with httpx.AsyncClient(timeout=60) as http:
            body = {"prompt": "a", "max_tokens": 50, "ignore_eos": True}
            rs = await asyncio.gather(
                *(http.post(f"{live.api_url}/completions", json=body) for _ in range(6))
            )
        return sorted(r.status_code for r in rs)

    codes = asyncio.run(burst())
    assert codes.count(200) >= 1 and codes.count(503) >= 1
    assert set(codes) == {200, 503}
    wait_idle(live)

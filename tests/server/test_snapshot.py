"""The server reads the engine only through the snapshot it publishes: a tight loop of
/metrics scrapes during a storm of cancelled requests never sees a request in two states or
in none."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.server.conftest import API_KEY, LiveServer, metric, scrape_metrics, wait_idle

STORM_SECONDS = 6.0


def _storm(live: LiveServer, i: int, stop: threading.Event) -> None:
    headers = {"authorization": f"Bearer {API_KEY}"}
    body = {"model": "tiny", "prompt": "word " * (20 + 7 * i), "max_tokens": 64}
    with httpx.Client(base_url=live.api_url, headers=headers) as client:
        n = 0
        while not stop.is_set():
            n += 1
            try:
                if n % 2:  # a stream dropped after a chunk or two
                    with client.stream(
                        "POST", "/completions", json={**body, "stream": True}, timeout=10
                    ) as r:
                        for _, _ in zip(range(1 + n % 3), r.iter_lines(), strict=False):
                            pass
                else:  # a client that gives up before the answer
                    client.post("/completions", json=body, timeout=0.02 + 0.01 * (n % 5))
            except httpx.TimeoutException:
                pass


@pytest.mark.slow
def test_metrics_are_never_torn_during_a_cancel_storm(live_server: LiveServer) -> None:
    """Every scrape's figures come from one moment; the pool's blocks always add up."""
    wait_idle(live_server)
    before = scrape_metrics(live_server)
    stop = threading.Event()
    threads = [
        threading.Thread(target=_storm, args=(live_server, i, stop), daemon=True) for i in range(6)
    ]
    for t in threads:
        t.start()
    scrapes, busiest = 0, 0.0
    deadline = time.monotonic() + STORM_SECONDS
    try:
        while time.monotonic() < deadline:
            m = scrape_metrics(live_server)
            added = metric(m, "kvgate:engine_requests_added_total")
            finished = metric(m, "kvgate:engine_requests_finished_total")
            running = metric(m, "vllm:num_requests_running")
            waiting = metric(m, "vllm:num_requests_waiting")
            assert running + waiting + finished == added, m
            blocks = sum(v for k, v in m.items() if k.startswith("kvgate:kv_cache_blocks{"))
            assert blocks == metric(before, "kvgate:kv_cache_blocks")  # used+cached+free
            busiest = max(busiest, running + waiting)
            scrapes += 1
    finally:
        stop.set()
        for t in threads:
            t.join(15)
    wait_idle(live_server)
    after = scrape_metrics(live_server)
    added = metric(after, "kvgate:engine_requests_added_total")
    assert added == metric(after, "kvgate:engine_requests_finished_total")
    assert added - metric(before, "kvgate:engine_requests_added_total") >= 20
    assert scrapes >= 20 and busiest >= 2
    assert after['kvgate:kv_cache_blocks{model_name="tiny",state="used"}'] == 0
    # The pool's size: tokens, and a token's bytes (the tiny Llama: K and V, float32).
    tokens = metric(after, "kvgate:kv_cache_capacity_tokens")
    assert tokens == metric(after, "kvgate:kv_cache_blocks") * 16
    assert metric(after, "kvgate:kv_cache_bytes_per_token") == 2 * 2 * 2 * 16 * 4
    assert metric(after, "kvgate:kv_cache_held_bytes_per_token") == 0  # nothing runs

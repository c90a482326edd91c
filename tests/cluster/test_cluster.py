"""Two SmolLM2 replicas on a local Ray Serve behind kvgate's ingress: prefix affinity, load
spread, a tenant's rate across both, streaming with disconnects, a replica killed -9 under
load, and lineage (the cluster: ``conftest.py``)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.cluster.conftest import DOC, chat, eventually, per_replica

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")

from kvgate.cluster.app import ENGINE, FIRST_ENGINE_APP  # noqa: E402
from kvgate.cluster.state import NAMESPACE, STATE_ACTOR  # noqa: E402


def test_the_same_prefix_lands_on_the_replica_that_cached_it(url: str) -> None:
    system = "".join(DOC.format(i=i) for i in range(12))  # ~2,000 characters
    before = per_replica(url, "vllm:prefix_cache_hits_total")
    cached = [
        chat(url, "sk-open", f"Question {q}?", system).json()["usage"]["prompt_tokens_details"]
        for q in range(4)
    ]
    assert cached[0]["cached_tokens"] == 0
    assert all(c["cached_tokens"] > 300 for c in cached[1:]), cached

    def gained() -> dict[str, float] | None:
        now = per_replica(url, "vllm:prefix_cache_hits_total")
        delta = {r: now[r] - before.get(r, 0.0) for r in now}
        total = sum(c["cached_tokens"] for c in cached)
        return delta if len(now) == 2 and sum(delta.values()) >= total else None

    delta = eventually(gained)
    assert delta, "the replicas' metrics never showed the hits"
    assert sorted(delta.values())[0] == 0  # every hit on one replica


def test_unrelated_load_spreads_over_both_replicas(url: str) -> None:
    # Both replicas by a gauge each always shows (a replica that never served a request has
    # no success counter yet: missing counts as 0); each pushes its metrics every 2 s.
    replicas = eventually(
        lambda: (lambda m: set(m) if len(m) == 2 else None)(
            per_replica(url, "vllm:num_requests_running")
        )
    )
    assert replicas, "the metrics never showed both replicas"
    before = per_replica(url, "vllm:request_success_total")
    prompts = [f"{i} " + "".join(DOC.format(i=i * 100 + j) for j in range(5)) for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        statuses = [r.status_code for r in pool.map(lambda p: chat(url, "sk-open", p), prompts)]
    assert statuses == [200] * 8

    def spread() -> dict[str, float] | None:
        now = per_replica(url, "vllm:request_success_total")
        delta = {r: now.get(r, 0.0) - before.get(r, 0.0) for r in replicas}
        return delta if sum(delta.values()) >= 8 else None

    delta = eventually(spread)
    assert delta and min(delta.values()) >= 2, delta


def test_a_tenants_request_rate_holds_across_both_replicas(url: str) -> None:
    def one(i: int) -> httpx.Response:
        return chat(url, "sk-limited", f"{i} " + "".join(DOC.format(i=i) for i in range(5)))

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        responses = list(pool.map(one, range(12)))
    codes = sorted(r.status_code for r in responses)
    assert codes == [200] * 6 + [429] * 6, codes  # 6 a minute for the deployment, not each
    refused = next(r for r in responses if r.status_code == 429)
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(refused.headers["retry-after"]) >= 1
    # Both replicas served the tenant: the sum held, not one replica's own bucket.
    served = eventually(
        lambda: (lambda d: d if len([v for v in d.values() if v > 0]) == 2 else None)(
            per_replica(url, "kvgate:tenant_requests_finished_total", tenant="limited")
        )
    )
    assert served, "the tenant's requests all went to one replica: the test proves nothing"


def test_models_lists_the_version_and_every_response_carries_it(url: str) -> None:
    models = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer sk-open"})
    entry = models.json()["data"][0]
    assert entry["version"].startswith("smollm2-") and len(entry["weights_sha256"]) == 64
    assert entry["created"] > 1_600_000_000 and entry["source"].endswith(".gguf")
    r = chat(url, "sk-open", "hi")
    assert r.headers["x-kvgate-model-version"] == entry["version"]  # same on both replicas
    r = chat(url, "sk-open", "hi")
    assert r.headers["x-kvgate-model-version"] == entry["version"]


def test_errors_and_body_limit_through_the_ingress(url: str) -> None:
    r = httpx.post(f"{url}/v1/chat/completions", content=b"{not json", timeout=30)
    assert r.status_code == 401  # the replica's own checks, unchanged: the key first
    r = httpx.post(
        f"{url}/v1/chat/completions",
        content=b"{not json",
        headers={"Authorization": "Bearer sk-open", "content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    big = b'{"messages": "' + b"x" * (5 * 2**20) + b'"}'
    r = httpx.post(f"{url}/v1/chat/completions", content=big, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def _stream(url: str, tokens: int) -> Iterator[dict[str, Any]]:
    body = {
        "messages": [{"role": "user", "content": "Count to a thousand."}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST",
        f"{url}/v1/chat/completions",
        json=body,
        headers={"Authorization": "Bearer sk-open"},
        timeout=httpx.Timeout(60, read=30),
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


def test_a_client_leaving_a_stream_aborts_it_on_the_replica(url: str) -> None:
    events = _stream(url, 1000)
    for _ in range(3):
        next(events)
    started = eventually(lambda: sum(per_replica(url, "vllm:num_requests_running").values()))
    assert started == 1
    events.close()  # the client goes away mid-stream (~30 s of tokens left)

    def idle() -> bool:
        running = per_replica(url, "vllm:num_requests_running")
        return bool(running) and sum(running.values()) == 0

    assert eventually(idle, timeout=15), "the stream kept running after its client left"


def _replica_pids() -> dict[str, int]:
    """Live replicas (pushed their metrics within 3 s) and their processes."""
    actor = ray.get_actor(STATE_ACTOR, namespace=NAMESPACE)
    pids: dict[str, int] = ray.get(actor.replica_pids.remote(3.0))
    return pids


def test_a_replica_killed_under_load_fails_its_streams_cleanly(url: str) -> None:
    from ray import serve

    pids = eventually(lambda: (lambda p: p if len(p) == 2 else None)(_replica_pids()))
    assert pids, "two replicas expected"
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(lambda: list(_stream(url, 300))) for _ in range(2)]
        running = eventually(
            lambda: (lambda r: r if sum(r.values()) >= 2 else None)(
                per_replica(url, "vllm:num_requests_running")
            )
        )
        assert running, "the streams never started"
        victim = max(running, key=lambda r: running[r])
        os.kill(pids[victim], signal.SIGKILL)
        results = [s.result(timeout=60) for s in streams]  # none hangs
    failed = [events for events in results if "error" in events[-1]]
    assert failed, "no stream was on the killed replica"
    assert all(events[-1]["error"]["code"] == "replica_failed" for events in failed)
    # New requests go to the survivor meanwhile.
    assert [chat(url, "sk-open", f"after {i}").status_code for i in range(3)] == [200] * 3

    def back() -> bool:
        status = serve.status().applications[FIRST_ENGINE_APP].deployments[ENGINE]
        pids_now = _replica_pids()
        return status.replica_states.get("RUNNING", 0) == 2 and len(pids_now) == 2

    assert eventually(back, timeout=120), "Ray did not bring the replica back"
    assert chat(url, "sk-open", "and again").status_code == 200

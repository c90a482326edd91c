"""Canary rollouts on the package's cluster (``conftest.py``): a canary that fails to load
or fails its golden prompts never gets traffic; one that errors is rolled back within one
step with no error from stable; a healthy one is promoted; a rolling restart under load
fails no request. Run after test_cluster.py (they replace the stable version)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.cluster.conftest import chat, eventually

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")

from kvgate.cluster.controller import CONTROLLER  # noqa: E402
from kvgate.cluster.rollout_cli import plan_of  # noqa: E402
from kvgate.cluster.state import NAMESPACE  # noqa: E402

GOLDEN = '{"prompt": "What is the capital of France? Answer in one word.", "expect": "Paris"}\n'


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("golden") / "golden.jsonl"
    path.write_text(GOLDEN)
    return str(path)


def controller() -> Any:
    return ray.get_actor(CONTROLLER, namespace=NAMESPACE)


def start(
    model: str, golden: str, steps: str, interval: str, serve_args: str = "", fault: str = ""
) -> dict[str, Any]:
    a = argparse.Namespace(
        model=model, golden=golden, steps=steps, interval=interval, key="sk-open",
        replicas=1, serve_args=serve_args,
    )  # fmt: skip
    status: dict[str, Any] = ray.get(controller().start.remote(**plan_of(a), fault=fault))
    return status


def status() -> dict[str, Any]:
    result: dict[str, Any] = ray.get(controller().status.remote())
    return result


def wait_state(*states: str, timeout: float = 180) -> dict[str, Any]:
    ends = {"rejected", "rolled_back", "promoted", *states}
    got = eventually(lambda: (lambda s: s if s["state"] in ends else None)(status()), timeout)
    assert got and got["state"] in states, f"the rollout did not reach {states}: {status()}"
    result: dict[str, Any] = got
    return result


class Traffic:
    """Clients sending small chat requests, one at a time each, until stopped."""

    def __init__(self, url: str, clients: int = 8) -> None:
        self.url = url
        self.results: list[tuple[int, str, str]] = []  # status, version header, error code
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._client, args=(f"sk-c{i}",)) for i in range(clients)
        ]

    def _client(self, key: str) -> None:
        while not self._stop.is_set():
            r = chat(self.url, key, "Say hi.")
            code = r.json().get("error", {}).get("code", "") if r.status_code != 200 else ""
            self.results.append((r.status_code, r.headers.get("x-kvgate-model-version", ""), code))

    def settle(self, version: str, run: int = 8, then: int = 8) -> int:
        """Wait until the last ``run`` answers all came from ``version`` (requests already
        sent elsewhere have ended), then for ``then`` more; returns where those start."""
        got = eventually(
            lambda: (
                len(self.results) >= run and {v for _, v, _ in self.results[-run:]} == {version}
            ),
            120,
        )
        assert got, f"traffic never settled on {version}: {self.results[-run:]}"
        return self.more(then)

    def more(self, count: int = 8) -> int:
        """Wait for ``count`` answers after the ones so far; returns where they start."""
        mark = len(self.results)
        assert eventually(lambda: len(self.results) >= mark + count, 120), "no traffic"
        return mark

    def __enter__(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)


def test_an_invalid_rollout_is_refused_before_anything_runs(golden: str) -> None:
    cli = [sys.executable, "-m", "kvgate.entrypoints.cli", "rollout", "start"]
    cases = [
        (["--model", "x", "--golden", golden, "--steps", "50,25"], "must rise"),
        (["--model", "x"], "--golden"),
        (["--model", "x", "--golden", golden, "--interval", "soon"], "duration"),
    ]
    for args, message in cases:
        out = subprocess.run([*cli, *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and message in out.stderr, out.stderr
        assert "Traceback" not in out.stderr


def test_a_canary_that_cannot_load_or_answer_never_takes_traffic(
    url: str, golden: str, tmp_path: Path, tiny_llama_dir: Path
) -> None:
    start(str(tmp_path / "no-such-model"), golden, "50,100", "5s")
    rejected = wait_state("rejected")
    assert rejected["history"][-1]["reason"] == "load_failed"
    stable = status()["stable"]["version"]
    # Random weights load fine but cannot say Paris: rejected before any traffic.
    with Traffic(url, clients=2) as traffic:
        start(str(tiny_llama_dir), golden, "50,100", "5s")
        rejected = wait_state("rejected")
    assert rejected["history"][-1]["reason"] == "golden_failed"
    assert rejected["weight"] == 0 and rejected["stable"]["version"] == stable
    assert traffic.results and {v for _, v, _ in traffic.results} == {stable}
    assert {s for s, _, _ in traffic.results} == {200}


def test_a_canary_that_errors_is_rolled_back_within_one_step(url: str, golden: str) -> None:
    interval = 8.0
    stable = status()["stable"]["version"]
    with Traffic(url) as traffic:
        start("smollm2", golden, "50,100", f"{interval}s",
              serve_args="--max-model-len 1536", fault="errors=0.5")  # fmt: skip
        rolled = wait_state("rolled_back", "promoted")
        # Requests the ingress had already sent the canary end; then all go to stable.
        after = traffic.settle(stable)
    assert rolled["state"] == "rolled_back", rolled
    decision = rolled["history"][-1]
    assert decision["reason"] == "error_rate" and decision["seconds_into_step"] < interval
    canary_errors = [r for r in traffic.results if r[0] != 200]
    assert canary_errors and all(code == "injected_fault" for _, _, code in canary_errors)
    assert all(s == 200 for s, v, _ in traffic.results if v == stable)  # stable: no error
    assert {v for _, v, _ in traffic.results[after:]} == {stable}  # all traffic back
    metrics = httpx.get(f"{url}/metrics").text
    assert 'kvgate:rollout_decisions_total{decision="rolled_back"} 1.0' in metrics
    assert 'kvgate:rollout_state{state="rolled_back"} 1.0' in metrics


def test_a_healthy_canary_is_promoted_to_all_traffic(url: str, golden: str) -> None:
    old = status()["stable"]["version"]
    # Light traffic: the canary's one replica against stable's two must not be judged on
    # being outnumbered (8 clients queued on it doubled its TTFT p99 once).
    with Traffic(url, clients=4) as traffic:
        started = start("smollm2", golden, "50,100", "4s", serve_args="--max-model-len 1024")
        assert started["state"] == "loading"
        promoted = wait_state("promoted", "rolled_back")
        assert promoted["state"] == "promoted", promoted["history"][-3:]
        new = promoted["stable"]["version"]
        after = traffic.settle(new)
    assert new != old  # another max_model_len: another version
    assert [h["decision"] for h in promoted["history"][-2:]] == ["advanced", "promoted"]
    assert {s for s, _, _ in traffic.results} == {200}
    assert {v for _, v, _ in traffic.results} == {old, new}
    assert {v for _, v, _ in traffic.results[after:]} == {new}
    models = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer sk-open"}).json()
    assert models["data"][0]["version"] == new and models["data"][0]["max_model_len"] == 1024


def test_a_rolling_restart_under_load_fails_no_request(
    url: str, cluster_argv: tuple[str, ...]
) -> None:
    from ray import serve

    from kvgate.cluster.app import ClusterSpec, engine_application

    app_name = status()["stable"]["app"]
    with Traffic(url, clients=4) as traffic:
        traffic.more(12)
        # Another setting for every replica: Serve replaces them one at a time, each old
        # one getting no new requests and finishing its own before it stops.
        argv = (*cluster_argv, "--max-queue-len", "200")
        serve.run(engine_application(ClusterSpec(argv, replicas=2, shutdown_timeout=10)),
                  name=app_name, route_prefix=None)  # fmt: skip
        traffic.more(12)  # on the new replicas
    statuses = [s for s, _, _ in traffic.results]
    assert len(statuses) > 20 and set(statuses) == {200}, [
        r for r in traffic.results if r[0] != 200
    ][:5]

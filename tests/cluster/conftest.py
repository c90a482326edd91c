"""One local Ray Serve cluster for the package's Ray tests: two SmolLM2 replicas (one
thread each) behind kvgate's ingress, tenants from a file (~25 s to start)."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvgate.cluster.private_ray import LOOPBACK_ENV

# Ray reads it once, when imported, which this package's test modules do as they are
# collected: set before (``start`` sets it too, which is enough for ``kvgate serve``).
os.environ[LOOPBACK_ENV] = "0"

TENANTS = """
admin_keys = ["sk-admin"]

[tenants.open]
keys = ["sk-open", "sk-c0", "sk-c1", "sk-c2", "sk-c3", "sk-c4", "sk-c5", "sk-c6", "sk-c7"]

[tenants.limited]
keys = ["sk-limited"]
requests_per_minute = 6
"""

DOC = (
    "Article {i}. The parties shall perform their obligations in full as agreed, and "
    "shall follow the principle of good faith in notifying, assisting and keeping secret. "
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="package")
def cluster_argv(
    tmp_path_factory: pytest.TempPathFactory, smollm2_gguf_path: Path
) -> tuple[str, ...]:
    d = tmp_path_factory.mktemp("cluster")
    (d / "tenants.toml").write_text(TENANTS)
    return (
        "--model", str(smollm2_gguf_path), "--served-model-name", "smollm2",
        "--threads", "1", "--kv-cache-memory", "64MiB", "--max-model-len", "2048",
        "--tenants", str(d / "tenants.toml"), "--data-dir", str(d / "data"),
        "--usage-db", str(d / "usage.sqlite3"), "--access-log", "",
    )  # fmt: skip


@pytest.fixture(scope="package")
def url(cluster_argv: tuple[str, ...]) -> Iterator[str]:
    pytest.importorskip("ray")
    from kvgate.cluster.app import ClusterSpec, start, stop

    port = _free_port()
    os.environ["KVGATE_RAY_LOGS"] = "0"
    start(ClusterSpec(cluster_argv, replicas=2, shutdown_timeout=10), "127.0.0.1", port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop()


def chat(url: str, key: str, content: str, system: str = "", **extra: Any) -> httpx.Response:
    messages = [{"role": "system", "content": system}] if system else []
    body = {"messages": [*messages, {"role": "user", "content": content}], "max_tokens": 2}
    return httpx.post(
        f"{url}/v1/chat/completions",
        json={**body, **extra},
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    )


def per_replica(url: str, sample: str, **labels: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer sk-admin"}).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                out[s.labels["replica"]] = out.get(s.labels["replica"], 0.0) + s.value
    return out


def eventually(check: Callable[[], Any], timeout: float = 30.0) -> Any:
    """``check()``'s first truthy result (replicas push their metrics every 2 s)."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.5)

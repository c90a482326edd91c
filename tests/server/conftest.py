"""A real uvicorn on 127.0.0.1 serving the tiny random-weight Llama (fp32, so greedy output is
exactly reproducible), and the pieces tests need to talk to it."""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn

from kvgate.config import EngineConfig
from kvgate.launch.server import engine_loader
from kvgate.server.app import ServerState, build_app
from kvgate.server.config import ServerConfig
from kvgate.server.http import uvicorn_config
from tests.conftest import tiny_engine_config

API_KEY = "sk-test-key-a"
#: May read the per-tenant /metrics and /dashboard figures of ``live_server``.
METRICS_KEY = "sk-test-metrics"
MODEL = "tiny"


@dataclass
class LiveServer:
    base_url: str
    state: ServerState
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def api_url(self) -> str:
        return f"{self.base_url}/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_server(
    engine_config: EngineConfig | Mapping[str, EngineConfig], config: ServerConfig
) -> LiveServer:
    """Start uvicorn on a thread and wait until /health says the model is ready; a mapping
    of served names to configs serves several models (the first is the default)."""
    port = _free_port()
    usage_db = config.usage_db or str(Path(tempfile.mkdtemp(prefix="kvgate-usage-")) / "u.db")
    data_dir = config.data_dir or tempfile.mkdtemp(prefix="kvgate-data-")
    config = ServerConfig(
        **{**config.__dict__, "port": port, "usage_db": usage_db, "data_dir": data_dir}
    )
    # KVGATE_ENGINE_PROCESS=on: every live server's engine in a process of its own (CI runs
    # the server tests both ways).
    own = config.engine_process or os.environ.get("KVGATE_ENGINE_PROCESS") == "on"
    configs = engine_config if isinstance(engine_config, Mapping) else {"": engine_config}
    loaders = {
        n: engine_loader(c, config.max_queue_len, own_process=own) for n, c in configs.items()
    }
    app = build_app(config, loaders if isinstance(engine_config, Mapping) else loaders[""])
    # The production server's settings (header timeout, connection limit).
    server = uvicorn.Server(
        uvicorn_config(app, "127.0.0.1", port, config.limits, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    live = LiveServer(f"http://127.0.0.1:{port}", app.state.kvgate, server, thread)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{live.base_url}/health", timeout=1).status_code == 200:
                return live
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    live.stop()
    raise RuntimeError("server did not become healthy")


def start_tenants_server(
    model_dir: Path,
    tenants: str,
    directory: Path,
    engine: dict[str, object] | None = None,
    **server: object,
) -> LiveServer:
    """A live server on the tiny model with ``tenants`` (TOML text) as its tenants file,
    written into ``directory``; ``engine`` and ``server`` override the configs' settings."""
    path = directory / "tenants.toml"
    path.write_text(tenants)
    config = ServerConfig(served_model_name=MODEL, tenants_file=str(path))
    return start_server(
        tiny_engine_config(model_dir, **(engine or {})),
        ServerConfig(**{**config.__dict__, **server}),
    )


LONE_KEYS = ("sk-lone-one", "sk-lone-two")


@pytest.fixture(scope="session")
def api_keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    # Two keys that name no tenant: separate callers of the default tenant.
    path.write_text(f"# test keys\n{API_KEY} team-a\n{LONE_KEYS[0]}\n{LONE_KEYS[1]}\n")
    return path


@pytest.fixture(scope="session")
def live_server(tiny_llama_dir: Path, api_keys_file: Path) -> Iterator[LiveServer]:
    live = start_server(
        tiny_engine_config(tiny_llama_dir),
        ServerConfig(
            served_model_name=MODEL,
            api_keys_file=str(api_keys_file),
            metrics_keys=(METRICS_KEY,),
        ),
    )
    yield live
    live.stop()


def wait_idle(live: LiveServer, timeout: float = 5.0) -> None:
    """Until every engine's latest snapshot shows nothing running, waiting or holding KV."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snaps = live.state.snapshots().values()
        if all(s.running == s.waiting == s.kv_used == 0 for s in snaps):
            return
        time.sleep(0.01)
    raise AssertionError(f"engine still busy: {live.state.snapshots()}")


def scrape_metrics(live: LiveServer, key: str = METRICS_KEY) -> dict[str, float]:
    """``name{labels}`` -> value from /metrics (histogram buckets skipped), read with ``key``
    (a metrics or admin key: per-tenant series included)."""
    values: dict[str, float] = {}
    text = httpx.get(f"{live.base_url}/metrics", headers={"authorization": f"Bearer {key}"}).text
    for line in text.splitlines():
        if line.startswith(("vllm:", "kvgate:")) and "_bucket" not in line:
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    return values


def metric(values: dict[str, float], name: str) -> float:
    """Sum of a metric over all its label sets."""
    return sum(v for k, v in values.items() if k.split("{")[0] == name)


def aborted_requests(live: LiveServer) -> float:
    return sum(
        v
        for k, v in scrape_metrics(live).items()
        if k.startswith("vllm:request_success_total") and 'finished_reason="abort"' in k
    )

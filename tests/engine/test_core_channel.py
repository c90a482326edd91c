"""The engine channel of ``kvgate serve --engine-process on`` (``channel.py``): a process of
the same user that connects to its sockets is not heard (nothing it sends is unpickled) and
gets no command, while the server goes on serving; and a server killed -9 leaves neither its
engine process nor the sockets' directory behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.engine.foreign_peer import ForeignPeer
from tests.server.conftest import _free_port

#: Outside the fast tier (scripts/test.sh --fast): servers in processes of their own, killed.
pytestmark = pytest.mark.slow


@dataclass
class Server:
    proc: subprocess.Popen[str]
    url: str
    tmp: Path  # the server's TMPDIR: the engine channel's directory is made there

    def socket_dir(self) -> Path:
        (found,) = self.tmp.glob("kvgate-engine-*")
        return found

    def engine_pid(self) -> int:
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            for pid in (task / "children").read_text().split():
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                if b"kvgate.engine.core_main" in cmdline:
                    return int(pid)
        raise AssertionError("no engine process among the server's children")

    def complete(self) -> httpx.Response:
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 3}
        return httpx.post(f"{self.url}/v1/completions", json=body, timeout=60)


def _until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _serve(tiny_llama_dir: Path, tmp_path: Path) -> Server:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "kvgate.entrypoints.cli", "serve", "--engine-process", "on",
            "--model", str(tiny_llama_dir), "--dtype", "float32", "--port", str(port),
            "--kv-cache-memory", "16MiB", "--max-model-len", "256", "--served-model-name",
            "tiny", "--data-dir", str(tmp_path / "data"), "--usage-db",
            str(tmp_path / "usage.sqlite3"), "--access-log", "",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp)},
    )  # fmt: skip
    server = Server(proc, f"http://127.0.0.1:{port}", tmp)

    def healthy() -> bool:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        try:
            return httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    _until(healthy, 180, "the server did not become healthy")
    return server


def _stop(server: Server) -> str:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGINT)
    out, _ = server.proc.communicate(timeout=60)
    return out


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    started = _serve(tiny_llama_dir, tmp_path_factory.mktemp("channel"))
    yield started
    _stop(started)


@pytest.mark.parametrize("keys", ["none", "a server key not the server's"])
@pytest.mark.parametrize("role", ["results", "commands"])
def test_a_foreign_peer_is_refused_and_the_server_goes_on(
    server: Server, tmp_path: Path, role: str, keys: str
) -> None:
    import zmq

    server_key = None if keys == "none" else zmq.curve_keypair()[0]
    marker = tmp_path / "unpickled"
    with ForeignPeer(server.socket_dir(), role, server_key, marker) as peer:
        outcome = peer.outcome()
        assert outcome not in ("HANDSHAKE_SUCCEEDED", "none"), outcome
        # Served meanwhile: every request's Add reached the engine, none the foreign peer.
        assert [server.complete().status_code for _ in range(4)] == [200] * 4
        assert peer.received() == 0
    assert not marker.exists()  # the front end never unpickled the peer's message
    assert server.proc.poll() is None


def test_a_server_killed_9_leaves_no_engine_and_no_socket_dir(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    killed = _serve(tiny_llama_dir, tmp_path)
    try:
        engine, socket_dir = killed.engine_pid(), killed.socket_dir()
        killed.proc.kill()  # -9: no shutdown of any kind
        killed.proc.wait(30)

        def gone() -> bool:
            try:  # a zombie has ended: only its reaping (by init, not by the test) is left
                ended = Path(f"/proc/{engine}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except FileNotFoundError:
                ended = "Z"
            return ended == "Z" and not socket_dir.exists()

        _until(gone, 60, "the engine process or its socket directory outlived the server")
    finally:
        _stop(killed)

"""The trickled-body probe (issue 43, "connections held without a key"): do legitimate
requests still get answered while one address holds sockets trickling a byte now and then?

A ``kvgate serve`` on the tiny random-weight Llama (tests/tiny_model.py, built into a
temporary directory) with ``--max-connections 40``. The attacker, from 127.0.0.2, keeps
``--sockets`` connections open (40 by default), half into ``POST /metrics`` (answered 405
without its body being read) and half into ``POST /v1/chat/completions`` with a valid key,
each with a large ``Content-Length`` and then one body byte every ``--every`` seconds; a
socket the server closes is opened again at once, as an attacker would. Meanwhile a
legitimate client on 127.0.0.1 sends ``GET /health`` and a keyed ``GET /v1/models``, one
request at a time, each on a new connection.

Reported: the legitimate requests' statuses and latency (p50, p99, max), and how long the
attacker's connections lasted. Run against any checkout (the server runs the ``kvgate`` that
``PYTHONPATH`` names); flags the server does not know go in ``--server-args``::

    PYTHONPATH=/work/main python bench/trickle.py --duration 30
    python bench/trickle.py --duration 30 --server-args "--max-connections-per-client 10"
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # tests.tiny_model; ``kvgate`` from PYTHONPATH first
KEY = "sk-trickle"


def build_model(directory: Path) -> Path:
    from kvgate.model.gguf_loader import load_gguf_tokenizer
    from kvgate.model.registry import DEFAULT_MODEL, resolve_model_path
    from tests.tiny_model import build_tiny_llama

    return build_tiny_llama(directory, load_gguf_tokenizer(resolve_model_path(DEFAULT_MODEL)))


def start(model: Path, keys: Path, port: int, extra: list[str]) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "kvgate.entrypoints.cli", "serve", "--model", str(model),
        "--served-model-name", "tiny", "--dtype", "float32", "--kv-cache-memory", "64MiB",
        "--max-model-len", "512", "--port", str(port), "--api-keys-file", str(keys),
        "--max-connections", "40", "--access-log", "", "--log-level", "error", *extra,
    ]  # fmt: skip
    # ``python -m`` puts its working directory first on sys.path: the checkout whose kvgate
    # this process imported.
    import kvgate

    checkout = Path(kvgate.__file__).resolve().parent.parent
    return subprocess.Popen(cmd, cwd=checkout, stdout=subprocess.DEVNULL)


def wait_healthy(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError("the server did not become healthy")


class Attacker:
    """``n`` trickling sockets from 127.0.0.2, each opened again when the server closes it."""

    def __init__(self, port: int, n: int, every: float) -> None:
        self.port, self.n, self.every = port, n, every
        self.stop = threading.Event()
        self.held: list[float] = []  # seconds each closed connection lasted
        self.opened = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _open(self, i: int) -> tuple[socket.socket, float] | None:
        sock = socket.socket()
        sock.bind(("127.0.0.2", 0))
        sock.settimeout(5)
        try:
            sock.connect(("127.0.0.1", self.port))
            if i % 2:
                head = "POST /metrics HTTP/1.1\r\nhost: x\r\ncontent-length: 1000000\r\n\r\n"
            else:
                head = (
                    "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                    f"authorization: Bearer {KEY}\r\ncontent-type: application/json\r\n"
                    "content-length: 1000000\r\n\r\n"
                )
            sock.sendall(head.encode())
        except OSError:
            sock.close()
            return None
        sock.setblocking(False)
        self.opened += 1
        return sock, time.monotonic()

    def _run(self) -> None:
        socks: list[tuple[socket.socket, float] | None] = [self._open(i) for i in range(self.n)]
        while not self.stop.wait(self.every):
            for i, entry in enumerate(socks):
                if entry is not None and self._alive(entry[0]):
                    with contextlib.suppress(OSError):
                        entry[0].send(b"x")
                        continue
                if entry is not None:
                    self.held.append(time.monotonic() - entry[1])
                    entry[0].close()
                socks[i] = self._open(i)
        for entry in socks:
            if entry is not None:
                entry[0].close()

    @staticmethod
    def _alive(sock: socket.socket) -> bool:
        """False once the server closed it (EOF or reset); a response waiting is drained."""
        try:
            while True:
                if not sock.recv(65536):
                    return False
        except BlockingIOError:
            return True
        except OSError:
            return False


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of attack measured")
    ap.add_argument("--sockets", type=int, default=40)
    ap.add_argument("--every", type=float, default=2.0, help="seconds between body bytes")
    ap.add_argument("--server-args", default="", help="more kvgate serve options")
    a = ap.parse_args()
    import kvgate

    print(f"kvgate from {Path(kvgate.__file__).resolve().parent}")
    work = Path(tempfile.mkdtemp(prefix="kvgate-trickle-"))
    model = build_model(work / "model")
    keys = work / "keys.txt"
    keys.write_text(f"{KEY} bench\n")
    port = 8431
    url = f"http://127.0.0.1:{port}"
    proc = start(model, keys, port, a.server_args.split())
    try:
        wait_healthy(url, proc)
        attacker = Attacker(port, a.sockets, a.every)
        attacker.thread.start()
        time.sleep(2 * a.every)  # every socket open and trickling
        statuses: dict[str, int] = {}
        latencies: list[float] = []
        end = time.monotonic() + a.duration
        i = 0
        while time.monotonic() < end:
            path = "/health" if i % 2 == 0 else "/v1/models"
            i += 1
            t = time.monotonic()
            try:
                resp = httpx.get(url + path, headers={"authorization": f"Bearer {KEY}"}, timeout=10)
                status = str(resp.status_code)
            except httpx.TransportError as exc:
                status = type(exc).__name__
            latencies.append(time.monotonic() - t)
            statuses[status] = statuses.get(status, 0) + 1
            time.sleep(0.2)
        attacker.stop.set()
        attacker.thread.join(30)
    finally:
        proc.terminate()
        proc.wait(60)
    ok = statuses.get("200", 0)
    print(f"legitimate requests: {sum(statuses.values())}, 200: {ok}, by status: {statuses}")
    print(
        f"latency ms: p50 {1000 * statistics.median(latencies):.1f}, "
        f"p99 {1000 * pct(latencies, 0.99):.1f}, max {1000 * max(latencies):.1f}"
    )
    held = attacker.held
    print(
        f"attacker: {attacker.opened} connections opened; {len(held)} closed by the server"
        + (
            f", held for median {statistics.median(held):.1f} s, max {max(held):.1f} s"
            if held
            else ""
        )
    )


if __name__ == "__main__":
    main()

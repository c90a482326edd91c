"""``kvgate serve`` as a user runs it: a process, a config file, start-up lines, a clean exit."""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from kvgate.errors import InvalidConfig
from kvgate.launch.server import check_data_dirs
from kvgate.server.config import ServerConfig
from tests.server.conftest import _free_port

#: Outside the fast tier (scripts/test.sh --fast): `kvgate serve` in processes of its own.
pytestmark = pytest.mark.slow


def _serve(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvgate.entrypoints.cli", "serve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


class _Output:
    """The server's output, read on a thread as it comes, so a test can wait for a line."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()

    def wait_for(self, text: str, timeout: float = 60) -> None:
        with self._changed:
            found = self._changed.wait_for(lambda: text in "".join(self.lines), timeout)
        assert found, f"no {text!r} in the server's output: {self.text()}"

    def text(self) -> str:
        with self._changed:
            return "".join(self.lines)

    def finish(self, timeout: float = 30) -> str:
        """Wait for the process to exit, then everything it wrote."""
        self.proc.wait(timeout)
        self._thread.join(timeout)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.text()


def _wait_healthy(proc: subprocess.Popen[str], url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, "the server exited before it was healthy"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not become healthy"
        time.sleep(0.1)


def test_serve_from_a_config_file(tiny_llama_dir: Path, tmp_path: Path) -> None:
    port = _free_port()
    config = tmp_path / "kvgate.toml"
    config.write_text(
        f'model = "{tiny_llama_dir}"\ndtype = "float32"\nport = {port}\n'
        'kv-cache-memory = "16MiB"\nmax_model_len = 256\nserved-model-name = "tiny"\n'
    )
    proc = _serve("--config", str(config))
    try:
        _wait_healthy(proc, f"http://127.0.0.1:{port}")
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "tiny", "prompt": "hello", "max_tokens": 3},
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert f"http://127.0.0.1:{port}/v1" in out
    assert "KV pool" in out and "blocks x 16 tokens" in out and "GiB" in out
    assert '"path": "/v1/completions"' in out  # the JSON access log line


def test_a_port_in_use_is_an_error_before_the_model_loads(tiny_llama_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _serve(
            "--model", str(tiny_llama_dir), "--dtype", "float32", "--host", "127.0.0.1",
            "--port", str(port), "--kv-cache-memory", "16MiB", "--max-model-len", "256",
        )  # fmt: skip
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2, out
    assert f"cannot listen on 127.0.0.1:{port}" in out and "--port" in out, out
    assert "startup complete" not in out and "KV pool" not in out and "Traceback" not in out


def test_a_model_that_cannot_load_exits_non_zero(tmp_path: Path) -> None:
    proc = _serve("--model", str(tmp_path / "missing"), "--port", str(_free_port()))
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "failed to load" in out and "missing" in out
    assert "Traceback" not in out


def test_sighup_reloads_the_tenants_file(tiny_llama_dir: Path, tmp_path: Path) -> None:
    port = _free_port()
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[tenants.a]\nkeys = ["sk-a"]\n')
    proc = _serve(
        "--model", str(tiny_llama_dir), "--dtype", "float32", "--port", str(port),
        "--kv-cache-memory", "16MiB", "--max-model-len", "256", "--tenants", str(tenants),
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    output = _Output(proc)

    def status(key: str) -> int:
        return httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code

    try:
        _wait_healthy(proc, url)
        assert (status("sk-a"), status("sk-b")) == (200, 401)
        tenants.write_text('[tenants.a]\nkeys = ["sk-a"]\n[tenants.b]\nkeys = ["sk-b"]\n')
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while status("sk-b") != 200:
            assert time.monotonic() < deadline, "SIGHUP did not reload the tenants file"
            time.sleep(0.1)
        output.wait_for("tenants reloaded")
        tenants.write_text("not = [valid\n")
        proc.send_signal(signal.SIGHUP)
        output.wait_for("keeping the old one")
        assert (status("sk-a"), status("sk-b")) == (200, 200)  # a bad file keeps the old one
    finally:
        proc.send_signal(signal.SIGINT)
        output.finish()


def test_sighup_without_a_tenants_file_does_not_end_the_server(
    tiny_llama_dir: Path,
) -> None:
    port = _free_port()
    proc = _serve(
        "--model", str(tiny_llama_dir), "--dtype", "float32", "--port", str(port),
        "--kv-cache-memory", "16MiB", "--max-model-len", "256",
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    output = _Output(proc)
    try:
        _wait_healthy(proc, url)
        proc.send_signal(signal.SIGHUP)
        output.wait_for("no tenants file to reload")
        assert proc.poll() is None and httpx.get(f"{url}/health").status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        out = output.finish()
    assert proc.returncode == 0, out


def test_sigterm_drains_then_exits(tiny_llama_dir: Path) -> None:
    """A rolling restart's SIGTERM: readiness 503 at once, new requests 503 with
    Retry-After, the stream in flight runs to its end, then a clean exit."""
    port = _free_port()
    proc = _serve(
        "--model", str(tiny_llama_dir), "--dtype", "float32", "--port", str(port),
        "--kv-cache-memory", "16MiB", "--max-model-len", "2048", "--shutdown-timeout", "60",
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    lines: list[str] = []
    started = threading.Event()

    def stream() -> None:
        # Long enough that the server is still generating when /health is asked: the tiny
        # model makes a token in about a millisecond on a fast core, and a slow reader alone
        # does not hold the request (the socket buffers take a few hundred short events).
        body = {"prompt": "a b c", "max_tokens": 1800, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    started.set()
                    if len(lines) < 100:
                        time.sleep(0.02)  # a slow reader at first, then as fast as it can

    try:
        _wait_healthy(proc, url)
        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(30)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while (health := httpx.get(f"{url}/health", timeout=5)).status_code == 200:
            assert time.monotonic() < deadline, "SIGTERM did not start a drain"
            time.sleep(0.05)
        assert health.status_code == 503 and health.json()["status"] == "draining"
        assert health.json()["in_flight"] == 1  # the stream, still running
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=5)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "server_shutting_down"
        assert refused.headers["retry-after"] == "1"
        reader.join(60)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)  # reaped and its pipe closed, even after a failure
    assert lines[-1] == "data: [DONE]" and len(lines) > 100  # the stream was not cut
    assert proc.returncode == 0
    assert "draining" in out and "drained" in out and "Traceback" not in out


def test_a_data_dir_others_may_read_is_refused_with_strict_data_dir(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """Refused before the model loads and before anything is written there."""
    data = tmp_path / "shared-data"
    data.mkdir()
    data.chmod(0o755)
    ledger = tmp_path / "ledger"  # pytest's tmp_path is 0700: only the data dir is exposed
    usage = str(ledger / "usage.sqlite3")
    proc = _serve("--model", str(tiny_llama_dir), "--data-dir", str(data), "--strict-data-dir",
                  "--usage-db", usage, "--port", str(_free_port()))  # fmt: skip
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out
    assert f"{data} has mode 0755 (others may read it)" in out and "--strict-data-dir" in out
    assert not any(data.iterdir()) and not ledger.exists()


def test_a_data_dir_others_may_read_is_a_warning_without_strict_data_dir(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data, ledger = tmp_path / "data", tmp_path / "state" / "usage.sqlite3"
    config = ServerConfig(data_dir=str(data), usage_db=str(ledger))
    assert check_data_dirs(config) == []  # not there yet: kvgate will make them 0700
    data.mkdir(mode=0o750)
    data.chmod(0o750)
    with caplog.at_level(logging.WARNING, "kvgate.server"):
        assert check_data_dirs(config) == [f"{data} has mode 0750 (others may read it)"]
    assert "other local users may read" in caplog.text
    data.chmod(0o700)
    assert check_data_dirs(config) == []
    with pytest.raises(InvalidConfig, match="mode 0711"):
        data.chmod(0o711)  # others may enter it and open what they can name
        check_data_dirs(
            ServerConfig(data_dir=str(data), usage_db=str(ledger), strict_data_dir=True)
        )

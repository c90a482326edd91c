"""Limits enforced before work is done: body size and stalls, keys before parsing, header
timeouts, the connection limit (issue 13's observed findings, each with a regression test)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from kvgate.errors import InvalidConfig
from kvgate.server.config import ServerConfig
from kvgate.server.limits import RequestLimits
from tests.conftest import tiny_engine_config
from tests.server.conftest import API_KEY, METRICS_KEY, MODEL, LiveServer, start_server

LIMITS = RequestLimits(
    max_body_bytes=64 * 1024,
    header_timeout=1.0,
    body_timeout=1.0,
    max_connections=16,
    max_connections_per_client=32,  # over the limit: its test holds every slot from here
)


@pytest.fixture(scope="module")
def guarded(tiny_llama_dir: Path, api_keys_file: Path) -> Iterator[LiveServer]:
    live = start_server(
        tiny_engine_config(tiny_llama_dir),
        ServerConfig(served_model_name=MODEL, api_keys_file=str(api_keys_file), limits=LIMITS),
    )
    yield live
    live.stop()


def _connect(live: LiveServer) -> socket.socket:
    host, port = live.base_url.removeprefix("http://").split(":")
    # Far above the server's 1 s timeouts: waiting on the server to act, not on a clock.
    return socket.create_connection((host, int(port)), timeout=60)


def _read_response(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (it must close it)."""
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            raise AssertionError(f"the server did not close the connection: {data!r}") from None
        if not chunk:
            return data
        data += chunk


def _eventually(check: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.05)


def test_a_body_over_the_limit_is_413_before_the_key_is_checked(guarded: LiveServer) -> None:
    body = b'{"prompt": "' + b"a" * (100 * 1024) + b'"}'
    resp = httpx.post(
        f"{guarded.api_url}/completions",
        content=body,
        headers={"content-type": "application/json"},  # and no key at all
    )
    assert resp.status_code == 413
    err = resp.json()["error"]
    assert err["code"] == "request_too_large" and "65536" in err["message"]


def test_a_chunked_body_is_cut_off_once_it_passes_the_limit(guarded: LiveServer) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(200):  # 1.6 MB in all, sent without a Content-Length
            yield b"a" * 8192
        yield b'"}'

    resp = httpx.post(
        f"{guarded.api_url}/completions",
        content=chunks(),
        headers={"authorization": f"Bearer {API_KEY}", "content-type": "application/json"},
    )
    assert resp.status_code == 413
    assert resp.json()["error"]["code"] == "request_too_large"


def test_the_key_is_checked_before_the_body_is_parsed(guarded: LiveServer) -> None:
    # Not JSON at all: a server that parses before it authenticates answers 400.
    resp = httpx.post(
        f"{guarded.api_url}/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert resp.status_code == 401
    assert resp.json()["error"]["type"] == "authentication_error"
    resp = httpx.post(
        f"{guarded.api_url}/chat/completions",
        content=b"{not json",
        headers={"authorization": "Bearer sk-wrong", "content-type": "application/json"},
    )
    assert resp.status_code == 401


def test_a_stalled_body_gets_408(guarded: LiveServer) -> None:
    with _connect(guarded) as sock:
        head = (
            "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"authorization: Bearer {API_KEY}\r\ncontent-length: 1000\r\n\r\n"
        )
        sock.sendall(head.encode() + b'{"prompt": "hel')  # and then nothing
        data = _read_response(sock)
    assert data.startswith(b"HTTP/1.1 408")
    body = json.loads(data.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "request_timeout"


def test_half_sent_headers_are_closed_after_the_header_timeout(guarded: LiveServer) -> None:
    with _connect(guarded) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-slow: ")
        assert _read_response(sock) == b""  # closed by the server, no response


def test_slow_headers_after_a_keep_alive_response_are_closed_too(guarded: LiveServer) -> None:
    with _connect(guarded) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        first = b""
        while b"}" not in first:  # the whole first response (a small JSON body)
            chunk = sock.recv(65536)
            assert chunk, first
            first += chunk
        assert first.startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /health HTTP/1.1\r\nhost")  # the next request, never finished
        assert _read_response(sock) == b""


def test_connections_past_the_limit_get_503(guarded: LiveServer) -> None:
    held = [_connect(guarded) for _ in range(LIMITS.max_connections)]
    health = f"{guarded.base_url}/health"
    try:
        # Once the server has accepted them all (no clock: it is asked until it says so).
        _eventually(lambda: httpx.get(health).status_code == 503)
    finally:
        for sock in held:
            sock.close()
    _eventually(lambda: httpx.get(health).status_code == 200)


def test_limits_must_be_positive() -> None:
    with pytest.raises(InvalidConfig, match="max_body_bytes"):
        RequestLimits(max_body_bytes=0)
    with pytest.raises(InvalidConfig, match="header_timeout"):
        RequestLimits(header_timeout=0)


def test_metrics_show_tenants_only_to_a_metrics_or_admin_key(live_server: LiveServer) -> None:
    httpx.post(
        f"{live_server.api_url}/completions",
        json={"prompt": "so team-a has series", "max_tokens": 2},
        headers={"authorization": f"Bearer {API_KEY}"},
    )
    public = httpx.get(f"{live_server.base_url}/metrics").text
    assert "vllm:num_requests_running" in public  # the aggregates stay open for scrapers
    assert "kvgate:tenant_" not in public and "team-a" not in public
    as_tenant = httpx.get(
        f"{live_server.base_url}/metrics", headers={"authorization": f"Bearer {API_KEY}"}
    ).text
    assert "team-a" not in as_tenant
    full = httpx.get(
        f"{live_server.base_url}/metrics", headers={"authorization": f"Bearer {METRICS_KEY}"}
    ).text
    assert 'kvgate:tenant_prompt_tokens_total{model_name="tiny",tenant="team-a"}' in full


def test_the_api_schema_needs_a_key(live_server: LiveServer) -> None:
    assert httpx.get(f"{live_server.base_url}/openapi.json").status_code == 401
    for key in (API_KEY, METRICS_KEY):
        resp = httpx.get(
            f"{live_server.base_url}/openapi.json", headers={"authorization": f"Bearer {key}"}
        )
        assert resp.status_code == 200 and "/v1/chat/completions" in resp.json()["paths"]

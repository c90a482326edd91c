"""Connections held without a key (issue 43): trickled bodies, bodies still arriving after an
early response, and one address taking every connection slot. The audit's probe in small: a
real server with ``max_connections`` 40, raw sockets, an attacker on 127.0.0.2 (Linux routes
all of 127/8 to loopback) and the legitimate client on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvgate.errors import InvalidConfig
from kvgate.server.config import ServerConfig
from kvgate.server.http import ClientCounts
from kvgate.server.limits import BodyClock, RequestLimits
from tests.conftest import tiny_engine_config
from tests.server.conftest import API_KEY, MODEL, LiveServer, start_server

LIMITS = RequestLimits(
    header_timeout=2.0,
    body_timeout=30.0,  # longer than the others: what closes each body here is a new limit
    body_deadline=3.0,
    min_body_rate=64,
    body_rate_grace=1.0,
    max_connections=40,
    max_connections_per_client=10,
)
ATTACKER = "127.0.0.2"
#: Generous: every limit here is a few seconds; a connection still open after this is held.
BOUND = 30.0


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, api_keys_file: Path) -> Iterator[LiveServer]:
    live = start_server(
        tiny_engine_config(tiny_llama_dir),
        ServerConfig(served_model_name=MODEL, api_keys_file=str(api_keys_file), limits=LIMITS),
    )
    yield live
    live.stop()


def _connect(live: LiveServer, source: str = "127.0.0.1") -> socket.socket:
    host, port = live.base_url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.bind((source, 0))
    sock.settimeout(10)
    sock.connect((host, int(port)))
    return sock


def _head(path: str, key: str | None = None, length: int = 1_000_000) -> bytes:
    auth = f"authorization: Bearer {key}\r\n" if key else ""
    return (
        f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{auth}"
        f"content-length: {length}\r\n\r\n"
    ).encode()


def _trickle_until_closed(sock: socket.socket, chunk: bytes, every: float) -> bytes:
    """Send ``chunk`` every ``every`` seconds until the server closes the connection (EOF or
    reset); what it answered meanwhile. Fails if it is still open after ``BOUND`` seconds."""
    answer = b""
    sock.settimeout(every)
    deadline = time.monotonic() + BOUND
    while time.monotonic() < deadline:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            try:
                sock.sendall(chunk)
            except OSError:
                return answer  # reset: closed
            continue
        except OSError:
            return answer
        if not data:
            return answer
        answer += data
    raise AssertionError(f"still open after {BOUND:g} s, having answered {answer[:200]!r}")


def _error(answer: bytes) -> tuple[int, dict[str, object]]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


@pytest.mark.slow
def test_a_keyed_body_trickled_fast_enough_for_the_rate_meets_the_deadline(
    server: LiveServer,
) -> None:
    # 64 bytes every 0.2 s: 320 bytes/s, over the minimum rate; each read well inside the
    # stall timeout; but 1 MB at that rate would hold the connection for 52 minutes.
    with _connect(server) as sock:
        sock.sendall(_head("/v1/chat/completions", API_KEY) + b'{"messages": "')
        status, err = _error(_trickle_until_closed(sock, b"a" * 64, 0.2))
    assert status == 408 and err["code"] == "request_timeout"
    assert "3 s in all" in str(err["message"])


def test_a_keyed_body_slower_than_the_minimum_rate_gets_408(server: LiveServer) -> None:
    with _connect(server) as sock:
        sock.sendall(_head("/v1/chat/completions", API_KEY))
        status, err = _error(_trickle_until_closed(sock, b" ", 0.2))  # 5 bytes/s
    assert status == 408 and err["code"] == "request_timeout"
    assert "64 bytes/s" in str(err["message"])


def test_a_body_without_a_key_is_answered_401_and_closed(server: LiveServer) -> None:
    with _connect(server) as sock:
        sock.sendall(_head("/v1/chat/completions"))
        status, err = _error(_trickle_until_closed(sock, b" ", 0.2))
    assert status == 401 and err["code"] == "invalid_api_key"


@pytest.mark.parametrize("path", ["/metrics", "/health", "/no-such-path"])
def test_a_body_still_arriving_after_an_early_response_is_closed(
    server: LiveServer, path: str
) -> None:
    """405, 404 or 200 without the body read: uvicorn drops the rest as it comes, so before,
    a byte every few seconds held the connection for ever (the keep-alive timer restarts on
    each byte, and the header timer waits for an idle peer)."""
    with _connect(server) as sock:
        sock.sendall(_head(path))
        answer = _trickle_until_closed(sock, b"x", 0.2)
    assert answer.startswith(b"HTTP/1.1 "), answer


def test_a_complete_body_answered_keeps_its_connection(server: LiveServer) -> None:
    """Only a body still arriving closes the connection: a request answered after its whole
    body arrived keeps the connection alive for the next one."""
    with _connect(server) as sock:
        for _ in range(3):
            sock.sendall(b"POST /metrics HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
            answer = b""
            while not answer.endswith(b"}"):  # the whole 405 (a small JSON body)
                chunk = sock.recv(65536)
                assert chunk, f"closed after {answer!r}"
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 405")


def test_one_address_past_its_cap_is_refused_and_others_are_not(server: LiveServer) -> None:
    held = [_connect(server, ATTACKER) for _ in range(LIMITS.per_client_connections)]
    try:
        with _connect(server, ATTACKER) as extra:
            extra.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            status, err = _error(_trickle_until_closed(extra, b"", 0.2))
        assert status == 503 and err["code"] == "too_many_connections"
        assert httpx.get(f"{server.base_url}/health").status_code == 200
    finally:
        for sock in held:
            sock.close()
    # The closed ones are given back: the address may connect again.
    deadline = time.monotonic() + BOUND
    while True:
        with _connect(server, ATTACKER) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            if _trickle_until_closed(sock, b"", 0.2).startswith(b"HTTP/1.1 200"):
                break
        assert time.monotonic() < deadline, "the address's connections were not given back"


class _Trickler:
    """``n`` sockets trickling a byte every ``every`` seconds, half into ``POST /metrics`` and
    half into a keyed chat request, each from its own source address in ``sources`` (cycled);
    with ``reopen``, a socket the server closes is opened again at once."""

    def __init__(
        self, live: LiveServer, n: int, sources: list[str], reopen: bool, every: float = 0.2
    ) -> None:
        self.live, self.n, self.sources, self.reopen, self.every = live, n, sources, reopen, every
        self.stop = threading.Event()
        self.closed = 0  # connections the server closed
        self.socks: list[socket.socket | None] = [self._open(i) for i in range(n)]
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _open(self, i: int) -> socket.socket | None:
        try:
            sock = _connect(self.live, self.sources[i % len(self.sources)])
            sock.sendall(_head("/metrics") if i % 2 else _head("/v1/chat/completions", API_KEY))
        except OSError:
            return None
        sock.setblocking(False)
        return sock

    def _run(self) -> None:
        while not self.stop.wait(self.every):
            for i, sock in enumerate(self.socks):
                if sock is None:
                    continue
                try:
                    while True:  # drain what was answered; EOF or reset: closed
                        if not sock.recv(65536):
                            raise ConnectionResetError
                except BlockingIOError:
                    with contextlib.suppress(OSError):
                        sock.send(b"x")
                        continue
                except OSError:
                    pass
                sock.close()
                self.closed += 1
                self.socks[i] = self._open(i) if self.reopen else None

    def close(self) -> None:
        self.stop.set()
        self.thread.join(BOUND)
        for sock in self.socks:
            if sock is not None:
                sock.close()


def test_forty_trickling_sockets_from_one_address_do_not_stop_a_request(
    server: LiveServer,
) -> None:
    """The audit's probe: 40 sockets on a 40-connection server, opened again whenever closed.
    Before, every legitimate request got 503 while they lasted."""
    attack = _Trickler(server, LIMITS.max_connections, [ATTACKER], reopen=True)
    try:
        for _ in range(10):
            with httpx.Client(base_url=server.base_url, timeout=BOUND) as http:
                assert http.get("/health").status_code == 200
                models = http.get("/v1/models", headers={"authorization": f"Bearer {API_KEY}"})
                assert models.status_code == 200
    finally:
        attack.close()
    assert attack.closed > 0  # the cap's refusals, and the early responses' closes


def test_forty_trickling_sockets_from_forty_addresses_are_each_closed(
    server: LiveServer,
) -> None:
    """No address over its cap: the server's own limits close them all, the early-answered
    ones at once, the keyed ones by the body rate, so a request gets through."""
    sources = [f"127.0.0.{2 + i}" for i in range(LIMITS.max_connections)]
    attack = _Trickler(server, LIMITS.max_connections, sources, reopen=False)
    try:
        deadline = time.monotonic() + BOUND
        while httpx.get(f"{server.base_url}/health", timeout=BOUND).status_code != 200:
            assert time.monotonic() < deadline, "no slot freed"
            time.sleep(0.1)
        deadline = time.monotonic() + BOUND
        while attack.closed < LIMITS.max_connections:
            assert time.monotonic() < deadline, f"only {attack.closed} closed"
            time.sleep(0.1)
    finally:
        attack.close()


def test_the_body_clock_names_the_first_limit_to_break() -> None:
    lim = RequestLimits(
        body_timeout=5.0, body_deadline=60.0, min_body_rate=100, body_rate_grace=2.0
    )
    clock = BodyClock(lim, start=100.0)
    # 1000 bytes are due by 2 + 10 s: the stall timeout (from the last bytes) comes first.
    left, why = clock.left(1000, now=101.0)
    assert left == pytest.approx(4.0) and "no bytes" in why
    clock.last = 104.0
    left, why = clock.left(1000, now=105.0)
    assert left == pytest.approx(4.0) and "no bytes" in why
    left, why = clock.left(100, now=105.0)
    assert left == pytest.approx(-2.0) and "100 bytes/s" in why
    clock.last = 159.0
    left, why = clock.left(10**6, now=159.5)
    assert left == pytest.approx(0.5) and "60 s in all" in why
    off = BodyClock(RequestLimits(min_body_rate=0, body_timeout=1.0), start=0.0)
    assert "no bytes" in off.left(0, now=50.0)[1]


def test_client_counts_cap_each_address_and_give_back() -> None:
    counts = ClientCounts(2)
    assert counts.take("a") and counts.take("a") and not counts.take("a")
    assert counts.take("b")
    counts.give("a")
    assert counts.open_from("a") == 1 and counts.take("a")
    counts.give("a")
    counts.give("a")
    assert counts.open_from("a") == 0


def test_connection_limits_are_checked() -> None:
    assert RequestLimits(max_connections=40).per_client_connections == 10
    assert RequestLimits(max_connections=2).per_client_connections == 1
    for bad in (
        {"max_connections_per_client": 0},
        {"body_deadline": 0},
        {"body_rate_grace": -1},
        {"min_body_rate": -1},
    ):
        with pytest.raises(InvalidConfig, match=next(iter(bad))):
            RequestLimits(**bad)  # type: ignore[arg-type]

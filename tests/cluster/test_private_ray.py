"""Ray as ``kvgate serve --replicas`` starts it (``private_ray.py``): every port of every
Ray process on loopback, read from ``/proc/net/tcp``; its GCS refusing a call without the
token; the token file 0600; and a Ray without token authentication refused before it
starts."""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path

import pytest

from kvgate.cluster.private_ray import prepare, private_token_file, token_file
from kvgate.errors import InvalidConfig


def _tree(root: int) -> set[int]:
    """``root`` and every process below it."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    tree = {root}
    while True:
        more = {pid for pid, ppid in parents.items() if ppid in tree} - tree
        if not more:
            return tree
        tree |= more


def _address(hex_address: str) -> str:
    """``/proc/net/tcp[6]``'s local address (host byte order, per 32-bit word)."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def _listening(pids: set[int]) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every TCP socket that ``pids`` listen on."""
    owner: dict[str, int] = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    owner[target[8:-1]] = pid
        except OSError:
            continue
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in owner:  # 0A: LISTEN
                host, port = local.split(":")
                found.append((_address(host), int(port, 16), owner[inode]))
    return found


def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def _unauthenticated(port: int) -> bool:
    """Whether the gRPC server on ``port`` refuses a call that carries no token."""
    import grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary("/ray.serve.ASGIService/HandleRequest")
        try:
            call(b"", timeout=30)
        except grpc.RpcError as exc:
            return bool(exc.code() == grpc.StatusCode.UNAUTHENTICATED)
    return False


@pytest.mark.slow
def test_every_ray_port_is_on_the_given_host_and_wants_the_token(url: str) -> None:
    ray = pytest.importorskip("ray")
    from kvgate.cluster.private_ray import call_without_token

    sockets = _listening(_tree(os.getpid()))
    names = {pid: Path(f"/proc/{pid}/comm").read_text().strip() for _, _, pid in sockets}
    # GCS, raylet, the agents, workers (Serve's controller, proxy, replicas), this driver.
    assert {"gcs_server", "raylet"} <= set(names.values()), sockets
    assert len(sockets) >= 8, sockets
    port = int(url.rsplit(":", 1)[1])
    assert ("127.0.0.1", port) in {(a, p) for a, p, _ in sockets}  # the Serve proxy, --host
    # The one exception: Ray Serve binds each replica's inter-deployment gRPC server to
    # [::]:0, hard-coded (ray/serve/_private/replica.py, ``_on_initialized``); it must at
    # least want the token.
    outside = [(a, p, names[pid]) for a, p, pid in sockets if not _loopback(a)]
    assert all(name.startswith("ray::ServeRepli") for _, _, name in outside), outside
    assert all(_unauthenticated(p) for _, p, _ in outside), outside
    assert call_without_token(ray.get_runtime_context().gcs_address) == "UNAUTHENTICATED"
    path = token_file(os.environ)
    assert path is not None and path.stat().st_mode & 0o777 == 0o600


def test_a_ray_without_token_authentication_is_refused_before_it_starts() -> None:
    environ = {"RAY_AUTH_MODE": "disabled"}
    with pytest.raises(InvalidConfig, match="token authentication only"):
        prepare(environ, local=True)
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in environ  # refused before anything


def test_start_refuses_a_ray_without_token_authentication(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvgate.cluster.app import ClusterSpec, start

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    with pytest.raises(InvalidConfig, match="RAY_AUTH_MODE=disabled"):
        start(ClusterSpec(("--model", "unused")), "127.0.0.1", 1)


def test_the_token_file_is_made_0600_whatever_the_umask(tmp_path: Path) -> None:
    path = tmp_path / "ray" / "auth_token"
    environ = {"RAY_AUTH_TOKEN_PATH": str(path)}
    old = os.umask(0o022)
    try:
        prepare(environ, local=True)
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o600 and len(path.read_text()) == 64
    assert environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    assert token_file({"RAY_AUTH_TOKEN": "t", "RAY_AUTH_TOKEN_PATH": str(path)}) is None


def test_a_token_file_others_can_read_is_tightened(tmp_path: Path) -> None:
    path = tmp_path / "auth_token"
    path.write_text("secret")
    path.chmod(0o644)  # as Ray writes it
    private_token_file(path, create=False)
    assert path.stat().st_mode & 0o777 == 0o600 and path.read_text() == "secret"
    private_token_file(tmp_path / "missing", create=False)  # joining a cluster: never made
    assert not (tmp_path / "missing").exists()


def test_proc_addresses_are_read_as_ss_shows_them() -> None:
    with socket.socket(socket.AF_INET6) as s6, socket.socket() as s4:
        s4.bind(("127.0.0.1", 0))
        s4.listen()
        s6.bind(("::1", 0))
        s6.listen()
        mine = {(a, p) for a, p, _ in _listening({os.getpid()})}
        assert ("127.0.0.1", s4.getsockname()[1]) in mine
        assert ("::1", s6.getsockname()[1]) in mine
    assert _loopback("::ffff:127.0.0.1") and not _loopback("0.0.0.0") and not _loopback("::")

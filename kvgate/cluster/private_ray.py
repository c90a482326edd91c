"""A Ray that only this host can reach, and only with its token (``app.start``).

Where Ray listens: its gRPC servers (GCS, raylet, object manager, every worker's), its
agents (dashboard agent, runtime env agent) and its Prometheus exporters (autoscaler,
dashboard, metrics agent) bind to loopback when the node IP is loopback, and to every
interface otherwise. ``ray.init`` replaces a loopback node IP by the host's outward address,
except in Ray's single-machine mode, ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (meant for
laptops; on Linux it changes nothing else: ``ray._private.services.get_node_ip_address``),
which Ray reads once, when it is imported. A cluster that ``kvgate serve --replicas`` starts
is one machine, so its Ray is on loopback whatever ``--host`` is; the Serve proxy, the one
port clients use, is on ``--host``.

Who may call it: token authentication (``RAY_AUTH_MODE=token``), which a new local Ray turns
on by default since 2.59 unless ``RAY_AUTH_MODE`` says otherwise. kvgate refuses any other
mode, writes the token file 0600 before Ray would write it with the umask (0644), and, once
Ray is up, checks that its GCS refuses a call that carries no token.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from kvgate.errors import InvalidConfig

log = logging.getLogger("kvgate.cluster")

#: Off ("0"): Ray keeps a loopback node IP (see the module's docstring).
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
AUTH_MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"


def token_file(environ: Mapping[str, str]) -> Path | None:
    """Where Ray reads its token: None when the environment holds the token itself."""
    if environ.get(TOKEN_ENV):
        return None
    return Path(environ.get(TOKEN_PATH_ENV) or Path.home() / ".ray" / "auth_token")


def private_token_file(path: Path, *, create: bool) -> None:
    """``path`` 0600: made so if ``create`` and missing (256 random bits, as Ray makes its
    own), tightened if it is there and others may read it."""
    if create and not path.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # made meanwhile by another start: tightened below
            pass
        else:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
            log.info("Ray's token: %s (new, 0600)", path)
    if path.exists() and path.stat().st_mode & 0o077:
        path.chmod(0o600)
        log.warning("Ray's token file %s could be read by other users: made it 0600", path)


def prepare(environ: MutableMapping[str, str], *, local: bool) -> None:
    """Before Ray is imported (it reads its environment then): refuse a Ray without token
    authentication, keep a local one on loopback, and its token file private.

    ``environ`` is the process's environment: Ray takes its settings from there, and Ray's
    own processes (GCS, raylet, workers) inherit them."""
    mode = environ.get(AUTH_MODE_ENV)
    if mode is not None and mode.lower() != "token":
        raise InvalidConfig(
            f"{AUTH_MODE_ENV}={mode}: kvgate runs Ray with token authentication only; "
            f"unset {AUTH_MODE_ENV} or set it to 'token'",
            param=AUTH_MODE_ENV,
        )
    if local:
        environ[LOOPBACK_ENV] = "0"
    path = token_file(environ)
    if path is not None:
        private_token_file(path, create=local)


def verify(*, local: bool) -> None:
    """Once Ray is up: refuse a Ray that takes calls without the token or, started here,
    listens beyond loopback."""
    import ray
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    node_ip = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
    if local and not ipaddress.ip_address(node_ip).is_loopback:
        raise InvalidConfig(
            f"Ray's node IP is {node_ip}, so Ray would listen on every interface: Ray was "
            f"imported before kvgate could set {LOOPBACK_ENV}=0; set it in the environment"
        )
    if not is_token_auth_enabled():
        raise InvalidConfig(f"Ray runs without token authentication ({AUTH_MODE_ENV})")
    gcs = ray.get_runtime_context().gcs_address
    answer = call_without_token(gcs)
    if answer != "UNAUTHENTICATED":
        raise InvalidConfig(
            f"Ray's GCS at {gcs} is not checking tokens: a call with none got {answer}, "
            "not UNAUTHENTICATED"
        )


def call_without_token(gcs_address: str) -> str:
    """How the GCS at ``gcs_address`` answers a call that carries no token: ``answered``, or
    the gRPC status (``UNAUTHENTICATED`` when it checks tokens)."""
    import grpc  # type: ignore[import-untyped]
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    with grpc.insecure_channel(gcs_address) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)  # type: ignore[no-untyped-call]
        try:
            request = gcs_service_pb2.GetClusterIdRequest()  # type: ignore[attr-defined]
            stub.GetClusterId(request, timeout=30)
        except grpc.RpcError as exc:
            return str(exc.code().name)
    return "answered"

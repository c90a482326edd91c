"""A throwaway PostgreSQL server for the tests that need one (Debian's postgresql-15, which
``scripts/install.sh --test`` installs): a cluster made in a temporary folder, listening on a
free loopback port, fsync off, stopped and removed at the end of the session. Each test gets
a database of its own (``new_database``)."""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


def _bindir() -> Path | None:
    for initdb in sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), reverse=True):
        return Path(initdb).parent
    found = shutil.which("initdb")
    return Path(found).resolve().parent if found else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def postgres_server() -> Iterator[str]:
    """Start a server; yields the URL of its ``postgres`` database (user ``kvgate``)."""
    bindir = _bindir()
    if bindir is None:
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql-15)")
    root = Path(tempfile.mkdtemp(prefix="kvgate-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:  # initdb refuses root: run the server as Debian's postgres user
        owner = pwd.getpwnam("postgres")
        os.chown(root, owner.pw_uid, owner.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    data, port = root / "data", _free_port()

    def run(*args: str | Path) -> None:
        subprocess.run([*as_user, *map(str, args)], check=True, capture_output=True, timeout=60)

    run(bindir / "initdb", "-D", data, "-A", "trust", "-U", "kvgate", "-E", "UTF8",
        "--locale=C", "--no-sync")  # fmt: skip
    options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off"
    run(bindir / "pg_ctl", "-D", data, "-w", "-l", root / "log", "-o", options, "start")
    try:
        yield f"postgresql://kvgate@127.0.0.1:{port}/postgres"
    finally:
        run(bindir / "pg_ctl", "-D", data, "-m", "immediate", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)


def new_database(server_url: str) -> str:
    """A fresh, empty database on the server; its URL."""
    import psycopg

    name = f"t_{secrets.token_hex(6)}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return server_url.rsplit("/", 1)[0] + f"/{name}"

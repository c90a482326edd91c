"""The rows of stored responses (``server/responses/stored.py``) in SQLite and PostgreSQL:
ownership, the quota, retention, chains, cancel, and what a stopped process left."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvgate.retrieval.db import open_database
from kvgate.retrieval.quota import StorageQuotaExceeded
from kvgate.server.responses.stored import ResponseStore


@pytest.fixture(params=["sqlite", "postgres"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str | None:
    if request.param == "sqlite":
        return None
    db: str = request.getfixturevalue("postgres_db")
    return db


@pytest.fixture
def store(url: str | None, tmp_path: Path) -> Iterator[ResponseStore]:
    limits = {"beta": 2}
    s = ResponseStore.open(tmp_path, url, max_for=limits.get)
    yield s
    s.close()


def _response(rid: str, status: str = "in_progress", **fields: Any) -> dict[str, Any]:
    return {"id": rid, "object": "response", "created_at": int(time.time()), "status": status,
            "output": [], **fields}  # fmt: skip


def test_rows_belong_to_their_tenant(store: ResponseStore) -> None:
    store.create("alpha", _response("resp_a"), [{"id": "msg_1", "type": "message"}], None)
    assert store.get("resp_a", "beta") is None
    row = store.get("resp_a", "alpha")
    assert row is not None and row.status == "in_progress" and row.input[0]["id"] == "msg_1"
    assert store.get("resp_a", None) is not None  # an admin
    assert not store.delete("resp_a", "beta")
    store.finish(_response("resp_a", "completed"))
    assert store.get("resp_a", "alpha").status == "completed"  # type: ignore[union-attr]
    assert store.delete("resp_a", "alpha") and store.get("resp_a", None) is None


def test_the_quota_counts_the_tenants_rows(store: ResponseStore) -> None:
    for i in range(2):
        store.check_room("beta")
        store.create("beta", _response(f"resp_{i}"), [], None)
    with pytest.raises(StorageQuotaExceeded):
        store.check_room("beta")
    with pytest.raises(StorageQuotaExceeded):  # checked again as the row is written
        store.create("beta", _response("resp_2"), [], None)
    store.create("alpha", _response("resp_3"), [], None)  # no limit for alpha
    store.delete("resp_0", "beta")
    store.create("beta", _response("resp_2"), [], None)


def test_expired_rows_count_against_no_quota(url: str | None, tmp_path: Path) -> None:
    store = ResponseStore.open(tmp_path, url, retention_s=60, max_for={"beta": 1}.get)
    old = _response("resp_old")  # left in_progress by a process long gone
    old["created_at"] -= 120
    store.create("beta", old, [], None)
    store.check_room("beta")  # the expired row is no longer the tenant's
    store.create("beta", _response("resp_new"), [], None)
    store._swept = 0.0
    store.create("alpha", _response("resp_a"), [], None)  # a write sweeps
    assert store.status("resp_old") == "in_progress"  # unfinished: kept for a grace period
    aged = _response("resp_aged")
    aged["created_at"] -= 120 + 3600
    store.create("alpha", aged, [], None)
    store._swept = 0.0
    store.create("alpha", _response("resp_b"), [], None)
    assert store.status("resp_aged") is None
    store.close()


def test_a_started_background_row_reads_in_progress(store: ResponseStore) -> None:
    store.create("alpha", _response("resp_bg", "queued", background=True), [], None)
    assert store.get("resp_bg", "alpha").response["status"] == "queued"  # type: ignore[union-attr]
    store.started("resp_bg")
    assert store.get("resp_bg", "alpha").response["status"] == "in_progress"  # type: ignore[union-attr]


def test_a_chain_is_followed_oldest_first_within_its_tenant(store: ResponseStore) -> None:
    store.create("alpha", _response("resp_1"), [], None)
    store.create("alpha", _response("resp_2"), [], "resp_1")
    store.create("alpha", _response("resp_3"), [], "resp_2")
    assert [r.id for r in store.chain("resp_3", "alpha")] == ["resp_1", "resp_2", "resp_3"]
    assert store.chain("resp_3", "beta") == []
    store.delete("resp_1", "alpha")  # a deleted turn ends the chain there
    assert [r.id for r in store.chain("resp_3", "alpha")] == ["resp_2", "resp_3"]


def test_a_cancel_is_kept_against_a_late_finish(store: ResponseStore) -> None:
    store.create("alpha", _response("resp_c", "queued", background=True), [], None)
    store.cancel("resp_c")
    assert store.status("resp_c") == "cancelled"
    store.finish(_response("resp_c", "completed"))  # the run had not seen the cancel
    assert store.status("resp_c") == "cancelled"
    store.finish(_response("resp_c", "cancelled", output=[{"type": "message"}]), force=True)
    assert store.get("resp_c", None).response["output"] == [{"type": "message"}]  # type: ignore[union-attr]


def test_expired_rows_are_gone(url: str | None, tmp_path: Path) -> None:
    store = ResponseStore.open(tmp_path, url, retention_s=60)
    old = _response("resp_old", "completed")
    old["created_at"] -= 120
    store.create("alpha", old, [], None)
    assert store.get("resp_old", "alpha") is None  # past retention: not shown
    store._swept = 0.0
    store.create("alpha", _response("resp_new"), [], None)  # a write sweeps
    rows = store.db.rows("SELECT id FROM responses")
    assert [r[0] for r in rows] == ["resp_new"]
    store.close()


def _dead_pid() -> int:
    """The pid of a process that has ended."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_what_a_stopped_process_left_is_failed(url: str | None, tmp_path: Path) -> None:
    db = open_database(tmp_path, url)
    host = socket.gethostname()
    rows = {
        "resp_dead": f"{host}:{_dead_pid()}:aa",  # this host, its process gone
        "resp_live": f"{host}:{os.getppid()}:bb",  # this host, a process still running
        # this very pid, another store's token: a restarted container whose server got the
        # same pid (1) again
        "resp_reborn": f"{host}:{os.getpid()}:dd",
        "resp_away": f"elsewhere:{_dead_pid()}:cc",  # another host: not ours to judge
    }
    for rid, owner in rows.items():
        db.write(
            "INSERT INTO responses (id, tenant, created_at, status, previous_id, owner, "
            "response, input, bytes) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (rid, "alpha", int(time.time()), "in_progress", None, owner,
             json.dumps(_response(rid, background=True)), "[]", 0),
        )  # fmt: skip
    store = ResponseStore(db)
    dead = store.get("resp_dead", None)
    assert dead is not None and dead.status == "failed"
    assert dead.response["status"] == "failed" and "stopped" in dead.response["error"]["message"]
    assert store.status("resp_live") == "in_progress"
    assert store.status("resp_reborn") == "failed"
    assert store.status("resp_away") == "in_progress"
    db.close()

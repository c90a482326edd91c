"""Stored responses: ``store`` (default true), ``GET`` / ``DELETE /v1/responses/{id}``,
its ``input_items``, ``previous_response_id`` chains and background responses.

They live in the documents' database (``retrieval/db.py``: SQLite beside the files by
default, PostgreSQL shared by replicas), one row each: the response object and its own
input items as JSON, the tenant that owns it, the response it continues. A row is written
when the response is created (``in_progress``, or ``queued`` in the background: the
tenant's quota is checked then, before any work) and again when it ends.

A row belongs to its tenant: another tenant's id is a 404, as one that does not exist; an
admin key sees every row. Rows older than the retention are deleted (finished ones only).

What runs in the background runs in the process that accepted it, and nowhere else: a
response still ``queued`` or ``in_progress`` when its process ended is marked ``failed``
("the server stopped before it finished") by the next server on the same host that opens
the database. It is not resumed: its prompt's work would be done twice and billed twice.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgate.retrieval.db import Database, open_database
from kvgate.retrieval.quota import StorageQuotaExceeded

#: OpenAI keeps responses 30 days.
DEFAULT_RETENTION_S = 30 * 24 * 3600.0
#: Longest ``previous_response_id`` chain followed.
MAX_CHAIN = 256
#: Seconds between two sweeps of expired rows.
_SWEEP_EVERY_S = 60.0
_UNFINISHED = ("queued", "in_progress")
STOPPED = {
    "code": "server_error",
    "message": "the server stopped before this response finished; it was not resumed",
}


@dataclass(frozen=True)
class StoredResponse:
    id: str
    tenant: str
    status: str
    previous_id: str | None
    response: dict[str, Any]
    input: list[dict[str, Any]]


#: A tenant's rows that count against its quota: those not past the retention.
_COUNT = "SELECT COUNT(*) FROM responses WHERE tenant = ? AND created_at >= ?"
#: Seconds past the retention after which an unfinished row is deleted too (its process is
#: long gone; a live run would have ended).
_UNFINISHED_GRACE_S = 3600.0


def _full(tenant: str, most: int) -> StorageQuotaExceeded:
    return StorageQuotaExceeded(
        f"tenant {tenant!r} may store at most {most} responses; delete some (DELETE "
        "/v1/responses/{id}), wait for the oldest to expire, or send store: false",
        param="store",
    )


def _owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ResponseStore:
    """The rows of stored responses. ``max_for(tenant)``: how many the tenant may keep
    (None: no limit)."""

    def __init__(
        self,
        db: Database,
        retention_s: float = DEFAULT_RETENTION_S,
        max_for: Callable[[str], int | None] = lambda tenant: None,
        own_db: bool = False,
    ) -> None:
        self.db = db
        self.retention_s = retention_s
        self.max_for = max_for
        self.owner = _owner()
        self._own_db = own_db
        self._swept = 0.0
        self._lock = threading.Lock()
        self.recover()

    @classmethod
    def open(cls, directory: Path, url: str | None, **kwargs: Any) -> ResponseStore:
        """A store on a database of its own (the server runs without the documents store)."""
        return cls(open_database(directory, url), own_db=True, **kwargs)

    def close(self) -> None:
        if self._own_db:
            self.db.close()

    def recover(self) -> None:
        """Mark ``failed`` what a stopped process on this host left unfinished."""
        host = socket.gethostname()
        rows = self.db.rows(
            "SELECT id, owner, response FROM responses WHERE status IN (?, ?)", _UNFINISHED
        )
        for response_id, owner, raw in rows:
            owner_host, _, rest = str(owner).partition(":")
            pid = rest.partition(":")[0]
            if owner_host != host or not pid.isdigit():
                continue  # another host's
            if _alive(int(pid)) and not (int(pid) == os.getpid() and owner != self.owner):
                continue  # a process still running (this pid with another token: a container
                # restarted, whose server has the same pid again)
            response = json.loads(raw)
            response.update(status="failed", error=STOPPED)
            self.db.write(
                "UPDATE responses SET status = ?, response = ? WHERE id = ? AND status IN (?, ?)",
                ("failed", json.dumps(response), response_id, *_UNFINISHED),
            )

    def create(
        self,
        tenant: str,
        response: dict[str, Any],
        items: list[dict[str, Any]],
        previous_id: str | None,
    ) -> None:
        """The row of a response just created; refused past the tenant's quota."""
        self._sweep()
        raw, listed = json.dumps(response), json.dumps(items)
        most = self.max_for(tenant)
        with self.db.transaction() as tx:
            if self.db.lock_tenant:
                tx.rows(self.db.lock_tenant, (tenant,))
            if most is not None:
                (count,) = tx.rows(_COUNT, (tenant, self._cutoff()))[0]
                if int(count) >= most:
                    raise _full(tenant, most)
            tx.write(
                "INSERT INTO responses (id, tenant, created_at, status, previous_id, owner, "
                "response, input, bytes) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (response["id"], tenant, int(response["created_at"]), response["status"],
                 previous_id, self.owner, raw, listed, len(raw) + len(listed)),
            )  # fmt: skip

    def check_room(self, tenant: str) -> None:
        """Refuse, before any work, a response the tenant has no room to store."""
        most = self.max_for(tenant)
        if most is not None:
            (count,) = self.db.rows(_COUNT, (tenant, self._cutoff()))[0]
            if int(count) >= most:
                raise _full(tenant, most)

    def finish(self, response: dict[str, Any], force: bool = False) -> None:
        """The response's final object (completed, incomplete, failed or cancelled); a
        response cancelled meanwhile stays cancelled unless ``force`` (the cancelled
        run's own last word: what it had made by then)."""
        raw = json.dumps(response)
        guard = "" if force else " AND status <> 'cancelled'"
        self.db.write(
            f"UPDATE responses SET status = ?, response = ?, bytes = ? WHERE id = ?{guard}",
            (response["status"], raw, len(raw), response["id"]),
        )

    def status(self, response_id: str) -> str | None:
        rows = self.db.rows("SELECT status FROM responses WHERE id = ?", (response_id,))
        return str(rows[0][0]) if rows else None

    def get(self, response_id: str, tenant: str | None) -> StoredResponse | None:
        """The row, if ``tenant`` owns it (None: an admin, any row)."""
        owned, args = ("", ()) if tenant is None else (" AND tenant = ?", (tenant,))
        rows = self.db.rows(
            "SELECT id, tenant, status, previous_id, response, input FROM responses "
            f"WHERE id = ?{owned}",
            (response_id, *args),
        )
        if not rows:
            return None
        rid, owner, status, previous, raw, listed = rows[0]
        response = json.loads(raw)
        if self._expired(response):
            return None
        if status in _UNFINISHED:
            response["status"] = status  # queued -> in_progress is written to the column only
        return StoredResponse(rid, owner, status, previous, response, json.loads(listed))

    def cancel(self, response_id: str) -> None:
        """Mark a background response cancelled (it must be unfinished)."""
        row = self.get(response_id, None)
        if row is None or row.status not in _UNFINISHED:
            return
        response = {**row.response, "status": "cancelled"}
        self.db.write(
            "UPDATE responses SET status = 'cancelled', response = ? WHERE id = ? "
            "AND status IN (?, ?)",
            (json.dumps(response), response_id, *_UNFINISHED),
        )

    def delete(self, response_id: str, tenant: str | None) -> bool:
        owned, args = ("", ()) if tenant is None else (" AND tenant = ?", (tenant,))
        return self.db.write(f"DELETE FROM responses WHERE id = ?{owned}", (response_id, *args)) > 0

    def chain(self, response_id: str, tenant: str | None) -> list[StoredResponse]:
        """The responses a ``previous_response_id`` continues, oldest first, each owned by
        ``tenant`` (None: an admin, any); empty when the first is not found (a 404)."""
        out: list[StoredResponse] = []
        at: str | None = response_id
        while at is not None and len(out) < MAX_CHAIN:
            row = self.get(at, tenant)
            if row is None:
                break
            out.append(row)
            at = row.previous_id
        return out[::-1]

    def _cutoff(self) -> int:
        return int(time.time() - self.retention_s)

    def _expired(self, response: dict[str, Any]) -> bool:
        return float(response.get("created_at", 0)) < time.time() - self.retention_s

    def started(self, response_id: str) -> None:
        """A queued background response begins to run."""
        self.db.write(
            "UPDATE responses SET status = 'in_progress' WHERE id = ? AND status = 'queued'",
            (response_id,),
        )

    def _sweep(self) -> None:
        now = time.time()
        with self._lock:
            if now - self._swept < _SWEEP_EVERY_S:
                return
            self._swept = now
        self.db.write(
            "DELETE FROM responses WHERE created_at < ? AND status NOT IN (?, ?)",
            (int(now - self.retention_s), *_UNFINISHED),
        )
        self.db.write(
            "DELETE FROM responses WHERE created_at < ?",
            (int(now - self.retention_s - _UNFINISHED_GRACE_S),),
        )
